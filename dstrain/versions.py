"""The same dstrain, torch, DeepSpeed and Python on every host of a job, checked before the first step.

Hosts of one job set up at different times (one checkout not pulled, one environment upgraded) ran
different code: ranks that pickle objects to each other, plan the same ZeRO partitions or reshard a
checkpoint each in their own way, failing later with an error far from its cause, or not at all.
Each rank therefore sends a small fingerprint (its host, and these versions: dstrain's as a digest of
its own source files, so that two checkouts of the same release that differ are told apart) in one
gather when the run starts, and every rank refuses a job whose fingerprints differ, in one line naming
the hosts and the versions that differ (:class:`dstrain.config.LaunchError`, exit 2: not restarted).
"""
from __future__ import annotations

import hashlib
import os
import platform
import socket
from pathlib import Path

_FINGERPRINT: list[dict] = []
"""This process's fingerprint, computed once."""

PACKAGES = ("dstrain", "torch", "deepspeed", "python")
"""What is compared (Python: major.minor only)."""


def _source_digest() -> str:
    """A short digest of the ``.py`` files of the ``dstrain`` and ``models`` packages (paths and contents)."""
    digest = hashlib.sha256()
    roots = [Path(__file__).resolve().parent]
    models = roots[0].parent / "models"
    if (models / "__init__.py").is_file():
        roots.append(models)
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            digest.update(f"{path.relative_to(root.parent).as_posix()}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()[:10]


def _dstrain_version() -> str:
    """dstrain's version as compared between hosts: the digest of its source only. The release an installation's
    metadata names is not part of it: a checkout on PYTHONPATH has none ("?"), and an editable install keeps the
    release it was installed at while its checkout moves on, so hosts running the same code were refused."""
    return f"source {_source_digest()}"


def fingerprint() -> dict:
    """This host's name and the versions :data:`PACKAGES` of this process."""
    if not _FINGERPRINT:
        import torch
        try:
            import deepspeed
            ds = getattr(deepspeed, "__version__", "?")
        except Exception:
            ds = "not importable"
        _FINGERPRINT.append({"host": socket.gethostname(), "dstrain": _dstrain_version(),
                             "torch": torch.__version__, "deepspeed": ds,
                             "python": ".".join(platform.python_version_tuple()[:2])})
    return dict(_FINGERPRINT[0])


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else \
        "ranks " + ",".join(map(str, ranks))


def skew_problem(prints: list[dict]) -> str | None:
    """One line naming every package whose version differs between ranks (``prints``: every rank's
    :func:`fingerprint`, in rank order) and the hosts with each version, else None."""
    parts = []
    for name in PACKAGES:
        seen: dict[str, dict[str, list[int]]] = {}  # version -> host -> ranks
        for rank, one in enumerate(prints):
            seen.setdefault(str(one.get(name, "?")), {}).setdefault(str(one.get("host", "?")), []).append(rank)
        if len(seen) > 1:
            parts.append(f"{name} " + ", ".join(
                f"{version} on " + " and ".join(f"{host} ({_ranks(ranks)})" for host, ranks in hosts.items())
                for version, hosts in seen.items()))
    if not parts:
        return None
    return ("the hosts of this job run different versions: " + "; ".join(parts)
            + ": install the same on every host (one checkout or environment for all), then launch again")


def check_same(world_size: int) -> None:
    """Every rank (collective): raise :class:`~dstrain.config.LaunchError` when the ranks' versions differ.
    Nothing is sent in a one-rank run; ``DSTRAIN_SKIP_VERSION_CHECK=1`` skips the check (a deliberate mix)."""
    if world_size <= 1 or os.environ.get("DSTRAIN_SKIP_VERSION_CHECK") == "1":
        return
    from dstrain import runtime
    from dstrain.config import LaunchError
    problem = skew_problem(runtime.all_gather_object(fingerprint()))
    if problem:
        raise LaunchError(problem)
