"""evaluate_tasks runs each distinct (program, tests, setup) once per call; copies share its result."""
from __future__ import annotations

from dstrain.data.tasks import Task
from dstrain.rewards import ExecResult, evaluate_tasks


class CountingPool:
    def __init__(self):
        self.jobs = []

    def run_many(self, jobs):
        self.jobs.extend(jobs)
        return [ExecResult("passed" if "+ 1" in program else "failed", int("+ 1" in program), len(tests), 0.01, "")
                for program, tests, setup in jobs]


def test_identical_programs_run_once_and_share_the_result():
    a = Task(task_id="a", prompt="p", kind="code", tests=("assert f(1) == 2",), code_prefix="f = lambda x: ")
    b = Task(task_id="b", prompt="q", kind="code", tests=("assert f(1) == 3",), code_prefix="f = lambda x: ")
    maths = Task(task_id="m", prompt="?", kind="maths", answer="4")
    pool = CountingPool()
    texts = ["x + 1", "x + 1", "x * 2", "x + 1", "#### 4", "x + 1"]
    results = evaluate_tasks([a, a, a, b, maths, a], texts, pool)
    # a/"x + 1" (three copies), a/"x * 2", b/"x + 1": same program text but other tests, so its own run
    assert pool.jobs == [("f = lambda x: x + 1", ["assert f(1) == 2"], ""),
                         ("f = lambda x: x * 2", ["assert f(1) == 2"], ""),
                         ("f = lambda x: x + 1", ["assert f(1) == 3"], "")]
    assert [r.status for r in results] == ["passed", "passed", "failed", "passed", "passed", "passed"]
    assert results[0] is results[1] is results[5] and results[3] is not results[0]
