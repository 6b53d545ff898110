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
    if _ROOTS[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_judge.py)
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
    ``_guards._lru_clears``)."""
    import sys

    global _HOLDERS
    if _HOLDERS[0] is _SNAPSHOT and _SNAPSHOT is not None:  # noqa: F821  (_judge.py)
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
