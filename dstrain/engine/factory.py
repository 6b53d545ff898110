"""The engine factory: run config + model -> a resolved DeepSpeed config -> an engine.

:func:`plan_engine` is the decision (pure apart from measuring the machine):
which profile, precision and activation checkpointing, and the DeepSpeed JSON
with every "auto" filled. :func:`create_engine` is the one place in dstrain that
calls ``deepspeed.initialize``; trainers see the narrow :class:`Engine`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import math

import torch

from dstrain.config import RunConfig, TrainConfig
from dstrain.comms import comms_sections
from dstrain.engine import compiling, cuda_env
from dstrain.engine import ds_config as dsc
from dstrain.engine import hardware
from dstrain.engine.engine import Engine
from dstrain.engine.grad_norm import fast_zero_norm, keep_grad_norm
from dstrain.engine.ds_sections import bf16_overflow_check
from dstrain.engine.optim import OptimizerChoice, apply_optimizer_type, choose_optimizer, group_weight_decay
from dstrain.engine.zero_tuning import fill_zero_sizes
from dstrain.optim.lazy_state import client_optimizer, drop_stale_optimizer_state
from dstrain.engine.profiles import (Plan, choose_plan, choose_precision, format_plan)


@dataclass
class EnginePlan:
    """Everything decided before DeepSpeed starts."""

    profile: str
    """Profile name (or the JSON path the user gave)."""
    ds_config: dict
    """Resolved DeepSpeed JSON: no "auto" left."""
    precision: str
    activation_checkpointing: bool
    explanation: str
    """Human-readable table and reason, as ``dstrain plan`` prints it."""
    plan: Plan | None = None
    shard_at_build: bool = False
    """ZeRO-3 only: build under ``zero.Init`` because one full copy per rank would not fit in RAM."""
    optimizer: OptimizerChoice | None = None
    """Which optimizer implementation runs (None: DeepSpeed builds what ``ds_config`` names)."""
    compile: bool = False
    """``torch.compile`` the model inside the engine (``train.compile``)."""
    compile_mode: str = "default"
    """``train.compile_mode``: torch.compile's ``mode`` ("default" passes none)."""
    compile_regions: Callable | None = None
    """``train.compile_scope`` regions: module -> the submodules compiled one by one (None: the whole model)."""
    attention_backend: str = "auto"
    """``train.attention_backend``: the SDPA kernel order each forward runs under (dstrain.ops.attention)."""
    pipeline: Any = None
    """``dstrain.parallel.pipeline.PipelineSetup`` when ``parallel.pp > 1`` (the stage split), else None."""

    @property
    def zero(self) -> dict:
        return dsc.describe_zero(self.ds_config)


def _model_parts(cfg: RunConfig):
    from models import registry
    spec = registry.get_spec(cfg.model.name)
    mcfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    return spec, mcfg


def _file_precision(template: dict) -> str | None:
    """The precision a DeepSpeed JSON fixes, None where it leaves it to dstrain ("auto"). A file with
    neither section enabled nor "auto" trains in fp32, as DeepSpeed reads it (a user's file that never
    mentions bf16 is not switched to it); one with an enabled ``torch_autocast`` section in that section's
    precision (:func:`dstrain.engine.ds_autocast.autocast_precision`: DeepSpeed runs it as written)."""
    sections = [template.get(key) for key in ("bf16", "fp16")]
    for key, section in zip(("bf16", "fp16"), sections):
        if isinstance(section, dict) and section.get("enabled") is True:
            return key
    from dstrain.engine.ds_autocast import autocast_precision
    if (decided := autocast_precision(template)) is not None:
        return decided  # fp32: autocast to fp32 lowers nothing (off on the CPU)
    autocast = isinstance(template.get("torch_autocast"), dict) and template["torch_autocast"].get("enabled") is True
    open_sections = any(isinstance(s, dict) and str(s.get("enabled")).lower() == "auto" for s in sections)
    if open_sections or autocast:
        return dsc.pinned_weights_dtype(template)  # param_dtype (DeepSpeed asserts it), stage 0's grad_accum_dtype
    return "fp32"


