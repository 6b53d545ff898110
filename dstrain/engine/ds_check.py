"""``dstrain check-config`` for DeepSpeed JSON files: dstrain's checks plus DeepSpeed's own parser.

A standalone DeepSpeed JSON has no run config beside it, so the "auto" values are
filled from the file's own explicit numbers where it has them (and dstrain's
defaults otherwise); then the sections go through DeepSpeed's pydantic models in
strict mode, which reject unknown keys (DeepSpeed's default drops some silently).
"""
from __future__ import annotations

import os
from pathlib import Path

from dstrain.config import TrainConfig
from dstrain.engine.ds_config import (DSConfigError, RunValues, describe_zero, fill_ds_config,
                                      load_ds_json)


def _explicit(value):
    return None if isinstance(value, str) and value.strip().lower() == "auto" else value


def values_from_file(cfg: dict, hidden_size: int = 1024) -> RunValues:
    """The run numbers a DeepSpeed JSON implies by itself (defaults where it says "auto")."""
    t = TrainConfig()
    micro = _explicit(cfg.get("train_micro_batch_size_per_gpu")) or t.micro_batch
    accum = _explicit(cfg.get("gradient_accumulation_steps")) or t.grad_accum
    world = 1
    total = _explicit(cfg.get("train_batch_size"))
    if isinstance(total, int) and isinstance(micro, int) and isinstance(accum, int) and micro * accum:
        world = max(1, total // (micro * accum))
    params = cfg.get("optimizer", {}).get("params", {}) if isinstance(cfg.get("optimizer"), dict) else {}
    sched = cfg.get("scheduler", {}).get("params", {}) if isinstance(cfg.get("scheduler"), dict) else {}
    precision = "fp32"
    for key in ("bf16", "fp16"):
        section = cfg.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            precision = key
    clip = _explicit(cfg.get("gradient_clipping"))
    steps = _explicit(sched.get("total_num_steps")) or t.steps
    ratio = _explicit(sched.get("cos_min_ratio"))
    return RunValues(
        micro_batch=micro if isinstance(micro, int) else t.micro_batch,
        grad_accum=accum if isinstance(accum, int) else t.grad_accum, dp_world_size=world,
        lr=_explicit(params.get("lr")) or t.lr,
        betas=tuple(_explicit(params.get("betas")) or t.betas),
        eps=_explicit(params.get("eps")) or t.eps,
        weight_decay=_explicit(params.get("weight_decay")) if _explicit(params.get("weight_decay")) is not None
        else t.weight_decay,
        grad_clip=clip if clip is not None else t.grad_clip, precision=precision,
        hidden_size=hidden_size, total_steps=steps if isinstance(steps, int) else t.steps,
        warmup_steps=_explicit(sched.get("warmup_num_steps")) or t.warmup_steps,
        min_lr_ratio=ratio if isinstance(ratio, (int, float)) else t.min_lr_ratio)


def _placeholders(node, key: str = ""):
    """A copy with every "auto" replaced by a value of the right kind, for section checks only."""
    if isinstance(node, dict):
        return {k: _placeholders(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_placeholders(v, key) for v in node]
    if _explicit(node) is None and node is not None:
        return False if key == "enabled" else 1
    return node


def deepspeed_problems(cfg: dict, full_parse: bool = True) -> list[str]:
    """Problems DeepSpeed's own config classes find in a filled config (strict: unknown keys too)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    problems = []
    strict = {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config,
              "fp16": DeepSpeedFP16Config}
    for key, model in strict.items():
        section = cfg.get(key)
        if isinstance(section, dict):
            try:
                model(strict=True, **section)
            except Exception as err:  # pydantic's ValidationError: report, do not crash
                detail = " ".join(str(err).split())
                problems.append(f"{key}: DeepSpeed rejects it: {detail[:400]}")
    if not problems and full_parse:
        try:
            DeepSpeedConfig(dict(cfg))
        except Exception as err:
            problems.append(f"DeepSpeed's config parser: {' '.join(str(err).split())[:400]}")
    return problems


def check_ds_file(path: str | Path) -> str:
    """Validate a DeepSpeed JSON; return a one-line summary or raise DSConfigError listing every problem."""
    source = str(path)
    cfg = load_ds_json(path)
    try:
        filled, problems = fill_ds_config(cfg, values_from_file(cfg), source), []
    except DSConfigError as err:
        filled, problems = _placeholders(cfg), list(err.problems)
    problems += deepspeed_problems(filled, full_parse=not problems)
    if problems:
        raise DSConfigError(source, problems)
    zero = describe_zero(filled)
    autos = sorted(k for k, v in cfg.items() if _explicit(v) is None and v is not None)
    offload = [name for name in ("optimizer", "param") if zero[f"offload_{name}"]]
    return (f"{source}: valid DeepSpeed config: ZeRO stage {zero['stage']}"
            f"{', offload ' + ' and '.join(offload) if offload else ''}"
            f"{'; filled by the run: ' + ', '.join(autos) if autos else ''}")
