"""Red team, round 30: what round 29 added (the test's renamed variables, the record of a test's failed asserts, the
batch time budget of ``SandboxPool.run_many``) and what one program of a batch does to the others.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1. Found and closed:

- an honest program's reward hung on where it stood in a batch: ``run_many`` gave each job what was left of the
  batch's budget when it started, so programs that sleep until the wall limit, placed first, left a slow honest
  program behind them ``late_wall_seconds`` (0.5 s with the fork server): a correct program that sleeps 0.8 s scored
  0 behind 12 sleepers of a 64-job batch (the rest MBPP references) on 2 workers at the trainer's 5 s, 1 in front of
  them. (MBPP's own references run in 0.25 s or less: with 1 sleeper and 63 references, or 16 sleepers or CPU
  burners and 48, on 2 or 4 workers, none lost its reward, before or after.) A job whose limit the budget cut and
  that ran out of it now runs again after the batch, each such job with the same share of half of
  ``batch_seconds`` (at most the wall limit) when that is more than it had: 1 then. A batch that never meets its
  budget runs as before (no second run; a lone sleeper still overlaps the others), so the sandbox benchmark is as
  fast; 64 sleepers at 5 s on 2 workers still about 39 s (the second runs do not pay: each share is under 0.5 s).

Checked and contained (pinned below): the record of failed asserts is a local of the test's function, out of the
program's reach: a test's function handed to the program is refused (its ``__closure__`` and ``__globals__`` with
it), a context manager's ``__exit__`` reading ``tb.tb_frame`` gets no frame, ``gc`` is refused; so neither read nor
reset, and its name tells nothing. A test that catches its own failed assert fails: no MBPP test catches
``AssertionError`` (none of the shared file's tests names it), so that costs honest tests nothing. Renamed
variables keep an honest test's meaning: ``del``, f-strings, a class body or the test's own function reading one,
a comprehension variable shadowing one, ``global``, a setup name read by the test; ``locals()`` and ``eval`` in a
test were refused before the renaming and still are (their failure is not the renaming's).

Dedup (identical completions of a task share one run, ``evaluate_tasks``) happens before ``run_many``: the batch's
budget counts distinct programs, so copies neither shrink nor grow another program's limit. Left open: in a batch
of many sleepers (more than ``workers`` times the second-run shares) a slow honest program behind them still gets
less than its wall limit, the price of the budget; one in front of them gets its whole limit.
"""
from __future__ import annotations

import dataclasses
import sys
import time

import pytest

from dstrain.rewards.sandbox import SandboxPool
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)
from tests.unit.test_sandbox_redteam import LIMITS, still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")


def test_an_honest_job_behind_sleepers_runs_again_with_a_share(monkeypatch):
    """Unit level (runs faked: a sleeper sleeps its whole wall limit, the honest job needs 0.2 s, half the wall
    limit). Before the fix three sleepers first on one worker took 1.2 s of the batch's 1.2 s and the honest job got
    0.05 s: timeout, reward 0. Now it and the last sleeper, both cut and out of time, run again with 0.25 s each."""
    from dstrain.rewards import sandbox

    walls: dict[str, list[float]] = {}

    def fake_run(program, tests, setup, limits, servers):
        need = 0.2 if program == "honest" else 10.0
        walls.setdefault(program, []).append(limits.wall_seconds)
        time.sleep(min(need, limits.wall_seconds))
        if need > limits.wall_seconds:
            return sandbox.ExecResult("timeout", 0, 1, limits.wall_seconds,
                                      f"wall-clock limit of {limits.wall_seconds:g} s")
        return sandbox.ExecResult("passed", 1, 1, need, "")

    monkeypatch.setattr(sandbox, "run_program", fake_run)
    limits = dataclasses.replace(LIMITS, wall_seconds=0.4)
    jobs = [(f"sleep {i}", ["assert True"], "") for i in range(3)] + [("honest", ["assert True"], "")]
    with SandboxPool(workers=1, limits=limits, mode="spawn", batch_seconds=1.0, late_wall_seconds=0.05) as pool:
        results = pool.run_many(jobs)
    assert [r.status for r in results] == ["timeout"] * 3 + ["passed"], walls
    assert walls["honest"] == [0.05, 0.25] and walls["sleep 0"] == walls["sleep 1"] == [0.4], walls


