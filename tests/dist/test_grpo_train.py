"""GRPO through the launcher on 2 CPU ranks: logs what the issue lists, checkpoints, resumes."""
import json
import os
import subprocess
import sys

from tests.dist import harness

RECIPE = harness.ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"
QUICK = ["--task.warm_start_steps=20", "--task.n_train=64", "--task.n_eval=4", "--task.num_generations=4",
         "--task.eval_k=2", "--task.eval_samples=2", "--task.max_new_tokens=12", "--train.micro_batch=4",
         "--train.log_every=1", "--train.eval_every=0", "--output.progress=false", "--checkpoint.every=2"]
LOGGED = ["reward_mean", "reward_std", "zero_variance_groups", "kl", "clip_fraction", "completion_length",
          "entropy", "gen_tokens_per_s", "train_tokens_per_s", "loss", "lr"]


def launch(out, steps, *extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(RECIPE), *QUICK,
           f"--train.steps={steps}", f"--output.dir={out}", *extra]
    proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def test_two_rank_grpo_logs_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "run"
    launch(out, 3)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for key in LOGGED:
        assert all(f"train/{key}" in r for r in train), key
    assert all(0.0 <= r["train/reward_mean"] <= 1.0 for r in train)
    assert all(r["train/gen_tokens_per_s"] > 0 and r["train/train_tokens_per_s"] > 0 for r in train)
    val = [r for r in records if "val/pass@1" in r]
    assert val and val[-1]["step"] == 3 and "val/pass@2" in val[-1] and val[-1]["val/tasks"] == 4
    assert (out / "warm_start" / "WARM_START_COMPLETE").is_file()
    assert list((out / "tensorboard").iterdir())
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000003"

    proc = launch(out, 5, "--resume")
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    assert "warm start" not in proc.stdout  # the finished warm start is reused
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == [1, 2, 3, 4, 5]
    assert json.loads((out / "summary.json").read_text())["step"] == 5
