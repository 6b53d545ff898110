"""The values the task's setup bound and the lists and dicts a library module keeps, as each test reads them; runs
only inside a sandbox child (its text follows ``_namespaces.py``'s, in the same private globals: see ``sandbox.py``).

The setup runs in the program's namespace, so the tested function reaches what it bound through its own globals: a
test ``assert f(1) == expected`` with ``expected = [1, 2, 3]`` in the setup was passed by ``expected.clear()`` and
``return []``. A test reads a setup's name as the setup bound it (:func:`_run_setup`); for a value made only of
the built-in containers and scalars (by exact type: no method of the program's runs while it is copied) that now means
a copy of what the value held when the setup ended, one per test (two reads in one test, or two names that shared a
list, share the copy: ``sort_in_place(lst) is None and lst == [1, 2, 3]`` still sees the call's work). The program's
globals keep the originals, so its code never holds a test's copy unless the test hands it one. The same goes for
the plain data the setup's own functions and classes hold, which the program reaches through them: a function's
defaults (``def check(v, ref=[3])``: ``check.__defaults__[0][:] = [0]``, or ``__defaults__`` replaced), keyword
defaults and closure cells are put back, as fresh copies, before each call of the test's, and a class attribute
(``R.vals``) a test reads is a copy of its own, put back on the class before a call too (:func:`_setup_state`).

A list or dict a library module keeps is the module's own object, and the program's code can change it as well:
``keyword.kwlist.clear()`` in the tested function passed ``assert f('if') == ('if' in keyword.kwlist)``. A test that
reads one (``attr``) now gets a new one holding what it held before the program ran (:func:`_library_data`).
"""

_SETUP_DATA = {}  # name -> a copy of the setup's value, taken when the setup ended (never handed out)
_DICT_OF = type.__dict__["__dict__"].__get__  # (bound now: a class's namespace, whatever its metaclass says)
_SETUP_STATE = []  # (kind, holder, key, copy, plain): what the setup's functions and classes held (_setup_state)
# (bound now, before any program ran: a method looked up by name could be one the program wrote into the class)
_COPY_TOOLS = (list.copy, list.extend, dict.items, dict.__setitem__, dict.__contains__, dict.__getitem__, dict.pop,
               dict.clear, set.copy, set.add, dict.values)


def _plain_copy(value, memo: dict):
    """A copy of ``value`` when it is built only of exact ``list``, ``dict``, ``set``, ``frozenset``, ``tuple``,
    ``bytearray`` and immutable scalars (shared and cyclic parts stay so, through ``memo``: id -> copy), else
    ``memo[0]`` is set and what comes back is meaningless. Reads through the built-in classes' own functions."""
    lcopy, extend, items, setitem, contains, getitem, _, _, scopy, add, _ = _COPY_TOOLS
    kind = type(value)  # (compared by identity: ``in`` would call a metaclass's ``__eq__``)
    if any(kind is t for t in (int, float, complex, str, bytes, bool, type(None))):
        return value
    if contains(memo, id(value)):
        return getitem(memo, id(value))
    if kind is list:
        out = []
        setitem(memo, id(value), out)
        extend(out, [_plain_copy(x, memo) for x in lcopy(value)])
    elif kind is dict:
        out = {}
        setitem(memo, id(value), out)
        for k, v in list(items(value)):
            setitem(out, _plain_copy(k, memo), _plain_copy(v, memo))
    elif kind is set:
        out = set()
        setitem(memo, id(value), out)
        for x in scopy(value):
            add(out, _plain_copy(x, memo))
    elif kind is bytearray:
        out = bytearray(value)
        setitem(memo, id(value), out)
    elif kind is tuple or kind is frozenset:
        out = kind([_plain_copy(x, memo) for x in value])  # (a cycle through one goes through a mutable container)
        setitem(memo, id(value), out)
    else:
        setitem(memo, 0, True)
        return value
    return out


