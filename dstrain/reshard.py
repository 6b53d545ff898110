"""Resume a checkpoint on a different number of data-parallel ranks (N -> M), optimizer state included.

Which path each ZeRO stage takes (DeepSpeed 0.19.8, verified on CPU with gloo):

* stage 0: nothing is partitioned. The model states file holds the whole module and
  the whole optimizer state (the fp32 masters too under 16-bit training), so
  DeepSpeed's ordinary ``load_checkpoint`` reads it on any number of ranks.
* stages 1, 2 and 3: the optimizer state is split into one file per saved rank.
  The checkpoint is converted once to DeepSpeed's *universal* format
  (``deepspeed.checkpoint.ds_to_universal``: one folder per parameter holding its
  full fp32 master weight, ``exp_avg``, ``exp_avg_sq`` and step) and the new engine
  loads it with ``load_universal`` set, which cuts every tensor into the new
  partitions. Stages 1 and 2 need ``--inject_missing_state`` because a plain
  ``nn.Module`` (no Megatron-style ``universal_checkpoint_info``) has nothing to say
  about tensor-parallel slicing; dstrain's own tensor parallelism is refused below.

Two flaws of DeepSpeed's ZeRO-3 universal loader are corrected after loading: it gives
every parameter group group 0's hyperparameters (the no-decay group would get weight
decay), and one shared ``step`` tensor that a foreach AdamW would advance once per group.

The conversion is cached beside the checkpoint, in ``<tag>/universal/<tag>``, made in
a temporary folder and renamed into place, so a kill during it leaves no half cache;
it goes when the checkpoint itself is pruned. The learning-rate schedule, DeepSpeed's
step counters and the client state come from the model states file as usual.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

UNIVERSAL = "universal"
DONE = "CONVERTED"


class ReshardError(RuntimeError):
    """A checkpoint that cannot be resumed on this layout."""


def saved_layout(saved_run_config: dict, tag_dir: str | Path | None = None) -> dict:
    """The tp, sp and pp degrees a checkpoint was written with. ``parallel.pp = "auto"`` in its run config
    is read from its files (``layer_XX`` files: one ``mp_rank_SS`` model-states file per stage)."""
    par = (saved_run_config.get("parallel") if isinstance(saved_run_config, dict) else None) or {}
    out = {k: par.get(k, 1) for k in ("tp", "sp", "pp")}
    if not isinstance(out["pp"], int) and tag_dir is not None:
        tag_dir = Path(tag_dir)
        layers = any(tag_dir.glob("layer_*-model_states.pt"))
        out["pp"] = len(list(tag_dir.glob("mp_rank_*_model_states.pt"))) if layers else 1
    return out


def check_layout(saved_run_config: dict, current: dict, tag: str, tag_dir: str | Path | None = None) -> None:
    """Only the data-parallel degree may change; tensor, sequence and pipeline degrees must match."""
    keys = ("tp", "sp", "pp")
    old = saved_layout(saved_run_config, tag_dir)
    new = {k: current.get(k, 1) for k in keys}
    if old != new:
        show = lambda d: " ".join(f"{k}={d[k]}" for k in keys)  # noqa: E731
        raise ReshardError(f"checkpoint {tag} was written with {show(old)}, this run has {show(new)}; "
                           "only the data-parallel size may change on resume")


def zero_stage(ckpt_root: Path, tag: str) -> int:
    ds = json.loads((Path(ckpt_root) / tag / "ds_config.json").read_text())
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def universal_root(ckpt_root: Path, tag: str) -> Path:
    """The folder DeepSpeed loads from (``load_dir``); the tag inside it is ``tag``."""
    return Path(ckpt_root) / tag / UNIVERSAL


def convert(ckpt_root: Path, tag: str, log=print) -> Path:
    """Convert ``tag`` to the universal format once (rank 0 only); return the load_dir.

    A finished conversion (its ``CONVERTED`` marker present) is reused.
    """
    dest = universal_root(ckpt_root, tag)
    if (dest / DONE).is_file():
        log(f"reshard: reusing the universal conversion of {tag} in {dest}")
        return dest
    tmp = dest.with_name(f"{UNIVERSAL}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(dest, ignore_errors=True)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(Path(ckpt_root) / tag), "--output_folder", str(tmp / tag),
           "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["(no output)"]
        raise ReshardError(f"converting checkpoint {tag} to DeepSpeed's universal format failed: {tail[0]}")
    (tmp / DONE).write_text(json.dumps({"tag": tag}) + "\n")
    os.replace(tmp, dest)
    log(f"reshard: converted {tag} to the universal format in {time.perf_counter() - start:.1f}s ({dest})")
    return dest


def load_resharded(engine, ckpt_root: Path, tag: str, saved_world: int, world, log=print) -> dict:
    """Load ``tag`` (written by ``saved_world`` ranks) into ``engine`` on ``world.world_size`` ranks.

    Every rank calls this. Rank 0 converts (stages 1-3) while the others wait.
    Returns DeepSpeed's client state.
    """
    from dstrain import runtime

    stage = zero_stage(ckpt_root, tag)
    say = log if world.is_main else (lambda _msg: None)
    say(f"reshard: checkpoint {tag} was written by {saved_world} ranks, this run has {world.world_size}: "
        + ("ZeRO-0 state is whole, loading it directly" if stage == 0
           else f"loading ZeRO-{stage} state through DeepSpeed's universal checkpoint"))
    if stage == 0:
        return engine.load(str(ckpt_root), tag)
    error = None
    if world.is_main:
        try:
            convert(ckpt_root, tag, log=say)
        except ReshardError as err:
            error = str(err)
    error = runtime.broadcast_object(error)
    if error:
        raise ReshardError(error)
    from dstrain.engine import resume_settings
    from dstrain.resilience import base_optimizer

    ds = engine.ds
    # ZeRO-3's universal loader copies group 0's settings into every group, which would give the no-decay
    # group (norms, embeddings) weight decay; each group gets this run's own back (resume_settings).
    engine.settings_changed = []
    ds._config.load_universal_checkpoint = True
    try:
        with resume_settings.kept(ds, engine.settings_changed):
            path, client_state = ds.load_checkpoint(str(universal_root(ckpt_root, tag)), tag=tag)
    finally:
        ds._config.load_universal_checkpoint = False
    if path is None:
        raise ReshardError(f"DeepSpeed could not load the universal conversion of {tag}")
    base = base_optimizer(ds)
    # It also hands every group the same ``step`` tensor; a foreach AdamW then increments that one
    # tensor once per group, so bias correction would run ahead. Each state gets its own copy.
    for state in base.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    return client_state or {}
