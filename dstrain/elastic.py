"""Ranks restarted by torchrun's own agent (``torchrun --max-restarts N``) continue their job's checkpoint.

torchrun restarts every rank of a failed attempt with the same command line. A run started without
``--resume`` in an empty folder has, by its first restart, written checkpoints there itself; the command
line still says "a fresh run", and the folder-holds-a-checkpoint refusal (exit 2) ended every restart.

A restart (``TORCHELASTIC_RESTART_COUNT`` > 0) therefore resumes the latest checkpoint when this same
torchrun job wrote it: each checkpoint's ``trainer_state.json`` records the job's agents (``host:pid:start`` of
the torchrun process each rank runs under, which outlives its ranks' restarts). A checkpoint written by
another job (the first attempt was refused for it, and torchrun restarted that refusal) is refused as
before. ``dstrain launch --max-restarts`` restarts the whole launch with ``--resume`` itself and does not
take this path (its torchrun starts at restart count 0).
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

_AGENTS: list[str] = []
"""This job's torchrun agents, gathered from every rank by :func:`gather_agents` (empty outside torchrun)."""


def restart_count(environ=os.environ) -> int:
    """How many times torchrun's agent has restarted this rank's job (0 outside torchrun)."""
    text = environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
    return int(text) if text.isdigit() else 0


def agent_id(environ=os.environ) -> str | None:
    """``host:pid:start`` of the torchrun agent that started this rank (start: its start time, where ``/proc``
    has it), or None when no torchrun agent did."""
    if "TORCHELASTIC_RESTART_COUNT" not in environ:
        return None
    pid = os.getppid()
    started = _start_time(pid)  # a pid and a container's host name recur across jobs; its start time does not
    return f"{socket.gethostname()}:{pid}" + (f":{started}" if started else "")


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks after boot, ``/proc/<pid>/stat``), None where unreadable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def gather_agents() -> list[str]:
    """Every rank's agent (collective: every rank calls it), kept for :func:`agents` and returned."""
    from dstrain import runtime
    _AGENTS[:] = sorted({a for a in runtime.all_gather_object(agent_id()) if a})
    return list(_AGENTS)


def agents() -> list[str]:
    return list(_AGENTS)


