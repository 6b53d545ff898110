"""Checkpoints that stall training only for the copy of the state to host memory.

DeepSpeed's ``save_checkpoint`` hands every file it writes to the engine's
*checkpoint engine* (``engine.checkpoint_engine.save(state_dict, path)``).
:class:`HostCopyWriter` takes that place: ``save`` copies the state's tensors to
host memory (a snapshot: training may change the live tensors as soon as it
returns) and queues the file for a background thread, which writes it under a
temporary name, fsyncs it and renames it into place.

:class:`Saver` is what a trainer calls. A save:

1. waits for the previous save to be finished (at most one in flight);
2. rank 0 clears a leftover incomplete folder of the same tag, every rank waits;
3. every rank snapshots its DeepSpeed state, its RNG and trainer extras (the stall);
4. in the background, each rank waits for its own files, then drops
   ``<tag>/written/rank_<r>``; rank 0 waits until every rank's marker is there and
   only then writes the metadata, ``COMPLETE`` and ``latest`` (and prunes old tags).

A kill at any point before step 4's ``COMPLETE`` leaves the previous complete
checkpoint as the latest (``checkpoint.find_latest`` trusts nothing else). The
background thread issues no collective: ranks meet through the files of the
checkpoint folder, which must be shared by all ranks, as for synchronous saves.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

WRITTEN = "written"


def to_host(obj):
    """A copy of ``obj`` whose tensors are fresh host-memory copies (containers rebuilt, other objects shared)."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) is not dict else {}
        for key, value in obj.items():
            out[key] = to_host(value)
        return out
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_host(v) for v in obj)
    return obj


def write_file(obj, path: str | Path) -> None:
    """``torch.save`` under a temporary name, fsync, rename: a reader sees all of the file or none."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _make_writer_class():
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class HostCopyWriter(CheckpointEngine):
        """DeepSpeed checkpoint engine: snapshot to host in ``save``, write in a background thread."""

        def __init__(self):
            super().__init__()
            self.name = "dstrain.HostCopyWriter"
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dstrain-ckpt-write")
            self._pending: list[Future] = []
            self.copy_s = 0.0
            """Seconds spent copying state to host memory since the caller last reset it."""

        def create(self, info):
            pass

        def save(self, state_dict, path: str):
            start = time.perf_counter()
            snapshot = to_host(state_dict)
            self.copy_s += time.perf_counter() - start
            self._pending.append(self._pool.submit(write_file, snapshot, path))

        def load(self, path: str, map_location=None):
            return torch.load(path, map_location=map_location, weights_only=False)

        def commit(self, info):
            return True

        def preserves_storage_sharing(self):
            return False  # save() copies every tensor itself; DeepSpeed need not clone first

        def wait(self) -> None:
            """Block until every queued file is on disk; re-raise a write error."""
            pending, self._pending = self._pending, []
            for future in pending:
                future.result()

    return HostCopyWriter


def install_writer(ds_engine):
    """Replace the DeepSpeed engine's checkpoint engine by a :class:`HostCopyWriter`; return it."""
    writer = _make_writer_class()()
    ds_engine.checkpoint_engine = writer
    return writer


def wait_for_markers(folder: Path, world_size: int, timeout_s: float, poll: float = 0.05) -> None:
    """Until ``folder`` holds ``rank_<r>`` for every rank; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    names = {f"rank_{r:05d}" for r in range(world_size)}
    while True:
        if folder.is_dir() and names <= {p.name for p in folder.iterdir()}:
            return
        if time.monotonic() > deadline:
            missing = sorted(names - ({p.name for p in folder.iterdir()} if folder.is_dir() else set()))
            raise TimeoutError(f"{folder.parent.name}: ranks did not finish writing within {timeout_s:g}s "
                               f"(missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
        time.sleep(poll)


class BackgroundFinisher:
    """One background job at a time: the tail of an asynchronous save."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dstrain-ckpt-finish")
        self._job: Future | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        self.wait()
        self._job = self._pool.submit(fn)

    def wait(self) -> None:
        job, self._job = self._job, None
        if job is not None:
            job.result()

    @property
    def busy(self) -> bool:
        return self._job is not None and not self._job.done()