def run_values(cfg: RunConfig, world_size: int, precision: str, hidden_size: int) -> dsc.RunValues:
    t = cfg.train
    return dsc.RunValues(
        micro_batch=t.micro_batch, grad_accum=t.grad_accum, dp_world_size=world_size,
        lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay,
        grad_clip=t.grad_clip, precision=precision, hidden_size=hidden_size,
        total_steps=t.steps, warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio)


def plan_engine(cfg: RunConfig, world_size: int, hw=None, hw_notes: str = "",
                ranks_per_node: int | None = None, device_type: str | None = None) -> EnginePlan:
    """Choose profile, precision and activation checkpointing and fill the DeepSpeed JSON."""
    from dstrain.engine.ds_trainers import planned_seq_len, scale_schedule_horizon, trainer_train, updates_per_step
    from dstrain.parallel.dims import ParallelDims
    if (train := trainer_train(cfg, world_size)) is not cfg.train:  # HRM: task.global_batch / ranks per rank
        cfg = dataclasses.replace(cfg, train=train)
    spec, mcfg = _model_parts(cfg)
    par = cfg.parallel
    dims = ParallelDims.from_world(world_size, par.tp, par.sp, 1 if par.pp == "auto" else par.pp)
    build = lambda: spec.build(mcfg)  # noqa: E731
    stats = hardware.model_stats(build)
    if hw is None:
        hw, hw_notes = hardware.detect_hardware(cfg.deepspeed.device_memory, cfg.deepspeed.host_memory,
                                                ranks_per_node=ranks_per_node or min(world_size, 8),
                                                device_type=device_type)
    # Sequence parallelism: one rank holds seq_len / sp tokens. ZeRO partitions over the
    # ranks that hold the same tensor shard (dp x sp); the batch identity counts dp only.
    seq_len, seq_note = planned_seq_len(cfg)  # policy RL: task.max_prompt_tokens + max_new_tokens where set
    seq = seq_len // dims.sp
    acts = hardware.trace_activations(
        build, lambda: spec.inputs_for_trace(mcfg, 1, seq), lambda m, flag: spec.parallelize(m, activation_checkpointing=flag),
        (lambda: spec.inputs_for_trace(mcfg, 2, seq)) if hw.device_type == "cuda" else None)
    ds = cfg.deepspeed
    pipe, stage_text, auto_note = None, "", ""
    if par.pp == "auto":
        pp, auto_note = _auto_pp(spec, mcfg, cfg, stats, hw, acts, world_size)
        dims = ParallelDims.from_world(world_size, par.tp, par.sp, pp)
    plan_cfg = _planned_amp(cfg, dims.pp)
    if dims.pp > 1:
        from dstrain.parallel.pipeline import plan_stages
        pipe, plan, stage_text = plan_stages(spec, mcfg, plan_cfg, dims, hw, acts)
    else:
        plan, stage_text = _plan_or_suggest_pp(spec, mcfg, plan_cfg, stats, hw, acts, dims, world_size)
    if ds.profile == "auto":
        profile, precision, ckpt = plan.profile, plan.precision, plan.activation_checkpointing
        why = f"profile {profile}: {plan.reason}"
    else:
        template = dsc.load_ds_json(dsc.resolve_profile_path(ds.profile))
        requested = ds.precision if ds.precision != "auto" else (_file_precision(template) or "auto")
        precision, _ = choose_precision(hw, requested)
        profile = ds.profile
        ckpt = ds.activation_checkpointing is True
        pinned = getattr(ds, "pinned_from", None)
        why = (f"profile {profile}: kept from the checkpoint resumed, {pinned} (the factory would pick "
               f"{plan.profile})" if pinned else
               f"profile {profile}: named in the run config (the factory would pick {plan.profile})")
    template = apply_optimizer_type(dsc.load_ds_json(dsc.resolve_profile_path(profile)), cfg.train.optimizer_type)
    source = str(dsc.resolve_profile_path(profile))
    if pipe is not None:
        from dstrain.parallel.pipeline import check_profile
        check_profile(template, source)
    values = run_values(cfg, dims.dp, precision, stats.hidden_size)
    resolved = dsc.fill_ds_config(fill_zero_sizes(template, stats.params, stats.hidden_size), values, source)
    optimizer, resolved = choose_optimizer(resolved, cfg.train.optimizer, hw.device_type, values,
                                           cfg.train.optimizer_type)
    # The pipeline engine runs DeepSpeed's own bf16 (its BF16_Optimizer path), not torch.autocast.
    amp_mode = "deepspeed" if pipe is not None and ds.mixed_precision == "auto" else ds.mixed_precision
    resolved, amp_note = mixed_precision(resolved, template, amp_mode, hw.device_type)
    resolved, overflow_note = bf16_overflow_check(resolved, template, cfg.train.nonfinite)
    resolved, section_notes = user_sections(resolved, cfg.output.dir, source)
    resolved, comm_notes = comms_sections(resolved, cfg.output.comms, ds.comm_dtype, source)
    scale_schedule_horizon(resolved, updates_per_step(cfg))  # GRPO: task.num_iterations updates a step
    section_notes += comm_notes
    compile_, compile_why = compiling.compile_choice(cfg, hw.device_type, pipe is not None)
    scope = compiling.compile_scope(cfg, spec.compile_regions) if compile_ else "model"
    named_by = "checkpoint resumed sets" if getattr(ds, "pinned_from", None) else "run names"
    table = ("" if ds.profile == "auto" else f"the factory's own choice, NOT used (the {named_by} a profile, below):\n") \
        + format_plan(plan, stats, hw, dims.replica_size, cfg.train.micro_batch)
    layout = (f"parallel layout: dp {dims.dp} x tp {dims.tp} x sp {dims.sp} = {world_size} ranks; model states "
              f"planned for the full model partitioned over dp x sp = {dims.replica_size}, activations "
              f"traced at {cfg.data.seq_len // dims.sp} tokens per rank" if dims.tp * dims.sp > 1 else "")
    if pipe is not None:
        layout = (f"parallel layout: pp {dims.pp} x dp {dims.dp} = {world_size} ranks; the table's model states "
                  f"and activations are the fullest stage's")
    explanation = "\n".join(x for x in (hw_notes, auto_note, layout, seq_note, table, stage_text, why,
                                        f"precision {precision}, activation checkpointing "
                                        f"{'on' if ckpt else 'off'}, torch.compile {'on' if compile_ else 'off'}"
                                        f" (train.compile={cfg.train.compile}{compile_why}"
                                        f"{', mode ' + cfg.train.compile_mode if compile_ else ''}"
                                        f"{compiling.describe(scope, cfg.model.name) if compile_ else ''})",
                                        amp_note, overflow_note, optimizer.description,
                                        compiling.attention_note(cfg, hw.device_type, precision),
                                        _schedule_line(resolved),
                                        *section_notes) if x)
    # A full fp32 copy of the model on every local rank at once must leave half the RAM free; tensor and
    # sequence parallelism split full weights after the build (and zero.Init would count tp x sp as dp).
    shard = (4 * stats.params * hw.ranks_per_node > 0.5 * hw.host_memory
             if ds.zero_init == "auto" else ds.zero_init) and dims.tp * dims.sp == 1
    return EnginePlan(profile=profile, ds_config=resolved, precision=precision,
                      activation_checkpointing=ckpt, explanation=explanation, plan=plan,
                      shard_at_build=shard and pipe is None, optimizer=optimizer, compile=compile_,
                      compile_mode=cfg.train.compile_mode, pipeline=pipe,
                      compile_regions=spec.compile_regions if scope == "regions" else None,
                      attention_backend=cfg.train.attention_backend)


