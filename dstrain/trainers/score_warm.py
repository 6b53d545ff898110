"""SCoRe's supervised warm start: the episode's prompt formats, taught before RL.

A policy that never saw a turn-2 prompt (task, previous attempt, hint) answers it with
noise, and a guidance model that never saw a hint prompt writes noise, so both learn the
formats first (``policy_rl.warm_start`` on re-prompted copies of the training tasks):

* policy: the reference answer after the turn-1 prompt, and after turn-2 prompts whose
  previous attempt is the reference (hint: it is correct) or a corrupted copy (hint: it is
  wrong; for maths, whether it is too high or too low);
* guidance: that verdict after the hint prompt.

So at step 0 the guidance model is a (weak) verifier and turn 2 can keep a right first
answer and retry a wrong one; RL then trains both on the verifiers' rewards.
"""
from __future__ import annotations

import dataclasses
import random

from dstrain.rl import episode

CORRECT = "The previous attempt is correct."
WRONG = "The previous attempt is wrong."
TOO_HIGH = "The previous answer is too high."
TOO_LOW = "The previous answer is too low."


def corrupt(text: str, rng: random.Random) -> str:
    """A wrong variant of ``text``: one digit changed (``+ 1`` appended when it has none)."""
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    if not digits:
        return text + " + 1"
    i = rng.choice(digits)
    new = rng.choice([d for d in "0123456789" if d != text[i]])
    return text[:i] + new + text[i + 1:]


def verdict(task, previous: str) -> str:
    """The warm-start hint for ``previous`` (a reference answer or a corrupted one)."""
    if previous == task.reference:
        return CORRECT
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


def _previous(task, rng: random.Random) -> str:
    return task.reference if rng.random() < 0.5 else corrupt(task.reference, rng)


def policy_examples(tasks: list, seed: int) -> list:
    """Re-prompted copies of ``tasks`` teaching the policy both turns (reference answers)."""
    rng = random.Random(f"score-warm-policy-{seed}")
    out = []
    for t in tasks:
        out.append(dataclasses.replace(t, prompt=episode.turn1_prompt(t.prompt)))
        prev = _previous(t, rng)
        out.append(dataclasses.replace(t, prompt=episode.turn2_prompt(t.prompt, prev, verdict(t, prev))))
    return out


def guidance_examples(tasks: list, seed: int) -> list:
    """Copies of ``tasks`` whose prompt is the hint prompt and whose reference is the verdict."""
    rng = random.Random(f"score-warm-guidance-{seed}")
    out = []
    for t in tasks:
        for _ in range(2):
            prev = _previous(t, rng)
            out.append(dataclasses.replace(t, prompt=episode.hint_prompt(t.prompt, prev),
                                           reference=verdict(t, prev), stop=HINT_STOP))
    return out


HINT_STOP = ("\n",)
"""A hint is one line: generation stops at the first newline."""
