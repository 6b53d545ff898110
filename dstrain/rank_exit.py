"""How a rank ends when the run does not reach ``train.steps``, and what it says.

* **Stopped by a signal** (SIGTERM, SIGINT, SIGUSR1 to any rank, or to ``dstrain launch``, which forwards
  it): every rank saves, then exits ``128 + N`` (N: the signal's number; the highest, if ranks got
  different ones), the status a shell gives a process killed by that signal, so schedulers and
  launchers do not take the early stop for a finished run. A run that reached ``train.steps`` exits 0.
  Each rank also leaves the status in ``$DSTRAIN_FAILURE_DIR/stopped`` for ``dstrain launch``, which
  returns it even where the launcher in between (torchrun) reports every non-zero rank as exit 1.
* **A checkpoint that could not be written** (disk full, quota, a read-only folder): one line naming
  the folder, the free space there and the checkpoint that is still the latest
  (:class:`CheckpointWriteError`); the incomplete folder is removed.
* **A peer that died** (SIGKILL, out of memory, a crashed host): the survivors' collective fails
  with gloo's or NCCL's connection error; :func:`peer_lost` turns it into one line.

Nothing here imports torch at module level (``dstrain.cli`` imports it for every subcommand).
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import signal
from pathlib import Path

STOPPED_FILE = "stopped"
"""In ``$DSTRAIN_FAILURE_DIR``: the exit status of a run stopped by a signal."""
FAILED_FILE = "failed"
"""In ``$DSTRAIN_FAILURE_DIR``: the exit status of the first rank that ended the job with a reason of its own (2, 3,
4, 124), which ``dstrain launch`` returns (and ``--max-restarts`` reads) rather than the exit 1 of a peer that lost
it, which the launcher in between may see first."""
FORWARDED_FILE = "forwarded"
"""In ``$DSTRAIN_FAILURE_DIR``: the signal ``dstrain launch`` got (Ctrl-C: SIGINT) and passed on to the ranks as
SIGTERM; its own exit status is 128 + that signal's number, which rank 0's stop line gives."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PENDING_STOP = [0]
"""A stop signal that reached this rank while it was starting, kept for the trainer's ``StopFlag``."""


def hold_stop_signals() -> None:
    """Until the trainer's ``StopFlag`` takes over, keep a stop signal for it instead of dying of it.

    A rank still starting (DeepSpeed's set-up, data, the plan) when the job is stopped would otherwise be
    killed by the signal, and its peers, already training, would lose it instead of saving with it; with
    this, the ranks agree on the stop at their first step."""
    def keep(signum, _frame):
        PENDING_STOP[0] = PENDING_STOP[0] or signum
    for sig in STOP_SIGNALS:
        signal.signal(sig, keep)


class _Joining:
    """:func:`stop_ends_joining`'s context manager."""

    def __enter__(self):
        import sys
        if PENDING_STOP[0]:  # stopped before it joined: no peer can be training without it, nothing to save
            name = signal.Signals(PENDING_STOP[0]).name
            print(f"dstrain: rank {os.environ.get('RANK', '0')} stopped by {name} before it joined the job "
                  f"(exit {128 + PENDING_STOP[0]})", file=sys.stderr, flush=True)
            os._exit(128 + PENDING_STOP[0])
        self.before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.before.items():
            signal.signal(sig, handler)
        return False


def stop_ends_joining() -> _Joining:
    """``with stop_ends_joining():`` around the start of the process group: a stop signal ends the rank at once.

    The wait for the peers (torch's store, gloo's or NCCL's connections) is native code, where the handler that
    :func:`hold_stop_signals` installs never runs: a rank waiting for a peer that never comes (a wrong
    MASTER_ADDR, a rank that failed to start, more ranks asked than started) kept SIGTERM and Ctrl-C and
    waited out the collective timeout (30 minutes by default). No peer trains before every rank has joined,
    so there is no step to save: the signal's default action ends the rank (status 128 + N). A stop that came
    earlier ends it before it joins, in one line."""
    return _Joining()


# ---------------------------------------------------------------- stopped by a signal

def stop_exit_code(summary: dict, steps: int) -> int:
    """0 when the run reached ``steps`` (or was not stopped); else ``128 + N``, N the stop signal agreed by
    every rank (an all-reduce: call it on every rank, while the process group is up)."""
    if not (isinstance(summary, dict) and summary.get("stopped")) or int(summary.get("step", 0)) >= steps:
        return 0
    import torch

    from dstrain import resilience, runtime
    mine = int(resilience.STOP_REQUESTED[0] or 0)
    signum = int(runtime.all_reduce(torch.tensor([mine], dtype=torch.int64), "max").item())
    return 128 + (signum or signal.SIGTERM)


