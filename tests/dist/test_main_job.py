"""The README's main job, shortened: what it leaves behind, and a graceful stop on SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dstrain import checkpoint as ckpt
from tests.dist import harness

TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/flops_per_s",
        "train/memory_gb", "val/loss"}


def test_main_job_leaves_events_checkpoints_and_resolved_configs(tmp_path):
    out = tmp_path / "run"
    proc = harness.launch([f"--output.dir={out}", "--train.steps=20", "--train.log_every=5",
                           "--checkpoint.every=10", "--data.max_bytes=1000000"])
    assert "train" in proc.stderr  # the rank-0 progress bar
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert TAGS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10, 15, 20]
    assert ckpt.complete_tags(out / "checkpoints") == ["step_00000010", "step_00000020"]
    for tag in ("step_00000010", "step_00000020"):
        resolved = json.loads((out / "checkpoints" / tag / "ds_config.json").read_text())
        assert "auto" not in json.dumps(resolved) and resolved["train_batch_size"] == 16
        assert json.loads((out / "checkpoints" / tag / "run_config.json").read_text())["train"]["steps"] == 20
    assert "choice:" in (out / "plan.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 20 and summary["val_loss"] < 5.0


def test_sigterm_saves_a_checkpoint_and_resume_finishes(tmp_path):
    out = tmp_path / "run"
    args = harness.overrides(out, 400, "--checkpoint.every=0", "--train.warmup_steps=2")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2",
                             str(harness.RECIPE), *args], cwd=harness.ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    tag = ckpt.find_latest(out / "checkpoints")
    assert tag is not None, "no checkpoint written on SIGTERM"
    stopped_at = ckpt.step_of(tag)
    assert 3 <= stopped_at < 400
    harness.launch([*harness.overrides(out, stopped_at + 3, "--checkpoint.every=0",
                                       "--train.warmup_steps=2"), "--resume"])
    steps = harness.metrics(out)
    assert max(steps) == stopped_at + 3
