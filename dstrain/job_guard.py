"""A job that outlives ``dstrain launch`` stops as if it had been asked to.

``dstrain launch`` runs the launcher (deepspeed or torchrun) and its ranks in a session of their own, so
that a Ctrl-C at the terminal reaches ``dstrain launch`` alone, which passes it on to the whole job. A
``dstrain launch`` killed outright (SIGKILL, the out-of-memory killer, a supervisor's hard kill) could
pass nothing on: the job trained on unattended, holding the run folder's lock, and a new launch into
that folder was refused. So the launcher is started through this module
(``python -m dstrain.job_guard PARENT_PID PORT -- ARGV``), the first process of the job's session: it
asks the kernel for a SIGTERM when its parent dies (Linux' ``PR_SET_PDEATHSIG``), runs ARGV in its own
process group and, on that signal, stops the job as ``dstrain launch`` would have: SIGTERM to its ranks
(:func:`stop_job`: they save and exit 143), SIGKILL to what is left after :data:`GRACE_S`; then it removes what
``dstrain launch`` would have removed (the job's failure folder, its CPU ranks' shared-memory buffers).
While ``dstrain launch`` lives, the guard passes the child's exit status through and does nothing else.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

GRACE_S = 120.0
"""How long the ranks of a job whose ``dstrain launch`` died may take to save and leave (as ``_wait_for_group``)."""
_PR_SET_PDEATHSIG = 1


def start_job(argv: list[str], env: dict, port: int | None = None) -> subprocess.Popen:
    """Start ``argv`` (the launcher's command) in a session of its own, behind the guard (see the module)."""
    guard = [sys.executable, "-m", "dstrain.job_guard", str(os.getpid()), str(port or 0), "--", *argv]
    return subprocess.Popen(guard, env=env, start_new_session=True)


def wait_for_group(pgid: int, limit_s: float = GRACE_S, poll: float = 0.2) -> None:
    """Return once no process of group ``pgid`` is left, or SIGKILL what is left after ``limit_s``."""
    end = time.monotonic() + limit_s
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > end:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return
        time.sleep(poll)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (Linux' /proc), children first."""
    import glob
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            children.setdefault(int(open(stat).read().rsplit(")", 1)[1].split()[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _is_rank(pid: int) -> bool:
    """Whether process ``pid`` is a rank (``python ... -m dstrain.cli train ...``), not a launcher that passes the
    same words on (``deepspeed ... --module dstrain.cli train``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return is_rank_argv(argv)


def is_rank_argv(argv: list[str]) -> bool:
    """``python [options] -m dstrain.cli train ...``: the interpreter's own ``-m``, not a launcher's option of the
    same name (``python -m torch.distributed.run ... -m dstrain.cli train``)."""
    i = 1
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        i += 2 if argv[i] in ("-W", "-X") else 1  # interpreter options; these two take a value
    return argv[i:i + 3] == ["-m", "dstrain.cli", "train"]


def stop_job(root: int, signum: int) -> None:
    """Ask the job under process ``root`` (the guard, leader of the job's process group) to stop with ``signum``.

    The ranks on this host get it; the launchers between them and us (DeepSpeed's ``launch.py``, torchrun's agent)
    do not: each passes a signal on to its ranks and SIGKILLs those still running 30 s later, which cut off a
    checkpoint that takes longer to save (the ranks then lost it, and the stop's step with it). The ranks agree on
    the stop at their next step (ranks on other hosts too) and exit 128 + N once saved; the launchers end with
    them. Where no rank runs on this host (the launcher still starting them, or every rank elsewhere), the group
    gets it, as before."""
    ranks = [pid for pid in _descendants(root) if _is_rank(pid)] if sys.platform.startswith("linux") else []
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    if not ranks:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(root, signum)


def _ask_for_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _clean_up(port: int) -> None:
    import shutil
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
    if port and os.environ.get("DS_ACCELERATOR") == "cpu":
        from dstrain.runtime import release_job_comm_buffers
        release_job_comm_buffers(port)


def main(args: list[str]) -> int:
    parent, port, argv = int(args[0]), int(args[1]), args[3:]
    orphaned = []

    def on_signal(signum, _frame):
        if os.getppid() == parent or orphaned:
            return  # dstrain launch sent it to the whole group (the child has it too), or we are ending already
        orphaned.append(time.monotonic())
        sys.stderr.write(f"dstrain: the launching process {parent} is gone; stopping the job (SIGTERM to its "
                         f"ranks: they save and leave)\n")
        stop_job(os.getpid(), signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    _ask_for_parent_death_signal()
    child = subprocess.Popen(argv)
    if os.getppid() != parent:  # it died before the kernel could be asked
        on_signal(signal.SIGTERM, None)
    while True:
        try:
            code = child.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            if orphaned and time.monotonic() - orphaned[0] > GRACE_S:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(os.getpgrp(), signal.SIGKILL)
    if orphaned:  # the launcher's own children may still be saving
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _wait_for_others(max(1.0, GRACE_S - (time.monotonic() - orphaned[0])))
        _clean_up(port)
    elif left := _ranks_in_group():
        return _stop_ranks_left(left, argv, code)
    return 128 - code if code < 0 else code


def _group_members() -> list[int]:
    """The other live (not zombie) processes of this process group, read from ``/proc``."""
    import glob
    me, group, found = os.getpid(), os.getpgrp(), []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = open(stat).read().rsplit(")", 1)[1].split()
            pid = int(stat.split("/")[2])
            if int(fields[2]) == group and pid != me and fields[0] != "Z":
                found.append(pid)
    return found


def _ranks_in_group() -> list[int]:
    """Ranks of this process group still running (reparented to init when their launcher died)."""
    return [pid for pid in _group_members() if _is_rank(pid)]


def _stop_ranks_left(ranks: list[int], argv: list[str], code: int) -> int:
    """The launcher ended under ranks still training (DeepSpeed's ``launch.py`` or torchrun's agent killed
    outright: SIGKILL, the out-of-memory killer; DeepSpeed's runner then even exits 0). Nobody would wait for
    them or pass them a stop: they save and leave on a SIGTERM from here, and the job counts as failed (not as
    stopped by a user: ``--max-restarts`` restarts it), whatever status the launcher left."""
    name = argv[argv.index("-m") + 1] if "-m" in argv[:3] else os.path.basename(argv[0])
    sys.stderr.write(f"dstrain: the launcher ({name}) ended (status {code}) while "
                     f"{len(ranks)} rank(s) on this host still ran (pids {' '.join(map(str, ranks))}): stopping "
                     "them (SIGTERM: they save a checkpoint and leave); --resume continues from it\n")
    sys.stderr.flush()
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _wait_for_others(GRACE_S)
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    if folder:  # the ranks' "stopped by a signal" status: the signal was ours, not a user's
        from dstrain.rank_exit import STOPPED_FILE
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, STOPPED_FILE))
    return 128 - code if code < 0 else code or 1


def _wait_for_others(limit_s: float) -> None:
    """Until this process is the last of its group (or SIGKILL to the others after ``limit_s``)."""
    end = time.monotonic() + limit_s
    while True:
        others = _group_members()
        if not others:
            return
        if time.monotonic() > end:
            for pid in others:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
