"""The namespaces of the classes no program may change; runs only inside a sandbox child (its text follows
``_frames.py``'s, in the same private globals: see ``sandbox.py``).

``setattr`` refuses to change a built-in class (``str``, ``dict``) or an immutable one (``re.Pattern``), but its
``mappingproxy`` hands comparisons and ``|`` to the dict it wraps, and a dict subclass's reflected method goes first:
``str.__dict__ == D()`` gives ``D.__eq__`` the namespace itself. Written there, any method looked up by name (not the
slots: ``==``, ``len``) is the program's, in the judge's code and the library's alike, and the type cache keeps an
entry after it is put back. Nothing stops that write, so :func:`_namespaces_check` compares these namespaces, by
identity, with the snapshot's at every entry of the judge's code the program's control reaches (the guards, after the
program's code and each test, before the hook resolves a path and before the verdict): a change seen once makes the
run a violation; after each check that passes, the type cache is emptied. What runs with no check first (the hook,
the profile guard, the replacements of ``eval``, the verdict's encoding) calls functions bound before the program ran.
Not covered: a change made and undone between two checks by a finalizer the judge's code sets off, and the type
cache's borrowed entries (a freed object left there: memory corruption, which the layers below the hook contain).
"""

_FIXED = (None, ((), (), (), ()))  # (the _SNAPSHOT they were taken for, what _fixed_namespaces returns)


def _fixed_namespaces() -> tuple:
    """``(namespaces, sizes, values, names)`` of the snapshot's classes that ``setattr`` refuses: the dicts (from their
    proxies, before the hook refuses ``gc``), their sizes, what they hold in order and the names. Taken once per
    snapshot, before any program runs, like ``_guardtools._lru_clears``."""
    import gc

    global _FIXED
    if _FIXED[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_snapshot.py)
        return _FIXED[1]
    flags_of, dict_of = type.__dict__["__flags__"].__get__, type.__dict__["__dict__"].__get__
    heap, immutable = 1 << 9, 1 << 8  # Py_TPFLAGS_HEAPTYPE, Py_TPFLAGS_IMMUTABLETYPE
    namespaces = []
    for cls, _, _ in _SNAPSHOT[0].values():  # noqa: F821
        flags = flags_of(cls)
        if flags & heap and not flags & immutable:
            continue  # (a class the program can assign to: the judge checks it where it matters, see ``_judge``)
        inner = [d for d in gc.get_referents(dict_of(cls)) if type(d) is dict]
        if len(inner) == 1:
            namespaces.append(inner[0])
    names = tuple(k for d in namespaces for k in d)
    values = tuple(v for d in namespaces for v in dict.values(d))
    _FIXED = (_SNAPSHOT, (tuple(namespaces), tuple(map(len, namespaces)), values, names))  # noqa: F821
    return _FIXED[1]


def _namespaces_check(tripped: list):
    """``kept() -> bool``: whether every namespace of :func:`_fixed_namespaces` holds what it held, and has since the
    run began (``tripped`` is never emptied). Runs only C code bound now, never a method looked up by name."""
    import itertools
    import operator
    import sys

    namespaces, sizes, values, names = _fixed_namespaces()
    same, equal, clear, flat, contents = operator.is_, operator.eq, sys._clear_type_cache, \
        itertools.chain.from_iterable, dict.values
    each, every, size, pairs = map, all, len, zip

    def kept() -> bool:
        if tripped:
            return False
        # (the same number of entries in each, and the same objects in the same order: a name deleted and another
        # added moves every value after it; only C code runs, none looked up by name)
        if not (every(each(equal, each(size, namespaces), sizes))
                and every(each(same, flat(each(contents, namespaces)), values))):
            name = "a name added or deleted"
            for value, was, key in pairs(flat(each(contents, namespaces)), values, names):  # for the report
                if value is not was:
                    name = key
                    break
            tripped[:] = [f"the program changed the namespace of a built-in class ({name!r})"]
            return False
        clear()  # (an entry the program had looked up while it was changed, then put back, would still answer)
        return True

    return kept


def _hook_methods() -> tuple:
    """What the audit hook calls, bound before the program runs: methods of ``str``, ``bytes``, ``int``, ``list`` and
    ``set`` (a ``str.startswith`` of the program's would let any path through), the C reader of a ``stat`` result's
    mode (``os.stat_result`` takes ``setattr``: a property ``st_mode`` calling a folder a file let the hook open one
    outside, whose descriptor an ``os.open(..., dir_fd=)`` writes through), and an ``lstat`` using it for ``realpath``
    (a link called a file would lead it elsewhere than the kernel)."""
    import os
    import types

    mode_of = type.__dict__["__dict__"].__get__(os.stat_result)["st_mode"].__get__
    real_lstat, namespace = os.lstat, types.SimpleNamespace

    def lstat(path, *, dir_fd=None):  # (all ``posixpath.realpath`` reads of it: ``st_mode``)
        return namespace(st_mode=mode_of(real_lstat(path, dir_fd=dir_fd)))

    return (str.startswith, str.rstrip, str.rsplit, str.split, str.replace, str.__str__, bytes.decode, bytes.join,
            int.__index__, list.append, set.add, mode_of, lstat)


def _frame_readers() -> tuple:
    """``(f_globals, f_code, co_name)`` through the C descriptors, bound before the program runs, for the profile guard
    (a property ``f_code`` of the program's would be handed a frame whose ``f_back`` leads to the judge's)."""
    import types

    frame, code = type.__dict__["__dict__"].__get__(types.FrameType), type.__dict__["__dict__"].__get__(types.CodeType)
    return frame["f_globals"].__get__, frame["f_code"].__get__, code["co_name"].__get__
