"""Tasks with verifiable answers for RL (GRPO): code tasks checked by running tests in
the sandbox (:mod:`dstrain.rewards`), maths tasks checked by their final answer.

* :class:`Task` - one prompt plus what is needed to verify a completion of it.
* :func:`load_mbpp` - MBPP from a local ``.jsonl`` (original) or ``.json`` (sanitized)
  file, or from the hub; the standard split by task id.
* :func:`load_gsm8k` - GSM8K from a local ``.jsonl`` file or the hub.
* :func:`make_program_tasks` / :func:`make_arithmetic_tasks` - embedded generated task
  sets that need no download and that a tiny byte-level policy can learn.
* :func:`split_tasks` - a seeded held-out split; :func:`load_tasks` - the dispatcher used
  by task configs (``{"source": "program", "n_train": 256, "n_eval": 64, "seed": 0}``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

KINDS = ("code", "maths")
MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}
MBPP_FEW_SHOT_IDS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 1)
"""Order of the few-shot examples (the MBPP paper's 3-shot prompt uses tasks 2, 3, 4)."""
GSM8K_HUB_NAMES = ("gsm8k", "openai/gsm8k")
SOURCES = ("program", "arithmetic", "choice", "mbpp", "gsm8k")


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str               # the text the policy is given
    kind: str                 # "code" or "maths"
    tests: tuple[str, ...] = ()   # code: test statements (asserts), each run after the program
    setup: str = ""           # code: MBPP test_setup_code; the sandbox runs it after the program, before the tests
    code_prefix: str = ""     # code: prepended to the extracted completion to make the program
    answer: str = ""          # maths: reference final answer
    reference: str = ""       # a known-correct completion (for supervised warm start and tests)
    stop: tuple[str, ...] = ()  # stop strings for generation of this task (may be empty)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Task {self.task_id!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "code" and not self.tests:
            raise ValueError(f"Task {self.task_id!r}: tests must hold at least one test for a code task")
        if self.kind == "maths" and not self.answer.strip():
            raise ValueError(f"Task {self.task_id!r}: answer must be set for a maths task")
        if not isinstance(self.tests, tuple) or not isinstance(self.stop, tuple):
            raise ValueError(f"Task {self.task_id!r}: tests and stop must be tuples of strings")


# ---------------------------------------------------------------- local files and the hub

def _read_records(path: Path) -> list[dict]:
    """The records of a ``.json`` list or a ``.jsonl`` file (one object a line); ValueError naming the
    file and line of the first one that is not a JSON object."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON (line {err.lineno}: {err.msg})") from None
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"{path}: expected a JSON list of records (objects)")
        return data
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not a valid JSON line ({err.msg}, column {err.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def _fields(row: Mapping[str, Any], what: str, *names: str) -> None:
    """ValueError naming the record and every field in ``names`` it lacks."""
    missing = [n for n in names if n not in row]
    if missing:
        ident = row.get("task_id", row.get("question", "?"))
        raise ValueError(f"{what} record {str(ident)[:60]!r} lacks field(s) {', '.join(missing)}")


def missing_task_file(source: str, key: str = "path") -> str:
    """The one line for a task file that is not there: where relative paths start, and how to name it."""
    where = "" if Path(source).expanduser().is_absolute() else f" (relative paths are read from {Path.cwd()})"
    data_dir = os.environ.get("DSTRAIN_DATA_DIR")  # the tests' data folder, which recipes do not read: the flag
    there = Path(data_dir).expanduser() / Path(source).name if data_dir else None
    if there is not None and there.is_file():
        return (f"task file not found: {source}{where}; name the file with --task.{key}={there} "
                "(recipes do not read DSTRAIN_DATA_DIR)")
    return f"task file not found: {source}{where}; name the file with --task.{key}=FILE"


def _looks_like_path(source: str) -> bool:
    """Hub names look like ``owner/name``; files end in .json/.jsonl or start like paths."""
    return source.endswith((".json", ".jsonl")) or source.startswith((".", "~", "/"))


def _records(source: str, split: str, hub_args: Callable[[str], tuple]) -> list[dict]:
    path = Path(source).expanduser()
    if path.is_dir():
        raise ValueError(f"{source} is a folder; name the file itself (.jsonl or .json)")
    if path.exists():
        return _read_records(path)
    if _looks_like_path(source):
        raise FileNotFoundError(missing_task_file(source))
    import datasets  # only for hub names; optional dependency

    return [dict(row) for row in datasets.load_dataset(*hub_args(source), split=split)]


# ---------------------------------------------------------------- MBPP

def _mbpp_prompt(text: str, tests: Sequence[str]) -> str:
    return f"{text.strip()}\nYour code should pass these tests:\n\n" + "\n".join(tests) + "\n```python\n"


def _typed(row: Mapping[str, Any], what: str, texts: Sequence[str] = (), lists: Sequence[str] = (),
           optional: Sequence[str] = ()) -> None:
    """ValueError naming the record and field whose value is not of the type the reader takes: ``texts`` strings,
    ``lists`` lists of strings (a string there was read one character a test), ``optional`` strings or null.
    Before, a wrong type ended in an AttributeError traceback, or silently split a string into characters."""
    ident = str(row.get("task_id", row.get("question", "?")))[:60]
    for name in (*texts, *optional):
        value = row.get(name)
        if not isinstance(value, str) and not (name in optional and value is None):
            raise ValueError(f"{what} record {ident!r}: field {name!r} must be a string, got {type(value).__name__}")
    for name in lists:
        value = row.get(name)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            got = type(value).__name__ if not isinstance(value, list) else "a list holding " + ", ".join(
                sorted({type(v).__name__ for v in value if not isinstance(v, str)}))
            raise ValueError(f"{what} record {ident!r}: field {name!r} must be a list of strings, got {got}")


def _mbpp_task(row: Mapping[str, Any]) -> Task:
    _fields(row, "MBPP", "task_id", "test_list", "code")
    _typed(row, "MBPP", texts=("code",), lists=("test_list", "test_imports"),
           optional=("text", "prompt", "test_setup_code"))
    if not row["test_list"]:
        raise ValueError(f"MBPP record {str(row['task_id'])[:60]!r}: field 'test_list' is empty; a code task needs "
                         "at least one test (remove the record or add its asserts)")
    tests = tuple(t.replace("\r\n", "\n") for t in row["test_list"])
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or ())
    code = row["code"].replace("\r\n", "\n").strip("\n").rstrip()
    text = row.get("text") or row.get("prompt") or ""
    return Task(task_id=f"mbpp/{int(row['task_id'])}", prompt=_mbpp_prompt(text, tests), kind="code",
                tests=tests, setup=setup.replace("\r\n", "\n"), reference=code + "\n```", stop=("```",))


_DEF_LINE = re.compile(r"def [A-Za-z_][A-Za-z0-9_]*\s*\(.*\)\s*(->[^:]*)?:\s*")


def with_signature(task: Task) -> Task | None:
    """``task`` with its reference's ``def`` line moved into the prompt (and ``code_prefix``), so
    the policy writes only the body; None unless the reference is one function whose first line is
    its ``def`` line (nothing before it, no second top-level statement after it)."""
    code = task.reference[: -len("```")].rstrip("\n") if task.reference.endswith("```") else task.reference
    first, _, body = code.partition("\n")
    if not _DEF_LINE.fullmatch(first) or not body.strip():
        return None
    if any(line and not line[0].isspace() for line in body.split("\n")):
        return None  # a second top-level statement (helper, constant): not a lone function
    header = first.rstrip() + "\n"
    return dataclasses.replace(task, prompt=task.prompt + header, code_prefix=header, reference=body + "\n```")


def load_mbpp(source: str, split: str, few_shot: int = 0, max_reference_chars: int = 0,
              signature: bool = False) -> list[Task]:
    """MBPP tasks of one standard split, by task id: ``"prompt"`` 1-10 (few-shot
    examples), ``"test"`` 11-510, ``"validation"`` 511-600, ``"train"`` 601-974.

    ``source`` is the original ``mbpp.jsonl`` (field ``text``), the sanitized JSON list
    (field ``prompt``, ``test_imports`` become the setup), or, when no such file exists
    and it does not look like a path, a hub name for ``datasets.load_dataset``.
    The prompt is the problem, ``"Your code should pass these tests:"``, the asserts and
    an opening ```` ```python ```` fence; the reference is the dataset's code and the
    closing fence, which is also the stop string. ``few_shot`` > 0 prefixes that many
    solved examples from the ``"prompt"`` split (2, 3, 4, ...).

    ``max_reference_chars`` > 0 keeps only the tasks whose reference code is that short
    (a tiny policy can learn those); ``signature`` ends each prompt with the reference's
    ``def`` line (see :func:`with_signature`) and keeps only tasks of that form.
    """
    if split not in MBPP_SPLITS:
        raise ValueError(f"unknown MBPP split {split!r}; valid splits: {', '.join(MBPP_SPLITS)}")
    local = Path(source).expanduser().exists()
    rows = _records(source, split, lambda name: (name,))
    low, high = MBPP_SPLITS[split]
    for r in rows:
        _fields(r, "MBPP", "task_id")
        if not isinstance(r["task_id"], int) and not str(r["task_id"]).isdigit():
            raise ValueError(f"MBPP record task_id {r['task_id']!r} is not a number")
    tasks = sorted((_mbpp_task(r) for r in rows if low <= int(r["task_id"]) <= high),
                   key=lambda t: int(t.task_id.split("/")[1]))
    if few_shot > 0:
        shots_rows = rows if local else _records(source, "prompt", lambda name: (name,))
        by_id = {int(r["task_id"]): _mbpp_task(r) for r in shots_rows if int(r["task_id"]) <= 10}
        shots = [by_id[i] for i in MBPP_FEW_SHOT_IDS if i in by_id][:few_shot]
        prefix = "".join(s.prompt + s.reference + "\n\n" for s in shots)
        tasks = [dataclasses.replace(t, prompt=prefix + t.prompt) for t in tasks]
    if max_reference_chars > 0:
        tasks = [t for t in tasks if len(t.reference) - len("```") <= max_reference_chars]
    if signature:
        tasks = [s for s in map(with_signature, tasks) if s is not None]
    return tasks


# ---------------------------------------------------------------- GSM8K

_CALCULATOR = re.compile(r"<<[^<>]*>>")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer (end with a line '#### <number>'):\n"


def load_gsm8k(source: str, split: str = "train") -> list[Task]:
    """GSM8K tasks from a local ``.jsonl`` (``question``, ``answer`` ending in
    ``#### <final>``) or the hub (``"gsm8k"``/``"openai/gsm8k"``, config ``main``).

    ``answer`` is the final answer without thousands separators; the reference is the
    worked solution with the ``<<...>>`` calculator annotations removed.
    """
    rows = _records(source, split, lambda name: ("openai/gsm8k" if name in GSM8K_HUB_NAMES else name, "main"))
    tasks = []
    for i, row in enumerate(rows):
        _fields(row, f"GSM8K {source} row {i}:", "question", "answer")
        _typed(row, f"GSM8K {source} row {i}:", texts=("question", "answer"))
        solution = _CALCULATOR.sub("", row["answer"]).strip()
        if "####" not in solution:
            raise ValueError(f"GSM8K {source} row {i}: answer has no '#### <final>' line")
        final = _THOUSANDS.sub("", solution.rsplit("####", 1)[1].strip())
        tasks.append(Task(task_id=f"gsm8k/{split}/{i}", prompt=gsm8k_prompt(row["question"]), kind="maths",
                          answer=final, reference=solution, stop=("\nQuestion:",)))
    return tasks


# ---------------------------------------------------------------- embedded generated tasks

# (words, template, precedence needed of the operand, precedence of the result, function)
_UNARY: list[tuple[str, str, int, int, Callable[[int], int]]] = [
    ("squared", "{e} ** 2", 4, 3, lambda v: v * v),
    ("negated", "-{e}", 3, 2, lambda v: -v),
    ("made absolute", "abs({e})", 0, 4, abs),
]
_WITH_K: list[tuple[str, str, int, int, Callable[[int, int], int], int]] = [
    ("plus {k}", "{e} + {k}", 1, 1, lambda v, k: v + k, 1),
    ("minus {k}", "{e} - {k}", 1, 1, lambda v, k: v - k, 1),
    ("times {k}", "{e} * {k}", 2, 2, lambda v, k: v * k, 2),
    ("floor-divided by {k}", "{e} // {k}", 2, 2, lambda v, k: v // k, 2),
    ("mod {k}", "{e} % {k}", 2, 2, lambda v, k: v % k, 2),
]
_PAIR = [("x plus y", "x + y", 1, lambda a, b: a + b), ("x minus y", "x - y", 1, lambda a, b: a - b),
         ("x times y", "x * y", 2, lambda a, b: a * b)]


def _random_op(rng: random.Random):
    """One operation: (words, apply-to-(expr, prec) -> (expr, prec), function)."""
    if rng.random() < 0.3:
        words, template, need, prec, fn = rng.choice(_UNARY)
        return words, (lambda e, p: (template.format(e=e if p >= need else f"({e})"), prec)), fn
    words, template, need, prec, fn, k_min = rng.choice(_WITH_K)
    k = rng.randint(k_min, 9)
    return (words.format(k=k), (lambda e, p: (template.format(e=e if p >= need else f"({e})", k=k), prec)),
            (lambda v, k=k: fn(v, k)))


def _program_task(rng: random.Random, task_id: str) -> Task | None:
    form = rng.choice(("comment", "docstring", "lambda", "pair"))
    n_ops = rng.choice((1, 2)) if form != "pair" else rng.choice((0, 1))
    if form == "pair":
        words0, expr, prec, fn0 = rng.choice(_PAIR)
        steps, fns = [words0], [lambda args, f=fn0: f(*args)]
    else:
        expr, prec, steps, fns = "x", 4, ["x"], [lambda args: args[0]]
    for _ in range(n_ops):
        words, apply, fn = _random_op(rng)
        expr, prec = apply(expr, prec)
        steps.append(words)
        fns.append(lambda args, f=fn: f(args))
    if len(steps) == 1 and form != "pair":
        return None  # "x" alone is not a task
    description = steps[0] if form == "pair" else f"x {steps[1]}"
    description += "".join(f", {s}" for s in steps[(1 if form == 'pair' else 2):])
    if form == "pair":
        inputs = [(rng.randint(-5, 9), rng.randint(-5, 9)) for _ in range(4)]
    else:
        inputs = [(v,) for v in rng.sample(range(-6, 13), 4)]

    def evaluate(args):
        value = fns[0](args)
        for f in fns[1:]:
            value = f(value)
        return value

    outputs = [evaluate(a) for a in inputs]
    if len(set(outputs)) < 2 or len(set(inputs)) < 4:
        return None  # tests that a constant could pass
    params = "x, y" if form == "pair" else "x"
    if form == "comment" or form == "pair":
        header, prefix = f"# {description}\n", f"def f({params}):\n    return "
    elif form == "docstring":
        header, prefix = "", f'def f(x):\n    """Return {description}."""\n    return '
    else:
        header, prefix = f"# f(x) = {description}\n", "f = lambda x: "
    tests = tuple(f"assert f({', '.join(map(str, a))}) == {o}" for a, o in zip(inputs, outputs))
    return Task(task_id=task_id, prompt=header + prefix, kind="code", tests=tests, code_prefix=prefix,
                reference=expr, stop=("\n",))


_MAX_MISSES = 20_000
"""Consecutive rejected draws after which a generator is taken to be exhausted."""


def make_program_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` small generated programming tasks, deterministic given ``seed``, with no two
    prompts alike. The prompt describes 1-2 operations in words (``plus 3``, ``times 2``,
    ``squared``, ``negated``, ``mod 4``, ...) in one of four forms (comment + ``def``,
    docstring, ``lambda``, two arguments); the policy completes the return expression
    (stop at the newline); ``code_prefix`` is the code part of the prompt; four asserts on
    distinct inputs check it. Example: prompt ``"# x plus 3, times 2\\ndef f(x):\\n    return "``,
    reference ``"(x + 3) * 2"``."""
    rng = random.Random(f"program-tasks-{seed}")
    tasks: list[Task] = []
    seen: set[str] = set()
    misses = 0
    while len(tasks) < n:
        task = _program_task(rng, f"program/{seed}/{len(tasks)}")
        if task is None or task.prompt in seen:
            misses += 1
            if misses > _MAX_MISSES:
                raise ValueError(f"could only generate {len(tasks)} distinct program tasks, {n} requested")
            continue
        misses = 0
        seen.add(task.prompt)
        tasks.append(task)
    return tasks


def distinct_maths_tasks(n: int, family: str, seed: int, draw) -> list[Task]:
    """``n`` maths tasks with distinct prompts, ids ``family/seed/i``: ``draw(rng)`` gives one
    ``(prompt, answer)`` from ``random.Random(f"{family}-tasks-{seed}")``; repeats are drawn again."""
    rng = random.Random(f"{family}-tasks-{seed}")
    tasks: list[Task] = []
    seen: set[str] = set()
    misses = 0
    while len(tasks) < n:
        prompt, value = draw(rng)
        if prompt in seen:
            misses += 1
            if misses > _MAX_MISSES:
                raise ValueError(f"could only generate {len(tasks)} distinct {family} tasks, {n} requested")
            continue
        misses = 0
        seen.add(prompt)
        tasks.append(Task(task_id=f"{family}/{seed}/{len(tasks)}", prompt=prompt, kind="maths",
                          answer=str(value), reference=f"#### {value}", stop=("\n",)))
    return tasks


def make_arithmetic_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` distinct arithmetic questions (``"Question: What is 23 + 45?\\nAnswer: "``)
    with the answer as a maths task; the reference completion is ``"#### 68"``."""
    def draw(rng):
        op = rng.choice("+-*")
        a, b = (rng.randint(2, 99), rng.randint(2, 99)) if op != "*" else (rng.randint(2, 19), rng.randint(2, 9))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return f"Question: What is {a} {op} {b}?\nAnswer: ", value

    return distinct_maths_tasks(n, "arithmetic", seed, draw)


# ---------------------------------------------------------------- splits and the dispatcher

def split_tasks(tasks: Sequence[Task], eval_fraction: float = 0.1, seed: int = 0,
                n_eval: int | None = None) -> tuple[list[Task], list[Task]]:
    """A seeded held-out split: ``(train, eval)`` with ``n_eval`` tasks (default
    ``round(eval_fraction * len(tasks))``) in eval; both keep the original order."""
    if n_eval is None:
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        n_eval = round(eval_fraction * len(tasks))
    if not 0 <= n_eval <= len(tasks):
        raise ValueError(f"n_eval must be between 0 and {len(tasks)}, got {n_eval}")
    held = set(random.Random(f"split-{seed}").sample(range(len(tasks)), n_eval))
    return ([t for i, t in enumerate(tasks) if i not in held], [t for i, t in enumerate(tasks) if i in held])


_SPEC_KEYS = ("source", "path", "eval_path", "split", "eval_split", "n_train", "n_eval", "seed", "few_shot",
              "max_reference_chars", "signature")


def load_tasks(spec: Mapping[str, Any] | Any) -> tuple[list[Task], list[Task]]:
    """``(train, eval)`` task lists from a task config (a mapping or a dataclass).

    Keys: ``source`` (required: ``"program"``, ``"arithmetic"``, ``"mbpp"``, ``"gsm8k"``);
    ``n_train`` / ``n_eval`` (sizes; for the generated sources default 256 / 64, for
    files everything / 64); ``seed`` (default 0); for mbpp and gsm8k ``path`` (a local
    file or hub name; default ``"mbpp"`` / ``"openai/gsm8k"``) and ``split`` (default
    ``"train"``). Eval tasks: generated sources hold out the last ``n_eval`` of one
    generated set; mbpp uses ``eval_split`` (default ``"validation"``); gsm8k reads
    ``eval_path`` (with ``eval_split``, default ``"test"``) when given, otherwise holds out
    ``n_eval`` tasks of the train file. ``few_shot`` (mbpp) prefixes solved examples;
    ``max_reference_chars`` and ``signature`` (mbpp) select and shape tasks (see :func:`load_mbpp`).
    """
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        spec = dataclasses.asdict(spec)
    spec = {k: v for k, v in dict(spec).items() if v is not None}
    unknown = sorted(set(spec) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown task config keys {unknown}; allowed: {', '.join(_SPEC_KEYS)}")
    source = spec.get("source")
    if source not in SOURCES:
        raise ValueError(f"unknown task source {source!r}; valid sources: {', '.join(SOURCES)}")
    seed, n_eval = int(spec.get("seed", 0)), int(spec.get("n_eval", 64))
    n_train = spec.get("n_train")
    if source in ("program", "arithmetic", "choice"):
        n_train = int(256 if n_train is None else n_train)
        from dstrain.data.choice_tasks import make_choice_tasks  # (it imports this module)
        make = {"program": make_program_tasks, "arithmetic": make_arithmetic_tasks, "choice": make_choice_tasks}[source]
        tasks = make(n_train + n_eval, seed)
        return tasks[:n_train], tasks[n_train:]
    split = spec.get("split", "train")
    if source == "mbpp":
        path = spec.get("path", "mbpp")
        shape = dict(few_shot=int(spec.get("few_shot", 0)), signature=bool(spec.get("signature", False)),
                     max_reference_chars=int(spec.get("max_reference_chars", 0)))
        train = load_mbpp(path, split, **shape)
        evals = load_mbpp(spec.get("eval_path", path), spec.get("eval_split", "validation"), **shape)[:n_eval]
    else:
        path = spec.get("path", "openai/gsm8k")
        train = load_gsm8k(path, split)
        if "eval_path" in spec:
            evals = load_gsm8k(spec["eval_path"], spec.get("eval_split", "test"))[:n_eval]
        else:
            train, evals = split_tasks(train, seed=seed, n_eval=min(n_eval, len(train)))
    return (train if n_train is None else train[: int(n_train)]), evals
