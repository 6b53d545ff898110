"""What the program's builtins and modules lack before it runs; runs only inside a sandbox child.

Its text is put after ``_guards.py``'s and in front of ``_child.py``'s, and executed in the same private globals
(see ``sandbox.py``). Importing it in the trainer defines functions and runs nothing.

:func:`_drop_unaudited`: the calls no audit event covers (``_child._UNAUDITED``), deleted from their modules.

:func:`_frame_builtins`: the builtins that read their caller's frame. A C-level callable of the program's that the
judge's own code runs has no Python frame of its own, so the innermost frame is then the judge's: a ``functools.
partial`` the tested name is bound to (``partial(next, map(exec, [src]))``), a ``map`` or ``itertools.starmap`` a test
or the judge iterates, a ``defaultdict``'s factory under a test's subscript, a ``__class__`` property under the
judge's ``isinstance``, an exception's ``__str__`` in ``_describe``. ``eval`` and ``exec`` without globals,
``globals()``, ``locals()`` and ``vars()`` read that frame: the judge's private globals (``_make_guards``, which the
next test calls) and the cells of its closures (which can be assigned: the guards of the test itself). Before the
program runs they are replaced in ``builtins`` by functions that ask a generator of this module (whose frame no
program can read: ``gi_frame`` is refused; the real builtins are held only there) to do the work for their caller's
frame, which it fetches with ``sys._getframe`` (let through for it alone by the audit hook's ``quiet``), and which
it refuses when it is the judge's (its globals) or a test's (``<test>``). And a C-level import run from the judge's
frame (``pickle.loads``, ``datetime.strptime``) calls the ``__import__`` of that frame's globals' ``__builtins__``
with those globals as an argument: the judge's globals get a private copy of the builtins, whose ``__import__`` is the
real one.
"""


def _drop_unaudited() -> None:
    """Delete the :data:`_UNAUDITED` functions from their C modules and from the Python modules
    that re-export them (``os``, ``signal``; a reload of those copies from the C module, which
    no longer has them)."""
    import sys

    for core, facade, names in _UNAUDITED:  # noqa: F821  (_child.py)
        for name in (core, facade):
            if name in sys.builtin_module_names:  # (gc: imported later, it would come back whole)
                __import__(name)
    held = _unaudited_holders()  # noqa: F821  (_unaudited.py: where else they are kept, found before they go)
    for core, facade, names in _UNAUDITED:  # noqa: F821
        for module in (sys.modules.get(core), sys.modules.get(facade)):
            for name in names:
                if module is not None and name in vars(module):
                    delattr(module, name)
    _drop_held(held)  # noqa: F821  (``os.supports_dir_fd`` holds ``mknod`` and ``mkfifo``)


_FRAME_WRAPPERS = "def _make(_next, _factory, _send):\n" + "".join(f"""
    def {name}({params}):
        worker = _next(_factory)
        _next(worker)
        ok, result = _send(worker, ("{name}", ({args}), {closure}))
        if not ok:
            raise result
        return result
""" for name, params, args, closure in (
    ("eval", "source, globals=None, locals=None, /", "source, globals, locals", "None"),
    ("exec", "source, globals=None, locals=None, /, *, closure=None", "source, globals, locals", "closure"),
    ("globals", "", "", "None"), ("locals", "", "", "None"), ("vars", "*args", "args", "None"))) + """
    return eval, exec, globals, locals, vars
"""
"""The replacements of the builtins that read their caller's frame: each hands its call to a fresh worker (see
:func:`_frame_builtins`), inline (a helper's frame would not be the library's code that the profile guard lets run),
through the cells of its closure (which the guards check before and after a library call, as the library's:
``_guardtools._library_cells``), not its globals (which a program could change unseen)."""


_QUIET = set()
"""Ids of the threads the audit hook lets call ``sys.setprofile`` and ``sys._getframe`` (the judge's own calls: the
guards' profile guard, :func:`_frame_builtins`' worker), and ``"defaults"`` (see ``_child._make_hook``)."""
_FRAMES_DONE = []


