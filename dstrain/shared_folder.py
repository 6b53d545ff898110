"""Is ``output.dir`` one folder for every rank? Checked once when a run starts, before anything is trained.

Every rank writes its part of each checkpoint (its ZeRO optimizer shard, under ZeRO-3 its weights too) into
``output.dir``; rank 0 writes ``COMPLETE`` once every rank has finished. When the hosts of a multi-host job do not
share the folder (a path on a local disk of each machine, ``/scratch/run``, a file system mounted on
the first host only), each host's ranks write into a folder of their own: the run trains to the end and every
checkpoint on the first host is marked complete without the other hosts' shards, found damaged only by the
``--resume`` that needs it. So rank 0 writes a file of a name no earlier run used (:func:`write_marker`), every
rank looks for it (:func:`problem`), and every rank learns which hosts did not see it.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from typing import Callable

from dstrain import runtime

PREFIX = ".dstrain.shared-check."
WAIT_S = 10.0  # a file system whose other clients see a new file a moment late (attribute caches); waited only
# where the file is not seen, so only a folder that is not shared pays it


def write_marker(out: Path) -> str | None:
    """Rank 0: the marker's name, the file written, synced and closed (NFS shows a closed file's data to the
    next open on another client); None when it cannot be written (the run's own writes will say why)."""
    name = f"{PREFIX}{os.getpid()}.{secrets.token_hex(6)}"
    try:
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, _host().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return None
    return name


def _sees(out: Path, name: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if (out / name).is_file():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


_gather = runtime.all_gather_object  # (every rank's (host, seen); tests stand in for it here)


def _host() -> str:
    return socket.gethostname()


def problem(out: Path, name: str | None, is_main: bool, gather: Callable | None = None,
            wait_s: float | None = None) -> str | None:
    """On every rank (a collective): why ``out`` is not one folder for all ranks, else None. ``name`` is rank 0's
    marker (None: nothing to check); rank 0 removes it once every rank has looked."""
    if name is None:
        return None
    seen = is_main or _sees(out, name, WAIT_S if wait_s is None else wait_s)
    every = (gather or _gather)((_host(), seen))
    if is_main:
        try:
            (out / name).unlink()
        except OSError:
            pass
    blind = sorted({h for h, seen in every if not seen})
    if not blind:
        return None
    first = every[0][0]
    ranks = [r for r, (_, seen) in enumerate(every) if not seen]
    return (f"output.dir {out} is not one folder for every rank: the ranks on {', '.join(blind)} (rank"
            f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}) do not see the file rank 0 on {first} "
            "wrote there, and each rank writes its part of every checkpoint into it; put output.dir on a file system "
            "every host mounts at the same path (NFS, Lustre, ...)" + _same_host_note(out, first, blind))


def _same_host_note(out: Path, first: str, blind: list[str]) -> str:
    """Ranks on rank 0's own host that do not see its file share that host's disks: their ``output.dir`` names
    another folder (a relative path read from another working directory, or a container of their own)."""
    if first not in blind:
        return ""
    relative = "" if out.is_absolute() else f" ({out} is relative: each rank reads it from its own working directory)"
    return (f"; ranks on {first}, rank 0's own host, do not see it either: they resolve output.dir to another "
            f"folder{relative}; start every rank in one working directory or give output.dir as an absolute path")
