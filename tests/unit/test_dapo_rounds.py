"""Dynamic sampling's round sizing: the binomial tail by hand, the running estimate of the
informative fraction, and a fake policy on which one batched round usually fills the share."""
from __future__ import annotations

import math

import pytest
import torch

from dstrain.rl import dapo
from dstrain.trainers import grpo_sampling as gs
from dstrain.trainers.grpo_config import PolicyTaskConfig
from tests.unit.test_grpo_dapo import fake_trainer


def test_binomial_tail_by_hand():
    assert dapo.binomial_at_least(4, 0.5, 2) == pytest.approx(11 / 16)  # 1 - (1 + 4) / 16
    assert dapo.binomial_at_least(5, 0.6, 2) == pytest.approx(1 - 0.4 ** 5 - 5 * 0.6 * 0.4 ** 4)
    assert dapo.binomial_at_least(3, 0.2, 0) == 1.0 and dapo.binomial_at_least(2, 0.9, 3) == 0.0


def test_groups_for_target_is_the_fewest_that_reach_it():
    # needed 2, p 0.6: n = 4 gives 0.8208, n = 5 gives 0.91296 -> 5 for a target of 0.9
    assert dapo.groups_for_target(2, 0.6, 0.9, cap=10) == 5
    assert dapo.groups_for_target(2, 0.6, 0.8, cap=10) == 4
    assert dapo.groups_for_target(3, 1.0, 0.99, cap=10) == 3  # every group informative: no extra
    assert dapo.groups_for_target(2, 0.1, 0.9, cap=6) == 6  # out of reach: the cap
    assert dapo.groups_for_target(0, 0.5, 0.9, cap=6) == 0
    for needed, p, target in [(1, 0.3, 0.9), (4, 0.5, 0.95), (2, 0.75, 0.5)]:
        n = dapo.groups_for_target(needed, p, target, cap=100)
        assert dapo.binomial_at_least(n, p, needed) >= target > dapo.binomial_at_least(n - 1, p, needed)


def test_groups_for_cost_by_hand():
    # deficit 2, p 0.6, a round costs 2 groups: a refill costs 2 + ceil(2 / 0.6) = 6
    # n = 2: 2 + 0.64 x 6 = 5.84; n = 3: 3 + 0.352 x 6 = 5.112; n = 4: 4 + 0.1792 x 6 = 5.075; n = 5: 5.52
    assert dapo.groups_for_cost(2, 0.6, round_cost=2.0, cap=10) == 4
    # free rounds: never oversample; very dear rounds: sample until a miss is (nearly) impossible
    assert dapo.groups_for_cost(2, 0.6, round_cost=0.0, cap=10) == 3  # 3 + 0.352 x 4 = 4.41 < 2 + 0.64 x 4
    # a refill at 104: n = 7 costs 7 + 0.01884 x 104 = 8.96, n = 8: 8 + 0.00852 x 104 = 8.89, n = 9: 9.40
    assert dapo.groups_for_cost(2, 0.6, round_cost=100.0, cap=10) == 8
    assert dapo.groups_for_cost(3, 1.0, round_cost=5.0, cap=10) == 3
    assert dapo.groups_for_cost(0, 0.5, round_cost=5.0, cap=10) == 0
    for needed, p, c in [(1, 0.3, 2.0), (4, 0.5, 3.0), (8, 0.75, 1.0)]:
        n = dapo.groups_for_cost(needed, p, c, cap=60)
        refill = c + math.ceil(needed / p)
        cost = lambda k: k + (1 - dapo.binomial_at_least(k, p, needed)) * refill  # noqa: E731
        assert all(cost(n) <= cost(k) + 1e-12 for k in range(needed, 61))


def test_keep_rate_is_a_moving_average_with_a_floor():
    k = dapo.KeepRate(rate=1.0, weight=0.3, floor=0.05)
    assert k.update(2, 4) == pytest.approx(0.7 * 1.0 + 0.3 * 0.5)
    assert k.update(0, 0) == pytest.approx(0.85)  # nothing generated: unchanged
    for _ in range(50):
        k.update(0, 8)
    assert k.rate == 0.05


