"""Checks of a built run configuration's values (``dstrain.config.run_config_from_dict`` calls :func:`validate`).

Each check raises :class:`dstrain.config.ConfigError` naming the file (or "command line") and the dotted key; the
model's own part is checked by the model's registry, a trainer's ``task`` section by its task config class.
"""
from __future__ import annotations

import json
import os

from dstrain.config import (ATTENTION_BACKENDS, COMPILE_MODES, COMPILE_SCOPES, INT64_MAX, ConfigError, RunConfig,
                            build_section)


MAX_LAYERS = 10_000
"""Layer counts above this are refused: the plan builds the model on the meta device, one Python object per layer
(``n_layer=1e30`` as an exact integer hung ``dstrain plan``; the deepest published networks have about 1000)."""


def _auto_or_bool(value) -> bool:
    """``auto``, true or false: not 1 or 0, which equal True and False in Python (``1 in (True,)``)."""
    return value == "auto" or isinstance(value, bool)


def _check(cond: bool, source: str, key: str, problem: str) -> None:
    if not cond:
        raise ConfigError(source, key, problem)


def validate(cfg: RunConfig, source: str) -> None:
    """Reject impossible values; the model part is checked by the model's registry."""
    t, d, ds, ck = cfg.train, cfg.data, cfg.deepspeed, cfg.checkpoint
    for key, value in [("train.steps", t.steps), ("train.micro_batch", t.micro_batch),
                       ("train.grad_accum", t.grad_accum), ("train.log_every", t.log_every),
                       ("train.eval_batches", t.eval_batches), ("data.seq_len", d.seq_len),
                       ("data.max_bytes", d.max_bytes), ("data.val_every", d.val_every),
                       ("checkpoint.keep", ck.keep)]:
        _check(value >= 1, source, key, f"must be at least 1, got {value}")
    for key, value in [("train.eval_every", t.eval_every), ("checkpoint.every", ck.every),
                       ("train.warmup_steps", t.warmup_steps), ("train.lr", t.lr),
                       ("train.weight_decay", t.weight_decay), ("train.grad_clip", t.grad_clip)]:
        _check(value >= 0, source, key, f"must not be negative, got {value}")
    _check(0.0 <= t.min_lr_ratio <= 1.0, source, "train.min_lr_ratio",
           f"must be within [0, 1], got {t.min_lr_ratio}")
    _check(len(t.betas) == 2 and all(0.0 <= b < 1.0 for b in t.betas), source, "train.betas",
           f"must be two numbers in [0, 1), got {list(t.betas)}")
    _check(t.eps > 0, source, "train.eps", f"must be positive, got {t.eps}")
    _check(t.nonfinite in ("stop", "skip", "off"), source, "train.nonfinite",
           f"must be stop, skip or off, got {t.nonfinite!r}")
    _check(t.nonfinite_check in ("auto", "sync", "deferred"), source, "train.nonfinite_check",
           f"must be auto, sync or deferred, got {t.nonfinite_check!r}")
    _check(t.max_consecutive_skips >= 1, source, "train.max_consecutive_skips",
           f"must be at least 1, got {t.max_consecutive_skips}")
    _check(t.collective_timeout_s > 0, source, "train.collective_timeout_s",
           f"must be positive, got {t.collective_timeout_s}")
    _check(ds.precision in ("auto", "fp32", "bf16", "fp16"), source, "deepspeed.precision",
           f"must be auto, fp32, bf16 or fp16, got {ds.precision!r}")
    _check(_auto_or_bool(ds.activation_checkpointing), source,
           "deepspeed.activation_checkpointing",
           f"must be auto, true or false, got {json.dumps(ds.activation_checkpointing)}")
    _check(_auto_or_bool(t.compile), source, "train.compile",
           f"must be auto, true or false, got {json.dumps(t.compile)}")
    _check(t.compile_mode in COMPILE_MODES, source, "train.compile_mode",
           f"must be one of {', '.join(COMPILE_MODES)}, got {json.dumps(t.compile_mode)}")
    _check(t.compile_scope in COMPILE_SCOPES, source, "train.compile_scope",
           f"must be one of {', '.join(COMPILE_SCOPES)}, got {json.dumps(t.compile_scope)}")
    _check(t.attention_backend in ATTENTION_BACKENDS, source, "train.attention_backend",
           f"must be {' or '.join(ATTENTION_BACKENDS)}, got {json.dumps(t.attention_backend)}")
    _check(t.optimizer in ("auto", "torch_fused", "torch_foreach", "deepspeed"), source, "train.optimizer",
           f"must be auto, torch_fused, torch_foreach or deepspeed, got {t.optimizer!r}")
    _check(t.optimizer_type in ("adamw", "adam_atan2"), source, "train.optimizer_type",
           f"must be adamw or adam_atan2, got {t.optimizer_type!r}")
    _check(ds.mixed_precision in ("auto", "deepspeed", "autocast"), source, "deepspeed.mixed_precision",
           f"must be auto, deepspeed or autocast, got {ds.mixed_precision!r}")
    from dstrain.comms import COMM_DTYPES
    _check(ds.comm_dtype in COMM_DTYPES, source, "deepspeed.comm_dtype",
           f"must be {', '.join(COMM_DTYPES[:-1])} or {COMM_DTYPES[-1]}, got {ds.comm_dtype!r}")
    _check(_auto_or_bool(ds.zero_init), source, "deepspeed.zero_init",
           f"must be auto, true or false, got {json.dumps(ds.zero_init)}")
    _check(0.0 < ds.margin <= 1.0, source, "deepspeed.margin", f"must be in (0, 1], got {ds.margin}")
    for key in ("device_memory", "host_memory"):
        value = getattr(ds, key)
        if value is not None:
            from dstrain.engine.profiles import parse_bytes
            try:
                parse_bytes(value)
            except ValueError as err:
                raise ConfigError(source, f"deepspeed.{key}", str(err)) from None
    if ds.profile != "auto":
        from dstrain.engine.ds_config import DSConfigError, resolve_profile_path
        try:
            resolve_profile_path(ds.profile)
        except DSConfigError as err:
            raise ConfigError(source, "deepspeed.profile", str(err)) from None
    _check(bool(cfg.output.dir), source, "output.dir", "must not be empty")
    _check(bool(d.corpus.strip()), source, "data.corpus",  # ("" is the current folder: its files, silently)
           "must not be empty: stdlib or the path of a .txt/.jsonl file or a folder")
    _validate_parallel(cfg, source)
    _validate_model(cfg, source)
    _validate_task(cfg, source)
    _validate_placement(cfg, source)


