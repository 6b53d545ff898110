"""The code-execution sandbox: results of ordinary programs, and adversarial programs
that must be contained (reward 0, the parent process and its files untouched).

Every test runs in both modes: through a warm fork server and with a spawned
interpreter per program."""
from __future__ import annotations

import dataclasses
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from dstrain.rewards.sandbox import MODES, ExecResult, SandboxLimits, SandboxPool, run_program

WALL = 2.0
LIMITS = SandboxLimits(cpu_seconds=5, wall_seconds=WALL, memory_bytes=512 << 20, output_bytes=1 << 16)
SLACK = 1.5
MODE = {"now": MODES[0]}


@pytest.fixture(autouse=True, params=MODES)
def mode(request):
    MODE["now"] = request.param
    yield request.param


def in_mode(limits: SandboxLimits) -> SandboxLimits:
    return dataclasses.replace(limits, mode=MODE["now"])


def run(program: str, tests=("assert True",), setup: str = "", limits: SandboxLimits = LIMITS) -> ExecResult:
    return run_program(textwrap.dedent(program), list(tests), setup, in_mode(limits))


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


# ---------------------------------------------------------------- ordinary programs

def test_passing_program_gets_reward_one():
    r = run("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"])
    assert (r.status, r.passed, r.total) == ("passed", 2, 2)
    assert r.reward() == 1.0 and r.reward(partial_credit=True) == 1.0


def test_failing_assert_gets_zero_and_partial_credit():
    r = run("def add(a, b):\n    return a + b + (a == 5)\n",
            ["assert add(1, 2) == 3", "assert add(5, 0) == 5", "assert add(0, 0) == 0", "assert add(5, 5) == 10"])
    assert (r.status, r.passed, r.total) == ("failed", 2, 4)
    assert "test 2" in r.detail
    assert r.reward() == 0.0
    assert r.reward(partial_credit=True) == pytest.approx(0.5)


def test_syntax_error_and_exceptions_score_zero():
    r = run("def f(x) return x\n", ["assert f(1) == 1"])
    assert r.status == "error" and "SyntaxError" in r.detail and r.reward(True) == 0.0
    r = run("raise RuntimeError('boom')\n", ["assert True"])
    assert r.status == "error" and "boom" in r.detail and r.reward(True) == 0.0
    r = run("def f(x):\n    return 1 / x\n", ["assert f(0) == 1", "assert f(1) == 1"])
    assert (r.status, r.passed) == ("failed", 1) and "ZeroDivisionError" in r.detail


def test_setup_runs_after_program_before_tests():
    r = run("class Box:\n    def __init__(self, v):\n        self.v = v\ndef get(b):\n    return b.v\n",
            ["assert get(box) == 7"], setup="box = Box(7)")
    assert r.status == "passed", r.detail


def test_files_inside_the_temporary_directory_are_allowed():
    program = """
        import os, tempfile
        with open("notes.txt", "w") as f:
            f.write("hello")
        os.mkdir("sub")
        os.rename("notes.txt", "sub/notes.txt")
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "x"), "w").close()
        def read():
            return open("sub/notes.txt").read()
    """
    r = run(program, ["assert read() == 'hello'"])
    assert r.status == "passed", r.detail


def test_standard_library_that_probes_frames_still_works():
    program = """
        from collections import namedtuple, Counter
        import enum, re, heapq, math
        P = namedtuple("P", "x y")
        Colour = enum.Enum("Colour", "RED GREEN")
        def f():
            return P(1, 2), Counter("aab"), Colour.RED.value
    """
    r = run(program, ["assert f()[0] == (1, 2)", "assert f()[1] == {'a': 2, 'b': 1}", "assert f()[2] == 1"])
    assert r.status == "passed", r.detail


# ---------------------------------------------------------------- limits

def test_infinite_loop_is_bounded_by_the_wall_clock():
    start = time.monotonic()
    r = run("while True:\n    pass\n")
    elapsed = time.monotonic() - start
    assert r.status == "timeout" and r.reward(True) == 0.0
    assert elapsed <= WALL + SLACK


def test_cpu_limit_applies_before_the_wall_clock():
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=30.0, memory_bytes=512 << 20)
    start = time.monotonic()
    r = run("while True:\n    pass\n", limits=limits)
    assert r.status == "timeout" and "CPU" in r.detail
    assert time.monotonic() - start < 10