@pytest.mark.slow
def test_a_batch_within_its_budget_runs_each_program_once():
    """Real runs, fork server: a sleeper beside honest programs, the budget never met: it runs once, beside them
    (about its wall limit for the batch), and they score 1."""
    sleeper = "import time\ntime.sleep(100)\n"
    fast = "def f(x):\n    return 2 * x + 1\n"
    limits = dataclasses.replace(LIMITS, wall_seconds=1.0)
    with SandboxPool(workers=2, limits=limits, mode="fork_server") as pool:
        pool.run_many([("x = 1\n", ["assert x == 1"], "")] * 2)  # (the servers started)
        start = time.monotonic()
        results = pool.run_many([(sleeper, ["assert f(1) == 3"], "")] + [(fast + f"# {i}\n", ["assert f(1) == 3"], "")
                                                                          for i in range(4)])
        elapsed = time.monotonic() - start
    assert [r.reward() for r in results] == [0.0] + [1.0] * 4, [r.detail for r in results]
    assert elapsed < limits.wall_seconds + 0.4, elapsed  # (not 0.5 s more, as a first short run would)


READERS = {  # name -> (program, tests): reaching the record of the test's failed asserts
    "the closure of a test's function": (
        "def f(chk):\n    try:\n        chk(1)\n    except AssertionError:\n        pass\n"
        "    for c in chk.__closure__ or ():\n        c.cell_contents.clear()\n    return 0\n",
        ["def chk(v):\n    assert v == 2\nf(chk)"]),
    "the globals of a test's function": (
        "def f(chk):\n    chk.__globals__.clear()\n    return 0\n", ["def chk(v):\n    assert v == 2\nf(chk)"]),
    "the traceback's frame in __exit__": (
        "class M:\n    def __enter__(self):\n        return 1\n    def __exit__(self, t, e, tb):\n"
        "        tb.tb_frame.f_locals['_sbx_failed'].clear()\n        return True\ndef f(x):\n    return M()\n",
        ["with f(1) as v:\n    assert v == 3"]),
    "the error's own traceback": (
        "class M:\n    def __enter__(self):\n        return 1\n    def __exit__(self, t, e, tb):\n"
        "        f = e.__traceback__.tb_frame\n        f.f_locals.clear()\n        return True\n"
        "def f(x):\n    return M()\n", ["with f(1) as v:\n    assert v == 3"]),
    "gc over every list": (
        "import gc\nclass M:\n    def __enter__(self):\n        return 1\n    def __exit__(self, *a):\n"
        "        [o.clear() for o in gc.get_objects() if type(o) is list and o == [1]]\n        return True\n"
        "def f(x):\n    return M()\n", ["with f(1) as v:\n    assert v == 3"]),
}


@pytest.mark.parametrize("name", list(READERS))
def test_the_record_of_failed_asserts_is_out_of_reach(pool, name):
    scores_zero(pool, name, *READERS[name])
    still_works(pool)


HONEST = {  # name -> test of f(x) = x + 1 (setup: base = 10): the renamed variables keep its meaning
    "del": "v = f(1)\ndel v\nv = f(2)\nassert v == 3",
    "an f-string": "v = f(1)\nassert f'{v}-{v!r}' == '2-2'",
    "a class body": "n = f(2)\nclass C:\n    w = n\nassert C.w == 3",
    "the test's function": "n = f(2)\ndef g():\n    return n\nassert g() == 3",
    "a comprehension shadowing it": "k = 3\nassert [f(i) for i in range(k)] == [1, 2, 3] and [k for k in range(2)] "
                                    "== [0, 1] and k == 3",
    "global": "global q\nq = f(1)\nassert q == 2",
    "a setup name": "b = base\nassert f(b) == 11",
}


@pytest.mark.parametrize("name", list(HONEST))
def test_renamed_variables_keep_an_honest_test_s_meaning(pool, name):
    r = pool.run("def f(x):\n    return x + 1\n", [HONEST[name]], "base = 10\n")
    assert r.reward() == 1.0, (name, r.status, r.detail)
