"""The files a run writes into ``output.dir`` besides checkpoints and logs: whole or not at all on a full disk."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import sys
from pathlib import Path

from dstrain.config import RunConfig, RunFolderError


def _replace_whole(path: Path, text: str) -> None:
    """``path`` holds ``text`` or, when the write fails, what it held before (written beside it, then renamed).
    A file that was there keeps its permission bits (the new one would have the umask's: a folder's records made
    group-writable for a team, or kept private, changed mode at each resume)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        mode = None  # (none there yet: the umask's, as before)
    try:
        tmp.write_text(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_run_records(out: Path, cfg: RunConfig, ds_config: dict, plan_text: str) -> None:
    """Rank 0 writes ``run_config.json``, ``ds_config.json`` and ``plan.txt`` into ``out``, each whole or not at
    all (written beside it, then renamed): a full disk or a folder that cannot be written is one
    ``RunFolderError`` naming the file, the free space and the fix, and leaves the earlier file as it was (before:
    an ``OSError`` traceback, and a folder's ``run_config.json`` cut short by the full disk)."""
    from dstrain.rank_exit import _free_bytes, write_failure
    files = {"run_config.json": json.dumps(cfg.to_dict(), indent=2) + "\n",
             "ds_config.json": json.dumps(ds_config, indent=2) + "\n", "plan.txt": plan_text + "\n"}
    path = out
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = out / name
            _replace_whole(path, text)
    except OSError as err:
        from dstrain.engine.profiles import format_bytes
        free = _free_bytes(out)
        space = f", {format_bytes(free)} free there" if free is not None else ""
        raise RunFolderError(f"output.dir {out}: {path.name} could not be written ({write_failure(err) or err}"
                             f"{space}); nothing was trained and the folder's checkpoints are untouched: free "
                             f"space or make the folder writable, then start again") from err


def write_summary(out: Path, summary: dict) -> None:
    """Rank 0's ``summary.json`` once the run has ended. A full disk (or a folder gone) costs one warning: the
    run's checkpoints are saved by then. Before, the ``OSError`` came after the last save: a finished (or
    stopped) run ended in a traceback and exit 1, which ``--max-restarts`` restarted, and left the file cut short."""
    try:
        _replace_whole(Path(out) / "summary.json", json.dumps(summary, indent=2) + "\n")
    except OSError as err:
        print(f"dstrain: warning: {Path(out) / 'summary.json'} could not be written ({err.strerror or err}); the "
              f"run's checkpoints are saved, its summary is this: {json.dumps(summary)}", file=sys.stderr, flush=True)


def cache_space_problem(err: BaseException, cache: str | Path) -> str | None:
    """The one line for ``err``, raised while rank 0 fills its data cache ``cache`` (``datasets``' Arrow files,
    under ``output.dir``), when the disk is full or over quota; None for any other error. Before: the ``OSError``
    traceback of rank 0 (``datasets``: "Not enough disk space. Needed: Unknown size"), its peers waiting."""
    return disk_full_problem(err, cache, "the data cache", "nothing was trained")


def disk_full_problem(err: BaseException, where: str | Path, what: str, lost: str) -> str | None:
    """``<what> <where> could not be written (no space left on device, N free there); <lost>: free space, then
    start again`` when ``err`` (or an error it was raised from) is a full disk or an exceeded quota, else None."""
    seen, cause = set(), err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and (cause.errno in (errno.ENOSPC, errno.EDQUOT)
                                           or "Not enough disk space" in str(cause)):
            from dstrain.engine.profiles import format_bytes
            from dstrain.rank_exit import _free_bytes
            free = _free_bytes(Path(where))
            space = f"{format_bytes(free)} free there" if free is not None else "free space unknown"
            why = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left on device"
            return f"{what} {where} could not be written ({why}, {space}); {lost}: free space, then start again"
        cause = cause.__cause__ or cause.__context__
    return None
