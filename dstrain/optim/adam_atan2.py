"""AdamATan2: Adam whose ``m / (sqrt(v) + eps)`` is replaced by ``atan2(m, sqrt(v))``.

Everett et al. 2024 ("Scaling Exponents Across Parameterizations and Optimizers") drop
Adam's epsilon by bounding the ratio with ``atan2``: near zero it is the ratio itself, it
never exceeds pi/2 in size, and it is invariant to the scale of the gradients. The HRM
reference trains with it (lr 7e-5 / 1e-4, weight decay 1.0, betas 0.9 / 0.95).

Per element, at step ``t`` (the rule of the HRM reference's CUDA kernel)::

    p <- p * (1 - lr * weight_decay)                   # decoupled weight decay, first
    m <- m + (1 - beta1) * (g - m)
    v <- v + (1 - beta2) * (g * g - v)
    p <- p - lr / (1 - beta1**t) * atan2(m, sqrt(v) / sqrt(1 - beta2**t))

The bias correction of the first moment scales the step, not the ``atan2`` argument.
Moments live in the parameter's dtype (fp32 master weights under DeepSpeed's bf16/fp16
and ZeRO; fp32 weights under autocast). The step count is a CPU scalar tensor per
parameter, as in ``torch.optim.AdamW``, so reading it never syncs a GPU. Implemented
with PyTorch's foreach ops: a fixed number of kernels per parameter group, whatever its size.

Like PyTorch's fused Adam it honours a ``found_inf`` attribute (a device scalar, 1: skip), the way
``torch.amp.GradScaler`` and dstrain's deferred non-finite check (``dstrain.engine.deferred_check``) hand it
over: a step with ``found_inf`` 1 leaves weights and moments exactly as they were, decided on the device.
Its step counts are host scalars, so they move on regardless; :meth:`AdamATan2.uncount_last_step` takes
them back once the host has read the flag (before the next step).
"""
from __future__ import annotations

import math

import torch


class AdamATan2(torch.optim.Optimizer):
    """Epsilon-free Adam with ``atan2`` (see the module doc); a drop-in for ``torch.optim.AdamW``."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 1e-2):
        if not (isinstance(lr, (int, float)) and lr >= 0):
            raise ValueError(f"AdamATan2: lr must be a non-negative number, got {lr!r}")
        betas = tuple(betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamATan2: betas must be two numbers in [0, 1), got {betas!r}")
        if not weight_decay >= 0:
            raise ValueError(f"AdamATan2: weight_decay must be non-negative, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._counted = []
        for group in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamATan2 does not take sparse gradients")
                state = self._init_state(p)
                params.append(p)
                grads.append(p.grad)
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if params:
                self._update(group, params, grads, avgs, sqs, steps, getattr(self, "found_inf", None))
                self._counted += steps
        return loss

    def uncount_last_step(self) -> None:
        """Take back the step counts the last ``step`` added (it was skipped through ``found_inf``)."""
        for count in getattr(self, "_counted", []):
            count.sub_(1.0)
        self._counted = []

    @staticmethod
    def _update(group, params, grads, avgs, sqs, steps, found_inf=None) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        torch._foreach_add_(steps, 1.0)
        counts = [float(t) for t in steps]  # CPU tensors: no device sync
        if found_inf is not None:  # skip on the device: gradients, moment rates and the step times ok (1 or 0)
            _masked_update(lr, wd, beta1, beta2, counts, params, grads, avgs, sqs, found_inf)
            return
        if wd != 0:
            torch._foreach_mul_(params, 1.0 - lr * wd)
        torch._foreach_lerp_(avgs, grads, 1.0 - beta1)
        torch._foreach_lerp_(sqs, torch._foreach_mul(grads, grads), 1.0 - beta2)
        updates = _ratio_atan(avgs, sqs, beta2, counts, any(p.dtype == torch.float16 for p in params))
        torch._foreach_mul_(updates, [-lr / (1.0 - beta1 ** n) for n in counts])
        torch._foreach_add_(params, updates)


def _ratio_atan(avgs, sqs, beta2: float, counts: list[float], fp16: bool) -> list[torch.Tensor]:
    """``atan2(m, sqrt(v) / sqrt(1 - beta2**t))`` per tensor (see ``AdamATan2._update``)."""
    denoms = torch._foreach_sqrt(sqs)
    torch._foreach_div_(denoms, [math.sqrt(1.0 - beta2 ** n) for n in counts])
    if fp16:  # too narrow for the floor below: per tensor
        return [torch.atan2(m, d) for m, d in zip(avgs, denoms)]
    # atan2(m, d) with d >= 0 is atan(m / d) once d is raised to fp32's smallest normal number
    # (1.2e-38; bf16 shares its range): 0 / 0 (no gradient yet) becomes atan(0) = 0 and m / 0
    # +-pi/2, atan2's values at d = 0. PyTorch has no foreach atan2; this keeps the number of
    # kernels fixed. (For fp64 moments, only a d below 1.2e-38 is moved.)
    torch._foreach_maximum_(denoms, torch.finfo(torch.float32).tiny)
    updates = torch._foreach_div(avgs, denoms)
    torch._foreach_atan_(updates)
    return updates


def _masked_update(lr, wd, beta1, beta2, counts, params, grads, avgs, sqs, found_inf) -> None:
    """The update with every change multiplied by ``ok = 1 - found_inf`` (a device scalar): exact when ok is 1,
    no change at all when it is 0. The gradients are zeroed first where ok is 0 (they hold the NaN/Inf
    that set the flag, and 0 x NaN is NaN), so the moments' and weights' changes are exact zeros."""
    # the flag in the parameters' precision (at least fp32): an fp32 ok made 1 - lr * wd and 1 - beta fp32
    # numbers, off by up to 6e-8 relative for fp64 parameters (the unmasked update uses exact scalars)
    ok = 1.0 - found_inf.to(torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32)
    safe = torch._foreach_mul(grads, ok.to(grads[0].dtype))
    for g in safe:
        torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
    if wd != 0:
        torch._foreach_mul_(params, (1.0 - lr * wd * ok).to(params[0].dtype))
    for moments, target, beta in ((avgs, safe, beta1), (sqs, torch._foreach_mul(safe, safe), beta2)):
        step = torch._foreach_sub(target, moments)  # m + (1 - beta) * ok * (g - m)
        torch._foreach_mul_(step, ((1.0 - beta) * ok).to(moments[0].dtype))
        torch._foreach_add_(moments, step)
    updates = _ratio_atan(avgs, sqs, beta2, counts, any(p.dtype == torch.float16 for p in params))
    torch._foreach_mul_(updates, [-lr / (1.0 - beta1 ** n) for n in counts])
    torch._foreach_mul_(updates, ok.to(updates[0].dtype))
    torch._foreach_add_(params, updates)