def test_memory_bomb_is_contained():
    r = run("blob = bytearray(4 << 30)\n")
    assert r.status == "error" and "MemoryError" in r.detail and r.reward() == 0.0
    r = run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n")
    assert r.status == "error" and "MemoryError" in r.detail


def test_huge_output_is_capped_and_kills_the_run():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 100000)\n    sys.stderr.write('y' * 100000)\n")
    assert r.status == "error" and "output limit" in r.detail and r.reward() == 0.0
    assert len(r.stdout) <= LIMITS.output_bytes and len(r.stderr) <= LIMITS.output_bytes
    assert time.monotonic() - start < WALL  # killed at the cap, not at the deadline
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB


def test_big_file_is_limited():
    r = run("with open('big', 'wb') as f:\n    f.write(b'x' * (8 << 20))\n")
    assert r.reward() == 0.0 and r.status in ("error", "crash")


# ---------------------------------------------------------------- processes and signals

def test_fork_bomb_with_os_fork_is_refused():
    marker = f"{uuid.uuid4().int % 10**6}.5"
    program = f"""
        import os
        for _ in range(5):
            try:
                if os.fork() == 0:
                    os.execv("/bin/sleep", ["sleep", "{marker}"])
            except PermissionError:
                pass
    """
    r = run(program)
    assert r.status == "error" and "os.fork" in r.detail and r.reward() == 0.0
    assert processes_with(marker) == []


def test_fork_bomb_with_subprocess_is_refused():
    marker = f"{uuid.uuid4().int % 10**6}.25"
    program = f"""
        import os, subprocess
        for _ in range(20):
            for spawn in (lambda: subprocess.Popen(["sleep", "{marker}"]),
                          lambda: os.system("sleep {marker} &"),
                          lambda: os.posix_spawn("/bin/sleep", ["sleep", "{marker}"], {{}})):
                try:
                    spawn()
                except Exception:
                    pass
    """
    r = run(program)
    assert r.status == "error" and r.reward() == 0.0
    assert processes_with(marker) == []


@pytest.fixture()
def victim():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("attack", ["os.kill({pid}, 9)", "os.killpg(os.getpgid({pid}), 9)",
                                    "os.kill(os.getppid(), 9)", "os.killpg(os.getpgid(os.getppid()), 9)"])
def test_killing_other_processes_is_refused(victim, attack):
    r = run(f"import os\n{attack.format(pid=victim.pid)}\n")
    assert r.status == "error" and r.reward() == 0.0
    assert victim.poll() is None
    assert os.getpid() > 0  # and we are still here


# ---------------------------------------------------------------- files, network, environment

@pytest.mark.parametrize("attack", [
    "open({path!r}, 'w').write('owned')",
    "os.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
    "open('x', 'w').close(); os.rename('x', {path!r})",
    "fd = os.open(os.path.dirname({path!r}), os.O_RDONLY); os.open(os.path.basename({path!r}), "
    "os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
    "os.symlink({path!r}, 'link'); open('link', 'w').write('owned')",
    "import pathlib; pathlib.Path({path!r}).write_text('owned')",
    "import shutil; open('x', 'w').close(); shutil.copy('x', {path!r})",
])
def test_writing_outside_the_temporary_directory_is_refused(tmp_path, attack):
    sentinel = tmp_path / "sentinel.txt"
    r = run(f"import os\n{attack.format(path=str(sentinel))}\n")
    assert r.status == "error" and r.reward() == 0.0, r.detail
    assert not sentinel.exists()


