"""Fixtures shared by the unit tests."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def sandbox_tmp():
    """An empty folder that sandboxed programs can reach: run as root with an interpreter ``nobody``
    may execute, they run as ``nobody``, and pytest's ``tmp_path`` lies under a folder only root enters."""
    path = tempfile.mkdtemp(prefix="dstrain-test-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.chmod(path, 0o711)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")


@pytest.fixture
def one_rank(monkeypatch):
    """Rank 0 of a one-rank world, holding no run-folder lock and no torchrun agents from another test."""
    import torch

    from dstrain import elastic, run_lock
    from dstrain.runtime import World
    monkeypatch.setattr(run_lock, "_HELD", [])  # this test's folders, not another test's lock
    monkeypatch.setattr(elastic, "_AGENTS", [])
    return World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def tiny_checkpoint(out: Path, step: int, **state) -> Path:
    """A complete checkpoint folder of the tiny GPT recipe under ``out`` (configs and trainer state, no weights)."""
    import json

    from dstrain import checkpoint as ckpt
    from dstrain.config import load_run_config
    tag_dir = out / "checkpoints" / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "run_config.json").write_text(json.dumps(load_run_config(RECIPE, [f"--output.dir={out}"]).to_dict()))
    (tag_dir / "trainer_state.json").write_text(json.dumps({"step": step, **state}))
    (tag_dir / ckpt.COMPLETE).write_text("{}\n")
    return tag_dir


@pytest.fixture
def no_lock(monkeypatch):
    """Run-folder locks taken in the test are the test's own (none held from another test, no SLURM job of this
    machine's in the records), let go at its end."""
    from dstrain import run_lock
    monkeypatch.setattr(run_lock, "_HELD", [])
    monkeypatch.setattr(run_lock, "_WARNED", set())
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    yield
    with run_lock._MUTEX:  # (not while a heartbeat thread rechecks it)
        for _, handle in run_lock._HELD:
            handle.close()