def _keep_setup_data(fixed: dict) -> None:
    """Called once the setup has run: keeps a copy of each value it bound that :func:`_plain_copy` can copy. A value
    deeper than the recursion limit allows (the program may lower it) is kept as unreadable: tests that read it fail."""
    _, _, items, setitem, _, _, pop, clear, _, _, _ = _COPY_TOOLS
    memo = {}
    clear(_SETUP_DATA)
    for name, value in list(items(fixed)):
        if any(type(value) is t for t in (list, dict, set, bytearray, tuple, frozenset)):
            known = len(memo)
            try:
                kept = _plain_copy(value, memo)
            except RecursionError:  # (what this copy began is half-made: no other name may share it)
                for k in list(memo)[known:]:  # (a dict keeps its keys in order: the last ones are this copy's)
                    pop(memo, k)
                setitem(_SETUP_DATA, name, None)
                continue
            if pop(memo, 0, False):
                continue  # (a container that holds other objects stays as it was: what it holds is judged)
            setitem(_SETUP_DATA, name, kept)
    del _SETUP_STATE[:]
    function = type(_keep_setup_data)
    for value in list(dict.values(fixed)):
        if type(value) is function and value.__code__.co_filename == "<setup>":
            held = [("defaults", value, None, value.__defaults__), ("kwdefaults", value, None, value.__kwdefaults__)]
            for c in value.__closure__ or ():
                try:
                    held.append(("cell", c, None, c.cell_contents))
                except ValueError:  # (an empty cell)
                    pass
        elif type(value) is type and _SNAPSHOT[0].get(id(value), (None,))[0] is not value:  # noqa: F821  (a class
            names = _DICT_OF(value)  # of the setup's: not one of the library's, whose namespace stays its own)
            held = [("attr", value, k, v) for k, v in list(names.items())
                    if type(k) is str and k != "__dict__" and k != "__weakref__"]
            held.append(("keys", value, None, frozenset(k for k in names if type(k) is str)))
        else:
            continue
        for kind, holder, key, v in held:  # (plain data copied; anything else put back as the same object)
            copy_memo = {}
            try:
                kept = _plain_copy(v, copy_memo)
            except RecursionError:  # too deep to copy: a call of the function (a read of the class) fails, rather
                _SETUP_STATE.append((kind, holder, key, None, None))  # than get back what the program can change
                continue
            plain = not pop(copy_memo, 0, False)
            _SETUP_STATE.append((kind, holder, key, kept if plain else v, plain))


def _setup_value(name: str, memo: dict):
    """What a test reads for the setup's ``name``: its own copy (``memo``: the test's id -> copy map), or
    ``_setup_value`` itself when the name holds no copied value."""
    if not _COPY_TOOLS[4](_SETUP_DATA, name):
        return _setup_value
    kept = _COPY_TOOLS[5](_SETUP_DATA, name)
    if kept is None:
        raise RecursionError(f"the setup's {name} is too deep to copy")
    return _plain_copy(kept, memo)


def _setup_state(memo=None, cls=None, name=None):
    """Puts back fresh copies of the plain data of every function and class of the setup, and what else their
    namespaces held (before a call of one of them), and returns ``_setup_state``. With ``cls`` (a class a test reads
    ``name`` of) and plain data there: a copy of it of the test's own (``memo``), put on no class."""
    if cls is not None:
        mine = False
        for kind, holder, key, kept, plain in _SETUP_STATE:
            if holder is cls:
                if plain and kind == "attr" and key == name:
                    return _plain_copy(kept, memo)
                mine = True
        if not mine:
            return _setup_state
    held = _HELD  # noqa: F821  (_guardtools.py: what is replaced is kept, or the program's finalizer in it would run
    for kind, holder, key, kept, plain in _SETUP_STATE:  # now, after the checks, and put its own value back)
        if plain is None:
            raise RecursionError("the setup's data is too deep to copy")
        fresh = _plain_copy(kept, {}) if plain else kept
        if kind == "defaults":
            held.append(holder.__defaults__)
            holder.__defaults__ = fresh
        elif kind == "kwdefaults":
            held.append(holder.__kwdefaults__)
            holder.__kwdefaults__ = fresh
        elif kind == "cell":
            try:
                held.append(holder.cell_contents)
            except ValueError:  # (emptied)
                pass
            holder.cell_contents = fresh
        elif kind == "attr":
            held.append(_DICT_OF(holder).get(key))  # (a class's keys are exact strs: nothing compared)
            type.__setattr__(holder, key, fresh)
        else:  # (a name the program added, which would hide a base class's)
            for k in [k for k in _DICT_OF(holder) if type(k) is str and k not in kept]:
                held.append(_DICT_OF(holder).get(k))
                type.__delattr__(holder, k)
    return _setup_state