def _validate_parallel(cfg: RunConfig, source: str) -> None:
    par = cfg.parallel
    for key in ("tp", "sp"):
        value = getattr(par, key)
        _check(value >= 1, source, f"parallel.{key}", f"must be at least 1, got {value}")
    _check(par.pp == "auto" or (isinstance(par.pp, int) and not isinstance(par.pp, bool) and par.pp >= 1),
           source, "parallel.pp", f"must be a positive integer or auto, got {json.dumps(par.pp)}")
    _check(par.pp in (1, "auto") or par.tp * par.sp == 1, source, "parallel.pp",
           f"pipeline parallelism (pp = {par.pp}) is supported with data parallelism only; "
           f"got tp = {par.tp}, sp = {par.sp} (set both to 1)")
    _check(par.pp in (1, "auto") or cfg.trainer == "lm", source, "parallel.pp",
           f"pipeline parallelism runs the supervised LM trainer only, not trainer {cfg.trainer!r}")
    _check(cfg.deepspeed.zero_init is not True or par.tp * par.sp == 1, source, "deepspeed.zero_init",
           f"true builds the model partitioned (deepspeed.zero.Init), which tensor and sequence parallelism "
           f"cannot split afterwards; got tp = {par.tp}, sp = {par.sp} (use zero_init auto or false)")
    _check(par.pp_partition in ("parameters", "uniform", "cost"), source, "parallel.pp_partition",
           f"must be parameters, uniform or cost, got {par.pp_partition!r}")
    ro = cfg.rollout
    _check(ro.backend in ("local", "ray"), source, "rollout.backend", f"must be local or ray, got {ro.backend!r}")
    _check(ro.cpus_per_worker > 0, source, "rollout.cpus_per_worker", f"must be positive, got {ro.cpus_per_worker}")
    _check(ro.num_cpus is None or (type(ro.num_cpus) is int and ro.num_cpus >= 1), source, "rollout.num_cpus",
           f"must be a positive integer or null (the machine's), got {json.dumps(ro.num_cpus)}")
    _check(ro.address is None or (isinstance(ro.address, str) and ro.address.strip() != ""), source,
           "rollout.address", f"must be a Ray address such as auto or host:6379, or null, got {json.dumps(ro.address)}")
    _check(ro.threads_per_worker >= 0, source, "rollout.threads_per_worker",
           f"must be 0 (the rank's) or more, got {ro.threads_per_worker}")
    _check(ro.backend == "local" or cfg.trainer in ("grpo", "score"), source, "rollout.backend",
           f"ray rollouts are for the RL trainers (grpo, score); {cfg.trainer!r} has none (use rollout.backend=local)")
    from dstrain.rl.vllm_generation import GENERATORS, vllm_missing
    _check(ro.generator in GENERATORS, source, "rollout.generator",
           f"must be one of {', '.join(GENERATORS)}, got {ro.generator!r}")
    if ro.generator == "vllm":
        _check(cfg.trainer == "grpo", source, "rollout.generator", f"vllm generation is built for the grpo trainer, "
               f"not {cfg.trainer!r} (use rollout.generator=hf)")
        _check(ro.backend == "local", source, "rollout.generator",
               "vllm runs colocated in the training ranks: use it with rollout.backend=local")
        _check(0 < ro.vllm_gpu_memory_utilization < 1, source, "rollout.vllm_gpu_memory_utilization",
               f"must be within (0, 1), got {ro.vllm_gpu_memory_utilization}")
        missing = vllm_missing()
        _check(not missing, source, "rollout.generator", f"{missing}; use rollout.generator=hf")
    _check(par.sp_mode in ("auto", "exchange", "ulysses"), source, "parallel.sp_mode",
           f"must be auto, exchange or ulysses, got {par.sp_mode!r}")
    _check(cfg.data.seq_len % par.sp == 0, source, "data.seq_len",
           f"{cfg.data.seq_len} is not divisible by parallel.sp = {par.sp}")


