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
    groups = [{k: v for k, v in g.items() if k not in _STATE_OF_THE_RUN} for g in getattr(opt, "param_groups", [])]
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
    return list(changed.values())


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