def _library_data(v, held):
    """What a test reads for a module's attribute ``v``: for an exact list or dict of what ``_snapshot._held_state`` kept
    (``held``: its getter, ``{id(key): (key, value)}`` or the items), a new one with the entries it had before the
    program ran; anything else as it is."""
    getter, by_id, _ = held
    if getter is list and type(v) is list:
        return list(by_id)
    if getter is None and type(v) is dict:
        return dict(_COPY_TOOLS[10](by_id))
    return v


def _run_setup(ns: dict, tools: tuple) -> None:
    """Runs the task's setup in the program's namespace with the real builtins (the program may have bound
    its own ``__builtins__``, whose ``__import__`` would hand ``from math import isclose`` a fake), one
    top-level statement at a time, and keeps (``tools[11]``) what each bound: a test reads those names as
    the setup left them, not as the program's code rebinds them later (``isclose = max`` in the tested
    function, or in a class the setup instantiates). No thread of the program's may run alongside it (``_worker``
    checks before it begins, this after each statement): one started at the program's top level waited for the setup's
    ``expected = [1, 2, 3]`` to appear in its globals and emptied it before the copy was taken, or put its own
    ``sorted`` back into the builtins for ``expected = sorted(...)``, then left before the first test."""
    module, steps, fixed = tools[8], tools[10], tools[11]
    if type(steps) is not list:
        raise steps  # (its SyntaxError, reported as the setup's)
    loaded = {rec[2]: rec for rec in _SNAPSHOT[1].values()}  # noqa: F821  (_snapshot.py)
    for code, names, imports in steps:
        _hold_names(ns, ("__builtins__",))
        dict.__setitem__(ns, "__builtins__", module)
        exec(code, ns)
        tools[1]()  # (gc off: a finalizer of the program's would run in the judge's code below, and then)
        _LIFT()  # noqa: F821  (_guardtools.py: not the recursion limit the program's code may have set)
        if tools[0]() != 1:  # (one the program's code in this statement started: it must have left by now)
            raise AssertionError("a thread of the program was running while the setup ran")
        if not tools[-1]():  # no built-in class's namespace changed by the program's code the setup ran
            raise AssertionError("the program changed the namespace of a built-in class in the setup")
        _str_keys_only(ns)
        fixed.update((k, v) for k, v in dict.items(ns) if k in names)
        # an import binds the module as it was before the program ran, and its attribute as it was then: not what
        # the program's finder (``sys.meta_path``), its ``sys.modules`` entry or a patched attribute gives
        for bound, name, attr in imports:
            rec = loaded.get(name)
            if rec is not None and (attr is None or attr in rec[1]):
                held = None if attr is None else dict.get(rec[3], attr)
                fixed[bound] = rec[0] if attr is None else rec[1][attr] if held is None else \
                    _library_data(rec[1][attr], held)  # (as it was before the program ran)
                dict.__setitem__(ns, bound, fixed[bound])
            elif attr is not None and f"{name}.{attr}" in loaded:  # ``from xml import dom``: a submodule
                fixed[bound] = loaded[f"{name}.{attr}"][0]
                dict.__setitem__(ns, bound, fixed[bound])
    _keep_setup_data(fixed)  # (a test reads its own copy of the setup's plain data)


def _hold_names(ns: dict, names) -> None:
    """Before the judge binds ``names`` in ``ns`` again: keeps what they are bound to (``_guardtools._HELD``), after
    dropping every key that is not an exact str (:func:`_str_keys_only`: no lookup compares a key of the program's).
    Dropped, an object of the program's would run its finalizer in the judge, after its checks: it rebound a function
    of the setup that ``dict.update`` had already put back (``check = functools.partial(...)``, no Python frame)."""
    _str_keys_only(ns)
    get = dict.get
    _HELD.append(tuple(get(ns, n) for n in names))  # noqa: F821


def _str_keys_only(ns: dict) -> None:
    """Drops every key of ``ns`` that is not an exact ``str``: a lookup of a name compares it with a key of the
    same hash, and the program's key's ``__eq__`` would then decide what the name means (or hide and restore
    a global of the program's while the guards look). Only exact strs are compared from then on: no code runs."""
    if any(type(k) is not str for k in dict.keys(ns)):
        kept = [(k, v) for k, v in dict.items(ns) if type(k) is str]
        _HELD.append(list(dict.items(ns)))  # noqa: F821  (_guardtools.py: no finalizer of the program's runs here)
        dict.clear(ns)
        dict.update(ns, kept)
