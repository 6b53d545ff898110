"""A sparse embedding table trained by distributed sign-SGD, beside the DeepSpeed engine.

HRM gives every puzzle identifier its own embedding vector. The table can be far larger
than what one step touches, so it is kept out of the engine (no dense gradients, no Adam
moments, no ZeRO partitioning) and updated here, one step at a time, only where a row
was used:

1. :meth:`SparseEmbedding.lookup` copies the rows of this rank's ids into a leaf
   tensor that requires grad; the model reads the puzzle embedding from it.
2. After the engine's backward, :meth:`SparseSignSGD.step` all-gathers every rank's
   ids and row gradients, sums the gradients of equal ids, and updates each touched
   row once: ``w <- w * (1 - lr * weight_decay) - lr * sign(g)`` (decoupled decay).

Every rank applies the same update to its full copy, so the copies stay identical.
Since sign(g) does not depend on how the loss is scaled, a per-rank mean loss gives
the same update as a single process averaging over the union of the batches.

Nothing here waits for the device: equal ids are summed by sorting and
``searchsorted`` (fixed shapes, no ``unique``), the id range is checked only for ids
still on the host, and with ``equal_counts`` (every rank passes the same number of
ids, as the HRM trainer's fixed batch does) the all-gather needs no size exchange.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class SparseEmbedding:
    """An ``[num_ids, dim]`` fp32 table outside autograd; :meth:`lookup` returns a grad leaf."""

    def __init__(self, num_ids: int, dim: int, init_std: float = 0.0, device=None,
                 generator: torch.Generator | None = None):
        if num_ids < 1 or dim < 1:
            raise ValueError(f"SparseEmbedding needs num_ids >= 1 and dim >= 1, got {num_ids}, {dim}")
        self.weight = torch.zeros(num_ids, dim, device=device)
        if init_std > 0:
            self.weight.normal_(0.0, init_std, generator=generator)
        self.ids: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    @property
    def num_ids(self) -> int:
        return self.weight.shape[0]

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``weight[ids]`` as a new leaf that requires grad (kept for :meth:`SparseSignSGD.step`).

        Ids on the host are range-checked first; ids already on an accelerator are not
        (that check would wait for the device).
        """
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {list(ids.shape)}")
        if ids.device.type == "cpu" and ids.numel() and (ids.min() < 0 or ids.max() >= self.num_ids):
            raise IndexError(f"puzzle ids must be in [0, {self.num_ids}), got [{int(ids.min())}, {int(ids.max())}]")
        ids = ids.to(self.weight.device, non_blocking=True).long()
        self.ids = ids
        self.rows = self.weight[ids].detach().requires_grad_(True)
        return self.rows

    def state_dict(self) -> dict:
        return {"weight": self.weight.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        weight = state["weight"]
        if weight.shape != self.weight.shape:
            raise ValueError(f"puzzle embedding table shape {list(weight.shape)} does not match "
                             f"{list(self.weight.shape)}")
        self.weight.copy_(weight)


def _all_gather_rows(ids: torch.Tensor, grads: torch.Tensor, group=None, equal_counts: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate every rank's ``ids`` and ``grads`` (ranks may hold different counts unless
    ``equal_counts``, which skips the size exchange and its wait)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return ids, grads
    world = dist.get_world_size(group)
    if equal_counts:
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        all_grads = [torch.empty_like(grads) for _ in range(world)]
        dist.all_gather(all_ids, ids, group=group)
        dist.all_gather(all_grads, grads.contiguous(), group=group)
        return torch.cat(all_ids), torch.cat(all_grads)
    count = torch.tensor([ids.numel()], dtype=torch.long, device=ids.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c.item()) for c in counts]
    most = max(sizes)
    pad = most - ids.numel()
    ids_p = torch.cat([ids, ids.new_zeros(pad)])
    grads_p = torch.cat([grads, grads.new_zeros(pad, grads.shape[1])])
    all_ids = [torch.empty_like(ids_p) for _ in range(world)]
    all_grads = [torch.empty_like(grads_p) for _ in range(world)]
    dist.all_gather(all_ids, ids_p, group=group)
    dist.all_gather(all_grads, grads_p, group=group)
    return (torch.cat([t[:n] for t, n in zip(all_ids, sizes)]),
            torch.cat([t[:n] for t, n in zip(all_grads, sizes)]))


class SparseSignSGD:
    """Distributed sign-SGD with decoupled weight decay over the rows touched in a step."""

    def __init__(self, embedding: SparseEmbedding, lr: float, weight_decay: float = 0.0, group=None,
                 equal_counts: bool = False):
        if lr < 0 or weight_decay < 0:
            raise ValueError(f"lr and weight_decay must not be negative, got {lr}, {weight_decay}")
        self.embedding, self.lr, self.weight_decay, self.group = embedding, lr, weight_decay, group
        self.equal_counts = equal_counts

    @torch.no_grad()
    def update(self, ids: torch.Tensor, grads: torch.Tensor, lr: float | None = None,
               ok: torch.Tensor | None = None) -> torch.Tensor:
        """Apply one step for this rank's ``ids`` ``[n]`` and row gradients ``[n, dim]``.

        Collective: every rank must call it. Returns the ids of every rank, sorted (an id
        appears once per use; each distinct id is updated once). ``ok``: a device scalar whose
        0 leaves the rows as they were (the engine's deferred non-finite verdict, ``Engine.step_ok``).
        """
        lr = self.lr if lr is None else lr
        weight = self.embedding.weight
        if grads.shape != (ids.numel(), weight.shape[1]):
            raise ValueError(f"grads must be [{ids.numel()}, {weight.shape[1]}], got {list(grads.shape)}")
        ids, grads = _all_gather_rows(ids.to(weight.device).long(), grads.to(weight), self.group,
                                      self.equal_counts)
        ids, order = torch.sort(ids)
        first = torch.searchsorted(ids, ids)  # each position -> the first position of its id
        summed = torch.zeros_like(grads).index_add_(0, first, grads[order])[first]
        rows = weight[ids] * (1.0 - lr * self.weight_decay) - lr * torch.sign(summed)
        if ok is not None:
            rows = torch.where(ok.to(weight.device) > 0, rows, weight[ids])
        weight.index_copy_(0, ids, rows)  # repeated ids write identical rows
        return ids

    def step(self, lr: float | None = None, ok: torch.Tensor | None = None) -> torch.Tensor:
        """Update from the last :meth:`SparseEmbedding.lookup` and its gradient (zeros if none); ``ok`` as
        in :meth:`update`."""
        emb = self.embedding
        if emb.ids is None or emb.rows is None:
            raise RuntimeError("SparseSignSGD.step() before SparseEmbedding.lookup()")
        grad = emb.rows.grad if emb.rows.grad is not None else torch.zeros_like(emb.rows)
        touched = self.update(emb.ids, grad, lr, ok)
        emb.ids = emb.rows = None
        return touched
