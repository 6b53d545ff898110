"""What the judge compares with: the classes, modules and library code as they were before the program ran; runs
only inside a sandbox child.

Its text is put after ``_judge.py``'s and in front of ``_guards.py``'s, and executed in the same private globals (see
``sandbox.py``). Importing it in the trainer defines functions and runs nothing. :func:`_type_snapshot` is taken once
per child (or once by the fork server, before it forks) into :data:`_SNAPSHOT`; ``_judge._make_trust`` checks values
against it.
"""

_SNAPSHOT = None  # (classes, modules, library code) of _type_snapshot(): taken before any untrusted code runs
_COMMON = ("math", "re", "string", "itertools", "functools", "operator", "heapq", "bisect", "copy", "cmath",
           "array", "struct", "time", "collections", "sys", "fractions")
"""Modules imported before the snapshot even by a spawned child (1-2 ms), so that tests
naming them get the real ones; the fork server imports more (``_server._PRELOAD``)."""


def _type_snapshot() -> tuple:
    """(classes, modules, library code): every class alive now (walked from ``object`` through
    ``__subclasses__``) with the entries its own ``__dict__`` has for :data:`_DUNDERS` (and,
    for classes made in Python, a copy of that ``__dict__``), a copy of every loaded module's
    namespace and :func:`_library_code`; objects are held, so their ids stay valid."""
    import sys

    for name in _COMMON + tuple(sys.builtin_module_names):  # every built-in module now: none is made later
        if not name.startswith(_DENY_MODULES):  # noqa: F821  (from _child.py; see _frames._drop_unaudited)
            __import__(name)
    dict_of, flags_of = type.__dict__["__dict__"].__get__, type.__dict__["__flags__"].__get__
    subclasses = type.__dict__["__subclasses__"]
    snap, stack = {}, [object]
    while stack:
        cls = stack.pop()
        if id(cls) in snap:
            continue
        d = dict_of(cls)
        snap[id(cls)] = (cls, tuple(d.get(n) for n in _DUNDERS), dict(d) if flags_of(cls) & (1 << 9) else None)  # noqa: F821
        stack.extend(subclasses(cls))
    modules = {}
    for name, module in list(sys.modules.items()):
        if type(module) is type(sys):
            modules[id(module)] = (module, dict(module.__dict__), name, _held_state(module.__dict__))
    return snap, modules, _library_code(snap, modules)


def _held_state(namespace: dict) -> dict:
    """``{name: (getter, {id(key): (key, value)}, {scalar key: value})}`` for what a module keeps whose contents its
    library functions read but its namespace does not show: a dict (a dispatch table: ``copy._deepcopy_dispatch``,
    ``copy.dispatch_table``; ``getter`` None), a list (``getter`` ``list``, then its items) and an instance's own attributes (``json._default_encoder``'s, read
    with ``getter``, the C-level ``__dict__`` descriptor of its class), and under ``(name, attribute)`` the dicts a
    Python-level class of the module keeps (``textwrap.TextWrapper.unicode_whitespace_trans``). Taken before the
    program runs; see ``_make_trust``'s ``module_intact``."""
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    scalar = (int, float, complex, bool, str, bytes, type(None))
    mro_of, dict_of = type.__dict__["__mro__"].__get__, type.__dict__["__dict__"].__get__
    getset = type(type.__dict__["__dict__"])
    held = {}
    for k, v in namespace.items():
        if type(k) is str and issubclass(type(v), type) and type.__dict__["__flags__"].__get__(v) & (1 << 9):
            for a, x in dict_of(v).items():  # a Python-level class's dicts: under (name, attribute)
                if type(x) is dict:
                    items = list(dict.items(x))
                    held[(k, a)] = (None, {id(p): (p, q) for p, q in items},
                                    {p: q for p, q in items if type(p) in scalar})
        if type(k) is not str or issubclass(type(v), skip) or type(v) in scalar:
            continue
        getter = None
        if type(v) is list:  # (a list's items, in order: ``urllib.parse.uses_netloc``)
            held[k] = (list, tuple(v), None)
            continue
        if not issubclass(type(v), dict):
            for cls in mro_of(type(v)):
                f = dict_of(cls).get("__dict__")
                if f is not None:
                    getter = f.__get__ if type(f) is getset else None
                    break
            contents = getter(v) if getter is not None else None
            if type(contents) is not dict:
                continue
        else:
            contents = v
        items = list(dict.items(contents))
        held[k] = (getter, {id(a): (a, b) for a, b in items}, {a: b for a, b in items if type(a) in scalar})
    return held


def _library_code(snap: dict, modules: dict) -> dict:
    """``{id: code}`` of every code object of the functions (and the functions, lambdas and
    comprehensions nested in them) held by the snapshot's classes and modules: the Python code
    a trusted operation may run. Code made later (the program's, whatever it compiles) is not."""
    import types

    code_type, function = types.CodeType, types.FunctionType
    codes, stack = {}, []

    def add(obj):
        try:  # (a library object's attribute lookup may run its code, and fail: then it adds nothing)
            found = (obj, getattr(obj, "__func__", None), getattr(obj, "fget", None), getattr(obj, "fset", None),
                     getattr(obj, "__wrapped__", None) if type(obj) is function else None)
        except Exception:
            return
        for f in found:
            if type(f) is function:
                stack.append(f.__code__)
                for cell in f.__closure__ or ():  # (a decorator's wrapper holds the method: importlib's
                    try:  # ``_check_name`` around ``FileLoader.get_filename``)
                        inner = cell.cell_contents
                    except ValueError:
                        continue
                    if type(inner) is function:
                        stack.append(inner.__code__)

    for rec in snap.values():
        if rec[2] is not None:
            for v in rec[2].values():
                add(v)
    for rec in modules.values():
        for v in rec[1].values():
            add(v)
            if not isinstance(v, (type, types.ModuleType, function)):  # an instance a module holds:
                try:
                    attrs = getattr(v, "__dict__", None)  # its function attributes (``os.environ.encodekey``)
                except Exception:
                    attrs = None
                if type(attrs) is dict:
                    for a in attrs.values():
                        add(a)
    while stack:
        code = stack.pop()
        if id(code) in codes:
            continue
        codes[id(code)] = code
        stack.extend(c for c in code.co_consts if type(c) is code_type)
    return codes
