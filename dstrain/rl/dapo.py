"""DAPO's sampling-side pieces, as pure functions tested against hand computation.

* :func:`overlong_penalty` - the soft overlong punishment added to a completion's
  reward: 0 up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at
  ``max_len`` (and ``-factor`` beyond).
* :func:`informative_groups` - which groups of ``G`` consecutive rewards have a spread
  (a group whose rewards all agree has advantage 0 and teaches nothing).
* :func:`refill_prompts` - the task indices of a refill round of dynamic sampling: a
  pure function of (seed, step, round, rank) and the prompts left out, so a resumed run
  draws the same ones.
* :class:`PromptRest` - prompts whose latest group was all right or all wrong rest for a
  number of steps (``task.dynamic_sampling_rest_steps``): fewer groups are generated only
  to be dropped.
* :class:`GroupFiller` - one rank's bookkeeping while dynamic sampling fills its share
  of the batch with informative groups, round after round.
* :func:`groups_for_target` - how many groups to sample so that, with each group
  informative with probability ``p``, at least ``needed`` are informative with
  probability ``target`` (the binomial tail, summed in log space); what sizes a round so that one
  batched generation call usually fills the share.
* :func:`groups_for_cost` - the round size that minimises the expected sampling time when a
  further round has a fixed cost (sequential decoding, a sandbox pass, a synchronisation).
* :class:`KeepRate` - the running estimate of ``p`` across steps (kept in checkpoints).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment of completions of ``lengths`` tokens (float tensor).

    ``R(L) = 0`` for ``L <= max_len - buffer``; ``((max_len - buffer) - L) / buffer * factor``
    for ``max_len - buffer < L <= max_len``; ``-factor`` for ``L > max_len``.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"the overlong buffer must be within (0, max_len={max_len}], got {buffer}")
    lengths = lengths.to(torch.float64)
    start = max_len - buffer
    penalty = (start - lengths) / buffer * factor
    penalty = torch.where(lengths <= start, torch.zeros_like(penalty), penalty)
    penalty = torch.where(lengths > max_len, torch.full_like(penalty, -factor), penalty)
    return penalty.to(torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Bool ``[n_groups]``: True where the group's rewards are not all equal."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    groups = rewards.view(-1, group_size)
    return groups.max(dim=1).values != groups.min(dim=1).values


def refill_prompts(n_tasks: int, step: int, round_: int, rank: int, count: int, seed: int,
                   exclude: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """``count`` task indices for refill round ``round_`` of ``step`` on ``rank`` (round 0: the
    first round's oversampling; -1: replacements for resting regular prompts), drawn with a
    generator seeded by all four from the tasks not in ``exclude`` (from all tasks when that
    leaves none); distinct while ``count`` does not exceed the tasks drawn from."""
    rng = random.Random(((seed * 1_000_003 + step) * 8191 + round_) * 131 + rank)
    pool = [i for i in range(n_tasks) if i not in exclude] if exclude else range(n_tasks)
    if not pool:
        pool = range(n_tasks)
    out: list[int] = []
    while len(out) < count:
        out.extend(rng.sample(pool, min(len(pool), count - len(out))))
    return out


@dataclass
class PromptRest:
    """Prompts whose latest group had rewards that all agree rest for ``steps`` steps.

    A group all right or all wrong at step ``s`` keeps its prompt out of the draws of steps
    ``s + 1 .. s + steps``; an informative group ends the prompt's rest. ``until`` maps a task
    index to the first step it may be drawn again. :meth:`record` is fed every rank's groups of
    a step in the same order, so the state is the same on every rank (and goes into checkpoints).
    """

    steps: int
    until: dict[int, int] = field(default_factory=dict)

    def resting(self, step: int) -> frozenset[int]:
        """Task indices not to draw at ``step``."""
        return frozenset(t for t, first in self.until.items() if first > step)

    def record(self, step: int, outcomes: list[tuple[int, bool]]) -> None:
        """``outcomes``: (task index, informative) of every group of ``step``, in a fixed order
        (the last one of a task decides)."""
        for task, informative in outcomes:
            if informative:
                self.until.pop(task, None)
            else:
                self.until[task] = step + 1 + self.steps
        self.until = {t: first for t, first in self.until.items() if first > step + 1}

    def state(self) -> list[list[int]]:
        return sorted([t, first] for t, first in self.until.items())

    @classmethod
    def from_state(cls, steps: int, state: list) -> "PromptRest":
        return cls(steps, {int(t): int(first) for t, first in state})


@dataclass
class GroupFiller:
    """Collects informative groups until ``needed`` are kept.

    :meth:`add` takes one round's groups (rewards ``[k * G]`` and any per-sample items)
    and keeps the informative ones, first come first kept, up to ``needed``; the others
    are counted as dropped (the first ``needed * G`` dropped samples are remembered as
    fillers: rows that pad a short batch with zero weight). Informative groups beyond
    ``needed`` are surplus; the first ``carry_limit`` of them are kept as spare (for the
    next step: ``task.dynamic_sampling_carry``). :meth:`add_carried` takes one group kept
    from the previous step (counted as carried, not as generated).
    """

    needed: int
    group_size: int
    carry_limit: int = 0
    kept_rewards: list = field(default_factory=list)
    kept_items: list = field(default_factory=list)
    filler_items: list = field(default_factory=list)
    spare_rewards: list = field(default_factory=list)
    spare_items: list = field(default_factory=list)
    generated: int = 0
    dropped: int = 0
    surplus: int = 0
    carried: int = 0
    rounds: int = 0

    @property
    def kept(self) -> int:
        return len(self.kept_rewards) // self.group_size

    @property
    def deficit(self) -> int:
        return self.needed - self.kept

    def add(self, rewards: torch.Tensor, items: list) -> list[bool]:
        """Take one round's groups; returns which of them were informative."""
        G = self.group_size
        if len(items) != rewards.numel():
            raise ValueError(f"GroupFiller.add got {rewards.numel()} rewards but {len(items)} items")
        self.rounds += 1
        keep = informative_groups(rewards, G).tolist() if rewards.numel() else []
        for g, ok in enumerate(keep):
            self.generated += 1
            rows = slice(g * G, (g + 1) * G)
            if ok and self.deficit > 0:
                self.kept_rewards.extend(rewards[rows].tolist())
                self.kept_items.extend(items[rows])
            elif ok:
                self.surplus += 1  # informative but not needed: the batch is full
                if len(self.spare_items) < self.carry_limit * G:
                    self.spare_rewards.extend(rewards[rows].tolist())
                    self.spare_items.extend(items[rows])
            else:
                self.dropped += 1
                if len(self.filler_items) < self.needed * G:
                    self.filler_items.extend(items[rows])
        return keep

    def add_carried(self, rewards: list[float], items: list) -> None:
        """Keep one informative group of the previous step (``G`` rewards and items)."""
        if self.deficit <= 0:
            raise ValueError("GroupFiller.add_carried: the share is already full")
        if len(rewards) != self.group_size or len(items) != self.group_size:
            raise ValueError(f"GroupFiller.add_carried takes one group of {self.group_size}, "
                             f"got {len(rewards)} rewards and {len(items)} items")
        self.kept_rewards.extend(rewards)
        self.kept_items.extend(items)
        self.carried += 1

    def next_count(self) -> int:
        """Groups to sample in the next round: the deficit divided by the fraction kept so
        far (at least 10%), at most ``needed`` (the memory of one share)."""
        if self.deficit <= 0:
            return 0
        rate = max((self.generated - self.dropped) / max(self.generated, 1), 0.1)
        return min(self.needed, math.ceil(self.deficit / rate))

    def stats(self) -> dict[str, float]:
        out = {"dropped_fraction": self.dropped / max(self.generated, 1), "rounds": float(self.rounds),
               "filled_fraction": self.kept / max(self.needed, 1), "generated_groups": float(self.generated),
               "surplus_groups": float(self.surplus)}
        if self.carry_limit or self.carried:
            out.update(carried_groups=float(self.carried), spare_groups=float(len(self.spare_items) // self.group_size))
        return out


def binomial_at_least(n: int, p: float, k: int) -> float:
    """P(Binomial(n, p) >= k), summed term by term in log space.

    Each term ``C(n, i) p^i (1 - p)^(n - i)`` is formed as ``exp(log C(n, i) + i log p + ...)``
    relative to the largest term (relative error below 1e-13 for tens of groups, about 1e-12 at
    thousands): the plain product raised OverflowError once ``C(n, i)`` passed the float range,
    at n of about 1030 (e.g. a rank's share of 600 prompts with 2x oversampling).
    """
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    logs = [log_n - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
            for i in range(k, n + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * math.fsum(math.exp(x - top) for x in logs))


def groups_for_target(needed: int, p: float, target: float, cap: int) -> int:
    """The fewest groups ``n`` (``needed <= n <= cap``) with ``P(Binomial(n, p) >= needed) >= target``;
    ``cap`` when even that many fall short (a later round makes up the rest). ``needed <= 0``: 0."""
    if needed <= 0:
        return 0
    cap = max(cap, needed)
    p = min(max(p, 0.0), 1.0)
    for n in range(needed, cap + 1):
        if binomial_at_least(n, p, needed) >= target:
            return n
    return cap


def groups_for_cost(needed: int, p: float, round_cost: float, cap: int) -> int:
    """The round size ``n`` (``needed <= n <= cap``) of least expected sampling cost, in units of one
    group's generation and verification: ``n + P(fewer than needed informative) x (round_cost + m)``,
    where a refill round costs ``round_cost`` (its fixed part: decoding steps run one after another
    whatever the batch, a sandbox pass, a synchronisation) plus ``m = ceil(needed / p)`` groups (a
    refill sized for the whole deficit: an upper estimate). ``needed <= 0``: 0; ties: the smaller."""
    if needed <= 0:
        return 0
    cap = max(cap, needed)
    p = min(max(p, 1e-6), 1.0)
    refill = round_cost + math.ceil(needed / p)
    costs = [(n + (1.0 - binomial_at_least(n, p, needed)) * refill, n) for n in range(needed, cap + 1)]
    return min(costs)[1]


@dataclass
class KeepRate:
    """Running estimate of the fraction of groups that are informative (not zero-variance).

    ``rate`` starts at ``initial`` and after each step moves ``weight`` of the way to that
    step's observed fraction (an exponential moving average over steps, so it follows the
    policy as its pass rates drift). Never below ``floor``: a step that kept nothing must
    not make the next one sample without bound (the round cap bounds it too)."""

    rate: float = 1.0
    weight: float = 0.3
    floor: float = 0.05

    def update(self, informative: float, generated: float) -> float:
        if generated > 0:
            observed = informative / generated
            self.rate = max(self.floor, (1.0 - self.weight) * self.rate + self.weight * observed)
        return self.rate
