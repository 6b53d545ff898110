"""What the guards of ``_guards.py`` are built on, taken before the program runs (it could patch the modules): the
functions they call, the caches they empty before each library call of a test, the closure cells and defaults of the
library's functions they compare; runs only inside a sandbox child.

Its text is put after ``_guards.py``'s and in front of ``_frames.py``'s, and executed in the same private globals
(see ``sandbox.py``). Importing it in the trainer defines functions and runs nothing.
"""


def _guard_tools(quiet: set, setup: str = "") -> tuple:
    """What the guards call, taken before the program runs (it could patch the modules);
    ``quiet``: the audit hook lets a thread listed there call ``sys.setprofile``; ``setup``: the task's
    setup, parsed now (``_rewrite._prepare_setup``) for :func:`_run_setup`."""
    import _thread
    import builtins
    import decimal
    import gc
    import re
    import sys
    import time

    global _LIFT
    _LIFT = _recursion_floor()
    # (decimal's context as it was: an operation on a ``Decimal`` runs in it, not in one the program set, where
    # ``Emin=0`` would round a wrong answer's difference to zero)
    context = (decimal.getcontext, decimal.setcontext, decimal.Context())
    # re's pattern caches, emptied before each library call of a test: an entry the program planted (its key
    # a pattern the test uses, its value a pattern that matches anything) would answer for the library
    caches = {k: (v, _holding_clear(v)) for k, v in vars(re).items() if k.startswith("_cache") and type(v) is dict}
    clears = tuple(_lru_holding_clear(getattr(re, k)) for k in ("_compile_repl", "_compile_template")  # (3.12: _cache2)
                   if hasattr(re, k))
    # and every ``functools.lru_cache`` of the loaded modules (``fnmatch._compile_pattern``, ``typing``'s), emptied
    # likewise: a result the program had it memoize while a global it reads was patched (``fnmatch.translate``,
    # then put back) would answer for the library later, with the module intact again
    state, codecs = _state_clears()  # noqa: F821  (_unaudited.py: zoneinfo, ABCs; codecs: only right before a call)
    clears += _lru_clears() + state
    strptime = sys.modules.get("_strptime")  # (its compiled formats: a pattern planted there would answer likewise)
    if type(strptime) is type(sys) and type(vars(strptime).get("_regex_cache")) is dict:
        clears += (_holding_clear(vars(strptime)["_regex_cache"]),)
    re_cache = (vars(re), caches, clears, codecs)
    # the C library's time zone (``TZ`` and ``time.tzset``): ``localtime``, ``mktime``, ``datetime.fromtimestamp`` and
    # ``strftime('%Z')`` read it, so a program that moved it three hours would make a wrong timestamp's hour right
    local, strftime = time.localtime, time.strftime

    def zone():
        return tuple((tuple(local(t)), strftime("%Z", local(t))) for t in (0, 1_700_000_000, 1_715_000_000))
    # the interpreter's own table of modules (the C code's imports read it, whatever ``sys.modules`` is bound to later)
    return (_thread_counter(), gc.disable, gc.callbacks, sys.setprofile, _thread.get_ident, quiet, context, vars(builtins),
            builtins, re_cache, _prepare_setup(setup), {}, sys.modules, (zone, zone()), _library_cells(),  # noqa: F821
            _frame_readers(), _namespaces_check([]))  # noqa: F821  (_namespaces.py: see there)


_LIFT = None  # the run's ``_recursion_floor()``, set by :func:`_guard_tools`


def _recursion_floor():
    """``lift()``: puts the recursion limit back up to what it was before the program ran, if the program lowered it
    (a higher limit it set stays). The limit is the interpreter's, so the judge's own code ran under the program's
    (red-team round 23): the copy of the setup's data stopped half-way through a list two of the setup's names shared,
    and the second name was kept as that half-made copy (``data = [[[5]]]`` then ``expected = data[0]``, kept as
    ``[]``: ``return []`` passed), or a default of a setup's function, too deep to copy, was put back as the program
    could change it (``check(v, ref=[[3]])``: reward 1); lower still, the judge's thread or the main thread failed
    with no verdict. The judge calls it after the program's top level, after each statement of the setup, before each
    test and before the verdict."""
    import sys

    get, put, floor = sys.getrecursionlimit, sys.setrecursionlimit, sys.getrecursionlimit()

    def lift() -> None:
        if get() < floor:
            put(floor)
    return lift


