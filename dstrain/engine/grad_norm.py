"""Gradient norms in a few multi-tensor kernels: clipping at ZeRO stage 0 (kept for the log), and
ZeRO-1/2's norm (:func:`fast_zero_norm`).

Without ZeRO and without DeepSpeed's own fp16/bf16 optimizer wrappers (fp32 weights, or bf16 as
``torch.autocast`` over fp32 weights: the factory's choice on a GPU at ZeRO-0), DeepSpeed clips in
``engine.clip_fp32_gradients`` with ``deepspeed.runtime.utils.clip_grad_norm_``: per parameter a
``.float().norm()`` and later a ``mul_``, i.e. several hundred kernel launches for a GPT of a few
hundred tensors, plus an all-reduce of the norm over the data-parallel group, and it then drops the
norm (``get_global_grad_norm()`` stays None, so nothing was logged). On a GPU those launches come
after the step's one host synchronisation (the non-finite check), with the device idle.

:class:`NormKeeper` replaces that call on the engine instance with the same computation done by
``torch._foreach_norm`` / ``torch._foreach_mul_`` per (device, dtype) group (what
``torch.nn.utils.clip_grad_norm_`` does), keeps the norm as a device tensor (read on log steps only),
and measures it without clipping where DeepSpeed does not clip (``gradient_clipping`` 0). The
clipping factor is DeepSpeed's: ``min(1, max_norm / (norm + 1e-6))``. Tensor-parallel shards
(parameters tagged ``model_parallel``) are summed over the tensor-parallel group; replicated
parameters are counted once. The data-parallel all-reduce of the norm is left out: at stage 0 every
data-parallel rank holds the same averaged gradients when the step runs.
"""
from __future__ import annotations

from collections import defaultdict

import torch


def _by_device_dtype(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    return list(groups.values())


def _fp32_norms(group: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm, accumulated in fp32 (16-bit gradients are not copied to do it)."""
    if group[0].dtype not in (torch.float16, torch.bfloat16):
        return torch._foreach_norm(group, 2)
    try:
        return torch._foreach_norm(group, 2, dtype=torch.float32)
    except TypeError:  # a torch without the dtype argument
        return [torch.linalg.vector_norm(g, dtype=torch.float32) for g in group]


def _squared_norm(grads: list[torch.Tensor], device) -> torch.Tensor:
    """Sum of squares of every element of ``grads`` (fp32, on ``device``)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for group in _by_device_dtype(grads):
        total = total + (torch.linalg.vector_norm(torch.stack(_fp32_norms(group)).float()) ** 2).to(device)
    return total


def total_grad_norm(params: list[torch.nn.Parameter], tp_group=None) -> torch.Tensor:
    """The global 2-norm of the gradients of ``params`` (a device tensor; no host synchronisation)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].device
    if tp_group is None:
        return _squared_norm(grads, device).sqrt()
    import torch.distributed as dist
    sharded = _squared_norm([p.grad for p in params if p.grad is not None and getattr(p, "model_parallel", False)],
                            device)
    dist.all_reduce(sharded, group=tp_group)
    replicated = [p.grad for p in params if p.grad is not None and not getattr(p, "model_parallel", False)]
    return (sharded + _squared_norm(replicated, device)).sqrt()


def clip_to(params: list[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))`` in place (DeepSpeed's factor)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for group in _by_device_dtype([p.grad for p in params if p.grad is not None]):
        torch._foreach_mul_(group, coef.to(group[0].device, group[0].dtype))


class NormKeeper:
    """The stage-0 norm and clipping of one DeepSpeed engine (see the module's docstring)."""

    def __init__(self, ds_engine, tp_group=None):
        self.ds, self.tp_group = ds_engine, tp_group
        self.max_norm = float(ds_engine.gradient_clipping())
        self.norm: torch.Tensor | None = None
        """The last optimizer step's gradient norm, before clipping."""
        if self.max_norm > 0:
            ds_engine.clip_fp32_gradients = self.clip  # an instance attribute: DeepSpeed's call finds it
        # Without clipping DeepSpeed never unscales fp16 autocast's gradients before its step: a norm
        # measured then would carry the loss scale, so none is kept there.
        self._measure = self.max_norm <= 0 and getattr(ds_engine, "torch_autocast_z0_gradscaler", None) is None
        self._fresh = False  # self.norm was measured for this step's gradients (clip reuses it)

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.ds.module.parameters() if p.grad is not None]

    def clip(self) -> None:
        params = self._params()
        if not self._fresh:
            self.norm = total_grad_norm(params, self.tp_group)
        self._fresh = False
        clip_to(params, self.max_norm, self.norm)

    def before_step(self, for_guard: bool = False) -> None:
        """At an accumulation boundary, before DeepSpeed's step: measure where DeepSpeed will not clip,
        and (``for_guard``) where the non-finite guard reads it; clipping then reuses this norm."""
        self._fresh = self._measure or for_guard
        if self._fresh:
            self.norm = total_grad_norm(self._params(), self.tp_group)

    @property
    def guards_gradients(self) -> bool:
        """Whether the norm can stand in for a non-finite check of the gradients: kept unscaled (not under
        fp16 autocast's loss scale). A NaN or Inf element makes the norm NaN or Inf; so does a finite
        gradient whose square leaves the fp32 range (|g| > 1.8e19)."""
        return getattr(self.ds, "torch_autocast_z0_gradscaler", None) is None

    def nonfinite(self) -> bool:
        """Whether the norm measured by ``before_step(for_guard=True)`` is NaN or Inf (one host read)."""
        return self.norm is not None and not bool(torch.isfinite(self.norm))

    def read(self) -> float | None:
        return None if self.norm is None else float(self.norm)


def keep_grad_norm(ds_engine, parallel=None) -> NormKeeper | None:
    """A :class:`NormKeeper` for ``ds_engine`` where DeepSpeed would clip per parameter and keep no norm
    (no ZeRO, no DeepSpeed fp16/bf16 wrapper); None elsewhere (ZeRO and the 16-bit wrappers keep theirs)."""
    if ds_engine.zero_optimization() or ds_engine.fp16_enabled() or ds_engine.bfloat16_enabled():
        return None
    tp_group = parallel.tp_group if parallel is not None and parallel.dims.tp > 1 else None
    return NormKeeper(ds_engine, tp_group)


def fast_zero_norm(ds_engine) -> bool:
    """ZeRO-1/2 (DeepSpeed's ``DeepSpeedZeroOptimizer``): its ``get_grad_norm_direct`` takes the norm of
    each gradient of the partition in a Python loop, each converted to fp64 first (a launch or three per
    parameter, 8 bytes written and read per element), before the step can go on. Replaced on the
    optimizer instance by the same selection (no padding, no pipeline-replicated parameter, model-parallel
    rank 0 for replicated ones), the same all-reduces over the data- and model-parallel groups and the
    same NaN/Inf masking, with the per-gradient norms of one ``torch._foreach_norm`` per (device, dtype)
    accumulated in fp32. Returns whether it was replaced (not for stage 3, offload, or other norms)."""
    try:
        from deepspeed import comm
        from deepspeed.runtime.constants import PIPE_REPLICATED
        from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        return False
    opt = ds_engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer) or getattr(opt, "cpu_offload", False):
        return False
    original = opt.get_grad_norm_direct

    def norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0:
            return original(gradients, params, norm_type)
        chosen = []
        for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or opt.model_parallel_rank == 0:
                chosen.append(g)
        total = _squared_norm(chosen, opt.device)
        comm.all_reduce(total, op=comm.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=total, op=comm.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    opt.get_grad_norm_direct = norm_direct
    return True
