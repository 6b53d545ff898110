"""What a sandboxed program could reach that no audit event covers beyond what ``_child._UNAUDITED`` names; runs only
inside a sandbox child (its text follows ``_setupdata.py``'s, in the same private globals: see ``sandbox.py``).

- C code outside the standard library. The audit hook sees what the interpreter's own modules do, a third-party
  extension module calls the C library with no event at all. ``numpy`` (whose own ``import ctypes`` is refused, but a
  module the program put into ``sys.modules`` under that name let it load) reads and writes any address through
  ``__array_interface__``: a program found the verdict's nonce in its own memory and wrote the verdict itself (reward
  1 with the fork server); ``psutil`` (with a fake ``_posixsubprocess``) sets another process's priority and
  CPUs. An extension module is now loaded only from the folders of the standard library's own
  (:func:`_extension_roots`), never from ``site-packages``; what the task's tests and setup import is loaded before
  the program runs, as before.
- The removed calls, kept elsewhere: ``os.supports_dir_fd`` holds ``os.mkfifo`` and ``os.mknod`` themselves, which
  without namespaces made a FIFO or a file in any folder the trainer's user may write to (a FIFO where the trainer
  opens a file hangs it). What a loaded module binds, and the sets, lists and dicts it keeps (one level down), are
  cleared of them too (:func:`_unaudited_holders`, :func:`_drop_held`).
- C libraries that read the environment once, when first used, for what to load. OpenSSL, initialized by the
  first import of ``_hashlib``, reads the configuration file ``OPENSSL_CONF`` names, whose providers and engines are
  shared objects of any path: a program that wrote one into its folder, and such a file, set ``os.environ`` and
  imported ``hashlib`` ran its own machine code (no audit event: the dynamic loader's ``dlopen``), which found the
  nonce and wrote the verdict (reward 1 in both modes). These modules are now loaded before the program runs
  (:data:`_READ_ENVIRONMENT_ONCE`, by ``_rewrite._load_imported`` and the fork server), with the trainer's
  environment; and no file of the program's may be mapped executable: its tmpfs is mounted ``noexec`` and
  ``os.memfd_create`` (an anonymous file, ``/proc/self/fd/N``, that no mount's ``noexec`` covers) is removed.
"""

# Extension modules whose C library reads the environment once, when first used, to decide what to load (OpenSSL's
# OPENSSL_CONF: providers and engines, shared objects): imported before the program runs, so the program's
# ``os.environ`` comes too late (``_rewrite._load_imported`` in every child, ``_server._serve`` before it forks)
_READ_ENVIRONMENT_ONCE = ("_hashlib",)

_HOLDERS = (None, ())  # (the _SNAPSHOT they were found for, ((holder, key), ...)): see _unaudited_holders
_ROOTS = (None, ())  # (the _SNAPSHOT they were found for, the folders): see _extension_roots


def _extension_roots() -> tuple:
    """The folders the standard library's extension modules are in (``lib-dynload``, and that of every loaded one),
    real paths, none of them a folder that holds ``site-packages`` (or ``dist-packages``): where an extension module
    may be loaded from once the program runs (``_child._make_hook``). Found once per snapshot, like
    :func:`_unaudited_holders`."""
    import os
    import sys

    global _ROOTS
    if _ROOTS[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_snapshot.py)
        return _ROOTS[1]
    stdlib, suffixes = frozenset(getattr(sys, "stdlib_module_names", ())), (".py", ".pyc")
    base = getattr(sys, "_stdlib_dir", None) or os.path.dirname(getattr(os, "__file__", None) or "")
    roots = {os.path.realpath(os.path.join(base, "lib-dynload"))} if base else set()
    for name, module in list(sys.modules.items()):
        path = vars(module).get("__file__") if type(module) is type(sys) else None
        if type(path) is str and name.split(".")[0] in stdlib and not path.endswith(suffixes):
            roots.add(os.path.dirname(os.path.realpath(path)))
    third = [os.path.realpath(p) for p in sys.path if type(p) is str and ("site-packages" in p or "dist-packages" in p)]
    _ROOTS = (_SNAPSHOT, tuple(sorted(  # noqa: F821
        r for r in roots if os.path.isdir(r) and "site-packages" not in r and "dist-packages" not in r
        and not any(t == r or t.startswith(r.rstrip("/") + "/") for t in third))))
    return _ROOTS[1]


