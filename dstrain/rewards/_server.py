"""The fork server's side: code that runs inside a sandbox server process, never in the trainer.

:class:`dstrain.rewards.forkserver.ForkServer` starts ``_child.py``'s ``launch`` stage
with ``"stage": "serve"``: the process is isolated once (namespaces, no capabilities,
``nobody``, ``no_new_privs``, ``RLIMIT_CORE=0``), then re-executes a fresh interpreter
that runs this file in ``_child.py``'s globals and calls :func:`_serve`. The server
holds nothing of the trainer's: an environment of four variables, its own empty
working directory, no inherited descriptors but its control pipes.

:func:`_serve` imports the modules generated programs commonly use (so that no child
pays for them), then loops: read one job from the control pipe, fork a child, pump the
child's stdout, stderr and result pipes (output cap and wall-clock deadline), kill the
child's process group, reap it, reply, then remove its directory (after the reply, off the
trainer's critical path; the next job waits for it). The child
(:func:`_child_main`): a new session, stdin on ``/dev/null``, stdout/stderr/result on
fresh pipes (every other descriptor closed, the control pipes included), a private
temporary directory as working directory, ``HOME`` and ``TMPDIR``, fresh random seeds,
the per-program resource limits, then ``_child._execute`` (audit hook, worker thread,
result line with the nonce). Whatever a program changes (globals, ``sys.modules``,
builtins, cwd, environment, signal dispositions, threads) lives in its forked copy and
dies with it; the server's memory is never written by a child. What children do share
with each other is what the server held when it forked them: the pre-imported modules'
initial state and the interpreter's string-hash seed (``random`` is reseeded per child).

Frames on the control pipes: 4-byte big-endian length, a JSON header, then the raw byte
blobs the header's ``"blobs"`` lengths announce. The server writes ``{"ready": ...}``
once, then per job ``{"started": pid}`` right after the fork and the reply when done.
"""

_PRELOAD = ("ast", "bisect", "collections", "copy", "datetime", "decimal", "enum", "fractions", "functools",
            "heapq", "itertools", "json", "math", "operator", "random", "re", "statistics", "string",
            "tempfile", "textwrap", "typing", "unicodedata", "array", "cmath", "dataclasses", "numbers",
            "queue", "struct", "time", "traceback", "contextlib", "_strptime")


def _frame(header: dict, blobs=()) -> bytes:
    import json

    header = dict(header, blobs=[len(b) for b in blobs])
    head = json.dumps(header).encode()
    return len(head).to_bytes(4, "big") + head + b"".join(blobs)


def _read_exact(fd: int, n: int):
    import os

    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    import os

    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _child_main(job: dict, pipes: tuple, workdir: str, isolation: str) -> None:
    """In the forked child: detach, rewire descriptors, limit, then run the job."""
    import os
    import sys

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out_w, err_w, res_w = pipes
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    os.dup2(res_w, 3)
    os.closerange(4, 1 << 16)  # the control pipes and the server's ends of this job's pipes
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
                       "TMPDIR": workdir})
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        tempfile.tempdir = None
    random = sys.modules.get("random")
    if random is not None:
        random.seed()  # not the server's state: each program draws its own numbers
    limits = job.pop("limits")
    _set_limits(limits)  # noqa: F821  (from _child.py, in whose globals this file runs)
    _execute(job, 3, isolation, int(limits["nproc"]))  # noqa: F821


