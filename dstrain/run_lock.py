"""The run folder's lock: one run writes ``output.dir`` at a time, also when two hosts share the folder.

Rank 0 holds an exclusive ``flock`` on ``output.dir/.dstrain.lock`` and writes ``PID HOST`` into it. The kernel
releases the lock however the holder ends, so on one machine a restart after a crash finds the folder free.
On a shared file system that is not enough: an NFS mount without lock support (``nolock``, NFSv3 without
``lockd``), Lustre's ``localflock`` and several FUSE file systems keep flocks local to each client, so a run on
another host gets the lock too; others refuse flock outright (ENOLCK, ENOSYS, EOPNOTSUPP). The holder therefore
also rewrites ``PID HOST TIME`` every :data:`BEAT_S` seconds (a heartbeat in the file's text, not its mtime: a run
folder copied with ``cp -r`` gets new mtimes) and empties the file when it ends normally. A lock file naming
another host with a heartbeat younger than :data:`STALE_S` refuses the folder whatever flock said; an older one
(that host died, lost power or was rebooted mid-run) is taken over with a note naming the run it replaces.
Under SLURM the record also names the job and its restart count (``slurm:JOBID.RESTARTS``): a job that SLURM
requeued onto another node (``--requeue`` after a node failure) finds its own earlier instance there, which SLURM
ended before requeuing it, and takes over without waiting out :data:`STALE_S` (after the :data:`CONFIRM_S` watch).
"""
from __future__ import annotations

import atexit
import fcntl
import os
import socket
import sys
import threading
import time
from pathlib import Path

NAME = ".dstrain.lock"
BEAT_S = 15.0
STALE_S = 120.0
CONFIRM_S = BEAT_S + 5.0
"""How long a lock that looks stale from another host is watched before it is taken over: a holder whose clock is
behind this host's writes heartbeats that look old here, and is alive if one comes."""

_HELD: list = []  # [(folder, open file)] of this process: held until it ends
_MUTEX = threading.Lock()


def holder_text(text: str) -> str:
    """``process PID on HOST`` from a lock file's text (``PID`` alone: written by an older dstrain)."""
    pid, host, _ = _holder(text)
    return f"process {pid or '?'}" + (f" on {host}" if host else "")


def _holder(text: str) -> tuple[str, str, float | None]:
    """PID, HOST and the heartbeat's time (None: a file of an older dstrain, without one)."""
    fields = text.split()
    try:
        beat = float(fields[2]) if len(fields) > 2 else None
    except ValueError:
        beat = None
    return (fields + ["", ""])[0], (fields + ["", ""])[1], beat


def _slurm_job() -> tuple[str, int] | None:
    """(SLURM_JOB_ID, SLURM_RESTART_COUNT) of this process, None outside a SLURM job."""
    job = os.environ.get("SLURM_JOB_ID", "").strip()
    if not job or any(c.isspace() for c in job):
        return None
    try:
        return job, int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        return job, 0


def _slurm_of(text: str) -> tuple[str, int] | None:
    """The ``slurm:JOBID.RESTARTS`` field of a lock record, None when it has none."""
    for field in text.split()[3:]:
        if field.startswith("slurm:"):
            job, _, count = field[len("slurm:"):].rpartition(".")
            if job and count.isdigit():
                return job, int(count)
    return None


def _requeued_from(text: str) -> tuple[str, int, int] | None:
    """(job, the holder's restart count, this one's) when the record's holder is an earlier instance of this
    process's SLURM job: SLURM requeues a job (``--requeue``, ``scontrol requeue``, a node failure) only once
    that instance has ended, so its lock is no other run's."""
    mine, theirs = _slurm_job(), _slurm_of(text)
    if mine and theirs and mine[0] == theirs[0] and theirs[1] < mine[1]:
        return mine[0], theirs[1], mine[1]
    return None


def _record() -> bytes:
    """This process's lock text; one length for every beat (each rewrites it in place, never empty)."""
    job = _slurm_job()
    tail = f" slurm:{job[0]}.{job[1]}" if job else ""
    return f"{os.getpid()} {socket.gethostname()} {time.time():014.1f}{tail}\n".encode()


def _other_host_problem(out: Path, path: Path, flock_works: bool) -> tuple[str | None, str | None]:
    """(refusal, takeover note) from what the lock file says, for a folder whose flock was granted or unusable."""
    try:
        text = path.read_text()
        pid, host, beat = _holder(text)
        age = max(0.0, time.time() - (beat if beat is not None else path.stat().st_mtime))
    except (OSError, UnicodeDecodeError):
        return None, None
    me = socket.gethostname()
    if not pid:
        return None, None
    if host == me or not host:
        if not flock_works and pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            return (f"output.dir {out} is in use by another run ({holder_text(text)}); "
                    "wait for it or choose another output.dir"), None
        return None, None
    if requeued := _requeued_from(text):
        job, before, now = requeued
        return None, (f"dstrain: note: taking over output.dir {out} from {holder_text(text)}: SLURM job {job} "
                      f"was requeued (restart {now}; the holder was its restart {before}, which SLURM ended); its "
                      "checkpoints stay")
    if age < STALE_S:
        return (f"output.dir {out} is in use by another run ({holder_text(text)}, heartbeat {age:.0f} s ago; this "
                f"file system does not share locks between hosts); wait for it or choose another output.dir (if "
                f"{host} is down: delete {path}, or start again once its heartbeat is {STALE_S:.0f} s old)"), None
    return None, (f"dstrain: note: taking over output.dir {out} from {holder_text(text)}: no heartbeat for "
                  f"{age:.0f} s (that host stopped or died); its checkpoints stay")


