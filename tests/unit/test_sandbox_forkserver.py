"""The sandbox fork server: a program cannot poison the next one run by the same warm
server, and a server that dies or gets stuck is replaced without losing later jobs."""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from dstrain.rewards.sandbox import SandboxLimits, SandboxPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux-only")

LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=2.0, memory_bytes=512 << 20, mode="fork_server")


@pytest.fixture()
def pool():
    with SandboxPool(workers=1, limits=LIMITS) as p:
        yield p


def one_server(pool) -> int:
    servers = pool.servers.servers
    assert len(servers) == 1 and servers[0].alive
    return servers[0].pid


# Each case: a program that tries to leave something behind (its run's status does not
# matter), then a program whose tests pass only if nothing was left.
POISON = {
    "globals of a module": ("import math, json\nmath.pi = 3\njson.dumps = lambda *a, **k: 'owned'\n",
                            "import math, json\n",
                            ["assert math.pi > 3.14", "assert json.dumps([1]) == '[1]'"]),
    "sys.modules": ("import sys, types\nfake = types.ModuleType('re')\nfake.compile = lambda *a: None\n"
                    "sys.modules['re'] = fake\nsys.modules['poison'] = fake\n",
                    "import re, sys\n",
                    ["assert re.compile('a+').match('aa') is not None", "assert 'poison' not in sys.modules"]),
    "builtins": ("import builtins\nbuiltins.len = lambda x: 42\nbuiltins.sorted = lambda x: [0]\n"
                 "builtins.POISON = 1\n",
                 "import builtins\n",
                 ["assert len([1]) == 1", "assert sorted([2, 1]) == [1, 2]", "assert not hasattr(builtins, 'POISON')"]),
    "working directory": ("import os\nos.mkdir('deeper')\nos.chdir('deeper')\n",
                          "import os\nhere = os.getcwd()\n",
                          ["assert os.path.basename(here).startswith('job')", "assert os.listdir(here) == []",
                           "assert os.environ['HOME'] == here and os.environ['TMPDIR'] == here"]),
    "environment": ("import os\nos.environ['POISON'] = '1'\nos.putenv('LD_PRELOAD', '/tmp/evil.so')\n"
                    "os.environ['PATH'] = '/nowhere'\n",
                    "import os\n",
                    ["assert 'POISON' not in os.environ and 'LD_PRELOAD' not in os.environ",
                     "assert os.environ['PATH'].startswith('/usr/local/bin')"]),
    "files left behind": ("import os, tempfile\nopen('left.txt', 'w').write('x')\n"
                          "open(os.path.join(tempfile.gettempdir(), 'left2.txt'), 'w').write('x')\n"
                          "try:\n    open('../left3.txt', 'w').write('x')\nexcept PermissionError:\n    pass\n",
                          "import os, tempfile\n",
                          ["assert os.listdir('.') == []", "assert os.listdir(tempfile.gettempdir()) == []",
                           "assert not os.path.exists('../left3.txt')"]),
    "signal handlers": ("import signal\nfor how in (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN),\n"
                        "            lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM}),\n"
                        "            lambda: signal.setitimer(signal.ITIMER_REAL, 0.05)):\n"
                        "    try:\n        how()\n    except Exception:\n        pass\n",
                        "import signal, time\ntime.sleep(0.2)\n",
                        ["assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL",
                         "assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)"]),
    "threads left running": ("import threading, time\n"
                             "def later():\n    time.sleep(0.3)\n    open('from_thread.txt', 'w').write('x')\n"
                             "threading.Thread(target=later).start()\n",
                             "import threading, time, os\ntime.sleep(0.5)\n",
                             ["assert threading.active_count() == 1", "assert os.listdir('.') == []"]),
    "random state": ("import random\nrandom.seed(0)\nfirst = random.random()\n",
                     "import random\nsecond = random.random()\n",
                     ["assert second != __import__('random').Random(0).random()"]),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_a_program_cannot_poison_the_next_one(pool, name):
    poison, program, tests = POISON[name]
    pool.run(textwrap.dedent(poison), ["assert True"])
    server = one_server(pool)
    r = pool.run(textwrap.dedent(program), tests)
    assert r.status == "passed", (name, r.detail, r.stderr[-300:])
    assert one_server(pool) == server  # the same warm server ran both


def test_poisoning_cannot_change_how_results_are_judged(pool):
    pool.run("import builtins\nbuiltins.bool = lambda *a: True\nbuiltins.int = str\n", ["assert True"])
    r = pool.run("def f(x):\n    return 2\n", ["assert f(1) == 3", "assert f(1) == 2"])
    assert (r.status, r.passed, r.total) == ("failed", 1, 2)


def test_a_dead_server_is_replaced_before_the_next_job(pool):
    assert pool.run("x = 1\n", ["assert x == 1"]).status == "passed"
    server = pool.servers.servers[0]
    os.killpg(server.pid, signal.SIGKILL)
    time.sleep(0.1)
    r = pool.run("x = 2\n", ["assert x == 2"])
    assert r.status == "passed", r.detail
    assert server.starts == 2 and server.alive


def after_start(monkeypatch, action):
    """Run ``action(server)`` once, 0.2 s after a server has reported that the program started."""
    import threading
    from dstrain.rewards import forkserver
    original, fired = forkserver.ForkServer._read_frame, []

    def read_frame(self, deadline):
        header, blobs = original(self, deadline)
        if header is not None and "started" in header and not fired:
            fired.append(threading.Timer(0.2, action, (self,)))
            fired[0].start()
        return header, blobs

    monkeypatch.setattr(forkserver.ForkServer, "_read_frame", read_frame)
    return fired


def test_a_server_killed_during_a_job_costs_that_job_only(monkeypatch, pool):
    pool.run("x = 1\n", ["assert True"])
    server = pool.servers.servers[0]
    fired = after_start(monkeypatch, lambda s: os.killpg(s.pid, signal.SIGKILL))
    r = pool.run("import time\ntime.sleep(1.5)\n", ["assert True"])
    fired[0].join()
    assert r.status == "crash" and r.reward() == 0.0 and "server" in r.detail
    assert pool.run("y = 3\n", ["assert y == 3"]).status == "passed"
    assert server.starts == 2


def test_a_server_stuck_during_a_job_is_replaced(monkeypatch):
    from dstrain.rewards import forkserver
    monkeypatch.setattr(forkserver, "GRACE_S", 0.5)
    short = SandboxLimits(cpu_seconds=5, wall_seconds=1.0, memory_bytes=512 << 20, mode="fork_server")
    with SandboxPool(workers=1, limits=short) as p:
        p.run("x = 1\n", ["assert True"])
        server = p.servers.servers[0]
        fired = after_start(monkeypatch, lambda s: os.killpg(s.pid, signal.SIGSTOP))
        start = time.monotonic()
        r = p.run("import time\ntime.sleep(0.6)\n", ["assert True"])
        fired[0].join()
        assert r.status == "crash" and "stopped answering" in r.detail
        assert time.monotonic() - start < 1.0 + 0.5 + 3.0
        assert p.run("y = 3\n", ["assert y == 3"]).status == "passed"
        assert server.starts == 2


def test_a_server_stuck_before_a_job_is_replaced_and_the_job_runs(monkeypatch):
    from dstrain.rewards import forkserver
    monkeypatch.setattr(forkserver, "GRACE_S", 0.5)
    short = SandboxLimits(cpu_seconds=5, wall_seconds=1.0, memory_bytes=512 << 20, mode="fork_server")
    with SandboxPool(workers=1, limits=short) as p:
        p.run("x = 1\n", ["assert True"])
        server = p.servers.servers[0]
        os.killpg(server.pid, signal.SIGSTOP)
        r = p.run("y = 3\n", ["assert y == 3"])
        assert r.status == "passed", r.detail
        assert server.starts == 2 and server.alive


def test_pool_close_stops_servers_and_removes_their_folders(sandbox_tmp):
    tmp_path = sandbox_tmp
    limits = SandboxLimits(wall_seconds=2.0, memory_bytes=512 << 20, tmp_root=str(tmp_path), mode="fork_server")
    with SandboxPool(workers=2, limits=limits) as p:
        p.run_many([("x = 1\n", ["assert x == 1"], "")] * 4)
        servers = p.servers.servers
        state = [(s.starts, s.isolation, s.proc and s.proc.returncode) for s in servers]
        assert 1 <= len(servers) <= 2 and all(s.alive for s in servers), state  # (starts, isolation, exit)
        pids = [s.pid for s in servers]
    assert list(tmp_path.iterdir()) == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_mode_is_validated():
    with pytest.raises(ValueError, match="mode"):
        SandboxLimits(mode="vm")
    with SandboxPool(workers=1, mode="spawn") as p:
        assert p.servers is None and p.mode == "spawn"
