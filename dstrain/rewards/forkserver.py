"""The trainer's side of the sandbox fork server: start, talk to, replace and stop servers.

A :class:`ForkServer` is one long-lived, already-isolated interpreter (see ``_server.py``
for what runs inside) that forks a fresh, limited child for every program, so a program
costs a ``fork`` instead of two interpreter start-ups. It is started like a spawned
sandbox run (``_child.py``'s ``launch`` stage, clean environment, its own temporary
directory as working directory, new session, no inherited descriptors but its
stdin/stdout control pipes) and then waits for jobs.

A server that has died is replaced transparently before the next job (a job whose
write fails is retried once on a fresh server); one that does not answer within the
job's wall-clock limit plus :data:`GRACE_S` is killed, its program's process group too,
and that job is reported as a crash. :class:`ServerSet` hands idle servers to threads
(one job per server at a time) and starts more on demand.
"""
from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dstrain.rewards import _child
from dstrain.rewards.sandbox import _CHILD_SOURCE, compact_source

GRACE_S = 5.0
"""How long past a job's wall-clock limit a server may take to reply before it is replaced."""
START_TIMEOUT_S = 60.0
_SERVER_SOURCE = compact_source((Path(_child.__file__).parent / "_server.py").read_text())


class ServerLost(RuntimeError):
    """The server died or stopped answering; ``ran`` says whether the job had started."""

    def __init__(self, msg: str, ran: bool) -> None:
        super().__init__(msg)
        self.ran = ran


class ForkServer:
    """One sandbox server process. Not thread-safe: one job at a time (see :class:`ServerSet`)."""

    def __init__(self, namespaces: bool = True, drop_root: bool = True, tmp_root: str | None = None) -> None:
        self.namespaces, self.drop_root, self.tmp_root = namespaces, drop_root, tmp_root
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None
        self.isolation = ""
        self.pidns = False
        self.starts = 0

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        from dstrain.rewards.sandbox import _base_env, _unprivileged_ids
        self.stop()
        self.dir = tempfile.mkdtemp(prefix="dstrain-fsrv-", dir=self.tmp_root)
        ids = _unprivileged_ids() if self.drop_root else None
        if ids is not None:
            os.chown(self.dir, *ids)
        cfg = {"stage": "serve", "nofile": 1024, "namespaces": bool(self.namespaces),
               "uid": ids[0] if ids else None, "gid": ids[1] if ids else None}
        argv = [sys.executable, "-I", "-B", "-c", _child.STUB, _CHILD_SOURCE, "launch", json.dumps(cfg), "-1",
                _SERVER_SOURCE]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     cwd=self.dir, env=_base_env(self.dir), start_new_session=True, close_fds=True)
        self.starts += 1
        header, _ = self._read_frame(time.monotonic() + START_TIMEOUT_S)
        if header is None or not header.get("ready"):
            self.stop()
            raise RuntimeError("the sandbox fork server did not start")
        self.isolation, self.pidns = header["isolation"], bool(header["pidns"])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Pid of the server's launcher process (the server itself, or its parent in a PID namespace)."""
        return self.proc.pid if self.proc is not None else None

    def stop(self, child: int | None = None) -> None:
        """Kill the server (and, outside a PID namespace, the program child ``child``); remove its folder."""
        if self.proc is not None:
            for stream in (self.proc.stdin, self.proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            if child is not None and not self.pidns:  # a pid inside a namespace means nothing out here
                try:
                    os.killpg(child, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self.proc.wait()
            self.proc = None
        if self.dir is not None:
            from dstrain.rewards.sandbox import _remove_tree
            _remove_tree(self.dir)
            self.dir = None

    # ---------------------------------------------------------------- one job
    def run(self, job: dict, wall: float) -> tuple[dict, bytes, bytes, bytes]:
        """(reply header, stdout, stderr, result bytes) of one job; :class:`ServerLost` when the server fails."""
        if not self.alive:
            self.start()
        head = json.dumps(job).encode()
        deadline = time.monotonic() + wall + GRACE_S
        if not _write_all(self.proc.stdin.fileno(), len(head).to_bytes(4, "big") + head, deadline):
            self.stop()
            raise ServerLost("the sandbox server was gone before the job", ran=False)
        started, _ = self._read_frame(deadline)
        if started is None or "started" not in started:
            self.stop()
            raise ServerLost("the sandbox server did not start the program", ran=False)
        reply, blobs = self._read_frame(deadline)
        if reply is None or "ending" not in reply:
            self.stop(child=int(started["started"]))
            raise ServerLost("the sandbox server stopped answering", ran=True)
        return reply, *blobs

    def _read_frame(self, deadline: float) -> tuple[dict | None, list[bytes]]:
        fd = self.proc.stdout.fileno()
        size = _read_exact(fd, 4, deadline)
        if size is None:
            return None, []
        head = _read_exact(fd, int.from_bytes(size, "big"), deadline)
        if head is None:
            return None, []
        header = json.loads(head)
        blobs = []
        for n in header.get("blobs", []):
            blob = _read_exact(fd, n, deadline)
            if blob is None:
                return None, []
            blobs.append(blob)
        return header, blobs


def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write ``data`` to the pipe ``fd`` before ``deadline``; False when the reader is gone or stuck."""
    view = memoryview(data)
    os.set_blocking(fd, False)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_WRITE)
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sel.select(remaining):
                    return False
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    continue
                except OSError:
                    return False
    finally:
        try:
            os.set_blocking(fd, True)
        except OSError:
            pass
    return True


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from the blocking pipe ``fd`` before ``deadline``; None on EOF or timeout."""
    parts, got = [], 0
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(remaining):
                return None
            chunk = os.read(fd, n - got)
            if not chunk:
                return None
            parts.append(chunk)
            got += len(chunk)
    return b"".join(parts)


class ServerSet:
    """Idle fork servers of one configuration; :meth:`acquire` hands one out (starting a new
    one when none is idle), :meth:`release` takes it back."""

    def __init__(self, namespaces: bool = True, drop_root: bool = True, tmp_root: str | None = None) -> None:
        self.key = (namespaces, drop_root, tmp_root)
        self._idle: list[ForkServer] = []
        self._all: list[ForkServer] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self) -> ForkServer:
        with self._lock:
            if self._closed:
                raise RuntimeError("this sandbox pool is closed")
            if self._idle:
                return self._idle.pop()
            server = ForkServer(*self.key)
            self._all.append(server)
        return server

    def release(self, server: ForkServer) -> None:
        with self._lock:
            if self._closed:
                server.stop()
            else:
                self._idle.append(server)

    @property
    def servers(self) -> list[ForkServer]:
        with self._lock:
            return list(self._all)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            servers, self._all, self._idle = self._all, [], []
        for server in servers:
            server.stop()


_shared: dict[tuple, ServerSet] = {}
_shared_lock = threading.Lock()


def shared_servers(namespaces: bool, drop_root: bool, tmp_root: str | None) -> ServerSet:
    """The process-wide server set of a configuration (used by ``run_program`` without a pool)."""
    key = (namespaces, drop_root, tmp_root)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = ServerSet(*key)
        return _shared[key]


def close_shared_servers() -> None:
    """Stop the servers :func:`shared_servers` started (also done at exit)."""
    with _shared_lock:
        sets = list(_shared.values())
        _shared.clear()
    for s in sets:
        s.close()


atexit.register(close_shared_servers)
