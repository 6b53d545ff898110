"""A run's DeepSpeed JSON checked against its run config before any rank starts.

``dstrain launch`` runs these with the launch's world size before it starts anything,
and every rank runs them again before its trainer starts (so ``dstrain train`` started
by hand, torchrun or SLURM gets the same checks): the file filled with the run's values
(:func:`dstrain.engine.ds_config.fill_ds_config`), every section honoured or refused by
name (:mod:`dstrain.engine.ds_sections`), and DeepSpeed's own strict parsing
(:func:`dstrain.engine.ds_check.deepspeed_problems`).

``deepspeed.values_from_file=true`` makes the file's explicit numbers win instead:
:func:`adopt_file_values` copies them into the run config and says what it took.
"""
from __future__ import annotations

import re
from pathlib import Path

from dstrain.config import ConfigError, RunConfig
from dstrain.engine import ds_config as dsc

_HIDDEN_NAMES = ("n_embd", "hidden_size", "d_model", "dim", "hidden")


def _template(cfg: RunConfig) -> tuple[dict | None, str]:
    if cfg.deepspeed.profile == "auto":
        return None, "auto"
    path = dsc.resolve_profile_path(cfg.deepspeed.profile)
    return dsc.load_ds_json(path), str(path)


def _section_as_written(source: str, section: str) -> str:
    """``section`` as the file spells it: DeepSpeed-Chat's legacy ``"bfloat16"`` section (read as ``"bf16"``,
    which the file does not have) keeps its own name in what dstrain says it adopted from it."""
    if section != "bf16":
        return section
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError:
        return section
    return "bfloat16" if re.search(r'"bfloat16"\s*:', text) and not re.search(r'"bf16"\s*:', text) else section


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    """Data-parallel ranks of a ``world_size`` job (world / (tp x sp x pp)); ConfigError if they do not divide it."""
    par = cfg.parallel
    stages = par.pp if isinstance(par.pp, int) else 1  # "auto": decided with the plan (profile auto only)
    model = par.tp * par.sp * stages
    if world_size % model:
        pp = f" x pp {stages}" if stages > 1 else ""
        raise ConfigError("run config", "parallel",
                          f"tp {par.tp} x sp {par.sp}{pp} = {model} does not divide the "
                          f"{world_size} ranks of this launch")
    return world_size // model


def _explicit(node, path: str):
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return None if dsc._is_auto(node) else node


def _deepspeed_defaults(template: dict, taken: set[str]) -> list[tuple[str, object, str]]:
    """What DeepSpeed itself uses where the file says nothing: ``(run key, value, why)``.

    ``gradient_clipping`` (DeepSpeed's ``GRADIENT_CLIPPING_DEFAULT``), and for an Adam-family
    block the constructor defaults of the optimizer DeepSpeed would build (FusedAdam, its CPU
    Adam, or torch's with ``torch_adam``): lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight
    decay 0 (torch.optim.AdamW: 0.01). A key set to "auto" is the run's, as without the flag.
    """
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():  # importing deepspeed picks an accelerator; leave that to the ranks
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    found = []
    if "gradient_clipping" not in template:
        found.append(("train.grad_clip", float(GRADIENT_CLIPPING_DEFAULT), "gradient_clipping"))
    block = template.get("optimizer")
    kind = str(block.get("type", "")).lower() if isinstance(block, dict) else ""
    params = block.get("params") if isinstance(block, dict) else None
    params = params if isinstance(params, dict) else {}
    if kind in dsc._ADAM_TYPES:
        decoupled = kind == "adamw" or params.get("adam_w_mode", True) is not False
        torch_adamw = params.get("torch_adam") is True and decoupled
        for key, name, value in (("train.lr", "lr", 1e-3), ("train.betas", "betas", (0.9, 0.999)),
                                 ("train.eps", "eps", 1e-8),
                                 ("train.weight_decay", "weight_decay", 0.01 if torch_adamw else 0.0)):
            if name not in params:
                found.append((key, value, f"optimizer.params.{name}"))
    return [(key, value, f"{path}: DeepSpeed's default, the file leaves it out") for key, value, path in found
            if key not in taken]


