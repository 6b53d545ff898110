"""How a sandboxed program's tests are judged; runs only inside a sandbox child.

Its text is put after ``_rewrite.py``'s (how tests are rewritten for these guards) and in front of
``_guards.py``'s (the guards a test calls) and ``_child.py``'s, and executed in the same private globals
(see ``sandbox.py``); what it compares with, taken before the program runs, is ``_snapshot.py``'s. Importing it in
the trainer defines functions and runs nothing.

A reward hack does not compute the answer: it returns an object that makes the test's own
operations say yes (``__eq__`` that always returns True, ``__bool__``, ``__sub__``
returning 0 for ``abs(f(x) - y) < eps``, a patched ``Counter.__eq__``, a trusted
container such as ``UserList`` whose data holds such an object). The rule here: every
value that a test *operates on* (comparison operands, arithmetic and boolean operands,
arguments of calls to anything but the program's own functions, comprehension items,
the asserted value) must be **trusted**, deeply: made of classes that existed, with the
same comparison/arithmetic/truth methods, before the program ran (the snapshot
``_snapshot._type_snapshot``), or of classes created later whose such methods are all inherited
or implemented in C by the class itself. Containers (``list``, ``tuple``, ``dict``,
``set``, ``deque``, dict views, subclasses of these), the instance dictionaries and slots of
Python-level objects, ``slice`` and ``SimpleNamespace`` are searched; weak proxies, cells, mapping
proxies and ``list[x]``, ``int | x`` (whose arguments compare) are never trusted.
A program thread still running, or a gc callback, when a value is checked makes the test fail
(it could swap the value after the check). While the operation itself runs, a profile function
fails the test if any Python code runs that is not the library's (``_snapshot._library_code``): whatever
path led there (an ABC check reaching a program's metaclass, a helper replaced in a subclass or an
instance, a function put into a library module), the program's code does not get to decide an operation's
result.
"""

# Methods a trusted operation of a test may call on a value.
_DUNDERS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__",
            "__contains__", "__abs__", "__neg__", "__pos__", "__sub__", "__rsub__", "__add__", "__radd__",
            "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__mod__", "__rmod__", "__xor__", "__rxor__",
            "__float__", "__int__", "__index__", "__round__", "__hash__", "__iter__", "__getitem__",
            # the other operators a test's expression is judged with (``_operators``), and what the C code of a builtin
            # or library function a test calls on a value reads off its type (``math.floor``, ``reversed``, ``divmod``)
            "__floordiv__", "__rfloordiv__", "__pow__", "__rpow__", "__lshift__", "__rlshift__", "__rshift__",
            "__rrshift__", "__and__", "__rand__", "__or__", "__ror__", "__matmul__", "__rmatmul__", "__invert__",
            "__divmod__", "__rdivmod__", "__floor__", "__ceil__", "__trunc__", "__complex__", "__reversed__",
            # what isinstance and issubclass read when the type itself does not match
            "__class__", "__getattribute__", "__bases__")
import sys as _judge_sys  # (its type is the module type)

_C_CALLED = ("copyreg", "re", "_strptime", "warnings", "encodings", "_compat_pickle")
"""Modules whose functions the interpreter's C code looks up (in ``sys.modules``) and calls on a test's behalf, with
no module of the test's call to check: ``object.__reduce_ex__`` -> ``copyreg.__newobj__``, ``datetime.strptime`` and
``time.strptime`` -> ``_strptime``, a pattern's ``sub`` -> ``re._subx``, ``warnings``, codecs' ``encodings``,
``pickle``'s ``_compat_pickle``. The guards check them, as the snapshot has them, before and after every library call
(``_guards._make_guards``' ``builtins_kept``)."""