def written_by_this_job(tag_dir: Path, job_agents: list[str]) -> bool:
    """Whether checkpoint ``tag_dir`` was written by the torchrun job whose agents are ``job_agents``."""
    try:
        state = json.loads((Path(tag_dir) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    saved = state.get("torchrun_agents") if isinstance(state, dict) else None
    return _same_job(saved, job_agents)


def _same_job(saved, job_agents: list[str]) -> bool:
    """Whether the agents a record names (``torchrun_agents``) include one of this job's."""
    return bool(job_agents) and isinstance(saved, list) and bool(set(saved) & set(job_agents))


# ---------------------------------------------------------------- a job stopped by a signal, restarted by torchrun

STOPPED_NAME = "stopped.json"
"""In ``output.dir``: how the last attempt of a torchrun job ended when a signal stopped it (rank 0 writes it)."""


class StoppedJobRestarted(RuntimeError):
    """torchrun restarted the ranks of a job that a signal stopped: they leave at once, with the stop's status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def note_stopped_job(out: Path, code: int, step: int, checkpoint: str | None) -> None:
    """Rank 0 of a torchrun job stopped by a signal (exit ``code``) records it, so that torchrun's restarts of
    its ranks (``--max-restarts``: it restarts ranks that exit non-zero, also 128 + N) do not train on."""
    if not _AGENTS:
        return
    record = {"code": int(code), "step": int(step), "checkpoint": checkpoint, "torchrun_agents": list(_AGENTS)}
    try:
        (Path(out) / STOPPED_NAME).write_text(json.dumps(record) + "\n")
    except OSError:
        pass


def stopped_job_problem(out: Path, job_agents: list[str]) -> StoppedJobRestarted | None:
    """The error a restarted rank leaves with when this torchrun job was stopped by a signal, else None."""
    try:
        record = json.loads((Path(out) / STOPPED_NAME).read_text())
        code, saved = int(record["code"]), record["torchrun_agents"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not _same_job(saved, job_agents) or not 128 < code < 193:
        return None
    import signal
    try:
        name = signal.Signals(code - 128).name
    except ValueError:
        name = f"signal {code - 128}"
    where = (f"checkpoint {record['checkpoint']} is saved" if record.get("checkpoint")
             else "no checkpoint was written")
    return StoppedJobRestarted(
        f"torchrun restart {restart_count()}: not training on: this job was stopped by {name} at step "
        f"{record.get('step')} ({where}), and torchrun --max-restarts restarts ranks that exit non-zero; each "
        f"restart ends here (exit {code}); to continue, start the job again with --resume", code)


def clear_stopped_job(out: Path) -> None:
    """A run that takes the folder drops the record of an earlier stopped job."""
    try:
        (Path(out) / STOPPED_NAME).unlink(missing_ok=True)
    except OSError:
        pass


# ---------------------------------------------------------------- the same error in two attempts torchrun restarted

ERROR_PREFIX = ".torchrun_error_"
"""In ``output.dir``: ``.torchrun_error_<N>.json``, the first unexpected error (or hang) of attempt N of a torchrun
job (its ``TORCHELASTIC_RESTART_COUNT``) and the job's agents, left by the rank that failed."""

_RUN_FOLDER: list[Path] = []
"""This rank's ``output.dir``, once :func:`decide_resume <dstrain.trainers.common.decide_resume>` has it."""


class RepeatedErrorRestarted(StoppedJobRestarted):
    """torchrun restarted a job whose last two attempts failed with the same error at the same point."""


def note_run_folder(out: Path) -> None:
    _RUN_FOLDER[:] = [Path(out)]


def note_attempt_error(signature: str, code: int = 1) -> None:
    """Leave this attempt's first error (:func:`dstrain.rank_exit.error_signature`) and its exit status in the run
    folder, for the next attempt torchrun restarts (no-op outside torchrun, or before the run folder is known)."""
    if not _AGENTS or not _RUN_FOLDER:
        return
    record = json.dumps({"error": signature, "code": int(code), "torchrun_agents": list(_AGENTS)}) + "\n"
    try:
        fd = os.open(_RUN_FOLDER[0] / f"{ERROR_PREFIX}{restart_count()}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError:
        return  # another rank's came first (or the folder is gone)
    try:
        os.write(fd, record.encode(errors="replace"))
    finally:
        os.close(fd)


def _attempt_error(out: Path, attempt: int, job_agents: list[str]) -> tuple[str | None, int]:
    """(error, exit status) attempt ``attempt`` of this job left (:func:`note_attempt_error`), else (None, 1)."""
    try:
        record = json.loads((Path(out) / f"{ERROR_PREFIX}{attempt}.json").read_text())
        error, code, saved = record["error"], int(record.get("code", 1)), record["torchrun_agents"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None, 1
    return (error, code) if isinstance(error, str) and _same_job(saved, job_agents) else (None, 1)


def repeated_error_problem(out: Path, job_agents: list[str]) -> RepeatedErrorRestarted | None:
    """At torchrun restart N: the error to leave with, else None, when the attempt before ended in a way ``dstrain
    launch --max-restarts`` does not restart (a non-finite loss under ``train.nonfinite=stop``, exit 3; a checkpoint
    the disk could not hold, exit 4: :data:`dstrain.supervise.NO_RESTART`), or when attempts N-2 and N-1 failed
    with the same error at the same point (a deterministic error: :func:`dstrain.supervise.repeated`). This attempt
    then leaves the same record (:func:`note_attempt_error`), so that every later restart leaves too."""
    from dstrain.supervise import NO_RESTART, repeated
    n = restart_count()
    if n < 1:
        return None
    last, code = _attempt_error(out, n - 1, job_agents)
    if last is not None and code in NO_RESTART:
        note_attempt_error(last, code)
        return RepeatedErrorRestarted(
            f"torchrun restart {n}: not training on: the attempt before ended with exit {code} ({last}), which "
            "every restart would meet again (dstrain launch --max-restarts does not restart it); torchrun "
            f"--max-restarts restarts ranks that exit non-zero, and each restart ends here (exit {code})", code)
    before = _attempt_error(out, n - 2, job_agents)[0] if n >= 2 else None
    if not repeated(before, last):
        return None
    note_attempt_error(last)
    return RepeatedErrorRestarted(
        f"torchrun restart {n}: not training on: this job failed twice in a row with the same error at the same "
        f"point: {last} (a deterministic error, which every restart would meet again; torchrun "
        "--max-restarts restarts ranks that exit non-zero, and each restart ends here): fix it, then start the "
        "job again with --resume", 1)


def clear_attempt_errors(out: Path) -> None:
    """A run that is no torchrun restart drops the error records of earlier jobs' attempts."""
    try:
        names = [p for p in Path(out).iterdir() if p.name.startswith(ERROR_PREFIX)]
    except OSError:
        return
    for path in names:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
