"""Red team without namespaces: where no namespace can be made (an unprivileged trainer without user
namespaces, a container that forbids unshare), calls with no audit event must still not reach other
processes nor leave files behind. Attacks with namespaces: ``test_sandbox_redteam.py``."""
from __future__ import annotations

import dataclasses
import os
import sys
import textwrap
import time
import uuid

import pytest

from dstrain.rewards.sandbox import MODES, SandboxPool
from tests.unit.test_sandbox_redteam import LIMITS, still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")


@pytest.mark.parametrize("mode", MODES)
def test_without_namespaces_nothing_is_left_in_dev_shm(mode):
    """``_posixshmem.shm_open`` (and ``_multiprocessing``'s named semaphores) make files in ``/dev/shm``
    with no audit event: without a read-only mount namespace they would outlive the program."""
    name = f"dstrain-redteam-{uuid.uuid4().hex[:8]}"
    program = (f"import _posixshmem, os\nfd = _posixshmem.shm_open('/{name}', os.O_CREAT | os.O_RDWR, 0o600)\n"
               "os.write(fd, b'left behind')\n")
    limits = dataclasses.replace(LIMITS, mode=mode, namespaces=False)
    try:
        with SandboxPool(workers=1, limits=limits) as pool:
            r = pool.run(program, ["assert True"])
            assert r.reward() == 0.0, (r.status, r.detail)
            assert not os.path.exists(f"/dev/shm/{name}")
            still_works(pool)
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("mode", MODES)
def test_without_namespaces_other_processes_and_folders_stay_out_of_reach(mode, tmp_path):
    """Where no namespace can be made (an unprivileged trainer without user namespaces, a
    container that forbids unshare), calls with no audit event must still not reach a process
    of the same user (here a sacrificial one) nor create files outside the program's folder."""
    import subprocess
    victim = subprocess.Popen(["sleep", "60"])
    try:
        nice = os.getpriority(os.PRIO_PROCESS, victim.pid)
        program = textwrap.dedent(f"""
            import fcntl, os, signal
            r, w = os.pipe()
            for call in (lambda: signal.pidfd_send_signal(os.pidfd_open({victim.pid}), signal.SIGKILL),
                         # SIGKILL (F_SETSIG) to the descriptor's owner when it becomes readable
                         lambda: (fcntl.fcntl(r, fcntl.F_SETOWN, {victim.pid}), fcntl.fcntl(r, 10, signal.SIGKILL),
                                  fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC), os.write(w, b"x")),
                         lambda: os.setpriority(os.PRIO_PROCESS, {victim.pid}, 19),
                         lambda: os.sched_setaffinity({victim.pid}, {{0}}),
                         lambda: os.mkfifo({str(tmp_path / 'fifo')!r}),
                         lambda: os.mknod({str(tmp_path / 'node')!r}, 0o600)):
                try:
                    call()
                except Exception:
                    pass
            import importlib
            importlib.reload(os)
            print(hasattr(os, "pidfd_open"), hasattr(os, "mknod"))
            """)
        limits = dataclasses.replace(LIMITS, mode=mode, namespaces=False)
        with SandboxPool(workers=1, limits=limits) as pool:
            r = pool.run(program, ["assert True"])
            assert r.stdout.split() == ["False", "False"], (r.status, r.detail, r.stdout)
            time.sleep(0.2)
            assert victim.poll() is None
            assert os.getpriority(os.PRIO_PROCESS, victim.pid) == nice
            assert os.sched_getaffinity(victim.pid) == os.sched_getaffinity(0)
            assert os.listdir(tmp_path) == []
            still_works(pool)
    finally:
        victim.kill()
        victim.wait()