def _validate_task(cfg: RunConfig, source: str) -> None:
    from dstrain import trainers
    try:
        cls = trainers.task_config_class(cfg.trainer)
    except KeyError as err:
        raise ConfigError(source, "trainer", str(err.args[0])) from None
    _check(not (problem := trainers.model_problem(cfg)), source, "trainer", problem)  # another family's model
    _check(not (why := trainers.parallel_problem(cfg)), source, f"parallel.{'tp' if cfg.parallel.tp > 1 else 'sp'}", why)
    if cls is None:
        if cfg.task:
            raise ConfigError(source, "task", f"trainer {cfg.trainer!r} takes no task settings, "
                                              f"got {', '.join(sorted(cfg.task))}")
        return
    build_section(cls, cfg.task, source, "task.")
    if isinstance(cfg.task, dict) and cfg.task.get("chat_template") == "on":  # known now, not after the engines
        from models.policy.tokenizer import chat_template_problem
        args = cfg.model.args if isinstance(cfg.model.args, dict) else {}
        _check(not (why := chat_template_problem(str(args.get("path") or ""))), source, "task.chat_template", why)


def _validate_placement(cfg: RunConfig, source: str) -> None:
    from dstrain import trainers
    cls = trainers.task_config_class(cfg.trainer)
    if getattr(cls, "uses_placement", False):
        from dstrain.rl.placement import placement_from_dict
        section = getattr(cls, "placement_section", lambda task, placement: placement)(cfg.task, cfg.placement)
        placement_from_dict(section, source, "placement.")
    elif cfg.placement:
        raise ConfigError(source, "placement", f"trainer {cfg.trainer!r} takes no placement section (it trains "
                                               f"one model), got {', '.join(sorted(cfg.placement))}")


def _validate_model(cfg: RunConfig, source: str) -> None:
    from models import registry
    try:
        spec = registry.get_spec(cfg.model.name)
    except KeyError as err:
        raise ConfigError(source, "model.name", str(err.args[0])) from None
    if cfg.model.size not in spec.sizes:
        raise ConfigError(source, "model.size",
                          f"unknown size {cfg.model.size!r} of {cfg.model.name}; "
                          f"sizes: {', '.join(spec.sizes)}")
    path = cfg.model.args.get("path") if isinstance(cfg.model.args, dict) else None
    if isinstance(path, str) and path:  # absolute: export and --resume read it back from another directory
        cfg.model.args["path"] = os.path.abspath(os.path.expanduser(path))
    try:
        mcfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    except (ValueError, TypeError) as err:  # the key it names, so that a typo in an override names the command line
        bad = next((k for k in cfg.model.args if repr(k) in str(err) or str(err).startswith(f"{k} ")), None)
        raise ConfigError(source, "model.args" + (f".{bad}" if bad else ""), str(err)) from None
    for name, value in sorted(vars(mcfg).items()) if hasattr(mcfg, "__dict__") else ():
        if type(value) is int and abs(value) > INT64_MAX:  # (a tensor size past 64 bits: torch's TypeError)
            key = f"model.args.{name}" if name in cfg.model.args else "model.size"
            raise ConfigError(source, key, f"expected an integer of at most {INT64_MAX} (64 bits), got {value}")
        if name.lower().endswith(("layer", "layers")) and type(value) is int and value > MAX_LAYERS:
            key = f"model.args.{name}" if name in cfg.model.args else "model.size"  # (building them would not end)
            raise ConfigError(source, key, f"{value} layers is past any model dstrain can build or plan (at most "
                                           f"{MAX_LAYERS}); use a smaller {name}")
    par = cfg.parallel
    if spec.layout_problem is not None and (found := spec.layout_problem(mcfg, par.tp, par.sp, par.sp_mode,
                                                                           cfg.data.seq_len)):
        raise ConfigError(source, *found)  # (what each rank would raise at its first forward)
    block = getattr(mcfg, "block_size", None)
    if block is not None and cfg.data.seq_len > block:
        raise ConfigError(source, "data.seq_len",
                          f"{cfg.data.seq_len} exceeds the model's block_size {block}")


# ---------------------------------------------------------------- entry points
