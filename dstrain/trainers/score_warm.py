"""SCoRe's supervised warm start: the episode's prompt formats, taught before RL.

A policy that never saw a turn-2 prompt (task, previous attempt, hint) answers it with
noise, and a guidance model that never saw a hint prompt writes noise, so both learn the
formats first (``policy_rl.warm_start`` on re-prompted copies of the training tasks):

* policy: the reference answer after the turn-1 prompt, and after turn-2 prompts whose
  previous attempt is the reference (hint: it is correct) or a corrupted copy (hint: it is
  wrong; for maths, whether it is too high or too low; for a two-choice task, just wrong),
  and after turn-2 prompts with the fixed hint of runs without a guidance model
  (``policy_examples``'s ``turn2="format"`` teaches keep-or-switch instead after a verdict);
* guidance: that verdict after the hint prompt.

So at step 0 the guidance model is a (weak) verifier and turn 2 can keep a right first
answer and retry a wrong one; RL then trains both on the verifiers' rewards.
"""
from __future__ import annotations

import dataclasses
import random

from dstrain.rl import episode

CORRECT = "Correct."
WRONG = "Wrong."
"""(A same-length pair, "Right." / "Wrong.", was learnt slower by the tiny policy: 11% of wrong first answers
fixed after 900 warm-start steps, against 47% with these two, in one run each.)"""
TOO_HIGH = "Too high."
TOO_LOW = "Too low."
NO_HINT = "Check the previous attempt."
"""The hint of every turn-2 prompt when no guidance model is used (``task.guidance: none``)."""
MATHS_SHIFTS = (-20, -10, -2, -1, 1, 2, 10, 20)
"""How a maths warm-start answer is made wrong: off by one or two in a digit, as carries go wrong."""


def answer_key(task) -> str:
    """What the verifier checks against, as the guidance model is shown it with ``task.guidance_key``:
    the tests of a code task; the final answer of a maths task, and for a two-choice task the marking
    scheme, one line per offered answer written as a turn writes it, with its verdict
    (``"#### 6 Wrong.\n#### 7 Correct."``): judging an attempt is then finding its line."""
    if task.kind != "maths":
        return "\n".join(task.tests)
    from dstrain.data.choice_tasks import choices
    offered = choices(task.prompt)
    if not offered or task.answer not in offered:
        return task.answer
    return "\n".join(f"#### {x} {CORRECT if x == task.answer else WRONG}" for x in offered)


def leaks_answer(task, hint: str) -> bool:
    """True when ``hint`` states a maths task's final answer: some number in it, read as the verifier reads
    numbers (``1,000``, ``$1000``, ``.5``, ``1/2``, a unicode minus), equals the answer."""
    if task.kind != "maths":
        return False
    from dstrain.rewards.maths import normalize_number, numbers_in
    want = normalize_number(task.answer)
    return want is not None and want in numbers_in(hint)


def corrupt(text: str, rng: random.Random) -> str:
    """A wrong variant of ``text``: one digit changed (``+ 1`` appended when it has none)."""
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    if not digits:
        return text + " + 1"
    i = rng.choice(digits)
    new = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + new + text[i + 1:]


def verdict(task, previous: str) -> str:
    """The warm-start hint for ``previous`` (a reference answer or a corrupted one): ``CORRECT``, or for
    a maths task ``TOO_HIGH`` / ``TOO_LOW`` (``WRONG`` for a two-choice task: the fix is the other choice)."""
    if previous == task.reference:
        return CORRECT
    from dstrain.data.choice_tasks import choices
    if task.kind == "maths" and choices(task.prompt):
        from dstrain.rewards.maths import extract_final_answer
        return CORRECT if extract_final_answer(previous) == task.answer else WRONG
    if task.kind == "maths":
        from dstrain.rewards.maths import extract_final_answer, normalize_number
        try:
            got = float(normalize_number(extract_final_answer(previous)) or "nan")
            want = float(normalize_number(task.answer) or "nan")
        except ValueError:
            return WRONG
        if got > want:
            return TOO_HIGH
        if got < want:
            return TOO_LOW
    return WRONG


def corrupt_maths(task, rng: random.Random) -> str:
    """A wrong final answer to a maths task whose reference ends ``#### <integer>``: the other choice
    of a two-choice task, else the answer shifted by one of ``MATHS_SHIFTS`` (``corrupt`` for other answers)."""
    from dstrain.data.choice_tasks import choices
    head = task.reference.rsplit("####", 1)[0] if "####" in task.reference else ""
    offered = choices(task.prompt)
    if offered and task.answer in offered:  # a two-choice task: the other choice
        return f"{head}#### {offered[1] if offered[0] == task.answer else offered[0]}"
    try:
        value = int(task.answer)
    except ValueError:
        return corrupt(task.reference, rng)
    return f"{head}#### {value + rng.choice(MATHS_SHIFTS)}"


def _wrong(task, rng: random.Random) -> str:
    return corrupt_maths(task, rng) if task.kind == "maths" else corrupt(task.reference, rng)


def _previous(task, rng: random.Random) -> str:
    return task.reference if rng.random() < 0.5 else _wrong(task, rng)


TURN2_MODES = ("verdict", "format")
"""What the policy's warm start teaches after a verdict hint (``task.warm_turn2``)."""


def policy_examples(tasks: list, seed: int, turn2: str = "verdict") -> list:
    """Re-prompted copies of ``tasks`` teaching the policy both turns: turn 1 (the reference), turn 2
    after the verdict hint, and turn 2 after ``NO_HINT`` (the hint of runs without a guidance model;
    the reference). One warm start thus serves runs with and without guidance: they start from the
    same weights.

    After the verdict hint, ``turn2="verdict"`` teaches the reference (the whole correction: keep a
    right first answer, fix a wrong one), ``"format"`` the previous attempt or a switch at random
    (half and half, whatever the verdict says; for a two-choice task: the other offered answer),
    so the policy learns the format and to copy, not to use the verdict: that is left to RL."""
    if turn2 not in TURN2_MODES:
        raise ValueError(f"turn2 must be one of {', '.join(TURN2_MODES)}, got {turn2!r}")
    rng = random.Random(f"score-warm-policy-{seed}")
    out = []
    for t in tasks:
        out.append(dataclasses.replace(t, prompt=episode.turn1_prompt(t.prompt)))
        prev = _previous(t, rng)
        if turn2 == "verdict":
            target = t.reference
        elif rng.random() < 0.5:
            target = prev
        else:  # the switch: to the reference from a wrong attempt, to a wrong answer from a right one
            target = t.reference if prev != t.reference else _wrong(t, rng)
        out.append(dataclasses.replace(t, prompt=episode.turn2_prompt(t.prompt, prev, verdict(t, prev)),
                                       reference=target))
        prev = _previous(t, rng)
        out.append(dataclasses.replace(t, prompt=episode.turn2_prompt(t.prompt, prev, NO_HINT)))
    return out


def guidance_examples(tasks: list, seed: int, key: bool = False) -> list:
    """Copies of ``tasks`` whose prompt is the hint prompt (with the answer key when ``key``) and
    whose reference is the verdict."""
    rng = random.Random(f"score-warm-guidance-{seed}")
    out = []
    for t in tasks:
        for _ in range(2):
            prev = _previous(t, rng)
            prompt = episode.hint_prompt(t.prompt, prev, answer_key(t) if key else None)
            out.append(dataclasses.replace(t, prompt=prompt, reference=verdict(t, prev), stop=HINT_STOP))
    return out


HINT_STOP = ("\n",)
"""A hint is one line: generation stops at the first newline."""
