"""SCoRe arithmetic against numbers worked out by hand."""
import math

import pytest
import torch

from dstrain.rl.score_math import (TurnBatch, critic_advantages, critic_loss, episode_critic_targets,
                                   group_advantages, guidance_rewards, kl_k3, masked_sequence_mean,
                                   score_objective, shaped_rewards, td_target, value_loss)

LN2 = math.log(2.0)
K3_UP = 1 - LN2          # k3 at ref - logp = +ln 2: 2 - ln 2 - 1 = 0.306853
K3_DOWN = LN2 - 0.5      # k3 at ref - logp = -ln 2: 1/2 + ln 2 - 1 = 0.193147


def _turn(logp, delta, mask, old_shift=0.0):
    """A TurnBatch with ref_logp = logp + delta and old_logp = logp - old_shift (ratio = e^old_shift)."""
    logp = torch.tensor(logp, requires_grad=True)
    delta, mask = torch.tensor(delta), torch.tensor(mask)
    return TurnBatch(logp=logp, old_logp=logp.detach() - old_shift, ref_logp=logp.detach() + delta, mask=mask)


def _example(old_shift=0.0):
    # turn 1: row 0 has 2 answer tokens (the third is padding with a wild value), row 1 has 3
    t1 = _turn([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.2]], [[0.0, LN2, 9.0], [-LN2, 0.0, 0.0]],
               [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], old_shift)
    # turn 2: row 0 three tokens at the reference, row 1 two tokens at +ln 2 (third is padding)
    t2 = _turn([[-0.2, -0.4, -0.6], [-1.5, -0.1, -3.0]], [[0.0, 0.0, 0.0], [LN2, LN2, -7.0]],
               [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], old_shift)
    return t1, t2, torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])


# kl_1 = mean(row 0: (0 + K3_UP) / 2, row 1: (K3_DOWN + 0 + 0) / 3) = 0.1089044
KL1 = (K3_UP / 2 + K3_DOWN / 3) / 2
# kl_2 = mean(row 0: 0, row 1: (K3_UP + K3_UP) / 2) = 0.153426
KL2 = K3_UP / 2
# ratio 1: pg_1 = -mean(1, -2) = 0.5 ; pg_2 = -mean(0.5, 3) = -1.75
PG1, PG2 = 0.5, -1.75


def test_k3_values_and_gradient():
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0 + LN2, -1.0 - LN2])
    kl = kl_k3(logp, ref)
    assert kl.tolist() == pytest.approx([0.0, K3_UP, K3_DOWN], abs=1e-7)
    kl.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1 - 2.0, 1 - 0.5], abs=1e-6)  # 1 - exp(ref - logp)


def test_constants_written_out():
    assert KL1 == pytest.approx(0.1089044, abs=1e-7)
    assert KL2 == pytest.approx(0.1534264, abs=1e-7)


def test_stage2_loss_and_stats():
    t1, t2, a1, a2 = _example()
    loss, stats = score_objective(t1, t2, a1, a2, stage=2, beta1=0.01, beta2=0.1)
    expected = PG1 + PG2 + 0.01 * (KL1 + KL2)  # = -1.2473767
    assert loss.item() == pytest.approx(-1.2473767, abs=1e-6)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["pg_loss_turn1"] == pytest.approx(PG1) and stats["pg_loss_turn2"] == pytest.approx(PG2)
    assert stats["kl_turn1"] == pytest.approx(KL1, abs=1e-6) and stats["kl_turn2"] == pytest.approx(KL2, abs=1e-6)
    assert stats["kl_coef_turn1"] == 0.01 and stats["kl_coef_turn2"] == 0.01
    assert all(isinstance(v, float) for v in stats.values())


def test_stage1_loss_drops_turn1_pg_and_uses_beta2():
    t1, t2, a1, a2 = _example()
    loss, stats = score_objective(t1, t2, a1, a2, stage=1, beta1=0.01, beta2=0.1)
    assert loss.item() == pytest.approx(PG2 + 0.1 * KL1 + 0.01 * KL2, abs=1e-6)  # -1.7375753
    assert loss.item() == pytest.approx(-1.7375753, abs=1e-6)
    assert stats["pg_loss_turn1"] == 0.0 and stats["kl_coef_turn1"] == 0.1
    # turn-1 advantages play no part in stage 1
    loss_b, _ = score_objective(*_example()[:2], torch.tensor([100.0, -50.0]), a2, stage=1)
    loss_c, _ = score_objective(*_example()[:2], None, a2, stage=1)
    assert loss_b.item() == pytest.approx(loss_c.item())
    with pytest.raises(ValueError, match="adv1"):
        score_objective(*_example()[:2], None, a2, stage=2)


