"""SCoRe's arithmetic (Kumar et al., 2024) for BiLevel SCoRe: rewards, advantages, losses.

Pure, differentiable torch functions; the trainer supplies the tensors. Per-token
tensors are ``[B, T]`` with a ``mask`` that is 1 on the turn's answer tokens.

Episode: state ``s1`` = the prompt, action ``a1`` = turn-1 answer; state ``s2`` =
(prompt, turn 1, hint), action ``a2`` = turn-2 answer; verifier rewards ``r1, r2`` in {0, 1}.

Shaped rewards (``shaped_rewards``)::

    stage 1:  R1 = 0                      R2 = r2
    stage 2:  R1 = r1                     R2 = r2 + alpha * (r2 - r1)

Policy objective (``score_objective``), a loss to minimise; for each turn ``k``::

    pg_k = mean_b [ sum_t m_bt * ( -rho_bt * A_bk ) / sum_t m_bt ],   rho = exp(logp - old_logp)
    kl_k = mean_b [ sum_t m_bt * k3(logp, ref_logp)_bt / sum_t m_bt ]
    k3   = exp(ref_logp - logp) - (ref_logp - logp) - 1            (>= 0, unbiased for KL(pi || ref))

    stage 1:  loss = pg_2 + beta2 * kl_1 + beta1 * kl_2
    stage 2:  loss = pg_1 + pg_2 + beta1 * (kl_1 + kl_2)

Stage 1 has no policy-gradient term for turn 1 (turn 1 is held near the reference by the
strong ``beta2`` KL alone; ``adv1`` is ignored) and keeps the ordinary ``beta1`` KL on turn
2 (pass ``beta1=0`` for the paper's stage-I equation, which has none). With ``clip_eps``
the per-token term is PPO's ``-min(rho A, clip(rho, 1 - eps, 1 + eps) A)``. On the first
pass ``old_logp == logp.detach()``, so ``rho = 1`` and the gradient is ``-A * grad logp``.

Critic and value (one-step TD over the two-turn episode, ``gamma`` default 1: undiscounted)::

    Q(s1, a1) <- R1 + gamma * V(s2)         (V of the value network, detached)
    Q(s2, a2) <- R2                         (the episode ends after turn 2)
    V(s)      <- Q_target(s, a_taken)       (the Polyak-averaged target critic, detached)
    A_k        = Q(s_k, a_k) - V(s_k)       (detached; ``critic_advantages``)

so V estimates E_a Q(s, a) under the sampling policy, and the target critic (not the online
one) keeps V's regression target slow. Losses are plain mean squared errors. With
``gamma = 1`` and stage 2, the turn-1 return is ``(1 - alpha) r1 + (1 + alpha) r2``: the
bonus rewards turn 1 for answers that turn 2 improves on, and the ``beta1`` KL bounds how
far turn 1 may drift for it; ``gamma = 0`` makes each turn a separate bandit instead.
Alternatively ``group_advantages`` normalises rewards within groups as GRPO does.

The guidance model's reward is the improvement it caused: ``r2 - r1``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TurnBatch:
    """One turn's per-token tensors, all ``[B, T]``."""

    logp: Tensor
    """Log-probabilities of the sampled tokens under the policy being trained (with gradient)."""
    old_logp: Tensor
    """The same under the policy that sampled them (no gradient)."""
    ref_logp: Tensor
    """The same under the frozen reference policy."""
    mask: Tensor
    """1 on this turn's answer tokens, 0 on prompt and padding."""

    def __post_init__(self):
        shapes = {k: tuple(getattr(self, k).shape) for k in ("logp", "old_logp", "ref_logp", "mask")}
        if len(set(shapes.values())) != 1 or len(shapes["logp"]) != 2:
            raise ValueError(f"TurnBatch tensors must all be [B, T], got {shapes}")


def _as_float(x, like: Tensor | None = None) -> Tensor:
    if isinstance(x, Tensor):
        return x.float()
    return torch.as_tensor(x, dtype=torch.float32, device=None if like is None else like.device)


def _check_stage(stage: int) -> int:
    if stage not in (1, 2) or isinstance(stage, bool):
        raise ValueError(f"SCoRe stage must be 1 or 2, got {stage!r}")
    return stage


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): ``exp(ref - logp) - (ref - logp) - 1``.

    Differentiable in ``logp`` (the gradient is ``1 - exp(ref - logp)``); ``ref_logp`` is
    treated as a constant.
    """
    delta = ref_logp.detach() - logp
    return torch.exp(delta) - delta - 1.0


def masked_sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``[B]``: mean of ``values`` over each row's masked tokens (0 for a row with none)."""
    m = mask.to(values.dtype)
    return (values * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0)


