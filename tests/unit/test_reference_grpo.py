"""GRPO's numbers against an independent float64 computation written from the definitions
(DeepSeekMath's GRPO, DAPO's token-level loss, Dr. GRPO, TRL's ``loss_type`` / ``scale_rewards``
conventions): group advantages with the unbiased std, the clipped surrogate with
``epsilon_low`` / ``epsilon_high``, the k3 KL, every aggregation, and the step's loss and gradient
when the batch is split over micro-batches and ranks as DeepSpeed reduces them."""
from __future__ import annotations

import math

import pytest
import torch

from dstrain.rl import grpo_math as gm
from tests.unit.test_grpo_dapo import fake_step_trainer

EPS = 1e-4  # TRL's epsilon under the std


# ---------------------------------------------------------------- references (plain loops, float64)

def ref_advantages(rewards: list[float], G: int, scale: bool) -> list[float]:
    out = []
    for g in range(0, len(rewards), G):
        grp = [float(r) for r in rewards[g:g + G]]
        mean = sum(grp) / G
        if max(grp) == min(grp):
            out += [0.0] * G
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (G - 1))  # torch.std: Bessel-corrected
        out += [(r - mean) / (std + EPS) if scale else r - mean for r in grp]
    return out


def ref_per_token(logp, old, ref, adv, eps_low, eps_high, beta):
    """[B][T] per-token losses as Python floats (torch only for the autograd of logp)."""
    B, T = logp.shape
    rows = []
    for i in range(B):
        row = []
        for t in range(T):
            ratio = torch.exp(logp[i, t] - old[i, t])
            clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
            obj = torch.minimum(ratio * adv[i], clipped * adv[i])
            loss = -obj
            if beta:
                d = ref[i, t] - logp[i, t]
                loss = loss + beta * (torch.exp(d) - d - 1)
            row.append(loss)
        rows.append(row)
    return rows


def ref_aggregate(rows, mask, loss_type, max_len):
    B = len(rows)
    if loss_type == "grpo":
        total = 0.0
        for i in range(B):
            n = sum(float(m) for m in mask[i])
            s = sum(rows[i][t] * mask[i][t] for t in range(len(rows[i])))
            total = total + s / max(n, 1.0)
        return total / B
    s = sum(rows[i][t] * mask[i][t] for i in range(B) for t in range(len(rows[i])))
    if loss_type in ("bnpo", "dapo"):
        return s / max(float(mask.sum()), 1.0)
    if loss_type == "dr_grpo":
        return s / (B * max_len)
    raise ValueError(loss_type)


def _inputs(B, T, seed=0, zero_rows=()):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios well outside [0.8, 1.28]
    ref = logp.detach() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.35).to(torch.float64)
    for r in zero_rows:
        mask[r] = 0.0  # a zero-length completion
    return logp, old, ref, adv, mask


# ---------------------------------------------------------------- advantages

@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_equal_the_definition(scale):
    g = torch.Generator().manual_seed(3)
    cases = [
        (torch.rand(24, generator=g).tolist(), 4),                     # random
        ([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0], 4),               # binary; second group all-equal
        ([0.1] * 8 + [0.7] * 8 + [0.2, 0.2, 0.9, 0.9, 0.2, 0.2, 0.9, 0.9], 8),  # float ties, equal groups
        ([1 / 3, 2 / 3, 1 / 3], 3),                                   # ties inside a group
        ([0.5, -0.25], 2),
    ]
    for rewards, G in cases:
        got = gm.group_advantages(torch.tensor(rewards), G, scale=scale).double()
        ref = torch.tensor(ref_advantages([float(torch.tensor(r, dtype=torch.float32)) for r in rewards], G, scale),
                           dtype=torch.float64)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6), (rewards, got, ref)


def test_a_group_without_spread_has_exactly_zero_advantage():
    # float32's mean of eight 0.1s is an ulp off 0.1: that ulp / (std + eps) was up to 6e-4 of advantage
    for x in (0.1, 0.2, 0.3, 2 / 3, 0.9, -0.35):
        for G in (2, 3, 7, 8, 16):
            assert torch.equal(gm.group_advantages(torch.full((G,), x), G), torch.zeros(G))
    assert gm.zero_variance_fraction(torch.tensor([0.1] * 8 + [0.1, 0.2] * 4), 8) == 0.5


def test_single_sample_groups_have_zero_advantage_not_nan():
    adv = gm.group_advantages(torch.tensor([0.3, 1.0, -2.0]), 1)
    assert torch.equal(adv, torch.zeros(3))


# ---------------------------------------------------------------- one batch, every loss type