def test_gradients_by_hand():
    t1, t2, a1, a2 = _example()
    loss, _ = score_objective(t1, t2, a1, a2, stage=2, beta1=0.01, beta2=0.1)
    loss.backward()
    # d/d logp at a masked token of row b with n_b tokens, B = 2 rows:
    #   (-A_b + beta * (1 - exp(ref - logp))) / (n_b * B)
    g2 = t2.logp.grad
    assert g2[1, 0].item() == pytest.approx((-3.0 + 0.01 * (1 - 2)) / 4, abs=1e-6)  # -0.7525
    assert g2[0, 2].item() == pytest.approx(-0.5 / 6, abs=1e-6)
    g1 = t1.logp.grad
    assert g1[0, 1].item() == pytest.approx((-1.0 + 0.01 * (1 - 2)) / 4, abs=1e-6)
    assert g1[1, 0].item() == pytest.approx((2.0 + 0.01 * (1 - 0.5)) / 6, abs=1e-6)
    # padding gets no gradient
    assert g1[0, 2].item() == 0.0 and g2[1, 2].item() == 0.0


def test_kl_gradient_reaches_logp_with_zero_advantages():
    for stage, beta_turn1 in ((1, 0.1), (2, 0.01)):
        t1, t2, _, _ = _example()
        zero = torch.zeros(2)
        loss, stats = score_objective(t1, t2, zero, zero, stage=stage, beta1=0.01, beta2=0.1)
        assert loss.item() == pytest.approx(beta_turn1 * KL1 + 0.01 * KL2, abs=1e-6)
        loss.backward()
        assert t1.logp.grad.abs().sum() > 0 and t2.logp.grad.abs().sum() > 0
        # row 0 token 1 (ref - logp = ln 2): beta * (1 - 2) / (2 * 2)
        assert t1.logp.grad[0, 1].item() == pytest.approx(-beta_turn1 / 4, abs=1e-7)
    # and without KL and advantages nothing moves
    t1, t2, _, _ = _example()
    loss, _ = score_objective(t1, t2, torch.zeros(2), torch.zeros(2), stage=2, beta1=0.0, beta2=0.0)
    loss.backward()
    assert t1.logp.grad.abs().sum() == 0


def test_stage1_turn1_gradient_is_kl_only_and_stage2_adds_pg():
    grads = {}
    for stage in (1, 2):
        t1, t2, a1, a2 = _example()
        score_objective(t1, t2, a1, a2, stage=stage, beta1=0.01, beta2=0.1)[0].backward()
        grads[stage] = t1.logp.grad.clone()
    # stage 1, row 1 token 0 (ref - logp = -ln 2): only 0.1 * (1 - 0.5) / 6
    assert grads[1][1, 0].item() == pytest.approx(0.1 * 0.5 / 6, abs=1e-7)
    assert grads[1][1, 1].item() == 0.0  # at the reference, no KL gradient, and no pg term
    assert grads[2][1, 1].item() == pytest.approx(2.0 / 6, abs=1e-7)


def test_masks_respected():
    t1, t2, a1, a2 = _example()
    base, _ = score_objective(t1, t2, a1, a2, stage=2)
    t1b, t2b, _, _ = _example()
    with torch.no_grad():  # change only padded positions, wildly
        t1b.ref_logp[0, 2] = 50.0
        t1b.old_logp[0, 2] = -50.0
        t2b.ref_logp[1, 2] = -50.0
    other, _ = score_objective(t1b, t2b, a1, a2, stage=2)
    assert other.item() == pytest.approx(base.item(), abs=1e-6)
    assert masked_sequence_mean(torch.ones(2, 3), torch.zeros(2, 3)).tolist() == [0.0, 0.0]