def _thread_counter():
    """``count(woke=True) -> int``: the threads ``_thread`` started that have not ended, as ``_thread._count`` says,
    plus those still ending. A thread's count drops before the interpreter clears what the thread keeps (its
    ``threading.local`` data, its context variables, its async generator hooks), and a finalizer there runs the
    program's code in that thread, for as long as it likes, while the judge, which counted it gone, checks a value and
    then uses it (a list's item set to an always-equal object of C callables in between: a third to a half of the
    tests of a setup's ``check(f(1))`` passed; red-team round 22). The kernel counts a thread until it has left:
    ``/proc/self/task`` has two links more than the process has threads, measured now, before the program runs,
    against ``_thread``'s count (``os.stat``: no audit event). A joined thread leaves microseconds after its count
    dropped, so an excess is waited for, 50 ms at most (``woke``: a list is told when the program's code may have run
    meanwhile; None: no wait).
    Without ``/proc``, ``_thread._count``."""
    import _thread
    import os
    import time

    count, stat, sleep, now, task = _thread._count, os.stat, time.sleep, time.monotonic, "/proc/self/task"
    try:
        others = stat(task).st_nlink - count()  # (the main thread and the two links of a folder)
    except OSError:
        return lambda woke=True: count()

    def threads(woke=True) -> int:
        n, until = count(), None
        while True:
            try:
                ending = stat(task).st_nlink - others - n
            except OSError:  # (it worked before the program ran)
                return n + 1
            if ending <= 0:
                return n
            if woke is None or until is not None and now() > until:
                return n + ending
            if until is None:
                until = now() + 0.05
            if woke is not True:
                woke[len(woke):] = [True]
            sleep(0.0005)
            n = count()

    return threads


_HELD = []
"""What the judge's clears took out of the library's caches (and what ``_setupdata`` replaces when it puts the setup
back), held until the process leaves (``os._exit``: no finalizer runs then). Dropped there, between a test's checks and
its library call (``_guards``' ``call`` and ``c_called_kept`` clear them), an object of the program's ran its finalizer
(``__del__``, a weak reference's callback) inside the judge, after the checks and after the caches were put back: it put
UTF-8's codec back under ``cp1252`` for the test's ``'\\u20ac'.encode('cp1252')``. Only what a cache held since its
last clear is kept."""


def _holding_clear(d: dict, then=None):
    """A clear of the library's cache ``d`` (an exact dict) that runs no code of the program's: what it held goes to
    :data:`_HELD` (a copy: no key is hashed or compared). ``then``: the cache's own clear, called instead of
    ``dict.clear`` (``functools.lru_cache``'s, whose entries the copy of its dict holds)."""
    copy, clear, held = dict.copy, dict.clear, _HELD

    def hold_and_clear():
        if dict.__len__(d):
            held.append(copy(d))
            if then is None:
                clear(d)
        if then is not None:
            then()
    return hold_and_clear


def _lru_holding_clear(w):
    """:func:`_holding_clear` for the ``functools.lru_cache`` wrapper ``w``, on the dict its C code keeps (the one
    referent of ``w`` that is a dict and not its ``__dict__``, once emptied); found before the program runs (the
    audit hook refuses ``gc.get_referents`` then). ``w.cache_clear`` if there is no such dict (a Python wrapper)."""
    import gc

    w.cache_clear()
    found = [r for r in gc.get_referents(w) if type(r) is dict and r is not getattr(w, "__dict__", None)]
    return _holding_clear(found[0], w.cache_clear) if len(found) == 1 else w.cache_clear