def shaped_rewards(r1, r2, stage: int, alpha: float = 10.0) -> tuple[Tensor, Tensor]:
    """``(R1, R2)``, the rewards each turn is trained on (module docstring).

    stage 1: ``(0, r2)``; stage 2: ``(r1, r2 + alpha * (r2 - r1))``.
    """
    _check_stage(stage)
    r1, r2 = _as_float(r1), _as_float(r2)
    if r1.shape != r2.shape:
        raise ValueError(f"r1 and r2 must have the same shape, got {tuple(r1.shape)} and {tuple(r2.shape)}")
    if stage == 1:
        return torch.zeros_like(r1), r2.clone()
    return r1.clone(), r2 + alpha * (r2 - r1)


def guidance_rewards(r1, r2, leaks=None) -> Tensor:
    """The guidance model's reward: the improvement its hint caused, ``r2 - r1``; -1 where
    ``leaks`` is set (a hint that states the answer is the worst hint, whatever turn 2 did)."""
    reward = _as_float(r2) - _as_float(r1)
    if leaks is None:
        return reward
    return torch.where(_as_float(leaks) > 0, torch.full_like(reward, -1.0), reward)


def critic_advantages(q: Tensor, v: Tensor) -> Tensor:
    """``Q(s, a) - V(s)``, detached (advantages never carry gradient into the critic)."""
    return (q - v).detach().float()


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO-style advantages: reward minus its group's mean, over (std + eps) unless ``scale=False``.

    ``rewards[g * group_size + j]`` is sample ``j`` of group ``g``; std is the unbiased sample
    std; a group of one, or of equal rewards, gets advantage 0.
    """
    rewards = _as_float(rewards)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    groups = rewards.to(torch.float64).view(-1, group_size)  # float32's mean of equal rewards is an ulp off
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    flat = groups.max(dim=1, keepdim=True).values == groups.min(dim=1, keepdim=True).values
    return centred.masked_fill(flat, 0.0).reshape(-1).float()


def _policy_gradient(turn: TurnBatch, adv: Tensor, clip_eps: float | None) -> tuple[Tensor, Tensor]:
    """(pg loss of one turn, fraction of masked tokens clipped)."""
    adv = _as_float(adv, turn.logp).detach()
    if adv.ndim == 1:
        adv = adv.unsqueeze(1)
    if adv.shape[0] != turn.logp.shape[0]:
        raise ValueError(f"advantages for {adv.shape[0]} sequences, log-probs for {turn.logp.shape[0]}")
    ratio = torch.exp(turn.logp - turn.old_logp.detach())
    surrogate = ratio * adv
    clipped_frac = torch.zeros((), device=turn.logp.device)
    if clip_eps is not None:
        clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
        was_clipped = (clipped < surrogate).float()
        surrogate = torch.minimum(surrogate, clipped)
        clipped_frac = masked_sequence_mean(was_clipped, turn.mask).mean()
    return masked_sequence_mean(-surrogate, turn.mask).mean(), clipped_frac


def score_objective(turn1: TurnBatch, turn2: TurnBatch, adv1: Tensor | None, adv2: Tensor, stage: int,
                    beta1: float = 0.01, beta2: float = 0.1, clip_eps: float | None = None
                    ) -> tuple[Tensor, dict[str, float]]:
    """SCoRe's policy loss for one batch of episodes and its statistics (module docstring).

    ``adv1``/``adv2`` are per sequence ``[B]`` (or per token ``[B, T]``) and treated as
    constants; ``adv1`` is unused in stage 1 (may be None). Returns ``(loss, stats)`` where
    stats holds floats: ``loss``, ``pg_loss_turn{1,2}`` (the terms as included, so
    ``pg_loss_turn1`` is 0 in stage 1), ``kl_turn{1,2}`` (masked means of k3),
    ``kl_coef_turn{1,2}``, and ``clip_fraction_turn{1,2}`` when ``clip_eps`` is set.
    """
    _check_stage(stage)
    if beta1 < 0 or beta2 < 0:
        raise ValueError(f"KL coefficients must not be negative, got beta1={beta1}, beta2={beta2}")
    if clip_eps is not None and not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    kl1 = masked_sequence_mean(kl_k3(turn1.logp, turn1.ref_logp), turn1.mask).mean()
    kl2 = masked_sequence_mean(kl_k3(turn2.logp, turn2.ref_logp), turn2.mask).mean()
    pg2, clip2 = _policy_gradient(turn2, adv2, clip_eps)
    if stage == 1:
        pg1, clip1 = torch.zeros((), device=pg2.device), torch.zeros(())
        coef1, coef2 = beta2, beta1
    else:
        if adv1 is None:
            raise ValueError("stage 2 needs turn-1 advantages (adv1)")
        pg1, clip1 = _policy_gradient(turn1, adv1, clip_eps)
        coef1, coef2 = beta1, beta1
    loss = pg1 + pg2 + coef1 * kl1 + coef2 * kl2
    stats = {"loss": loss.item(), "pg_loss_turn1": pg1.item(), "pg_loss_turn2": pg2.item(),
             "kl_turn1": kl1.item(), "kl_turn2": kl2.item(), "kl_coef_turn1": float(coef1),
             "kl_coef_turn2": float(coef2)}
    if clip_eps is not None:
        stats.update(clip_fraction_turn1=float(clip1), clip_fraction_turn2=float(clip2))
    return loss, stats


# ---------------------------------------------------------------- critic and value

def td_target(reward, next_value, done, gamma: float = 1.0) -> Tensor:
    """One-step TD target ``r + gamma * (1 - done) * next_value``, detached."""
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = _as_float(reward)
    nxt = _as_float(next_value).detach()
    d = _as_float(done)
    return (r + gamma * (1.0 - d) * nxt).detach()


def episode_critic_targets(turn1_reward, turn2_reward, v_s2, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(target of Q(s1, a1), target of Q(s2, a2))`` = ``(R1 + gamma * V(s2), R2)``, detached.

    ``turn{1,2}_reward`` are the shaped rewards of ``shaped_rewards``; ``v_s2`` is the value
    network's estimate of the turn-2 state.
    """
    r1 = _as_float(turn1_reward)
    q1 = td_target(r1, v_s2, torch.zeros_like(r1), gamma)
    r2 = _as_float(turn2_reward)
    q2 = td_target(r2, torch.zeros_like(r2), torch.ones_like(r2), gamma)
    return q1, q2


