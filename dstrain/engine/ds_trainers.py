"""A user's DeepSpeed JSON against what each trainer does with the batch.

The LM and RL trainers feed DeepSpeed ``train.micro_batch`` x ``train.grad_accum`` per
rank. The HRM trainer does not: it steps once per ACT segment (no gradient accumulation)
and sizes its batch by ``task.global_batch`` (puzzles per step over all ranks), setting
``train.micro_batch`` to ``task.global_batch / ranks`` itself. The checks before launch
(:mod:`dstrain.engine.ds_preflight`) must fill the file with the batch the trainer will
use, and name the keys a user of that trainer sets.
"""
from __future__ import annotations

import dataclasses

from dstrain.config import ConfigError, RunConfig


def hrm_global_batch(cfg: RunConfig) -> int:
    value = (cfg.task or {}).get("global_batch", 0) if isinstance(cfg.task, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def trainer_train(cfg: RunConfig, world_size: int):
    """``cfg.train`` as the trainer will run it on ``world_size`` ranks (HRM: micro-batch from task.global_batch)."""
    if cfg.trainer != "hrm":
        return cfg.train
    gb = hrm_global_batch(cfg)
    if gb and world_size > 0 and gb % world_size == 0:
        return dataclasses.replace(cfg.train, micro_batch=gb // world_size)
    return cfg.train


def planned_seq_len(cfg: RunConfig) -> tuple[int, str]:
    """(tokens per sequence the memory plan traces, the plan's line on it or ""): ``data.seq_len``, or for a
    policy-RL run with ``task.max_prompt_tokens`` set, the longest sequence that limit lets through
    (``dstrain.trainers.prompt_limit.planned_seq_len``)."""
    from dstrain.trainers.prompt_limit import planned_seq_len as policy_len
    seq = policy_len(cfg)
    if seq is None:
        return cfg.data.seq_len, ""
    extra = " + the turn-2 episode's answer, hint and words" if cfg.trainer == "score" else ""
    return seq, (f"sequence length planned: {seq} tokens (task.max_prompt_tokens {cfg.task['max_prompt_tokens']} "
                 f"+ task.max_new_tokens{extra}; data.seq_len {cfg.data.seq_len} is not used)")


def hrm_file_problems(cfg: RunConfig, template: dict, dp: int, source: str) -> None:
    """Refuse (ConfigError naming the file's key) a file that asks the HRM trainer to accumulate gradients,
    or ZeRO-3 beside task.ema (the trainer refused that only inside the ranks, after the launch's checks)."""
    if cfg.trainer != "hrm":
        return
    zero = template.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    ema = (cfg.task or {}).get("ema", 0) if isinstance(cfg.task, dict) else 0
    if str(stage).strip() == "3" and isinstance(ema, (int, float)) and ema > 0:
        raise ConfigError(source, "zero_optimization.stage",
                          f"3, but the hrm trainer's task.ema ({ema:g}) keeps an average of the full parameters on "
                          f"every rank, which ZeRO-3 partitions; use a stage below 3 in the file, or --task.ema=0")
    from dstrain.engine import ds_config as dsc
    t = trainer_train(cfg, dp)
    _, accum, problems = dsc.implied_batch(template, dp, t.micro_batch, 1)
    if problems or accum in (None, 1):
        return
    how = "says" if not dsc._is_auto(template.get("gradient_accumulation_steps", "auto")) else "implies"
    raise ConfigError(source, "gradient_accumulation_steps",
                      f"file {how} {accum}, but the hrm trainer steps once per ACT segment (no gradient "
                      f"accumulation); set gradient_accumulation_steps to 1 or \"auto\" and size the batch "
                      f"with task.global_batch (train_batch_size = task.global_batch)")


def translate_fixes(cfg: RunConfig, world_size: int, err):
    """A DSConfigError whose suggested overrides are the ones this trainer reads (HRM: task.global_batch)."""
    if cfg.trainer != "hrm" or "train.micro_batch" not in err.fixes:
        return err
    from dstrain.engine import ds_config as dsc
    fixes = {}
    for key, value in err.fixes.items():
        if key == "train.micro_batch":
            key, value = "task.global_batch", int(value) * world_size
        fixes[key] = value
    problems = [p.replace("run gives", "the hrm trainer runs", 1) if p.startswith("train_micro_batch_size_per_gpu")
                else p for p in err.problems]
    return dsc.DSConfigError(err.source, problems, fixes, err.mismatches,
                             switch_on=cfg.deepspeed.values_from_file)


def adopt_batch_key(cfg: RunConfig, key: str, value, world_size: int) -> tuple[str, object]:
    """Where ``deepspeed.values_from_file`` puts a file's batch value for this trainer: ``(run key, value)``."""
    if cfg.trainer == "hrm" and key == "train.micro_batch":
        return "task.global_batch", int(value) * world_size
    return key, value


def updates_per_step(cfg: RunConfig) -> int:
    """Optimizer updates per run step of the trained policy (GRPO: task.num_iterations; the others: 1)."""
    if cfg.trainer != "grpo" or not isinstance(cfg.task, dict):
        return 1
    value = cfg.task.get("num_iterations", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


def _peak_number(value) -> float | None:
    if isinstance(value, list) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        value = max(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def schedule_reference_lr(ds_config: dict, run_lr: float) -> float:
    """The learning rate a DeepSpeed JSON's schedule treats as its full rate: the scheduler block's own peak
    (WarmupLR / WarmupDecayLR ``warmup_max_lr``; OneCycle's larger of ``cycle_min_lr`` / ``cycle_max_lr``;
    torch's OneCycleLR / CyclicLR ``max_lr``; LRRangeTest's starting ``lr_range_test_min_lr``), else ``run_lr``
    (dstrain's own schedule, WarmupCosineLR's ratios and torch's schedules that scale the optimizer's lr).
    HRM's puzzle embedding follows the engine's rate as a fraction of it: measured against train.lr, a
    OneCycle whose range is not train.lr (ESM's 1e-4 over an optimizer lr of 1e-7) gave the table 1000x its lr."""
    sched = ds_config.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    if not isinstance(params, dict):
        return run_lr
    kind = str(sched.get("type", "")).lower()
    if kind == "onecycle":
        found = [v for v in map(_peak_number, (params.get("cycle_min_lr"), params.get("cycle_max_lr"))) if v]
        return max(found) if found else run_lr
    for key in ("warmup_max_lr", "max_lr", "lr_range_test_min_lr"):
        if (value := _peak_number(params.get(key))) is not None:
            return value
    return run_lr


def scale_schedule_horizon(ds_config: dict, updates_per_step: int) -> None:
    """A DeepSpeed ``scheduler`` block counts optimizer updates; its ``total_num_steps`` was filled
    from (or checked against) ``train.steps``. A trainer that takes ``updates_per_step`` updates per
    run step (GRPO's ``num_iterations``) stretches it to match, as its fallback cosine does."""
    params = (ds_config.get("scheduler") or {}).get("params")
    if updates_per_step != 1 and isinstance(params, dict) and isinstance(params.get("total_num_steps"), int):
        params["total_num_steps"] *= updates_per_step


def rl_batch_problems(cfg: RunConfig, template: dict, world_size: int, source: str) -> None:
    """GRPO / SCoRe: a step's samples (micro-batch x accumulation x ranks, DeepSpeed's train_batch_size) are
    whole groups of task.num_generations completions. The trainer refused other sizes only inside the
    ranks, naming train.micro_batch even where the file's batch keys set it; refused here by the file's key."""
    if cfg.trainer not in ("grpo", "score"):
        return
    from dstrain.engine import ds_config as dsc
    from dstrain.trainers import task_config
    groups = getattr(task_config(cfg), "num_generations", 1)
    t = cfg.train
    samples = t.micro_batch * t.grad_accum * world_size
    if groups <= 1 or samples % groups == 0:
        return
    explicit = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                if k in template and not dsc._is_auto(template[k])]
    if not explicit:
        return  # the run config's numbers alone: the trainer names them
    raise ConfigError(source, explicit[0],
                      f"the step's batch is micro-batch {t.micro_batch} x accumulation {t.grad_accum} x {world_size} "
                      f"ranks = {samples} samples, not a multiple of task.num_generations = {groups} (the {cfg.trainer} "
                      f"trainer fills each step with whole groups); make train_batch_size a multiple of {groups} "
                      f"(or set the batch keys to \"auto\"), or change task.num_generations")