def test_network_is_refused():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = f"""
        import socket
        s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
        s.sendall(b"leak")
    """
    try:
        r = run(program)
        assert r.status == "error" and "socket" in r.detail and r.reward() == 0.0
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def test_environment_is_not_inherited(monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("DSTRAIN_TEST_SECRET", secret)
    r = run("import os\nprint(dict(os.environ))\nkeys = set(os.environ)\n",
            ["assert keys <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE'}"])
    assert r.status == "passed", r.detail
    assert "TMPDIR" in r.stdout and secret not in r.stdout


@pytest.mark.parametrize("whose", ["{pid}", "os.getppid()", "'self/../{pid}'"])
def test_reading_the_trainers_environment_is_refused(monkeypatch, whose):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("DSTRAIN_TEST_SECRET", secret)
    target = whose.format(pid=os.getpid())
    r = run(f"import os\nprint(open(f'/proc/{{{target}}}/environ', 'rb').read())\n")
    assert r.status == "error" and r.reward() == 0.0
    assert secret not in r.stdout + r.stderr + r.detail


def test_reading_private_files_outside_the_interpreter_is_refused(tmp_path):
    secret_file = tmp_path / "token"
    secret_file.write_text("hf_secret_token")
    r = run(f"print(open({str(secret_file)!r}).read())\n")
    assert r.status == "error" and "hf_secret_token" not in r.stdout


# ---------------------------------------------------------------- reward hacking

HACKS = {
    "always-equal class": ("class A:\n    def __eq__(self, other):\n        return True\n"
                           "def f(x):\n    return A()\n", "assert f(1) == 3"),
    "type() with a borrowed __ne__": ("A = type('A', (int,), {'__eq__': int.__ne__})\n"
                                      "def f(x):\n    return A(5)\n", "assert f(1) == 3"),
    "always-equal inside a list": ("class L(list):\n    def __eq__(self, other):\n        return True\n"
                                   "def f(x):\n    return [L()]\n", "assert f(1) == [3]"),
    "truthy object": ("class T:\n    def __bool__(self):\n        return True\n"
                      "def f(x):\n    return T()\n", "assert f(1)"),
    "builtins patched at import": ("import builtins\nbuiltins.bool = lambda *a: True\n"
                                   "def f(x):\n    return 2\n", "assert f(1) == 3"),
    "builtins patched while tested": ("def f(x):\n    import builtins\n    builtins.bool = lambda *a: True\n"
                                      "    builtins.isinstance = lambda *a: True\n    return 2\n",
                                      "assert f(1) == 3"),
    "forged result lines": ("import os\nfor fd in range(3, 40):\n    try:\n"
                            "        os.write(fd, b'\\nfeedface 1 1 ok 0 none\\tforged\\n')\n"
                            "    except OSError:\n        pass\nos._exit(0)\n", "assert f(1) == 3"),
    "sys.exit before the tests": ("import sys\nsys.exit(0)\n", "assert f(1) == 3"),
    "gc walk": ("import gc\nobjs = gc.get_objects()\ndef f(x):\n    return 3\n", "assert f(1) == 3"),
    "thread left running": ("import threading, time\n"
                            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
                            "def f(x):\n    return 3\n", "assert f(1) == 3"),
}


@pytest.mark.parametrize("name", sorted(HACKS))
def test_reward_hacks_score_zero(name):
    program, test = HACKS[name]
    r = run(program, [test])
    assert r.reward(partial_credit=True) == 0.0, (r.status, r.detail)


def test_frame_access_is_refused_but_not_fatal():
    program = "import sys\ntry:\n    sys._getframe()\n    seen = True\nexcept ValueError:\n    seen = False\n"
    r = run(program, ["assert seen is False"])
    assert r.status == "passed", r.detail


# ---------------------------------------------------------------- the pool

def test_pool_runs_a_batch_of_infinite_loops_concurrently():
    start = time.monotonic()
    with SandboxPool(workers=4, limits=in_mode(LIMITS)) as pool:
        results = pool.run_many([("while True:\n    pass\n", ["assert True"], "")] * 8)
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["timeout"] * 8
    assert elapsed <= 2 * WALL + 3.0


def test_pool_preserves_order():
    jobs = [(f"def f():\n    return {i}\n", [f"assert f() == {i if i % 3 else -1}"], "") for i in range(7)]
    with SandboxPool(workers=3, limits=in_mode(LIMITS)) as pool:
        results = pool.run_many(jobs)
    assert [r.status for r in results] == ["failed" if i % 3 == 0 else "passed" for i in range(7)]


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="at least one worker"):
        SandboxPool(workers=0)