def _schedule_line(resolved: dict) -> str:
    """plan.txt's line on the learning-rate schedule: the file's block, dstrain's own, or none (an empty block, from
    which DeepSpeed builds no scheduler, while its presence keeps dstrain's off: the lr stays constant)."""
    if "scheduler" not in resolved:
        return "learning-rate schedule: dstrain's warm-up + cosine (the JSON has no scheduler block)"
    if not (resolved["scheduler"] or {}).get("type"):
        return ("learning-rate schedule: none, the lr stays constant (the JSON's scheduler block is empty, and "
                "DeepSpeed builds no scheduler from it; remove the block for dstrain's warm-up + cosine)")
    return "learning-rate schedule: the DeepSpeed JSON's scheduler block"


def _planned_amp(cfg: RunConfig, pp: int) -> RunConfig:
    """``cfg`` as the memory plan reads it: with ``deepspeed.mixed_precision`` "autocast" where a named DeepSpeed JSON
    turns ``torch_autocast`` on itself and :func:`mixed_precision` will run bf16 as that section (fp32 weights and
    gradients: the fp32 row of model states above ZeRO-0; ``ds_autocast.planned_mixed_precision``)."""
    ds = cfg.deepspeed
    if ds.profile == "auto":
        return cfg
    from dstrain.engine.ds_autocast import planned_mixed_precision
    mode = "deepspeed" if pp > 1 and ds.mixed_precision == "auto" else ds.mixed_precision  # as plan_engine runs it
    planned = planned_mixed_precision(dsc.load_ds_json(dsc.resolve_profile_path(ds.profile)), mode)
    if planned == ds.mixed_precision:
        return cfg
    import dataclasses
    return dataclasses.replace(cfg, deepspeed=dataclasses.replace(ds, mixed_precision=planned))