def _unaudited_holders() -> tuple:
    """``((holder, key), ...)``: where a loaded module keeps one of the functions ``_child._UNAUDITED`` names besides
    the modules it is removed from: a name of a module's namespace bound to it (``holder`` that dict), or a set, list
    or dict the module keeps that holds it (as an item, a key or a value). Found once per snapshot of the loaded
    modules, before the functions are removed (the fork server finds them before it forks, like
    ``_guardtools._lru_clears``)."""
    import sys

    global _HOLDERS
    if _HOLDERS[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_snapshot.py)
        return _HOLDERS[1]
    dropped = {}
    for core, facade, names in _UNAUDITED:  # noqa: F821  (_child.py)
        for module in (sys.modules.get(core), sys.modules.get(facade)):
            for name in names:
                f = vars(module).get(name) if type(module) is type(sys) else None
                if f is not None:
                    dropped[id(f)] = f
    found = []
    for module in list(sys.modules.values()):
        if type(module) is not type(sys):
            continue
        namespace = vars(module)
        for k, v in list(namespace.items()):
            if id(v) in dropped and dropped[id(v)] is v:
                found.append((namespace, k))
            elif type(v) is set or type(v) is list:
                found.extend((v, x) for x in list(v) if id(x) in dropped and dropped[id(x)] is x)
            elif type(v) is dict:
                found.extend((v, a) for a, b in list(v.items())
                             if id(b) in dropped and dropped[id(b)] is b or id(a) in dropped and dropped[id(a)] is a)
    _HOLDERS = (_SNAPSHOT, tuple(found))  # noqa: F821
    return _HOLDERS[1]


def _drop_held(holders: tuple) -> None:
    """Removes what :func:`_unaudited_holders` found from where it was found."""
    for holder, key in holders:
        if type(holder) is set:
            set.discard(holder, key)
        elif type(holder) is list:
            holder[:] = [x for x in holder if x is not key]
        elif type(holder) is dict:
            dict.pop(holder, key, None)



_THREAD_LIMIT = [1 << 30]  # how many threads a job may have alive (``_thread._count``: the judge's worker too)
_THREAD_GATE = """def _make(_next, _factory, _send):
    def start_new_thread(function, args, kwargs=None, /):
        worker = _next(_factory)
        _next(worker)
        ok, result = _send(worker, (function, args, kwargs))
        if not ok:
            raise result
        return result
    return start_new_thread
"""


def _cap_threads() -> None:
    """Replaces ``_thread.start_new_thread`` wherever a loaded module keeps it (``_thread``, ``threading``) by one that
    refuses a thread beyond :data:`_THREAD_LIMIT` alive, ``RuntimeError`` as when the system has none left (``_execute``
    sets it to the job's ``max_processes``). ``RLIMIT_NPROC``, which says so, is not enforced for root, and starting a
    thread raises no audit event: with 32 KiB stacks (``threading.stack_size``) a program held hundreds of kernel tasks
    (382 at 512 MiB of address space in ``tests/unit/test_sandbox_redteam31.py``), each a pid of the trainer's machine
    (red-team round 31). The real function and the limit's holder are kept only in a generator's frame (``gi_frame``
    is refused), as ``_frames._frame_builtins`` keeps the real ``eval``. Once per process, before the snapshot."""
    import _thread
    import sys

    real, count, limit = _thread.start_new_thread, _thread._count, _THREAD_LIMIT
    if type(real) is not type(len):
        return  # (replaced already)

    def worker():
        request = yield
        try:
            if type(request) is not tuple or len(request) != 3 or type(request[1]) is not tuple:
                raise TypeError("sandbox: not a request of the thread start's replacement")
            if count() >= limit[0]:
                raise RuntimeError(f"can't start new thread (the sandbox allows {limit[0]} at a time)")
            function, args, kwargs = request
            answer = (True, real(function, args) if kwargs is None else real(function, args, kwargs))
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

    made, namespace = factory(), {"__builtins__": {}}
    next(made)
    exec(compile(_THREAD_GATE, "<sandbox-threads>", "exec"), namespace)
    gate = namespace.pop("_make")(next, made, type(made).send)
    for module in list(sys.modules.values()):
        if type(module) is type(sys):
            namespace = vars(module)
            for k, v in list(namespace.items()):
                if v is real:
                    namespace[k] = gate