def signal_name(code: int) -> str:
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return f"signal {code - 128}"


def stop_line(summary: dict, steps: int, ckpt_root: Path, code: int) -> str:
    """What rank 0 prints when the run stopped early: step, signal, exit status, the checkpoint to resume."""
    from dstrain import checkpoint as ckpt
    latest = ckpt.find_latest(ckpt_root)
    where = (f"checkpoint {ckpt_root / latest} is saved; --resume continues from it" if latest
             else "no checkpoint was written; --resume starts from step 0")
    by = signal_name(code)
    forwarded = _forwarded_signal()
    if forwarded:  # the ranks got SIGTERM from dstrain launch; the user sees launch's status, 128 + its signal
        by, code = f"{signal_name(128 + forwarded)} to dstrain launch", 128 + forwarded
    return (f"dstrain: stopped at step {summary.get('step')} of {steps} by {by} "
            f"(exit {code}, not a finished run): {where}")


class StoppedBeforeTraining(RuntimeError):
    """A stop signal that came in a phase before the training steps that a rank checks on its own (the GRPO /
    SCoRe supervised warm start, minutes on a CPU): every rank leaves with 128 + N, rank 0 with this line."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def stopped_in_line(phase: str, signum: int, what_now: str) -> tuple[str, int]:
    """Rank 0's line and the exit status for a stop by ``signum`` in ``phase`` (named as :func:`stop_line` names
    it: ``by SIGINT to dstrain launch (exit 130, ...)`` when the launch passed the user's Ctrl-C on)."""
    code = 128 + signum
    by = signal_name(code)
    forwarded = _forwarded_signal()
    if forwarded:
        by, code = f"{signal_name(128 + forwarded)} to dstrain launch", 128 + forwarded
    return f"stopped {phase} by {by} (exit {code}, not a finished run): {what_now}", code  # after "dstrain: "


def note_forwarded(folder: str | Path, signum: int) -> None:
    """``dstrain launch`` passes ``signum`` on to its job: left for rank 0's stop line (the first signal only)."""
    _write_first(folder, FORWARDED_FILE, int(signum))


def _write_first(folder: str | Path, name: str, value: int | str) -> None:
    """``value`` into ``folder/name`` unless that file exists already (the first writer wins; errors ignored)."""
    try:
        fd = os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return
    os.write(fd, f"{value}\n".encode(errors="replace"))
    os.close(fd)


def _forwarded_signal() -> int | None:
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    try:
        signum = int((Path(folder) / FORWARDED_FILE).read_text().strip()) if folder else 0
    except (OSError, ValueError):
        return None
    return signum if 0 < signum < 65 else None


def note_stopped(code: int) -> None:
    """Leave ``code`` for ``dstrain launch`` (no-op for ranks it did not start, or on another host)."""
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    if not folder:
        return
    try:
        (Path(folder) / STOPPED_FILE).write_text(f"{code}\n")
    except OSError:
        pass


def note_failed(code: int) -> None:
    """Leave ``code`` for ``dstrain launch`` unless a rank left one first (no-op for ranks it did not start)."""
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    if folder:
        _write_first(folder, FAILED_FILE, code)


LAUNCH_FAILURE_NAME = ".dstrain-failures"
"""The failure folder a multi-host ``dstrain launch`` makes inside ``output.dir`` (see :func:`launch_failure_dir`)."""


def launch_failure_dir(output_dir: str | Path, multi_host: bool) -> str | None:
    """Where a launch's ranks leave their status and first error, when it is not a folder of the launcher's own.

    ``$DSTRAIN_FAILURE_DIR`` is read by ``dstrain launch`` on its own host. Ranks that DeepSpeed's pdsh runner
    starts on other hosts would write into a folder of that name on their own disk, which the launcher never sees
    (no error line, and a deterministic error restarted until ``--max-restarts`` ran out). A multi-host run's
    ``output.dir`` is one folder shared by every host (:mod:`dstrain.shared_folder`), so the folder goes there:
    hidden, made afresh for each attempt and removed after it (one launch at a time holds an ``output.dir``), under
    a name that stays the same from one launch to the next (a ``.deepspeed_env`` of the user's own can carry it).
    ``None`` for one host (a temporary folder, as before)."""
    if not multi_host:
        return None
    return str(Path(output_dir).absolute() / LAUNCH_FAILURE_NAME)


