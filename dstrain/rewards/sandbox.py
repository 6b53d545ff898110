"""Run untrusted generated programs and their tests in a separate, locked-down process.

Nothing generated ever runs in the trainer's process. Two modes (``SandboxLimits.mode``):

* ``"fork_server"`` (the default on Linux): a long-lived, already-isolated server
  interpreter per worker, with the usual modules imported, forks a fresh child per
  program; the child gets a new session, its own temporary directory, the environment
  below, the resource limits and the audit hook, then runs the program exactly as a
  spawned one does. Nothing a program changes reaches the next one (its changes live
  in its forked copy). A dead or stuck server is replaced. See ``forkserver.py``.
* ``"spawn"`` (the default elsewhere): :func:`run_program` starts, for
  each program, ``python -I -B`` (:data:`sys.executable`) in a fresh temporary directory
(removed afterwards), in a new session, with an environment of four variables
(``PATH``, ``LANG``, ``HOME`` and ``TMPDIR``, the last two pointing at that directory),
writes the job to its stdin, and collects stdout/stderr (at most
``SandboxLimits.output_bytes`` kept; more output kills the run) and a result line on a
separate pipe. A wall-clock deadline kills the whole process group with ``SIGKILL``.

Layers, from the kernel up (see ``_child.py`` for the child side):

* resource limits set in the child before the program's interpreter starts:
  ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NPROC``, ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE=0``;
* a new network namespace (no interfaces but a down loopback) and a new PID namespace
  (the trainer's pid does not exist there, and a fresh ``/proc`` lists none of its
  processes) when ``unshare`` is permitted; silently skipped when it is not;
* a new mount namespace in which every mount is remounted read-only and the program's
  folder is a fresh ``noexec`` tmpfs of ``_child.TMPFS_BYTES`` (64 MiB): nothing outside it can be
  created even by calls no audit event covers (``mknod``, ``mkfifo``), and a disk-filling
  program fills 64 MiB of memory, not the trainer's disk (``ExecResult.isolation`` then
  says ``mntns,rofs``);
* when the trainer runs as root: an empty capability bounding set (no ``mknod``,
  ``mount``, raw sockets, raising limits), ``no_new_privs``, and, when the interpreter
  is readable by ``nobody``, the uid/gid of ``nobody``;
* an audit hook installed before the program runs, which cannot be removed, refusing
  process creation (fork, exec, spawn, system, ``subprocess``), signals (``os.kill``,
  ``os.killpg``), sockets, ``ctypes``, garbage-collector and frame introspection,
  tracing, writes outside the temporary directory (``/dev/null`` excepted), links,
  reads and directory listings outside the import path and a few system folders (so
  ``/proc/<pid>/environ`` and the trainer's home are out of reach), hand-made code objects
  (``code.__new__``, ``marshal.loads``: modules are compiled from source, no ``.pyc`` is
  read), and extension modules that act without audit events of their own
  (``_posixsubprocess``, ``_ctypes``, ``_testcapi``, sub-interpreters), however loaded.
  Every refusal except frame access makes the run ``"error"`` with reward 0, even when
  the program catches the exception.

The result line carries a random nonce passed on stdin, which the child reads before
any untrusted code runs and keeps only in the frame of its main thread, while the
program runs in another thread; frame access is refused, so the program cannot print
a forged "all passed" line. Tests are judged so that they cannot be won without computing
the answer (``_judge.py``, ``_guards.py``): every value a test operates on (comparison and arithmetic
operands, arguments of library calls, the asserted value) must be built, deeply, from
classes that existed with the same comparison, arithmetic and truth methods before the
program ran, so an always-equal object (however its class was made), a patched
``Counter.__eq__`` or such an object inside a list, ``UserList``, ``deque`` or ``Fraction``
fails the test; builtins, loaded modules and their attributes are read as they were before
the program ran (a program-defined ``set`` or a patched ``math.isclose`` does not reach the
test; the one exception is a tested function that is itself named like a builtin); a library function
a test calls finds its module, what that module keeps (dispatch tables, instances' and classes' attributes) and
the modules the interpreter's C code calls into (``copyreg``, ``_strptime``, ``re``) as they were, its
memoized results emptied, and the time zone unmoved; and a program thread still running while a value is judged
fails the test.

Consequences for programs: no ``ctypes`` and therefore no ``numpy``; no subprocesses
(``import subprocess`` itself is refused, and with it ``asyncio`` and ``multiprocessing``);
threads must have ended when the tests finish; ``sys._getframe``/``traceback`` frame access
raises; only the temporary directory is writable, and nothing in it is executable (no
``os.memfd_create`` either); imported modules compile from source.

Not protected against: a determined attacker with a CPython memory-corruption bug or a
kernel exploit (this is not a security boundary of the strength of a VM or of seccomp:
there is no seccomp filter, and as root without ``nobody`` the child keeps uid 0 without
capabilities, so the read-only mounts and the audit hook are what keep it from files);
denial of service within the limits (CPU, memory, 64 MiB of tmpfs); reading files on the
import path (standard library, site-packages) and under ``/usr/lib``, ``/usr/share`` and
``/lib``; a test that hands a lambda to the program (lambda bodies in tests are not
guarded, but for those given to ``map``, ``filter`` and the ``key`` of ``sorted``, ``min`` and
``max``); a program that patches a module it imported itself and the test then uses (only
modules loaded before the program ran are restored); stdlib classes with Python-level
comparison methods first imported by the program (their instances then count as
untrusted: a correct program returning one scores 0). Without namespaces (no root, no
user namespaces) writes, network and process isolation rest on the audit hook alone, and on
the removal, before the program runs, of the calls no audit event covers that reach other
processes or make special files (``pidfd_open``/``pidfd_send_signal``, ``setpriority``,
``sched_set*``, ``mknod``, ``mkfifo``); the hook then gives the folder the tmpfs's room (64 files
at 1 MiB, 8192 entries). An unprivileged trainer's user namespace maps its own uid and gid, so the
program's tmpfs folder takes files.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pwd
import secrets
import selectors
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dstrain.rewards import _child
from dstrain.rewards._server import _remove as _remove_tree  # any depth: see its docstring

STATUSES = ("passed", "failed", "timeout", "error", "crash")
MODES = ("fork_server", "spawn")


def default_mode() -> str:
    """``"fork_server"`` on Linux (it relies on ``fork`` and ``/proc``), ``"spawn"`` elsewhere."""
    return "fork_server" if sys.platform.startswith("linux") else "spawn"


#: Linux's limit on one command-line argument (MAX_ARG_STRLEN, 32 pages): the child's source travels as one.
ARG_BYTES = 32 * 4096


def compact_source(text: str) -> str:
    """``text`` without its comments and docstrings (parsed and written back by ``ast``; the code is the
    same): the child's source is passed to each interpreter as one argument, which Linux caps at
    :data:`ARG_BYTES`, and the sandbox modules' prose alone would take a third of that."""
    import ast
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and all(isinstance(n, ast.stmt) for n in body):
            kept = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                                            and isinstance(n.value.value, str))]
            node.body = kept or [ast.Pass()]
    out = _one_space_indents(ast.unparse(tree)) + "\n"
    if len(out.encode()) >= ARG_BYTES:
        raise RuntimeError(f"the sandbox child's source is {len(out.encode())} bytes even without comments, over "
                           f"Linux's {ARG_BYTES} for one argument: split it, or pass it another way")
    return out


