"""AdamATan2 against an element-by-element hand computation, and how the engine picks it."""
import math

import pytest
import torch

from dstrain.engine.ds_config import RunValues, fill_ds_config
from dstrain.engine.optim import choose_optimizer
from dstrain.optim.adam_atan2 import AdamATan2

VALUES = RunValues(micro_batch=4, grad_accum=1, dp_world_size=1, lr=7e-5, betas=(0.9, 0.95), eps=1e-8,
                   weight_decay=1.0, grad_clip=1.0, precision="fp32", hidden_size=64, total_steps=10,
                   warmup_steps=1, min_lr_ratio=1.0)


def hand_steps(p0, grads, lr, betas, weight_decay):
    """The HRM reference kernel's rule, one Python float at a time."""
    b1, b2 = betas
    p, m, v = list(p0), [0.0] * len(p0), [0.0] * len(p0)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            p[i] *= 1 - lr * weight_decay
            m[i] += (1 - b1) * (gi - m[i])
            v[i] += (1 - b2) * (gi * gi - v[i])
            denom = math.sqrt(v[i]) / math.sqrt(1 - b2 ** t)
            p[i] -= lr / (1 - b1 ** t) * math.atan2(m[i], denom)
    return p


def run(p0, grads, dtype=torch.float64, **kw):
    p = torch.nn.Parameter(torch.tensor(p0, dtype=dtype))
    opt = AdamATan2([p], **kw)
    for g in grads:
        p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return p.detach().tolist(), opt


def test_matches_the_hand_computation():
    p0 = [0.5, -1.25, 0.0, 2.0, 3e-3]
    grads = [[0.3, -2.0, 0.0, 1e-6, -4.0], [-0.1, 0.5, 0.0, 2e-6, 4.0], [0.2, -0.7, 1e-3, -1e-6, 1.0]]
    kw = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.5)
    got, opt = run(p0, grads, **kw)
    assert got == pytest.approx(hand_steps(p0, grads, **kw), rel=1e-12, abs=1e-15)
    assert float(opt.state[opt.param_groups[0]["params"][0]]["step"]) == 3


def test_first_step_is_bounded_and_scale_free():
    # step 1 with no decay: atan2(g (1 - b1), |g| sqrt(1 - b2) / sqrt(1 - b2)) / (1 - b1)
    # = atan2(sign(g) (1 - b1), 1) / (1 - b1), whatever the gradient's size; a zero gradient stays put.
    b1 = 0.9
    got, _ = run([0.0, 0.0, 0.0], [[1e-9, -5e3, 0.0]], lr=1.0, betas=(b1, 0.99), weight_decay=0.0)
    step = math.atan2(1 - b1, 1.0) / (1 - b1)
    assert got == pytest.approx([-step, step, 0.0], rel=1e-12)
    small, _ = run([1.0, 2.0], [[1e-3, -2e-3], [3e-3, 1e-3]], lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
    large, _ = run([1.0, 2.0], [[1e3, -2e3], [3e3, 1e3]], lr=0.1, betas=(0.9, 0.95), weight_decay=0.0)
    assert small == pytest.approx(large, rel=1e-12)


def test_state_dict_round_trip_continues_exactly():
    grads = [[0.3, -0.2], [0.1, 0.4], [-0.5, 0.05]]
    whole, _ = run([1.0, -1.0], grads, lr=0.05, betas=(0.8, 0.9), weight_decay=0.1)
    part, opt = run([1.0, -1.0], grads[:2], lr=0.05, betas=(0.8, 0.9), weight_decay=0.1)
    p = torch.nn.Parameter(torch.tensor(part, dtype=torch.float64))
    again = AdamATan2([p], lr=0.05, betas=(0.8, 0.9), weight_decay=0.1)
    again.load_state_dict(opt.state_dict())
    p.grad = torch.tensor(grads[2], dtype=torch.float64)
    again.step()
    assert p.detach().tolist() == pytest.approx(whole, rel=1e-14)


@pytest.mark.parametrize("kw, match", [(dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
                                       (dict(weight_decay=-0.1), "weight_decay")])
def test_bad_hyper_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        AdamATan2([torch.nn.Parameter(torch.zeros(2))], **kw)


def test_run_config_type_builds_it_from_the_run_values():
    choice, ds = choose_optimizer({"zero_optimization": {"stage": 2}}, "auto", "cuda", VALUES, "adam_atan2")
    assert choice.algorithm == "adam_atan2" and "optimizer" not in ds
    assert choice.params == {"lr": 7e-5, "betas": [0.9, 0.95], "weight_decay": 1.0}
    assert "AdamATan2" in choice.description and "train.optimizer_type" in choice.description
    opt = choice.factory()([torch.nn.Parameter(torch.zeros(3))])
    assert type(opt) is AdamATan2 and opt.defaults["betas"] == (0.9, 0.95)


def test_json_block_of_type_adamatan2_is_filled_and_built():
    template = {"optimizer": {"type": "AdamATan2", "params": {"lr": "auto", "eps": 1e-8}},
                "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto"}
    resolved = fill_ds_config(template, VALUES, "test.json")
    assert resolved["optimizer"]["params"]["betas"] == [0.9, 0.95]  # filled: the run's, not a default
    choice, ds = choose_optimizer(resolved, "auto", "cpu", VALUES)
    assert choice.algorithm == "adam_atan2" and "optimizer" not in ds
    assert "eps" not in choice.params and "eps dropped" in choice.description


@pytest.mark.parametrize("cfg, requested, otype, match", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "auto", "adam_atan2", "offload"),
    ({}, "torch_fused", "adam_atan2", "torch_fused"),
    ({}, "deepspeed", "adam_atan2", "deepspeed"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "auto", "adam_atan2", "type 'AdamW'"),
    ({"optimizer": {"type": "AdamATan2", "params": {"lr": 1e-3, "amsgrad": True}}}, "auto", "adamw", "amsgrad"),
    ({}, "auto", "lion", "optimizer_type"),
])
def test_what_adamatan2_cannot_do_is_refused(cfg, requested, otype, match):
    with pytest.raises(ValueError, match=match):
        choose_optimizer(cfg, requested, "cuda", VALUES, otype)


