"""Code that runs inside a sandbox child process; the trainer never executes it.

:mod:`dstrain.rewards.sandbox` passes this file's text on the command line::

    python -I -B -c STUB <this source> launch <config json> <result fd>

and :data:`STUB` executes it in a private globals dictionary. Two stages follow (the
fork server, ``_server.py``, replaces the second by a loop that forks one child per
program and calls :func:`_execute` there).

``launch`` (trusted, before any untrusted byte is read): tries ``unshare`` of a
network and a PID namespace (falling back to a user namespace, then to no namespace,
silently), then of a mount namespace in which every mount is read-only but a fresh tmpfs
on the working directory (:func:`_private_mounts`), drops every capability from the bounding set, switches to an unprivileged
uid when the parent asked for one, sets ``no_new_privs`` and the resource limits, then
(inside a new PID namespace, after one fork so the program is that namespace's init)
re-executes a fresh interpreter for the second stage, so ``ctypes`` is never loaded
where the untrusted code runs.

``run``: reads the job (program, setup, tests, nonce) from stdin and replaces stdin with
``/dev/null``; installs an audit hook (:func:`_make_hook`, which cannot be removed);
then runs program, setup and tests in a separate thread, so that Python signal handlers
(which receive the current frame) cannot be installed by untrusted code, while the main
thread, the only holder of the nonce, waits. It finally writes one line
``<nonce> <passed> <total> <phase> <violations> <isolation>\\t<detail>`` to the result
pipe and leaves with ``os._exit``.

How tests are judged (every value a test operates on must be made of classes that existed,
unchanged, before the program ran; builtins and loaded modules as they were then) is in
``_judge.py`` and ``_guards.py`` (and how tests are rewritten for them in ``_rewrite.py``; what the
program's builtins and modules lack in ``_frames.py``), whose texts run in front of this file's in the same globals;
the ``launch`` stage is in ``_launch.py`` (re-exported here in the trainer).
"""

STUB = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'), {'__name__': '__sandbox__'})"


if __name__ != "__sandbox__":  # in the trainer (``sandbox``, ``forkserver``, tests): stage 1 is in _launch.py
    from dstrain.rewards._launch import (  # noqa: F401
        CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWUSER, TMPFS_BYTES, TMPFS_INODES, _launch, _map_own_ids,
        _private_mounts, _set_limits)


# Audit events that are always refused and counted as violations.
_DENY = frozenset({
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "os.kill", "os.killpg", "os.link", "os.symlink", "os.chflags",
    "os.lchflags", "os.setxattr", "os.removexattr", "os.startfile", "sys.addaudithook",
    "sys.settrace", "sys.setprofile", "sys._current_frames", "sys._current_exceptions",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "webbrowser.open",
    "sys.monitoring.register_callback", "sys.remote_exec",  # (3.12+, 3.14+): callbacks get the judge's callables
    "code.__new__", "marshal.loads", "marshal.load",  # hand-made bytecode reads and writes memory at will
    # The working directory stays the program's folder: the hook resolves a relative path against
    # it, and cannot see the ``dir_fd`` an ``open`` is relative to, so a program that moved deeper
    # could name a path that looks inside its folder to the hook but leaves it for the kernel.
    "os.chdir",
})
# Extension modules that start processes, touch files or the network or corrupt memory without an audit event of
# their own (``_posixsubprocess.fork_exec``, ``_testcapi``, sub-interpreters, Tcl's ``exec`` and ``open``, readline's
# history files, ``/etc/shadow``, the system log, ``/dev/shm``, ``nis``: its C library's RPC to the portmapper and DNS
# queries, the network without namespaces): refused by name or file name, however they are loaded.
_DENY_MODULES = ("_posixsubprocess", "_ctypes", "_test", "_xx", "xx", "_tkinter", "readline", "spwd", "syslog",
                 "_posixshmem", "_multiprocessing", "_ssl", "nis")  # (_ssl: OpenSSL reads certificate files anywhere)
