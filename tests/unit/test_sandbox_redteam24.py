"""Red team, round 24: the reward's input (the completion text), what the trainer gets back, the pool's next job, the
time a program takes from the batch, and whether the same program is judged alike twice.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1, in time. The hole this round closed was
in determinism: the interpreter that judges a program started with a random string hash (``python -I`` ignores
``PYTHONHASHSEED``), so a program whose answer hung on a set's order or on ``hash(str)`` passed or failed by the luck
of the run (``return 3 if hash('abc') % 2 == 0 else 0``: in spawn mode reward 1 in some runs of eight, 0.5 in the
others; in the fork server by the luck of each server's start). The judging interpreter now starts with
``PYTHONHASHSEED=0`` (``-s -P`` instead of ``-I``, with an environment of our own; the program still sees the four
variables), in both modes, on Python 3.11 and later.

What did not get past the sandbox, pinned here: a completion that redefines the setup's names or functions the
asserts use (the setup runs after the program), runs the asserts itself under ``if __name__ == '__main__':``,
prints ``passed`` or a verdict line, or hides a fence in a string; a program's NUL bytes, lone surrogates, invalid
UTF-8, terminal escapes and a 10 MB exception text (the detail stays one printable-as-UTF-8 line of at most 1000
characters, the streams are capped and decoded with replacement, and the trainer logs only rewards and statuses);
``os.setsid``/``os.setpgrp``, lowered or raised rlimits, a 400 MB anonymous mapping, files in the temporary folder,
``SIGTERM`` ignored (``signal.signal`` is removed) and ``chdir`` (refused) before the next job; threads that spin on
past the program (the run ends at the wall limit and the next job is on time). There are no format rewards in
dstrain (MBPP shaping moves the ``def`` line into the prompt; DAPO's overlong shaping counts tokens only), and
``evaluate_tasks`` judges identical programs of one call once. Not closed: a program that sleeps just under the
wall limit costs its worker that long (no per-batch budget: denial of service within the limits); ``id()`` and the
clock still differ between runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dstrain.data.tasks import Task
from dstrain.rewards.code import evaluate_tasks, summarize
from tests.unit.test_sandbox_redteam import GOOD, TESTS, still_works  # noqa: F401
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

WRONG = "def f(x):\n    return 0\n"


TASK = Task(task_id="t", prompt="Write f.", kind="code", tests=("assert f(1) == expected", "assert check(f(2))"),
            setup="expected = 3\ndef check(v):\n    return v == 5\n")
COMPLETIONS = {  # the completion text, as the trainer hands it to the reward: every one is wrong
    "the setup's names redefined": "```python\nexpected = 0\ndef check(v):\n    return True\n" + WRONG + "```",
    "the asserts run by itself": ("```python\n" + WRONG + "if __name__ == '__main__':\n    try:\n"
                                  "        assert f(1) == expected\n    except NameError:\n        pass\n```"),
    "a verdict printed": ("```python\n" + WRONG + "print('passed')\n"
                          "print('{\"status\": \"passed\", \"passed\": 2, \"total\": 2}')\n```"),
    "a fence in a string": "```python\n" + WRONG + "s = \'\'\'\n```\n\'\'\'\ndef f(x):\n    return 2 * x + 1\n```",
    "two blocks, the harness in the second": ("Here:\n```py\n" + WRONG + "```\n```python\nimport builtins\n"
                                              "builtins.AssertionError = None\n```"),
}


@pytest.mark.parametrize("name", list(COMPLETIONS))
def test_a_completion_cannot_vouch_for_itself(pool, name):
    results = evaluate_tasks([TASK] * 2, [COMPLETIONS[name], "```python\n" + GOOD + "```"], pool)
    assert results[0].reward(partial_credit=True) == 0.0, (name, results[0].status, results[0].detail)
    assert results[1].reward() == 1.0, (results[1].status, results[1].detail)
    assert summarize(results, partial_credit=True)["reward"] == 0.5


OUTPUTS = dict([
    ("surrogates and escapes", "import sys\nsys.stdout.write('\\udcff\\x00\\x1b[2J')\nsys.stdout.flush()\n"
                               "sys.stdout.buffer.write(b'\\xff\\xfe\\xc0')\ndef f(x):\n"
                               "    raise ValueError('\\udcff\\x1b]0;x\\x07\\r\\n' * 1000)\n"),
    ("a 10 MB exception text", "def f(x):\n    raise ValueError('A' * 10_000_000)\n"),
    ("escapes past the output cap", "import sys\nsys.stderr.write('\\x1b]0;pwn\\x07\\r\\x00' * 10000)\n" + WRONG),
    ("a NUL byte in the source", WRONG + "# \x00\n"),
    ("a lone surrogate in the source", WRONG + "# \ud800\n"),
])


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_what_comes_back_can_be_logged(pool, name):
    program = OUTPUTS[name]
    r = scores_zero(pool, name, program, TESTS)
    for text in (r.detail, r.stdout, r.stderr):
        text.encode("utf-8")  # no lone surrogate reaches the trainer's logs
    assert len(r.detail) <= 1000 and "\n" not in r.detail, repr(r.detail[:200])
    json.loads(json.dumps({"detail": r.detail, "stdout": r.stdout, "stderr": r.stderr}))
    still_works(pool)


STATES = dict([
    ("a new session and group", "import os\nfor call in (os.setsid, os.setpgrp):\n    try:\n        call()\n"
                                "    except Exception:\n        pass\n" + WRONG),
    ("rlimits lowered", "import resource as r\nr.setrlimit(r.RLIMIT_NOFILE, (3, 3))\n"
                        "r.setrlimit(r.RLIMIT_AS, (1 << 24, 1 << 24))\nr.setrlimit(r.RLIMIT_CPU, (1, 1))\n" + WRONG),
    ("rlimits raised", "import resource as r\nfor k in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_NOFILE, r.RLIMIT_NPROC):\n"
                       "    try:\n        r.setrlimit(k, (r.RLIM_INFINITY, r.RLIM_INFINITY))\n"
                       "    except Exception:\n        pass\n" + WRONG),
    ("a 400 MB mapping", "import mmap\nm = mmap.mmap(-1, 400 << 20)\nm[:4] = b'keep'\n" + WRONG),
    ("files in the temporary folder", "import os, tempfile\nfor i in range(200):\n"
                                      "    with open(os.path.join(tempfile.gettempdir(), f'left{i}'), 'w') as fh:\n"
                                      "        fh.write('x' * 4096)\n" + WRONG),
    ("SIGTERM ignored", "import signal\ntry:\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\nexcept Exception:\n"
                        "    pass\n" + WRONG),
    ("cwd moved", "import os\ntry:\n    os.chdir('/')\nexcept Exception:\n    pass\n" + WRONG),
])


@pytest.mark.parametrize("name", list(STATES))
def test_process_state_does_not_reach_the_next_job(pool, name):
    scores_zero(pool, name, STATES[name], TESTS)
    still_works(pool)
    left = pool.run("import os\ndef f(x):\n    return 2 * x + 1 + len(os.listdir('.'))\n", TESTS)
    assert left.reward() == 1.0, (name, left.status, left.detail)  # a fresh, empty folder


def test_a_string_hash_is_the_same_in_every_run(pool):
    """Before the fix: a random hash per run (spawn) or per server (fork server), so the test below failed."""
    want = subprocess.run([sys.executable, "-c", "print(hash('dstrain'))"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONHASHSEED": "0"}, check=True).stdout.strip()
    if sys.version_info < (3, 11):
        pytest.skip("the judging interpreter keeps -I (a random hash) before Python 3.11")
    program = "import os\ndef f(x):\n    return hash('dstrain'), sorted(os.environ)\n"
    r = pool.run(program, [f"assert f(1) == ({want}, ['HOME', 'LANG', 'PATH', 'TMPDIR'])"])
    assert r.reward() == 1.0, (r.status, r.detail)
    hashed = "def f(x):\n    return 3 if x == 1 and hash('abc') % 2 == 0 else (5 if x == 2 else 0)\n"
    assert len({r.reward(partial_credit=True) for r in pool.run_many([(hashed, TESTS, "")] * 3)}) == 1


@pytest.mark.slow
def test_threads_spinning_past_the_program_leave_the_next_job_on_time(pool):
    spin = ("import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(4):\n"
            "    threading.Thread(target=spin, daemon=True).start()\n" + WRONG)
    start = time.monotonic()
    r = scores_zero(pool, "spinning threads", spin, TESTS)
    assert r.status in ("timeout", "failed") and time.monotonic() - start < pool.limits.wall_seconds + 1.0
    still_works(pool)