def _still_beating(out: Path, path: Path) -> str | None:
    """The refusal when the lock file, whose heartbeat looked stale (another host), gets a new one within
    :data:`CONFIRM_S`: its holder runs, on a clock behind this host's (no NTP on one of them), and a takeover
    would have two runs writing one folder. None when no heartbeat comes (that host is down)."""
    try:
        before = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    print(f"dstrain: note: output.dir {out} was last held by {holder_text(before)}, whose heartbeat looks stale "
          f"here; watching it for {CONFIRM_S:.0f} s before taking over", file=sys.stderr, flush=True)
    end = time.monotonic() + CONFIRM_S  # (a clock that cannot jump)
    while time.monotonic() < end:
        time.sleep(min(0.5, CONFIRM_S / 10))
        try:
            now = path.read_text()
        except (OSError, UnicodeDecodeError):
            return None
        _, host, beat = _holder(now)
        if now != before and now.strip() and beat is not None and host != socket.gethostname():
            if _requeued_from(now):
                return (f"output.dir {out} is in use by another run ({holder_text(now)}): the earlier instance of "
                        f"SLURM job {_slurm_of(now)[0]} still renews its heartbeat (its node lost from SLURM, not "
                        "from the file system); wait for it to end or choose another output.dir")
            behind = time.time() - beat
            return (f"output.dir {out} is in use by another run ({holder_text(now)}): its heartbeat is still "
                    f"renewed although it reads {behind:.0f} s old here (the clocks of {host} and "
                    f"{socket.gethostname()} differ by about that much: check their NTP); wait for it or choose "
                    "another output.dir")
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def probe(out: Path) -> str | None:
    """Why a new run may not take ``out`` now (checked by ``dstrain launch`` before any rank starts), else None."""
    path = out / NAME
    if not path.is_file():
        return None
    try:
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return (f"output.dir {out} is in use by another run ({_holder_now(handle)}); "
                        "wait for it or choose another output.dir")
            except OSError:
                return _other_host_problem(out, path, False)[0]  # no flock on this file system
    except OSError:
        return None
    return _other_host_problem(out, path, True)[0]


def take(out: Path) -> str | None:
    """Hold ``out``'s lock for this process's lifetime (with a heartbeat); the problem if another run holds it."""
    if _HELD and _HELD[0][0] == out.resolve():
        return None  # this process holds it already (a run resumed in the same process)
    path = out / NAME
    try:
        out.mkdir(parents=True, exist_ok=True)
        handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    except OSError as err:
        return f"output.dir {out}: cannot be written ({err.strerror or err})"
    flock_works = True
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_now(handle)
        handle.close()
        return f"output.dir {out} is in use by another run ({holder}); wait for it or choose another output.dir"
    except OSError:
        flock_works = False  # ENOLCK / ENOSYS / EOPNOTSUPP: a file system without flock; the lock file decides
    problem, note = _other_host_problem(out, path, flock_works)
    if problem:
        handle.close()
        return problem
    if note:
        live = _still_beating(out, path)
        if live:
            handle.close()
            return live
        print(note, file=sys.stderr, flush=True)
    try:
        handle.truncate(0)
        os.pwrite(handle.fileno(), mine := _record(), 0)  # the host too: a folder on a shared file system
        if not flock_works and (rival := _raced(path, mine)):  # (a raise here is the one line below)
            handle.close()
            return (f"output.dir {out} is in use by another run ({rival}), started at the same moment on a "
                    "file system without locks; wait for it or choose another output.dir")
    except OSError as err:  # a full disk (quota) at the start: one line, not a traceback in rank 0
        handle.close()
        from dstrain.engine.profiles import format_bytes
        from dstrain.rank_exit import _free_bytes
        free = _free_bytes(out)  # (as the run records' line says it: README, "A full disk outside a save")
        space = f"; {format_bytes(free)} free there" if free is not None else ""
        return (f"output.dir {out}: cannot be written ({err.strerror or err}: {path}{space}); free space, then "
                "start again")
    _HELD[:] = [(out.resolve(), handle)]
    threading.Thread(target=_beat, args=(handle,), name="dstrain-run-lock", daemon=True).start()
    return None


SETTLE_S = 0.5
"""Without flock, how long a run that wrote the lock file waits before reading it back (:func:`_raced`)."""


