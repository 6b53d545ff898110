"""Start-up decisions every trainer shares: resume or not, and keeping the checkpoint's plan."""
from __future__ import annotations

import json
from pathlib import Path

from dstrain import checkpoint as ckpt
from dstrain import runtime
from dstrain.config import RunConfig, RunFolderError


def decide_resume(cfg: RunConfig, world: runtime.World, out: Path, ckpt_root: Path) -> str | None:
    """Rank 0 decides whether to resume and from which tag; every rank gets the answer.

    A folder that already holds a checkpoint is never overwritten by a fresh run
    (RunFolderError); ``--resume`` without a checkpoint starts from step 0.
    """
    decision = None
    if world.is_main:
        latest = ckpt.find_latest(ckpt_root)
        if cfg.checkpoint.resume:
            decision = ("resume", latest)
        elif latest is not None:
            decision = ("error", f"{out} already holds checkpoint {latest}; "
                                 "pass --resume to continue it or choose another output.dir")
        else:
            decision = ("fresh", None)
    kind, value = runtime.broadcast_object(decision)
    if kind == "error":
        raise RunFolderError(value)
    if kind == "resume" and value is None and world.is_main:
        print(f"no complete checkpoint in {ckpt_root}: starting from step 0", flush=True)
    return value if kind == "resume" else None


def pin_plan(cfg: RunConfig, ckpt_root: Path, tag: str) -> None:
    """A resumed run keeps the checkpoint's profile, precision and activation checkpointing.

    The factory's choice depends on measurements (memory, bf16 speed) that may come
    out differently on the second start; DeepSpeed cannot load optimizer states
    saved under another precision or stage. Values the run config names explicitly win.
    """
    state = json.loads((ckpt_root / tag / "trainer_state.json").read_text())
    ds = cfg.deepspeed
    for key in ("profile", "precision", "activation_checkpointing"):
        if key in state and getattr(ds, key) in ("auto", state[key]):
            setattr(ds, key, state[key])
