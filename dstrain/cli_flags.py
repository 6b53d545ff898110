"""The one line for a mistyped command-line flag: the flags a parser knows that are close to it.

argparse refuses an unknown option (``--nprocs``, ``--max-restart``, ``--world_size``, ``--dryrun``) as
"unrecognized arguments" and names no alternative; dotted overrides already name the close key
(``dstrain.config``). These do the same for the options of ``dstrain``'s subcommands and of ``dstrain bench``.
"""
from __future__ import annotations

import argparse
import difflib


def long_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--flag`` the parser takes, hidden ones (``help=SUPPRESS``) left out."""
    return [o for a in parser._actions if a.help != argparse.SUPPRESS
            for o in a.option_strings if o.startswith("--")]


def close_flag(item: str, parser: argparse.ArgumentParser) -> str | None:
    """The parser's flag closest to ``item`` (``--nprocs`` -> ``--nproc``), if one is close."""
    if not item.startswith("--") or "." in item.split("=", 1)[0]:
        return None  # not a flag, or a dotted override (its key is checked by the run config)
    flag = item.split("=", 1)[0]
    flags = long_flags(parser)
    normal = {f.replace("_", "-").lower(): f for f in flags}
    if flag.replace("_", "-").lower() in normal:  # --world_size, --Dry-Run
        return normal[flag.replace("_", "-").lower()]
    close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_flags_problem(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """``unrecognized arguments: --nprocs (did you mean --nproc?)``."""
    hints = [f"{flag} takes no value" if flag == item.split("=", 1)[0] else  # --resume=true
             f"{item.split('=', 1)[0]}: did you mean {flag}?"
             for item in unknown if (flag := close_flag(item, parser))]
    return f"unrecognized arguments: {' '.join(unknown)}" + (f" ({'; '.join(hints)})" if hints else "")


def flags_written_as_overrides(overrides: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """The undotted ``--key=value`` items that are no top-level run config key but close to one of the
    parser's flags (``--nprocs=2``, ``--world_size=4``): a mistyped flag, not an override."""
    from dstrain.config import RunConfig, _field_types
    top = _field_types(RunConfig)
    return [o for o in overrides if "." not in o.split("=", 1)[0] and o[2:].split("=", 1)[0] not in top
            and close_flag(o, parser)]


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (its usage and flags), else ``parser`` itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return parser