def is_launch_failure_dir(name: str) -> bool:
    """Whether a name in ``output.dir`` is the :func:`launch_failure_dir` (not the run's own file)."""
    return name == LAUNCH_FAILURE_NAME


ERROR_FILE = "error"
"""In ``$DSTRAIN_FAILURE_DIR``: the unexpected error of the first rank that failed, and where (``RuntimeError: ...
at forward of step 150``), which ``--max-restarts`` compares from one attempt to the next."""


def error_signature(err: BaseException, where: tuple[str | None, int] | None) -> str:
    """One line naming an unexpected error and the phase and step it came in (the same for the same error at the
    same point of a resumed attempt)."""
    first = _steady_part(err, (str(err).strip().splitlines() or [""])[0])[:240]
    at = f" (in {where[0]} of step {where[1]})" if where and where[0] else " (before the first step)"
    return f"{type(err).__name__}{': ' + first if first else ''}{at}"


_OOM_REQUEST = re.compile(r"^(.*?out of memory\.?(?: Tried to allocate [0-9.]+ ?[KMGT]?i?B\.?)?)")


def _steady_part(err: BaseException, line: str) -> str:
    """What of an error's first line stays the same when the same error comes again in another process. A CUDA
    out-of-memory message goes on with this moment's numbers (``GPU 0 has a total capacity of 79.1 GiB of which
    1.2 GiB is free. Process 81234 has 77.9 GiB memory in use...``: another process id, free memory and GPU index
    on every attempt), so it is cut after the request (``CUDA out of memory. Tried to allocate 2.00 GiB.``),
    which a deterministic OOM repeats."""
    if "OutOfMemoryError" in {t.__name__ for t in type(err).__mro__} or "out of memory" in line[:40].lower():
        match = _OOM_REQUEST.match(line)
        if match:
            return match.group(1)
    return line


def hang_signature(phase: str, step: int) -> str:
    """The error a hang leaves for ``--max-restarts`` (see :func:`note_error`): the phase and step only (not the
    rank, nor the seconds waited, which differ between attempts of the same hang)."""
    return f"Hang: no progress (in {phase} of step {step})"


ENVIRONMENT_HANG_PHASES = ("save",)
"""Phases whose hang names the environment, not the job: a save waits on the file system (an NFS or Lustre server
that stalls), and saves fall on the same steps in every attempt, so the same stall meets the same step again."""


def environment_hang(signature: str) -> bool:
    """Whether ``signature`` is a :func:`hang_signature` in one of :data:`ENVIRONMENT_HANG_PHASES`."""
    found = re.fullmatch(r"Hang: no progress \(in (.+) of step -?\d+\)", signature)
    return found is not None and found.group(1) in ENVIRONMENT_HANG_PHASES


def note_error(signature: str) -> None:
    """Leave the first failing rank's :func:`error_signature` (or :func:`hang_signature`) for ``dstrain launch``
    (first writer wins), and for the next attempt of a torchrun job that torchrun itself restarts
    (:func:`dstrain.elastic.note_attempt_error`)."""
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    if folder:
        _write_first(folder, ERROR_FILE, signature.replace("\n", " "))
    from dstrain import elastic
    elastic.note_attempt_error(signature.replace("\n", " "))


def error_of(folder: str | Path) -> str | None:
    """The error the first failing rank of a job left in ``folder`` (:func:`note_error`), else None."""
    try:
        return (Path(folder) / ERROR_FILE).read_text(errors="replace").strip() or None
    except OSError:
        return None


