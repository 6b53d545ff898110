"""Batches built ahead of the step that needs them, in a worker process.

A trainer whose batches are made on the host by Python code (HRM's Sudoku augmentation:
about 30 ms for 384 puzzles on one core) would otherwise do that work between two
device steps, where the device waits for it. :class:`StepPrefetcher` runs the batch
function for the next ``depth`` steps in a worker process (its own interpreter, so it
does not compete for the trainer's GIL) while the device works; ``get(step)`` then
only collects a finished result.

The batch function must depend on the step alone (every dstrain dataset does: the data
order needs no saved state), so prefetched batches are exactly those the trainer would
build itself, after a resume too. It is pickled once, at start-up; each request then
sends only a step number. The worker is a fresh ``python -c`` interpreter talking over
its stdin and stdout: neither forked from a trainer that holds CUDA contexts and
communication threads, nor importing the trainer's ``__main__`` (as multiprocessing's
spawn would: a script without a ``__main__`` guard would start a second trainer). What
the batch function prints goes to stderr.

A worker that dies (killed, out of memory) is reported once on stderr and the batches
are built in the trainer from then on; an exception raised by the batch function is
raised again by ``get`` for that step.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Callable

_CHILD = "from dstrain.data.prefetch import _serve; _serve()"


def _serve() -> None:
    """The worker: read the batch function, then steps; answer ``(step, ok, batch or exception)``. It leaves when
    the trainer closes its stdin (or exits); Ctrl-C, which reaches the whole process group, is the trainer's to
    handle (it saves and stops), so the worker ignores SIGINT rather than die with a traceback mid-save."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the protocol owns the original stdout; prints of the batch function go to stderr
    inp = sys.stdin.buffer
    make = pickle.load(inp)
    while True:
        try:
            step = pickle.load(inp)
        except EOFError:
            return
        try:
            answer = (step, True, make(step))
        except Exception as err:  # noqa: BLE001 - handed to the trainer, which raises it
            answer = (step, False, err)
        try:
            data = pickle.dumps(answer)
        except Exception as err:  # noqa: BLE001 - an unpicklable exception (or batch)
            data = pickle.dumps((step, False, RuntimeError(f"batch of step {step}: {err!r}")))
        out.write(data)
        out.flush()


class StepPrefetcher:
    """``get(step)`` returns ``make(step)``; steps ``step+1 .. step+depth`` are built meanwhile."""

    def __init__(self, make: Callable[[int], Any], depth: int = 4):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth}")
        self.make, self.depth = make, depth
        self._wanted: set[int] = set()  # asked for and not yet collected
        self._ready: dict[int, tuple[bool, Any]] = {}
        self._cv = threading.Condition()
        self._dead = False
        payload = pickle.dumps(make)  # an unpicklable function fails here, before a worker starts
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        self._send(payload, raw=True)
        self._reader = threading.Thread(target=self._read, name="dstrain-prefetch", daemon=True)
        self._reader.start()

    def get(self, step: int) -> Any:
        """The batch of ``step``: collected from the worker when it was asked for, else built here."""
        window = set(range(step + 1, step + 1 + self.depth))
        with self._cv:
            answer = None
            if step in self._wanted:
                self._cv.wait_for(lambda: step in self._ready or self._dead)
                answer = self._ready.pop(step, None)
            self._wanted &= window  # after a jump: answers still to come for other steps are dropped
            self._ready = {s: a for s, a in self._ready.items() if s in window}
            dead, new = self._dead, sorted(window - self._wanted)
            if not dead:
                self._wanted |= window
        if dead:
            self._report()
        else:
            for s in new:
                self._send(s)
        if answer is None:
            return self.make(step)
        ok, value = answer
        if ok:
            return value
        raise value

    def _send(self, obj, raw: bool = False) -> None:
        try:
            self._proc.stdin.write(obj if raw else pickle.dumps(obj))
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # ValueError: the pipe was closed
            with self._cv:
                self._dead = True
                self._cv.notify_all()

    def _read(self) -> None:
        try:
            while True:
                step, ok, value = pickle.load(self._proc.stdout)
                with self._cv:
                    if step in self._wanted:
                        self._ready[step] = (ok, value)
                        self._cv.notify_all()
        except Exception:  # noqa: BLE001 - EOF or a broken stream: the worker is gone
            with self._cv:
                self._dead = True
                self._cv.notify_all()

    def _report(self) -> None:
        if self._proc is not None:
            print("dstrain: the data prefetch worker stopped; batches are built in the trainer from now on",
                  file=sys.stderr, flush=True)
            self.close()

    @property
    def alive(self) -> bool:
        """Whether batches still come from the worker."""
        return self._proc is not None and not self._dead

    def close(self) -> None:
        """Stop the worker (answers still to come are dropped)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with self._cv:
            self._dead = True
            self._wanted.clear()
            self._ready.clear()
            self._cv.notify_all()
        try:
            proc.stdin.close()  # EOF: the worker leaves its loop
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._reader.join(timeout=10)
        proc.stdout.close()

    def __enter__(self) -> "StepPrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
