"""Optimizer state for parameters that arrive after the optimizer was built.

DeepSpeed's unfused 16-bit wrapper (bf16/fp16 without ZeRO, for optimizers other than
Adam/AdamW) swaps each group's parameters for fp32 copies after the optimizer was built,
then takes one step with zero gradients to create their state. Adagrad makes its state
(``sum``, ``step``) in its constructor: torch 2.13's ``step`` creates it for parameters
without one, torch 2.11's does not and fails with ``KeyError: 'sum'`` (the GPU test
machine runs 2.11). :func:`init_missing_state` gives such parameters what the constructor
would have given them, and :class:`LazyStateAdagrad` does so before every step.
"""
from __future__ import annotations

import torch


def init_missing_state(opt: torch.optim.Optimizer) -> None:
    """Give each parameter of ``opt`` that has no state what ``opt``'s constructor would give it, with
    its group's options (nothing for optimizers that create state lazily in ``step``, like Adam)."""
    for group in opt.param_groups:
        bare = [p for p in group["params"] if p not in opt.state]
        if not bare:
            continue
        try:
            fresh = type(opt)(bare, **{k: group[k] for k in opt.defaults if k in group})
        except TypeError:  # a constructor that does not take its defaults back: leave it to step
            return
        for p in bare:
            if fresh.state.get(p):
                opt.state[p] = fresh.state[p]


class LazyStateAdagrad(torch.optim.Adagrad):
    """``torch.optim.Adagrad`` whose step first creates the state of parameters swapped in after
    construction (what torch 2.13's Adagrad does itself); otherwise the same optimizer."""

    @torch.no_grad()
    def step(self, closure=None):
        init_missing_state(self)
        return super().step(closure)


def deepspeed_adagrad_client(ds_config: dict):
    """A client-optimizer callable for DeepSpeed when its JSON has it build a plain ``torch.optim.Adagrad``
    (type Adagrad, no optimizer offload: that runs DeepSpeed's CPU Adagrad): the same optimizer, from the
    same ``params``, as :class:`LazyStateAdagrad`. None for any other JSON."""
    from dstrain.engine.ds_config import describe_zero
    block = ds_config.get("optimizer")
    if not isinstance(block, dict) or str(block.get("type", "")).lower() != "adagrad":
        return None
    if describe_zero(ds_config)["offload_optimizer"]:
        return None
    params = dict(block.get("params") or {})
    return lambda groups: LazyStateAdagrad(groups, **params)


def client_optimizer(choice, ds_config: dict):
    """The optimizer callable ``deepspeed.initialize`` gets for an engine plan's optimizer ``choice``
    (``dstrain.engine.optim.OptimizerChoice`` or None) and DeepSpeed JSON: the one dstrain builds (plan.txt
    names it), or, where the JSON has DeepSpeed build a plain Adagrad, :func:`deepspeed_adagrad_client`;
    else None (DeepSpeed builds the optimizer)."""
    if choice is not None and choice.implementation != "deepspeed":
        return choice.factory()
    return deepspeed_adagrad_client(ds_config)


def drop_stale_optimizer_state(ds_engine) -> int:
    """Forget optimizer state kept for parameters the optimizer no longer holds; returns how many.

    DeepSpeed's unfused 16-bit wrapper keeps the state an optimizer made in its constructor for
    the replaced 16-bit tensors (Adagrad's sums), and ``state_dict()`` then fails on them (a
    KeyError at the first checkpoint). Copies still without state get what the optimizer's
    constructor gives a parameter (:func:`init_missing_state`).
    """
    inner = getattr(getattr(ds_engine, "optimizer", None), "optimizer", None)
    state = getattr(inner, "state", None)
    if not isinstance(state, dict) or not hasattr(inner, "param_groups"):
        return 0
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    stale = [p for p in state if id(p) not in held]
    for p in stale:
        del state[p]
    if stale:
        init_missing_state(inner)
    return len(stale)