def failed_code(folder: str | Path) -> int | None:
    """The status the first failing rank left in ``folder`` (:func:`note_failed`), else None."""
    try:
        code = int((Path(folder) / FAILED_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return code if 0 < code < 256 else None


def stopped_code(folder: str | Path) -> int | None:
    """The status the ranks of a job stopped by a signal left in ``folder``, else None."""
    try:
        code = int((Path(folder) / STOPPED_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return code if 128 < code < 128 + 65 else None


# ---------------------------------------------------------------- a checkpoint that could not be written

EXIT_CHECKPOINT_WRITE = 4
"""Exit status of a run whose checkpoint could not be written (disk full, quota, read-only): not restarted by
``--max-restarts`` (``supervise.NO_RESTART``), since each retry would train up to the same save and fail there."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint's files could not be written (one-line message); the previous checkpoint stands."""

    exit_code = EXIT_CHECKPOINT_WRITE


# What torch's zip writer says when a write() failed underneath it (it drops the errno).
_TORCH_WRITE_FAILURES = ("iostream error", "file write failed", "unexpected pos", "PytorchStreamWriter failed")


def write_failure(err: BaseException) -> str | None:
    """Why a file write failed, when ``err`` (or an error it was raised from) is one; else None.

    Connection and timeout errors are not write failures (a peer died; a rank was late)."""
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and not isinstance(cause, (ConnectionError, TimeoutError)):
            if cause.errno in (errno.ENOSPC, errno.EDQUOT):
                return "no space left on device" if cause.errno == errno.ENOSPC else "disk quota exceeded"
            return cause.strerror or str(cause)
        if isinstance(cause, RuntimeError) and any(s in str(cause) for s in _TORCH_WRITE_FAILURES):
            return "a file write failed"
        cause = cause.__cause__ or cause.__context__
    return None


def _free_bytes(path: Path) -> int | None:
    there = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        return shutil.disk_usage(there).free if there is not None else None
    except OSError:
        return None


def checkpoint_write_error(err: BaseException, ckpt_root: Path, tag: str) -> CheckpointWriteError | None:
    """The one-line error for ``err`` raised while writing checkpoint ``tag``, or None when it is not a
    write failure. Removes the incomplete ``tag`` folder (never one marked complete) to give its space back."""
    why = write_failure(err)
    if why is None:
        return None
    from dstrain import checkpoint as ckpt
    tag_dir = Path(ckpt_root) / tag
    free = _free_bytes(tag_dir)
    if why == "a file write failed" and free is not None and free < 64 * 2**20:
        why = "no space left on device"  # torch's writer hides the errno; the file system says it
    removed = ""
    if tag_dir.is_dir() and not ckpt.is_complete(tag_dir):
        shutil.rmtree(tag_dir, ignore_errors=True)
        removed = f"; the incomplete {tag} was removed"
    latest = ckpt.find_latest(ckpt_root)
    kept = (f"checkpoint {latest} is intact and stays the latest: free space, then --resume continues from it"
            if latest and latest != tag else
            f"checkpoint {tag} is complete" if latest == tag else
            "there is no earlier checkpoint: free space and start again")
    from dstrain.engine.profiles import format_bytes
    space = f"{format_bytes(free)} free there" if free is not None else "free space unknown"
    return CheckpointWriteError(f"checkpoint {tag} could not be written to {ckpt_root}: {why} ({space}{removed}); "
                                f"{kept}")


# ---------------------------------------------------------------- a peer that died

# gloo (tcp pair), NCCL and torch's store: the messages of a collective whose peer process went away.
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited or there was a network error", "NCCL communicator was aborted")


def peer_lost(err: BaseException) -> str | None:
    """The transport's own words, shortened, when ``err`` is a collective that lost a peer; else None."""
    if not isinstance(err, RuntimeError):
        return None
    text = " ".join(str(err).split())
    for marker in _PEER_LOST:
        at = text.find(marker)
        if at >= 0:
            head = re.sub(r"^\[[^\]]*\]\s*", "", text[:at])  # gloo's "[.../pair.cc:537] " source position
            return (head + marker)[-200:]
    return None


PEER_LOST_EXIT_DELAY_S = 2.5
"""How long a rank that lost its peer waits before it exits 1. DeepSpeed's launcher polls its ranks once a second,
in no fixed order, and returns the status of the first failed one it finds: a survivor that left at once could be
found before the rank that was killed (SIGKILL, the out-of-memory killer), and ``dstrain launch`` then said nothing
of the signal and returned 1. Waiting longer than one poll lets the dead rank's signal be found first (then named)."""


def peer_lost_line(err: BaseException, rank: int | str, where: tuple[str | None, int] | None = None) -> str | None:
    """``dstrain: rank R lost contact with the job (a peer died or left) in PHASE of step S: WHAT``, or None."""
    what = peer_lost(err)
    if what is None:
        return None
    phase = f" in {where[0]} of step {where[1]}" if where and where[0] else ""
    return f"dstrain: rank {rank} lost contact with the job{phase} (a peer process died or left): {what}"
