"""Red team, round 31: what a program leaves running on the trainer's machine, the kernel's tasks and the processes.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, and the same pool must afterwards still
score a correct program 1. Found and closed:

- a spawned program outlived its run: with a PID namespace the program is the namespace's init, a child of the
  launcher, and the trainer kills the launcher's process group at the deadline; ``os.setsid()`` took the program out
  of that group, so ``time.sleep`` (or any loop that sleeps: ``RLIMIT_CPU`` never comes) went on after the run was
  reported as a timeout, for ever, holding its 64 MiB tmpfs and a pid (one more per such program: the trainer's
  memory and pids run out over a training run). The init of the namespace now gets ``SIGKILL`` when the launcher
  dies (``PR_SET_PDEATHSIG``, ``_launch._launch``), which ends every process of the namespace. (The fork server kills
  the program's own pid as well as its group: not affected.)
- a program held as many kernel tasks as its address space allowed: ``RLIMIT_NPROC`` (``max_processes``, 64) is not
  enforced for root, and starting a thread raises no audit event, so with ``threading.stack_size(32768)`` it started
  hundreds of threads (382 before its address space ran out at this file's limits), each a pid of the trainer's
  machine (a ``pid_max`` of 32768, or a container's ``pids.max``, runs out with enough workers doing so). A thread beyond
  ``max_processes`` alive (the judge's worker included) now gets ``RuntimeError: can't start new thread``, as when
  the system has none left (``_unaudited._cap_threads``); the real ``_thread.start_new_thread`` is out of reach
  (reloading ``_thread`` or running its module again gives the gate back).
- without a mount namespace (an unprivileged trainer with no user namespaces, a container that forbids unshare) the
  program's folder is a folder of the trainer's disk, and the file size limit (1 MiB) was all that bounded a write:
  a program wrote files until its wall limit, as fast as the disk took them (all 100 files of 1 MiB of the test below). The audit hook now gives such a folder the tmpfs's room: as many new files as fill 64 MiB at the file size
  limit, 8192 entries in all, then ``OSError: [Errno 28]`` as from a full tmpfs (``_child._make_hook``'s ``room``).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

import pytest

from dstrain.rewards.sandbox import MODES, SandboxPool
from tests.unit.redteam_rounds import round_pool  # noqa: F401 (round_pool: the pool fixture)
from tests.unit.test_sandbox_redteam import GOOD, LIMITS, TESTS, still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")


def _programs_under(root: str) -> list[int]:
    """Pids of the processes whose ``HOME`` is a program's folder under ``root``: a spawned program's
    (``dstrain-sbx-*``) or a fork server's job's (``dstrain-fsrv-*/jobN``), not a server's own."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"HOME="):
                home = os.fsdecode(item[5:])
                if home.startswith(os.path.join(root, "dstrain-sbx-")) or (
                        home.startswith(os.path.join(root, "dstrain-fsrv-")) and "/job" in home):
                    found.append(int(entry))
    return found


@pytest.mark.parametrize("mode", MODES)
def test_a_program_that_leaves_its_group_ends_with_its_run(mode, tmp_path):
    """Before the fix, in spawn mode, the program below was still sleeping after its run had been reported (a
    timeout), with the trainer's init as its parent."""
    limits = dataclasses.replace(LIMITS, mode=mode, tmp_root=str(tmp_path))
    program = "import os, time\ntry:\n    os.setsid()\nexcept OSError:\n    pass\nwhile True:\n    time.sleep(1)\n"
    left = []
    with SandboxPool(workers=1, limits=limits) as pool:
        try:
            r = pool.run(program, TESTS)
            assert r.status == "timeout", (r.status, r.detail)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                left = _programs_under(str(tmp_path))
                if not left:
                    break
                time.sleep(0.05)
            assert not left, f"the program still runs after its run ({mode}): pids {left}"
            still_works(pool)
        finally:
            for pid in left:  # (before the fix: the program this test started)
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


def test_threads_are_capped_at_max_processes(pool):
    """Before the fix the program started threads until its address space ran out (382 of the 400 it asked for at
    these limits); now ``max_processes`` (64) at most are alive, the judge's worker thread included, and a
    program that copes with the error still scores."""
    program = ("import threading\nthreading.stack_size(32768)\nstop, mine = threading.Event(), []\ntry:\n"
               "    for _ in range(400):\n        mine.append(threading.Thread(target=stop.wait, daemon=True))\n"
               "        mine[-1].start()\nexcept RuntimeError as e:\n    mine.pop()\n    print('refused:', e)\n"
               "print('started', len(mine), flush=True)\nstop.set()\nfor t in mine:\n    t.join()\n" + GOOD)
    r = pool.run(program, TESTS)
    started = int(r.stdout.split("started ")[-1].split()[0])
    assert started <= LIMITS.max_processes - 1, (started, r.stdout[-300:])
    assert r.reward() == 1.0, (r.status, r.detail)
    still_works(pool)


def test_the_real_thread_start_is_out_of_reach(pool):
    """What leads back to ``_thread.start_new_thread`` from the program: reloading ``_thread``, running its module
    again, the gate's closure (a generator whose frame is refused). Each still gives the gate: 70 threads asked, 63
    started."""
    program = ("import _imp, _thread, importlib, threading\nfor again in (importlib.reload, _imp.exec_builtin):\n"
               "    try:\n        again(_thread)\n    except Exception:\n        pass\n"
               "starts = [_thread.start_new_thread, _thread.start_new, threading._start_new_thread]\n"
               "for c in _thread.start_new_thread.__closure__:\n"
               "    for name in ('gi_frame', 'gi_code'):\n        try:\n"
               "            starts.append(getattr(c.cell_contents, name))\n        except Exception:\n            pass\n"
               "stop = threading.Event()\nn = 0\nfor start in starts:\n    try:\n        for _ in range(70):\n"
               "            start(stop.wait, ())\n            n += 1\n    except Exception:\n        pass\n"
               "print('started', n, flush=True)\nstop.set()\n" + GOOD)
    r = pool.run(program, TESTS)
    started = int(r.stdout.split("started ")[-1].split()[0])
    assert started <= LIMITS.max_processes - 1, (started, r.stdout[-300:])
    still_works(pool)


@pytest.mark.parametrize("mode", MODES)
def test_without_namespaces_the_folder_has_the_room_of_the_tmpfs(mode):
    """Before the fix the program wrote all its 100 files of 1 MiB into the trainer's disk; now 64, then ENOSPC."""
    program = ("import errno\nblob, n = b'x' * (1 << 20), 0\ntry:\n    while n < 100:\n"
               "        with open(f'f{n}', 'wb') as fh:\n            fh.write(blob)\n        n += 1\n"
               "except OSError as e:\n    print('refused', errno.errorcode[e.errno])\n"
               "print('written', n, flush=True)\n" + GOOD)
    limits = dataclasses.replace(LIMITS, mode=mode, namespaces=False, wall_seconds=5.0)
    with SandboxPool(workers=1, limits=limits) as pool:
        r = pool.run(program, TESTS)
        written = int(r.stdout.split("written ")[-1].split()[0])
        assert written == (64 << 20) // limits.file_size_bytes and "refused ENOSPC" in r.stdout, r.stdout[-300:]
        assert r.reward() == 1.0, (r.status, r.detail)  # (a program that copes with it still scores)
        still_works(pool)
