"""Task types and loaders: validation, MBPP and GSM8K files, generated task sets."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from dstrain.data.tasks import (MBPP_SPLITS, Task, load_gsm8k, load_mbpp, load_tasks, make_arithmetic_tasks,
                                make_program_tasks, split_tasks)
from dstrain.rewards import SandboxLimits, SandboxPool, evaluate_tasks, maths_reward, score_tasks

# real public data: $DSTRAIN_DATA_DIR, else shared/data beside the clone
DATA = Path(os.environ.get("DSTRAIN_DATA_DIR") or Path(__file__).resolve().parents[2].parent / "shared" / "data")
LIMITS = SandboxLimits(wall_seconds=5.0, memory_bytes=512 << 20)


def data_file(name: str) -> Path:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"shared data file {name} not in {DATA} (set DSTRAIN_DATA_DIR to the folder holding it)")
    return path


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, limits=LIMITS) as p:
        yield p


# ---------------------------------------------------------------- Task

def test_task_validation_names_field_and_id():
    with pytest.raises(ValueError, match=r"'x1'.*kind"):
        Task(task_id="x1", prompt="p", kind="prose")
    with pytest.raises(ValueError, match=r"'x2'.*tests"):
        Task(task_id="x2", prompt="p", kind="code")
    with pytest.raises(ValueError, match=r"'x3'.*answer"):
        Task(task_id="x3", prompt="p", kind="maths")
    Task(task_id="ok", prompt="p", kind="maths", answer="1")


# ---------------------------------------------------------------- MBPP

def test_mbpp_standard_split_by_task_id():
    path = data_file("mbpp.jsonl")
    sizes = {"prompt": 10, "test": 500, "validation": 90, "train": 374}
    for split, (low, high) in MBPP_SPLITS.items():
        tasks = load_mbpp(str(path), split)
        ids = [int(t.task_id.split("/")[1]) for t in tasks]
        assert len(tasks) == sizes[split]
        assert ids == sorted(ids) and min(ids) == low and max(ids) == high


def test_mbpp_prompt_format():
    path = data_file("mbpp.jsonl")
    row = json.loads(path.read_text().splitlines()[10])  # task 11
    task = load_mbpp(str(path), "test")[0]
    assert task.task_id == "mbpp/11" and task.kind == "code" and task.stop == ("```",)
    assert task.prompt.startswith(row["text"].strip() + "\n")
    assert ("Your code should pass these tests:\n\n" + "\n".join(row["test_list"]) + "\n```python\n") in task.prompt
    assert task.prompt.endswith("```python\n")
    assert task.tests == tuple(row["test_list"])
    assert task.reference.endswith("\n```") and "\r" not in task.reference


def test_mbpp_few_shot_prefix():
    path = data_file("mbpp.jsonl")
    plain = load_mbpp(str(path), "validation")[0]
    shot = load_mbpp(str(path), "validation", few_shot=3)[0]
    assert shot.prompt.endswith(plain.prompt)
    prefix = shot.prompt[: -len(plain.prompt)]
    assert prefix.count("```python\n") == 3 and prefix.count("\n```\n") == 3


def test_mbpp_errors():
    with pytest.raises(ValueError, match="valid splits: prompt, test, validation, train"):
        load_mbpp("whatever.jsonl", "dev")
    with pytest.raises(FileNotFoundError, match="no/such/mbpp.jsonl"):
        load_mbpp("no/such/mbpp.jsonl", "test")


def test_mbpp_references_pass_their_own_tests(pool):
    path = data_file("mbpp.jsonl")
    tasks = [t for split in MBPP_SPLITS for t in load_mbpp(str(path), split)]
    sample = random.Random(0).sample(tasks, 9) + [t for t in tasks if t.task_id == "mbpp/367"]  # 367 has setup
    assert sample[-1].setup
    results = evaluate_tasks(sample, [t.reference for t in sample], pool)
    assert [r.status for r in results] == ["passed"] * len(sample), [r.detail for r in results]
    wrong = evaluate_tasks(sample[:3], ["def nothing():\n    pass\n```"] * 3, pool)
    assert [r.reward() for r in wrong] == [0.0] * 3


def test_sanitized_mbpp_uses_prompt_field_and_test_imports(pool):
    path = data_file("sanitized-mbpp.json")
    tasks = load_mbpp(str(path), "test")
    assert len(tasks) > 200
    with_imports = [t for t in tasks if t.setup][:2]
    sample = with_imports + random.Random(1).sample(tasks, 3)
    assert score_tasks(sample, [t.reference for t in sample], pool) == [1.0] * len(sample)


# ---------------------------------------------------------------- GSM8K

def test_gsm8k_references_score_one():
    path = data_file("gsm8k_test.jsonl")
    tasks = load_gsm8k(str(path), "test")
    assert len(tasks) == 1319 and tasks[0].task_id == "gsm8k/test/0"
    assert all(maths_reward(t.reference, t.answer) == 1.0 for t in tasks)
    assert all("<<" not in t.reference and "," not in t.answer for t in tasks)
    assert tasks[0].answer == "18" and tasks[0].prompt.startswith("Question: Janet")
    assert "####" in tasks[0].prompt  # the prompt asks for the #### format
    wrong = [t.reference.rsplit("####", 1)[0] + "#### 123456789" for t in tasks[:50]]
    assert sum(maths_reward(w, t.answer) for w, t in zip(wrong, tasks)) == 0.0


def test_gsm8k_missing_file():
    with pytest.raises(FileNotFoundError, match="missing/gsm8k.jsonl"):
        load_gsm8k("./missing/gsm8k.jsonl")


# ---------------------------------------------------------------- generated tasks


@pytest.mark.parametrize("name, text, match", [
    ("cut.jsonl", '{"task_id": 601, "code": "x"}\n{"task_id": 602, "te', r"cut.jsonl:2: not a valid JSON line"),
    ("list.jsonl", "[1, 2]\n", r"list.jsonl:1: expected a JSON object, got list"),
    ("nocode.jsonl", '{"task_id": 700, "text": "t", "test_list": []}\n', r"MBPP record '700' lacks field\(s\) code"),
    ("badid.jsonl", '{"task_id": "seven", "text": "t"}\n', r"task_id 'seven' is not a number"),
    ("notlist.json", '{"task_id": 700}', r"notlist.json: expected a JSON list of records"),
    ("broken.json", '[{"task_id": 700,', r"broken.json: not valid JSON \(line 1"),
])
def test_malformed_mbpp_files_name_file_line_and_field(tmp_path, name, text, match):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        load_mbpp(str(tmp_path / name), "train")


def test_gsm8k_row_without_answer_is_named(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n" + json.dumps({"question": "2+2?"}))
    with pytest.raises(ValueError, match=r"row 1: record '2\+2\?' lacks field\(s\) answer"):
        load_gsm8k(str(path))

def test_program_tasks_are_deterministic_distinct_and_well_formed():
    tasks = make_program_tasks(300, seed=3)
    assert tasks == make_program_tasks(300, seed=3)
    assert [t.prompt for t in tasks] != [t.prompt for t in make_program_tasks(300, seed=4)]
    assert len({t.prompt for t in tasks}) == 300 and len({t.task_id for t in tasks}) == 300
    for t in tasks:
        assert t.kind == "code" and t.stop == ("\n",) and t.prompt.endswith(t.code_prefix)
        assert len(t.tests) == 4 and "\n" not in t.reference
    assert {t.code_prefix for t in tasks} >= {"def f(x):\n    return ", "f = lambda x: ", "def f(x, y):\n    return "}


def test_program_task_example_form():
    tasks = make_program_tasks(500, seed=0)
    comment = [t for t in tasks if t.prompt.startswith("# x ") and t.code_prefix == "def f(x):\n    return "]
    assert comment, "the comment form is generated"
    t = comment[0]
    assert t.prompt == t.prompt.split("\n")[0] + "\n" + t.code_prefix


def test_program_task_references_pass_and_wrong_answers_fail(pool):
    tasks = make_program_tasks(400, seed=0)
    sample = random.Random(2).sample(tasks, 16)
    assert score_tasks(sample, [t.reference for t in sample], pool) == [1.0] * 16
    wrong = [f"{t.reference} + 1" for t in sample]
    assert score_tasks(sample, wrong, pool) == [0.0] * 16
    # every reference, checked in process (our own generated code, not untrusted)
    for t in tasks:
        scope: dict = {}
        exec(t.code_prefix + t.reference, scope)
        for test in t.tests:
            exec(test, scope)


def test_arithmetic_tasks():
    tasks = make_arithmetic_tasks(200, seed=1)
    assert tasks == make_arithmetic_tasks(200, seed=1)
    assert len({t.prompt for t in tasks}) == 200
    assert all(t.kind == "maths" and maths_reward(t.reference, t.answer) == 1.0 for t in tasks)
    t = tasks[0]
    a, op, b = t.prompt.split("What is ")[1].split("?")[0].split()
    assert int(t.answer) == eval(f"{a} {op} {b}")  # noqa: S307 - our own two-number expression
    assert maths_reward(f"#### {int(t.answer) + 1}", t.answer) == 0.0


def test_too_many_tasks_requested():
    with pytest.raises(ValueError, match="distinct arithmetic tasks"):
        make_arithmetic_tasks(30_000, seed=0)


# ---------------------------------------------------------------- splits and the dispatcher

def test_split_tasks():
    tasks = make_arithmetic_tasks(50, seed=0)
    train, held = split_tasks(tasks, eval_fraction=0.2, seed=7)
    assert len(train) == 40 and len(held) == 10
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
    assert split_tasks(tasks, 0.2, seed=7) == (train, held)
    assert split_tasks(tasks, 0.2, seed=8) != (train, held)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_tasks(tasks, eval_fraction=1.5)


def test_load_tasks_generated_sources():
    train, held = load_tasks({"source": "program", "n_train": 20, "n_eval": 5, "seed": 1})
    assert len(train) == 20 and len(held) == 5
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in held})
    train, held = load_tasks({"source": "arithmetic", "n_train": 8, "n_eval": 2})
    assert all(t.kind == "maths" for t in train + held) and len(train + held) == 10


def test_load_tasks_files():
    mbpp = data_file("mbpp.jsonl")
    train, held = load_tasks({"source": "mbpp", "path": str(mbpp), "n_train": 30, "n_eval": 7})
    assert len(train) == 30 and train[0].task_id == "mbpp/601"
    assert len(held) == 7 and held[0].task_id == "mbpp/511"
    gsm = data_file("gsm8k_train.jsonl")
    train, held = load_tasks({"source": "gsm8k", "path": str(gsm), "n_train": 12, "n_eval": 4, "seed": 0})
    assert len(train) == 12 and len(held) == 4
    train, held = load_tasks({"source": "gsm8k", "path": str(gsm), "eval_path": str(data_file("gsm8k_test.jsonl")),
                              "n_train": 3, "n_eval": 2})
    assert held[0].task_id == "gsm8k/test/0"


def test_load_tasks_rejects_unknown_sources_and_keys():
    with pytest.raises(ValueError, match="valid sources: program, arithmetic, choice, mbpp, gsm8k"):
        load_tasks({"source": "humaneval"})
    with pytest.raises(ValueError, match=r"unknown task config keys \['n_trian'\]"):
        load_tasks({"source": "program", "n_trian": 3})
