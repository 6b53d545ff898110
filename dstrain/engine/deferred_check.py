"""The non-finite check without a host wait per step (``train.nonfinite_check=deferred``).

The synchronous check (``Engine.step``, ``resilience.NonFiniteGuard.check``) reads on the host whether the
step's loss or gradient norm is finite before the optimizer step: the host waits for the device every step, so
the device idles while the host then launches the optimizer step and prepares the next batch. Where the
device can skip an update by itself this check is deferred instead:

* the step's verdict is computed on the device (0: finite, 1: a non-finite loss, 2: a non-finite gradient)
  and handed to the optimizer as ``found_inf``, the flag ``torch.amp.GradScaler`` gives the fused optimizers:
  PyTorch's fused Adam/AdamW and dstrain's :class:`~dstrain.optim.adam_atan2.AdamATan2` then leave weights,
  moments and step counts as they were, on the device, without the host knowing;
* the verdict is copied to the host without waiting (pinned memory and an event on CUDA), and read at the next
  step's boundary (:meth:`DeferredCheck.settle`), when the device has long finished it, or earlier where a
  trainer needs it (log steps, saves). The guard then does its usual bookkeeping one step late: skips
  counted, messages, and under ``stop`` a :class:`~dstrain.resilience.NonFiniteError` whose ``good_step`` is the
  bad step (its state is good: its update was not taken).

It runs where all of this holds, else the synchronous check does: one process alone (peers would need the
verdict all-reduced before their steps), dstrain's own norm at ZeRO-0 without DeepSpeed's 16-bit wrappers
(``grad_norm.NormKeeper``; not fp16, whose loss scaler owns overflows), an optimizer that honours
``found_inf``, and a trainer whose other per-step updates follow the device verdict (``Engine.step_ok``:
HRM's puzzle embeddings and EMA). ``auto`` defers on CUDA only, where the host wait costs.
"""
from __future__ import annotations

import torch

def device_skip_support(optimizer) -> str | None:
    """Why ``optimizer`` cannot skip an update on the device given ``found_inf`` (None: it can)."""
    from dstrain.optim.adam_atan2 import AdamATan2
    if isinstance(optimizer, AdamATan2):
        return None
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        if optimizer.defaults.get("fused"):
            return None
        return f"torch.optim.{type(optimizer).__name__} without fused=True ignores found_inf"
    return f"{type(optimizer).__name__} takes no found_inf"


def verdict(losses: list[torch.Tensor], norm: torch.Tensor) -> torch.Tensor:
    """On the device: 1 if a loss is NaN/Inf, else 2 if the gradient norm is, else 0 (int32 scalar)."""
    device = norm.device
    loss_bad = torch.zeros((), dtype=torch.bool, device=device)
    if losses:
        total = torch.stack([loss.detach().float().reshape(-1).sum().to(device) for loss in losses]).sum()
        loss_bad = ~torch.isfinite(total)
    grad_bad = ~torch.isfinite(norm.float())
    return torch.where(loss_bad, 1, torch.where(grad_bad, 2, 0)).to(torch.int32)


class DeferredCheck:
    """The pending verdict of one engine's last optimizer step (see the module's docstring)."""

    def __init__(self, guard, name: str = ""):
        self.guard, self.name = guard, name
        self._host: torch.Tensor | None = None  # pinned on CUDA, reused step after step
        self._event = None
        self._pending: int | None = None  # the step whose verdict is in flight
        self.last_taken = True
        """Whether the last settled step's update was taken."""

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def arm(self, optimizer, code: torch.Tensor) -> torch.Tensor:
        """Before the optimizer step: hand ``code``'s verdict to ``optimizer`` as ``found_inf``; returns the
        step's ``ok`` flag (float 1/0 on the device) for the trainer's other updates."""
        bad = (code > 0).float()
        optimizer.found_inf = bad
        return 1.0 - bad

    @staticmethod
    def disarm(optimizer) -> None:
        """After the optimizer step (also when it failed): the next steps run without ``found_inf``."""
        if "found_inf" in vars(optimizer):
            del optimizer.found_inf

    def post(self, code: torch.Tensor, step: int) -> None:
        """After the optimizer step: start the verdict's copy to the host; it is read by :meth:`settle`."""
        if code.is_cuda:
            if self._host is None:
                self._host = torch.empty((), dtype=code.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(code, non_blocking=True)
            self._event.record()
        else:
            self._host = code
        self._pending = step

    def settle(self, optimizer) -> None:
        """Read the pending verdict (a wait only for the device work up to it) and apply the guard's policy;
        may raise ``NonFiniteError``. A bad step's host-side step counts (``AdamATan2``) are taken back."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        if self._event is not None:
            self._event.synchronize()
        code = int(self._host)
        self.last_taken = code == 0
        if code and hasattr(optimizer, "uncount_last_step"):
            optimizer.uncount_last_step()
        self.guard.record(step, code == 1, code == 2, self.name)