def test_round_size_uses_the_estimate_then_what_the_step_has_seen():
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_oversample=2.0,
                            dynamic_sampling_sizing="target")
    f = dapo.GroupFiller(needed=4, group_size=4)
    assert gs.round_size(task, f, estimate=1.0) == 4
    assert gs.round_size(task, f, estimate=0.5) == dapo.groups_for_target(4, 0.5, 0.9, 12)
    f.add(torch.tensor([1.0, 0, 0, 0] * 2 + [1.0] * 8), list(range(16)))  # 2 kept, 2 dropped
    p = (gs.PRIOR_GROUPS * 0.9 + 2) / (gs.PRIOR_GROUPS + 4)
    assert gs.round_size(task, f, estimate=0.9) == dapo.groups_for_target(2, p, 0.9, 12)
    fixed = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_oversample=0.5,
                             dynamic_sampling_sizing="fixed")
    assert gs.round_size(fixed, dapo.GroupFiller(needed=4, group_size=4), estimate=0.1) == 4 + 2
    assert gs.round_size(fixed, f, estimate=0.1) == f.next_count()
    cost = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_round_cost=3.0)
    assert cost.dynamic_sampling_sizing == "cost"
    assert gs.round_size(cost, f, estimate=0.9) == dapo.groups_for_cost(2, p, 3.0, 12)


def test_one_batched_round_usually_fills_the_share_once_the_rate_is_learnt(monkeypatch):
    """A third of the prompts give informative groups: the first step needs refills, later ones
    sample enough in round 0 (one generation call) and the estimate settles near 1/3."""
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_rounds=4,
                            dynamic_sampling_max_oversample=4.0, dynamic_sampling_sizing="target")
    kinds = ["easy", "hard", "mixed"] * 40
    tr = fake_trainer(kinds, task, local_samples=16, monkeypatch=monkeypatch)
    rounds = []
    for step in range(12):
        tr.rl.calls.clear()
        sb = gs.dynamic_batch(tr, step)
        assert sb.log["trained_zero_variance_groups"] == 0.0
        rounds.append(int(sb.log["dynamic/rounds"]))
        assert len(tr.rl.calls) == rounds[-1]
    assert rounds[0] >= 2
    assert sum(r == 1 for r in rounds[4:]) >= 6, rounds  # target 0.9: most later steps need one round
    assert tr.keep_rate.rate == pytest.approx(1 / 3, abs=0.12)
    needed = 4
    assert sb.log["dynamic/round0_groups"] <= math.floor(5.0 * needed)


def test_cost_sizing_needs_fewer_rounds_than_fixed_sizing(monkeypatch):
    """Same prompts and fake policy: sizing rounds from the estimate takes fewer generation calls than
    the fixed rule (share first, then deficit / rate), and no trained group is zero-variance."""
    kinds = ["easy", "hard", "mixed"] * 40
    rounds = {}
    for sizing in ("fixed", "cost"):
        task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_rounds=6,
                                dynamic_sampling_sizing=sizing)
        tr = fake_trainer(kinds, task, local_samples=16, monkeypatch=monkeypatch)
        for step in range(12):
            sb = gs.dynamic_batch(tr, step)
            assert sb.log["trained_zero_variance_groups"] == 0.0
        rounds[sizing] = len(tr.rl.calls)
    assert rounds["cost"] < rounds["fixed"], rounds


def test_the_running_estimate_goes_into_the_checkpoint_state():
    import types

    from dstrain.trainers.grpo import GRPOTrainer
    saved = {}
    fake = types.SimpleNamespace(samples_per_step=32, guards=types.SimpleNamespace(skipped=0), keep_rate=None,
                                 saver=types.SimpleNamespace(save=lambda step, state: saved.update(state, step=step)))
    GRPOTrainer.save(fake, 5)
    assert "dynamic_keep_rate" not in saved and saved["step"] == 5
    fake.keep_rate = dapo.KeepRate(rate=0.42)
    GRPOTrainer.save(fake, 6)
    assert saved["dynamic_keep_rate"] == 0.42 and saved["step"] == 6