def _pump(fds: dict, deadline: float, cap: int) -> tuple:
    """Drain ``{name: fd}`` until all close, the deadline, or more than ``cap`` bytes of
    stdout + stderr; returns (ending, {name: bytes})."""
    import os
    import selectors
    import time

    sel = selectors.DefaultSelector()
    out = {name: bytearray() for name in fds}
    for name, fd in fds.items():
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    written, ending = 0, "done"
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ending = "timeout"
                break
            for key, _ in sel.select(min(remaining, 1.0)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    sel.unregister(key.fd)
                    continue
                buf = out[key.data]
                if key.data == "result":  # keep the tail: the real line comes last
                    buf += data
                    del buf[:-(1 << 16)]
                    continue
                written += len(data)
                if len(buf) < cap:
                    buf += data[:cap - len(buf)]
                if written > cap:
                    return "overflow", out
    finally:
        sel.close()
    return ending, out


def _remove(path: str) -> None:
    """Delete the folder ``path`` and everything in it, however deep (a program can nest
    thousands of folders with short names, beyond both ``PATH_MAX`` and Python's recursion
    limit, which ``shutil.rmtree`` reaches), and whatever modes it set. No recursion, one
    folder descriptor open at a time below ``path``: entries of sub-folders are moved up
    into ``path`` itself (``rename`` relative to descriptors) until nothing is left."""
    import os
    import stat

    try:
        os.chmod(path, stat.S_IRWXU)
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    moved, progress = 0, True
    try:
        while progress:  # a pass that removes or moves nothing (entries nothing can delete) is the last
            progress = False
            with os.scandir(top) as it:
                entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            for name, is_dir in entries:
                if not is_dir:
                    try:
                        os.unlink(name, dir_fd=top)
                        progress = True
                    except OSError:
                        pass
                    continue
                try:
                    os.chmod(name, stat.S_IRWXU, dir_fd=top, follow_symlinks=False)
                except (OSError, NotImplementedError):
                    pass
                try:
                    os.rmdir(name, dir_fd=top)  # already empty
                    progress = True
                    continue
                except OSError:
                    pass
                try:
                    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                except OSError:
                    continue
                try:
                    with os.scandir(sub) as it:
                        inner = [e.name for e in it]
                    for child in inner:  # one level up, under a name no entry of ``path`` has
                        moved += 1
                        try:
                            os.rename(child, f".rm{moved}-{child[:32]}", src_dir_fd=sub, dst_dir_fd=top)
                            progress = True
                        except OSError:
                            pass
                finally:
                    os.close(sub)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _one(job: dict, workdir: str, isolation: str, ctl_out: int) -> bytes:
    """Run one job in a forked child; the reply frame."""
    import os
    import signal
    import time

    wall, cap = float(job.pop("wall")), int(job.pop("cap"))
    root = os.path.dirname(workdir)
    os.chmod(root, 0o700)
    os.mkdir(workdir, 0o700)
    # The server's folder read-only for its owner while the program runs: the program is
    # uid 0 without capabilities, so DAC stops calls no audit event covers (``mknod``) from
    # planting anything next to its own folder, e.g. where the next job's folder will be.
    os.chmod(root, 0o500)
    pipes = [os.pipe() for _ in range(3)]
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _child_main(job, tuple(w for _, w in pipes), workdir, isolation)
        finally:
            os._exit(127)
    for _, w in pipes:
        os.close(w)
    _write_all(ctl_out, _frame({"started": pid}))
    reads = {"stdout": pipes[0][0], "stderr": pipes[1][0], "result": pipes[2][0]}
    try:
        ending, out = _pump(reads, start + wall, cap)
    finally:
        for r in reads.values():
            os.close(r)
    for kill in (os.killpg, os.kill):  # the group first; the pid itself if setsid had not run yet
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _, status, usage = os.wait4(pid, 0)
    seconds = time.monotonic() - start
    header = {"ending": ending, "returncode": os.waitstatus_to_exitcode(status),
              "cpu": usage.ru_utime + usage.ru_stime, "seconds": seconds}
    return _frame(header, (bytes(out["stdout"]), bytes(out["stderr"]), bytes(out["result"])))


def _fingerprint() -> tuple:
    """What a program child may change in the server from outside (same uid, no audit event
    for ``setpriority``, ``sched_setaffinity``, ``sched_setscheduler``; ``prlimit`` is
    refused): every later child would inherit it."""
    import os
    import resource

    limits = tuple(resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_"))
    return (os.getpriority(os.PRIO_PROCESS, 0), tuple(sorted(os.sched_getaffinity(0))), os.sched_getscheduler(0),
            os.sched_getparam(0).sched_priority, limits)


def _serve(isolation: str) -> None:
    """The server loop (see the module docstring); leaves when the control pipe closes."""
    import gc
    import json
    import os
    import signal

    for name in _PRELOAD + _READ_ENVIRONMENT_ONCE:  # noqa: F821  (_unaudited.py)
        try:
            __import__(name)
        except ImportError:
            pass
    # Everything the server holds now goes to the collector's permanent generation: a child's
    # collections then never walk (and so never copy-on-write) the server's pages.
    global _SNAPSHOT
    _frame_builtins()  # noqa: F821  (from _frames.py: before the snapshot, which holds every module's __builtins__)
    _cap_threads()  # noqa: F821  (from _unaudited.py: likewise)
    _SNAPSHOT = _type_snapshot()  # noqa: F821  (from _snapshot.py): the classes every child starts with
    _lru_clears()  # noqa: F821  (from _guardtools.py: found once here, for every child of this snapshot)
    _library_cells()  # noqa: F821  (likewise)
    _fixed_namespaces()  # noqa: F821  (from _namespaces.py: likewise)
    _unaudited_holders(), _extension_roots(), _codec_cache(), _zone_cache(), _state_clears()  # noqa: F821  (likewise)
    gc.collect()
    gc.freeze()
    # As its PID namespace's init, the server gets from its children only the signals it
    # handles: Python's SIGINT handler is the one it had (pidfd_send_signal has no audit event).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    root = os.path.realpath(os.getcwd())
    _write_all(ctl_out, _frame({"ready": True, "isolation": isolation, "pidns": "pidns" in isolation.split(",")}))
    n, clean = 0, _fingerprint()
    while True:
        size = _read_exact(ctl_in, 4)
        if size is None:
            os._exit(0)
        data = _read_exact(ctl_in, int.from_bytes(size, "big"))
        if data is None:
            os._exit(0)
        n += 1
        workdir = os.path.join(root, f"job{n}")
        _write_all(ctl_out, _one(json.loads(data), workdir, isolation, ctl_out))
        os.chmod(root, 0o700)
        _remove(workdir)  # after the reply: the program's group is dead already; the trainer need not wait
        if _fingerprint() != clean:
            os._exit(0)  # a program changed the server itself (niceness, CPU set, limits): be replaced
