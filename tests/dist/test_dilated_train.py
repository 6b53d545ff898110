"""Dilated LM through `dstrain launch` with sequence parallelism equals plain single-process training.

* 4 ranks, dp = 2 x sp = 2: each replica's two ranks hold the two halves of every
  sequence (the 128-token segment spans both, so keys and values are exchanged).
* the shipped debug recipe's layout (2 ranks, sp = 2; with ``-m slow``).

The reference (tests/reference.py) trains the same dense model in one process on the
whole global batch with AdamW, the same schedule and clipping; fp32 throughout.
"""
import json
import os
import subprocess
import sys

import pytest

from dstrain.config import load_run_config
from tests.dist import harness
from tests.reference import plain_training

RECIPE = harness.ROOT / "models" / "dilated_lm" / "recipes" / "debug.json"
STEPS = 4


def _launch(out, nproc, *extra):
    args = [*harness.overrides(out, STEPS), "--checkpoint.every=0", *extra]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(nproc), str(RECIPE), *args]
    proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return load_run_config(RECIPE, args)


# The recipe's own layout (sp = 2 alone) waits for -m slow (suite time): dp2_sp2 runs the same exchange of
# keys and values across the two halves of each sequence, and test_sequence_parallel.py checks the layer on 2 ranks.
@pytest.mark.parametrize("nproc,dp", [(4, 2), pytest.param(2, 1, marks=pytest.mark.slow)], ids=["dp2_sp2", "recipe_sp2"])
def test_sequence_parallel_training_matches_plain(tmp_path, nproc, dp):
    out = tmp_path / "run"
    cfg = _launch(out, nproc, "--parallel.sp=2")
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == cfg.train.micro_batch * cfg.train.grad_accum * dp  # dp counts, not sp
    ref_losses, ref_norms, _ = plain_training(cfg, world_size=dp, norms=True)
    losses = harness.metrics(out)
    got = [losses[s] for s in range(1, STEPS + 1)]
    assert got == pytest.approx(ref_losses, rel=2e-5, abs=2e-5), (got, ref_losses)
    assert ref_losses[-1] < ref_losses[0] - 0.1
    norms = harness.metrics(out, "train/grad_norm")
    assert [norms[s] for s in range(1, STEPS + 1)] == pytest.approx(ref_norms, rel=1e-4)
