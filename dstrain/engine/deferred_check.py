"""The non-finite check without a host wait per step (``train.nonfinite_check=deferred``).

The synchronous check (``Engine.step``, ``resilience.NonFiniteGuard.check``) reads on the host whether the
step's loss or gradient norm is finite before the optimizer step: the host waits for the device every step, so
the device idles while the host then launches the optimizer step and prepares the next batch. Where the
device can skip an update by itself this check is deferred instead:

* the step's verdict is computed on the device (finite, or which rank's loss or gradient was not)
  and handed to the optimizer as ``found_inf``, the flag ``torch.amp.GradScaler`` gives the fused optimizers:
  PyTorch's fused Adam/AdamW and dstrain's :class:`~dstrain.optim.adam_atan2.AdamATan2` then leave weights,
  moments and step counts as they were, on the device, without the host knowing;
* the verdict is copied to the host without waiting (pinned memory and an event on CUDA), and read at the next
  step's boundary (:meth:`DeferredCheck.settle`), when the device has long finished it, or earlier where a
  trainer needs it (log steps, saves). The guard then does its usual bookkeeping one step late: skips
  counted, messages, and under ``stop`` a :class:`~dstrain.resilience.NonFiniteError` whose ``good_step`` is the
  bad step (its state is good: its update was not taken).

With several ranks the verdict is all-reduced on the device (one small collective, queued like the step's
others), so every rank skips the same steps; each rank's own losses and gradients (its ``GradWatch``, before
the gradients' all-reduce) name the rank, and a stop signal rides along, so all ranks stop at the same step.

It runs where all of this holds, else the synchronous check does: dstrain's own norm at ZeRO-0 without
DeepSpeed's 16-bit wrappers (``grad_norm.NormKeeper``; not fp16, whose loss scaler owns overflows; ZeRO-1/2/3
measure the norm inside their step), an optimizer that honours ``found_inf``, and a trainer whose other per-step
updates follow the device verdict (``Engine.step_ok``: HRM's puzzle embeddings and EMA). ``auto`` defers on
CUDA only, where the host wait costs.
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


def deferral_refusal(engine, check: str) -> str | None:
    """Why the non-finite check cannot be deferred on ``engine`` (an ``engine.Engine``; None: it can)."""
    from dstrain.resilience import base_optimizer
    if check == "auto" and engine.device.type != "cuda":
        return "auto defers on CUDA only"
    if getattr(engine.ds, "zenflow", False):
        return "ZenFlow steps its own way"
    keeper = engine._keeper
    if keeper is None or not keeper.guards_gradients or engine.plan.precision == "fp16":
        return ("it needs ZeRO stage 0 without DeepSpeed's fp16/bf16 optimizer wrappers, and not fp16 (ZeRO "
                "measures the norm inside its step)")
    return device_skip_support(base_optimizer(engine.ds))


def verdict(losses: list[torch.Tensor], norm: torch.Tensor, grads_bad: torch.Tensor | None = None,
            rank: int = 0, world_size: int = 1, stop: bool = False) -> torch.Tensor:
    """The step's verdict on the device, the same on every rank: ``[code, go_on]`` (int64), all-reduced with
    ``min`` over the ranks (on the device: no host wait). ``code``: ``r`` for a NaN/Inf loss on rank ``r``,
    ``W + r`` for a NaN/Inf gradient rank ``r`` produced (``grads_bad``: its ``GradWatch``, before the gradients'
    all-reduce), ``2W`` for a non-finite norm of the reduced gradients alone, ``3W`` for a good step (``W`` the
    world size): the lowest bad rank wins, losses first, as in the synchronous check. ``go_on`` is 0 when a stop
    signal reached some rank (``resilience.STOP_REQUESTED``), so every rank learns it at the same step."""
    from dstrain.runtime import all_reduce
    device = norm.device
    loss_bad = torch.zeros((), dtype=torch.bool, device=device)
    if losses:
        total = torch.stack([loss.detach().float().reshape(-1).sum().to(device) for loss in losses]).sum()
        loss_bad = ~torch.isfinite(total)
    local_grad_bad = torch.zeros((), dtype=torch.bool, device=device) if grads_bad is None else grads_bad.to(device)
    if grads_bad is None and world_size == 1:  # alone: the norm is this rank's gradients'
        local_grad_bad = ~torch.isfinite(norm.float())
    w = world_size
    code = torch.where(loss_bad, rank, torch.where(local_grad_bad, w + rank,
                                                   torch.where(torch.isfinite(norm.float()), 3 * w, 2 * w)))
    both = torch.stack([code.to(torch.int64), torch.full((), 0 if stop else 1, dtype=torch.int64, device=device)])
    return all_reduce(both, "min") if world_size > 1 else both


def decode(code: int, world_size: int) -> tuple[int | None, int | None]:
    """``verdict``'s code -> (rank of a non-finite loss, rank of a non-finite gradient), None where none; a
    non-finite norm of the reduced gradients alone counts as a gradient of rank 0."""
    w = world_size
    if code < w:
        return code, None
    if code < 2 * w:
        return None, code - w
    return (None, 0) if code < 3 * w else (None, None)


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

    def arm(self, optimizer, both: torch.Tensor) -> torch.Tensor:
        """Before the optimizer step: hand ``verdict``'s result to ``optimizer`` as ``found_inf``; returns the
        step's ``ok`` flag (float 1/0 on the device) for the trainer's other updates."""
        bad = (both[0] < 3 * self.guard.world_size).float()
        optimizer.found_inf = bad
        return 1.0 - bad

    @staticmethod
    def disarm(optimizer) -> None:
        """After the optimizer step (also when it failed): the next steps run without ``found_inf``."""
        if "found_inf" in vars(optimizer):
            del optimizer.found_inf

    def post(self, both: torch.Tensor, step: int) -> None:
        """After the optimizer step: start the verdict's copy to the host; it is read by :meth:`settle`."""
        if both.is_cuda:
            if self._host is None:
                self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
                self._event = torch.cuda.Event()
            self._host.copy_(both, non_blocking=True)
            self._event.record()
        else:
            self._host = both
        self._pending = step

    def step(self, engine) -> torch.Tensor:
        """``engine.step`` at a boundary (an ``engine.Engine``): the previous step's verdict is read (long computed
        by now), this step's goes to the optimizer as ``found_inf``; no wait for the device. Returns ``step_ok``."""
        from dstrain.resilience import STOP_REQUESTED, base_optimizer
        engine._phase("step")
        opt, n = base_optimizer(engine.ds), engine.ds.global_steps + 1
        self.settle(opt)  # the previous step's: may raise NonFiniteError
        engine._keeper.before_step(for_guard=True)
        losses, engine._losses = engine._losses, []
        watch = engine._grads
        both = verdict(losses, engine._keeper.norm, watch.take_on_device() if watch is not None else None,
                       self.guard.rank, self.guard.world_size, bool(STOP_REQUESTED[0]))
        ok = self.arm(opt, both)
        try:
            engine.ds.step()
        finally:
            self.disarm(opt)
        self.post(both, n)
        return ok

    def settle(self, optimizer) -> None:
        """Read the pending verdict (a wait only for the device work up to it) and apply the guard's policy;
        may raise ``NonFiniteError``. A bad step's host-side step counts (``AdamATan2``) are taken back."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        if self._event is not None:
            self._event.synchronize()
        code, go_on = self._host.tolist()
        loss_rank, grad_rank = decode(code, self.guard.world_size)
        self.last_taken = loss_rank is None and grad_rank is None
        if not self.last_taken and hasattr(optimizer, "uncount_last_step"):
            optimizer.uncount_last_step()
        self.guard.record(step, loss_rank, grad_rank, not go_on, self.name)