_DENY_PREFIXES = ("socket.", "ctypes.", "_ctypes.", "sqlite3.", "winreg.", "msvcrt.")
# Calls with no audit event that reach other processes of the same user, make special files (or executable ones:
# ``memfd_create``, see _unaudited.py) or expose the judge: removed from the modules before the program runs
# (``_frames._drop_unaudited``). With PID and mount namespaces they reach nothing outside anyway; without them (an
# unprivileged trainer with no user namespaces, a container that forbids unshare) ``pidfd_open`` +
# ``pidfd_send_signal`` would signal the trainer, ``setpriority`` / ``sched_set*`` slow it, and ``mknod`` / ``mkfifo``
# create files outside the program's folder.
# (C module, the Python module that re-exports it, names)
_UNAUDITED = (("posix", "os", ("pidfd_open", "mknod", "mkfifo", "setpriority", "sched_setaffinity", "memfd_create",
                               "sched_setscheduler", "sched_setparam", "sync")),  # (sync: every disk's writeback)
              # a handler runs in the main thread, with its frame (f_back, f_locals and f_globals are not audited):
              # the program never runs there but as a finalizer of a collection the main thread's allocation starts
              ("_signal", "signal", ("pidfd_send_signal", "signal", "set_wakeup_fd")),
              # a fresh instance of a built-in module has every function again (all are loaded before the program
              # runs, and the hook refuses to import one afresh, but this makes one with no audit event)
              ("_imp", "_imp", ("create_builtin",)),
              # gc.set_debug(DEBUG_SAVEALL) puts every unreachable object in gc.garbage, frames of the audit hook
              # included (their globals and closures are the judge's); the profile function the judge sets stays out
              # (getrefcount: a test's constants, compiled before the program ran, each add a reference to the
              # small int, True or None they are, and a program that knew the counts of a run without them read
              # the expected answers off the difference; red-team round 26)
              ("gc", "gc", ("set_debug",)), ("sys", "sys", ("getprofile", "gettrace", "getrefcount")),
              ("_abc", "abc", ("_reset_registry", "_reset_caches")),  # (``_unaudited._state_clears``: see there)
              ("_codecs", "codecs", ("register", "register_error")))  # (the program's codec or error handler
# would run inside a test's C call, ``codecs.encode``, where no profile guard watches)
# Descriptor owners that get SIGIO (or any signal ``F_SETSIG`` picks, SIGKILL too) when I/O is ready: a signal
# to any process of the same uid (or any, for euid 0) with no kill event (F_SETOWN, F_SETSIG, F_SETOWN_EX; ioctl
# FIOSETOWN, SIOCSPGRP); and, on a descriptor opened to read a file outside, a lease (F_SETLEASE: the trainer's open
# waits) or the inode's flags and version (FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR, FS_IOC_SETVERSION, 64- and 32-bit).
_SIGNAL_OWNER = {"fcntl.fcntl": (8, 10, 15, 1024),
                 "fcntl.ioctl": (0x8901, 0x8902, 0x40086602, 0x40046602, 0x401C5820, 0x40087602, 0x40047602)}
# Frame access: refused (so the nonce stays out of reach) but not counted, because the
# standard library probes sys._getframe (namedtuple, enum) and copes with ValueError.
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
# Events that modify a path: (indices of path arguments, indices of dir_fd arguments).
_PATH_WRITE = {
    "os.mkdir": ((0,), (2,)), "os.rmdir": ((0,), (1,)), "os.remove": ((0,), (1,)),
    "os.rename": ((0, 1), (2, 3)), "os.truncate": ((0,), ()), "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)), "shutil.rmtree": ((0,), (1,)),
}


