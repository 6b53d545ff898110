"""Two-choice subtraction with a one-digit answer: a generated task family where a first answer is
often wrong and a hint fixes it.

``"What is 47 - 41: 6 or 8?"`` -> ``"#### 6"``. Both operands have two digits and lie at most 9
apart, so the answer is one digit; the distractor is a slip of one or two in it (kept within 0-9).
The numbers a byte-level policy has to copy are single characters, yet choosing right takes the
subtraction, which a tiny policy does not learn in a few minutes. A policy that cannot subtract picks one of the two
digits; a hint that says the pick is wrong is enough to answer right the second time (the other
one), and without it the second try has nothing new to go on. Used by SCoRe's self-correction
recipe; checked by the maths verifier like ``arithmetic`` tasks.
"""
from __future__ import annotations

import re

from dstrain.data.tasks import Task, distinct_maths_tasks

SLIPS = (-2, -1, 1, 2)
"""How the distractor differs from the answer (the other sign when the slip leaves 0-9)."""
_CHOICES = re.compile(r": (-?\d+) or (-?\d+)\?")


def distractor(value: int, slip: int) -> int:
    """``value + slip``, or ``value - slip`` when that leaves the digits 0-9."""
    return value + slip if 0 <= value + slip <= 9 else value - slip


def make_choice_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` distinct two-choice differences of two-digit numbers with a one-digit answer,
    deterministic in ``seed``; the right answer is first or second at random."""
    def draw(rng):
        value = rng.randint(0, 9)
        b = rng.randint(10, 99 - value)
        a = b + value
        wrong = distractor(value, rng.choice(SLIPS))
        first, second = (value, wrong) if rng.random() < 0.5 else (wrong, value)
        return f"What is {a} - {b}: {first} or {second}?", value

    return distinct_maths_tasks(n, "choice", seed, draw)


def choices(prompt: str) -> tuple[str, str] | None:
    """The two offered answers of a choice task's prompt (None for another prompt)."""
    found = _CHOICES.search(prompt)
    return (found.group(1), found.group(2)) if found else None
