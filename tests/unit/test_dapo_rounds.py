"""Dynamic sampling's round sizing: the binomial tail by hand, the running estimate of the
informative fraction, and a fake policy on which one batched round usually fills the share."""
from __future__ import annotations

import math

import pytest
import torch

from dstrain.rl import dapo
from dstrain.trainers import grpo_sampling as gs
from dstrain.trainers.grpo_config import PolicyTaskConfig
from tests.unit.test_grpo_dapo import FakeRL, fake_trainer


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
                                 window=[],
                                 prompt_rest=None,
                                 saver=types.SimpleNamespace(save=lambda step, state: saved.update(state, step=step)))
    GRPOTrainer.save(fake, 5)
    assert "dynamic_keep_rate" not in saved and saved["step"] == 5
    fake.keep_rate = dapo.KeepRate(rate=0.42)
    GRPOTrainer.save(fake, 6)
    assert saved["dynamic_keep_rate"] == 0.42 and saved["step"] == 6


# ---------------------------------------------------------------- resting prompts (task.dynamic_sampling_rest_steps)

def test_prompt_rest_by_hand():
    rest = dapo.PromptRest(steps=3)
    rest.record(10, [(4, False), (7, True), (9, False), (9, True)])  # 9: the last outcome decides
    assert rest.resting(11) == {4} and rest.resting(13) == {4} and rest.resting(14) == set()
    rest.record(12, [(4, True), (5, False)])  # an informative group ends the rest
    assert rest.resting(13) == {5} and rest.until == {5: 16}
    assert dapo.PromptRest.from_state(3, rest.state()) == rest
    rest.record(20, [])  # nothing resting any more: the table is emptied
    assert rest.until == {}


def test_refill_prompts_leave_out_the_excluded_and_keep_the_old_draws():
    assert dapo.refill_prompts(50, 3, 1, 0, 10, 7, frozenset()) == dapo.refill_prompts(50, 3, 1, 0, 10, 7)
    out = dapo.refill_prompts(20, 3, 1, 0, 15, 7, exclude={0, 1, 2, 3, 4, 5})
    assert not set(out) & {0, 1, 2, 3, 4, 5} and len(out) == 15 and len(set(out)) == 14  # 14 left: wraps once
    assert len(dapo.refill_prompts(3, 0, 0, 0, 2, 7, exclude={0, 1, 2})) == 2  # all excluded: all allowed


class RecordingRL(FakeRL):
    """FakeRL that also keeps the prompts of every generation call."""

    def __init__(self):
        super().__init__()
        self.prompts = []

    def generate(self, model, tok, prompts, **kw):
        self.prompts.extend(prompts)
        return super().generate(model, tok, prompts, **kw)


def _run(monkeypatch, rest_steps: int, steps: int = 16):
    """(groups generated per group trained, prompts drawn at each step, resting set before each step, trainer)."""
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_rounds=6,
                            dynamic_sampling_rest_steps=rest_steps)
    tr = fake_trainer(["easy", "hard", "mixed"] * 8, task, local_samples=16, monkeypatch=monkeypatch)
    tr.rl = RecordingRL()
    generated, trained, drawn, resting = 0, 0.0, [], []
    for step in range(steps):
        resting.append(tr.prompt_rest.resting(step) if getattr(tr, "prompt_rest", None) else frozenset())
        tr.rl.calls.clear()
        tr.rl.prompts.clear()
        sb = gs.dynamic_batch(tr, step)
        assert sb.log["trained_zero_variance_groups"] == 0.0
        drawn.append({int(p.split()[1]) for p in tr.rl.prompts})
        generated += sum(tr.rl.calls) // 4
        trained += 4 * sb.log["dynamic/filled_fraction"]
    return generated / trained, drawn, resting, tr


def test_resting_prompts_cut_the_groups_generated_only_to_be_dropped(monkeypatch):
    """'easy' and 'hard' prompts always give groups that agree: once seen they rest (here for longer
    than the run), no step draws a resting prompt, and fewer groups are generated per group trained."""
    plain, drawn_plain, _, _ = _run(monkeypatch, rest_steps=0)
    rested, drawn, resting, tr = _run(monkeypatch, rest_steps=100)
    assert rested < 0.8 * plain, (rested, plain)
    assert tr.keep_rate.rate > 0.6  # most groups drawn are informative
    for step, (d, r) in enumerate(zip(drawn, resting)):
        assert not d & r, (step, d & r)
    agreeing = {i for d in drawn for i in d if i % 3 != 2}  # every easy or hard prompt drawn rests
    assert tr.prompt_rest.resting(16) == agreeing and agreeing
    assert any(d & r for d, r in zip(drawn_plain, resting))  # without the rest, those prompts come back


def test_rest_steps_need_dynamic_sampling_and_go_into_the_checkpoint_state():
    import types

    from dstrain.trainers.grpo import GRPOTrainer
    with pytest.raises(ValueError, match="dynamic_sampling_rest_steps needs task.dynamic_sampling"):
        PolicyTaskConfig(dynamic_sampling_rest_steps=5)
    with pytest.raises(ValueError, match="dynamic_sampling_rest_steps must not be negative"):
        PolicyTaskConfig(dynamic_sampling=True, dynamic_sampling_rest_steps=-1)
    saved = {}
    fake = types.SimpleNamespace(samples_per_step=32, guards=types.SimpleNamespace(skipped=0), keep_rate=None,
                                 window=[],
                                 prompt_rest=dapo.PromptRest(5, {3: 12}),
                                 saver=types.SimpleNamespace(save=lambda step, state: saved.update(state, step=step)))
    GRPOTrainer.save(fake, 7)
    assert saved["dynamic_prompt_rest"] == [[3, 12]]
    assert dapo.PromptRest.from_state(5, saved["dynamic_prompt_rest"]) == dapo.PromptRest(5, {3: 12})
