"""GRPO with DAPO's dynamic sampling on 2 CPU ranks: every trained batch is free of
zero-variance groups, the rounds and the dropped fraction are logged, and the step's
time split reaches metrics.jsonl, TensorBoard and the end-of-run print."""
import json
import os
import subprocess
import sys

from tests.dist import harness

RECIPE = harness.ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"
QUICK = ["--task.warm_start_steps=20", "--task.n_train=64", "--task.n_eval=4", "--task.num_generations=4",
         "--task.eval_k=0", "--task.max_new_tokens=12", "--train.micro_batch=4", "--train.grad_accum=2",
         "--train.log_every=1", "--train.eval_every=0", "--output.progress=false", "--checkpoint.every=0",
         "--task.dynamic_sampling=true", "--task.dynamic_sampling_max_rounds=3", "--task.overlong_buffer=4",
         "--task.overlong_filter=true", "--task.loss_type=dapo"]


def test_two_rank_dynamic_sampling(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(RECIPE), *QUICK,
           "--train.steps=3", f"--output.dir={out}"]
    proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    by_step: dict[int, dict] = {}  # one line per section (train/, dynamic/, time/) and step
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step.setdefault(record["step"], {}).update(record)
    train = [r for _, r in sorted(by_step.items()) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["train/trained_zero_variance_groups"] == 0.0
        assert 1 <= r["dynamic/rounds"] <= 3 and 0 <= r["dynamic/dropped_fraction"] <= 1
        assert 0 < r["dynamic/filled_fraction"] <= 1 or r["dynamic/rounds"] == 3
        assert "train/overlong_filtered" in r
        for part in ("generation", "reward", "training", "step"):
            assert r[f"time/{part}"] >= 0
    assert "step time split over" in proc.stdout, proc.stdout[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["time_split"]["generation"]["seconds"] > 0
    assert list((out / "tensorboard").iterdir())