def test_shipped_profiles_take_the_run_config_type_and_pinned_blocks_stay():
    from dstrain.engine.ds_config import load_ds_json, resolve_profile_path
    from dstrain.engine.optim import apply_optimizer_type
    template = load_ds_json(resolve_profile_path("zero2"))
    assert template["optimizer"]["type"] == "AdamW"  # every param "auto"
    retyped = apply_optimizer_type(template, "adam_atan2")
    assert retyped["optimizer"]["type"] == "AdamATan2" and "eps" not in retyped["optimizer"]["params"]
    assert template["optimizer"]["type"] == "AdamW" and apply_optimizer_type(template, "adamw") is template
    choice, _ = choose_optimizer(fill_ds_config(retyped, VALUES, "zero2.json"), "auto", "cpu", VALUES, "adam_atan2")
    assert choice.algorithm == "adam_atan2" and choice.params["weight_decay"] == 1.0
    pinned = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": "auto"}}}
    assert apply_optimizer_type(pinned, "adam_atan2") is pinned


def torch_steps(p0, grads, dtype, lr, betas, weight_decay):
    """The same rule in ``dtype`` with torch.atan2, one element at a time (underflow included)."""
    b1, b2 = betas
    t_ = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    p, m, v = [t_(x) for x in p0], [t_(0.0)] * len(p0), [t_(0.0)] * len(p0)
    for t, g in enumerate(grads, start=1):
        for i, gi in enumerate(g):
            gi = t_(gi)
            p[i] = p[i] * (1 - lr * weight_decay)
            m[i] = torch.lerp(m[i], gi, 1 - b1)
            v[i] = torch.lerp(v[i], gi * gi, 1 - b2)
            p[i] = p[i] - lr / (1 - b1 ** t) * torch.atan2(m[i], torch.sqrt(v[i]) / math.sqrt(1 - b2 ** t))
    return [float(x) for x in p]


@pytest.mark.parametrize("dtype, tiny", [(torch.float32, 1e-25), (torch.float16, 1e-7)])
def test_narrow_dtypes_and_vanishing_gradients_follow_atan2(dtype, tiny):
    # ``tiny`` squares to 0 in ``dtype``: v = 0 while m != 0, where atan2 gives pi/2 (fp16 runs per tensor).
    p0 = [0.5, -0.25, 0.0, 1.0]
    grads = [[tiny, -0.5, 0.0, 2.0], [0.0, 0.25, 0.0, -1.0]]
    kw = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    got, _ = run(p0, grads, dtype=dtype, **kw)
    assert all(math.isfinite(x) for x in got)
    assert got == pytest.approx(torch_steps(p0, grads, dtype, **kw), rel=1e-3 if dtype == torch.float16 else 1e-6)
