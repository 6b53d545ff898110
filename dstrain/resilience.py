"""Bad numbers and hangs: the non-finite policy and the step watchdog.

:class:`NonFiniteGuard` takes one all-reduce per optimizer step: every rank says
whether any of its micro-batch losses, or any gradient it computed (:class:`GradWatch`:
one ``isfinite`` reduction per parameter gradient, on the device), was NaN/Inf, and all
ranks learn the lowest rank that saw one, so they all take the same decision before
the optimizer step:

* ``skip``: the step's update is dropped on every rank (the base optimizer's ``step``
  does nothing for that one call: weights and Adam moments stay as they were; the
  gradients are discarded with DeepSpeed's usual zeroing; the learning-rate schedule
  and the data order move on). Skips are counted; ``max_consecutive_skips`` in a row
  raise :class:`NonFiniteError`.
* ``stop``: the update is not taken; the trainer saves the last good state (the
  previous step) and exits with :data:`EXIT_NONFINITE`, one line naming step and rank.

:class:`~dstrain.engine.engine.Engine` runs the check in its ``step`` once a guard is
attached (``Engine.watch``), so every trainer and every trained model of a trainer
(SCoRe's critics, value function and guidance model too) gets the same policy.
Gradients are not watched under fp16, where DeepSpeed's loss scaler owns overflows.

:class:`Watchdog` is a daemon thread that watches the phase the rank is in
(forward, backward, allreduce, step, save, eval ...). A phase that lasts longer than
the timeout is a hang: the thread prints which rank waited, in which phase of which
step, and ends the process with :data:`EXIT_HANG`; the launcher then ends the other
ranks and ``dstrain launch --max-restarts`` starts the job again from its latest
complete checkpoint (not a third time into the same hang at the same step and phase).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

EXIT_NONFINITE = 3
"""A run stopped on a NaN/Inf loss: not restarted automatically (it would fail the same way)."""
EXIT_HANG = 124
"""A rank ended by the watchdog: restarted by ``--max-restarts`` (unless the same hang, same phase and step, ended
the attempt before too, outside a save: :func:`dstrain.supervise.repeated`)."""


def torch_timeout_s(collective_timeout_s: float) -> float:
    """torch.distributed's own timeout: a little after the watchdog's, whose report (naming the
    phase) should come first; a collective stuck where the watchdog does not look still fails."""
    return collective_timeout_s + max(5.0, 0.1 * collective_timeout_s)


class NonFiniteError(RuntimeError):
    """The run met a non-finite loss it may not continue past (one-line message)."""

    exit_code = EXIT_NONFINITE

    def __init__(self, message: str, step: int, rank: int, good_step: int | None = None):
        super().__init__(message)
        self.step = step
        self.rank = rank
        self.good_step = good_step
        """Set by the deferred check (``Engine`` with ``train.nonfinite_check`` deferred): the step whose state
        the engine holds and may be saved (the bad step, its update skipped on the device); None: the trainer
        decides (``RunGuards.last_good``)."""


#: The number of the first stop signal this rank got (0 or False: none), set by the trainers' signal handler
#: (``trainers.common.StopFlag``); carried to every rank by the guard's per-step agreement
#: (``NonFiniteGuard.stop_agreed``), and the exit status (128 + N) of a run it stopped early.
STOP_REQUESTED = [False]


def _first_bad_ranks(flags: list[bool], rank: int, world_size: int) -> list[int | None]:
    """For each flag: the lowest rank where it is set (every rank gets the same answer), or None."""
    import torch
    from dstrain.runtime import all_reduce
    value = all_reduce(torch.tensor([rank if bad else world_size for bad in flags], dtype=torch.int64), "min")
    return [v if v < world_size else None for v in value.tolist()]


class GradWatch:
    """Notes, without waiting for the device, whether any gradient of ``module`` was NaN/Inf.

    A tensor hook on every trainable parameter adds the sum of its gradient (in fp32) into
    one scalar as each gradient is produced, before DeepSpeed reduces or partitions it (a
    non-finite local gradient makes the reduced one non-finite too). One NaN or Inf element
    makes its sum, and so the scalar, non-finite for good (inf - inf is NaN, NaN stays NaN),
    so ``take()`` reads one number: one reduction per gradient, no elementwise temporary
    (``isfinite`` per gradient cost 10-40x more on the CPU). A finite gradient whose sum leaves
    the fp32 range (|sum| > 3.4e38) also counts as non-finite. ``take()`` reads and clears it.
    """

    def __init__(self, module):
        import torch
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self._sum = torch.zeros((), dtype=torch.float32, device=device)
        self._handles = [p.register_hook(self._note) for p in params]

    def _note(self, grad):
        import torch
        self._sum.add_(grad.sum(dtype=torch.float32).to(self._sum.device))

    def take(self) -> bool:
        return bool(self.take_on_device())

    def take_on_device(self):
        """As ``take``, the answer left on the device (a bool tensor; no host wait)."""
        import torch
        bad = ~torch.isfinite(self._sum)
        self._sum.zero_()
        return bad

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class NonFiniteGuard:
    """Per-step agreement on non-finite losses and the bookkeeping of the chosen policy."""

    def __init__(self, policy: str, max_consecutive: int, rank: int, world_size: int):
        if policy not in ("skip", "stop"):
            raise ValueError(f"train.nonfinite must be skip or stop, got {policy!r}")
        self.policy = policy
        self.max_consecutive = max_consecutive
        self.rank, self.world_size = rank, world_size
        self.skipped = 0
        """Updates skipped so far (all models of the run)."""
        self.stop_agreed = False
        """A stop signal reached some rank; every rank learns it at the same step (in ``check``)."""
        self.consecutive = 0
        """Skips in a row of the model checked last (each model counts its own)."""
        self._in_a_row: dict[str, int] = {}

    def check(self, losses: list, step: int, grads_bad: bool = False, name: str = "") -> bool:
        """Call on every rank before the step's last ``engine.step()``; True: skip this update.

        ``losses``: this rank's micro-batch losses of the step; ``grads_bad``: whether one of
        its gradients was non-finite; ``name``: the model, named in messages when given.
        Raises :class:`NonFiniteError` under ``stop`` (nothing has been updated yet)
        and when too many steps in a row were skipped.
        """
        import torch
        loss_bad = bool(losses) and not bool(torch.isfinite(torch.stack([loss.detach().float().reshape(-1).sum()
                                                                          for loss in losses])).all())
        bad_loss, bad_grad, stop = _first_bad_ranks([loss_bad, grads_bad, STOP_REQUESTED[0]], self.rank,
                                                    self.world_size)
        return self._decide(bad_loss, bad_grad, stop, step, name)

    def record(self, step: int, loss_rank: int | None, grad_rank: int | None, stop: bool, name: str = "") -> bool:
        """``check`` for a step that already ran with its update skipped on the device when it was bad (the
        deferred check, ``Engine.settle``), given what every rank agreed on the device: the lowest rank with a
        non-finite loss or gradient, and whether a stop signal reached one. The same bookkeeping, messages and
        errors. Under ``stop`` the error's ``good_step`` is ``step``: the engine holds that step's state, its
        update not taken."""
        return self._decide(loss_rank, None if loss_rank is not None else grad_rank, 0 if stop else None, step,
                            name, good_step=step)

    def _decide(self, bad_loss, bad_grad, stop, step: int, name: str, good_step: int | None = None) -> bool:
        self.stop_agreed = self.stop_agreed or stop is not None  # every rank gets the same answer, same step
        if bad_loss is None and bad_grad is None:
            self.consecutive = self._in_a_row[name] = 0
            return False
        what, bad_rank = ("loss", bad_loss) if bad_loss is not None else ("gradient", bad_grad)
        where = f"non-finite {what} at step {step} on rank {bad_rank}" + (f" ({name})" if name else "")
        if self.policy == "stop":
            raise NonFiniteError(f"{where}: stopped (train.nonfinite=stop); the checkpoint holds the last "
                                 f"good state", step, bad_rank, good_step)
        self.skipped += 1
        self.consecutive = self._in_a_row[name] = self._in_a_row.get(name, 0) + 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteError(f"{where}: {self.consecutive} steps skipped in a row (train.max_consecutive_skips="
                                 f"{self.max_consecutive}); stopping", step, bad_rank, good_step)
        if self.rank == 0:
            print(f"dstrain: {where}: update skipped ({self.skipped} so far)", flush=True)
        return True


def base_optimizer(ds_engine):
    """The optimizer that updates weights and moments (inside ZeRO's or DeepSpeed's wrappers)."""
    import torch
    opt = ds_engine.optimizer
    seen = set()
    while hasattr(opt, "optimizer") and isinstance(getattr(opt, "optimizer"), torch.optim.Optimizer) \
            and id(opt) not in seen:
        seen.add(id(opt))
        opt = opt.optimizer
    return opt


@contextlib.contextmanager
def update_skipped(ds_engine):
    """Inside: the base optimizer's ``step`` is a no-op, so DeepSpeed's step only discards gradients."""
    opt = base_optimizer(ds_engine)
    opt.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del opt.step


NOTES_WAIT_S = 30.0
"""How long a firing :class:`Watchdog` waits for its notes to ``dstrain launch`` to be written before it ends the rank."""


class Watchdog:
    """Ends this rank when one phase of a step lasts longer than ``timeout_s``.

    ``phase(name, step)`` marks progress; ``pause()`` stops watching (between runs,
    or around work that may legitimately take long).
    """

    def __init__(self, rank: int, timeout_s: float, exit=os._exit, out=sys.stderr):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self._exit, self._out = exit, out
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._step = 0
        self._since = time.monotonic()
        self._stopped = threading.Event()
        self.fired: str | None = None
        folder = os.environ.get("DSTRAIN_FAILURE_DIR")  # shared by the job's ranks on this host
        from dstrain.rank_exit import is_launch_failure_dir
        if folder and is_launch_failure_dir(os.path.basename(folder.rstrip("/"))):
            folder = None  # a multi-host launch's, in output.dir: no heartbeat every few seconds on a network file
            # system, where a stalled server would block this thread too (and the hang of a save go unseen)
        self._beats = os.path.join(folder, "heartbeat") if folder else None
        self._thread = threading.Thread(target=self._watch, name="dstrain-watchdog", daemon=True)
        self._thread.start()

    last: tuple[str | None, int] = (None, 0)
    """(phase, step) this process was last in, kept after ``close`` (named when a collective fails)."""

    def phase(self, name: str, step: int | None = None) -> None:
        with self._lock:
            self._phase = name
            if step is not None:
                self._step = step
            self._since = time.monotonic()
            Watchdog.last = (name, self._step)

    def pause(self) -> None:
        with self._lock:
            self._phase = None

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(5.0, max(0.05, self.timeout_s / 20))
        while not self._stopped.wait(poll):
            with self._lock:
                phase, step, waited = self._phase, self._step, time.monotonic() - self._since
            self._beat(phase, step, waited)
            if phase is not None and waited > self.timeout_s:
                peers = stuck_peers(self._beats, self.rank, time.time() - waited, 3 * poll + 2) if self._beats else ""
                self.fired = (f"dstrain: hang: rank {self.rank} waited {waited:.0f}s in {phase} of step {step} "
                              f"(train.collective_timeout_s={self.timeout_s:g}){peers}; ending this rank")
                print(self.fired, file=self._out, flush=True)
                from dstrain.rank_exit import hang_signature, note_error, note_failed

                def notes():
                    note_failed(EXIT_HANG)  # dstrain launch returns 124, not the exit 1 of a peer it may see first
                    note_error(hang_signature(phase, step))  # the same hang twice in a row: not restarted again
                # (a multi-host launch's folder is on output.dir's file system, which may be what hangs: the rank
                # ends anyway after a while)
                noting = threading.Thread(target=notes, name="dstrain-watchdog-notes", daemon=True)
                noting.start()
                noting.join(NOTES_WAIT_S)
                self._exit(EXIT_HANG)
                return

    def _beat(self, phase: str | None, step: int, waited: float) -> None:
        """Leave this rank's phase, step and when it entered it for its peers on this host (:func:`stuck_peers`)."""
        if not self._beats:
            return
        try:
            os.makedirs(self._beats, exist_ok=True)
            path = os.path.join(self._beats, f"rank_{self.rank}")
            with open(path + ".tmp", "w") as f:
                f.write(f"{phase or '-'} {step} {time.time() - waited:.3f}\n")
            os.replace(path + ".tmp", path)
        except OSError:
            self._beats = None  # (a rank on another host: no such folder there)


def stuck_peers(folder: str, rank: int, my_since: float, stale_s: float, now: float | None = None) -> str:
    """What the ranks that wrote heartbeats into ``folder`` (:meth:`Watchdog._beat`) were doing, for the hang line
    of ``rank``, which entered its phase at ``my_since`` (wall clock): the peers that went silent for ``stale_s``
    (stopped, or dead) or that entered their phase well before ``my_since`` (busy, keeping the others waiting)."""
    now = time.time() if now is None else now
    found = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return ""
    for name in names:
        if not name.startswith("rank_") or name.endswith(".tmp") or name == f"rank_{rank}":
            continue
        try:
            path = os.path.join(folder, name)
            phase, step, since = open(path).read().split()
            silent = now - os.path.getmtime(path)
        except (OSError, ValueError):
            continue
        where = f"{phase} of step {step}" if phase != "-" else f"between phases after step {step}"
        if silent > stale_s:
            found.append(f"rank {name[5:]} silent for {silent:.0f}s (last in {where}: stopped or dead)")
        elif phase != "-" and float(since) < my_since - stale_s:
            found.append(f"rank {name[5:]} in {where} for {now - float(since):.0f}s")
    return "".join(f"; {one}" for one in found)
