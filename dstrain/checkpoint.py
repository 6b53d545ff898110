"""Checkpoints: where they live, when one counts as complete, resume and export.

Layout of ``<output>/checkpoints``::

    step_00000100/            DeepSpeed's files for that step (any ZeRO stage)
        COMPLETE              written last, after every rank finished writing
        run_config.json       the resolved run config
        ds_config.json        the resolved DeepSpeed JSON
        trainer_state.json    step and counters
        rng/rank_<r>.pt       every rank's random state
        written/rank_<r>      asynchronous saves: rank r's files are on disk
        universal/            DeepSpeed's universal conversion, made when resumed on another world size
    latest                    tag of the newest complete checkpoint (atomic rename)

A checkpoint without ``COMPLETE`` (the process died while writing it) is never
taken as the latest: :func:`find_latest` skips it even if ``latest`` names it.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

COMPLETE = "COMPLETE"
LATEST = "latest"
_TAG = re.compile(r"^step_(\d+)$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    match = _TAG.match(tag)
    if not match:
        raise ValueError(f"not a dstrain checkpoint tag: {tag!r}")
    return int(match.group(1))


def is_complete(tag_dir: Path) -> bool:
    return (Path(tag_dir) / COMPLETE).is_file()


def complete_tags(root: str | Path) -> list[str]:
    """Complete checkpoint tags under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    tags = [p.name for p in root.iterdir() if p.is_dir() and _TAG.match(p.name) and is_complete(p)]
    return sorted(tags, key=step_of)


def find_latest(root: str | Path) -> str | None:
    """The newest complete checkpoint tag, or None.

    Only ``COMPLETE`` markers count; the ``latest`` file is written for
    DeepSpeed's own tools (``zero_to_fp32.py``) and is not trusted here.
    """
    tags = complete_tags(root)
    return tags[-1] if tags else None


_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim_states|model_states)\.pt$")


def files_problem(tag_dir: str | Path, world_size: int | None = None, zero_shards: int | None = None) -> str | None:
    """What is missing or cut short among a checkpoint's files, without loading them; None when nothing is.

    Every ``.pt`` file in torch's zip format must have its central directory, which a file cut short lacks (one in
    torch's legacy format, a plain pickle, is not checked);
    DeepSpeed's ZeRO shards must number 0..n-1 with one n for every kind; ``rng/`` must hold every rank's
    state when ``world_size`` (the checkpoint's) is given (a resume would otherwise reseed that rank), and each
    kind of shard ``zero_shards`` files when given (ZeRO partitions over every rank without tp or pp)."""
    import zipfile
    tag_dir = Path(tag_dir)
    shards: dict[tuple[str, str], set[int]] = {}
    for path in sorted(tag_dir.rglob("*.pt")):
        if "universal" in path.relative_to(tag_dir).parts:
            continue  # a conversion cache, rebuilt when needed
        try:
            with open(path, "rb") as fh:
                legacy = fh.read(1) == b"\x80"  # torch's non-zip format (checkpoint_serialization false): a pickle
            if not legacy:
                zipfile.ZipFile(path).close()
        except (OSError, zipfile.BadZipFile) as err:
            return f"{path.relative_to(tag_dir)} is unreadable or cut short ({err})"
        match = _SHARD.match(path.name)
        if match:
            shards.setdefault((match.group(2), match.group(3)), set()).add(int(match.group(1)))
    counts = {len(ranks) for ranks in shards.values()} | {max(ranks) + 1 for ranks in shards.values()}
    counts |= {zero_shards} if shards and zero_shards else set()
    if len(counts) > 1:
        full = max(counts)
        missing = sorted(f"zero_pp_rank_{r}_mp_rank_{mp}_{kind}.pt" for (mp, kind), ranks in shards.items()
                         for r in range(full) if r not in ranks)
        return f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} missing"
    if world_size:
        missing = [f"rng/rank_{r}.pt" for r in range(world_size) if not (tag_dir / "rng" / f"rank_{r}.pt").is_file()]
        if missing:
            return f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} missing"
    return _kind_missing(tag_dir)