def test_ratio_and_clipping():
    t1, t2, a1, a2 = _example(old_shift=LN2)  # every ratio is exp(ln 2) = 2
    _, stats = score_objective(t1, t2, a1, a2, stage=2, beta1=0.0)
    assert stats["pg_loss_turn1"] == pytest.approx(2 * PG1) and stats["pg_loss_turn2"] == pytest.approx(2 * PG2)
    t1, t2, a1, a2 = _example(old_shift=LN2)
    loss, stats = score_objective(t1, t2, a1, a2, stage=2, beta1=0.0, clip_eps=0.2)
    # A > 0: min(2A, 1.2A) = 1.2A (clipped); A < 0: min(2A, 1.2A) = 2A (not clipped)
    assert stats["pg_loss_turn1"] == pytest.approx(-(1.2 * 1.0 + 2 * -2.0) / 2)
    assert stats["pg_loss_turn2"] == pytest.approx(-(1.2 * 0.5 + 1.2 * 3.0) / 2)
    assert stats["clip_fraction_turn1"] == pytest.approx(0.5) and stats["clip_fraction_turn2"] == 1.0
    loss.backward()
    assert t2.logp.grad.abs().sum() == 0  # clipped tokens carry no gradient
    assert t1.logp.grad[1, 0].item() == pytest.approx(2 * 2.0 / 6, abs=1e-6)


def test_objective_validation():
    t1, t2, a1, a2 = _example()
    for kwargs in ({"stage": 3}, {"stage": 2, "beta1": -1.0}, {"stage": 2, "clip_eps": 1.5}):
        with pytest.raises(ValueError):
            score_objective(t1, t2, a1, a2, **kwargs)
    with pytest.raises(ValueError, match="B, T"):
        TurnBatch(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_shaped_rewards():
    r1, r2 = torch.tensor([0.0, 1.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])
    R1, R2 = shaped_rewards(r1, r2, stage=1, alpha=10.0)
    assert R1.tolist() == [0, 0, 0, 0] and R2.tolist() == [0, 0, 1, 1]
    R1, R2 = shaped_rewards(r1, r2, stage=2, alpha=10.0)
    assert R1.tolist() == [0, 1, 0, 1] and R2.tolist() == [0, -10, 11, 1]
    assert guidance_rewards(r1, r2).tolist() == [0, -1, 1, 0]
    with pytest.raises(ValueError, match="stage"):
        shaped_rewards(r1, r2, stage=0)


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 2: all equal -> 0
    adv = group_advantages(rewards, 4, eps=0.0)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0])
    assert group_advantages(rewards, 4).tolist()[0] == pytest.approx(0.75 / (0.5 + 1e-4))
    assert group_advantages(rewards, 4, scale=False).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    assert group_advantages(rewards, 1).tolist() == [0.0] * 8
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(rewards, 3)


def test_critic_value_targets_and_losses():
    q = torch.tensor([1.0, 2.0], requires_grad=True)
    v = torch.tensor([0.5, 3.0], requires_grad=True)
    adv = critic_advantages(q, v)
    assert adv.tolist() == [0.5, -1.0] and not adv.requires_grad
    v_s2 = torch.tensor([0.5, -1.0], requires_grad=True)
    q1_t, q2_t = episode_critic_targets(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0]), v_s2, gamma=0.9)
    assert q1_t.tolist() == pytest.approx([0.45, 0.1]) and q2_t.tolist() == [2.0, 3.0]
    assert not q1_t.requires_grad
    done = torch.tensor([0.0, 1.0])
    assert td_target(torch.tensor([1.0, 1.0]), torch.tensor([5.0, 5.0]), done, 0.5).tolist() == [3.5, 1.0]
    loss = critic_loss(q, q1_t)  # ((1 - 0.45)^2 + (2 - 0.1)^2) / 2
    assert loss.item() == pytest.approx((0.55 ** 2 + 1.9 ** 2) / 2)
    loss.backward()
    assert q.grad.tolist() == pytest.approx([0.55, 1.9])  # 2 (q - t) / 2
    target_q = torch.tensor([1.0, 1.0], requires_grad=True)
    vl = value_loss(v, target_q)
    vl.backward()
    assert vl.item() == pytest.approx((0.25 + 4.0) / 2) and target_q.grad is None
    with pytest.raises(ValueError, match="shape"):
        critic_loss(q.detach().unsqueeze(1), q1_t)
    with pytest.raises(ValueError, match="gamma"):
        td_target(1.0, 1.0, 0.0, gamma=1.5)
