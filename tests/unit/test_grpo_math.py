"""GRPO arithmetic against numbers worked out by hand."""
import math

import pytest
import torch

from dstrain.rl import grpo_math as gm


def test_group_advantages_hand_values():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    adv = gm.group_advantages(r, 2)
    std = math.sqrt(0.5)  # unbiased std of {1, 0}
    expect = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expect, rel=1e-6)
    assert gm.group_advantages(r, 2, scale=False).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0])
    assert gm.zero_variance_fraction(r, 2) == pytest.approx(1 / 3)


def test_group_advantages_three_samples():
    r = torch.tensor([3.0, 0.0, 0.0])
    # mean 1, unbiased var ((2^2 + 1 + 1) / 2) = 3
    assert gm.group_advantages(r, 3, eps=0.0).tolist() == pytest.approx([2 / math.sqrt(3), -1 / math.sqrt(3),
                                                                         -1 / math.sqrt(3)])
    with pytest.raises(ValueError, match="group_size"):
        gm.group_advantages(torch.ones(5), 2)


def test_clipping_hand_values():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    obj, clipped = gm.clipped_objective(logp, old, adv, 0.2, 0.2)
    assert obj.tolist()[0] == pytest.approx([1.2, -1.5, 0.5, -0.8])
    assert clipped.tolist()[0] == [1.0, 0.0, 0.0, 1.0]
    # asymmetric bounds (DAPO's clip-higher): eps_high 0.6 lets 1.5 through
    obj, clipped = gm.clipped_objective(logp, old, adv, 0.2, 0.6)
    assert obj.tolist()[0] == pytest.approx([1.5, -1.5, 0.5, -0.8])


def test_k3_hand_value_and_gradient():
    logp = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    kl = gm.k3_kl(logp, ref)
    assert kl.item() == pytest.approx(0.5 + math.log(2) - 1)
    kl.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = -exp(ref - logp) + 1 = 0.5
    assert logp.grad.item() == pytest.approx(0.5)
    assert gm.k3_kl(ref, ref).item() == 0.0


def test_aggregations_hand_values():
    per = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert gm.aggregate(per, mask, "grpo").item() == pytest.approx(3.0)
    assert gm.aggregate(per, mask, "bnpo").item() == pytest.approx(2.5)
    assert gm.aggregate(per, mask, "dapo", token_normaliser=8).item() == pytest.approx(1.25)
    assert gm.aggregate(per, mask, "dr_grpo", max_completion_length=5).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="token_normaliser"):
        gm.aggregate(per, mask, "dapo")
    with pytest.raises(ValueError, match="unknown loss_type"):
        gm.aggregate(per, mask, "mean")


def test_loss_gradient_on_first_pass_is_policy_gradient():
    """old == new: ratio 1, d loss / d logp = -A / tokens of the sequence (grpo)."""
    logp = torch.log(torch.tensor([[0.2, 0.3, 0.4], [0.5, 0.6, 0.7]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = gm.grpo_loss(logp, logp.detach(), None, adv, mask, gm.GRPOLossConfig())
    loss.backward()
    expect = torch.tensor([[-2 / 2, -2 / 2, 0], [1 / 3, 1 / 3, 1 / 3]]) / 2
    assert torch.allclose(logp.grad, expect)
    assert stats["clip_fraction"] == 0.0 and "kl" not in stats


def test_loss_with_kl_matches_formula():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([0.0])
    cfg = gm.GRPOLossConfig(beta=0.1, loss_type="bnpo")
    loss, stats = gm.grpo_loss(logp, old, ref, adv, torch.ones(1, 2), cfg)
    kl = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert loss.item() == pytest.approx(0.1 * sum(kl) / 2)
    assert stats["kl"] == pytest.approx(sum(kl) / 2)
    loss.backward()  # zero advantage: the gradient is the KL's alone and not zero
    assert logp.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="reference"):
        gm.grpo_loss(logp, old, None, adv, torch.ones(1, 2), cfg)


def test_pass_at_k():
    assert gm.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert gm.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert gm.pass_at_k(4, 0, 2) == 0.0
    assert gm.pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        gm.pass_at_k(3, 4, 1)
