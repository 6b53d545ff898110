"""Checks the benchmark scripts share for their own options: whole numbers in range, comma-separated lists of
them, and a result path that can be written, all judged before any measurement starts, so that a mistyped
value ends in one line under the script's usage (exit 2) instead of a traceback minutes later."""
from __future__ import annotations

import argparse
import math
from pathlib import Path


def count(least: int = 1):
    """An argparse ``type``: a whole number of at least ``least`` (``--steps 0`` and ``--nproc -1`` refused)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    parse.__name__ = "count"  # argparse names the type in some messages
    return parse


def counts(least: int = 1):
    """An argparse ``type``: comma-separated whole numbers of at least ``least`` (``--lengths 4096,8192``)."""
    one = count(least)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
        out = []
        for item in items:
            try:
                out.append(one(item))
            except argparse.ArgumentTypeError as err:
                raise argparse.ArgumentTypeError(err if len(items) == 1 else f"{item!r} in {text!r}: {err}") \
                    from None
        return out
    parse.__name__ = "counts"
    return parse


def number(least: float = 0.0, most: float | None = None, above: bool = False):
    """An argparse ``type``: a number at least ``least`` (above it, with ``above``) and at most ``most``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if math.isnan(value) or (value <= least if above else value < least) or (most is not None and value > most):
            span = f"above {least:g}" if above else f"at least {least:g}"
            raise argparse.ArgumentTypeError(f"must be {span}" + (f" and at most {most:g}" if most is not None
                                                                  else "") + f", got {text}")
        return value
    parse.__name__ = "number"
    return parse


def out_problem(path: str | Path, kind: str = "file", flag: str = "--out") -> str | None:
    """Why the result ``path`` (a ``file`` or a ``folder`` the script creates) cannot be written, else None:
    a folder where a file is meant or the reverse, a file in its path, no permission, a file system that
    refuses (judged as ``dstrain launch`` judges ``output.dir``)."""
    from dstrain.cli_checks import writable_problem
    path = Path(path).expanduser()
    if kind == "file":
        if path.is_dir():
            return f"{flag} {path}: is a folder; name the result file, e.g. {path / 'result.json'}"
        return writable_problem(path.parent, flag, path)
    if path.exists() and not path.is_dir():
        return f"{flag} {path}: is a file; name a folder (the results are written into it)"
    return writable_problem(path, flag)


def check_out(parser: argparse.ArgumentParser, path: str | Path | None, kind: str = "file",
              flag: str = "--out") -> None:
    """``parser.error`` (one line, exit 2) when ``path`` cannot be written; nothing for no path."""
    if path:
        problem = out_problem(path, kind, flag)
        if problem:
            parser.error(problem)
