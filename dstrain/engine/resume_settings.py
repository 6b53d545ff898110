"""A resumed run trains with its own optimizer settings, not the checkpoint's.

DeepSpeed's ``load_checkpoint`` restores the optimizer's parameter groups whole (learning rate, betas, weight
decay, eps) and the scheduler's base learning rates, so a run resumed with ``--train.lr`` (or
``train.weight_decay``, ``train.betas``) changed, as one does to continue with a lower rate after a loss spike,
went on with the checkpoint's values and said nothing (and HRM's puzzle-embedding rate, scaled by the engine's
rate over ``train.lr``, by a wrong factor). What the checkpoint must give back (weights, optimizer moments, the
step count, the schedule's position) it still does: only the settings the run config decides are put back.
"""
from __future__ import annotations

import contextlib

import torch

_STATE_OF_THE_RUN = ("params", "lr", "initial_lr", "step")
"""Group keys that are not settings: the parameters, the rate the schedule set for the current step (rescaled
below) and a step counter some optimizers keep there."""


def _scheduler(ds):
    sched = getattr(ds, "lr_scheduler", None)
    return sched if isinstance(getattr(sched, "base_lrs", None), list) else None


def snapshot(ds) -> dict:
    """This run's optimizer settings (per parameter group) and the scheduler's base rates, before a load."""
    from dstrain.resilience import base_optimizer
    opt = base_optimizer(ds)
    # OneCycle's cycled momentum is the schedule's position, not a setting (reapply_schedule sets it)
    state = _STATE_OF_THE_RUN + (("betas",) if getattr(getattr(ds, "lr_scheduler", None), "cycle_momentum", False)
                                 else ())
    groups = [{k: v for k, v in g.items() if k not in state} for g in getattr(opt, "param_groups", [])]
    sched = _scheduler(ds)
    return {"groups": groups, "base_lrs": list(sched.base_lrs) if sched is not None else None}


def restore(ds, fresh: dict) -> list[str]:
    """Put this run's settings ``fresh`` (:func:`snapshot`) back after a load; what the checkpoint had
    differently, as ``name old -> new`` (group 0's, one entry per setting)."""
    from dstrain.resilience import base_optimizer
    opt = base_optimizer(ds)
    groups = getattr(opt, "param_groups", [])
    changed: dict[str, str] = {}
    for group, own in zip(groups, fresh["groups"]):
        for key, value in own.items():
            if key in group and group[key] != value:
                changed.setdefault(key, f"{key} {_show(group[key])} -> {_show(value)}")
            group[key] = value
    sched = _scheduler(ds)
    if sched is not None and fresh["base_lrs"] is not None and len(fresh["base_lrs"]) == len(sched.base_lrs):
        lambdas = getattr(sched, "lr_lambdas", None)
        for i, (old, new) in enumerate(zip(sched.base_lrs, fresh["base_lrs"])):
            if old == new:
                continue
            changed.setdefault("lr", f"lr {_show(old)} -> {_show(new)}")
            if i < len(groups):  # the rate of the next step: the schedule's factor now, on the new base
                factor = (groups[i]["lr"] / old if old else
                          lambdas[i](sched.last_epoch) if lambdas and callable(lambdas[i]) else 1.0)
                groups[i]["lr"] = new * factor
                if "initial_lr" in groups[i]:
                    groups[i]["initial_lr"] = new
        sched.base_lrs = list(fresh["base_lrs"])
        if hasattr(sched, "_last_lr"):
            sched._last_lr = [g["lr"] for g in groups]
    reapply_schedule(ds)
    return list(changed.values())


def reapply_schedule(ds) -> None:
    """Set the rate (and OneCycle's cycled momentum) of the next update from this run's schedule at the position
    the checkpoint left it. The optimizer's groups come back holding the rate the checkpoint's schedule set, and a
    schedule only writes its next value after the first update, so a run resumed with its schedule changed
    (``train.steps`` raised to go on, ``train.warmup_steps`` or ``train.min_lr_ratio``, or a scheduler block's
    ``total_num_steps``) took that first update at the old schedule's rate: steps 6 -> 12 resumed at step 6, the
    old cosine's floor (0.1 lr) for the new one's 0.69 lr. Schedules without a closed form of their position
    (torch's other classes, whose whole state the checkpoint restores) are left as loaded."""
    sched = getattr(ds, "lr_scheduler", None)
    groups = getattr(getattr(sched, "optimizer", None), "param_groups", None)
    if sched is None or not groups:
        return
    rates, momenta = None, None
    if type(sched) is torch.optim.lr_scheduler.LambdaLR:  # dstrain's warm-up + cosine (not MultiplicativeLR's product)
        rates = [base * f(sched.last_epoch) for base, f in zip(sched.base_lrs, sched.lr_lambdas)]
    elif isinstance(getattr(sched, "last_batch_iteration", None), int) and callable(getattr(sched, "get_lr", None)):
        if sched.last_batch_iteration < 0:
            return  # DeepSpeed's schedules before their first step: the construction's rates stand
        rates = list(sched.get_lr())  # DeepSpeed's schedules: a closed form of last_batch_iteration
        if getattr(sched, "cycle_momentum", False) and callable(getattr(sched, "get_mom", None)):
            momenta = sched.get_mom()
    if rates is None or len(rates) != len(groups):
        return
    for group, rate in zip(groups, rates):
        group["lr"] = rate
    if momenta is not None and len(momenta) == len(groups):
        for group, mom in zip(groups, momenta):  # as OneCycle's own step sets them
            group["betas"] = mom
    if hasattr(sched, "_last_lr"):
        sched._last_lr = list(rates)


@contextlib.contextmanager
def kept(ds, changes: list | None = None):
    """Inside: load a checkpoint into DeepSpeed engine ``ds``; after: this run's settings are back (what
    differed appended to ``changes``)."""
    fresh = snapshot(ds)
    yield
    found = restore(ds, fresh)
    if changes is not None:
        changes.extend(found)


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return str(value)
