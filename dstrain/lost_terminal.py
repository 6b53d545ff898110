"""Output to a terminal that went away: a run started without ``nohup`` from an ssh session that ended.

The ssh server hangs up the session's terminal: ``dstrain launch`` gets SIGHUP and stops the job as for
Ctrl-C (its ranks save a checkpoint and leave, 128 + 1), but every write to that terminal now fails with EIO
(EPIPE where the output went through a pipe, ``| tee``, whose reader died). The ranks write to it too (the
launchers pass their stdout on), so a rank's next ``print`` (a step's line, the stop's own line) raised: the
rank ended in an ``OSError`` before its stop's checkpoint was written, and the launcher in a traceback.
:func:`guard` makes such a stream swallow what it can no longer show: the first failed write sends its file
descriptor to ``/dev/null`` (native writers, gloo's and NCCL's, too) and the run goes on; its records
(``metrics.jsonl``, ``summary.json``, checkpoints) are files and lose nothing.
"""
from __future__ import annotations

import errno
import os
import sys

LOST = (errno.EIO, errno.EPIPE, errno.ENXIO)
"""A terminal hung up (EIO, ENXIO) or a pipe whose reader is gone (EPIPE)."""


class TolerantStream:
    """``stream``, whose writes and flushes that fail for a lost terminal or pipe are dropped from then on."""

    def __init__(self, stream):
        self._stream = stream
        self.lost = False

    def _drop(self, err: OSError) -> None:
        if err.errno not in LOST:
            raise err
        self.lost = True
        try:  # later writes, buffered text and native code's writes all go nowhere instead of failing
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError):
            pass

    def write(self, text):
        if not self.lost:
            try:
                return self._stream.write(text)
            except OSError as err:
                self._drop(err)
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except OSError as err:
                self._drop(err)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def guard() -> None:
    """Wrap this process's own ``sys.stdout`` and ``sys.stderr`` (not a test's capture of them), once."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and stream is getattr(sys, f"__{name}__"):
            setattr(sys, name, TolerantStream(stream))
