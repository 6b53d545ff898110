"""Polyak (exponential moving average) update of a target network, in place and in chunks.

``polyak_update_(target, source, tau)`` sets, for every parameter (and optionally buffer)
of the same name::

    target <- (1 - tau) * target + tau * source        (torch.lerp_, exact at tau = 1)

without gradient, one parameter at a time and in flat chunks of at most ``chunk_numel``
elements, so the only temporary is one chunk of the source converted to the target's
device and dtype (none when they already agree). No second copy of the model is ever
made, which matters when the target is a multi-billion-parameter critic kept on the CPU
while the critic trains on a GPU.

ZeRO-3 (parameters carrying ``ds_id`` / ``ds_tensor``): a partitioned parameter holds
only its rank's flat slice ``[r * s, (r + 1) * s)`` of the padded parameter in
``p.ds_tensor`` (``s = ds_tensor.ds_numel``, ``r`` = rank in ``p.ds_process_group``);
``p.data`` is an empty placeholder. Then:

* target and source partitioned alike (same slice size and rank): the local shards are
  updated directly, no communication;
* target plain, source partitioned: the source is gathered ONE parameter at a time
  (``deepspeed.zero.GatheredParameters([p])``, read only) and the target read from it;
* target partitioned, source plain (or partitioned differently): the target's own shard
  is updated from the matching slice of the (gathered) source.

Writes always go to storage that persists (the plain tensor or ``ds_tensor``), never
into a gathered copy that DeepSpeed releases. Gathering is a collective: with a
partitioned source every rank must call ``polyak_update_`` with the same modules. The
target must not be a trained engine (its optimizer's fp32 master weights would overwrite
the shard on the next step), and ZeRO++ secondary partitions (hpZ) are refused because
they would go stale.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def _full_shape(p: torch.Tensor) -> tuple:
    return tuple(getattr(p, "ds_shape", p.shape)) if _is_partitioned(p) else tuple(p.shape)


def _check_tau(tau: float) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or not 0 < tau <= 1:
        raise ValueError(f"polyak tau must satisfy 0 < tau <= 1, got {tau!r}")
    return float(tau)


def _pairs(target: nn.Module, source: nn.Module, buffers: bool) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, target tensor, source tensor) matched by name; ValueError listing every mismatch."""
    def tensors(module):
        out = dict(module.named_parameters())
        if buffers:
            out.update(module.named_buffers())
        return out

    tgt, src = tensors(target), tensors(source)
    problems = []
    missing_src = sorted(set(tgt) - set(src))
    missing_tgt = sorted(set(src) - set(tgt))
    if missing_src:
        problems.append(f"only in target: {', '.join(missing_src)}")
    if missing_tgt:
        problems.append(f"only in source: {', '.join(missing_tgt)}")
    shapes = [f"{n} target {list(_full_shape(tgt[n]))} vs source {list(_full_shape(src[n]))}"
              for n in tgt if n in src and _full_shape(tgt[n]) != _full_shape(src[n])]
    if shapes:
        problems.append(f"shape mismatch: {'; '.join(shapes)}")
    if problems:
        raise ValueError("polyak_update_: target and source do not match: " + " | ".join(problems))
    return [(n, tgt[n], src[n]) for n in tgt]


def _lerp_flat_(dst: torch.Tensor, src: torch.Tensor, tau: float, chunk_numel: int, stages: dict) -> None:
    """dst <- lerp(dst, src, tau) over flat 1-D views, ``chunk_numel`` elements at a time.

    A source that needs moving or converting goes through one staging chunk per (device,
    dtype), kept in ``stages`` and reused by every parameter of the call.
    """
    n = dst.numel()
    if src.numel() != n:
        raise ValueError(f"internal: flat sizes differ ({n} vs {src.numel()})")
    stage = None
    if n and (src.device != dst.device or src.dtype != dst.dtype):
        key = (dst.device, dst.dtype)
        stage = stages.get(key)
        if stage is None or stage.numel() < min(n, chunk_numel):  # grows to at most one chunk
            stage = stages[key] = torch.empty(min(n, chunk_numel), dtype=dst.dtype, device=dst.device)
    for start in range(0, n, chunk_numel):
        d = dst[start:start + chunk_numel]
        s = src[start:start + chunk_numel]
        if stage is not None:
            s = stage[:d.numel()].copy_(s)
        if d.is_floating_point() or d.is_complex():
            d.lerp_(s, tau)
        else:  # integer buffers (e.g. BatchNorm's num_batches_tracked) are copied
            d.copy_(s)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1)  # contiguity is checked up front (a gathered parameter is contiguous)


def _shard_range(p: torch.Tensor) -> tuple[int, int, int]:
    """(flat start, shard size, valid elements) of this rank's ZeRO-3 shard of ``p``."""
    import torch.distributed as dist
    size = p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel()
    rank = dist.get_rank(group=p.ds_process_group) if dist.is_initialized() else 0
    start = rank * size
    valid = max(0, min(size, p.ds_numel - start))
    return start, size, valid


def _check_shard(name: str, p: torch.Tensor) -> None:
    if getattr(p, "ds_secondary_tensor", None) is not None:
        raise NotImplementedError(f"polyak_update_: {name} has a ZeRO++ secondary partition (hpZ), "
                                  "which an in-place shard update would leave stale")


def _gathered(p: torch.Tensor):
    """Read-only full view of a partitioned source parameter (a no-op context for plain ones)."""
    if not _is_partitioned(p):
        return contextlib.nullcontext()
    import deepspeed
    return deepspeed.zero.GatheredParameters([p], modifier_rank=None)


@torch.no_grad()
def polyak_update_(target: nn.Module, source: nn.Module, tau: float, chunk_numel: int = 1 << 20,
                   buffers: bool = False) -> None:
    """In place: ``target <- (1 - tau) * target + tau * source`` for every parameter of the same name.

    ``tau`` must be in (0, 1] (1 copies the source); ``chunk_numel`` bounds the temporaries
    (elements per chunk); ``buffers=True`` also averages floating buffers and copies integer
    ones. Target and source may live on different devices and dtypes. Raises ValueError
    listing every name that is missing on one side or whose shape differs.
    """
    tau = _check_tau(tau)
    if isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1:
        raise ValueError(f"chunk_numel must be a positive integer, got {chunk_numel!r}")
    pairs = _pairs(target, source, buffers)
    strided = [n for n, t, s in pairs for x in (t, s) if not _is_partitioned(x) and not x.is_contiguous()]
    if strided:  # checked before anything is written
        raise ValueError(f"polyak_update_ needs contiguous tensors (updated through flat views): "
                         f"{', '.join(sorted(set(strided)))}")
    stages: dict = {}
    for name, t, s in pairs:
        t_part, s_part = _is_partitioned(t), _is_partitioned(s)
        if not t_part:
            with _gathered(s):
                _lerp_flat_(_flat(t.data), _flat(s.data), tau, chunk_numel, stages)
            continue
        _check_shard(name, t)
        start, size, valid = _shard_range(t)
        shard = t.ds_tensor.data.view(-1)
        if s_part:
            _check_shard(name, s)
            if _shard_range(s) == (start, size, valid) and s.ds_tensor.numel() == t.ds_tensor.numel():
                _lerp_flat_(shard[:valid], s.ds_tensor.data.view(-1)[:valid], tau, chunk_numel, stages)
                continue
        if valid == 0:  # this rank's shard is pure padding, but a partitioned source still gathers
            with _gathered(s):
                pass
            continue
        with _gathered(s):
            _lerp_flat_(shard[:valid], _flat(s.data)[start:start + valid], tau, chunk_numel, stages)