def _auto_pp(spec, mcfg, cfg, stats, hw, acts, world_size) -> tuple[int, str]:
    """``parallel.pp = auto``: ``(pp, why)``.

    1 when the profile is named, the model or trainer cannot be pipelined, or ZeRO without
    parameter partitioning (ZeRO-0/1/2, no offload) fits the whole model; otherwise the
    smallest pp under which ZeRO-0/1 fits every stage (activations move between neighbouring
    stages instead of ZeRO-3 gathering every parameter for every micro-batch); 1 again when
    no pp fits (ZeRO-3 / offload decide).
    """
    from dstrain.engine.profiles import PlanError, suggest_pp
    par, ds, t = cfg.parallel, cfg.deepspeed, cfg.train
    if ds.profile != "auto" or spec.pipeline is None or par.tp * par.sp > 1 or cfg.trainer != "lm" \
            or world_size < 2:
        return 1, "parallel.pp auto -> 1: pipelining needs deepspeed.profile auto, tp = sp = 1, the lm trainer, " \
                  "a model with pipeline layers and 2+ ranks"
    try:
        choose_plan(stats, hw, acts, world_size, t.micro_batch, precision=ds.precision,
                    activation_checkpointing=ds.activation_checkpointing, margin=ds.margin,
                    profiles=("zero0", "zero1", "zero2"), mixed_precision=ds.mixed_precision)
        return 1, "parallel.pp auto -> 1: ZeRO-0/1/2 fits the whole model"
    except PlanError:
        pass
    from dstrain.parallel.pipeline import layer_activations
    pp = suggest_pp(spec.pipeline(mcfg, False).param_counts(), hw, acts, world_size, t.micro_batch, t.grad_accum,
                    precision=ds.precision, margin=ds.margin, layer_acts=layer_activations(spec, mcfg, cfg.data.seq_len),
                    mixed_precision=ds.mixed_precision)
    if pp is None:
        return 1, "parallel.pp auto -> 1: ZeRO-0/1/2 does not fit and no pipeline degree fits with ZeRO-0/1"
    return pp, (f"parallel.pp auto -> {pp}: ZeRO-0/1/2 does not fit the whole model on {world_size} ranks, "
                f"ZeRO-0/1 fits every one of {pp} stages (preferred over ZeRO-3's parameter gathering)")


