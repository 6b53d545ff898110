"""GRPO's arithmetic, written once and tested against hand-computed values.

Everything here is a pure function of tensors: the trainer (``dstrain.trainers.grpo``)
supplies per-token log-probabilities of the sampled completions under the policy being
trained (``logp``, with gradient), under the policy that sampled them (``old_logp``)
and under the frozen reference (``ref_logp``), a completion mask, and one advantage
per sequence.

Conventions (all tensors ``[B, T]`` unless said otherwise; ``mask`` is 1 on
completion tokens):

* advantages: ``A_i = (r_i - mean(group)) / (std(group) + eps)``; std is the unbiased
  sample std (as TRL computes it); ``scale=False`` leaves ``r_i - mean`` (Dr. GRPO).
* ratio ``rho = exp(logp - old_logp)``; per-token objective
  ``min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``; the loss is its negative.
* KL: the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (unbiased for
  KL(pi || ref), always >= 0), added per token with weight ``beta``.
* aggregation of per-token losses ``l``:
  ``grpo``  mean over each sequence's tokens, then mean over sequences;
  ``bnpo``  sum over the batch's tokens / the batch's token count;
  ``dapo``  sum over the batch's tokens / ``token_normaliser`` (the token count of the
  whole global batch, every rank and micro-batch, supplied by the trainer);
  ``dr_grpo`` sum over the batch's tokens / (sequences x ``max_completion_length``).
  With ``sequence_normaliser`` (a batch that dynamic sampling could not fill, padded
  with zero-mask rows) every type divides a sum over the micro-batch by a count of the
  whole global batch instead, so that the padded batch trains exactly like its kept
  samples alone as one batch: ``grpo`` sum of per-sequence means / kept sequences;
  ``dr_grpo`` token sum / (kept sequences x ``max_completion_length``); ``bnpo`` and
  ``dapo`` token sum / ``token_normaliser`` (for ``bnpo`` that is the global token
  mean: a micro-batch of padding alone has no token mean of its own).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True,
                     eps: float = 1e-4) -> torch.Tensor:
    """Group-normalised advantages of ``rewards`` laid out as consecutive groups.

    ``rewards[g * group_size + j]`` is sample ``j`` of prompt ``g``. A group whose
    rewards are all equal gets advantage 0 for every sample.
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    # float64: in float32 the mean of equal rewards (e.g. 0.1 x 8) is off by an ulp, and that
    # ulp divided by (std + eps) left advantages of up to 6e-4 in groups that have no spread
    groups = rewards.to(torch.float64).view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(centred[:, :1])
        centred = centred / (std + eps)
    flat = groups.max(dim=1, keepdim=True).values == groups.min(dim=1, keepdim=True).values
    return centred.masked_fill(flat, 0.0).reshape(-1).float()


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose samples all got the same reward (they teach nothing)."""
    groups = rewards.to(torch.float64).view(-1, group_size)
    return (groups.max(dim=1).values == groups.min(dim=1).values).float().mean().item()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref); differentiable in ``logp``."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def clipped_objective(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token clipped surrogate to maximise, mask of tokens where clipping bound).

    ``advantages`` is per sequence ``[B]`` or per token ``[B, T]``.
    """
    adv = advantages.unsqueeze(1) if advantages.ndim == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    unclipped_term, clipped_term = ratio * adv, clipped * adv
    was_clipped = (clipped_term < unclipped_term).float()
    return torch.minimum(unclipped_term, clipped_term), was_clipped


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int | None = None, token_normaliser: float | None = None,
              sequence_normaliser: float | None = None) -> torch.Tensor:
    """Reduce per-token losses to a scalar as ``loss_type`` says (module docstring)."""
    mask = mask.to(per_token.dtype)
    if sequence_normaliser is not None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {loss_type!r}; one of {', '.join(LOSS_TYPES)}")
        if loss_type == "grpo":
            per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            return per_seq.sum() / max(sequence_normaliser, 1.0)
        if loss_type == "dr_grpo":
            if not max_completion_length:
                raise ValueError("loss_type dr_grpo needs max_completion_length")
            return (per_token * mask).sum() / (max(sequence_normaliser, 1.0) * max_completion_length)
        if token_normaliser is None:
            raise ValueError(f"loss_type {loss_type} with a sequence_normaliser needs token_normaliser")
        return (per_token * mask).sum() / max(token_normaliser, 1.0)
    if loss_type == "grpo":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return per_seq.mean()
    total = (per_token * mask).sum()
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1.0)
    if loss_type == "dapo":
        if not token_normaliser:
            raise ValueError("loss_type dapo needs token_normaliser (tokens of the global batch)")
        return total / token_normaliser
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type dr_grpo needs max_completion_length")
        return total / (per_token.shape[0] * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}; one of {', '.join(LOSS_TYPES)}")


def backward_scale(loss_type: str, short: bool, grad_accum: int, world_size: int) -> float:
    """Factor on each micro-batch's :func:`grpo_loss` before ``engine.backward``.

    DeepSpeed divides by ``grad_accum`` and averages over ranks, i.e. takes the mean of the
    micro-batch losses. That mean is the step's loss for ``grpo``, ``bnpo`` and ``dr_grpo`` (equal
    micro-batches); ``dapo`` and every short batch divide by global counts instead, so their
    micro-batch losses add up to the step's loss and the mean is undone. The mean over
    micro-batches and ranks of ``loss x backward_scale`` is the step's loss in every case.
    """
    return float(grad_accum * world_size) if short or loss_type == "dapo" else 1.0


@dataclass(frozen=True)
class GRPOLossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 0.0
    loss_type: str = "grpo"
    max_completion_length: int | None = None


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, cfg: GRPOLossConfig,
              token_normaliser: float | None = None, sequence_normaliser: float | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch and its statistics (masked token means).

    ``ref_logp`` may be None only when ``cfg.beta == 0``. ``sequence_normaliser``: see
    the module docstring (a short batch of dynamic sampling).
    """
    surrogate, was_clipped = clipped_objective(logp, old_logp, advantages, cfg.eps_low, cfg.eps_high)
    per_token = -surrogate
    stats: dict[str, float] = {}
    m = mask.float()
    tokens = m.sum().clamp(min=1.0)
    if cfg.beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probabilities")
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + cfg.beta * kl
        stats["kl"] = ((kl.detach() * m).sum() / tokens).item()
    elif ref_logp is not None:
        stats["kl"] = ((k3_kl(logp.detach(), ref_logp) * m).sum() / tokens).item()
    stats["clip_fraction"] = ((was_clipped * m).sum() / tokens).item()
    loss = aggregate(per_token, mask, cfg.loss_type, cfg.max_completion_length, token_normaliser,
                     sequence_normaliser)
    return loss, stats


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if not 0 <= c <= n or k < 1 or k > n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
