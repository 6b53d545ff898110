"""Code extraction, maths answer checking, and scoring tasks by kind."""
from __future__ import annotations

import pytest

from dstrain.data.tasks import Task
from dstrain.rewards import (ExecResult, SandboxLimits, SandboxPool, evaluate_tasks, extract_code,
                             extract_final_answer, maths_reward, normalize_number, score_tasks, summarize)

LIMITS = SandboxLimits(wall_seconds=3.0, memory_bytes=512 << 20)


# ---------------------------------------------------------------- extract_code

@pytest.mark.parametrize("completion, expected", [
    ("def f():\n    return 1", "def f():\n    return 1"),
    ("Here you go:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1"),
    ("```py\nx = 1\n```", "x = 1"),
    ("```\nx = 2\n```\n```python\ny = 3\n```", "x = 2"),
    ("```python\ndef f():\n    return 1\n", "def f():\n    return 1\n"),
    ("def f():\n    return 1\n```\nsome chatter", "def f():\n    return 1"),
    ("\n\n```\nz = 4\n```", "z = 4"),
    ("", ""),
])
def test_extract_code(completion, expected):
    assert extract_code(completion) == expected


def test_extract_code_keeps_inline_backticks():
    text = "s = '```'\nprint(s)"
    assert extract_code(text) == text


# ---------------------------------------------------------------- maths

@pytest.mark.parametrize("text, expected", [
    ("She makes 9 * 2 = $18.\n#### 18", "18"),
    ("#### 1,000\nQuestion: next", "1,000"),
    ("first #### 3 then\n#### 4", "4"),
    ("####72", "72"),
    ("no marker here, 42", None),
    ("#### \n", None),
])
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_final_answer_fallback_to_last_number():
    assert extract_final_answer("so 3 plus 4 is 7.", fallback_last_number=True) == "7"
    assert extract_final_answer("it costs 1,250 dollars", fallback_last_number=True) == "1250"
    assert extract_final_answer("nothing", fallback_last_number=True) is None


@pytest.mark.parametrize("raw, expected", [
    ("1,000", "1000"), ("1000", "1000"), ("$1,000.00", "1000"), ("3.50", "3.5"), ("3.5", "3.5"),
    ("-2", "-2"), ("\u22122", "-2"), ("18.", "18"), ("18 dollars", "18"), ("50%", "50"), ("1/2", "0.5"),
    (".5", "0.5"), ("2/3", "2/3"), ("4/2", "2"), ("0.10", "0.1"), ("1,234,567", "1234567"), ("-$5", "-5"),
    ("abc", None), ("", None), (None, None), ("1/0", None),
])
def test_normalize_number(raw, expected):
    assert normalize_number(raw) == expected


def test_maths_reward():
    assert maths_reward("work...\n#### 1,000", "1000") == 1.0
    assert maths_reward("#### $3.50", "3.5") == 1.0
    assert maths_reward("#### 3.51", "3.5") == 0.0
    assert maths_reward("the answer is 1000", "1000") == 0.0  # the #### format is required
    assert maths_reward("#### 0.5", "1/2") == 1.0
    assert maths_reward("#### -7", "7") == 0.0
    assert maths_reward("#### yes", "yes") == 1.0  # a non-numeric reference compares as text


# ---------------------------------------------------------------- scoring by kind

def _code_task(tid: str = "t1") -> Task:
    return Task(task_id=tid, prompt="# x plus 1\ndef f(x):\n    return ", kind="code",
                tests=("assert f(1) == 2", "assert f(5) == 6", "assert f(-1) == 0"),
                code_prefix="def f(x):\n    return ", reference="x + 1", stop=("\n",))


def _maths_task() -> Task:
    return Task(task_id="m1", prompt="What is 2 + 2?\nAnswer: ", kind="maths", answer="4", reference="#### 4")


def test_score_tasks_dispatches_by_kind():
    code, maths = _code_task(), _maths_task()
    tasks = [code, maths, code, maths, code]
    completions = ["x + 1", "#### 4", "x + 2", "#### 5", "abs(x) + 1"]
    with SandboxPool(workers=2, limits=LIMITS) as pool:
        assert score_tasks(tasks, completions, pool) == [1.0, 1.0, 0.0, 0.0, 0.0]
        assert score_tasks(tasks, completions, pool, partial_credit=True) == pytest.approx(
            [1.0, 1.0, 0.0, 0.0, 2 / 3])


def test_score_tasks_without_a_pool_and_with_fenced_completions():
    task = Task(task_id="fenced", prompt="Write add.\n```python\n", kind="code",
                tests=("assert add(2, 3) == 5",), reference="def add(a, b):\n    return a + b\n```")
    completions = [task.reference, "```python\ndef add(a, b):\n    return a - b\n```"]
    assert score_tasks([task, task], completions, limits=LIMITS) == [1.0, 0.0]


def test_evaluate_tasks_reports_statuses_for_logging():
    code, maths = _code_task(), _maths_task()
    results = evaluate_tasks([code, code, maths, maths], ["x + 1", "(", "#### 4", "four"], limits=LIMITS)
    assert [r.status for r in results] == ["passed", "error", "passed", "error"]
    stats = summarize(results)
    assert stats["passed"] == 2 and stats["error"] == 2 and stats["timeout"] == 0
    assert stats["reward"] == pytest.approx(0.5)


def test_evaluate_tasks_checks_lengths():
    with pytest.raises(ValueError, match="2 tasks but 1 completions"):
        evaluate_tasks([_maths_task(), _maths_task()], ["#### 4"])


def test_exec_result_reward_rules():
    assert ExecResult("failed", 1, 4, 0.1).reward(partial_credit=True) == 0.25
    assert ExecResult("failed", 1, 4, 0.1).reward() == 0.0
    for status in ("timeout", "error", "crash"):
        assert ExecResult(status, 3, 4, 0.1).reward(partial_credit=True) == 0.0