_CODEC_CACHE = []  # [the interpreter's codec cache] once found: see _codec_cache


def _codec_cache():
    """The interpreter's own cache of codec lookups (a dict of the C code's, by normalized name: ``'utf_8'``), found
    among what refers to UTF-8's entry, or None. The fork server finds it before it forks (and before ``gc.freeze``,
    after which the collector no longer sees it)."""
    import codecs
    import gc
    import sys

    if not _CODEC_CACHE:
        encodings, info = sys.modules.get("encodings"), codecs.lookup("utf-8")
        own = vars(encodings).get("_cache") if type(encodings) is type(sys) else None
        found = [d for d in gc.get_referrers(info) if type(d) is dict and d is not own
                 and all(type(k) is str and type(v) is codecs.CodecInfo for k, v in d.items())]
        fresh = [n for n in ("utf8", "u8", "utf", "utf8_ucs4") if all(n not in d for d in found)][:1]
        for name in fresh:  # (UTF-8's aliases: nothing imported; a copy the judge keeps, ``_snapshot._held_state``'s,
            # gets no new name)
            codecs.lookup(name)
            found = [d for d in found if name in d]
        _CODEC_CACHE.append(found[0] if len(found) == 1 and fresh else None)
    return _CODEC_CACHE[0]


def _codecs_back(dicts: tuple, bound: tuple):
    """For :func:`_state_clears`: a function that puts the codec caches ``dicts`` back as they were (now, before the
    program runs), and the names ``bound`` (``(namespace, name, value)``) that bind them, when the program changed them:
    compared by identity, key by key and value by value (no key is hashed or compared, so no code of the program's
    runs), and what they held then kept (``_guardtools._HELD``: its finalizers would run in the judge)."""
    from itertools import repeat

    is_, held, text = _ABC_CALLS[4], _HELD, str  # noqa: F821  (_HELD: _guardtools.py)
    kept = tuple((d, dict(d), tuple(d), tuple(dict.values(d))) for d in dicts)

    def codecs_back():
        for d, was, keys, values in kept:
            if dict.__len__(d) != len(keys) or not all(map(is_, d, keys)) or not all(map(is_, dict.values(d), values)):
                held.append(dict.copy(d))
                dict.clear(d)
                dict.update(d, was)
        for namespace, k, v in bound:
            if not all(map(is_, map(type, namespace), repeat(text))):  # (a lookup would compare a program's key)
                raise AssertionError("the program put a key that is no str into the namespace of a codec module")
            if dict.get(namespace, k) is not v:
                held.append(dict.get(namespace, k))
                dict.__setitem__(namespace, k, v)
    return codecs_back


_ZONE_CACHE = []  # [the weak cache of zoneinfo's C class, or None] once found: see _zone_cache


