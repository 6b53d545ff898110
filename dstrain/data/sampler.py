"""Stateless, resumable sampling of fixed-length windows from a token stream.

The stream is cut into non-overlapping windows of ``seq_len + 1`` tokens that
share their boundary token (window ``i`` covers ``tokens[i*seq_len : i*seq_len +
seq_len + 1]``; inputs are its first ``seq_len`` tokens, targets the last
``seq_len``). Global sample ``g`` (counting across steps) belongs to epoch
``g // num_windows`` and is window ``perm_e[g % num_windows]`` of that epoch's
seeded permutation. The order is a pure function of ``(seed, step)``, so resuming
at step ``s`` needs no sampler state in the checkpoint.

This also holds across world sizes: step ``s`` takes the same ``global_batch``
samples whatever the split ``micro_batch x grad_accum x world_size``, so a
checkpoint resumed on another number of ranks (``dstrain.reshard``) with the
global batch kept continues with exactly the samples the original run would have
used; :func:`WindowSampler.local_batch_indices` only decides which rank takes which.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

_EPOCH_SEED_STRIDE = 1_000_003
_PERM_CACHE_SIZE = 4


class WindowSampler:
    """Deterministic window order over a stream of ``num_tokens`` tokens.

    Args:
        num_tokens: length of the token stream.
        seq_len: tokens per training sequence (each window holds ``seq_len + 1``).
        seed: data-order seed; epoch ``e`` uses ``randperm`` seeded with
            ``seed * 1_000_003 + e``.
    """

    def __init__(self, num_tokens: int, seq_len: int, seed: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.num_tokens = int(num_tokens)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.num_windows = (self.num_tokens - 1) // self.seq_len
        if self.num_windows <= 0:
            raise ValueError(
                f"a stream of num_tokens={num_tokens} holds no window of seq_len={seq_len} "
                f"(needs at least seq_len + 1 = {seq_len + 1} tokens)"
            )
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        """The window order of ``epoch`` (a permutation of ``range(num_windows)``)."""
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(self.seed * _EPOCH_SEED_STRIDE + epoch)
            perm = torch.randperm(self.num_windows, generator=gen)
            self._perms[epoch] = perm
            while len(self._perms) > _PERM_CACHE_SIZE:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return perm

    def global_indices(self, step: int, global_batch: int, first_sample: int | None = None) -> torch.Tensor:
        """Window indices of the ``global_batch`` samples of optimizer step ``step``.

        Returns a ``LongTensor[global_batch]``: sample ``g`` in
        ``[step * global_batch, (step + 1) * global_batch)`` is window
        ``perm_e[g % num_windows]`` with ``e = g // num_windows``. ``first_sample``, when given, is
        where the step starts instead of ``step * global_batch`` (a run resumed with another global batch
        continues at the sample its checkpoint reached).
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {global_batch}")
        start = step * global_batch if first_sample is None else int(first_sample)
        if start < 0:
            raise ValueError(f"first_sample must be >= 0, got {start}")
        g = torch.arange(start, start + global_batch, dtype=torch.long)
        epochs = g // self.num_windows
        offsets = g % self.num_windows
        out = torch.empty_like(g)
        for e in torch.unique(epochs).tolist():
            mask = epochs == e
            out[mask] = self.epoch_permutation(e)[offsets[mask]]
        return out

    def local_batch_indices(
        self, step: int, micro_batch: int, grad_accum: int, rank: int, world_size: int,
        first_sample: int | None = None,
    ) -> torch.Tensor:
        """This rank's window indices for ``step`` as ``LongTensor[grad_accum, micro_batch]``.

        The global batch (``micro_batch * grad_accum * world_size`` samples) is
        viewed as ``[grad_accum, world_size, micro_batch]`` and rank ``r`` takes
        ``[:, r, :]``; row ``k`` is the micro-batch of accumulation step ``k``.
        """
        for name, value in (("micro_batch", micro_batch), ("grad_accum", grad_accum),
                            ("world_size", world_size)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        gb = micro_batch * grad_accum * world_size
        view = self.global_indices(step, gb, first_sample).view(grad_accum, world_size, micro_batch)
        return view[:, rank, :].clone()


def get_batch(
    tokens: torch.Tensor, window_indices: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather windows from a 1-D token stream.

    Args:
        tokens: the stream (any integer dtype).
        window_indices: window numbers, shape ``[n]`` (any shape is accepted;
            outputs then have shape ``[*window_indices.shape, seq_len]``).
        seq_len: tokens per sequence (the sampler's ``seq_len``).

    Returns:
        ``(inputs, targets)`` as int64, ``targets`` being ``inputs`` shifted by one.
    """
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
    num_windows = (tokens.numel() - 1) // seq_len
    idx = window_indices.to(device=tokens.device, dtype=torch.long)
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= num_windows):
        raise IndexError(
            f"window index out of range [0, {num_windows}) for a stream of "
            f"{tokens.numel()} tokens at seq_len={seq_len}"
        )
    positions = idx.unsqueeze(-1) * seq_len + torch.arange(seq_len + 1, device=tokens.device)
    windows = tokens[positions].long()
    return windows[..., :-1], windows[..., 1:]