def adopt_file_values(cfg: RunConfig, world_size: int) -> list[tuple[str, object, str]]:
    """With ``deepspeed.values_from_file``: take the file's explicit values into ``cfg`` (in place).

    Batch sizes (DeepSpeed's derivation with the data-parallel size), optimizer lr, betas,
    eps and weight_decay, gradient_clipping, the scheduler's warm-up steps, warm-up peak
    (as lr, when the optimizer block gives none) and cosine floor, and bf16 / fp16 as the
    precision; where the file leaves gradient_clipping or an Adam block's numbers out, what
    DeepSpeed would use (:func:`_deepspeed_defaults`). The scheduler's ``total_num_steps`` is
    not adopted: ``train.steps`` decides how long the run is. Returns ``(run key, value, from
    where)`` for each value changed.
    """
    template, source = _template(cfg)
    if template is None or not cfg.deepspeed.values_from_file:
        return []
    from dstrain.engine import ds_trainers
    dp = data_parallel_size(cfg, world_size)
    t = ds_trainers.trainer_train(cfg, world_size)
    file_dp = dsc.file_data_parallel(template, dp) if cfg.parallel.sp == 1 else dp
    micro, accum, problems = dsc.implied_batch(template, file_dp, t.micro_batch, t.grad_accum)
    if not problems:  # batch keys that disagree: named below with the file's other numbers, all at once
        ds_trainers.hrm_file_problems(cfg, template, dp, source)
    wanted: list[tuple[str, object, str]] = []
    if micro is not None:
        key, value = ds_trainers.adopt_batch_key(cfg, "train.micro_batch", micro, world_size)
        wanted.append((key, value, "train_micro_batch_size_per_gpu"))
    if accum is not None:
        wanted.append(("train.grad_accum", accum, "gradient_accumulation_steps"))
    numbers = [("train.lr", "optimizer.params.lr"), ("train.betas", "optimizer.params.betas"),
               ("train.eps", "optimizer.params.eps"), ("train.weight_decay", "optimizer.params.weight_decay"),
               ("train.grad_clip", "gradient_clipping"), ("train.warmup_steps", "scheduler.params.warmup_num_steps"),
               ("train.min_lr_ratio", "scheduler.params.cos_min_ratio")]
    if dsc.sets_lr_itself(template):  # WarmupLR / WarmupDecayLR set the lr: their peak is the run's lr
        numbers[0] = ("train.lr", "scheduler.params.warmup_max_lr")
    elif _explicit(template, "optimizer.params.lr") is None:
        numbers.append(("train.lr", "scheduler.params.warmup_max_lr"))
    for key, path in numbers:
        value = _explicit(template, path)
        pair = key == "train.betas"
        if value is not None and not dsc._is_number_like(value, (0.0, 0.0) if pair else 0.0):
            problems.append(dsc.number_problem(path, value, pair))
        elif value is not None and (bad := dsc.range_problem(path, value)) is not None:
            problems.append(bad)  # named by the file's key, not as the run key it would have become
        elif value is not None:
            wanted.append((key, tuple(value) if isinstance(value, list) else value, path))
    if problems:  # a number written as a string, batch keys that disagree, ...: named, not taken
        raise dsc.DSConfigError(source, problems)
    wanted += _deepspeed_defaults(template, {key for key, _, _ in wanted})
    from dstrain.engine.ds_autocast import autocast_precision
    enabled = [kind for kind in ("bf16", "fp16") if _explicit(template, f"{kind}.enabled") is True]
    if len(enabled) == 1:  # both: refused by the checks that follow (DeepSpeed allows only one)
        wanted.append(("deepspeed.precision", enabled[0], f"{_section_as_written(source, enabled[0])}.enabled"))
    elif (autocast := autocast_precision(template)) is not None:  # the section DeepSpeed runs as written
        wanted.append(("deepspeed.precision", autocast, "torch_autocast.enabled"))
    elif (weights := dsc.open_weights_dtype(template)) is not None:  # the weights' dtype DeepSpeed asserts
        wanted.append(("deepspeed.precision", weights, dsc.pinned_weights(template)[1]))
    adopted = []
    for key, value, path in wanted:
        section, name = key.split(".")
        holder = getattr(cfg, section)
        old = holder.get(name) if isinstance(holder, dict) else getattr(holder, name)
        if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if old != value:
            if isinstance(holder, dict):  # the free-form task section (HRM's task.global_batch)
                holder[name] = value
            else:
                setattr(holder, name, value)
            where = path.replace(": ", f" in {source}: ", 1) if ": " in path else f"{path} in {source}"
            adopted.append((key, value, f"{where} (was {dsc.format_override(old)})"))
    from dstrain.config_checks import validate
    try:
        validate(cfg, source)
    except ConfigError as err:
        raise ConfigError(source, err.key, f"{err.problem} (taken from the file by deepspeed.values_from_file)") \
            from None
    return adopted


