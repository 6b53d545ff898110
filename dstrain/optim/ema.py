"""Exponential moving average (EMA) of a module's weights, for evaluation.

After every optimizer update ``shadow = d * shadow + (1 - d) * weight`` with
``d = min(decay, (1 + n) / (10 + n))`` at the ``n``-th update (0-based): the average
forgets its starting point fast early on (d = 0.1, 0.18, 0.25, ...) and settles at
``decay`` (0.999: an average over about the last 1,000 updates). The shadow is kept in
float32 on the weights' device. Evaluation swaps the shadow into the module and back
(:meth:`EMA.applied`); training never sees it.

Full (unsharded) parameters only: ZeRO stage 3 partitions them, and its callers refuse EMA.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class EMA:
    """EMA of the floating-point parameters of ``module`` (names as ``named_parameters`` gives)."""

    def __init__(self, module: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be within (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {name: p.detach().float().clone() for name, p in self._params(module)}

    @staticmethod
    def _params(module: torch.nn.Module):
        return [(n, p) for n, p in module.named_parameters() if p.dtype.is_floating_point]

    def rate(self) -> float:
        """The decay the next :meth:`update` uses."""
        return min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))

    @torch.no_grad()
    def update(self, module: torch.nn.Module, ok: torch.Tensor | None = None) -> None:
        """One average step. ``ok``: a device scalar whose 0 leaves the shadow as it is (the engine's deferred
        non-finite verdict, ``Engine.step_ok``: the weights did not move either); the count moves on, as
        the host cannot tell yet (the next steps' decay rises by one step's worth early in training)."""
        d = self.rate()
        for name, p in self._params(module):
            if ok is None:
                self.shadow[name].mul_(d).add_(p.detach().float(), alpha=1.0 - d)
            else:
                self.shadow[name].lerp_(p.detach().float(), (1.0 - d) * ok.to(p.device, torch.float32))
        self.updates += 1

    @contextmanager
    def applied(self, module: torch.nn.Module):
        """Inside the block the module's parameters hold the average; the weights come back after."""
        saved = {}
        with torch.no_grad():
            for name, p in self._params(module):
                saved[name] = p.detach().clone()
                p.copy_(self.shadow[name])
        try:
            yield module
        finally:
            with torch.no_grad():
                for name, p in self._params(module):
                    p.copy_(saved[name])

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict) -> None:
        missing = set(self.shadow) ^ set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state does not match the module: parameters {sorted(missing)[:5]} differ")
        self.updates = int(state["updates"])
        for name, value in state["shadow"].items():
            self.shadow[name].copy_(value)
