"""launch/slurm.sbatch's own logic without SLURM: a fake ``srun`` (records its argv, waits, exits 128 + the
signal it gets, as dstrain's ranks do after saving) and a fake ``scontrol`` (records its argv) on PATH.

A requeued job (SLURM_RESTART_COUNT > 0) passes --resume; SIGUSR1 to the script (--signal=B:USR1@120) reaches
srun at once, and a stop on it requeues the job; SIGTERM is passed on the same way, without a requeue."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "slurm.sbatch"

FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun.argv"
if [ -n "${FAKE_SRUN_EXIT:-}" ]; then exit "$FAKE_SRUN_EXIT"; fi
trap 'echo USR1 > "$FAKE_DIR/srun.signal"; exit 138' USR1
trap 'echo TERM > "$FAKE_DIR/srun.signal"; exit 143' TERM
touch "$FAKE_DIR/srun.ready"
while :; do sleep 0.05; done
"""
FAKE_SCONTROL = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/scontrol.argv"
"""


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ("RESUME", "REQUEUE_ON")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_DIR=str(tmp_path), SLURM_JOB_ID="4242",
               PYTHON="python3")
    return tmp_path, env


def start(env, *args, **extra):
    return subprocess.Popen(["bash", str(SCRIPT), "r.json", *args], env={**env, **extra},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def srun_argv(folder: Path) -> list[str]:
    return (folder / "srun.argv").read_text().splitlines()


@pytest.mark.parametrize("extra, args, resumed", [
    ({}, ["--train.lr=3e-4"], False),                                      # a first start
    ({"SLURM_RESTART_COUNT": "0"}, [], False),
    ({"SLURM_RESTART_COUNT": "2"}, ["--train.lr=3e-4"], True),             # requeued: continue the run
    ({"SLURM_RESTART_COUNT": "1"}, ["--resume"], True),                    # given already: passed once
    ({"RESUME": "1"}, [], True),                                           # a new job continuing an earlier run
    ({"RESUME": "0", "SLURM_RESTART_COUNT": "1"}, [], False),
])
def test_resume_on_a_requeued_start(fake, extra, args, resumed):
    folder, env = fake
    proc = start(env, *args, FAKE_SRUN_EXIT="0", **extra)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    argv = srun_argv(folder)
    assert argv[:6] == ["--kill-on-bad-exit=1", "python3", "-m", "dstrain.cli", "train", "r.json"]
    assert argv[6:] == [a for a in args if a != "--resume"] + (["--resume"] if resumed else [])
    assert ("--resume (latest complete checkpoint)" in err) == resumed
    assert not (folder / "scontrol.argv").exists()


def test_bad_resume_value_is_refused(fake):
    folder, env = fake
    proc = start(env, RESUME="yes")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "RESUME must be auto, 1 or 0" in err
    assert not (folder / "srun.argv").exists()


@pytest.mark.parametrize("sig, requeue_on, requeued", [
    (signal.SIGUSR1, None, True),          # --signal=B:USR1@120: the time limit is near
    (signal.SIGTERM, None, False),         # scancel --batch --signal=TERM, --signal=B:TERM@N: save and stop
    (signal.SIGTERM, "USR1 TERM", True),
])
def test_signal_to_the_script_reaches_srun_at_once(fake, sig, requeue_on, requeued):
    folder, env = fake
    proc = start(env, **({"REQUEUE_ON": requeue_on} if requeue_on else {}))
    deadline = time.monotonic() + 30
    while not (folder / "srun.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    assert (folder / "srun.signal").read_text().strip() == sig.name[3:]
    assert proc.returncode == 128 + sig
    if requeued:
        assert (folder / "scontrol.argv").read_text().split() == ["requeue", "4242"]
        assert f"stopped on {sig.name} (exit {128 + sig}): requeueing job 4242" in err
    else:
        assert not (folder / "scontrol.argv").exists()


@pytest.mark.parametrize("code, requeued", [(138, True), (1, False), (143, False), (0, False)])
def test_exit_status_of_the_ranks(fake, code, requeued):
    """138: the ranks got SIGUSR1 themselves (--signal=USR1@N without B:) and saved; 1: a failure."""
    folder, env = fake
    proc = start(env, FAKE_SRUN_EXIT=str(code))
    proc.communicate(timeout=60)
    assert proc.returncode == code
    assert (folder / "scontrol.argv").exists() == requeued
