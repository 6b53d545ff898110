"""Trainers by name: a run config's ``trainer`` picks the loop every rank runs.

Each entry maps a name to ``(module, task config)``: the module exposes
``train(cfg: RunConfig) -> dict``; the task config, written "package.module:Class",
is the dataclass that types the run config's free-form ``task`` section (None: the
trainer takes no ``task`` keys). Task configs live in light modules so validating a
config does not import torch or DeepSpeed.
"""
from __future__ import annotations

import importlib
from typing import Any

TRAINERS: dict[str, tuple[str, str | None]] = {
    "lm": ("dstrain.trainers.lm", None),
    "hrm": ("dstrain.trainers.hrm", "dstrain.trainers.hrm_config:HRMTaskConfig"),
    "grpo": ("dstrain.trainers.grpo", "dstrain.trainers.grpo_config:PolicyTaskConfig"),
    "score": ("dstrain.trainers.score", "dstrain.trainers.score_config:ScoreTaskConfig"),
}

#: Trainers whose model inputs change shape from step to step (sampled completions of any length):
#: ``train.compile=auto`` leaves their models uncompiled, since torch.compile with static shapes
#: would compile again for each new sequence width.
VARIABLE_SHAPES = frozenset({"grpo", "score"})


#: What each trainer needs of the model it trains (``_fits`` tests it), as an error names it.
NEEDS = {"lm": "a language model (no ACT halting)", "hrm": "a model with ACT halting (such as 'hrm')",
         "grpo": "a policy model with an RL toolkit (such as 'policy')",
         "score": "a policy model with an RL toolkit (such as 'policy')"}


def _fits(trainer: str, spec, model_cfg) -> bool:
    """Whether ``trainer`` can train this model family: the RL trainers drive a policy's toolkit
    (``ModelSpec.rl``), HRM's loop drives ACT halting (``halt_max_steps``), which the LM loop cannot."""
    act, policy = hasattr(model_cfg, "halt_max_steps"), getattr(spec, "rl", None) is not None
    return {"grpo": policy, "score": policy, "hrm": act}.get(trainer, not act)


def model_problem(cfg) -> str | None:
    """Why ``cfg.trainer`` cannot train ``cfg.model`` (a recipe of another family), or None."""
    from models import registry
    spec = registry.get_spec(cfg.model.name)
    model_cfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    if cfg.trainer not in TRAINERS or _fits(cfg.trainer, spec, model_cfg):
        return None
    fit = " or ".join(repr(t) for t in available() if _fits(t, spec, model_cfg))
    return (f"trainer {cfg.trainer!r} trains {NEEDS[cfg.trainer]}, not {cfg.model.name!r}, "
            f"which trains with trainer {fit}")


def parallel_problem(cfg) -> str | None:
    """Why ``cfg.model`` cannot take ``parallel.tp`` / ``parallel.sp`` above 1 (its ``parallelize`` takes no layout to
    split its layers by: GPT and HRM raised a TypeError in every rank, policies NotImplementedError), or None."""
    import inspect

    from models import registry
    par = cfg.parallel
    if par.tp * par.sp == 1:
        return None
    def splits(name: str) -> bool:  # its parallelize takes the layout (dstrain.parallel.dims.ParallelState)
        return "state" in inspect.signature(registry.get_spec(name).parallelize).parameters

    if splits(cfg.model.name):
        return None
    other = " and pipeline stages (parallel.pp)" if registry.get_spec(cfg.model.name).pipeline is not None else ""
    those = ", ".join(n for n in registry.available() if splits(n))
    return (f"model {cfg.model.name!r} has no tensor or sequence parallelism (got tp = {par.tp}, sp = {par.sp}; "
            f"models that have: {those}); it trains with data parallelism (ZeRO){other}: set both to 1")


def available() -> list[str]:
    return sorted(TRAINERS)


def _check(name: str) -> None:
    if name not in TRAINERS:
        raise KeyError(f"unknown trainer {name!r}; available: {', '.join(available())}")


def task_config_class(name: str) -> type | None:
    """The dataclass typing ``task`` for trainer ``name`` (None if it takes no task keys)."""
    _check(name)
    target = TRAINERS[name][1]
    if target is None:
        return None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def get_trainer(name: str) -> Any:
    """The trainer module (with ``train(cfg)``) registered under ``name``."""
    _check(name)
    return importlib.import_module(TRAINERS[name][0])


def task_config(cfg) -> Any:
    """``cfg.task`` as its typed dataclass (already validated when the config loaded)."""
    from dstrain.config import build_section
    cls = task_config_class(cfg.trainer)
    return None if cls is None else build_section(cls, cfg.task, "run config", "task.")
