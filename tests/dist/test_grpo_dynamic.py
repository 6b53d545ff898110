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


def test_two_rank_kept_groups_are_used_and_resume_exactly(tmp_path):
    """task.dynamic_sampling_carry on 2 ranks: groups kept by one step are trained in the next, each rank's
    kept groups go into the checkpoint, and a run resumed from step 1 repeats steps 2-4 of the run that
    went straight through (same losses, rewards and kept groups: step 2 trains those step 1 kept)."""
    import shutil
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    carry = [*QUICK, "--checkpoint.every=1", "--checkpoint.keep=5", "--task.dynamic_sampling_carry=true",
             "--task.num_generations=2", "--train.micro_batch=2", "--task.dynamic_sampling_max_rounds=4",
             "--task.dynamic_sampling_oversample=2"]  # a first estimate of 1/3: round 0 samples 3x the share

    def launch(out, *extra):
        cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(RECIPE), *carry,
               "--train.steps=4", f"--output.dir={out}", *extra]
        proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    def by_step(out):
        steps: dict[int, dict] = {}
        for line in (out / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], {}).update(record)  # a resumed step's lines come last
        return steps

    straight = tmp_path / "straight"
    launch(straight)
    for tag in ("step_00000001", "step_00000004"):
        assert sorted(p.name for p in (straight / "checkpoints" / tag).glob("dynamic_reserve_rank*.pt")) == [
            "dynamic_reserve_rank00000.pt", "dynamic_reserve_rank00001.pt"]
    a = by_step(straight)
    assert all(a[s]["train/trained_zero_variance_groups"] == 0.0 for s in (1, 2, 3, 4))
    assert all("dynamic/carried_groups" in a[s] and "dynamic/spare_groups" in a[s] for s in (1, 2, 3, 4))
    assert a[1]["dynamic/spare_groups"] > 0 and a[2]["dynamic/carried_groups"] > 0, \
        {s: {k: v for k, v in r.items() if k.startswith("dynamic/")} for s, r in a.items()}
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    for tag in ("step_00000002", "step_00000003", "step_00000004"):
        shutil.rmtree(resumed / "checkpoints" / tag)
    (resumed / "checkpoints" / "latest").write_text("step_00000001\n")
    launch(resumed, "--resume")
    b = by_step(resumed)
    for s in (2, 3, 4):
        for key in ("train/loss", "train/reward_mean", "dynamic/carried_groups", "dynamic/spare_groups",
                    "dynamic/generated_groups"):
            assert b[s][key] == a[s][key], (s, key, a[s][key], b[s][key])