def test_no_processes_or_directories_are_left_behind(sandbox_tmp):
    tmp_path = sandbox_tmp
    limits = in_mode(SandboxLimits(wall_seconds=WALL, memory_bytes=512 << 20, tmp_root=str(tmp_path)))
    with SandboxPool(workers=2, limits=limits) as pool:
        pool.run("while True:\n    pass\n", ["assert True"])
        pool.run("def f():\n    return 1\n", ["assert f() == 1"])
        for server_dir in tmp_path.iterdir():  # a warm server keeps its own (empty) folder while it lives
            assert server_dir.name.startswith("dstrain-fsrv-") and list(server_dir.iterdir()) == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="capabilities are only dropped when the trainer is root")
def test_root_child_has_no_capabilities():
    program = "import os\nopen('f', 'w').close()\nos.chown('f', 1, 1)\n"  # giving a file away needs CAP_CHOWN
    r = run(program)
    if "nocaps" not in r.isolation and "uid=" not in r.isolation:
        pytest.skip(f"this machine does not let the sandbox drop capabilities ({r.isolation})")
    assert r.status == "error" and "PermissionError" in r.detail, r.detail


def test_a_temporary_folder_nobody_can_reach_is_refused_before_any_program_runs(sandbox_tmp, monkeypatch):
    """As root, programs run as nobody in folders under tmp_root, entered by absolute path: behind a
    folder only its owner may enter, every program crashed ("sandbox server lost") and every reward was 0."""
    from dstrain.rewards import sandbox
    private = sandbox_tmp / "private"
    private.mkdir(mode=0o700)
    (private / "inner").mkdir()
    os.chmod(private, 0o700)
    nobody = (65534, 65534) if os.geteuid() != 65534 else (65533, 65533)
    assert sandbox.unreachable_step(str(private / "inner"), *nobody) == str(private.resolve())
    assert sandbox.unreachable_step("/", *nobody) is None
    monkeypatch.setattr(sandbox, "_unprivileged_ids", lambda: nobody)
    with pytest.raises(ValueError, match=r"cannot enter .*private \(mode 700\).*TMPDIR"):
        SandboxPool(workers=1, limits=in_mode(SandboxLimits(tmp_root=str(private / "inner"))))
    with pytest.raises(ValueError, match="cannot enter"):
        run_program("x = 1\n", ["assert x == 1"], limits=in_mode(SandboxLimits(tmp_root=str(private / "inner"))))
    import tempfile
    import types

    from dstrain.config import ConfigError
    from dstrain.trainers.rl_loop import sandbox_pool
    monkeypatch.setattr(tempfile, "tempdir", str(private / "inner"))  # as TMPDIR pointing there
    task = types.SimpleNamespace(sandbox_workers=1, sandbox_cpu_s=5, sandbox_wall_s=5.0, sandbox_memory_mb=512)
    with pytest.raises(ConfigError, match="TMPDIR"):  # the RL trainers: one line, before the first step
        sandbox_pool(task)
    os.chmod(private, 0o711)
    sandbox.check_tmp_root(SandboxLimits(tmp_root=str(private / "inner")))  # reachable now: no error
    sandbox.check_tmp_root(SandboxLimits(tmp_root=str(private / "inner"), drop_root=False))


def test_folder_removal_needs_no_recursion_and_ends_on_what_it_cannot_delete(tmp_path, monkeypatch):
    """The sandbox's folders are removed however deep a program nested them (beyond Python's recursion
    limit and PATH_MAX), and an entry that cannot be deleted ends the removal instead of looping."""
    import os

    from dstrain.rewards._server import _remove
    top = tmp_path / "job"
    top.mkdir()
    monkeypatch.chdir(top)
    for i in range(1500):
        os.mkdir(f"a{i}")
    for i in range(1499, 0, -1):
        os.rename(f"a{i}", f"a{i - 1}/a{i}")
    os.mkdir("locked")
    (top / "locked" / "f").write_text("x")
    os.chmod("locked", 0o500)
    monkeypatch.chdir(tmp_path)
    _remove(str(top))
    assert not top.exists()
    stuck = tmp_path / "stuck"
    stuck.mkdir()
    (stuck / "f").write_text("x")
    real_unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda *a, **k: (_ for _ in ()).throw(PermissionError("no")))
    _remove(str(stuck))  # returns: nothing it can do
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert (stuck / "f").exists()