@pytest.mark.parametrize("loss_type", gm.LOSS_TYPES)
@pytest.mark.parametrize("beta,eps_low,eps_high", [(0.0, 0.2, 0.2), (0.04, 0.2, 0.28), (0.1, 0.1, 0.3)])
def test_loss_and_gradient_equal_the_definition(loss_type, beta, eps_low, eps_high):
    B, T = 6, 9
    logp, old, ref, adv, mask = _inputs(B, T, zero_rows=(2,))
    cfg = gm.GRPOLossConfig(eps_low=eps_low, eps_high=eps_high, beta=beta, loss_type=loss_type,
                            max_completion_length=T + 3)
    loss, stats = gm.grpo_loss(logp, old, ref, adv, mask, cfg, token_normaliser=mask.sum().item())
    grad, = torch.autograd.grad(loss, logp)
    expect = ref_aggregate(ref_per_token(logp, old, ref, adv, eps_low, eps_high, beta), mask, loss_type, T + 3)
    expect_grad, = torch.autograd.grad(expect, logp)
    assert loss.item() == pytest.approx(expect.item(), rel=1e-10, abs=1e-12)
    assert torch.allclose(grad, expect_grad, rtol=1e-9, atol=1e-12)
    d = ref - logp.detach()
    kl = ((d.exp() - d - 1) * mask).sum() / mask.sum()
    assert stats["kl"] == pytest.approx(kl.item(), rel=1e-5)


def test_clip_bounds_are_asymmetric_and_the_gradient_vanishes_outside():
    logp = torch.log(torch.tensor([[0.5, 0.75, 1.0, 1.25, 1.5]], dtype=torch.float64)).requires_grad_()
    old = torch.zeros(1, 5, dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.float64)
    for a, live in ((1.0, [1, 1, 1, 1, 0]), (-1.0, [0, 0, 1, 1, 1])):  # eps_low 0.2, eps_high 0.28
        cfg = gm.GRPOLossConfig(eps_low=0.2, eps_high=0.28, loss_type="bnpo")
        loss, _ = gm.grpo_loss(logp, old, None, torch.tensor([a], dtype=torch.float64), mask, cfg)
        grad, = torch.autograd.grad(loss, logp)
        assert [int(v != 0) for v in grad[0].tolist()] == live
    # A > 0: only ratios above 1 + eps_high stop learning (1.25 still learns); A < 0: only those below 1 - eps_low


# ---------------------------------------------------------------- the step: micro-batches x ranks