_LRU_CLEARS = (None, ())  # (the _SNAPSHOT they were found for, the functions): see _lru_clears


def _lru_clears() -> tuple:
    """The ``cache_clear`` of every ``functools.lru_cache`` wrapper that a loaded module, one of its classes or one
    of its dicts (``typing._caches``) holds, the ``re`` ones excepted (see :func:`_guard_tools`). Found once per
    snapshot of the loaded modules (``_snapshot._SNAPSHOT``, which the fork server takes, and this with it, before it
    forks: the walk takes milliseconds), before the program runs."""
    import functools
    import sys

    global _LRU_CLEARS
    if _LRU_CLEARS[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_snapshot.py)
        return _LRU_CLEARS[1]
    wrapper, found = functools._lru_cache_wrapper, {}
    for module in list(sys.modules.values()):
        if type(module) is not type(sys) or getattr(module, "__name__", None) == "re":
            continue
        for v in list(vars(module).values()):
            inner = list(vars(v).values()) if isinstance(v, type) else list(v.values()) if type(v) is dict else [v]
            for w in inner:
                w = getattr(w, "__func__", w) if type(w) in (staticmethod, classmethod) else w
                if type(w) is wrapper:
                    found[id(w)] = _lru_holding_clear(w)
    _LRU_CLEARS = (_SNAPSHOT, tuple(found.values()))  # noqa: F821
    return _LRU_CLEARS[1]


_CELLS = (None, ((), ()))  # (the _SNAPSHOT they were found for, (cells, defaults)): see _library_cells


def _shallow(x):
    """What a default value of a library function holds, if it is a list, a set or a dict (exact types: no program code
    runs), as a tuple to compare item by item; None for anything else."""
    tx = type(x)
    return tuple(dict.items(x)) if tx is dict else tuple(x) if tx is list or tx is set else None


def _library_cells() -> tuple:
    """``(((cell, contents), ...), ((function, defaults, kwdefaults, their items, what their lists and dicts hold),
    ...))`` for the library's functions (those the snapshot's classes and modules hold, and the functions their cells
    hold: ``Fraction.__sub__`` is a closure of ``_operator_fallbacks`` over ``Fraction._sub``). A cell's
    ``cell_contents``, a function's ``__defaults__`` and ``__kwdefaults__`` (or what they hold) can be changed with no
    audit event, and the library function, its class and its module unchanged, would then run what the program put
    there (a C callable: no Python frame for the profile guard either; ``copy.deepcopy``'s ``memo`` prefilled, ``json.
    dumps``' ``default``). Found once per snapshot, like :func:`_lru_clears`, before the program runs."""
    import types

    global _CELLS
    if _CELLS[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_snapshot.py)
        return _CELLS[1]
    function, todo, seen, found, defaulted = types.FunctionType, [], set(), [], []
    values = [v for rec in _SNAPSHOT[0].values() if rec[2] is not None for v in rec[2].values()]  # noqa: F821
    values += [v for rec in _SNAPSHOT[1].values() for v in rec[1].values()]  # noqa: F821
    for v in values:
        tv = type(v)
        f = v.__func__ if tv is classmethod or tv is staticmethod else v.fget if tv is property else v
        if type(f) is function:
            todo.append(f)
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        d, kw = f.__defaults__, f.__kwdefaults__
        if d is not None or kw is not None:  # (the lists, sets and dicts among them, with what they hold)
            held = tuple((x, _shallow(x)) for x in (*(d or ()), *(kw or {}).values()) if _shallow(x) is not None)
            defaulted.append((f, d, kw, _shallow(kw), held))
        for cell in f.__closure__ or ():
            try:
                x = cell.cell_contents
            except ValueError:  # (empty: nothing to keep)
                continue
            found.append((cell, x))
            if type(x) is function:
                todo.append(x)
    _CELLS = (_SNAPSHOT, (tuple(found), tuple(defaulted)))  # noqa: F821
    return _CELLS[1]
