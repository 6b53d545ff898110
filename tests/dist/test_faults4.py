"""Fault round 4 with real ranks: DeepSpeed's per-host launcher (``launch.py``) killed outright under a running job.

Before: DeepSpeed's runner exited 0 (it reads a child killed by a signal as success), ``dstrain launch`` returned
0, and the two ranks, reparented to init, trained on unattended, holding the run folder's lock. After: the job
guard stops them (they save a checkpoint at the step they reached and leave), names what happened, and
``dstrain launch`` returns 1 only once no rank is left. (In-process checks: ``tests/unit/test_faults4.py``.)"""
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dstrain import checkpoint as ckpt
from tests.dist import harness


def _processes(out: Path, module: str) -> list[int]:
    """The pids of ``python -m MODULE ...`` processes of the run writing ``out``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if module in argv and f"--output.dir={out}" in argv:
            found.append(int(cmdline.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the processes through /proc")
def test_ranks_left_by_a_killed_launcher_save_and_stop_and_the_launch_fails(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(harness.RECIPE),
           *harness.overrides(out, 5000, "--checkpoint.every=1000")]
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log_file:  # (a file: ranks left running would hold a pipe open)
        launch = subprocess.Popen(cmd, env=env, cwd=harness.ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and launch.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and "train/loss" in metrics.read_text():
                break
            time.sleep(0.2)
        middle = _processes(out, "deepspeed.launcher.launch")
        assert len(middle) == 1 and launch.poll() is None, "the job never trained"
        os.kill(middle[0], signal.SIGKILL)
        launch.wait(timeout=120)
        log = log_path.read_text()
        found = re.search(r"dstrain: the launcher \(deepspeed\) ended \(status 0\) while 2 rank\(s\) on this host "
                          r"still ran \(pids (\d+) (\d+)\)", log)
        assert found, log[-3000:]
        assert launch.returncode == 1, log[-3000:]
        assert not any(map(_alive, map(int, found.groups())))  # dstrain launch returned once they had left
        stopped = re.search(r"dstrain: stopped at step (\d+) of 5000 by SIGTERM", log)
        assert stopped, log[-3000:]
        assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(int(stopped.group(1)))
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.wait()
        for pid in _processes(out, "dstrain.cli"):  # ranks left running (before the fix)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
