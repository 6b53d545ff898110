"""Start the subprocess runs of a module's tests ahead of the tests, two at a time (a module fixture's work).

On a 2-core machine most of a short run's time is single-threaded start-up (imports, planning): with two runs
going, one's start-up overlaps the other's steps. Each test still reads and judges its own run only.
"""
from __future__ import annotations

import contextlib
import subprocess
from concurrent.futures import ThreadPoolExecutor

_POPEN = subprocess.Popen  # (taken at import: a test that replaces subprocess.Popen does not reach these runs)


def _run(cmd: list[str], timeout: float | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``, through ``_POPEN``."""
    with _POPEN(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def runs_ahead(request, plan, workers: int = 2):
    """``nodeid -> (future of the completed process, payload)`` for the tests of ``request.module`` that run in
    this session (not deselected, not skipped by a marker), in their order. ``plan(item)`` gives ``(command,
    subprocess.run keyword arguments, payload)``, or None (or raises) for a test that starts no run ahead: that
    test runs its own, or fails on its own."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ahead")
    runs = {}
    try:
        for item in request.session.items:
            if item.module is not request.module or item.get_closest_marker("skip"):
                continue
            try:
                planned = plan(item)
            except Exception:
                planned = None
            if planned is not None:
                cmd, kwargs, payload = planned
                runs[item.nodeid] = pool.submit(_run, cmd, **kwargs), payload
        yield runs
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