def _mse(pred: Tensor, target, what: str) -> Tensor:
    target = _as_float(target, pred).detach()
    if pred.shape != target.shape:  # [B, 1] against [B] would broadcast to [B, B] silently
        raise ValueError(f"{what}: prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    return torch.mean((pred.float() - target) ** 2)


def critic_loss(q_pred: Tensor, target) -> Tensor:
    """Mean squared error of the critic's Q(s, a) against its (detached) target."""
    return _mse(q_pred, target, "critic_loss")


def value_loss(v_pred: Tensor, target) -> Tensor:
    """Mean squared error of V(s) against the target critic's Q(s, a_taken) (detached)."""
    return _mse(v_pred, target, "value_loss")


# ---------------------------------------------------------------- held-out evaluation

def wilson_interval(successes: float, n: float, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n`` (95% for the default ``z``)."""
    if n <= 0:
        raise ValueError(f"wilson_interval needs n > 0, got {n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within [0, n={n}], got {successes}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference_interval(both: float, only_first: float, only_second: float, neither: float,
                               z: float = 1.959964) -> tuple[float, float, float]:
    """``(difference, low, high)`` of ``p_second - p_first`` on paired binary outcomes, with
    Newcombe's (1998) hybrid score interval for paired proportions (his method 10: the two
    Wilson intervals combined through the correlation phi of the 2x2 table).

    For self-correction: ``first`` = turn 1 correct, ``second`` = turn 2 correct; so
    ``only_first`` counts correct -> incorrect tasks and ``only_second`` incorrect -> correct.
    """
    a, b, c, d = (float(x) for x in (both, only_first, only_second, neither))
    if min(a, b, c, d) < 0:
        raise ValueError(f"paired counts must not be negative, got {(a, b, c, d)}")
    n = a + b + c + d
    if n <= 0:
        raise ValueError("paired_difference_interval needs at least one pair")
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson_interval(a + b, n, z)
    l2, u2 = wilson_interval(a + c, n, z)
    denom = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / denom ** 0.5 if denom > 0 else 0.0
    diff = p2 - p1
    lower = ((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2) ** 0.5
    upper = ((u2 - p2) ** 2 - 2 * phi * (u2 - p2) * (p1 - l1) + (p1 - l1) ** 2) ** 0.5
    return diff, max(-1.0, diff - lower), min(1.0, diff + upper)
