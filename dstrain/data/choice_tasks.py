"""Two-choice arithmetic: a generated task family where a first answer is often wrong and a hint fixes it.

``"Question: What is 47 + 38: 75 or 85?\\nAnswer: "`` -> ``"#### 85"``. The distractor is the
answer off by a slip a child (or a tiny model) makes: a carry lost or added (+-10), or the last
digit off by one or two. A policy that cannot yet add picks one of the two numbers; a hint that
says the pick is wrong (or too high / too low) is enough to answer right the second time, and
without it the second try has nothing new to go on. Used by SCoRe's self-correction recipe;
checked by the maths verifier like ``arithmetic`` tasks.
"""
from __future__ import annotations

import re

from dstrain.data.tasks import Task, distinct_maths_tasks

SLIPS = (-10, 10, -1, 1, -2, 2)
"""How the distractor differs from the answer."""
_CHOICES = re.compile(r": (-?\d+) or (-?\d+)\?")


def make_choice_tasks(n: int, seed: int = 0) -> list[Task]:
    """``n`` distinct two-choice sum / difference questions of two-digit numbers, deterministic in ``seed``;
    the right answer is first or second at random."""
    def draw(rng):
        op = rng.choice("+-")
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        value = a + b if op == "+" else a - b
        wrong = value + rng.choice(SLIPS)
        first, second = (value, wrong) if rng.random() < 0.5 else (wrong, value)
        return f"Question: What is {a} {op} {b}: {first} or {second}?\nAnswer: ", value

    return distinct_maths_tasks(n, "choice", seed, draw)


def choices(prompt: str) -> tuple[str, str] | None:
    """The two offered answers of a choice task's prompt (None for another prompt)."""
    found = _CHOICES.search(prompt)
    return (found.group(1), found.group(2)) if found else None
