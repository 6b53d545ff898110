"""The README's main job, shortened: what it leaves behind, and a graceful stop on SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dstrain.config import load_run_config
from dstrain.data.sampler import WindowSampler, get_batch

from dstrain import checkpoint as ckpt
from tests.dist import harness
from tests.reference import build_model, token_streams

TAGS = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/flops_per_s",
        "train/memory_gb", "val/loss"}


def test_main_job_leaves_events_checkpoints_and_resolved_configs(tmp_path):
    out = tmp_path / "run"
    args = [f"--output.dir={out}", "--train.steps=20", "--train.log_every=5", "--checkpoint.every=10",
            "--data.max_bytes=1000000"]
    proc = harness.launch(args)
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
    # DeepSpeed's CPU shared-memory allreduce buffers (~69 MB of RAM each) are removed at the end.
    import re
    port = re.search(r"--master_port (\d+)", proc.stdout + proc.stderr).group(1)
    left = [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in f]
    assert left == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 20 and summary["val_loss"] < 5.0

    # Export the ZeRO-0 checkpoint (fp32 masters even when the run trained in bf16) and
    # reproduce the run's validation loss with the plain model.
    from dstrain.cli import main
    assert main(["export", str(out), str(tmp_path / "w.safetensors")]) == 0
    state = load_file(str(tmp_path / "w.safetensors"))
    assert all(t.dtype == torch.float32 for t in state.values())
    cfg = load_run_config(harness.RECIPE, args)
    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
    _, val = token_streams(cfg)
    sampler = WindowSampler(len(val), cfg.data.seq_len, cfg.data.seed)
    with torch.no_grad():
        losses = [model(*get_batch(val, sampler.local_batch_indices(b, cfg.train.micro_batch, 1, r, 2)[0],
                                   cfg.data.seq_len)).item()
                  for b in range(cfg.train.eval_batches) for r in range(2)]
    tolerance = 2e-2 if summary["precision"] == "bf16" else 1e-5  # bf16 forward vs fp32 forward
    assert sum(losses) / len(losses) == pytest.approx(summary["val_loss"], rel=tolerance)


def _rank_pid(launcher_pid: int, rank: int, deadline: float) -> int:
    """The pid of rank ``rank`` among the launcher's descendants (its RANK variable)."""
    import psutil
    while time.time() < deadline:
        for child in psutil.Process(launcher_pid).children(recursive=True):
            try:
                if "dstrain.cli" in child.cmdline() and child.environ().get("RANK") == str(rank):
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} not found")


def test_sigterm_to_one_rank_saves_exits_143_unrestarted_and_resume_warns_of_the_batch(tmp_path):
    """SIGTERM to one rank (a scheduler's preemption, ``kill``), not to the launcher: every rank saves, the job
    exits 128 + 15 (not 0: it did not finish), ``--max-restarts`` leaves it stopped, and ``--resume`` continues;
    resumed with another global batch, it says what that changes."""
    out = tmp_path / "run"
    args = harness.overrides(out, 400, "--checkpoint.every=0", "--train.warmup_steps=2")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "launch.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", "--max-restarts", "1",
                                 str(harness.RECIPE), *args], cwd=harness.ROOT, env=env, stdout=sink, stderr=sink)
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.5)
        os.kill(_rank_pid(proc.pid, 1, deadline), signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    text = log.read_text()
    tag = ckpt.find_latest(out / "checkpoints")
    assert tag is not None, "no checkpoint written on SIGTERM"
    stopped_at = ckpt.step_of(tag)
    assert 3 <= stopped_at < 400
    assert (f"dstrain: stopped at step {stopped_at} of 400 by SIGTERM (exit 143, not a finished run): checkpoint "
            f"{out / 'checkpoints' / tag} is saved; --resume continues from it") in text, text[-3000:]
    assert "restart" not in text and "Traceback" not in text, text[-3000:]
    proc = harness.launch([*harness.overrides(out, stopped_at + 3, "--checkpoint.every=0", "--train.warmup_steps=2",
                                              "--train.grad_accum=1"), "--resume"])
    assert (f"dstrain: warning: resuming {out / 'checkpoints' / tag} with a global batch of 4 samples per step "
            "where it was trained with 8") in proc.stderr, proc.stderr[-3000:]
    steps = harness.metrics(out)
    assert max(steps) == stopped_at + 3


CHECKS = ("sync", "deferred")


def _ctrl_c_job(out, log, check) -> subprocess.Popen:
    deferred = ["--deepspeed.profile=zero0", "--train.optimizer=torch_fused", "--train.nonfinite_check=deferred"]
    args = harness.overrides(out, 5000, "--checkpoint.every=0", "--train.log_every=1000", "--output.progress=true",
                             *(deferred if check == "deferred" else []))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as sink:
        return subprocess.Popen([sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2",
                                 str(harness.RECIPE), *args], cwd=harness.ROOT, env=env, stdout=sink, stderr=sink)


@pytest.fixture(scope="module")
def ctrl_c_jobs(tmp_path_factory):
    """``check -> (run folder, log text, exit status, ranks of the run left when dstrain launch returned)``: one
    job per non-finite check, launched side by side (independent: on 2 cores their start-ups overlap), each sent
    SIGINT a few steps into training (3 s after its progress bar shows) and read the moment its launcher returns."""
    jobs = {}
    try:
        for check in CHECKS:
            folder = tmp_path_factory.mktemp(f"ctrl_c_{check}")
            jobs[check] = folder / "run", folder / "launch.log", _ctrl_c_job(folder / "run", folder / "launch.log",
                                                                              check)
        deadline, training, sent, done = time.time() + 240, {}, set(), {}
        while len(done) < len(jobs) and time.time() < deadline + 120:
            for check, (out, log, proc) in jobs.items():
                if check not in training and ("train:" in log.read_text() or time.time() > deadline):
                    training[check] = time.time()
                if check in training and check not in sent and time.time() > training[check] + 3:  # a few steps in
                    proc.send_signal(signal.SIGINT)
                    sent.add(check)
                if check in sent and check not in done and proc.poll() is not None:
                    ranks = subprocess.run(["pgrep", "-f", f"--output.dir={out}"], capture_output=True, text=True)
                    done[check] = out, log.read_text(), proc.returncode, ranks.stdout
            time.sleep(0.1)
        assert len(done) == len(jobs), f"not stopped in time: {sorted(set(jobs) - set(done))}"
        return done
    finally:
        for _, _, proc in jobs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("check", CHECKS)
def test_ctrl_c_stops_at_the_next_step_saves_and_waits_for_its_ranks(ctrl_c_jobs, check):
    """Ctrl-C (SIGINT) to ``dstrain launch`` with the next log step far away: the ranks agree on the stop
    at the next optimizer step (the non-finite guard's per-step all-reduce carries it; under the deferred check
    its verdict, all-reduced on the device, one step later), save, and leave; the launcher returns 130 only once
    no process of the job is left, with no traceback."""
    out, text, code, ranks = ctrl_c_jobs[check]
    assert code == 128 + signal.SIGINT, text[-3000:]
    tag = ckpt.find_latest(out / "checkpoints")
    assert tag is not None and 1 <= ckpt.step_of(tag) < 1000, text[-3000:]  # not held back to the log step
    assert json.loads((out / "summary.json").read_text())["nonfinite_check"] == check
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert (f"by SIGINT to dstrain launch (exit 130, not a finished run): checkpoint {out / 'checkpoints' / tag} is "
            "saved") in text, text[-3000:]  # launch's own status, not the ranks' 143 for the SIGTERM it passed on
    assert ranks.strip() == "", ranks  # the launcher returned after its ranks were gone
