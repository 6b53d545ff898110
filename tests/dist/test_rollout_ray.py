"""GRPO and SCoRe on 2 CPU ranks with rollouts on Ray actors equal the same runs with local rollouts.

Each rank's actor holds a copy of the policy, gets the changed weights after every
optimizer step and samples with the rank's seed, so completions, rewards and hence
losses must match the local backend step for step.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.dist import harness

RECIPE = harness.ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"
QUICK = ["--task.warm_start_steps=10", "--task.n_train=32", "--task.n_eval=2", "--task.num_generations=4",
         "--task.eval_k=0", "--task.max_new_tokens=10", "--task.sandbox_workers=1", "--train.micro_batch=4",
         "--train.log_every=1", "--train.eval_every=0", "--output.progress=false", "--output.tensorboard=false",
         "--checkpoint.every=0", "--train.steps=3"]


SCORE = harness.ROOT / "models" / "policy" / "recipes" / "score_debug.json"
SCORE_QUICK = ["--task.warm_start_steps=10", "--task.n_train=32", "--task.n_eval=2", "--task.stage_one_steps=1",
               "--task.guidance_every=2", "--train.log_every=1", "--train.eval_every=0", "--output.progress=false",
               "--output.tensorboard=false", "--checkpoint.every=0", "--train.steps=3"]


def run(out, *extra, recipe=RECIPE, quick=QUICK):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(recipe), *quick,
           f"--output.dir={out}", *extra]
    proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # (suite time, 51 s: tests/unit/test_rollout.py runs a real Ray actor against the local rollout)
def test_ray_rollouts_train_like_local_ones(tmp_path):
    pytest.importorskip("ray")
    local_records = run(tmp_path / "local")
    ray_records = run(tmp_path / "ray", "--rollout.backend=ray", "--rollout.num_cpus=2")
    local = {r["step"]: r for r in local_records if "train/loss" in r}
    ray = {r["step"]: r for r in ray_records if "train/loss" in r}
    assert sorted(local) == sorted(ray) == [1, 2, 3]
    for step in local:
        for key in ("train/reward_mean", "train/completion_length", "train/loss"):
            assert ray[step][key] == pytest.approx(local[step][key], rel=1e-6, abs=1e-7), (step, key)
    # every step pushed the weights (timed); the local backend has nothing to push
    synced = {r["step"] for r in ray_records if r.get("time/weight_sync", 0) > 0}
    assert synced == {1, 2, 3}
    assert not any("time/weight_sync" in r for r in local_records)


@pytest.mark.slow  # (suite time)
def test_ray_rollouts_give_score_the_same_episodes(tmp_path):
    """SCoRe's two policy turns (and their rewards) on the actors; the guidance model stays in the ranks."""
    pytest.importorskip("ray")
    local = {r["step"]: r for r in run(tmp_path / "local", recipe=SCORE, quick=SCORE_QUICK) if "train/loss" in r}
    ray = {r["step"]: r for r in run(tmp_path / "ray", "--rollout.backend=ray", "--rollout.num_cpus=2",
                                     recipe=SCORE, quick=SCORE_QUICK) if "train/loss" in r}
    assert sorted(local) == sorted(ray) == [1, 2, 3]
    for step in local:
        for key in ("train/accuracy@t1", "train/accuracy@t2", "train/loss"):
            assert ray[step][key] == pytest.approx(local[step][key], rel=1e-6, abs=1e-7), (step, key)


@pytest.mark.slow
def test_ray_rollouts_under_zero3_push_gathered_weights(tmp_path):
    """ZeRO-3: the push gathers the partitioned policy once; decay moves the weights every step."""
    pytest.importorskip("ray")
    extra = ("--deepspeed.profile=zero3", "--train.weight_decay=0.5", "--train.lr=0.01")
    local = {r["step"]: r for r in run(tmp_path / "local", *extra) if "train/loss" in r}
    records = run(tmp_path / "ray", *extra, "--rollout.backend=ray", "--rollout.num_cpus=2")
    ray = {r["step"]: r for r in records if "train/loss" in r}
    for step in local:
        for key in ("train/completion_length", "train/loss"):
            assert ray[step][key] == pytest.approx(local[step][key], rel=1e-6, abs=1e-7), (step, key)
    pushed = [r["train/weight_sync_mb"] for r in records if "train/weight_sync_mb" in r]
    assert len(pushed) == 3 and all(mb > 0.1 for mb in pushed)  # whole tensors, not empty shards
