"""The learning rate per optimizer update when a DeepSpeed JSON carries a ``scheduler`` block:
dstrain fills the block from the run config and DeepSpeed's own scheduler class runs it. The lr
of each update is compared with the schedule's definition evaluated on the run config's numbers
(``train.lr`` the peak, ``train.warmup_steps``, ``train.steps`` x updates per step the horizon,
``train.min_lr_ratio`` the cosine floor), and gradient clipping with DeepSpeed's
``clip_grad_norm_`` (coefficient ``max_norm / (norm + 1e-6)``, at most 1)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from dstrain.engine import ds_config as dsc
from dstrain.engine.ds_trainers import scale_schedule_horizon

LR, MIN_RATIO = 3e-4, 0.1


def _values(steps, warmup):
    return dsc.RunValues(micro_batch=2, grad_accum=1, dp_world_size=1, lr=LR, betas=(0.9, 0.95), eps=1e-8,
                         weight_decay=0.0, grad_clip=1.0, precision="fp32", hidden_size=64, total_steps=steps,
                         warmup_steps=warmup, min_lr_ratio=MIN_RATIO)


def _ref_lr(kind, update, steps, warmup, warmup_type):
    """The lr of optimizer update ``update`` (0-based) from the schedules' definitions, driven as
    DeepSpeed's engine drives them: the scheduler steps after each update, so update k runs at the
    schedule's iteration k - 1 (iteration -1: the warm-up minimum, 0 here). Warm-up over at least 2
    iterations; log: ln(k + 1) / ln(W); linear: k / W."""
    k = update - 1
    if k < 0:
        return 0.0
    W = max(2, max(1, warmup))
    if k < W:
        g = math.log(k + 1) / math.log(W) if warmup_type == "log" else k / W
        return LR * g  # warm-up from 0 (warmup_min_lr / warmup_min_ratio 0)
    if kind == "WarmupLR":
        return LR
    if kind == "WarmupDecayLR":
        return LR * max(0.0, (steps - k) / max(1, steps - W))
    progress = min(1.0, (k - W + 1) / max(1, steps - W))
    return LR * (MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def _ds_lrs(cfg, updates):
    from deepspeed.runtime import lr_schedules
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))],
                          lr=cfg.get("optimizer", {}).get("params", {}).get("lr", LR))
    sched = getattr(lr_schedules, cfg["scheduler"]["type"])(opt, **cfg["scheduler"]["params"])
    out = []
    for _ in range(updates):  # DeepSpeed's _take_model_step: the update at the current lr, then scheduler.step()
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
@pytest.mark.parametrize("steps,warmup,updates_per_step", [(20, 5, 1), (20, 0, 1), (12, 1, 1), (10, 3, 2), (8, 8, 1)])
def test_filled_scheduler_block_gives_the_schedule_of_the_run_config(kind, warmup_type, steps, warmup,
                                                                    updates_per_step):
    params = {"warmup_num_steps": "auto", "warmup_type": warmup_type}
    if kind == "WarmupCosineLR":
        params.update(total_num_steps="auto", cos_min_ratio="auto", warmup_min_ratio="auto")
    else:
        params.update(warmup_max_lr="auto", warmup_min_lr="auto")
        if kind == "WarmupDecayLR":
            params["total_num_steps"] = "auto"
    template = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                "scheduler": {"type": kind, "params": params}}
    cfg = dsc.fill_ds_config(copy.deepcopy(template), _values(steps, warmup), "test")
    scale_schedule_horizon(cfg, updates_per_step)
    total = steps * updates_per_step
    got = _ds_lrs(cfg, total + 2)
    expect = [_ref_lr(kind, k, total, warmup, warmup_type) for k in range(total + 2)]
    assert got == pytest.approx(expect, rel=1e-12, abs=1e-15)


def test_missing_scheduler_params_are_filled_from_the_run_config():
    cfg = dsc.fill_ds_config({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR"}},
                             _values(30, 4), "test")
    got = _ds_lrs(cfg, 32)
    assert got == pytest.approx([_ref_lr("WarmupDecayLR", k, 30, 4, "log") for k in range(32)], rel=1e-12)


def test_horizon_scales_only_an_integer_total():
    cfg = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 3}}}
    scale_schedule_horizon(cfg, 3)
    assert cfg["scheduler"]["params"] == {"total_num_steps": 30, "warmup_num_steps": 3}
    one_cycle = {"scheduler": {"type": "OneCycle", "params": {"cycle_first_step_size": 10}}}
    scale_schedule_horizon(one_cycle, 3)
    assert one_cycle["scheduler"]["params"] == {"cycle_first_step_size": 10}
    scale_schedule_horizon({}, 2)  # no block: nothing to do


def test_one_cycle_block_is_left_to_deepspeed():
    import json
    from pathlib import Path
    raw = json.loads((Path(__file__).parents[1] / "configs" / "examples_onecycle_scheduler.json").read_text())
    cfg = dsc.fill_ds_config(raw, _values(20, 0), "test")
    assert cfg["scheduler"] == raw["scheduler"]
    p = cfg["scheduler"]["params"]
    lrs = _ds_lrs(cfg, 2 * p["cycle_first_step_size"] + 1)
    # the cycle's definition, update u (its scheduler iteration u - 1 counts u batches seen): the lr climbs
    # from min to max over the first step size and back over the second, held flat on each of
    # ``stair_count`` stairs of each half
    first, second, stair = p["cycle_first_step_size"], p["cycle_second_step_size"], p["cycle_first_stair_count"]
    for u in (0, 1, 2, 3, 499, 500, 501, 999, 1000, 1001, 1500, 1999, 2000):
        pos = u * stair / first if u <= first else (first + second - u) * stair / second
        expect = p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * math.floor(pos) / stair
        assert lrs[u] == pytest.approx(expect, rel=1e-9), u


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e6])
def test_grad_clipping_equals_deepspeeds(max_norm, monkeypatch):
    import deepspeed.runtime.utils as dsu
    from deepspeed.runtime.utils import clip_grad_norm_
    monkeypatch.setattr(dsu.groups, "_get_data_parallel_group", lambda: None)  # one process, no group
    monkeypatch.setattr(dsu.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dsu.dist, "all_reduce", lambda tensor, *a, **k: tensor)
    from dstrain.engine.grad_norm import clip_to, total_grad_norm
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (2, 2, 2)]
    a = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    b = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for pa, pb in zip(a, b):
        pa.grad = torch.randn(pa.shape, generator=g)
        pb.grad = pa.grad.clone()
    norm = total_grad_norm(a)
    clip_to(a, max_norm, norm)
    ds_norm = clip_grad_norm_(b, max_norm)
    assert float(norm) == pytest.approx(float(ds_norm), rel=1e-6)
    for pa, pb in zip(a, b):
        assert torch.allclose(pa.grad, pb.grad, rtol=1e-6, atol=0)
    coef = min(1.0, max_norm / (float(ds_norm) + 1e-6))
    assert (coef < 1) == (max_norm < float(norm))
