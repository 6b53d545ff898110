"""Cross-entropy of a linear LM head without materialising the ``[tokens, vocab]`` logits.

``linear_cross_entropy(x, weight, targets, chunk)`` equals
``F.cross_entropy((x @ weight.T).float(), targets, ignore_index=...)`` (mean over the
targets that are not ignored), but walks the tokens ``chunk`` rows at a time: each
chunk's fp32 logits live only while that chunk is processed, and when a gradient is
needed the chunk's gradients for ``x`` and ``weight`` are computed right there
(``softmax - onehot`` is the logits' gradient), so backward only scales stored
results. Peak extra memory: one chunk of logits plus ``x``'s and ``weight``'s
gradients, instead of ``tokens x vocab`` fp32 logits and their gradient; this is what
lets a long sequence (a dilated LM at a million tokens) or a large vocabulary train.

One deliberate difference from torch: when every target is ignored, torch's mean is 0 / 0 = nan;
here the loss is 0 with zero gradients (the count is clamped to 1), so a micro-batch that is all
padding adds nothing instead of turning the data-parallel average into nan.
"""
from __future__ import annotations

import torch


class _LinearCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, targets, chunk: int, ignore_index: int):
        n = x.shape[0]
        valid_all = targets != ignore_index
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        count = valid_all.sum().clamp(min=1).to(acc)
        want = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=acc, device=x.device)
        dx = torch.empty_like(x) if want else None
        dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want else None
        for start in range(0, n, chunk):
            xs, tgt = x[start:start + chunk], targets[start:start + chunk]
            valid = valid_all[start:start + chunk]
            logits = (xs @ weight.t()).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(valid, tgt, torch.zeros_like(tgt))
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            total = total + ((lse - picked) * valid).sum()
            if want:
                grad = torch.exp(logits - lse.unsqueeze(1))  # softmax, in place of the logits
                del logits
                grad.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(picked).unsqueeze(1))
                grad *= (valid.to(grad.dtype) / count).unsqueeze(1)
                g = grad.to(x.dtype)
                dx[start:start + chunk] = g @ weight
                dw += (g.t() @ xs).to(acc)
        if want:
            ctx.save_for_backward(dx, dw.to(weight.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors
        return dx * grad_loss.to(dx.dtype), dw * grad_loss.to(dw.dtype), None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 4096,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``targets``, ``chunk`` tokens at a time.

    Args:
        x: ``[..., D]`` hidden states (any float dtype; logits are formed in it, reduced in fp32).
        weight: ``[V, D]`` the head's weight (``nn.Linear(D, V, bias=False).weight``).
        targets: ``[...]`` class indices; ``ignore_index`` entries are skipped.
        chunk: tokens per chunk (at least 1).

    Every target ignored: 0 (torch's ``F.cross_entropy`` gives nan; see the module docstring).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    if x.shape[:-1] != targets.shape or x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear_cross_entropy expects x [..., D], weight [V, D], targets [...], got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    return _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1).long(),
                                     int(chunk), int(ignore_index))