def _make_hook(tmp: str, read_roots: tuple, violations: list, quiet: set = frozenset(), kept=None, room=None):
    """The audit hook: refuses process creation, signals, sockets, ctypes, introspection,
    writes outside ``tmp`` and reads outside ``read_roots``; records refusals. ``quiet``: ids of
    threads inside the judge's own ``sys.setprofile`` calls (nothing else runs there), and ``"defaults"`` once a
    function's defaults were read or set. ``kept``: whether the built-in classes are intact (``_namespaces.py``).
    ``room``: ``(files, entries)`` the program may make in ``tmp`` when it is no tmpfs (no mount namespace), else None:
    a file takes up to the file size limit of the trainer's disk, so without it a program wrote files until its wall
    limit, as fast as the disk took them (red-team round 31); beyond, ``OSError`` as from a full tmpfs."""
    import _thread
    import builtins
    import gc
    import os
    import posixpath
    import stat
    import sys
    import types

    # Path functions with private globals: ``realpath`` reads ``os.lstat`` and ``os.readlink`` from the live
    # module, where a program's replacement would run in here and could lie about where a path leads.
    starts, rstrip, rsplit, split, replace, text, decode, join_bytes, index, append, add, mode_of, safe_lstat = \
        _hook_methods()  # noqa: F821  (_namespaces.py: bound now, and the mode read through a C descriptor)
    g = dict(vars(posixpath), os=types.SimpleNamespace(**dict(vars(os), lstat=safe_lstat)), __builtins__=dict(
        vars(builtins)), stat=types.SimpleNamespace(**vars(stat)))  # (builtins too: ``isinstance`` is read there)
    for k, f in vars(posixpath).items():
        if type(f) is types.FunctionType:
            g[k] = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
            g[k].__kwdefaults__ = f.__kwdefaults__
    get_ident, getcwd, readlink, realpath, getpid = _thread.get_ident, os.getcwd, os.readlink, g["realpath"], os.getpid
    builtin_names, extension_roots = frozenset(sys.builtin_module_names), _extension_roots()  # noqa: F821
    join, isabs, lstat, S_ISDIR, S_ISREG = g["join"], g["isabs"], os.stat, stat.S_ISDIR, stat.S_ISREG
    encoding, errors = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()
    gc_enabled, gc_disable, gc_enable = gc.isenabled, gc.disable, gc.enable
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    # Nothing here may call a method of an argument: ``sys.audit`` lets the program raise any event with any
    # arguments, and code of its own run in here (``isinstance`` reads ``__class__``, ``in`` hashes, ``!r``)
    # would run in the middle of the check. Types are compared by identity.
    def kind(x, types) -> bool:
        return issubclass(type(x), types)  # (the real type, against built-in ones: no __instancecheck__)

    def shown(x) -> str:
        return repr(x) if type(x) is str or type(x) is bytes else "an object"

    def under(path: str, roots) -> bool:
        return any(path == r or starts(path, rstrip(r, "/") + "/") for r in roots)

    def resolve(p, dir_fd=None):
        if kind(p, str):
            p = text(p)  # an exact str: a subclass cannot lie to the checks below
        elif kind(p, (bytes, bytearray)):
            p = decode(join_bytes(b"", (p,)), encoding, errors)
        else:
            return None  # path-like objects could answer differently on a second call
        if "\0" in p or kept is not None and not kept():
            return None
        if not isabs(p):
            fd = index(dir_fd) if kind(dir_fd, int) else None
            base = getcwd() if fd in (None, -1, -100) else readlink(f"/proc/self/fd/{fd}")
            p = join(base, p)
        return realpath(p)

    def deny(event: str, why: str):
        if len(violations) < 20:
            append(violations, f"{event}: {why}"[:200])
        raise PermissionError(f"sandbox: {event} is not allowed ({why})")

    made = [0, 0]  # (files, entries the program made in ``tmp``: see ``room``; an upper bound, see ``recount``)
    scandir, entry_is_dir, entry_path, pop = os.scandir, os.DirEntry.is_dir, os.DirEntry.path.__get__, list.pop
    threads = _thread._count

    def recount() -> None:
        """``made`` as what ``tmp`` holds now, walked: a file removed (or a folder emptied) gives its room back as on
        a tmpfs. Before, every file ever made counted, so an honest program making and removing temporary files
        (``tempfile.mkstemp`` then ``os.remove``, 40 a test) ran out at the 65th without namespaces only. Whatever a
        name moved to (a folder renamed with its files), the walk finds it. Walked only while no thread of the
        program's runs (the judge's worker alone: no file moves behind the walk), and left as it was where a folder
        cannot be listed (``chmod 0``, gone): the count never falls below what the folder holds."""
        if threads() > 1:
            return
        files = entries = 0
        stack = [tmp]
        while stack:
            try:
                with scandir(pop(stack)) as found:
                    for entry in found:
                        entries += 1
                        if entry_is_dir(entry, follow_symlinks=False):
                            append(stack, entry_path(entry))
                        else:
                            files += 1
            except OSError:
                return
        made[0], made[1] = files, entries

    def take(path, file: bool) -> None:
        try:
            lstat(path)
            return  # (there already: rewritten)
        except OSError:
            pass
        if made[1] >= room[1] or file and made[0] >= room[0]:
            recount()
        if made[1] >= room[1] or file and made[0] >= room[0]:
            raise OSError(28, f"sandbox: no room left in the program's folder ({room[0]} files, {room[1]} entries)")
        made[0] += 1 if file else 0
        made[1] += 1

    def writable(path) -> bool:
        if path is None:
            return False
        if path == "/dev/null":
            return True
        if not under(path, (tmp,)):
            return False
        try:
            mode = mode_of(lstat(path))
        except OSError:
            return True
        return S_ISREG(mode) or S_ISDIR(mode)

    def check(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if kind(path, int) and not kind(path, bool):
                return
            target = resolve(path)
            write = (kind(flags, int) and index(flags) & write_flags) or (
                kind(mode, str) and any(c in text(mode) for c in "wax+"))
            if write:
                if not writable(target):
                    deny(event, f"write to {target or shown(path)}")
                if room is not None and target != "/dev/null":
                    take(target, True)
                return
            if target is None or not under(target, read_roots):
                deny(event, f"read of {target or shown(path)}")
            try:
                is_dir = S_ISDIR(mode_of(lstat(target)))
            except OSError:
                is_dir = False
            if is_dir and not under(target, (tmp,)):
                deny(event, f"directory {target}")
        elif event in _DENY or starts(event, _DENY_PREFIXES):
            deny(event, "forbidden")
        elif event in _SIGNAL_OWNER and type(args) is tuple and len(args) > 1 and type(args[1]) is int \
                and args[1] in _SIGNAL_OWNER[event]:  # the C call's own ints (``sys.audit`` may pass anything)
            deny(event, "a signal owner, lease or inode flags for a descriptor")
        elif event == "resource.prlimit":
            pid = (tuple(args) + (0,))[0]  # an exact int: the C value the call will use
            if type(pid) is not int or (pid != 0 and pid != getpid()):  # another process: the fork server, say
                deny(event, "limits of another process")
        elif event == "import":
            args = tuple(args) + (None, None)
            name, path = args[0], args[1]
            name = decode(name, encoding, errors) if kind(name, bytes) else text(name) if kind(name, str) else ""
            short = replace(rsplit(name, ".", 1)[-1], "-", "_")  # the C loader's PyInit_<name>: '-' is '_' there
            if starts(short, _DENY_MODULES) or (name if path is None else short) in builtin_names:
                deny(event, f"module {name}")  # (a built-in one was loaded before: this would be a second copy)
            if path is not None:  # an extension module's file: the standard library's (see _unaudited.py), not others'
                target = resolve(path)  # (/proc/self/fd/N names the file it is open on)
                if target is None or not under(target, extension_roots) or under(target, (tmp,)) \
                        or starts(replace(split(rsplit(target, "/", 1)[-1], ".", 1)[0], "-", "_"), _DENY_MODULES):
                    deny(event, f"extension module {target or shown(path)}")
        elif event in ("os.listdir", "os.scandir"):
            path = (tuple(args) + (None,))[0]
            if kind(path, int) and not kind(path, bool):
                return
            target = resolve("." if path is None else path)
            if target is None or not under(target, read_roots):
                deny(event, f"listing of {target or shown(path)}")
        elif event == "sys._getframe":
            raise ValueError("sandbox: frame access is not allowed")
        elif event in ("object.__getattr__", "object.__setattr__"):
            name = args[1] if len(args) > 1 and type(args[1]) is str else ""
            if name in ("__defaults__", "__kwdefaults__"):  # from now on the guards check the library's functions'
                add(quiet, "defaults")  # defaults (``_guards._make_guards``' ``cells_kept``: costly for every test)
            if event == "object.__getattr__" and name in _FRAME_ATTRS:
                raise AttributeError(f"sandbox: {name} is not accessible")
            if event == "object.__setattr__" and name == "__code__":  # a library function made to run the program's code
                deny(event, "replacing a function's __code__")
        elif event in _PATH_WRITE:
            path_at, dir_fd_at = _PATH_WRITE[event]
            args = tuple(args)
            for n, at in enumerate(path_at):
                if at >= len(args):
                    continue
                if kind(args[at], int) and not kind(args[at], bool):  # an open descriptor: the file it is open on
                    if event in ("os.chmod", "os.chown", "os.utime"):  # may be outside (opened to read), and no
                        deny(event, "a descriptor's mode, owner or times")  # check of it outraces a dup2
                    continue
                dir_fd = args[dir_fd_at[n]] if n < len(dir_fd_at) and dir_fd_at[n] < len(args) else None
                target = resolve(args[at], dir_fd)
                if not writable(target):
                    deny(event, f"change to {target or shown(args[at])}")
                if room is not None and event == "os.mkdir":
                    take(target, False)

    def hook(event: str, args: tuple) -> None:
        if (event == "sys.setprofile" or event == "sys._getframe") and get_ident() in quiet:  # the judge's own call
            return
        # No event is let through unchecked, even one raised by code run in here; and no collection runs in
        # here (a finalizer of the program's would run in the middle of the check)
        enabled = gc_enabled()
        gc_disable()
        try:
            check(event, args)
        finally:
            if enabled:
                gc_enable()

    return hook


def _worker(job: dict, prepared: list, box: list, judge: tuple, done) -> None:
    """Runs program, setup and tests (the only place untrusted code runs); fills ``box``
    with ``[passed, phase, detail]``. Each prepared test (``_rewrite._prepare_test``) is a
    code object run as a function of the program's namespace with fresh guards."""
    import builtins
    import gc
    import sys

    out, err = sys.stdout, sys.stderr
    bdict = builtins.__dict__
    function = type(_worker)
    checks, modules, tools = judge
    saved, clear, update, kept, release, gc_on, gc_off = (None, dict.clear, dict.update, tools[-1], done.release,
                                                          gc.enable, gc.disable)  # (bound now: see _namespaces.py)
    try:
        try:
            code = compile(job["program"], "<solution>", "exec")
        except BaseException as e:  # SyntaxError, ValueError (null bytes), MemoryError
            box[1:] = ["compile", _describe(e)]  # noqa: F821  (_guards.py)
            return
        saved = dict(bdict)
        ns = {"__name__": "solution", "__builtins__": builtins}
        try:
            exec(code, ns)
        except BaseException as e:
            box[1:] = ["program", _describe(e)]  # noqa: F821  (_guards.py)
            return
        _LIFT()  # noqa: F821  (_guardtools.py: the judge's code runs under the recursion limit it had, not a lower one)
        if job["setup"].strip() and tools[0]() != 1:  # (a thread of the program's that ran alongside the setup, or
            box[1:] = ["setup", "a thread of the program was running when the setup began"]  # ran after the builtins
            return  # were put back, changed what the setup bound before it was copied: see _setupdata._run_setup)
        if not kept():
            return
        clear(bdict)
        update(bdict, saved)
        if job["setup"].strip():
            try:
                _run_setup(ns, tools)  # noqa: F821  (_setupdata.py: with the real builtins, its bindings kept)
            except BaseException as e:
                box[1:] = ["setup", _describe(e)]  # noqa: F821  (_guards.py)
                return
        passed, detail = 0, ""
        for i, prep in enumerate(prepared):
            gc_off()  # (no finalizer of the program's in the judge's code until the test runs)
            _LIFT()  # noqa: F821
            if tools[0]() != 1 or not kept():  # (before the judge's code looks up methods by name again; no thread
                detail = detail or f"test {i + 1}: a thread of the program was running"  # of the program's left, nor
                break  # one still ending, to change a namespace meanwhile; a changed one is the run's violation)
            clear(bdict)
            update(bdict, saved)
            ok, why, bad = False, "failed", []
            try:
                if type(prep) is str:  # a test that does not compile
                    why = prep
                else:
                    guards = _make_guards(checks, ns, bad, saved, modules, prep[1], tools)  # noqa: F821
                    gc_on()  # (only now: a finalizer of the program's would run in the judge's code above)
                    function(prep[0], ns)(*guards)
                    ok = not bad and kept()  # (and no built-in class changed: see _namespaces.py)
            except BaseException as e:
                why = _describe(e)  # noqa: F821  (_guards.py)
            if bad:  # even when the program caught the guard's exception
                ok, why = False, bad[0]
            if ok:
                passed += 1
            elif not detail:
                detail = f"test {i + 1}: {why}"
        box[:] = [passed, "ok", detail]
    finally:
        _LIFT()  # noqa: F821  (before the main thread's code: the last test's may have lowered the limit)
        gc_on()
        if saved is not None and kept():
            clear(bdict)
            update(bdict, saved)
        for stream in (out, err):
            try:
                stream.flush()
            except BaseException:
                pass
        release()


def _run(result_fd: int, isolation: str, max_processes: int) -> None:
    """Stage 2: read the job from stdin, then :func:`_execute` it."""
    import json
    import os

    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    job = json.loads(b"".join(chunks))
    del chunks
    _execute(job, result_fd, isolation, max_processes)


def _execute(job: dict, result_fd: int, isolation: str, max_processes: int) -> None:
    """Install the hook, run the worker, report with the nonce, leave with ``os._exit``.

    Runs in a process of its own (a spawned interpreter, or a child forked by the fork
    server) whose working directory is the program's private temporary directory."""
    import _thread
    import builtins
    import os
    import resource
    import sys
    import time

    # Every builtin this file uses is looked up in its private globals from now on, so a
    # program that replaces builtins cannot change how its results are judged.
    scope = globals()
    for name, value in vars(builtins).items():
        if not name.startswith("__"):
            scope.setdefault(name, value)
    write, fstat, exit_now, sleep, count = os.write, os.fstat, os._exit, time.sleep, _thread._count
    text, replace, encode = str.__str__, str.replace, str.encode  # (bound now: see _namespaces.py)
    st = fstat(result_fd)
    pipe_id = (st.st_dev, st.st_ino)
    nonce = job.pop("nonce").encode()
    tmp = os.path.realpath(os.getcwd())
    roots = {tmp, "/dev/null", "/dev/urandom", "/dev/zero", "/proc/cpuinfo", "/proc/meminfo",
             "/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/share", "/lib", "/lib64", "/etc/localtime"}
    for p in sys.path:  # the import path, not the whole prefix (a virtual environment's other files stay closed)
        if p:
            roots.add(os.path.realpath(p))
    global _SNAPSHOT
    _frame_builtins()  # noqa: F821  (_frames.py: eval, exec, globals, locals and vars refuse the judge's frames)
    _cap_threads()  # noqa: F821  (_unaudited.py: at most ``max_processes`` threads, root or not)
    _THREAD_LIMIT[0] = max_processes  # noqa: F821
    if _load_imported(job) or _SNAPSHOT is None:  # noqa: F821  (the fork server took it once, before forking)
        _SNAPSHOT = _type_snapshot()  # noqa: F821
    prepared = []
    for src in job["tests"]:
        try:
            prepared.append(_prepare_test(src))  # noqa: F821  (from _rewrite.py, in whose globals this file runs)
        except (SyntaxError, ValueError, TypeError) as e:
            prepared.append(_describe(e))  # noqa: F821  (_guards.py)
    total = len(prepared)
    checks = _make_trust(*_SNAPSHOT)  # noqa: F821
    violations = []
    box = [0, "crash", "worker did not finish"]
    done = _thread.allocate_lock()
    acquire = done.acquire  # (bound now: see _namespaces.py)
    acquire()
    # Modules are compiled from source from now on: no .pyc is read (marshal is refused, see
    # _DENY) and none can be planted, as the cache folder would be inside the program's own.
    sys.pycache_prefix = os.path.join(tmp, ".no-pycache")
    import signal  # noqa: F401  (loaded now, so that _drop_unaudited reaches its copy too)
    _drop_unaudited()  # noqa: F821  (_frames.py, like _frame_builtins)
    tools = _guard_tools(_QUIET, job["setup"])  # noqa: F821  (_guardtools.py; _QUIET: _frames.py)
    fsize = resource.getrlimit(resource.RLIMIT_FSIZE)[0]  # (the job's: set before this stage, or by the fork server)
    room = None if "mntns" in isolation.split(",") else (  # (the tmpfs's room: _launch.py)
        max(1, TMPFS_BYTES // fsize) if fsize > 0 else TMPFS_INODES, TMPFS_INODES)  # noqa: F821
    sys.addaudithook(_make_hook(tmp, tuple(sorted(roots)), violations, tools[5], tools[-1], room))
    _thread.start_new_thread(_worker, (job, prepared, box, (checks, _SNAPSHOT[1], tools), done))
    try:  # only now: counted per user, the limit could otherwise stop the worker thread itself
        resource.setrlimit(resource.RLIMIT_NPROC, (max_processes, max_processes))
    except (ValueError, OSError):
        pass
    acquire()
    _LIFT()  # noqa: F821  (the program's lowered recursion limit left this thread no verdict)
    for _ in range(1000):  # let the worker thread end (0.5 s at most); any other thread is a violation
        if count() == 0:
            break
        sleep(0.0005)
    if tools[0]():  # (also one whose count dropped but whose finalizers still run: see _guardtools._thread_counter)
        violations[len(violations):] = ["threads left running"]
    if not tools[-1]():  # a built-in class's namespace changed, ever: the program's method would write this line
        violations[:0] = ["the program changed the namespace of a built-in class"]
    passed, phase, detail = box
    if violations:
        phase, detail = "violation", violations[0]
    detail = replace(replace(text(detail), "\n", "\\n"), "\t", " ")[:1000]
    line = b"\n" + nonce + encode(f" {int(passed)} {total} {phase} {len(violations)} {isolation}\t{detail}\n",
                                   "utf-8", "replace")
    st = fstat(result_fd)
    if (st.st_dev, st.st_ino) == pipe_id:  # the program may have swapped the descriptor
        write(result_fd, line)
    exit_now(0)


if __name__ == "__sandbox__":
    import json as _json
    import os as _os
    import sys as _sys

    _os.environ.pop("PYTHONHASHSEED", None)  # read at start-up (see ``_launch``); the program sees the four variables
    if _sys.argv[2] == "launch":
        _launch(_json.loads(_sys.argv[3]), int(_sys.argv[4]))
    elif _sys.argv[2] == "serve":
        exec(compile(_sys.argv[3], "<sandbox-server>", "exec"), globals())
        _serve(_sys.argv[4])  # noqa: F821  (from _server.py, executed into these globals just above)
    else:
        _run(int(_sys.argv[3]), _sys.argv[4], int(_sys.argv[5]))