def _frame_builtins() -> None:
    """Replaces ``eval``, ``exec``, ``globals``, ``locals`` and ``vars`` in ``builtins`` and gives the judge's globals a
    private copy of the builtins (see the module docstring), once per process, before the snapshot of the classes and
    modules is taken (``_snapshot._type_snapshot``: a module's ``__builtins__`` is among what it keeps). A replacement
    behaves as the builtin for the program's frames (an ``exec`` at its top level binds its globals); the frame of a
    wrapper only asks a worker (a generator handed out by a generator, fresh for each call, so that an ``eval`` inside
    an ``eval`` works) and holds nothing of the judge's. The judge keeps the real ones in its globals."""
    import _thread
    import builtins
    import sys

    if _FRAMES_DONE:
        return
    _FRAMES_DONE.append(True)
    judge, quiet = globals(), _QUIET
    real = {n: vars(builtins)[n] for n in ("eval", "exec", "globals", "locals", "vars")}
    judge.update(real)  # (the judge's own ``exec(code, ns)``)
    getframe, get_ident, refused, dict_type = sys._getframe, _thread.get_ident, id(judge), dict
    # bound now (see ``_namespaces.py``): ``set.add`` would hand the program ``quiet``, ``f_code`` a frame
    add, discard, contains, setitem = set.add, set.discard, dict.__contains__, dict.__setitem__
    dict_of = type.__dict__["__dict__"].__get__
    frame_ns, co_filename = dict_of(type(getframe())), dict_of(type(getframe().f_code))["co_filename"].__get__
    f_code, f_globals, f_locals, f_builtins = (frame_ns[n].__get__ for n in ("f_code", "f_globals", "f_locals",
                                                                             "f_builtins"))
    namespace = {"__builtins__": {}}
    real["exec"](compile(_FRAME_WRAPPERS, "<sandbox-builtins>", "exec"), namespace)

    def caller():
        """The frame that called the wrapper (or the worker, called directly), or None when it is the judge's or a
        test's."""
        ident = get_ident()
        add(quiet, ident)
        try:  # 0 is this function, 1 the worker, 2 what sent to it: a wrapper, or the program calling a worker itself
            frame = getframe(2)
            if id(f_code(frame)) in wrapper_codes:
                frame = getframe(3)
        except ValueError:
            return None
        finally:
            discard(quiet, ident)
        if id(f_globals(frame)) == refused or co_filename(f_code(frame)) == "<test>":
            return None
        return frame

    def worker():
        request = yield
        try:
            if type(request) is not tuple or len(request) != 3 or type(request[0]) is not str or request[0] not in real \
                    or type(request[1]) is not tuple:  # (a program's request: its __eq__ would run in here)
                raise TypeError("sandbox: not a request of the builtins' replacements")
            kind, args, closure = request
            frame = caller()
            if frame is None:
                raise PermissionError(f"sandbox: {kind}() was called from the judge's code")
            if kind == "globals" or kind == "locals" or kind == "vars":
                if args:  # (vars(obj): no frame read)
                    result = real["vars"](*args)
                else:
                    result = f_globals(frame) if kind == "globals" else f_locals(frame)
            else:
                source, g, loc = args
                if g is None:
                    g, loc = f_globals(frame), f_locals(frame) if loc is None else loc
                if issubclass(type(g), dict_type) and not contains(g, "__builtins__"):
                    setitem(g, "__builtins__", f_builtins(frame))  # (the caller's, as the builtin does)
                del frame
                extra = {} if closure is None else {"closure": closure}
                result = real[kind](source, g, loc, **extra)
            answer = (True, result)
        except BaseException as e:
            answer = (False, e)
        yield answer

    def factory():
        while True:
            try:
                yield worker()
            except GeneratorExit:
                raise
            except BaseException:
                pass  # (thrown in by the program: the next call still gets a worker)

    made = factory()
    next(made)
    wrappers = namespace.pop("_make")(next, made, type(made).send)  # (``send`` bound: see ``_namespaces.py``)
    wrapper_codes = frozenset(id(w.__code__) for w in wrappers)
    for n, w in zip(("eval", "exec", "globals", "locals", "vars"), wrappers):
        setattr(builtins, n, w)
    judge["__builtins__"] = dict(vars(builtins))  # (the replacements, and the real __import__)