def _raced(path: Path, mine: bytes) -> str | None:
    """Without flock, two runs started within a second (two ``dstrain launch``, or two hosts' jobs) both read
    a free lock file and both wrote it: the last write stays. Read back after :data:`SETTLE_S`, the file names
    the winner; the holder text of that other run when it is not this one, else None."""
    time.sleep(SETTLE_S)
    now = _first_written(lambda: path.read_bytes().decode(errors="replace"))  # (empty: between truncate and write)
    if now.split()[:2] == mine.decode().split()[:2]:
        return None
    return holder_text(now) if now.strip() else "a run starting now"


def _holder_now(handle) -> str:
    """The holder's text of a lock file whose flock another run holds: read again for up to half a second when
    empty (the other run took the flock and has not written its record yet: two launches at the same moment)."""
    def read() -> str:
        handle.seek(0)
        return handle.read()

    text = _first_written(read)
    return holder_text(text) if text.strip() else "a run starting or ending now"


def _first_written(read) -> str:
    """``read()`` again for up to half a second while it gives an empty lock file (another run between its
    truncate and its write); the last text read."""
    for _ in range(10):
        text = read()
        if text.strip():
            break
        time.sleep(0.05)
    return text


def _beat(handle) -> None:
    while _HELD and _HELD[0][1] is handle:
        time.sleep(BEAT_S)
        if _HELD and _HELD[0][1] is handle:
            recheck()  # (may move the lock to a new file: its own thread beats it)
        with _MUTEX:  # (not after release emptied the file)
            try:
                if _HELD and _HELD[0][1] is handle:
                    os.pwrite(handle.fileno(), _record(), 0)
            except (OSError, ValueError):
                return  # the file was closed


_WARNED: set[str] = set()


def recheck() -> str | None:
    """Whether the held lock file is still the one at ``output.dir/.dstrain.lock`` (every heartbeat, and rank 0
    before each save); the warning said when it is not, else None.

    ``output.dir`` deleted (``rm -rf`` of a run thought finished) or renamed (``mv``) while the run goes: the
    flock stays on a file no longer there, DeepSpeed recreates the folder at the next save, and a second run
    found no lock file and took the folder. The lock is taken again at its path (the folder made anew), or,
    when another run got there first, both runs are named."""
    with _MUTEX:
        if not _HELD:
            return None
        folder, handle = _HELD[0]
        path = folder / NAME
        try:
            if os.path.samestat(os.stat(path), os.fstat(handle.fileno())):
                return None
        except FileNotFoundError:
            pass
        except (OSError, ValueError):
            return None  # unreadable now (a file system hiccup, the file closed at exit): the next beat looks again
        gone = "deleted or renamed" if not folder.is_dir() or not path.exists() else "replaced"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            new = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
        except OSError as err:
            return _warn(f"dstrain: warning: output.dir {folder} was {gone} while this run goes, and its lock "
                         f"cannot be made again ({err.strerror or err}); another run may take the folder")
        try:
            fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_now(new)
            new.close()
            return _warn(f"dstrain: warning: output.dir {folder} was {gone} while this run goes, and another run "
                         f"({holder}) took it since: both write it now; stop one of them (this run's checkpoints "
                         "before that went with the old folder)")
        except OSError:
            pass  # no flock on this file system: the text decides, as in take()
        problem, _ = _other_host_problem(folder, path, True)
        if problem:
            new.close()
            return _warn(f"dstrain: warning: output.dir {folder} was {gone} while this run goes, and {problem}")
        try:
            new.truncate(0)
            os.pwrite(new.fileno(), _record(), 0)
        except OSError:
            pass
        try:
            handle.truncate(0)  # the old file (in a renamed folder): free for whoever resumes that copy
            handle.close()
        except (OSError, ValueError):
            pass
        _HELD[:] = [(folder, new)]
        threading.Thread(target=_beat, args=(new,), name="dstrain-run-lock", daemon=True).start()
    return _warn(f"dstrain: warning: output.dir {folder} was {gone} while this run goes; its lock is taken again "
                 "there and the run goes on writing it (checkpoints from the next save on; earlier ones went with "
                 "the old folder: move them back to keep them)")


def _warn(line: str) -> str:
    if line not in _WARNED:
        print(line, file=sys.stderr, flush=True)
        _WARNED.add(line)
    return line


def release() -> bool:
    """Let go of the lock this process holds, leaving an empty lock file: nothing to take over (nor to refuse,
    once copied); whether one was held. At exit (``atexit``) and from :func:`dstrain.runtime.exit_rank`, whose
    ``os._exit`` runs no ``atexit`` handler: before, every rank's lock record stayed, so a job started on another
    host within :data:`STALE_S` of the run's end (the next job of a SLURM chain, a retry) was refused as if the
    run still went, and one started later waited :data:`CONFIRM_S` and took over "from a host that died"."""
    with _MUTEX:
        held = list(_HELD)
        _HELD.clear()
    for _folder, handle in held:
        try:
            handle.truncate(0)
            handle.close()
        except (OSError, ValueError):
            pass
    return bool(held)


atexit.register(release)