def _kind_missing(tag_dir: Path) -> str | None:
    """A whole kind of DeepSpeed file gone from a checkpoint that holds some (the optimizer states deleted to
    save space, the model states lost in a copy): the shard count check above cannot see a kind with no file
    left. Checkpoints without any DeepSpeed file are left to the loader."""
    top = {path.name for path in tag_dir.glob("*.pt")}
    if not top:
        return None
    kinds = {match.group(3) for match in map(_SHARD.match, top) if match}
    try:
        zero = json.loads((tag_dir / "ds_config.json").read_text()).get("zero_optimization") or {}
        stage = int(zero.get("stage", 0) or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # unreadable: the stage is not known here
    pipeline = any(name.startswith("layer_") for name in top)
    if stage == 3 and not pipeline:
        has_model = "model_states" in kinds
        model_file = "zero_pp_rank_*_mp_rank_00_model_states.pt"
    else:
        has_model = any(re.match(r"^mp_rank_\d+_model_states\.pt$", name) for name in top)
        model_file = "mp_rank_00_model_states.pt"
    if not has_model:
        return f"{model_file} (the model's weights) missing"
    if stage >= 1 and "optim_states" not in kinds:
        return f"zero_pp_rank_*_mp_rank_00_optim_states.pt (the ZeRO-{stage} optimizer state) missing"
    return None


_NO_FSYNC = (errno.EINVAL, errno.ENOTSUP, errno.EBADF)
"""fsync's answers where a file system does not sync (not a failed write: ENOSPC, EIO are raised)."""


def _fsync(fd: int) -> None:
    """``os.fsync``, where the file system has one (some FUSE mounts answer EINVAL: nothing to make durable there)."""
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _NO_FSYNC:
            raise


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            _fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # a failed write (a full disk) leaves no stray file beside ``path``
            tmp.unlink(missing_ok=True)


def _sync_dir(path: Path) -> None:
    """Make the names in folder ``path`` durable (a file system that cannot sync a folder is left as it is)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def sync_tree(tag_dir: Path) -> None:
    """Every file under ``tag_dir`` on disk, and its folders' entries, before ``COMPLETE`` is written.

    DeepSpeed's ``torch.save`` leaves its files in the page cache; only ``COMPLETE`` was synced. After a crash of
    the machine (power, kernel, a node the scheduler reboots) the marker could be on disk while the shards written
    before it were empty or cut short: a "complete" checkpoint that cannot be loaded, taken as the latest. A
    write error the file system reports only now (NFS: a full disk at flush) is raised here, before the marker."""
    for path in sorted(Path(tag_dir).rglob("*")):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                _fsync(fd)
            finally:
                os.close(fd)
    for folder in sorted((p for p in Path(tag_dir).rglob("*") if p.is_dir()), reverse=True):
        _sync_dir(folder)
    _sync_dir(Path(tag_dir))


def prepare_tag_dir(root: str | Path, tag: str) -> None:
    """Remove a leftover incomplete folder of the same tag (rank 0, before saving)."""
    path = Path(root) / tag
    if path.exists() and not is_complete(path):
        shutil.rmtree(path)


def mark_complete(root: str | Path, tag: str, run_config: dict, ds_config: dict,
                  trainer_state: dict, keep: int, param_groups: list[list[str]] | None = None) -> None:
    """Rank 0, after every rank has saved: write metadata, the marker, then ``latest``.

    ``param_groups`` (parameter names per optimizer group, in order) lets export
    unflatten the fp32 master weights that DeepSpeed keeps for 16-bit ZeRO-0.
    """
    root = Path(root)
    tag_dir = root / tag
    if param_groups is not None:
        (tag_dir / "param_groups.json").write_text(json.dumps(param_groups) + "\n")
    (tag_dir / "run_config.json").write_text(json.dumps(run_config, indent=2) + "\n")
    (tag_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    (tag_dir / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
    sync_tree(tag_dir)
    _atomic_write(tag_dir / COMPLETE, json.dumps({"step": trainer_state.get("step")}) + "\n")
    _sync_dir(tag_dir)
    try:
        _atomic_write(root / LATEST, tag + "\n")
        _sync_dir(root)
    except OSError as err:  # a full disk just after the marker: the checkpoint is complete (find_latest reads
        try:  # markers), and ``latest``, for DeepSpeed's tools, must not name a tag removed below
            (root / LATEST).unlink(missing_ok=True)
        except OSError:
            pass
        import sys  # said, not swallowed: an I/O error here is the disk's, and DeepSpeed's tools lose ``latest``
        print(f"dstrain: warning: {root / LATEST} could not be written ({err.strerror or err}); checkpoint {tag} is "
              f"complete (dstrain resumes from COMPLETE markers) and {LATEST} is removed: name the tag to DeepSpeed's "
              "zero_to_fp32.py", file=sys.stderr, flush=True)
    for old in complete_tags(root)[:-keep]:
        (root / old / COMPLETE).unlink(missing_ok=True)  # a kill during the removal leaves no half "complete" tag
        shutil.rmtree(root / old, ignore_errors=True)
    _prune_cut_short(root, keep)


def _prune_cut_short(root: Path, keep: int) -> None:
    """Remove the incomplete tag folders older than the oldest checkpoint kept: saves cut short (a SIGKILL, an
    OOM kill or a lost node while writing, a stop's save killed by the scheduler's follow-up SIGKILL). The
    resumed run removes such a folder only if it saves that very step again, which it does not when its save
    points moved (another ``checkpoint.every``, a stop's save at an odd step): before, each stayed for good, a
    full set of shards that ``checkpoint.keep`` never counted. One older than every kept checkpoint is what
    ``keep`` would have removed had it been complete; newer ones stay (one whose COMPLETE the user removed)."""
    kept = complete_tags(root)[-keep:] if keep > 0 else []
    if not kept:
        return
    floor = step_of(kept[0])
    for path in root.iterdir():
        if path.is_dir() and _TAG.match(path.name) and step_of(path.name) < floor and not is_complete(path):
            shutil.rmtree(path, ignore_errors=True)


def rng_state() -> dict:
    """This rank's generators. CUDA: only this rank's device (each rank sees every GPU of the launch,
    and a run resumed on fewer GPUs could not restore the states of devices it no longer sees); none for
    CPU ranks on a machine with a GPU (reading it would open a CUDA context on GPU 0 in every rank)."""
    from dstrain.runtime import ranks_use_cuda
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if ranks_use_cuda():
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    from dstrain.runtime import ranks_use_cuda
    if not ranks_use_cuda():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif "cuda" in state:  # older checkpoints: every visible device's state; take this rank's device's
        device = torch.cuda.current_device()
        if device < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][device])


def save_rng(root: str | Path, tag: str, rank: int) -> None:
    path = Path(root) / tag / "rng"
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / f"rank_{rank}.pt")


def load_rng(root: str | Path, tag: str, rank: int) -> None:
    path = Path(root) / tag / "rng" / f"rank_{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no random state for rank {rank}; was the world size different?")
    set_rng_state(torch.load(path, weights_only=False))


# ---------------------------------------------------------------- export

def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """Accept an output folder, a checkpoints folder or one tag folder -> (root, tag)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint or folder")
    if _TAG.match(path.name) and path.is_dir():
        if not is_complete(path):
            raise ValueError(f"{path}: checkpoint is incomplete (no {COMPLETE} marker)")
        return path.parent, path.name
    for root in (path, path / "checkpoints"):
        tag = find_latest(root)
        if tag:
            return root, tag
    raise FileNotFoundError(f"{path}: no complete checkpoint found")


def consolidated_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """fp32 weights of a checkpoint of any ZeRO stage, plus its run config."""
    root, tag = resolve_checkpoint(path)
    tag_dir = root / tag
    damage, found = files_problem(tag_dir), {}  # a shard cut short or emptied, a JSON garbled: named, not a traceback
    for name in ("ds_config.json", "run_config.json"):
        try:
            found[name] = json.loads((tag_dir / name).read_text())
        except (OSError, ValueError) as err:
            damage = damage or f"{name}: {type(err).__name__}: {err}"
        if not damage and not isinstance(found[name], dict):
            damage = f"{name} is not a JSON object"
    ds_cfg, run_cfg = found.get("ds_config.json"), found.get("run_config.json")
    if damage:
        before = [t for t in complete_tags(root) if step_of(t) < step_of(tag)] if _TAG.match(tag) else []
        other = f"export the one before ({root / before[-1]}) or " if before else ""
        raise ValueError(f"checkpoint {tag_dir} is damaged ({damage}); {other}export from a copy of the run "
                         "that is whole")
    stage = int(ds_cfg.get("zero_optimization", {}).get("stage", 0))
    if any(tag_dir.glob("layer_*-model_states.pt")):  # DeepSpeed's pipeline engine saved it
        state = pipeline_checkpoint_state_dict(tag_dir, run_cfg)
    elif stage == 0:
        state = _zero0_state_dict(tag_dir)
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        state = get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)
    state = {k: v.detach().float().contiguous().clone() for k, v in state.items()}
    return state, run_cfg


def pipeline_checkpoint_state_dict(tag_dir: Path, run_cfg: dict) -> dict[str, torch.Tensor]:
    """The plain model's weights from a pipeline checkpoint (``layer_XX-model_states.pt`` per layer).

    Layer i's parameters get the plain model's names through the model's pipeline
    layers (``PipelineParts.prefixes``). These are the weights the stages hold: the
    fp32 weights of an fp32 run; a 16-bit run exports its 16-bit weights (upcast),
    not the fp32 optimizer masters.
    """
    from dstrain.parallel.pipeline import plain_state_dict
    from models import registry
    model = run_cfg["model"]
    spec = registry.get_spec(model["name"])
    if spec.pipeline is None:
        raise ValueError(f"{tag_dir}: model {model['name']!r} has no pipeline layers to map the checkpoint back")
    parts = spec.pipeline(registry.make_model_config(model["name"], model["size"], model.get("args") or {}), False)
    return plain_state_dict(tag_dir, parts.prefixes)


def _zero0_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Weights of a ZeRO-0 checkpoint: the module's, or the fp32 masters of 16-bit training."""
    files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise FileNotFoundError(f"{tag_dir}: no model states file")
    saved = torch.load(files[0], map_location="cpu", weights_only=False)
    module = saved["module"]
    optim = saved.get("optimizer") or {}
    flats = optim.get("fp32_groups_flat") if isinstance(optim, dict) else None
    if not flats:
        return module  # fp32 training: the module's weights are the master weights
    layout = tag_dir / "param_groups.json"
    if not layout.is_file():
        raise FileNotFoundError(f"{layout}: needed to unflatten the fp32 master weights of a 16-bit "
                                "ZeRO-0 checkpoint")
    state = dict(module)
    for names, flat in zip(json.loads(layout.read_text()), flats):
        offset = 0
        for name in names:
            low = module[name]
            master = flat[offset:offset + low.numel()].view(low.shape)
            offset += low.numel()
            if not torch.equal(master.to(low.dtype), low):
                raise ValueError(f"{tag_dir}: fp32 master of {name} does not match the module's weights; "
                                 "parameter group layout differs from param_groups.json")
            state[name] = master
    return state


def export_safetensors(ckpt: str | Path, out: str | Path) -> Path:
    """Write consolidated fp32 weights to ``out`` (a .safetensors file, or a folder)."""
    from safetensors.torch import save_file

    state, run_cfg = consolidated_state_dict(ckpt)
    out = Path(out)
    if out.suffix != ".safetensors":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "model.safetensors"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "dstrain_model": json.dumps(run_cfg["model"]),
            "dstrain_run_config": json.dumps(run_cfg)}
    # Written beside it and renamed into place: an export stopped halfway (Ctrl-C, a full disk) leaves an
    # earlier file of that name whole, never a truncated one that loads as garbage or not at all.
    partial = out.with_name(f".{out.name}.partial")
    try:
        save_file(state, str(partial), metadata=meta)
        # safetensors creates its file 0600; an export is for others to load: the mode any new file gets here
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(partial, 0o666 & ~mask)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out