def _zone_cache():
    """The ``data`` dict (key -> weak reference) of the cache of zones ``zoneinfo.ZoneInfo`` keeps in C, found among
    the live weak-value dictionaries as the one that holds a zone made for it (UTC's, then dropped from the cache), or
    None (no time zone files, no ``_zoneinfo``). Found before the program runs (the fork server: before ``gc.freeze``)."""
    import gc
    import sys
    import weakref

    c = getattr(sys.modules.get("_zoneinfo"), "ZoneInfo", None)
    if not _ZONE_CACHE and type(c) is type:  # (not yet loaded: looked for again in the child that loads it)
        found = []
        try:
            zone = c("UTC")
        except Exception:
            zone = None
        if zone is not None:
            found = [o.data for o in gc.get_objects() if type(o) is weakref.WeakValueDictionary
                     and type(o.data) is dict and "UTC" in o.data and o.data["UTC"]() is zone]
            c.clear_cache(only_keys=["UTC"])
        _ZONE_CACHE.append(found[0] if len(found) == 1 else None)
    return _ZONE_CACHE[0] if _ZONE_CACHE else None


def _state_clears() -> tuple:
    """``(clears, codecs)`` (for ``_guardtools._guard_tools``: ``clears`` called before and after each library call of
    a test, ``codecs`` right before it) of what the library keeps beyond a module's namespace and the caches ``_guards``
    empties, where a program could leave an answer for later (nothing they take out is dropped: ``_guardtools._HELD``):

    - codecs. A lookup's result is kept by the interpreter (:func:`_codec_cache`), from ``encodings.search_function``,
      which reads ``encodings._cache``, ``encodings.aliases.aliases`` and ``sys.modules``: a program that put UTF-8's
      entry there under ``cp1252`` had a test's ``'€'.encode('cp1252')`` give UTF-8's bytes (reward 1 for the wrong
      answer), also when it looked the name up once and then put everything back. All three caches are put back as
      they were before the program ran, when changed (:func:`_codecs_back`);
    - ``zoneinfo``: ``ZoneInfo`` keeps every zone it made, by key; a program that pointed ``zoneinfo.reset_tzpath``
      at a folder of its own, made ``ZoneInfo('Europe/Paris')`` from its own file there and reset the path had a
      test's ``ZoneInfo('Europe/Paris')`` get its zone (reward 1). Its caches are emptied, its search path put back."""
    import sys

    clears, codecs, encodings, aliases = [], (), sys.modules.get("encodings"), sys.modules.get("encodings.aliases")
    if type(encodings) is type(sys):
        dicts = {id(d): d for d in (_codec_cache(), vars(encodings).get("_cache"), vars(encodings).get("_aliases"),
                                    getattr(aliases, "aliases", None)) if type(d) is dict}  # (_aliases: the same)
        bound = [(vars(encodings), k, vars(encodings).get(k)) for k in ("_cache", "_aliases")]
        if type(aliases) is type(sys):
            bound.append((vars(aliases), "aliases", vars(aliases).get("aliases")))
        codecs = (_codecs_back(tuple(dicts.values()), tuple(bound)),)
    tzpath, zoneinfo = sys.modules.get("zoneinfo._tzpath"), sys.modules.get("zoneinfo")
    if type(tzpath) is type(sys) and type(zoneinfo) is type(sys):
        path_was, classes = vars(tzpath).get("TZPATH"), [vars(zoneinfo).get("ZoneInfo")]
        classes += [vars(m).get("ZoneInfo") for m in (sys.modules.get("_zoneinfo"),) if type(m) is type(sys)]
        clear_caches = tuple(c.clear_cache for c in classes if type(c) is type and "clear_cache" in vars(c))
        weak, held, namespace, text = _zone_cache(), _HELD, vars(tzpath), str  # noqa: F821  (_HELD: _guardtools.py)
        from itertools import repeat

        def zones_back():
            if not all(map(_ABC_CALLS[4], map(type, namespace), repeat(text))):  # (the lookup below would compare)
                raise AssertionError("the program put a key that is no str into the namespace of zoneinfo._tzpath")
            if dict.get(namespace, "TZPATH") is not path_was:
                held.append(dict.get(namespace, "TZPATH"))
                dict.__setitem__(namespace, "TZPATH", path_was)
            if weak is not None and dict.__len__(weak):  # (the zones, strong references: a weak reference's callback
                held.append([r() for r in dict.values(weak)])  # of the program's would run when the cache drops one)
            for clear in clear_caches:
                clear()
        clears.append(zones_back)
    global _ABCS
    if _ABCS[0] is not _SNAPSHOT or _SNAPSHOT is None:  # noqa: F821  (found once per snapshot, like _lru_clears)
        _ABCS = (_SNAPSHOT, tuple(rec[0] for rec in _SNAPSHOT[0].values() if isinstance(rec[0], _ABC_CALLS[0])))  # noqa: F821
    abcs = _ABCS[1]
    if abcs:
        clears.append(_abc_check(abcs))
    return tuple(clears), codecs


