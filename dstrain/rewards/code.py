"""Rewards for tasks: code extraction, and scoring a batch of completions by task kind.

* :func:`extract_code` - the code of a completion (fenced or not).
* :func:`evaluate_tasks` - one :class:`~dstrain.rewards.sandbox.ExecResult` per
  completion: code tasks run ``task.code_prefix + extract_code(completion)`` (:func:`program_of`: code
  that starts the program is moved to the top level) with the task's setup and tests in the sandbox (each distinct program once per call: identical
  completions of a task share one run and its result); maths tasks go through
  :func:`~dstrain.rewards.maths.maths_reward` (no process needed).
* :func:`score_tasks` - the rewards (floats) of :func:`evaluate_tasks`.
* :func:`summarize` - counts per status and the mean reward, for logging.
"""
from __future__ import annotations

import os
import re
import textwrap
from collections import Counter
from typing import TYPE_CHECKING, Sequence

from dstrain.rewards.maths import extract_final_answer, maths_reward, normalize_number
from dstrain.rewards.sandbox import STATUSES, ExecResult, SandboxLimits, SandboxPool

if TYPE_CHECKING:
    from dstrain.data.tasks import Task

_FENCE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+.-]*)[ \t]*$")


def extract_code(completion: str) -> str:
    """The code in a completion.

    * A completion that opens a fence (```` ```python ````, ```` ```py ````, or a bare
      ```` ``` ```` with nothing but blank lines before it) gives the lines up to the
      closing fence, or to the end when the fence is never closed.
    * A completion whose first fence closes a block opened in the prompt (code comes
      first, then a bare ```` ``` ````) gives the text before that fence.
    * Without a fence the text is returned as is.
    """
    lines = completion.split("\n")
    for i, line in enumerate(lines):
        m = _FENCE.match(line)
        if m is None:
            continue
        opening = bool(m.group(1)) or not "\n".join(lines[:i]).strip()
        if not opening:
            return "\n".join(lines[:i])
        body = []
        for rest in lines[i + 1:]:
            if _FENCE.match(rest) and not _FENCE.match(rest).group(1):
                break
            body.append(rest)
        return "\n".join(body)
    return completion


def program_of(code_prefix: str, code: str) -> str:
    """The program a code task runs: ``code_prefix + code``.

    With no code in ``code_prefix`` the code starts the program, at the top level: a completion read after a
    prompt that does not end in a newline (``"[/INST]"``, ``"<|assistant|>"``, ``"...:"``) starts with the
    space that separates it from the prompt (a SentencePiece ``▁def``), an IndentationError though the
    code is right. There the code's common indentation is removed, then what is left in front of its first
    line; code after a ``code_prefix`` (a function's body after its ``def`` line) is kept as written.
    """
    if code_prefix.strip():
        return code_prefix + code
    code = textwrap.dedent(code)
    lines = code.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None:
        lines[first] = lines[first].lstrip(" \t")
    return code_prefix + "\n".join(lines)


def _maths_result(completion: str, answer: str) -> ExecResult:
    predicted = extract_final_answer(completion)
    if predicted is None:
        return ExecResult("error", 0, 1, 0.0, "no '####' final answer")
    ok = maths_reward(completion, answer) == 1.0
    detail = "" if ok else f"expected {answer!r}, got {predicted!r} (normalised {normalize_number(predicted)!r})"
    return ExecResult("passed" if ok else "failed", int(ok), 1, 0.0, detail)


def evaluate_tasks(tasks: Sequence["Task"], completions: Sequence[str], pool: SandboxPool | None = None,
                   limits: SandboxLimits | None = None) -> list[ExecResult]:
    """One result per (task, completion) pair, in order. Code tasks run in ``pool`` (a
    temporary pool of up to 4 workers is made and closed when ``pool`` is None, with
    ``limits``); maths tasks are checked in process."""
    if len(tasks) != len(completions):
        raise ValueError(f"evaluate_tasks got {len(tasks)} tasks but {len(completions)} completions")
    results: list[ExecResult | None] = [None] * len(tasks)
    jobs, where = [], []
    for i, (task, completion) in enumerate(zip(tasks, completions)):
        if task.kind == "maths":
            results[i] = _maths_result(completion, task.answer)
        elif task.kind == "code":
            jobs.append((program_of(task.code_prefix, extract_code(completion)), list(task.tests), task.setup))
            where.append(i)
        else:
            raise ValueError(f"task {task.task_id}: unknown kind {task.kind!r}")
    if jobs:
        # The same program with the same tests and setup runs once per call (a group's completions are
        # often identical: all right or all wrong alike); its copies share the result.
        unique: dict[tuple, int] = {}
        slots = [unique.setdefault((program, tuple(tests), setup), len(unique)) for program, tests, setup in jobs]
        todo = [(program, list(tests), setup) for program, tests, setup in unique]
        own = pool is None
        pool = pool or SandboxPool(workers=max(1, min(4, os.cpu_count() or 1, len(todo))), limits=limits)
        try:
            ran = pool.run_many(todo)
        finally:
            if own:
                pool.close()
        for i, slot in zip(where, slots):
            results[i] = ran[slot]
    return results  # type: ignore[return-value]


def score_tasks(tasks: Sequence["Task"], completions: Sequence[str], pool: SandboxPool | None = None,
                partial_credit: bool = False, limits: SandboxLimits | None = None) -> list[float]:
    """Rewards in [0, 1], one per completion (see :meth:`ExecResult.reward`)."""
    return [r.reward(partial_credit) for r in evaluate_tasks(tasks, completions, pool, limits)]


def summarize(results: Sequence[ExecResult], partial_credit: bool = False) -> dict[str, float]:
    """``{"passed": n, "failed": n, "timeout": n, "error": n, "crash": n, "reward": mean,
    "seconds": mean}`` for logging."""
    counts = Counter(r.status for r in results)
    out: dict[str, float] = {s: float(counts.get(s, 0)) for s in STATUSES}
    n = max(len(results), 1)
    out["reward"] = sum(r.reward(partial_credit) for r in results) / n
    out["seconds"] = sum(r.seconds for r in results) / n
    return out
