"""Automatic restart of a failed job from its latest complete checkpoint (``dstrain launch --max-restarts K``).

The launcher runs the whole job (every rank, through the deepspeed or torchrun
launcher) as one attempt. When an attempt fails (a rank killed, an exception on one
rank, a collective that timed out: the launcher ends the other ranks and returns
non-zero), the job is started again with ``--resume``, so each rank continues from
the latest complete checkpoint, at most K times. Lost work is at most one checkpoint
interval. Not restarted: success, a configuration refusal (exit 2: it would fail the
same way), a run stopped on a non-finite loss (exit 3, ``train.nonfinite=stop``: its
checkpoint holds the last good state, and a deterministic run would meet the same
numbers again), a checkpoint the disk could not hold (exit 4: every retry would fail at the
same save), and a stop asked for by a signal (128 + N: SIGINT/SIGTERM/SIGHUP to the launcher, or
SIGINT/SIGTERM/SIGUSR1 to a rank, which saves a checkpoint and exits 128 + N: whoever sent it, a user
or a scheduler's preemption, decides whether the run continues, with ``--resume``).
A rank ended by the hang watchdog (exit 124) is restarted like any failure, except as below.

Nor is a deterministic error restarted for ever: when two attempts in a row end with the same unexpected error
(exception type and message, as the first failing rank left it) in the same phase of the same step, the second
resumed from the checkpoint the first did and met it again, and so would every other restart (each costing a
start-up, and the error buried under them): the launch stops there with one line naming it. A lost node, a
killed rank or an error at another step (a flaky file system, a collective that timed out) differs, or leaves
no error (a signal), and is restarted as before. So is an error that names its environment rather than the
job (:data:`TRANSIENT`: a full disk or quota, a timeout, a dropped connection, NCCL/the process group), even
when two attempts print the same line: the user may be clearing the disk, the fabric may recover.
A hang counts as an error here (:func:`dstrain.rank_exit.hang_signature`: the phase and step the first rank's
watchdog named): one that recurs in the same phase of the same step in two attempts in a row ends the restarts
too (a deadlock in the code, a collective only some ranks reach), where each restart cost
``train.collective_timeout_s`` of waiting and the hang stayed buried. A hang in a save is the file system's
(saves fall on the same steps in every attempt): restarted as before. A torchrun job restarted by torchrun's
own ``--max-restarts`` keeps the same rule through its run folder (:mod:`dstrain.elastic`).
"""
from __future__ import annotations

import re
import signal
import time
from typing import Callable

#: Exit statuses that are not failures to retry.
NO_RESTART = {0, 2, 3, 4} | {128 + s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}

#: What in an error's line names a cause outside the job, which a restart may no longer meet.
TRANSIENT = re.compile(r"no space left on device|errno 28\b|disk quota exceeded|errno 122\b|file write failed|"
                       r"timed? ?out|timeout|watchdog|connection (?:reset|refused|aborted|closed)|broken pipe|"
                       r"nccl|distbackenderror|distnetworkerror|gloo|stale file handle|input/output error",
                       re.IGNORECASE)


def repeated(seen: str | None, now: str | None) -> bool:
    """Whether an attempt's error ``now`` is the previous attempt's ``seen`` again, and not one of the
    environment (:data:`TRANSIENT`, or a hang in a save: :func:`dstrain.rank_exit.environment_hang`): a
    deterministic error, which no restart gets past."""
    from dstrain.rank_exit import environment_hang
    return now is not None and now == seen and not TRANSIENT.search(now) and not environment_hang(now)


def run_with_restarts(attempt: Callable[[bool], int], max_restarts: int, log: Callable[[str], None],
                      latest: Callable[[], str | None] = lambda: None, pause: float = 1.0,
                      error: Callable[[], str | None] = lambda: None) -> int:
    """Run ``attempt(resume)`` until it succeeds, is not retryable, or ``max_restarts`` restarts are spent.

    ``attempt(False)`` is the first run (it may itself resume, as the user asked);
    restarts call ``attempt(True)``. ``latest()`` names the checkpoint a restart will
    continue from (for the log); ``error()`` the last attempt's first unexpected error and where
    (None: none left, as for a rank killed by a signal). Returns the last attempt's exit status.
    """
    if max_restarts < 0:
        raise ValueError(f"max_restarts must not be negative, got {max_restarts}")
    code = attempt(False)
    seen = error() if code not in NO_RESTART else None
    for n in range(1, max_restarts + 1):
        if code in NO_RESTART:
            return code
        where = latest()
        log(f"dstrain: job failed (exit {code}); restart {n}/{max_restarts} "
            + (f"from checkpoint {where}" if where else "from the start (no complete checkpoint yet)"))
        time.sleep(pause)  # ports and shared memory of the dead attempt are released
        code = attempt(True)
        now = error() if code not in NO_RESTART else None
        if repeated(seen, now):
            left = max_restarts - n
            log(f"dstrain: job failed again with the same error at the same point: {now}; not restarting it "
                f"({left} restart(s) left unused: a deterministic error, which every restart would meet again): "
                "fix it, then --resume")
            return code
        seen = now
    if code not in NO_RESTART and max_restarts:
        log(f"dstrain: job failed (exit {code}) after {max_restarts} restart(s); giving up")
    return code