def _one_space_indents(code: str) -> str:
    """``ast.unparse``'s output with one space per indentation level instead of four (a sixth of the sandbox
    modules' compacted bytes). ``unparse`` writes every statement on its own line and every string on one line
    (escaped), so a line's leading spaces are only its indentation; where that does not hold (the result parses to
    another tree), ``code`` is returned as it is."""
    import ast
    lines = []
    for line in code.split("\n"):
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        if indent % 4:
            return code
        lines.append(" " * (indent // 4) + body)
    out = "\n".join(lines)
    return out if ast.dump(ast.parse(out)) == ast.dump(ast.parse(code)) else code


_CHILD_SOURCE = compact_source("".join((Path(_child.__file__).parent / name).read_text()
                                       for name in ("_rewrite.py", "_judge.py", "_snapshot.py", "_guards.py",
                                                    "_guardtools.py", "_frames.py", "_namespaces.py",
                                                    "_setupdata.py", "_unaudited.py", "_launch.py",
                                                    "_child.py")))
_RESULT_CAP = 1 << 16


@dataclass
class SandboxLimits:
    """Limits for one sandboxed run.

    ``cpu_seconds`` is the CPU-time limit (``RLIMIT_CPU``); ``wall_seconds`` the
    wall-clock deadline after which the process group is killed; ``memory_bytes`` the
    address-space limit; ``file_size_bytes`` the largest file the program may write;
    ``max_processes`` ``RLIMIT_NPROC`` and the most threads alive at once (Linux does not enforce
    the former for root; the audit hook refuses process creation); ``open_files`` ``RLIMIT_NOFILE``;
    ``output_bytes`` how much stdout and stderr may be written in total before the run
    is killed (and how much of each is kept). ``namespaces`` tries network and PID
    namespaces; ``drop_root`` runs as ``nobody`` when the trainer is root and the
    interpreter allows it; ``tmp_root`` is where temporary directories are made
    (default: the system's). ``mode`` is ``"fork_server"``, ``"spawn"`` or ``""`` (the
    platform's default, :func:`default_mode`); see the module docstring.
    """

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 1 << 20
    max_processes: int = 64
    open_files: int = 64
    output_bytes: int = 1 << 16
    namespaces: bool = True
    drop_root: bool = True
    tmp_root: str | None = None
    mode: str = ""

    def __post_init__(self) -> None:
        if self.mode not in ("",) + MODES:
            raise ValueError(f"SandboxLimits.mode must be one of {', '.join(MODES)} (or empty for the default), "
                             f"got {self.mode!r}")
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "file_size_bytes",
                     "max_processes", "open_files", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")
        if self.open_files < 16:
            raise ValueError(f"SandboxLimits.open_files must be at least 16 (the interpreter needs some), "
                             f"got {self.open_files}")


@dataclass
class ExecResult:
    """Outcome of one sandboxed run.

    ``status``: ``"passed"`` (every test passed), ``"failed"`` (the program ran, some test
    failed), ``"timeout"`` (wall or CPU limit), ``"error"`` (syntax error, exception in the
    program or setup, refused operation, output limit) or ``"crash"`` (the process died
    without reporting: a signal, ``os._exit``, a broken interpreter). ``passed``/``total``
    count tests; ``seconds`` is the wall time of the run; ``detail`` says why in one line.
    ``stdout``/``stderr`` are the (capped) captured streams; ``isolation`` lists the
    kernel-level layers that were in force (e.g.
    ``"netns,pidns,mntns,rofs,nocaps,nonewprivs,procfs"``).
    """

    status: str
    passed: int
    total: int
    seconds: float
    detail: str = ""
    stdout: str = ""
    stderr: str = ""
    isolation: str = ""

    def reward(self, partial_credit: bool = False) -> float:
        """1.0 when every test passed; with ``partial_credit`` a failed run earns
        ``passed / total``; 0.0 for timeouts, errors and crashes."""
        if self.status == "passed":
            return 1.0
        if partial_credit and self.status == "failed" and self.total > 0:
            return self.passed / self.total
        return 0.0


_uid_lock = threading.Lock()
_uid_cache: dict[str, tuple[int, int] | None] = {}


def _unprivileged_ids() -> tuple[int, int] | None:
    """(uid, gid) of ``nobody`` when we are root and the interpreter runs as that user."""
    if os.geteuid() != 0:
        return None
    with _uid_lock:
        if "ids" not in _uid_cache:
            try:
                entry = pwd.getpwnam("nobody")
                ids = (entry.pw_uid, entry.pw_gid)
            except KeyError:
                ids = (65534, 65534)
            try:
                probe = subprocess.run([sys.executable, "-I", "-B", "-c", "import json, ast, resource"],
                                       user=ids[0], group=ids[1], extra_groups=[], cwd="/", env=_base_env("/"),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
                _uid_cache["ids"] = ids if probe.returncode == 0 else None
            except (OSError, subprocess.SubprocessError):
                _uid_cache["ids"] = None
        return _uid_cache["ids"]


def _base_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}


class _Collector:
    """Drains a child's stdout, stderr and result pipes without blocking and without
    holding more than the caps, and feeds its stdin."""

    def __init__(self, proc: subprocess.Popen, result_fd: int, job: bytes, cap: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.cap = cap
        self.out = {"stdout": bytearray(), "stderr": bytearray(), "result": bytearray()}
        self.written = 0  # stdout + stderr bytes the child produced
        self.job, self.pos = memoryview(job), 0
        self.proc = proc
        for name, fd in (("stdout", proc.stdout.fileno()), ("stderr", proc.stderr.fileno()), ("result", result_fd)):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, name)
        stdin = proc.stdin.fileno()
        os.set_blocking(stdin, False)
        self.sel.register(stdin, selectors.EVENT_WRITE, "stdin")

    def _drop(self, fd: int) -> None:
        self.sel.unregister(fd)

    def pump(self, deadline: float) -> str:
        """Runs until every pipe is closed (``"done"``), the deadline (``"timeout"``) or
        too much output (``"overflow"``)."""
        while self.sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in self.sel.select(min(remaining, 1.0)):
                fd, name = key.fd, key.data
                if name == "stdin":
                    try:
                        self.pos += os.write(fd, self.job[self.pos:self.pos + (1 << 16)])
                    except BlockingIOError:
                        continue
                    except OSError:  # the child is gone or closed its stdin
                        self.pos = len(self.job)
                    if self.pos >= len(self.job):
                        self._drop(fd)
                        self._close_stdin()
                    continue
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(fd)
                    continue
                buf = self.out[name]
                if name == "result":  # keep the tail: the real line comes last
                    buf += data
                    del buf[:-_RESULT_CAP]
                    continue
                self.written += len(data)
                if len(buf) < self.cap:
                    buf += data[: self.cap - len(buf)]
                if self.written > self.cap:
                    return "overflow"
        return "done"

    def _close_stdin(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:  # a failed flush of nothing on a broken pipe
            pass

    def close(self) -> None:
        """Closes the selector and the child's pipes (not the result pipe)."""
        self.sel.close()
        self._close_stdin()
        self.proc.stdout.close()
        self.proc.stderr.close()


def _parse_result(data: bytes, nonce: bytes) -> tuple | None:
    marker = b"\n" + nonce + b" "
    at = data.rfind(marker)
    if at < 0:
        return None
    line = data[at + len(marker):].split(b"\n", 1)[0].decode("utf-8", "replace")
    try:
        head, detail = line.split("\t", 1)
        passed, total, phase, violations, isolation = head.split(" ")
        return int(passed), int(total), phase, int(violations), isolation, detail
    except ValueError:
        return None


class SandboxFolderError(ValueError):
    """The sandbox's temporary folder is out of reach of the user programs run as (:func:`check_tmp_root`)."""


def unreachable_step(path: str, uid: int, gid: int) -> str | None:
    """The first directory on the way to ``path`` (itself included) that user ``uid`` of group
    ``gid``, with no other groups, may not enter; None when every one may be."""
    here = "/"
    for part in [""] + [p for p in os.path.realpath(path).split("/") if p]:
        here = os.path.join(here, part)
        st = os.stat(here)
        bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
        if not st.st_mode & bit:
            return here
    return None


def check_tmp_root(limits: SandboxLimits) -> None:
    """Raise :class:`SandboxFolderError` when programs would run as ``nobody`` (the trainer is root) in a
    temporary folder that user cannot reach: every program would crash, and every reward be 0.

    A server or program makes its folders under ``limits.tmp_root`` (default: ``TMPDIR`` or
    /tmp) and uses them by absolute path, so each directory on the way must be searchable.
    """
    ids = _unprivileged_ids() if limits.drop_root else None
    if ids is None:
        return
    root = limits.tmp_root or tempfile.gettempdir()
    step = unreachable_step(root, *ids)
    if step is not None:
        mode = stat.S_IMODE(os.stat(step).st_mode)
        raise SandboxFolderError(
            f"sandboxed programs run as uid {ids[0]} (the trainer runs as root), and that user cannot enter "
            f"{step} (mode {mode:o}) on the way to the sandbox's temporary folder {root}: point TMPDIR (or "
            "SandboxLimits.tmp_root) at a folder every user can reach, such as /tmp")


def run_program(program: str, tests: Sequence[str], setup: str = "",
                limits: SandboxLimits | None = None, servers=None) -> ExecResult:
    """Runs ``program``, then ``setup``, then each test statement in a fresh sandboxed
    process and reports how many tests passed (see the module docstring).

    ``setup`` runs after the program and before the tests, in the same namespace (MBPP's
    ``test_setup_code`` builds objects from the program's classes). In fork-server mode
    ``servers`` (a :class:`~dstrain.rewards.forkserver.ServerSet`) supplies the server;
    by default a process-wide set shared by calls without a pool.
    """
    limits = limits or SandboxLimits()
    check_tmp_root(limits)
    tests = [str(t) for t in tests]
    if (limits.mode or default_mode()) == "fork_server":
        return _run_forked(str(program), tests, str(setup or ""), limits, servers)
    return _run_spawned(str(program), tests, str(setup or ""), limits)


def _run_forked(program: str, tests: list[str], setup: str, limits: SandboxLimits, servers) -> ExecResult:
    from dstrain.rewards.forkserver import ServerLost, shared_servers
    servers = servers or shared_servers(limits.namespaces, limits.drop_root, limits.tmp_root)
    start = time.monotonic()
    nonce = secrets.token_hex(16)
    job = {"nonce": nonce, "program": program, "setup": setup, "tests": tests, "wall": float(limits.wall_seconds),
           "cap": int(limits.output_bytes),
           "limits": {"cpu": int(limits.cpu_seconds), "mem": int(limits.memory_bytes),
                      "fsize": int(limits.file_size_bytes), "nofile": int(limits.open_files),
                      "nproc": int(limits.max_processes)}}
    for attempt in range(2):  # a server found dead before the program started is replaced, once
        server = servers.acquire()
        try:
            reply, out, err, res = server.run(job, limits.wall_seconds)
            break
        except ServerLost as lost:
            if lost.ran or attempt:
                return ExecResult("crash", 0, len(tests), time.monotonic() - start, f"sandbox server lost: {lost}")
        finally:
            servers.release(server)
    return _interpret(reply["ending"], int(reply["returncode"]), float(reply["cpu"]),
                      _parse_result(res, nonce.encode()), len(tests), time.monotonic() - start, limits,
                      out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _run_spawned(program: str, tests: list[str], setup: str, limits: SandboxLimits) -> ExecResult:
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="dstrain-sbx-", dir=limits.tmp_root)
    proc = collector = None
    read_fd = write_fd = -1
    try:
        ids = _unprivileged_ids() if limits.drop_root else None
        if ids is not None:
            os.chown(tmp, *ids)
        nonce = secrets.token_hex(16)
        job = json.dumps({"nonce": nonce, "program": str(program), "setup": str(setup or ""),
                          "tests": tests}).encode()
        read_fd, write_fd = os.pipe()
        cfg = {"cpu": int(limits.cpu_seconds), "mem": int(limits.memory_bytes), "fsize": int(limits.file_size_bytes),
               "nproc": int(limits.max_processes), "nofile": int(limits.open_files),
               "namespaces": bool(limits.namespaces), "uid": ids[0] if ids else None, "gid": ids[1] if ids else None}
        argv = [sys.executable, "-I", "-B", "-c", _child.STUB, _CHILD_SOURCE, "launch", json.dumps(cfg), str(write_fd)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=tmp, env=_base_env(tmp), pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        write_fd = -1
        collector = _Collector(proc, read_fd, job, limits.output_bytes)
        ending = collector.pump(start + limits.wall_seconds)
        try:  # kill the group before reaping, so that its id cannot have been reused
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - start
        out = collector.out
        return _interpret(ending, proc.returncode, usage.ru_utime + usage.ru_stime, _parse_result(
            bytes(out["result"]), nonce.encode()), len(tests), seconds, limits,
            bytes(out["stdout"]).decode("utf-8", "replace"), bytes(out["stderr"]).decode("utf-8", "replace"))
    finally:
        if collector is not None:
            collector.close()
        elif proc is not None:
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        if proc is not None and proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for fd in (read_fd, write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        _remove_tree(tmp)


def _interpret(ending: str, returncode: int, cpu: float, record: tuple | None, n_tests: int, seconds: float,
               limits: SandboxLimits, stdout: str, stderr: str) -> ExecResult:
    def result(status: str, detail: str, passed: int = 0, isolation: str = "") -> ExecResult:
        return ExecResult(status, passed, n_tests, seconds, detail, stdout, stderr, isolation)

    if ending == "overflow":
        return result("error", f"output limit exceeded (more than {limits.output_bytes} bytes)")
    if record is not None:
        passed, total, phase, violations, isolation, detail = record
        if violations:
            return result("error", f"sandbox violation: {detail}", isolation=isolation)
        if phase == "ok":
            status = "passed" if passed == total else "failed"
            return result(status, detail, passed, isolation)
        return result("error", f"{phase}: {detail}", isolation=isolation)
    if ending == "timeout":
        return result("timeout", f"wall-clock limit of {limits.wall_seconds:g} s")
    sig = -returncode if returncode < 0 else (returncode - 128 if returncode > 128 else 0)
    # SIGXCPU comes from RLIMIT_CPU (the kernel's CPU clock can run slightly ahead of rusage);
    # SIGKILL is the hard limit only when the CPU time says so (the wall-clock kill is "timeout" above).
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_seconds - 0.05):
        return result("timeout", f"CPU limit of {limits.cpu_seconds} s")
    tail = stderr.strip().splitlines()[-1:] or [""]
    how = f"killed by {signal.Signals(sig).name}" if sig in signal.valid_signals() else f"exit code {returncode}"
    return result("crash", f"{how} without a result; {tail[0][:200]}".rstrip("; "))


class SandboxPool:
    """Runs several sandboxed programs at once: ``workers`` threads, each managing one
    child process at a time (in fork-server mode, each through its own warm server,
    started on first use and stopped by :meth:`close`). Use as a context manager or
    call :meth:`close`. ``mode`` overrides ``limits.mode``.

    :meth:`run_many`'s batch has ``batch_seconds`` (default two wall limits) plus ``late_wall_seconds`` (default
    0.5 s with a fork server, 1.5 s spawning a process per program; never more than the wall limit) per ``workers``
    of its jobs: a job that starts with less than its wall limit left of that runs with what is left, at least
    ``late_wall_seconds``. Programs that sleep or loop until just under the limit no longer cost a batch a wall limit
    per ``workers`` of them (64 at 5 s on 2 workers: 157 s, now 39 s). Jobs so cut that ran out of time run again
    after the batch, each with the same share of half of ``batch_seconds`` when that is more than they had: an
    honest program behind such sleepers is not judged on what they left it.
    """

    def __init__(self, workers: int = 4, limits: SandboxLimits | None = None, mode: str | None = None,
                 batch_seconds: float | None = None, late_wall_seconds: float | None = None) -> None:
        if workers < 1:
            raise ValueError(f"SandboxPool needs at least one worker, got {workers}")
        self.workers = workers
        self.limits = limits or SandboxLimits()
        if mode is not None:
            self.limits = dataclasses.replace(self.limits, mode=mode)
        self.mode = self.limits.mode or default_mode()
        self.batch_seconds = 2 * self.limits.wall_seconds if batch_seconds is None else float(batch_seconds)
        late = (0.5 if self.mode == "fork_server" else 1.5) if late_wall_seconds is None else late_wall_seconds
        self.late_wall_seconds = min(float(late), self.limits.wall_seconds)
        if not self.batch_seconds > 0 or not self.late_wall_seconds > 0:
            raise ValueError(f"SandboxPool needs positive batch_seconds and late_wall_seconds, got "
                             f"{self.batch_seconds} and {late_wall_seconds}")
        check_tmp_root(self.limits)  # before any work: a bad folder would make every reward 0
        self.servers = None
        if self.mode == "fork_server":
            from dstrain.rewards.forkserver import ServerSet
            self.servers = ServerSet(self.limits.namespaces, self.limits.drop_root, self.limits.tmp_root)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dstrain-sandbox")

    def run(self, program: str, tests: Sequence[str], setup: str = "") -> ExecResult:
        return self._executor.submit(run_program, program, tests, setup, self.limits, self.servers).result()

    def run_many(self, jobs: Sequence[tuple[str, Sequence[str], str]]) -> list[ExecResult]:
        """Runs ``(program, tests, setup)`` jobs concurrently; results in job order (see the class for the limits;
        red-team round 30: a correct 0.8 s program behind 12 sleepers of a batch had 0.5 s, and scored 0)."""
        rounds = -(-len(jobs) // self.workers)
        deadline = time.monotonic() + self.batch_seconds + rounds * self.late_wall_seconds
        cut: dict[int, float] = {}

        def one(i, share=0.0):
            limits, left = self.limits, share or deadline - time.monotonic()
            if left < limits.wall_seconds:
                limits = dataclasses.replace(limits, wall_seconds=max(self.late_wall_seconds, left))
                cut[i] = cut.get(i, limits.wall_seconds)
            return run_program(*jobs[i], limits, self.servers)

        out = list(self._executor.map(one, range(len(jobs))))
        again = [i for i in cut if out[i].status == "timeout" and out[i].detail.startswith("wall")]
        share = self.batch_seconds / 2 / max(1, -(-len(again) // self.workers))
        again = [i for i in again if cut[i] < min(share, self.limits.wall_seconds)]
        for i, r in zip(again, self._executor.map(one, again, [share] * len(again))):
            out[i] = r
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self.servers is not None:
            self.servers.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
