"""Two-turn self-correction episodes: the prompts each model sees, and the transition statistics.

An episode: the policy answers the task (turn 1); the guidance model reads the task and
that answer and writes a hint; the policy answers again given the task, its first answer
and the hint (turn 2). Every prompt is plain text with one labelled section per piece, in
a fixed order, so a model (and a test) can tell the pieces apart::

    Problem:
    <task>

    Previous attempt:          (hint and turn-2 prompts)
    <turn-1 answer>

    Answer key:                (hint prompt, only when the guidance model is shown the key)
    <what the verifier checks against>

    Hint:                      (turn-2 prompt)
    <hint>

    Try again: ...             (turn-2 prompt: the closing instruction)
    Answer:

Pieces are stripped of surrounding blank space; nothing else is changed (a piece that
itself contains "Hint:" is not escaped: the section order still tells them apart).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

PROBLEM = "Problem:"
PREVIOUS = "Previous attempt:"
HINT = "Hint:"
TRY_AGAIN = "Try again:"
ANSWER = "Answer:"
KEY = "Answer key:"

HINT_INSTRUCTION = "Write a hint (not the answer)."
RETRY_INSTRUCTION = "correct any mistake."
"""Both instructions are kept short: on the tiny CPU policies every prompt byte costs compute."""


def _section(label: str, text: str) -> str:
    return f"{label}\n{text.strip()}"


def turn1_prompt(task_prompt: str) -> str:
    """What the policy sees for its first answer."""
    return f"{_section(PROBLEM, task_prompt)}\n\n{ANSWER}\n"


def hint_prompt(task_prompt: str, turn1_text: str, key: str | None = None) -> str:
    """What the guidance model sees: the task and the policy's first answer, and the answer key
    when one is given (a teacher that knows the solution but must not state it)."""
    key_section = "" if key is None else f"{_section(KEY, key)}\n\n"
    return (f"{_section(PROBLEM, task_prompt)}\n\n{_section(PREVIOUS, turn1_text)}\n\n{key_section}"
            f"{HINT_INSTRUCTION}\n{HINT}\n")


def turn2_prompt(task_prompt: str, turn1_text: str, hint_text: str) -> str:
    """What the policy sees for its second answer: task, first answer, hint, instruction."""
    return (f"{_section(PROBLEM, task_prompt)}\n\n{_section(PREVIOUS, turn1_text)}\n\n"
            f"{_section(HINT, hint_text)}\n\n{TRY_AGAIN} {RETRY_INSTRUCTION}\n{ANSWER}\n")


@dataclass
class Episode:
    """One finished two-turn episode."""

    task_index: int
    turn1: str
    hint: str
    turn2: str
    r1: float
    """Verifier reward of turn 1 (1 correct, 0 wrong)."""
    r2: float
    """Verifier reward of turn 2."""

    @property
    def improvement(self) -> float:
        """``r2 - r1``: what the hint and the second try gained (the guidance model's reward)."""
        return self.r2 - self.r1


def transition_stats(r1: Sequence[float], r2: Sequence[float], threshold: float = 0.5) -> dict[str, float]:
    """SCoRe's self-correction metrics over paired turn-1 / turn-2 rewards.

    A reward counts as correct when it is ``> threshold``. Returns fractions of episodes:
    ``accuracy@t1``, ``accuracy@t2``, ``delta(t1,t2)`` (= accuracy@t2 - accuracy@t1),
    ``incorrect_to_correct`` and ``correct_to_incorrect`` (so
    ``delta = incorrect_to_correct - correct_to_incorrect``), and ``episodes``.
    """
    r1, r2 = [float(x) for x in r1], [float(x) for x in r2]
    if len(r1) != len(r2):
        raise ValueError(f"transition_stats needs paired rewards, got {len(r1)} and {len(r2)}")
    if not r1:
        raise ValueError("transition_stats needs at least one episode")
    n = len(r1)
    c1 = [x > threshold for x in r1]
    c2 = [x > threshold for x in r2]
    acc1, acc2 = sum(c1) / n, sum(c2) / n
    return {
        "accuracy@t1": acc1,
        "accuracy@t2": acc2,
        "delta(t1,t2)": acc2 - acc1,
        "incorrect_to_correct": sum((not a) and b for a, b in zip(c1, c2)) / n,
        "correct_to_incorrect": sum(a and (not b) for a, b in zip(c1, c2)) / n,
        "episodes": float(n),
    }


def episode_stats(episodes: Iterable[Episode], threshold: float = 0.5) -> dict[str, float]:
    """``transition_stats`` of a list of episodes."""
    episodes = list(episodes)
    return transition_stats([e.r1 for e in episodes], [e.r2 for e in episodes], threshold)