def adopted_overrides(adopted: list[tuple[str, object, str]]) -> list[str]:
    """The adopted values as command-line overrides (``--train.lr=0.0003``), for the ranks' command."""
    return [f"--{key}={dsc.format_override(value)}" for key, value, _ in adopted]


def _hidden_size(cfg: RunConfig) -> int:
    from models import registry
    mcfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    for name in _HIDDEN_NAMES:
        value = getattr(mcfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1024


def _leaf_findings(cfg: RunConfig, template: dict) -> tuple[list[str], list[str]]:
    """ZeRO-3 leaf settings that would make the run's whole model one leaf, and leaf classes the model does not have
    (refusals, notes: dstrain.engine.zero_leaves)."""
    from dstrain.engine.zero_leaves import leaf_findings

    def build():  # only where the file sets leaf modules (failures there are DeepSpeed's to report)
        from models import registry
        spec = registry.get_spec(cfg.model.name)
        return spec.build(registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args))
    return leaf_findings(template, build)


def check_run(cfg: RunConfig, world_size: int, device_type: str, strict: bool = True) -> list[str]:
    """Refuse (DSConfigError / ConfigError) what the run's DeepSpeed JSON cannot do here; return notes.

    The file is filled with the run config's values on ``world_size`` ranks (the precision
    the run asks for, the file's own, or fp32 as a stand-in when the factory will choose),
    then every section is checked (:func:`dstrain.engine.ds_sections.section_problems`)
    and, with ``strict``, parsed by DeepSpeed's own classes. The run's own fp16 request on
    a CPU is refused here too, naming the alternatives.
    """
    from dstrain.engine.ds_check import _placeholders, beside_unfillable, deepspeed_problems, merge_problems
    from dstrain.engine.ds_classes import run_notes, run_problems
    from dstrain.engine.ds_engine_keys import run_length_problems
    from dstrain.engine.ds_sections import section_problems
    template, source = _template(cfg)
    # the clipping DeepSpeed gets where the file leaves it out or "auto": the run's (ZeRO's compute_grad_norm needs 0)
    seen = template if template is None or _explicit(template, "gradient_clipping") is not None else \
        {**template, "gradient_clipping": cfg.train.grad_clip}
    found, notes = section_problems(seen, device_type) if template is not None else ([], [])
    if template is not None:
        from dstrain.engine.ds_trainers import updates_per_step
        leaf_refusals, leaf_notes = _leaf_findings(cfg, template)
        found += leaf_refusals + run_length_problems(template, cfg.train.steps, updates_per_step(cfg))
        notes += leaf_notes
        found += run_problems(template, cfg.train.steps)
        notes += run_notes(template, cfg.train.betas)
    if device_type == "cpu" and cfg.deepspeed.precision == "fp16" and not found:  # else the file's fp16 is named
        raise ConfigError("run config", "deepspeed.precision",
                          "fp16 does not run on the CPU accelerator (DeepSpeed raises 'Type fp16 is not supported'); "
                          "use --deepspeed.precision=bf16 or --deepspeed.precision=fp32")
    if template is None:
        return []
    zero = template.get("zero_optimization")  # (not an object: refused below with the file's other problems)
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if cfg.parallel.pp not in (1, "auto") and isinstance(stage, int) and stage >= 2:  # as the factory checks it
        from dstrain.engine.profiles import PROFILE_ORDER  # (check-config did not, and called pp 2 with zero3 valid)
        from dstrain.parallel.pipeline import check_profile
        if cfg.deepspeed.profile in PROFILE_ORDER:  # a shipped profile: named by its profile
            try:
                check_profile(template, source)
            except ValueError as err:
                raise ConfigError(source, "", str(err).removeprefix(f"{source}: ")) from None
        raise ConfigError(source, "zero_optimization.stage",  # a user's file: by the key, the fix in the file
                          f"{stage}, but DeepSpeed's pipeline engine (parallel.pp={cfg.parallel.pp}) takes ZeRO-0 or "
                          f"ZeRO-1 only; set the file's zero_optimization.stage to 1 (or 0), or run without pipeline "
                          f"parallelism (--parallel.pp=1)")
    from dstrain.engine import ds_trainers
    dp = data_parallel_size(cfg, world_size)
    ds_trainers.hrm_file_problems(cfg, template, dp, source)
    ds_trainers.rl_batch_problems(cfg, template, world_size, source)
    precision = cfg.deepspeed.precision
    if precision == "auto":
        from dstrain.engine.ds_autocast import autocast_precision
        precision = next((k for k in ("bf16", "fp16") if _explicit(template, f"{k}.enabled") is True), None) \
            or autocast_precision(template) or dsc.open_weights_dtype(template) or "fp32"
    t = ds_trainers.trainer_train(cfg, world_size)  # the batch the trainer will feed DeepSpeed
    try:
        values = dsc.RunValues(
            micro_batch=t.micro_batch, grad_accum=t.grad_accum, lr=t.lr, betas=tuple(t.betas),
            dp_world_size=dsc.file_data_parallel(template, dp) if cfg.parallel.sp == 1 else dp,
            eps=t.eps, weight_decay=t.weight_decay, grad_clip=t.grad_clip, precision=precision,
            hidden_size=_hidden_size(cfg), total_steps=t.steps, warmup_steps=t.warmup_steps,
            min_lr_ratio=t.min_lr_ratio)
    except ValueError as err:
        raise ConfigError("run config", "", str(err)) from None
    filling = None
    try:
        filled = dsc.fill_ds_config(template, values, source)
    except dsc.DSConfigError as err:
        filling, filled = ds_trainers.translate_fixes(cfg, world_size, err), _placeholders(template)
    # every problem in one refusal: the file's sections, its disagreements with the run, DeepSpeed's parser
    strict = deepspeed_problems(filled, full_parse=filling is None and not found) if strict else []
    if filling is not None and cfg.deepspeed.values_from_file:  # the switch is on: do not offer it again
        filling = dsc.DSConfigError(source, filling.problems, filling.fixes, filling.mismatches, switch_on=True)
    if filling is not None and not found and not strict:
        raise filling  # disagreements only: one line that ends with the overrides that remove them
    if filling is not None:
        found = beside_unfillable(found, filling.problems)
    problems = merge_problems(found + (filling.problems if filling is not None else []), strict)
    if problems:
        fixes = filling.fixes if filling is not None else {}
        raise dsc.DSConfigError(source, problems, fixes, switch_on=cfg.deepspeed.values_from_file)
    return notes
