"""The ``task`` section of a GRPO run config (light: no torch import, so configs validate fast)."""
from __future__ import annotations

from dataclasses import dataclass

SOURCES = ("program", "arithmetic", "choice", "mbpp", "gsm8k")
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")


@dataclass
class PolicyTaskConfig:
    """Tasks, sampling, verifier sandbox, warm start and evaluation of a policy-RL run.

    Shared by the GRPO and SCoRe trainers. ``train.micro_batch`` counts sampled
    completions per micro-batch; one optimizer step consumes
    ``micro_batch x grad_accum x ranks`` completions, ``num_generations`` per prompt.
    """

    source: str = "program"
    """program (generated Python tasks, embedded) | arithmetic (generated maths, embedded) |
    choice (generated two-choice sums, embedded: ``dstrain.data.choice_tasks``) |
    mbpp | gsm8k (read from ``path``: a local file, or a hub name when no such file exists)."""
    path: str = ""
    """MBPP/GSM8K file (``mbpp.jsonl``, ``sanitized-mbpp.json``, ``gsm8k_train.jsonl``) or hub name."""
    eval_path: str = ""
    """GSM8K's held-out file (``gsm8k_test.jsonl``); empty: the tail of ``path``. MBPP uses its split ids."""
    mbpp_max_reference_chars: int = 0
    """MBPP: keep only tasks whose reference code has at most this many characters (0: all)."""
    mbpp_signature: bool = False
    """MBPP: end each prompt with the reference's ``def`` line, so the policy writes the body (tasks
    whose reference is not one lone function are left out)."""
    train_split: str = "train"
    eval_split: str = "test"
    n_train: int = 0
    """Training tasks to use (0: all of the file; the embedded sources then generate 256)."""
    n_eval: int = 64
    """Held-out tasks evaluated (pass@1 greedy, pass@k sampled)."""
    num_generations: int = 4
    """Completions sampled per prompt (the group of GRPO's advantage)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    max_prompt_tokens: int = 0
    """Tasks whose prompt, as the policy is given it (its tokenizer's BOS, the chat template, SCoRe's turn-1
    sections), is longer than this many tokens are dropped when the tasks load (one note: how many, the longest);
    with none left the run is refused. Set, it is also the prompt length ``dstrain plan`` plans for (plus
    ``max_new_tokens``) instead of ``data.seq_len``. 0: 8192 (``prompt_limit.DEFAULT_MAX_PROMPT_TOKENS``, far
    above any MBPP or GSM8K prompt), with ``data.seq_len`` planned as before."""
    epsilon: float = 0.2
    """Lower clip range of the importance ratio: ratio >= 1 - epsilon."""
    epsilon_high: float = 0.0
    """Upper clip range (ratio <= 1 + epsilon_high); 0: same as ``epsilon``."""
    beta: float = 0.0
    """KL coefficient against the frozen reference (0: no reference is loaded)."""
    loss_type: str = "grpo"
    """grpo (per-sequence mean) | bnpo (token mean over the micro-batch) | dapo (token mean
    over the global batch) | dr_grpo (sum / (sequences x max_new_tokens))."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (False: Dr. GRPO's centred rewards)."""
    num_iterations: int = 1
    """Optimisation passes over each generated batch (>1 stores the sampling policy's log-probs)."""
    reference: str = "cpu"
    """Where the reference lives: cpu (plain frozen module) | engine (DeepSpeed inference engine)."""
    partial_credit: bool = False
    """Code reward = fraction of tests passed instead of all-or-nothing."""
    dynamic_sampling: bool = False
    """GRPO: DAPO's dynamic sampling. Groups whose rewards all agree are dropped and each rank
    refills its own share with fresh prompts, round after round (every rank runs the same rounds:
    generation is collective under ZeRO-3), until every share is full or
    ``dynamic_sampling_max_rounds`` is reached; a share still short then trains on its kept groups,
    padded with zero-weight rows and normalised over the kept samples of the whole batch. Needs
    ``micro_batch x grad_accum`` to be a multiple of ``num_generations`` (whole groups per rank)."""
    dynamic_sampling_max_rounds: int = 4
    """Generation rounds per step at most (the first included)."""
    dynamic_sampling_oversample: float = 0.0
    """First guess of the extra groups needed, as a fraction of the share (e.g. 0.5: half as many
    again, on fresh prompts). ``fixed`` sizing: the first round always samples this many extra;
    otherwise it only sets the initial estimate of the informative fraction, ``1 / (1 + oversample)``,
    which then follows the measured fraction (a moving average over steps)."""
    dynamic_sampling_sizing: str = "cost"
    """How many groups each round samples, from the estimated informative fraction ``p`` (a moving
    average over steps): cost (the size of least expected sampling time, a further round costing
    ``dynamic_sampling_round_cost`` groups' worth on top of its groups) | target (the fewest groups that
    fill the share with probability ``dynamic_sampling_target``) | fixed (round 0: the share plus
    ``oversample`` of it; refills: ``deficit / observed rate``; the behaviour before sizing existed)."""
    dynamic_sampling_round_cost: float = 2.0
    """cost sizing: the fixed cost of one more generation round, in units of one group's generation and
    verification (decoding steps run one after another whatever the batch; measure it as the time of a
    round minus its groups' share, over the time of one group: about 2 for the tiny CPU policy)."""
    dynamic_sampling_target: float = 0.9
    """target sizing: probability that one round fills the share (binomial tail)."""
    dynamic_sampling_max_oversample: float = 2.0
    """A round samples at most ``(1 + this) x`` the share's groups (bounds generation memory)."""
    dynamic_sampling_rest_steps: int = 0
    """A prompt whose latest group (on any rank) had rewards that all agree is not drawn for this many
    steps: a regular prompt of the step that is resting is swapped for a fresh one, and refills skip
    resting prompts and those already dropped in this step. Fewer groups are generated only to be
    dropped; the prompts seen are then no longer plain GRPO's. 0: off."""
    dynamic_sampling_carry: bool = False
    """Keep this step's informative groups beyond its share (at most one share per rank) and use them
    in the next step where its first round falls short, before any refill round; the first round is
    then sized to the share less the kept groups over the estimated informative fraction (at least the
    step's regular prompts). A carried group was sampled by
    the policy before the last update: its log-probabilities under that policy are kept (one forward
    over the kept rows, no gradient) and its clipped importance ratio corrects for the update. The
    groups kept go into checkpoints (per rank). Off: informative groups beyond the share are discarded."""
    overlong_filter: bool = False
    """Mask out of the loss the completions that ``max_new_tokens`` cut (no stop string, no EOS)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: the last this many tokens before ``max_new_tokens`` cost
    linearly up to ``overlong_penalty`` of reward (0: off)."""
    overlong_penalty: float = 1.0
    sandbox_workers: int = 2
    sandbox_mode: str = ""
    """fork_server (a warm, isolated server per worker forks a child per program) | spawn (a fresh
    interpreter per program) | empty: fork_server on Linux, spawn elsewhere."""
    sandbox_wall_s: float = 5.0
    sandbox_cpu_s: int = 4
    sandbox_memory_mb: int = 1024
    eval_k: int = 4
    """k of pass@k; ``eval_samples`` completions per held-out task estimate it (0: no pass@k)."""
    eval_samples: int = 8
    warm_start_steps: int = 0
    """Supervised steps on the tasks' reference completions before RL (the tiny embedded policy
    needs them: a random byte model almost never writes a valid expression). Run once, on
    rank 0 with plain AdamW; the result is saved as ``warm_start/`` and is also the reference."""
    warm_start_lr: float = 3e-3
    warm_start_batch: int = 32
    time_limit_s: float = 0.0
    """Stop (checkpoint, evaluate, leave) at the first log step after this many seconds (0: none)."""
    chat_template: str = "off"
    """off (prompts are encoded as plain text) | on (every prompt is rendered as one user message
    through the tokenizer's chat template with the generation prompt appended; refused for a
    tokenizer without one) | auto (on exactly when the checkpoint's tokenizer has a template)."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"task.source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source in ("mbpp", "gsm8k") and not self.path:
            raise ValueError(f"task.path must name the {self.source} file (or hub name) for source {self.source}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"task.loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.reference not in ("cpu", "engine"):
            raise ValueError(f"task.reference must be cpu or engine, got {self.reference!r}")
        if self.num_generations < 2:
            raise ValueError(f"task.num_generations must be at least 2 (a group needs a spread), "
                             f"got {self.num_generations}")
        for name in ("max_new_tokens", "num_iterations", "sandbox_workers", "sandbox_cpu_s",
                     "sandbox_memory_mb", "n_eval", "warm_start_batch", "dynamic_sampling_max_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"task.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("n_train", "max_prompt_tokens", "mbpp_max_reference_chars", "beta", "epsilon_high", "eval_k",
                     "warm_start_steps", "warm_start_lr", "time_limit_s", "overlong_buffer", "overlong_penalty",
                     "dynamic_sampling_oversample", "dynamic_sampling_max_oversample", "dynamic_sampling_round_cost",
                     "dynamic_sampling_rest_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"task.{name} must not be negative, got {getattr(self, name)}")
        if not 0 < self.epsilon < 1:
            raise ValueError(f"task.epsilon must be within (0, 1), got {self.epsilon}")
        if not 0 < self.dynamic_sampling_target < 1:
            raise ValueError(f"task.dynamic_sampling_target must be within (0, 1), "
                             f"got {self.dynamic_sampling_target}")
        if self.dynamic_sampling_rest_steps and not self.dynamic_sampling:
            raise ValueError("task.dynamic_sampling_rest_steps needs task.dynamic_sampling=true")
        if self.dynamic_sampling_carry and not self.dynamic_sampling:
            raise ValueError("task.dynamic_sampling_carry needs task.dynamic_sampling=true")
        if self.dynamic_sampling_sizing not in ("cost", "target", "fixed"):
            raise ValueError(f"task.dynamic_sampling_sizing must be cost, target or fixed, "
                             f"got {self.dynamic_sampling_sizing!r}")
        if self.temperature <= 0:
            raise ValueError(f"task.temperature must be positive (greedy decoding is used for pass@1), "
                             f"got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"task.top_p must be within (0, 1], got {self.top_p}")
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"task.overlong_buffer ({self.overlong_buffer}) must not exceed task.max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.chat_template not in ("off", "on", "auto"):
            raise ValueError(f"task.chat_template must be off, on or auto, got {self.chat_template!r}")
        if self.sandbox_mode not in ("", "fork_server", "spawn"):
            raise ValueError(f"task.sandbox_mode must be fork_server or spawn (or empty for the platform's "
                             f"default), got {self.sandbox_mode!r}")
        if self.sandbox_wall_s <= 0:
            raise ValueError(f"task.sandbox_wall_s must be positive, got {self.sandbox_wall_s}")
        if self.eval_k and self.eval_samples < self.eval_k:
            raise ValueError(f"task.eval_samples ({self.eval_samples}) must be at least task.eval_k "
                             f"({self.eval_k})")

    @property
    def clip_high(self) -> float:
        return self.epsilon_high or self.epsilon