def _make_trust(snapshot: dict, modules: dict | None = None, codes: dict | None = None):
    """``(trusted(value) -> bool, overridden(obj, name) -> bool, operators, library code ids,
    module_intact(name) -> bool, library_class(cls) -> bool)`` for one run (see the module
    docstring). They never call code of the program: only C-level accessors, iterators and
    descriptors. ``modules``: the snapshot's modules (their namespaces as they were); ``codes``:
    its library code (``_snapshot._library_code``)."""
    import builtins
    import collections
    import types
    import weakref

    mro_of = type.__dict__["__mro__"].__get__
    flags_of = type.__dict__["__flags__"].__get__
    dict_of = type.__dict__["__dict__"].__get__
    wrapper, member, getset = type(object.__init__), type(slice.__dict__["start"]), type(type.__dict__["__dict__"])
    plain = {id(t) for t in (int, float, complex, bool, str, bytes, type(None))}
    dunders = frozenset(_DUNDERS)
    never = (weakref.ProxyType, weakref.CallableProxyType, weakref.ReferenceType, types.MappingProxyType,
             types.CellType, types.FrameType, types.TracebackType, types.GenericAlias, types.UnionType)
    view_types = (type({}.keys()), type({}.values()), type({}.items()))
    seq_bases = (list, tuple, set, frozenset, collections.deque)
    walk_static = {id(slice), id(types.SimpleNamespace)}
    heap, immutable = 1 << 9, 1 << 8  # Py_TPFLAGS_HEAPTYPE, Py_TPFLAGS_IMMUTABLETYPE
    absent, proxy = object(), types.MappingProxyType
    scalars = (int, float, complex, bool, str, bytes, type(None))
    rebound_at_fork = ("threading",)  # modules whose objects os.register_at_fork callbacks replace
    module_dict = type(_judge_sys).__dict__["__dict__"].__get__
    module_named = {rec[2]: rec for rec in (modules or {}).values()}
    scalar_keys = frozenset(map(id, scalars))

    def is_scalar(v) -> bool:  # (by identity: ``type(v) in scalars`` would run a metaclass's ``__eq__``)
        return id(type(v)) in scalar_keys

    def class_kept(cls, k: str, held: dict) -> bool:
        """Unless ``cls`` is a Python-level class of the snapshot's: True. Else whether its namespace is as it was,
        and the dicts it keeps hold what they held (``textwrap.TextWrapper.unicode_whitespace_trans``, which
        ``textwrap.wrap`` translates with): a class attribute a library function reads, replaced by another library
        object or a C callable, would decide its result with no Python frame for the profile guard to see."""
        if not issubclass(type(cls), type):
            return True
        entry = snapshot.get(id(cls))
        if entry is None or entry[0] is not cls or entry[2] is None:
            return True
        d, saved = dict_of(cls), entry[2]
        if len(d) != len(saved) or any(d.get(a, absent) is not x for a, x in dict.items(saved)):
            return False
        for a, x in dict.items(saved):
            h = held.get((k, a))
            if h is not None and not contents_kept(x, *h):
                return False
        return True

    def contents_kept(v, getter, by_id: dict, by_scalar: dict) -> bool:
        """Whether a dict a module keeps (``getter`` None), or the attributes of an instance it keeps, hold what they
        held before the program ran: no entry replaced or added (entries may go: a cache the library clears, and
        ``re``'s and ``_strptime``'s that the guards clear before a library call). A dispatch table's entry
        (``copy._deepcopy_dispatch[list]``, or one for a list subclass of the program's) or an instance's method (``json.
        _default_encoder.encode``) set to a C callable would decide the library's result with no Python frame for
        the profile guard to see. Keys are compared by identity, or as exact scalars: no program code runs."""
        if getter is list:  # (``by_id``: the items it had)
            return type(v) is list and len(v) == len(by_id) and all(a is b for a, b in zip(v, by_id))
        if getter is not None:
            v = getter(v)
            if type(v) is not dict:
                return False
        for k, x in dict.items(v):
            if id(type(k)) in scalar_keys:
                was = by_scalar.get(k, absent)
            else:
                e = by_id.get(id(k))
                was = e[1] if e is not None and e[0] is k else absent
            if was is absent or x is not was:  # (a scalar too: ``json._default_encoder.item_separator``)
                return False
        return True

    module_by_id = {id(rec[0]): rec for rec in (modules or {}).values()}
    builtin_names = frozenset(vars(builtins))
    code_kinds = (types.FunctionType, types.BuiltinFunctionType, type, classmethod, staticmethod, property,
                  types.ModuleType)

    def module_intact(name, depth: int = 1, caches: bool = False) -> bool:
        """Whether the globals that a library's Python code runs with (its module's, and those of the
        modules it holds, ``depth`` levels down: ``re`` -> ``re._compiler``) still hold what they held:
        no function, class or module replaced, no name added that hides a builtin (``collections.all
        = ...`` would decide ``Counter.__eq__``); with ``caches``, no other object of the module itself
        replaced either but numbers and strings (``re._cache``: a dict subclass would answer for any pattern;
        ``fractions._RATIONAL_FORMAT``: another compiled pattern; ``json._default_encoder``: another encoder)."""
        rec = module_named.get(name) if type(name) is str else None
        if rec is None:
            return True  # not a module of the snapshot's (then its classes were not either)
        saved = rec[1]
        for k, v in dict.items(module_dict(rec[0])):
            if type(k) is not str:
                return False
            was = saved.get(k, absent)
            if was is absent:
                if k in builtin_names:
                    return False
            elif v is not was and issubclass(type(was), code_kinds):  # (isinstance would read ``__class__``)
                return False
            elif caches and v is not was and not (is_scalar(was) and is_scalar(v)) and (
                    name not in rebound_at_fork or type(was) is dict):  # (a number or a string may change: a
                return False  # counter; an object or a pattern a module keeps may not; threading rebinds its sets
                # and locks in every forked child, its private dicts it clears in place)
            elif v is was and snapshot.get(id(type(v)), (None,))[0] is not type(v):
                return False  # an object the module keeps given a class of the program's (``__class__`` assigned:
                # ``json._default_encoder``'s, whose ``encode`` a C callable would be, run by no Python frame;
                # ``Fraction``'s metaclass, whose ``__call__`` would make any instance)
            elif caches and v is was and name not in rebound_at_fork and (
                    k in rec[3] and not contents_kept(v, *rec[3][k]) or not class_kept(v, k, rec[3])):
                return False
            elif depth and type(v) is types.ModuleType and v is not rec[0]:
                inner = module_by_id.get(id(v))
                if inner is not None and inner[0] is v and not module_intact(inner[2], depth - 1):
                    return False
        return True
    partialmethod = getattr(_judge_sys.modules.get("functools"), "partialmethod", None)

    def c_level(f, depth: int = 6) -> bool:
        """Whether ``f``, an attribute of a program-made class or of an instance, is (or wraps, or hands out through
        ``__get__``) a callable that runs no Python frame of its own: a library class's instance such as
        ``functools.partial``, a builtin function or method, ``operator.attrgetter``, ``functools.partialmethod``, or
        an object of the program's whose class's ``__call__`` or ``__get__`` is one. Python functions (also as class
        or static methods and properties) and classes are not: what they run, the profile guard sees. Reads only
        C-level attributes of library types."""
        tf = type(f)
        if tf is classmethod or tf is staticmethod or tf is types.MethodType:
            return depth > 0 and c_level(f.__func__, depth - 1)
        if tf is property:
            return depth > 0 and any(g is not None and c_level(g, depth - 1) for g in (f.fget, f.fset, f.fdel))
        if tf is types.FunctionType:  # the library's code, made at run time around what it forwards to
            return depth > 0 and library_made(f, depth - 1)
        if issubclass(tf, type):  # a class of the program's: what calling it runs (``__new__ = staticmethod(c)``, a
            return depth > 0 and any(  # metaclass's ``__call__ = c``)
                c_level(g, depth - 1) for c in (*mro_of(f), *mro_of(tf)) if not library_class(c)
                for g in (dict_of(c).get("__new__"), dict_of(c).get("__init__"), dict_of(c).get("__call__"))
                if g is not None)
        if f is None:
            return False
        if library_class(tf):  # (or a library descriptor holding one: ``singledispatchmethod``'s dispatcher)
            return callable(f) or tf is partialmethod or depth > 0 and any("__get__" in dict_of(c) for c in mro_of(tf)) \
                and any(forwards(x, depth - 1) for x in own_dict(f))
        for c in mro_of(tf):  # a program's object: its class's __call__ and __get__
            d = dict_of(c)
            for n in ("__call__", "__get__"):
                g = d.get(n)
                if g is None:
                    continue
                if not library_class(c):
                    if depth > 0 and c_level(g, depth - 1):
                        return True
                elif type(g) is not types.FunctionType:  # a library callable or descriptor of C code, subclassed
                    return True  # (``class P(functools.partial)``: its C code calls what the instance holds)
                elif depth > 0 and any(forwards(x, depth - 1) for x in own_dict(f)):  # one of Python code: what
                    return True  # the instance holds (``cached_property``'s ``func``)
        return False

    descriptors, builtin_function = (type(str.join), type(dict.__dict__["fromkeys"]), wrapper), type(len)
    library_namespaces = {id(rec[1]) for rec in (modules or {}).values()} | {
        id(module_dict(rec[0])) for rec in (modules or {}).values()}

    def own_dict(obj) -> tuple:
        """The values of ``obj``'s instance dictionary, read with its class's C-level ``__dict__`` descriptor."""
        for c in mro_of(type(obj)):
            g = dict_of(c).get("__dict__")
            if g is not None:
                d = g.__get__(obj) if type(g) is getset else None
                return tuple(dict.values(d)) if type(d) is dict else ()
        return ()

    def library_made(f, depth: int) -> bool:
        """Whether ``f``, a Python function, runs the library's code (a code object of the snapshot's) around what the
        program chose: globals that are no library module's, or a closure cell, a default or what those hold that
        :func:`forwards` to a C-level callable (``functools.partialmethod(c)._make_unbound_method()``, the wrapper of
        ``functools.singledispatch(c)``: the profile guard sees only the library's frame, then ``c`` decides)."""
        if codes is None or codes.get(id(f.__code__)) is not f.__code__:
            return False  # the program's own code: the profile guard sees it run
        defaults, kw, held = f.__defaults__, f.__kwdefaults__, []
        if id(f.__globals__) not in library_namespaces or defaults is not None and type(defaults) is not tuple \
                or kw is not None and type(kw) is not dict:
            return True
        for cell in f.__closure__ or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:  # (an empty cell)
                pass
        return any(forwards(x, depth) for x in (*held, *(defaults or ()), *(kw or {}).values()))

    def forwards(x, depth: int) -> bool:
        """Whether ``x``, held by a library function or descriptor made at run time, leads to a C-level callable of the
        program's choosing: one bound to an object (``{...}.get``, a ``functools.partial``), not a module's function
        or a class's method (``len``, ``tuple.__new__``: namedtuple's closures hold those)."""
        tx = type(x)
        if id(tx) in plain or x is None or issubclass(tx, type) or any(tx is d for d in descriptors) or (
                issubclass(tx, weakref.ReferenceType) and library_class(tx)):  # (a weak reference gives its referent)
            return False
        if depth <= 0:
            return True
        if tx is tuple or tx is list or tx is dict:
            return any(forwards(e, depth - 1) for e in (dict.values(x) if tx is dict else x))
        if tx is builtin_function:
            s = x.__self__
            return not (s is None or type(s) is types.ModuleType or issubclass(type(s), type))
        return c_level(x, depth)

    def own_c(f, mro) -> bool:
        """Whether ``f`` is the C code of a class in ``mro``: its method, class method or slot descriptor, or its
        ``__new__`` (which only a C class has: a program makes none)."""
        tf = type(f)
        if any(tf is d for d in descriptors):  # (``in`` would compare: a metaclass's ``__eq__`` would answer)
            return any(f.__objclass__ is c for c in mro)
        return tf is builtin_function and any(f.__self__ is c for c in mro)

    verdicts = {}  # types no program can change (none of their classes is a mutable Python-level one)
    called_by = {}  # id(library class) -> (class, names its comparison code reads off ``self``)
    code_type = types.CodeType

    def comparison_names(cls, saved: dict) -> frozenset:
        """Names the Python code of ``cls``'s comparison and arithmetic methods reads (``UserList.__eq__``
        reads ``data`` and ``_UserList__cast``), following the methods of ``cls`` they name."""
        hit = called_by.get(id(cls))
        if hit is not None and hit[0] is cls:
            return hit[1]
        names, todo, seen = set(), [saved.get(n) for n in _DUNDERS], set()
        while todo:
            f = todo.pop()
            f = getattr(f, "__func__", f) if type(f) is classmethod or type(f) is staticmethod else f
            if type(f) is not types.FunctionType or id(f) in seen:
                continue
            seen.add(id(f))
            codes = [f.__code__]
            while codes:
                c = codes.pop()
                for n in c.co_names:
                    if n not in names:
                        names.add(n)
                        todo.append(saved.get(n))
                codes.extend(x for x in c.co_consts if type(x) is code_type)
        result = frozenset(names)
        called_by[id(cls)] = (cls, result)
        return result

    def dict_items(v):
        for k, x in dict.items(v):
            yield k
            yield x

    def info(tp, local: dict):
        """None when ``tp`` is untrusted, else (element iterator, member descriptors, __dict__ getter,
        names an instance's own __dict__ must not have). ``local``: the verdicts of one ``trusted``
        call (no program code runs during it); only types no program can change are kept longer."""
        hit = verdicts.get(id(tp)) or local.get(id(tp))
        if hit is not None:
            return hit[1]
        result, mutable = _inspect(tp)
        (local if mutable else verdicts)[id(tp)] = (tp, result)
        return result

    def _inspect(tp):
        """(verdict, whether the program could change it later). A class of the snapshot must be as
        it was then: its whole ``__dict__`` for a Python-level class (``UserList.__eq__`` calls
        ``self.__cast``: replacing that helper would change what ``==`` says), its comparison and
        arithmetic methods otherwise. A class made since may not define those methods (but with C
        code of its own, or the library's very functions), nor a method or helper that the Python
        code of a library class above it reads in its comparisons (:func:`comparison_names`)."""
        mro = mro_of(tp)
        mutable = any(flags_of(c) & heap and not flags_of(c) & immutable for c in mro)
        if any(issubclass(tp, n) for n in never):
            return None, mutable
        members, dict_get, made, protected, defined, made_dicts = [], None, [], set(), {}, []
        library = {}  # name -> what the snapshot's classes in ``tp``'s method order define under it
        for cls in mro:
            entry = snapshot.get(id(cls))
            d = dict_of(cls)
            if entry is not None and entry[0] is cls:
                recorded = entry[1]
                for i, name in enumerate(_DUNDERS):
                    if d.get(name) is not recorded[i]:
                        return None, mutable  # changed since the program started
                saved = entry[2]
                if saved is not None:  # a Python-level class: nothing added, removed or replaced
                    if len(d) != len(saved) or any(d.get(k, absent) is not x for k, x in dict.items(saved)):
                        return None, mutable
                    if not module_intact(saved.get("__module__")):
                        return None, mutable
                    protected.update(comparison_names(cls, saved))
                    for k, x in dict.items(saved):  # methods and other callables, not data
                        if callable(x) or any(type(x) is k for k in (classmethod, staticmethod, property)):
                            defined.setdefault(k, []).append(x)
                for name in dunders:
                    library.setdefault(name, []).append(d.get(name))
            else:  # created while the program ran: its comparison methods are C code of its own, or
                # the very functions a library class defines (``enum`` copies ``Flag.__or__`` into each flag)
                for name, f in d.items():
                    if type(name) is not str:
                        return None, mutable
                    if name in dunders and f is not None and not (type(f) is wrapper and f.__objclass__ is cls) \
                            and not any(f is x for x in library.get(name, ())):
                        made.append((name, f))
                made_dicts.append(d)
            if flags_of(tp) & (1 << 9) or id(tp) in walk_static:
                for name, f in d.items():
                    if type(f) is member:
                        members.append(f)
                    elif name == "__dict__" and dict_get is None and type(f) is getset:
                        dict_get = f.__get__
        for name, f in made:  # (a library class may come after the made one in the method order)
            if not any(f is x for x in library.get(name, ())):
                return None, mutable
        # a library method or helper its comparisons call, replaced by a program-made subclass (with any
        # callable: ``_UserList__cast = functools.partialmethod(getattr, 'data')`` runs no program code)
        guarded_names = frozenset(n for n in protected if n in defined)
        for d in made_dicts:  # (what enum's metaclass copies from the library class is the same object)
            for name, f in d.items():
                if name in guarded_names and not any(f is x for x in defined[name]):
                    return None, mutable
        # any attribute of a program-made class that is a C-level callable (``__deepcopy__ = functools.partial(...)``,
        # ``as_integer_ratio = property(len)``): a library function of Python code that calls it by name (``copy.
        # deepcopy``, ``statistics.mean``) would run it with no Python frame for the profile guard to see; unless it
        # is what a library class in the method order has (``__hash__ = object.__hash__``, enum's ``_new_member_``)
        # (or the C code of a class in the method order: an extension module's class made since, ``_datetime``'s)
        if made_dicts and any(c_level(f) for d in made_dicts for f in d.values()):
            allowed = {id(x) for c in mro if library_class(c) for x in dict_of(c).values()}
            if any(c_level(f) and id(f) not in allowed and not own_c(f, mro) for d in made_dicts for f in d.values()):
                return None, mutable
        elements = None
        if issubclass(tp, dict):
            elements = dict_items
        else:
            for base in seq_bases:
                if issubclass(tp, base):
                    elements = base.__iter__
                    break
            else:
                for view in view_types:  # (and their subclasses: ``OrderedDict``'s views, which compare as sets)
                    if issubclass(tp, view):
                        elements = view.__iter__
                        break
        return (elements, tuple(members), dict_get, guarded_names), mutable

    value_bases = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
    # the value types' yes/no methods (``startswith``, ``isdigit``, ``issubset``): a test asserts their answer itself
    predicates = frozenset(n for b in value_bases for n in dir(b) if n.startswith(("is", "startswith", "endswith")))

    def data_descriptor(f) -> bool:
        return type(f) is getset or type(f) is member

    def overridden(obj, name: str) -> bool:
        """Whether reading ``obj.name`` would reach code the program supplied in place of a
        builtin's: a method of a class that existed before the program ran and was replaced
        since, or a program-made subclass's own version of a method of the builtin value type
        it derives from (a ``str`` whose ``startswith`` always says yes; new methods are fine), or a yes/no
        method of the value types (``startswith``, ``isdigit``) that no library class supplies for ``obj``."""
        tp = type(obj)
        if id(tp) in plain:
            return False
        if name in predicates and not any(name in dict_of(c) for c in mro_of(tp)
                                          if snapshot.get(id(c), (None,))[0] is c):
            return True  # no library class answers it for this value: the program's code would (a look-alike ``str``)
        for cls in mro_of(tp):  # an instance attribute hiding a library class's (``c.most_common = ...``), but
            f = dict_of(cls).get("__dict__")  # for a C data descriptor of library classes only, which no instance
            if type(f) is getset:  # attribute hides (``C.__name__`` of a test's class ``C``: ``type``'s getset)
                inst = f.__get__(obj)
                if inst is not None and (type(inst) is not dict or name in inst) and any(
                        name in dict_of(c) for c in mro_of(tp) if snapshot.get(id(c), (None,))[0] is c) and not (
                        all(snapshot.get(id(c), (None,))[0] is c for c in mro_of(tp))
                        and data_descriptor(next(dict_of(c)[name] for c in mro_of(tp) if name in dict_of(c)))):
                    return True
                break
        # a builtin value type ``tp`` descends from that has ``name`` (``str.startswith``)
        lookalike = any(issubclass(tp, b) and any(name in dict_of(c) for c in mro_of(b)) for b in value_bases)
        for cls in mro_of(tp):
            d = dict_of(cls)
            entry = snapshot.get(id(cls))
            if entry is not None and entry[0] is cls:
                if entry[2] is not None and d.get(name, absent) is not entry[2].get(name, absent):
                    return True
                if name in d:
                    return False
            else:
                if any(type(k) is not str for k in d):
                    return True
                if name in d:
                    return lookalike or name in predicates
        return False

    def trusted(value, budget: int = 2_000_000) -> bool:
        # ``seen`` holds what it walked: an items view's pairs are made as they are read, and a freed pair's
        # address, reused by the next view's pair, would pass that pair (and what it holds) unwalked
        stack, seen, local = [value], {}, {}
        while stack:
            v = stack.pop()
            tp = type(v)
            if id(tp) in plain:
                continue
            budget -= 1
            if budget < 0:
                return False
            if id(v) in seen:
                continue
            seen[id(v)] = v
            found = info(tp, local)
            if found is None:
                return False
            elements, members, dict_get, guarded_names = found
            if elements is not None:
                stack.extend(elements(v))
            for m in members:
                try:
                    stack.append(m.__get__(v, tp))
                except AttributeError:
                    pass
            if dict_get is not None:
                d = dict_get(v)
                if d is not None and type(d) is not proxy:  # (a class's namespace: not the value's data)
                    if type(d) is not dict:  # a dict subclass set as ``__dict__``: not walked, so not trusted
                        return False
                    for k, x in dict.items(d):  # an instance attribute hiding a helper a library comparison calls,
                        if type(k) is not str or k in guarded_names or c_level(x):  # or a C-level callable one
                            return False  # that a library function calls by name (``obj.__deepcopy__ = partial(...)``)
                    stack.extend(dict_items(d))
        return True

    def library_class(cls) -> bool:
        return snapshot.get(id(cls), (None,))[0] is cls

    return trusted, overridden, _operators(), frozenset(codes or ()), module_intact, library_class  # noqa: F821