def _plan_or_suggest_pp(spec, mcfg, cfg, stats, hw, acts, dims, world_size):
    """``(choose_plan's plan, note)``, considering pipeline stages when ZeRO alone struggles.

    When the plan needs parameter partitioning or offload (ZeRO-3, offload profiles), the
    note names the smallest pipeline degree under which ZeRO-0/1 fits every stage (no
    parameter gathering per micro-batch); when nothing fits, the PlanError names it.
    """
    from dstrain.engine.profiles import PlanError, suggest_pp
    ds, t = cfg.deepspeed, cfg.train
    pipelinable = spec.pipeline is not None and dims.tp * dims.sp == 1 and world_size > 1

    def pp_that_fits():
        from dstrain.parallel.pipeline import layer_activations
        counts = spec.pipeline(mcfg, False).param_counts()
        return suggest_pp(counts, hw, acts, world_size, t.micro_batch, t.grad_accum, precision=ds.precision,
                          margin=ds.margin, layer_acts=layer_activations(spec, mcfg, cfg.data.seq_len),
                          mixed_precision=ds.mixed_precision)
    try:
        plan = choose_plan(stats, hw, acts, dims.replica_size, t.micro_batch, precision=ds.precision,
                           activation_checkpointing=ds.activation_checkpointing, margin=ds.margin,
                           mixed_precision=ds.mixed_precision, grad_accum=t.grad_accum)
    except PlanError as err:
        pp = pp_that_fits() if pipelinable else None
        if pp is None:
            raise
        raise PlanError(f"{err}; or cut the model into pipeline stages: --parallel.pp={pp} fits "
                        f"(ZeRO-0/1 per stage, dp {world_size // pp})", err.estimates) from None
    if pipelinable and (plan.profile == "zero3" or "offload" in plan.profile):
        pp = pp_that_fits()
        if pp is not None:
            return plan, (f"pipeline alternative: --parallel.pp={pp} fits with ZeRO-0/1 per stage (dp "
                          f"{world_size // pp}), without {plan.profile}'s parameter gathering or offload")
    return plan, ""


_MONITOR_PATHS = (("tensorboard", "output_path"), ("csv_monitor", "output_path"),
                  ("flops_profiler", "output_file"))


def user_sections(resolved: dict, out_dir: str, source: str) -> tuple[dict, list[str]]:
    """Monitors, profilers and DeepSpeed's activation-checkpointing block as dstrain runs them.

    Relative monitor paths (``tensorboard.output_path``, ``csv_monitor.output_path``,
    ``flops_profiler.output_file``) resolve inside the run's output folder, and an enabled
    monitor without one writes there too (DeepSpeed's default is the working directory).
    DeepSpeed's ``activation_checkpointing`` block acts only on models that call
    ``deepspeed.checkpointing``; dstrain's models checkpoint through their own
    ``parallelize`` (``deepspeed.activation_checkpointing``), so a block that turns any
    of its features on is refused by name, and an all-off block is dropped with a note.
    Returns ``(the JSON for DeepSpeed, notes)``; raises DSConfigError naming the key.
    """
    import os
    out = dict(resolved)
    notes = []
    for section, key in _MONITOR_PATHS:
        block = out.get(section)
        if not isinstance(block, dict) or block.get("enabled") is not True:
            continue
        path = block.get(key)
        if not path:
            path = "ds_" + section + (".txt" if key == "output_file" else "")
        if not os.path.isabs(str(path)):
            out[section] = {**block, key: os.path.join(out_dir, str(path))}
            notes.append(f"{section}.{key} -> {out[section][key]}")
    ac = out.get("activation_checkpointing")
    if isinstance(ac, dict):
        from dstrain.engine.ds_scalars import activation_checkpointing_problem
        refusal = activation_checkpointing_problem(ac)  # also named by the checks before launch (ds_sections)
        if refusal:
            raise dsc.DSConfigError(source, refusal)
        out.pop("activation_checkpointing")
        notes.append("activation_checkpointing block (all features off) dropped: dstrain's models checkpoint "
                     "through deepspeed.activation_checkpointing")
    return out, notes