def _ds_step(logp, old, ref, adv, mask, cfg, GA, W, max_len, weights=None):
    """The trainer's arithmetic (grpo.train_step) over W ranks x GA micro-batches, reduced as DeepSpeed
    does (backward of loss / GA, gradients averaged over ranks); returns (logged loss, gradient)."""
    B = logp.shape[0]
    weights = torch.ones(B, dtype=logp.dtype) if weights is None else weights
    m_all = mask * weights[:, None]
    tokens_global, rows_global = m_all.sum().item(), weights.sum().item()
    short = rows_global < B
    scale = gm.backward_scale(cfg.loss_type, short, GA, W)
    per_rank, mb = B // W, B // (W * GA)
    grad = torch.zeros_like(logp)
    logged = []
    for r in range(W):
        rank_grad = torch.zeros_like(logp)
        for k in range(GA):
            sl = slice(r * per_rank + k * mb, r * per_rank + (k + 1) * mb)
            loss, _ = gm.grpo_loss(logp[sl], old[sl], None if ref is None else ref[sl], adv[sl] * weights[sl],
                                   m_all[sl], cfg, token_normaliser=tokens_global,
                                   sequence_normaliser=rows_global if short else None)
            g, = torch.autograd.grad(loss * scale / GA, logp)
            rank_grad += g
            logged.append(loss.item() * scale)
        grad += rank_grad / W
    return sum(logged) / len(logged), grad


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("GA,W", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_step_equals_the_single_batch_definition_for_any_split(loss_type, GA, W):
    B, T = 16, 7
    logp, old, ref, adv, mask = _inputs(B, T, seed=GA * 10 + W, zero_rows=(5,))
    mask[1, :] = 1.0  # uneven lengths across micro-batches
    cfg = gm.GRPOLossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, loss_type=loss_type, max_completion_length=T)
    logged, grad = _ds_step(logp, old, ref, adv, mask, cfg, GA, W, T)
    expect = ref_aggregate(ref_per_token(logp, old, ref, adv, 0.2, 0.28, 0.04), mask, loss_type, T)
    expect_grad, = torch.autograd.grad(expect, logp)
    assert logged == pytest.approx(expect.item(), rel=1e-10)
    assert torch.allclose(grad, expect_grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("GA,W", [(2, 1), (2, 2)])
def test_bnpo_is_the_mean_of_micro_batch_token_means_as_in_trl(GA, W):
    """Deliberate, as TRL documents bnpo: normalised over the local (micro-)batch's tokens."""
    B, T = 8, 5
    logp, old, ref, adv, mask = _inputs(B, T, seed=7)
    cfg = gm.GRPOLossConfig(loss_type="bnpo")
    logged, grad = _ds_step(logp, old, None, adv, mask, cfg, GA, W, T)
    rows = ref_per_token(logp, old, None, adv, 0.2, 0.2, 0.0)
    mb = B // (GA * W)
    parts = [ref_aggregate(rows[s:s + mb], mask[s:s + mb], "bnpo", T) for s in range(0, B, mb)]
    expect = sum(parts) / len(parts)
    expect_grad, = torch.autograd.grad(expect, logp)
    assert logged == pytest.approx(expect.item(), rel=1e-10)
    assert torch.allclose(grad, expect_grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("loss_type", gm.LOSS_TYPES)
@pytest.mark.parametrize("GA,W", [(2, 1), (2, 2)])
def test_short_batch_step_equals_its_kept_rows_as_one_batch(loss_type, GA, W):
    B, T = 8, 6
    logp, old, ref, adv, mask = _inputs(B, T, seed=11)
    weights = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1], dtype=torch.float64)  # padding / overlong-filtered rows
    cfg = gm.GRPOLossConfig(loss_type=loss_type, max_completion_length=T)
    logged, grad = _ds_step(logp, old, None, adv, mask, cfg, GA, W, T, weights)
    kept = weights.bool().tolist()
    rows = [r for r, k in zip(ref_per_token(logp, old, None, adv, 0.2, 0.2, 0.0), kept) if k]
    # bnpo over a padded batch is the kept rows' global token mean (a padding micro-batch has no mean)
    expect = ref_aggregate(rows, mask[weights.bool()], "dapo" if loss_type == "bnpo" else loss_type, T)
    expect_grad, = torch.autograd.grad(expect, logp)
    assert logged == pytest.approx(expect.item(), rel=1e-10)
    assert torch.allclose(grad, expect_grad, rtol=1e-9, atol=1e-13)


def test_all_zero_mask_gives_zero_loss_and_gradient():
    B, T = 4, 5
    logp, old, ref, adv, _ = _inputs(B, T)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for loss_type in gm.LOSS_TYPES:
        cfg = gm.GRPOLossConfig(loss_type=loss_type, beta=0.1, max_completion_length=T)
        loss, stats = gm.grpo_loss(logp, old, ref, adv, mask, cfg, token_normaliser=1.0)
        grad, = torch.autograd.grad(loss, logp)
        assert loss.item() == 0.0 and not grad.any() and math.isfinite(stats["kl"])


# ---------------------------------------------------------------- the trainer's logged loss
# (the trainer over a tiny LM and an engine with DeepSpeed's contract is test_grpo_dapo's)

@pytest.mark.parametrize("loss_type", gm.LOSS_TYPES)
def test_trainer_logs_the_step_loss_and_trains_on_its_gradient(loss_type):
    """grad_accum 4: the logged ``loss`` is the batch's loss (it was the dapo loss / grad_accum)."""
    from dstrain.trainers import grpo_sampling as gs
    from models.policy.model import token_logprobs
    torch.manual_seed(5)
    B, T, GA = 8, 9, 4
    ids = torch.randint(1, 11, (B, T))
    cmask = torch.zeros(B, T, dtype=torch.long)
    for i in range(B):
        cmask[i, 3:3 + 1 + i % 5] = 1  # completions of 1..5 tokens
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": cmask}
    adv = torch.randn(B)
    tr = fake_step_trainer(loss_type, gs.StepBatch(batch, adv, torch.ones(B), {}, {"generation": 0.0, "reward": 0.0}, 0),
                           GA)
    out = tr.train_step(0)

    model = tr.engine.module
    with torch.no_grad():
        logp = token_logprobs(model(ids), ids).double()
    mask = cmask[:, 1:].double()
    rows = ref_per_token(logp, logp, None, adv.double(), 0.2, 0.2, 0.0)
    if loss_type == "bnpo":
        mb = B // GA
        expect = sum(ref_aggregate(rows[s:s + mb], mask[s:s + mb], "bnpo", T) for s in range(0, B, mb)) / GA
    else:
        expect = ref_aggregate(rows, mask, loss_type, T)
    assert out["loss"] == pytest.approx(float(expect), rel=1e-5, abs=1e-7)
