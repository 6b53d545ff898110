"""``train.nonfinite`` beyond the LM trainer, 2 CPU ranks, faults injected on rank 1 (``dstrain.faults``).

HRM, skip: step 3's gradients are NaN behind a finite loss; every rank drops that update, of the
network, of the sparse puzzle-embedding table and of the EMA alike (checkpoint 3 equals checkpoint 2),
and step 4 trains on; the same under the deferred check, which skips on the device. SCoRe, stop: the critic's loss of its second step is NaN; the job exits 3 with
one line naming the critic, and since the policy had already taken step 2's update, no new
checkpoint is written: step 1's stays the latest.
"""
import json
import os
import sys

import pytest
import torch

from dstrain import checkpoint as ckpt
from tests.dist import harness
from tests.dist.test_hrm_train import QUICK as HRM_QUICK
from tests.dist.test_score_train import QUICK as SCORE_QUICK

RECIPES = harness.ROOT / "models"


def _start(recipe, out, steps, quick, fault_env, *extra) -> harness.Background:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "DSTRAIN_FAULT_RANK": "1", **fault_env}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(recipe), *quick,
           f"--train.steps={steps}", f"--output.dir={out}", "--checkpoint.every=1", "--checkpoint.keep=10", *extra]
    return harness.Background(cmd, env)


HRM_SKIPS = {"sync": ("--train.log_every=1",),
             "deferred": ("--train.log_every=2", "--train.nonfinite_check=deferred", "--train.optimizer_type=adam_atan2")}


@pytest.fixture(scope="module")
def hrm_skip_runs(tmp_path_factory):
    """``check -> (out, completed process)``: the two HRM jobs with step 3's gradients NaN on rank 1, under the
    synchronous and the deferred check, launched side by side (independent jobs: on 2 cores their start-ups
    overlap); each test below reads its own."""
    jobs = {}
    try:
        for check, extra in HRM_SKIPS.items():
            out = tmp_path_factory.mktemp(f"hrm_{check}") / "hrm"
            jobs[check] = out, _start(RECIPES / "hrm" / "recipes" / "sudoku_debug.json", out, 4, HRM_QUICK,
                                      {"DSTRAIN_FAULT_NAN_GRAD_STEP": "3"}, "--train.nonfinite=skip", *extra)
        return {check: (out, job.result(timeout=400, check=False)) for check, (out, job) in jobs.items()}
    finally:
        for _, job in jobs.values():
            job.stop()


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _skipped_step_3(out, proc, rank, logged=(1, 2, 3, 4)):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"non-finite gradient at step 3 on rank {rank}: update skipped" in proc.stdout + proc.stderr
    assert harness.metrics(out, "train/skipped_steps") == {s: int(s >= 3) for s in logged}
    root = out / "checkpoints"
    weights = {s: ckpt.consolidated_state_dict(root / ckpt.tag_for(s))[0] for s in (2, 3, 4)}
    table = {s: torch.load(root / ckpt.tag_for(s) / "hrm" / "puzzle_emb.pt", weights_only=True)["weight"]
             for s in (2, 3, 4)}
    ema = {s: torch.load(root / ckpt.tag_for(s) / "hrm" / "ema.pt", weights_only=False)["shadow"] for s in (2, 3)}
    assert _same(weights[2], weights[3]) and torch.equal(table[2], table[3]), "the skipped step changed the state"
    assert _same(ema[2], ema[3])
    assert not _same(weights[3], weights[4]) and not torch.equal(table[3], table[4])
    assert all(torch.isfinite(v).all() for v in weights[4].values())
    return json.loads((out / "summary.json").read_text())


def test_hrm_skips_a_nan_gradient_step_on_every_rank(hrm_skip_runs):
    out, proc = hrm_skip_runs["sync"]
    assert _skipped_step_3(out, proc, 1)["nonfinite_check"] == "sync"


def test_hrm_skips_a_nan_gradient_step_on_the_device_under_the_deferred_check(hrm_skip_runs):
    """``train.nonfinite_check=deferred`` on 2 ranks: the verdict is all-reduced on the device and step 3's
    AdamATan2 update, puzzle-embedding rows and EMA are left out there on both ranks (the hosts learn it at step
    4's boundary, naming rank 1 from its own gradients): the same state as the synchronous check leaves."""
    out, proc = hrm_skip_runs["deferred"]
    assert _skipped_step_3(out, proc, 1, logged=(2, 4))["nonfinite_check"] == "deferred"


def test_score_stops_on_a_nan_critic_loss_and_keeps_the_last_complete_checkpoint(tmp_path):
    out = tmp_path / "score"
    proc = _start(RECIPES / "policy" / "recipes" / "score_debug.json", out, 3, SCORE_QUICK,
                  {"DSTRAIN_FAULT_NAN_STEP": "2", "DSTRAIN_FAULT_MODEL": "critic"}, "--train.nonfinite=stop").result(
        timeout=400, check=False)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dstrain: error:")]
    assert len(lines) == 1 and "non-finite loss at step 2 on rank 1 (critic): stopped" in lines[0], lines
    assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(1)
    assert ckpt.complete_tags(out / "checkpoints") == [ckpt.tag_for(1)]