def mixed_precision(resolved: dict, template: dict, mode: str, device_type: str) -> tuple[dict, str]:
    """Run bf16 as DeepSpeed's 16-bit weights or as ``torch.autocast`` over fp32 weights.

    Without ZeRO partitioning both hold 16 bytes of model state per parameter, but the
    autocast form skips DeepSpeed's bf16 optimizer wrapper (flat fp32 copies of weights
    and gradients and the copies between them) and lets the fused AdamW update the
    weights in place: on GPUs it is the faster of the two (the same loop a plain
    ``torch.autocast`` script runs). ``auto`` takes it on CUDA at ZeRO stage 0 when the
    profile leaves bf16 to the factory (``"enabled": "auto"``); a file that sets
    ``bf16.enabled`` itself keeps DeepSpeed's bf16.
    """
    bf16 = resolved.get("bf16", {}).get("enabled") is True
    stage = (resolved.get("zero_optimization") or {}).get("stage", 0)
    left_to_us = (template.get("bf16") or {}).get("enabled") == "auto"
    # a file asking for torch_autocast itself (bf16 not set true there) gets it, on every device and stage
    file_autocast = (template.get("torch_autocast") or {}).get("enabled") is True \
        and (template.get("bf16") or {}).get("enabled") is not True
    if mode == "auto":
        mode = "autocast" if bf16 and (file_autocast or (left_to_us and stage == 0 and device_type == "cuda")) \
            else "deepspeed"
    from dstrain.engine.ds_autocast import autocast_precision
    # the run's bf16 is that section (no bf16 section was filled in for it): written out as the autocast form
    by_section = not bf16 and file_autocast and autocast_precision(template) == "bf16"
    if not by_section and (not bf16 or mode == "deepspeed"):
        return resolved, ""
    out = dict(resolved)
    out["bf16"] = {"enabled": False}
    if file_autocast:  # the file's block (its dtype, lower_precision_safe_modules) kept
        out["torch_autocast"] = {"dtype": "bfloat16", **template["torch_autocast"], "enabled": True}
        return out, "bf16 as torch.autocast over fp32 weights (the file's torch_autocast section)"
    out["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return out, "bf16 as torch.autocast over fp32 weights (deepspeed.mixed_precision=autocast or auto on a GPU)"


def param_groups(model: torch.nn.Module, weight_decay: float | None) -> list[dict]:
    """Decay matrices and embeddings, not biases and norm gains (nanoGPT's rule); None: the
    optimizer's own default for the decayed group (:func:`dstrain.engine.optim.group_weight_decay`)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))
        (decay if ndim >= 2 else no_decay).append(p)
    decayed = {"params": decay} if weight_decay is None else {"params": decay, "weight_decay": weight_decay}
    return [decayed, {"params": no_decay, "weight_decay": 0.0}]


class WarmupCosine:
    """Learning-rate factor for optimizer step k (0-based): linear warm-up, then cosine.

    ``(k + 1) / warmup`` for k < warmup (so the first step already learns), then a
    cosine from 1 down to ``min_ratio`` reached at k = total. Used when the
    DeepSpeed JSON has no "scheduler" section (DeepSpeed's WarmupCosineLR spends
    its first two steps at learning rate 0).
    """

    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, k: int) -> float:
        if k < self.warmup:
            return (k + 1) / self.warmup
        progress = min(1.0, (k - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduler_factory(train: TrainConfig):
    """A callable DeepSpeed turns into the scheduler: optimizer -> LambdaLR.

    The factor is wrapped in a plain function so that LambdaLR's checkpointed state
    holds only the step: a resumed run follows the schedule of its own run config
    (e.g. more steps), not the one saved in the checkpoint.
    """
    schedule = WarmupCosine(train.warmup_steps, train.steps, train.min_lr_ratio)
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: schedule(k))


def _init_sharded(model: torch.nn.Module) -> None:
    """Re-run the model's initialisation one module at a time on gathered parameters.

    Under ``zero.Init`` every submodule is partitioned as soon as its own
    ``__init__`` returns, so a model-wide init written afterwards touches empty
    shards. Models that expose ``init_module(name, module)`` get it replayed here
    in construction order (same random numbers as an unsharded build); rank 0's
    values are kept.
    """
    import deepspeed

    init = getattr(model, "init_module", None)
    if init is None:
        return
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                init(name, module)


def create_engine(build_model: Callable[[], torch.nn.Module],
                  parallelize: Callable[..., Any], plan: EnginePlan,
                  train: TrainConfig, parallel=None, sp_mode: str = "auto", pipeline_parts=None) -> Engine:
    """Build the model (sharded at construction under ZeRO-3) and start DeepSpeed.

    This is the only call of ``deepspeed.initialize`` in dstrain. The learning
    rate follows the JSON's "scheduler" if it has one, else :class:`WarmupCosine`.
    With ``parallel`` (a ParallelState with tp or sp > 1) the model's parallelize
    gets it, and DeepSpeed gets an mpu: gradients are averaged over dp x sp, the
    norm sums tensor-parallel shards (parameters tagged ``model_parallel``).
    """
    import deepspeed

    if plan.pipeline is not None:
        return _create_pipeline_engine(build_model, pipeline_parts, plan, train)
    if plan.zero["stage"] == 3 and plan.shard_at_build:
        with deepspeed.zero.Init(config_dict_or_path=plan.ds_config):
            model = build_model()
        _init_sharded(model)
    else:
        model = build_model()
    mpu = None
    if parallel is not None and parallel.dims.tp * parallel.dims.sp > 1:
        from dstrain.parallel.dims import DeepSpeedMPU
        model = parallelize(model, activation_checkpointing=plan.activation_checkpointing,
                            state=parallel, sp_mode=sp_mode)
        mpu = DeepSpeedMPU(parallel)
    else:
        parallel = None
        model = parallelize(model, activation_checkpointing=plan.activation_checkpointing)
    scheduler = None if "scheduler" in plan.ds_config else scheduler_factory(train)
    groups = param_groups(model, group_weight_decay(plan.optimizer, plan.ds_config, train.weight_decay))
    names = {id(p): n for n, p in model.named_parameters()}
    group_names = [[names[id(p)] for p in g["params"]] for g in groups]
    cuda_env.apply()  # DeepSpeed's op builders cannot parse e.g. TORCH_CUDA_ARCH_LIST=9.0a
    client = client_optimizer(plan.optimizer, plan.ds_config)
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=client, lr_scheduler=scheduler,
        config=plan.ds_config, mpu=mpu)
    skip_lone_allreduce(ds_engine, plan)
    fast_zero_norm(ds_engine)
    drop_stale_optimizer_state(ds_engine)
    if plan.compile:
        compiling.compile_engine(ds_engine, plan.compile_mode, plan.compile_regions)
    return Engine(ds_engine, plan, group_names, parallel, keep_grad_norm(ds_engine, parallel))


def skip_lone_allreduce(ds_engine, plan: EnginePlan) -> bool:
    """Turn off DeepSpeed's gradient all-reduce where there is nothing to reduce with: one process
    in all, no ZeRO. There, DeepSpeed would still flatten every gradient into a new buffer, all-reduce
    it with itself and copy it back at every step: two passes over the gradients and a buffer the
    size of all of them (ZeRO-1/2/3 reduce in their own optimizers, which also fill their partitions,
    so they are left as they are). Returns whether it was turned off."""
    import torch.distributed as dist
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    if alone and plan.zero["stage"] == 0 and plan.pipeline is None:
        ds_engine.enable_backward_allreduce = False
        return True
    return False


def _create_pipeline_engine(build_model, pipeline_parts, plan: EnginePlan, train: TrainConfig):
    """DeepSpeed's pipeline engine over this stage's layers (``plan.pipeline`` says the split)."""
    import deepspeed

    from dstrain.parallel.pipeline import PipelineEngine, build_engine_module
    if pipeline_parts is None:
        raise ValueError("parallel.pp > 1 needs the model's pipeline layers (ModelSpec.pipeline)")
    module = build_engine_module(build_model, pipeline_parts, plan.pipeline, plan.activation_checkpointing)
    scheduler = None if "scheduler" in plan.ds_config else scheduler_factory(train)
    decay = group_weight_decay(plan.optimizer, plan.ds_config, train.weight_decay)
    groups = [g for g in param_groups(module, decay) if g["params"]]
    names = {id(p): n for n, p in module.named_parameters()}
    group_names = [[names[id(p)] for p in g["params"]] for g in groups]  # before ZeRO flattens the groups
    cuda_env.apply()
    client = client_optimizer(plan.optimizer, plan.ds_config)
    ds_engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=groups, optimizer=client, lr_scheduler=scheduler, config=plan.ds_config)
    return PipelineEngine(ds_engine, plan, group_names)
