"""The guards a rewritten test calls (``_rewrite.py``), built per test on the trust checks of
``_judge.py``; runs only inside a sandbox child.

Its text is put after ``_judge.py``'s (and ``_snapshot.py``'s) and in front of ``_guardtools.py``'s (what the
guards are built on) and ``_child.py``'s, and executed in the same
private globals (see ``sandbox.py``). Importing it in the trainer defines functions and runs nothing.
"""


_TYPE_NAME = type.__dict__["__name__"].__get__  # (a class's own name: a metaclass's ``__name__`` property may raise)


def _describe(exc: BaseException) -> str:
    name = _TYPE_NAME(type(exc))
    try:
        text = f"{name}: {exc}"
    except BaseException:
        text = name
    return str.__str__(text) if isinstance(text, str) else "error"


def _make_guards(judge: tuple, ns: dict, bad: list, builtins: dict, modules: dict, test_names: tuple, tools: tuple):
    """The functions a prepared test receives: ``value(v)`` (check a value a test operates
    on), ``call(fn, *args, **kw)`` (check the arguments unless ``fn`` is the program's own
    function or method), ``name(n)`` (a builtin or module name: see below) and
    ``attr(obj, n)`` (an attribute of a module loaded before the program is read as it was
    then, so ``math.isclose = lambda *a, **k: True`` does not reach the test; a method the
    program put in place of a library one fails: see ``overridden``). A failed
    check is recorded in ``bad`` (so that catching the exception does not help) and raises.

    ``name``: a builtin name means the real builtin, unless the program defines it and the
    test names none of the program's other globals nor another builtin the program defines (the tested
    function itself is called ``sum``); a module name means that module when the test reads an attribute of it
    (``math.isclose``), otherwise unless the program bound something else to that name
    (``from datetime import datetime``, a global ``string = ...``); a name the setup bound means what the setup
    bound. Every free name of a test is read through ``name``."""
    trusted, overridden, operators, library_code, module_intact, library_class = judge
    function, module_type, missing = type(_make_guards), type(_judge_sys), object()  # noqa: F821  (_judge.py)
    count, gc_disable, gc_callbacks, set_profile, get_ident, quiet, (get_context, set_context, context), live, \
        builtins_module, (re_dict, re_caches, re_clears, codecs_back), _, fixed, interp_modules, (zone, zone_was), \
        (cells, defaulted), (f_globals, f_code, co_name), types_kept = tools
    _hold_names(ns, ("__builtins__",))  # noqa: F821  (_setupdata.py; with _str_keys_only)
    # the test function takes its builtins from the globals it is made with (``__import__``, ``__build_class__``)
    dict.__setitem__(ns, "__builtins__", builtins_module)
    # the one builtin name the program may have in place of the builtin: the tested function (``sum``), when the test
    # names no other global of the program's nor another builtin the program defines (``abs``, a judging function)
    mine = [n for n in test_names if n in builtins and n in ns]
    shadow = mine[0] if len(mine) == 1 and not any(n not in builtins and n in ns for n in test_names) else None
    by_name, get = {rec[2]: rec[0] for rec in modules.values()}, dict.get
    # the code of the task's setup (its functions and methods): task code, not the program's (see ``setup_call``)
    setup_codes, todo = {}, [s[0] for s in tools[10]] if type(tools[10]) is list else []
    setup_copies = {}
    while todo:
        c = todo.pop()
        if id(c) not in setup_codes:
            setup_codes[id(c)] = c
            todo.extend(x for x in c.co_consts if type(x) is type(c))

    def name(n, as_module=False):  # (no method looked up by name: ``get``, bound when these guards were made)
        if as_module and n in by_name:  # ``math.isclose``: the module, whatever the program bound to the name
            return by_name[n]
        if n in fixed:  # a copy of the setup's plain data, this test's own (see ``_setupdata.py``)
            v = _setup_value(n, setup_copies)  # noqa: F821
            if v is not _setup_value:  # noqa: F821
                return v
        if n in builtins:
            if n in fixed:
                return fixed[n]
            if n == shadow:
                return ns[n]
            return builtins[n]
        v = fixed[n] if n in fixed else get(ns, n, missing)  # (``fixed``: what the setup bound, see ``_run_setup``)
        real = get(by_name, n)
        if real is not None and (v is missing or type(v) is module_type):
            return real  # (identity tests only: a metaclass's __eq__ must not decide this)
        if v is missing:
            raise NameError(f"name {n!r} is not defined")
        if shadow is not None:  # the program's builtin was given to this test because it named no global of the
            bad[len(bad):] = [f"the program's global {n} appeared while the test ran"]  # program's: this one was
            raise AssertionError(bad[-1])  # hidden then (deleted by the tested function, a key that puts it back)
        return v

    def attr(obj, n):
        rec = get(modules, id(obj))
        known = rec is not None and rec[0] is obj  # a module loaded before the program ran
        if type(obj) is module_type and known and n in rec[1]:  # (nothing looked up by name: no check of the built-in
            held = get(rec[3], n)  # classes needed; a list or a dict the module keeps: a new one, see ``_setupdata``)
            return rec[1][n] if held is None else _library_data(rec[1][n], held)  # noqa: F821
        types_intact("before the test read " + n)
        if type(obj) is type:  # a class of the setup's: its plain data as the setup left it (see ``_setupdata``)
            v = _setup_state(setup_copies, obj, n)  # noqa: F821
            if v is not _setup_state:  # noqa: F821
                return v
        if type(obj) is not module_type:
            if known:  # (``math.__class__ = M``: M's __getattribute__ would answer)
                modules_kept("before the test read " + n)
            if overridden(obj, n):
                bad[len(bad):] = [f"{type(obj).__name__}.{n} is the program's, in place of the library's"]
                raise AssertionError(bad[-1])
        return getattr(obj, n)

    real_map, real_filter, real_getattr = builtins["map"], builtins["filter"], builtins["getattr"]
    lambda_takers = tuple(builtins[n] for n in _LAMBDA_CALLS)  # noqa: F821  (_rewrite.py)
    method, builtin_method = type(_make_guards.__get__(0)), type([].append)  # bound methods
    slot_method = type([].__len__)  # a slot bound to its value (``v.__contains__``, ``v.__eq__``): a method too
    mro_of, dict_of = type.__dict__["__mro__"].__get__, type.__dict__["__dict__"].__get__
    flags_of, heap = type.__dict__["__flags__"].__get__, 1 << 9
    judge_globals = _make_guards.__globals__
    real_globals = {id(vars(rec[0])): rec[2] for rec in modules.values()}

    kept = []  # the program's gc callbacks, held until the test ends: dropped here, their finalizers would run
    fresh_guard = []  # set where the built-in classes were just checked (see ``builtins_kept``)

    def types_intact(when: str) -> None:
        """Fails the test (and the run: see ``_namespaces.py``) if a built-in class's namespace was ever changed.
        (``bad`` is filled by slot operations only: a program's ``list.append`` could empty it.)"""
        if not types_kept():
            bad[len(bad):] = [f"the program changed the namespace of a built-in class {when}"]
            raise AssertionError(bad[-1])

    def value(v, fresh=False, settle=None, woke=None):
        gc_disable()  # no finalizer or gc callback of the program between this check and the operation
        # ``settle`` (default: ``not fresh``): a thread still ending is waited for, 50 ms at most, and ``woke`` told
        # (its code ran meanwhile: ``_guardtools._thread_counter``); otherwise a thread still ending fails the test
        waited = [] if (not fresh if settle is None else settle) else None
        alone = count(waited) == 1
        if waited and woke is not None:
            woke[len(woke):] = [True]
        if not fresh or waited:  # (``fresh``: checked just before, and only the judge's code ran since)
            types_intact("before a value was judged")
        kept.extend(gc_callbacks)
        del gc_callbacks[:]
        if not alone:
            bad[len(bad):] = ["a thread of the program was running while a result was judged"]
        elif not trusted(v):
            bad[len(bad):] = [f"untrusted value of type {type(v).__name__}"]
        else:
            return v
        raise AssertionError(bad[-1])

    def checked(vs, fresh=False) -> None:
        """``value`` of each of ``vs``, a thread still ending waited for; one waited for after the first check may
        have changed a value checked before: then all again, with none ending now."""
        woke, first = [], True
        for v in vs:
            value(v, fresh, True, None if first else woke)
            first = False
        if woke:
            for v in vs:
                value(v, True, False)

    def own(fn) -> bool:
        """The program's function or method, or a class it made (calling it runs the program's code,
        which is what is tested, and its result is checked where it is used)."""
        if type(fn) is method:
            fn = fn.__func__
        if isinstance(fn, type):
            return not library_class(fn)
        return type(fn) is function and fn.__globals__ is ns and fn.__code__.co_filename not in ("<test>", "<setup>")

    def materialized(x):
        """An iterator the program made (a generator, ``map`` over its function) as a list: its code
        runs here, as the program's own computation, not inside a guarded library operation."""
        return unhandled(list, x) if any("__next__" in dict_of(c) for c in mro_of(type(x))) else x

    blank_type = builtins["Exception"]

    def unhandled(fn, *args, **kw):
        """``fn(*args, **kw)``, the program's code, with no exception of the test's as the one being handled: called
        in a test's ``except`` block, the program read the test's exception (``sys.exc_info()``, the ``__context__``
        of one it raised: ``KeyError('mango')``) and returned what it carried (red-team round 28). The one it sees now
        is a blank ``Exception``, with no context and no traceback (also inside a built-in function it hands a generator
        of the program's to)."""
        try:
            raise blank_type()
        except blank_type as blank:
            blank.__context__ = blank.__traceback__ = None
            return fn(*args, **kw)

    loaded = tuple(rec[0] for rec in modules.values())

    def modules_kept(when: str) -> None:
        """Fails the test unless every module loaded before the program ran is still of the module type: a
        module's ``__class__`` can be assigned, and its class's ``__getattribute__`` would answer for any attribute
        that a test or library code reads (``math.isclose``)."""
        if set(map(type, loaded)) - {module_type}:
            bad[len(bad):] = [f"the program changed the class of a module {when}"]
            raise AssertionError(bad[-1])

    c_called = tuple((n, by_name[n]) for n in _C_CALLED if n in by_name)  # noqa: F821  (_judge.py)
    c_names, operator_functions = frozenset(n for n, _ in c_called), tuple(operators.values())

    def c_called_kept(when: str, before: bool = False) -> None:
        """Fails the test unless the modules the interpreter's C code calls into (``_judge._C_CALLED``) are those of
        the snapshot, in the interpreter's table of modules, intact (``copyreg`` and ``_strptime`` with what they keep:
        ``copyreg.dispatch_table``, ``_strptime._TimeRE_cache``): ``copyreg.__newobj__`` or ``_strptime.
        _strptime_datetime`` replaced by a C callable would decide what ``copy.deepcopy`` or ``datetime.strptime``
        gives, with no Python frame for the profile guard and no module of the test's call to check."""
        for clear in re_clears:  # (``_strptime._regex_cache`` grows with each new format the library parses)
            clear()
        if before:  # (the codec caches: compared with what they held, key by key, so only where it counts)
            for back in codecs_back:
                back()
        found = {}
        for k, v in dict.items(interp_modules):  # (exact str keys only are compared: no program __eq__)
            if type(k) is str and k in c_names:
                found[k] = v
            elif type(k) is str and k in by_name and by_name[k] is not v:  # a library function's own ``import``
                bad[len(bad):] = [f"module {k} was replaced by the program {when}"]  # (``Counter.most_common``'s
                raise AssertionError(bad[-1])  # ``import heapq``) would read this entry, a fake of the program's
        for n, real in c_called:
            if found.get(n) is not real or not module_intact(n, 1, n in ("copyreg", "_strptime")):
                bad[len(bad):] = [f"module {n} was changed by the program {when}"]
                raise AssertionError(bad[-1])
        if zone() != zone_was:  # (tuples of ints and exact strs: no program code runs)
            bad[len(bad):] = [f"the program changed the time zone {when}"]
            raise AssertionError(bad[-1])

    cell_contents = type((lambda: cells).__closure__[0]).__dict__["cell_contents"].__get__
    scalar_ids = frozenset(map(id, (int, float, complex, bool, str, bytes, type(None))))
    same_object = operators["is_"]
    cell_list, cell_was = tuple(c for c, _ in cells), tuple(x for _, x in cells)
    fns = tuple(r[0] for r in defaulted)
    get_defaults, get_kw = function.__dict__["__defaults__"].__get__, function.__dict__["__kwdefaults__"].__get__
    defaults_was, kw_was = tuple(r[1] for r in defaulted), tuple(r[2] for r in defaulted)
    contents_was = tuple((r[2], r[3]) for r in defaulted if r[2] is not None) + tuple(h for r in defaulted for h in r[4])

    def cells_kept(when: str) -> None:
        """Fails the test unless every closure cell of the library's functions (``_library_cells``) holds what it held
        before the program ran, or another number or string (a counter the library keeps there), and their defaults
        too, with what their lists, sets and dicts hold: ``Fraction.__sub__``'s cell assigned a C callable would decide
        what ``f(1) - 3`` gives, ``copy.deepcopy``'s ``memo`` prefilled what it copies (mostly C loops: this runs at
        every library call)."""
        try:
            kept = all(map(same_object, map(cell_contents, cell_list), cell_was))
        except ValueError:  # (a cell the program emptied)
            kept = False
        for cell, was in () if kept else cells:
            try:
                x = cell_contents(cell)
            except ValueError:
                x = missing
            if x is not was and not (id(type(x)) in scalar_ids and id(type(was)) in scalar_ids):
                bad[len(bad):] = [f"a closure of the library was changed by the program {when}"]
                raise AssertionError(bad[-1])
        if "defaults" in quiet and not (all(map(same_object, map(get_defaults, fns), defaults_was)) and all(
                map(same_object, map(get_kw, fns), kw_was)) and all(same(_shallow(x), h) for x, h in contents_was)):  # noqa: F821
            bad[len(bad):] = [f"the defaults of a library function were changed by the program {when}"]
            raise AssertionError(bad[-1])

    def same(a, b) -> bool:  # two ``_shallow`` tuples: the same objects, in the same order
        return a is None and b is None or a is not None and b is not None and len(a) == len(b) and all(
            x is y or type(x) is tuple and type(y) is tuple and len(x) == 2 == len(y) and x[0] is y[0] and x[1] is y[1]
            for x, y in zip(a, b))

    def builtins_kept(when: str, calls: bool = True, before: bool = False) -> None:
        """Fails the test unless the builtins are those the program started with: library code reads them
        (``builtins.isinstance = slice; builtins.all = bool`` in the tested function, C callables no profile
        sees, and ``Counter() == 3`` says yes). Only exact ``str`` keys are looked up (no program ``__eq__``).
        No module may have a class of the program's either (:func:`modules_kept`). ``before``: right before the
        library's call (the codec caches are put back then, ``c_called_kept``)."""
        if fresh_guard:  # (its caller checked the built-in classes, and only the judge's code ran since)
            del fresh_guard[:]
        else:
            types_intact(when)
        modules_kept(when)
        cells_kept(when)
        if calls:  # (a call's: an operator of the test on trusted values runs no C code that calls into them)
            c_called_kept(when, before)
        if len(live) == len(builtins):
            for k, v in dict.items(live):
                if type(k) is not str or builtins.get(k, missing) is not v:
                    break
            else:
                return
        bad[len(bad):] = [f"the program changed the builtins {when}"]
        raise AssertionError(bad[-1])

    def holds_guards(a) -> bool:
        """A test lambda whose body is guarded (``_rewrite._LAMBDA_CALLS``): its closure leads to the guards."""
        return type(a) is function and a.__code__.co_filename == "<test>" \
            and any(n.startswith("_sbx_") for n in a.__code__.co_freevars)

    def call(fn, *args, **kw):
        types_intact("before the test's call")
        if (any(map(holds_guards, args)) or any(map(holds_guards, kw.values()))) \
                and not any(fn is f for f in lambda_takers):  # a guarded lambda goes to the real builtins only
            bad[len(bad):] = ["a lambda of the test was handed to something other than the builtin it was written "
                              "for"]
            raise AssertionError(bad[-1])
        if fn is real_getattr and not kw and 2 <= len(args) <= 3 and type(args[1]) is str and (
                type(args[0]) is module_type or type(args[0]) is type):  # read as ``obj.name`` is: ``attr``
            try:
                return attr(args[0], args[1])
            except AttributeError:
                if len(args) == 2:
                    raise
                return args[2]
        inner = fn.__func__ if type(fn) is method else fn
        if type(inner) is function and id(inner.__code__) in setup_codes:
            return setup_call(fn, inner.__code__, args, kw)
        if own(fn):
            result = unhandled(fn, *args, **kw)
            types_intact("in its function")
            return result
        for k, (cache, hold_and_clear) in re_caches.items():
            if re_dict.get(k) is not cache:
                bad[len(bad):] = ["module re was changed by the program"]
                raise AssertionError(bad[-1])
            hold_and_clear()  # (``_guardtools._holding_clear``: no finalizer of the program's runs here)
        for clear in re_clears:
            clear()
        if type(fn) is method:
            fn_globals = fn.__func__.__globals__ if type(fn.__func__) is function else None
        else:
            fn_globals = fn.__globals__ if type(fn) is function else None
        name_of = real_globals.get(id(fn_globals)) if fn_globals is not None else None
        if name_of is None and issubclass(type(fn), type) and library_class(fn) and flags_of(fn) & heap:
            name_of = dict_of(fn).get("__module__")  # a library class of Python code: its module's (``Fraction``)
        # ``re._compile`` replaced under ``re.match``, or its cache a dict subclass that answers for any pattern
        if name_of is not None and not module_intact(name_of, caches=True):
            bad[len(bad):] = [f"module {name_of} was changed by the program"]
            raise AssertionError(bad[-1])
        checked((*args, *kw.values()), True)  # (checked at this call's start, and only the judge's code ran since)
        # ``map`` and ``filter`` as generators of this function: the items they hand to a library callable are
        # checked like any call's arguments (``all(map(operator.eq, gen, ys))``), and a ``StopIteration`` the
        # program's function raises cannot end the iteration early for ``all`` (PEP 479: a RuntimeError).
        # A generator's frame (and so its closure) is out of the program's reach: ``gi_frame`` is refused.
        if fn is real_map and len(args) > 1:
            return (call(args[0], *items) for items in zip(*args[1:], **kw))
        if fn is real_filter and len(args) == 2 and args[0] is not None and not kw:
            return (x for x in args[1] if call(args[0], x))
        tf = type(fn)
        receiver = getattr(fn, "__self__", None) if tf is method or tf is builtin_method or tf is slot_method else None
        if tf is method and type(fn.__func__) is function and fn.__func__.__globals__ is ns \
                and fn.__func__.__code__.co_filename == "<test>":  # a method of a class the test defines: its code is
            receiver = None  # the test's, guarded, called as the test's functions are (round 28: it was the program's)
        if receiver is None or type(receiver) is module_type:
            if (name_of is not None or issubclass(type(fn), type) and library_class(fn) and flags_of(fn) & heap) \
                    and not any(type(a) is function or type(a) is method for a in (*args, *kw.values())):
                # a library function or class of Python code (``json.dumps``, ``Fraction``): the program's code must
                # not run inside it, reached through the module's objects (``json._default_encoder.encode = ...``,
                # ``copy._deepcopy_dispatch[list] = ...``, ``fractions._RATIONAL_FORMAT = P()``); a generator of the
                # program's it is handed runs first, as the program's own code
                args = [materialized(a) for a in args]
                kw = {k: materialized(a) for k, a in kw.items()}
                checked((*args, *kw.values()))
                fresh_guard[:] = [True]
                return guarded("the test's call of " + str(getattr(fn, "__name__", "a library function")), fn, *args, **kw)
            fresh_guard[:] = [True]
            builtins_kept("before the test's call", before=True)
            programs_context = get_context()
            set_context(context.copy())  # (``abs(d)`` rounds in it)
            try:  # (a generator of the program's it is handed runs in it: ``list(f(x))``)
                result = unhandled(fn, *args, **kw)
            finally:
                set_context(programs_context)
            builtins_kept("during the test's call")
            return result
        # a library method of a value (``u.startswith``, ``c.most_common``): the program's code must not
        # run inside it (a ``str`` subclass held as ``UserString.data``, a ``Counter`` subclass's ``items``)
        # and the value itself is checked like an operand, before and after (``[E()].count(3)``: a list of the
        # program's objects whose ``__eq__`` is a C callable, run by no Python frame for the profile guard to see)
        args = [materialized(a) for a in args]
        checked((receiver, *args, *kw.values()))
        fresh_guard[:] = [True]
        result = guarded("the test's call of " + getattr(fn, "__name__", "a method"), fn, *args, **kw)
        value(receiver)
        return result

    def setup_call(fn, code, args, kw):
        """A function (or method) the task's setup defined: its arguments are checked like a library call's, it
        reads the names the setup bound as the setup left them (the program's code that computed the arguments
        may have rebound them: ``K = 0`` for ``def check(a, b): return K == 0 or a == b``), no builtin it reads may
        be the program's, and no program code may run inside it."""
        _hold_names(ns, fixed)  # noqa: F821  (_setupdata.py: no finalizer of the program's in what is rebound)
        dict.update(ns, fixed)
        for n in fixed:  # (this test's copies while it runs, the originals again after: see ``_setupdata.py``)
            if _COPY_TOOLS[4](_SETUP_DATA, n):  # noqa: F821  (the name holds a copied value)
                dict.__setitem__(ns, n, name(n))
        reads, todo = set(), [code]
        while todo:
            c = todo.pop()
            reads.update(c.co_names)
            todo.extend(x for x in c.co_consts if type(x) is type(c))
        for n in reads:
            if n in builtins and n not in fixed and dict.__contains__(ns, n):
                bad[len(bad):] = [f"the program's {n} hides the builtin a function of the setup reads"]
                raise AssertionError(bad[-1])
        checked((*args, *kw.values()))
        _setup_state()  # noqa: F821  (its functions' defaults and cells, its classes' data, as the setup left them)
        try:
            return guarded("the setup's " + code.co_name, fn, *args, **kw)
        finally:
            _hold_names(ns, fixed)  # noqa: F821
            dict.update(ns, fixed)

    flagged, quiet_add, quiet_discard = [], set.add, set.discard  # (bound now: see ``_namespaces.py``)

    def watch(frame, event, arg):  # (what it reads, bound before the program ran: see ``_namespaces.py``)
        if event == "call" and not flagged and f_globals(frame) is not judge_globals \
                and id(f_code(frame)) not in library_code and id(f_code(frame)) not in setup_codes:
            flagged[:] = [co_name(f_code(frame))]

    def guarded(what: str, fn, *args, **kw):
        """``fn(*args, **kw)`` with no Python code but the library's (and the judge's) allowed to run."""
        calls = not any(fn is op for op in operator_functions)
        builtins_kept("before " + what, calls, True)
        ident = get_ident()
        del flagged[:]
        programs_context = get_context()
        set_context(context.copy())
        gc_disable()  # a finalizer run while ``quiet`` would be the program's code with the hook silent
        quiet_add(quiet, ident)
        set_profile(watch)
        quiet_discard(quiet, ident)
        try:
            result = fn(*args, **kw)
        finally:
            gc_disable()  # (the program's code, flagged, may have enabled it again inside ``fn``)
            quiet_add(quiet, ident)
            set_profile(None)
            quiet_discard(quiet, ident)
            set_context(programs_context)
        if flagged:
            bad[len(bad):] = [f"the program's code ({flagged[0]}) ran inside {what}"]
            raise AssertionError(bad[-1])
        builtins_kept("during " + what, calls)
        return result

    def operate(op, a, b):
        """``a <op> b`` for one comparison or arithmetic operator, both operands checked only
        once both exist (the program's code that computed ``b`` cannot change ``a`` after its check).
        While it runs, any Python code that is not the library's (a metaclass's ``__subclasscheck__``
        reached through an ABC check, a function put into a library module, a generator's body, a
        ``defaultdict`` factory under ``Counter.__eq__``) fails the test."""
        types_intact("before the test's operation")
        if op == "chain":  # ``a < b < c``: a (the operator names), b (every operand, already evaluated)
            result = True
            for i, name_ in enumerate(a):
                result = operate(name_, b[i], b[i + 1])
                if not result:
                    break
            return result
        if op == "getitem":  # ``d[k]``: a key of the program's must not decide a lookup in a library container
            if not library_class(type(a)):  # (hash and ``__eq__`` of an always-equal key); the program's own
                return a[b]  # container answers as the program's code, and what it gives is judged where used
            value(b, True, True)
            fresh_guard[:] = [True]
            result = guarded("the test's subscript", operators[op], a, b)
            value(b, True)
            return result
        fresh = op not in ("in_", "not_in")
        if not fresh:  # ``3 in gen``: the program's generator runs first, as its own code
            b = materialized(b)
        value(a, fresh, True)
        value(b, True)
        fresh_guard[:] = [True]
        result = value(guarded(f"the test's {op}", operators[op], a, b), True)  # (``guarded`` checks, at its end)
        value(a, True)  # again: a C-level callable of the program's that the library reached (a metaclass's
        value(b, True)  # ``__subclasscheck__`` in an ABC check) runs no Python frame for the profile guard to flag
        return result

    return value, call, name, attr, operate


def _operators() -> dict:
    import operator

    ops = {name: getattr(operator, name) for name in (
        "eq", "ne", "lt", "le", "gt", "ge", "is_", "is_not", "add", "sub", "mul", "truediv", "floordiv",
        "mod", "pow", "lshift", "rshift", "and_", "or_", "xor", "matmul", "getitem")}
    ops["in_"] = lambda a, b: a in b
    ops["not_in"] = lambda a, b: a not in b
    ops["is_str"] = lambda a, b: type(a) is str and type(b) is str and a == b  # (see _rewrite._op_name)
    ops["is_not_str"] = lambda a, b: not (type(a) is str and type(b) is str and a == b)
    return ops
