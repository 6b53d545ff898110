"""The ``task`` section of a BiLevel SCoRe run config (light: no torch import).

SCoRe reuses GRPO's task fields (source, sampling, sandbox, warm start, evaluation) and
adds the two-stage objective, the critic / value / guidance settings and the hint length.
Where each model lives is the run config's separate ``placement`` section
(``dstrain.rl.placement``); a trainer that reads it says so with ``uses_placement``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dstrain.trainers.grpo_config import PolicyTaskConfig

ADVANTAGES = ("critic", "group")
GUIDANCE = ("model", "none")


@dataclass
class ScoreTaskConfig(PolicyTaskConfig):
    """Tasks and sampling as in GRPO (``PolicyTaskConfig``), plus SCoRe's objective and models.

    One optimizer step takes ``micro_batch x grad_accum x ranks`` episodes,
    ``num_generations`` per prompt (the group of ``advantage: group`` and of the guidance
    reward). ``temperature``/``top_p``/``max_new_tokens`` apply to both turns; the hint
    samples at the same temperature, ends at its first newline or ``hint_max_new_tokens``.
    GRPO-only fields: ``beta`` must stay 0 (SCoRe's KL coefficients are ``beta1``/``beta2``),
    ``num_iterations`` 1, ``reference`` cpu (``placement.reference`` decides); ``epsilon``
    and ``loss_type`` are unused (one on-policy pass, so no ratio to clip), and so are ``eval_k`` /
    ``eval_samples``: evaluation runs greedy two-turn episodes on the held-out tasks
    (``accuracy@t1``, ``accuracy@t2``, transitions; ``pass@1`` is the turn-2 accuracy).

    Warm start (``warm_start_steps`` > 0): the policy learns the reference answer after
    turn-1 prompts and after turn-2 prompts (previous attempt = the reference or a corrupted
    copy, hint = the matching verdict); the guidance model (its own ``warm_start_steps``)
    learns to write that verdict. Both are saved under the output folder and loaded by
    every rank; the policy's is also the KL reference and the critics' backbone.
    """

    uses_placement: ClassVar[bool] = True
    """Run configs of this trainer take a ``placement`` section (checked by dstrain.config)."""

    stage_one_steps: int = 100
    """Steps of stage I (maximise r2, turn 1 held to the reference by beta2); stage II after."""
    alpha: float = 10.0
    """Stage II bonus alpha x (r2 - r1) on the turn-2 reward."""
    beta1: float = 0.01
    """KL coefficient on turn 2 in stage I and on both turns in stage II."""
    beta2: float = 0.1
    """Strong KL coefficient on turn 1 in stage I."""
    gamma: float = 0.0
    """Discount from turn 2 back to turn 1 in the critic's TD target and the group return.
    0 (default): each turn is trained on its own reward. With gamma = 1 and alpha = 10 the
    stage-II return of turn 1 is -9 r1 + 11 r2, which pays turn 1 for being wrong whenever
    turn 2 fixes it (sandbagging), held back only by the small beta1 KL; 0 keeps turn 1 on r1."""
    advantage: str = "critic"
    """critic: A = Q(s, a) - V(s) from the critic and value function | group: rewards
    normalised within each prompt's group, as in GRPO (no critic, value or target built)."""
    tau: float = 0.05
    """Polyak rate of the target critic: target <- (1 - tau) target + tau critic, every critic step."""
    critic_lr: float = 1e-4
    value_lr: float = 1e-4
    guidance_lr: float = 1e-5
    guidance_every: int = 1
    """Update the guidance model every k steps (its own schedule counts those updates)."""
    guidance_frozen: bool = False
    """Never train the guidance model (implies ``placement.guidance.frozen``; either freezes it)."""
    guidance: str = "model"
    """model: a guidance model writes each hint | none: no guidance model is built and every
    turn-2 prompt carries the same fixed hint (``score_warm.NO_HINT``), as in the SCoRe paper's
    plain "try again" instruction (the no-guidance ablation)."""
    guidance_key: bool = False
    """Show the guidance model the answer key (maths: the final answer; code: the tests) in its
    prompt: a teacher that knows the solution and must not state it. A hint that states a maths
    answer anyway counts as a leak: its guidance reward is -1 and ``hint_leak`` logs the rate."""
    hint_max_new_tokens: int = 32
    guidance_warm_start: float = 1.0
    """Steps of the guidance model's supervised warm start, as a multiple of the policy's
    ``warm_start_steps`` (rounded up)."""
    guidance_warm_start_lr: float = 0.0
    """Learning rate of the guidance model's warm start (0: ``warm_start_lr``)."""
    guidance_from_policy: bool = False
    """Start the guidance model's warm start from the policy's warm-started weights instead of a fresh
    initialisation: a model that already reads the previous attempt and the offered answers learns to
    judge them much faster than one that must first learn to read."""
    warm_turn2: str = "verdict"
    """What the policy's warm start teaches on turn-2 prompts with a verdict hint: verdict (the
    reference: keep a right first answer, fix a wrong one) | format (keep the previous attempt
    or switch to another answer, half and half whatever the verdict: the format and copying,
    leaving the use of the verdict to RL). Turn-2 prompts with the fixed hint always teach the reference."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta:
            raise ValueError(f"task.beta is GRPO's KL coefficient; SCoRe uses task.beta1 and task.beta2 "
                             f"(set beta to 0), got {self.beta}")
        if self.num_iterations != 1:
            raise ValueError(f"task.num_iterations must be 1 for SCoRe (one on-policy pass per episode batch), "
                             f"got {self.num_iterations}")
        if self.reference != "cpu":
            raise ValueError("task.reference is not used by SCoRe: place the reference with "
                             "placement.reference (device, engine)")
        if self.guidance not in GUIDANCE:
            raise ValueError(f"task.guidance must be one of {', '.join(GUIDANCE)}, got {self.guidance!r}")
        if self.guidance == "none" and self.guidance_key:
            raise ValueError("task.guidance_key shows the key to the guidance model, but task.guidance is none")
        from dstrain.trainers.score_warm import TURN2_MODES
        if self.warm_turn2 not in TURN2_MODES:
            raise ValueError(f"task.warm_turn2 must be one of {', '.join(TURN2_MODES)}, got {self.warm_turn2!r}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"task.advantage must be one of {', '.join(ADVANTAGES)}, got {self.advantage!r}")
        if self.guidance_warm_start_lr < 0:
            raise ValueError(f"task.guidance_warm_start_lr must not be negative, got {self.guidance_warm_start_lr}")
        if not self.guidance_warm_start > 0:
            raise ValueError(f"task.guidance_warm_start must be positive, got {self.guidance_warm_start}")
        for name in ("stage_one_steps", "alpha", "beta1", "beta2"):
            if getattr(self, name) < 0:
                raise ValueError(f"task.{name} must not be negative, got {getattr(self, name)}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"task.gamma must be within [0, 1], got {self.gamma}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"task.tau must be within (0, 1], got {self.tau}")
        for name in ("critic_lr", "value_lr", "guidance_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"task.{name} must be positive, got {getattr(self, name)}")
        for name in ("guidance_every", "hint_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"task.{name} must be at least 1, got {getattr(self, name)}")

    @staticmethod
    def placement_section(task: dict, placement: dict) -> dict:
        """The raw placement section as the task implies it: ``guidance_frozen`` freezes the guidance role."""
        if task.get("guidance_frozen") is not True:
            return placement
        guidance = placement.get("guidance", {})
        return {**placement, "guidance": {**guidance, "frozen": True} if isinstance(guidance, dict) else guidance}

    def stage(self, step: int) -> int:
        """SCoRe stage of 0-based optimizer step ``step``: 1 for the first ``stage_one_steps``, then 2."""
        return 1 if step < self.stage_one_steps else 2
