"""SCoRe's numbers (Kumar et al., 2024) against plain-loop float64 computations of the definitions:
stage I / II shaped rewards (bonus alpha (r2 - r1) on the second attempt), the per-turn policy
gradient and k3 KL terms with their coefficients (stage I: beta2 on turn 1), the two-turn TD
targets, and group-normalised advantages."""
from __future__ import annotations

import math

import pytest
import torch

from dstrain.rl import score_math as sm


def _turn(B, T, seed, zero_row=None):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    if zero_row is not None:
        mask[zero_row] = 0
    return sm.TurnBatch(logp, old, ref, mask)


def _ref_terms(turn, adv, clip):
    """(pg, kl) of one turn: per-sequence token means, then the batch mean."""
    B, T = turn.logp.shape
    pg = kl = 0.0
    for i in range(B):
        n = float(turn.mask[i].sum())
        sp = sk = 0.0
        for t in range(T):
            if turn.mask[i, t] == 0:
                continue
            ratio = torch.exp(turn.logp[i, t] - turn.old_logp[i, t])
            obj = ratio * adv[i]
            if clip is not None:
                obj = torch.minimum(obj, torch.clamp(ratio, 1 - clip, 1 + clip) * adv[i])
            d = turn.ref_logp[i, t] - turn.logp[i, t]
            sp = sp - obj
            sk = sk + torch.exp(d) - d - 1
        pg = pg + sp / max(n, 1.0)
        kl = kl + sk / max(n, 1.0)
    return pg / B, kl / B


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_objective_equals_the_definition(stage, clip):
    B, T = 5, 7
    t1, t2 = _turn(B, T, 1, zero_row=3), _turn(B, T, 2)
    adv1 = torch.randn(B, dtype=torch.float64)
    adv2 = torch.randn(B, dtype=torch.float64)
    beta1, beta2 = 0.01, 0.1
    loss, stats = sm.score_objective(t1, t2, adv1, adv2, stage, beta1=beta1, beta2=beta2, clip_eps=clip)
    pg1, kl1 = _ref_terms(t1, adv1, clip)
    pg2, kl2 = _ref_terms(t2, adv2, clip)
    expect = pg2 + beta2 * kl1 + beta1 * kl2 if stage == 1 else pg1 + pg2 + beta1 * (kl1 + kl2)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-6)  # advantages are taken in float32
    for a in (t1.logp, t2.logp):
        got, = torch.autograd.grad(loss, a, retain_graph=True)
        want, = torch.autograd.grad(expect, a, retain_graph=True)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-9)
    assert stats["kl_turn1"] == pytest.approx(kl1.item(), rel=1e-6)


def test_shaped_rewards_and_two_turn_returns():
    r1 = torch.tensor([0.0, 1.0, 0.0, 1.0])
    r2 = torch.tensor([0.0, 0.0, 1.0, 1.0])
    alpha = 10.0
    R1, R2 = sm.shaped_rewards(r1, r2, stage=1, alpha=alpha)
    assert R1.tolist() == [0, 0, 0, 0] and R2.tolist() == r2.tolist()
    R1, R2 = sm.shaped_rewards(r1, r2, stage=2, alpha=alpha)
    assert R1.tolist() == r1.tolist()
    assert R2.tolist() == [b + alpha * (b - a) for a, b in zip(r1.tolist(), r2.tolist())]  # [0, -10, 11, 1]
    v_s2 = torch.tensor([0.3, -0.2, 0.5, 0.9])
    for gamma in (1.0, 0.5, 0.0):
        q1, q2 = sm.episode_critic_targets(R1, R2, v_s2, gamma)
        assert torch.allclose(q1, R1 + gamma * v_s2) and torch.equal(q2, R2)


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_equal_the_definition_and_flat_groups_are_zero(scale):
    rewards = [0.1] * 8 + [0.0, 1.0, 1.0, 0.0, 0.5, 0.25, 0.75, 1.0] + [2 / 3] * 8
    got = sm.group_advantages(torch.tensor(rewards), 8, scale=scale).double()
    for g in range(3):
        grp = [float(torch.tensor(r, dtype=torch.float32)) for r in rewards[8 * g:8 * g + 8]]
        mean = sum(grp) / 8
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / 7)
        for j, r in enumerate(grp):
            expect = 0.0 if std == 0 else ((r - mean) / (std + 1e-4) if scale else r - mean)
            assert got[8 * g + j].item() == pytest.approx(expect, rel=1e-6, abs=0 if std == 0 else 1e-7)
