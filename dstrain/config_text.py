"""The one line for a run config file that is not plain JSON (``dstrain.config.read_json``).

Run configs are read as strict JSON; the DeepSpeed JSONs they name are read as DeepSpeed reads them (hjson:
comments and trailing commas allowed). A run config written in that looser form, or an empty file, is named
as such rather than with the JSON parser's bare position.
"""
from __future__ import annotations

import json


def invalid_json_problem(text: str, err: json.JSONDecodeError) -> str:
    """What is wrong with ``text``, which ``json.loads`` refused with ``err``."""
    if not text.strip().lstrip("\ufeff"):
        return "the file is empty; a run config is a JSON object such as models/gpt/recipes/tiny.json"
    where = f"invalid JSON at line {err.lineno} column {err.colno}: {err.msg}"
    try:
        import hjson
        loose = hjson.loads(text)
    except Exception:  # noqa: BLE001 - not hjson either: the JSON error is the one to show
        return where
    if isinstance(loose, dict):
        return (f"{where}: run configs are plain JSON, without the comments or trailing commas that DeepSpeed's "
                "own JSON files may have; remove them")
    return where


def section_error_key(prefix: str, message: str) -> str:
    """The key a section's own check names (``task.path must name ...`` -> ``task.path``), so that a bad value
    given on the command line is blamed on the command line; else the section (``task``)."""
    import re
    named = re.match(rf"{re.escape(prefix)}[A-Za-z_][A-Za-z0-9_]*(?=[\s:,]|$)", message) if prefix else None
    return named.group(0) if named else prefix.rstrip(".")


def folder_problem(path) -> str:
    """What to say when a folder is named where a JSON file goes (``dstrain launch models/gpt/recipes``)."""
    from pathlib import Path
    files = sorted(Path(path).glob("*.json")) or sorted(Path(path).glob("*/*.json"))
    named = ", ".join(str(f) for f in files[:4]) + (", ..." if len(files) > 4 else "")
    return "is a folder, not a JSON file: name a file" + (f", e.g. {named}" if named else "")


def missing_file_problem(path) -> str:
    """What to say when a recipe path names nothing (``dstrain launch models/gpt/recipes/tine.json``): the OS's
    words, and the file meant where each missing part of the path is close to one name beside it."""
    import difflib
    from pathlib import Path
    path = Path(path)
    guess = Path(path.anchor) if path.is_absolute() else Path()
    for part in path.parts[1:] if path.anchor else path.parts:
        if (guess / part).exists():
            guess = guess / part
            continue
        try:
            names = [p.name for p in guess.iterdir()] if str(guess) else []
        except OSError:
            names = []
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.6) if names else []
        if not close:
            guess = None
            break
        guess = guess / close[0]
    if guess is not None and guess.is_file():
        return f"cannot read: No such file or directory (did you mean {guess}?)"
    shipped = shipped_recipes_named(path.name)  # `dstrain launch tiny.json`: the recipe's name without its folder
    if shipped:
        return f"cannot read: No such file or directory (did you mean {' or '.join(shipped)}?)"
    return "cannot read: No such file or directory"


def shipped_recipes_named(name: str) -> list[str]:
    """The shipped recipes (``models/*/recipes/*.json`` beside the ``dstrain`` package) whose file name is ``name``
    (``.json`` may be left off) or, failing that, close to it; as paths from here where they lie below it."""
    import difflib
    import os
    from pathlib import Path
    if not name:
        return []
    recipes = sorted(Path(__file__).resolve().parents[1].glob("models/*/recipes/*.json"))
    stem = name.removesuffix(".json")
    found = [r for r in recipes if r.stem == stem]
    if not found:
        close = set(difflib.get_close_matches(stem, [r.stem for r in recipes], n=2, cutoff=0.75))
        found = [r for r in recipes if r.stem in close]
    here = Path.cwd().resolve()
    return [os.path.relpath(r, here) if r.is_relative_to(here) else str(r) for r in found[:3]]


def decode_recipe(raw: bytes, source: str) -> str:
    """A recipe file's bytes as text: UTF-8, with a leading byte-order mark dropped (editors on Windows write one);
    UTF-16 (PowerShell's ``>``: a BOM, or a NUL byte beside each ASCII character) is named rather than refused as
    a JSON position."""
    from dstrain.config import ConfigError
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(raw) > 1 and (raw[0] == 0) != (raw[1] == 0)):
        raise ConfigError(source, "", "cannot read: UTF-16 text, not UTF-8; save the file as UTF-8")
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:  # a binary file (a checkpoint's .pt)
        raise ConfigError(source, "", "cannot read: not UTF-8 text") from None


class DuplicateKeyError(ValueError):
    """A key written twice in one JSON object (Python's json keeps the last silently)."""

    def __init__(self, key: str):
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def no_duplicate_keys(pairs: list) -> dict:
    """``json.loads``' (and hjson's) object_pairs_hook for run configs and DeepSpeed JSONs alike: a
    :class:`DuplicateKeyError` for a key written twice in one object."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key)
        out[key] = value
    return out


def duplicate_key_problem(text: str, key: str) -> str:
    """The run config's line for ``key`` written twice in ``text`` (dropping, e.g., a whole ``"train"`` section
    written earlier), naming the line of each."""
    import re
    lines = [text.count("\n", 0, m.start()) + 1 for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
    where = f" (lines {', '.join(map(str, lines))})" if len(set(lines)) > 1 else ""
    return f"written twice in one object{where}; JSON keeps only the last silently: keep one"