def _abc_calls() -> tuple:
    """``abc.ABCMeta`` and ``_abc``'s ``get_cache_token``, ``_get_dump`` and ``_reset_caches``, bound as this text
    loads (``_reset_caches`` is removed before the program runs: ``_child._UNAUDITED``)."""
    import _abc
    import abc

    import operator

    return abc.ABCMeta, _abc.get_cache_token, _abc._get_dump, _abc._reset_caches, operator.is_


_ABC_CALLS = _abc_calls()
_ABCS = (None, ())  # (the _SNAPSHOT they were found for, its abstract classes): see _state_clears


def _abc_check(abcs: list):
    """For :func:`_state_clears`: the abstract classes' registries (``collections.abc.Mapping.register(list)``) and
    caches, kept in C, where no namespace shows them. A program that registered ``list`` as a ``Mapping`` had the
    test's ``Counter([('a', 1)])`` count ``{'a': 1}`` (``Counter.update`` asks ``isinstance(x, Mapping)``), its own
    wrong answer (reward 1). Whenever the cache token moved (every registration moves it), a class of the library's
    registered since the program began with an abstract class (the library's, or a subclass of one: the library's
    ``issubclass`` asks those too) fails the test, and every abstract class of the library's forgets what its
    checks cached (a registration undone keeps its answer there). The registries cannot be emptied any more
    (``_abc._reset_registry`` is removed; ``_abc._abc_init``, which makes a class's data afresh, fails the test)."""
    meta, token, dump, reset, _ = _ABC_CALLS
    subclasses, snapshot = type.__dict__["__subclasses__"], _SNAPSHOT[0]  # noqa: F821
    was = {id(c): frozenset(id(r()) for r in dump(c)[0]) for c in abcs}
    import _operator

    # (``_abc._abc_init`` makes a class's data afresh: compared by identity, in C, the class namespaces read live)
    proxies = tuple(map(type.__dict__["__dict__"].__get__, abcs))
    get, keys, is_not = type(proxies[0]).get, ("_abc_impl",) * len(proxies), _operator.is_not
    impl_was, last = tuple(map(get, proxies, keys)), [token()]

    def abc_back():
        if any(map(is_not, map(get, proxies, keys), impl_was)):
            raise AssertionError("the program made the data of an abstract class of the library's afresh")
        if token() == last[0]:
            return
        seen, todo = set(), list(abcs)
        while todo:
            c = todo.pop()
            if id(c) in seen:
                continue
            seen.add(id(c))
            todo.extend(subclasses(c))
            try:
                registered = [r() for r in dump(c)[0]]
            except TypeError:  # (not an abstract class: a plain subclass of one)
                continue
            for r in registered:
                if r is not None and snapshot.get(id(r), (None,))[0] is r and id(r) not in was.get(id(c), ()):
                    raise AssertionError("the program registered a class of the library's with an abstract class")
        for c in abcs:
            reset(c)
        last[0] = token()
    return abc_back
