"""MBPP shaped for a small policy: short references only, and the function's ``def`` line moved
into the prompt (the policy writes the body). Skips without the shared MBPP file."""
from __future__ import annotations

import json

import pytest

from dstrain.data.tasks import Task, load_mbpp, load_tasks, with_signature
from dstrain.rewards import SandboxLimits, SandboxPool, score_tasks
from dstrain.trainers import policy_rl as prl
from dstrain.trainers.grpo_config import PolicyTaskConfig
from tests.unit.test_tasks import data_file


def _task(code: str) -> Task:
    return Task(task_id="t", prompt="Write it.\n```python\n", kind="code", tests=("assert f(1) == 2",),
                reference=code + "\n```", stop=("```",))


def test_signature_moves_the_def_line_into_the_prompt():
    t = with_signature(_task("def f(x) :\n    return x + 1"))
    assert t.prompt == "Write it.\n```python\ndef f(x) :\n" and t.code_prefix == "def f(x) :\n"
    assert t.reference == "    return x + 1\n```"
    assert t.code_prefix + t.reference[:-3] == "def f(x) :\n    return x + 1\n"


@pytest.mark.parametrize("code", ["import math\ndef f(x):\n    return x + 1",      # something before the def
                                  "def g(x):\n    return x\ndef f(x):\n    return g(x) + 1",  # two functions
                                  "def f(x):\n    return x + 1\nR = 3",          # a statement after it
                                  "f = lambda x: x + 1",                           # no def at all
                                  "def f(x): return x + 1"])                       # body on the def line
def test_signature_refuses_what_is_not_one_lone_function(code):
    assert with_signature(_task(code)) is None


def test_short_signature_tasks_from_the_file_pass_their_own_tests():
    path = str(data_file("mbpp.jsonl"))
    every = {t.task_id: t for t in load_mbpp(path, "train")}
    short = load_mbpp(path, "train", max_reference_chars=100, signature=True)
    assert 40 <= len(short) < len(every)  # 79 of the 374 train tasks in the file we have
    for t in short:
        original = every[t.task_id]
        assert len(original.reference) - 3 <= 100
        assert t.prompt == original.prompt + t.code_prefix and t.code_prefix.startswith("def ")
        lines = (t.code_prefix + t.reference).split("\n")
        assert [x.rstrip() for x in lines] == [x.rstrip() for x in original.reference.split("\n")]
    completions = [t.reference for t in short]  # as the policy would write them: body, then the fence
    with SandboxPool(workers=2, limits=SandboxLimits(wall_seconds=5.0, memory_bytes=512 << 20)) as pool:
        rewards = score_tasks(short, completions, pool)
    assert sum(rewards) >= len(short) - 1, [t.task_id for t, r in zip(short, rewards) if r < 1]


def test_task_section_reaches_the_loader():
    path = str(data_file("mbpp.jsonl"))
    task = PolicyTaskConfig(source="mbpp", path=path, eval_split="validation", n_eval=8,
                            mbpp_max_reference_chars=100, mbpp_signature=True)
    train, held = prl.load_task_sets(task, seed=0)
    assert len(held) == 8 and all(t.code_prefix.startswith("def ") for t in train + held)
    assert [t.task_id for t in train] == [t.task_id for t in load_tasks(
        {"source": "mbpp", "path": path, "max_reference_chars": 100, "signature": True})[0]]
    with pytest.raises(ValueError, match="mbpp_max_reference_chars"):
        PolicyTaskConfig(mbpp_max_reference_chars=-1)
    json.dumps(train[0].__dict__)  # plain data: goes to a Ray actor as is
