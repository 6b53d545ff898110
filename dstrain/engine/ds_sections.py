"""What dstrain does with each section a user's DeepSpeed JSON may bring: honour it or refuse it by name.

DeepSpeed silently ignores much of what a copied config says: stage-3 keys under
ZeRO-2, an ``activation_checkpointing`` block for a model that never calls
``deepspeed.checkpointing``, a pipeline section without a PipelineModule. dstrain
refuses those before launch, each with the key and the reason, and honours the rest
(monitors, profilers, communication and accumulation dtypes, every ZeRO key of the
file's stage), so that no setting is dropped without the user hearing of it.

:func:`section_problems` is pure apart from asking whether an optional package
(wandb, comet_ml) or DeepSpeed's async-io kernel is there.
"""
from __future__ import annotations

import importlib.util
import os

from dstrain.engine.ds_classes import class_notes, class_problems
from dstrain.engine.ds_config import describe_zero, precision_left_open, sets_lr_itself
from dstrain.engine.ds_engine_keys import engine_key_problems
from dstrain.engine.ds_foreign import foreign_section_problems
from dstrain.engine.ds_key_rules import (CLIPPING_KEYS, clipping_in_params, precision_auto_notes,
                                        stage_default_notes, steps_per_print_check)
from dstrain.engine.ds_scalars import scalar_checks
from dstrain.engine.ds_copied import copied_checks
from dstrain.engine.ds_unread import allgather_partitions_note, unread_problems
from dstrain.engine.ds_reading import DEEPSPEED_OPTIMIZER_TYPES, dotted_type_hint

#: ZeRO keys read only at stage 3 (with DeepSpeed's aliases).
STAGE3_ONLY = frozenset({
    "offload_param", "cpu_offload_param", "sub_group_size",
    "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_param_persistence_threshold",
    "param_persistence_threshold", "stage3_model_persistence_threshold", "model_persistence_threshold",
    "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
    "module_granularity_threshold", "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential", "allgather_sequential", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings", "leaf_module",
})

#: ZeRO keys DeepSpeed 0.19 removed (it raises on them at start-up), with what to do instead.
REMOVED_ZERO_KEYS = {
    "mics_shard_size": "MiCS sharding was removed from DeepSpeed (ZeRO-3 shards over all data-parallel ranks)",
    "mics_hierarchical_params_gather": "MiCS sharding was removed from DeepSpeed",
    "zeropp_loco_param": "LoCo-ZeRO++ was removed from DeepSpeed (zero_quantized_gradients runs without it)",
}

#: DeepSpeed's deprecated ZeRO keys and what it reads them as.
DEPRECATED_ZERO_KEYS = {"cpu_offload": "offload_optimizer.device \"cpu\"",
                        "cpu_offload_param": "offload_param.device \"cpu\"",
                        "stage3_gather_fp16_weights_on_model_save": "gather_16bit_weights_on_model_save"}

#: ZeRO++ switches that run DeepSpeed's CUDA quantizer kernel (no CPU implementation).
ZERO_QUANTIZED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")

#: ZeRO keys that do something at stage 0 (the rest of the section is unused there).
STAGE0_USED = frozenset({"stage", "load_from_fp32_weights", "elastic_checkpoint", "reduce_bucket_size",
                         "allgather_bucket_size", "round_robin_gradients", "ignore_unused_parameters"})

#: ZeRO keys whose "auto" dstrain fills from the model's hidden size (HF Trainer's rule: dstrain.engine.ds_config).
FILLED_ZERO_KEYS = frozenset({"reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                              "prefetch_bucket_size", "stage3_param_persistence_threshold",
                              "param_persistence_threshold"})

#: Offload keys DeepSpeed reads only when the device is "nvme" (its swappers and fast init).
NVME_ONLY_OFFLOAD_KEYS = frozenset({"nvme_path", "pipeline_read", "pipeline_write", "fast_init"})

#: ZeRO keys only DeepSpeed's stage 1/2 optimizer reads (its stage 3 does not).
STAGE12_ONLY = frozenset({"round_robin_gradients", "use_multi_rank_bucket_allreduce", "allgather_bucket_size",
                          "ignore_unused_parameters", "parameter_alignment", "elastic_checkpoint"})

#: Optimizer types whose DeepSpeed kernels exist only for CUDA.
CUDA_ONLY_OPTIMIZERS = {"lamb": "FusedLamb"}

#: DeepSpeed's communication-compressed optimizers, gone from 0.19.8 (it then looks the name up in torch.optim
#: and stops at start-up, on every device).
REMOVED_OPTIMIZERS = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB"}


#: Keys of DeepSpeed's dict-based (not pydantic) sections, which otherwise ignore typos.
PLAIN_SECTION_KEYS = {
    "flops_profiler": {"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
                       "detailed", "output_file"},
    "activation_checkpointing": {"partition_activations", "number_checkpoints", "contiguous_memory_optimization",
                                 "synchronize_checkpoint_boundary", "profile", "cpu_checkpointing"},
    "aio": {"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds",
            "thread_count"},
    "data_types": {"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"},
    "torch_autocast": {"enabled", "dtype", "lower_precision_safe_modules"},
    "checkpoint": {"tag_validation", "checkpoint_serialization", "writer", "load_universal", "use_node_local_storage",
                   "parallel_write"},
}

_DTYPES = {"fp32", "float32", "float", "fp16", "float16", "half", "bf16", "bfloat16"}
_HALF = {"fp16", "float16", "half"}
_CANONICAL_DTYPE = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                    "bf16": "bf16", "bfloat16": "bf16"}


def _enabled(block) -> bool:
    return isinstance(block, dict) and block.get("enabled") is True


def _zero_problems(cfg: dict, device_type: str, problems: list[str], notes: list[str]) -> None:
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict):
        return
    stage = zo.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool):
        return  # ds_config names it
    if stage < 3:  # templates (DeepSpeed-Chat's, OpenRLHF's) write them at every stage; DeepSpeed ignores them
        keys = sorted(k for k in zo if k in STAGE3_ONLY and k not in ("offload_param", "cpu_offload_param"))
        if keys:
            notes.append(f"zero_optimization: stage {stage} does not use {', '.join(keys)} (stage-3 keys)")
    for name in ("", "offload_param", "offload_optimizer"):  # the section, then its offload blocks
        block = zo.get(name) if name else zo
        autos = sorted(k for k, v in block.items() if isinstance(v, str) and v.strip().lower() == "auto"
                       and (name or (k not in FILLED_ZERO_KEYS and k != "stage"))) if isinstance(block, dict) else []
        if autos:
            from dstrain.engine.ds_config import zero_defaults
            defaults = zero_defaults(name)
            known = [f"{k} {defaults[k]:g}" if not isinstance(defaults[k], bool) else f"{k} {defaults[k]}"
                     for k in autos if k in defaults] + ([] if name else stage_default_notes(zo))
            if known:
                notes.append(f"zero_optimization{'.' + name if name else ''}: \"auto\" is DeepSpeed's default there "
                             "(its parser drops \"auto\"): " + ", ".join(known))
    if stage == 0:
        off = zo.get("offload_optimizer")
        if (isinstance(off, dict) and str(off.get("device", "none")).lower() not in ("none", "auto")) \
                or zo.get("cpu_offload") is True:
            problems.append("zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3 and "
                            "the file has stage 0 (DeepSpeed would keep the optimizer on the device); set a stage")
        unused = sorted(k for k in zo if k not in STAGE0_USED and k not in STAGE3_ONLY
                        and k not in ("offload_optimizer", "cpu_offload"))
        if unused:
            notes.append(f"zero_optimization: stage 0 does not use {', '.join(unused)}")
    if stage == 3:
        unused = sorted(k for k in zo if k in STAGE12_ONLY)
        if unused:
            notes.append(f"zero_optimization: stage 3 does not use {', '.join(unused)} (stage 1/2 keys)")
    if (allgather := allgather_partitions_note(zo, stage)) is not None:
        notes.append(allgather)
    removed = sorted(k for k in zo if k in REMOVED_ZERO_KEYS)
    if removed:
        problems.append(f"zero_optimization.{', '.join(removed)}: {REMOVED_ZERO_KEYS[removed[0]]}; remove "
                        f"{'it' if len(removed) == 1 else 'them'}")
    for key, new in DEPRECATED_ZERO_KEYS.items():  # a false offload flag sets no offload (DeepSpeed's new_param_fn)
        off = zo.get(key) is False and new.startswith("offload")
        if key in zo:
            notes.append(f"zero_optimization.{key}: deprecated spelling, " + (f"and false sets no {new.split('.')[0]} "
                         "(DeepSpeed offloads nothing for it); remove it" if off else
                         f"DeepSpeed reads it as {new}"))
    quantized = sorted(k for k in ZERO_QUANTIZED if zo.get(k) is True)
    if stage == 3 and quantized and device_type == "cpu":
        them = "it" if len(quantized) == 1 else "them"
        problems.append(f"zero_optimization.{', '.join(quantized)}: ZeRO++ quantized communication runs DeepSpeed's "
                        f"quantizer kernel, which the CPU accelerator does not have; set {them} to false (keep "
                        "zero_hpz_partition_size) or run on GPUs")
    off = zo.get("offload_optimizer")
    if isinstance(off, dict) and off.get("super_offload") is True:
        if stage != 3:  # DeepSpeed reads it only when it builds its stage-3 optimizer
            notes.append(f"zero_optimization.offload_optimizer: stage {stage} does not use super_offload (a stage-3 "
                         "key)")
        elif device_type == "cpu":
            problems.append("zero_optimization.offload_optimizer.super_offload: SuperOffload runs only on NVIDIA CUDA "
                            "GPUs (DeepSpeed asserts it when it builds the ZeRO-3 optimizer); set it to false (plain "
                            "ZeRO-Offload) or run on GPUs")
    for key in ("offload_optimizer", "offload_param"):
        block = zo.get(key)
        if isinstance(block, dict) and str(block.get("device", "")).lower() == "nvme":
            if device_type == "cpu" and not _async_io_available():
                problems.append(f"zero_optimization.{key}.device: NVMe offload needs DeepSpeed's async_io kernel "
                                "(libaio), which is not available here; use \"cpu\"")
            elif not block.get("nvme_path") or not os.path.isdir(str(block.get("nvme_path"))):
                problems.append(f"zero_optimization.{key}.nvme_path: NVMe offload needs an existing folder to "
                                f"swap to, file says {block.get('nvme_path')!r}")
        elif isinstance(block, dict) and str(block.get("device", "")).lower() == "cpu":
            unused = sorted(k for k in block if k in NVME_ONLY_OFFLOAD_KEYS and block[k] not in (None, False))
            if unused:  # ZeRO-Infinity templates switched to "cpu": DeepSpeed reads these only for "nvme"
                notes.append(f"zero_optimization.{key}: device \"cpu\" does not use {', '.join(unused)} (NVMe-only "
                             "keys; DeepSpeed ignores them)")


def _gradient_scaling_problems(cfg: dict, problems: list[str]) -> None:
    """``prescale_gradients`` / ``gradient_predivide_factor`` where DeepSpeed's ZeRO asserts them away: stage 3, and
    stage 2 averaging gradients, each with reduce_scatter on (the default)."""
    zo = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    stage = describe_zero(cfg)["stage"]
    averaging = str(cfg.get("gradient_allreduce_op", "mean")).lower() != "sum"
    if zo.get("reduce_scatter", True) is False or not (stage == 3 or (stage == 2 and averaging)):
        return
    keys = [k for k, off in (("prescale_gradients", False), ("gradient_predivide_factor", 1.0))
            if k in cfg and cfg[k] != off]
    if keys:
        them = "it" if len(keys) == 1 else "them"
        problems.append(f"{', '.join(keys)}: ZeRO stage {stage} with reduce_scatter does not support {them} "
                        f"(DeepSpeed asserts at start-up: 'not yet supported with ZeRO-{stage} with reduce scatter "
                        f"enabled'); remove {them}, or set zero_optimization.reduce_scatter to false")


def _checkpoint_writer_problems(cfg: dict, device_type: str, problems: list[str]) -> None:
    """``checkpoint.writer`` of type "fast" (the type a writer block gets when it names none) on the CPU: DeepSpeed
    builds that writer when it builds the engine, pinning its I/O buffer (which needs a GPU) for its async_io kernel,
    so every rank fails in ``deepspeed.initialize``; the "python" writer writes the same files with plain I/O. The
    "mock" writer (FastPersist's benchmark setting) counts the bytes and writes none, on any device."""
    ck = cfg.get("checkpoint")
    writer = ck.get("writer") if isinstance(ck, dict) else None
    if not isinstance(writer, dict):
        return
    kind = writer.get("type", "fast")
    if isinstance(kind, str) and kind.strip().lower() == "mock":
        problems.append("checkpoint.writer.type: DeepSpeed's mock writer opens each checkpoint file and counts the "
                        "bytes without writing them (a benchmark setting: every checkpoint would be empty and no "
                        "resume could read it); set \"type\": \"python\" (or \"fast\" on GPUs) or remove "
                        "checkpoint.writer")
    stage = describe_zero(cfg)["stage"]
    if writer.get("data_parallel") is None and stage < 3:  # DeepSpeed's rank-0 writer, which it cannot build there
        problems.append(f"checkpoint.writer.data_parallel: absent, which DeepSpeed 0.19.8 reads as one writer (rank "
                        f"0) and fails to set up at ZeRO stage {stage} without a model-parallel unit "
                        "(deepspeed.initialize fails: 'UniversalParallelInfo' object has no attribute 'dp_rank'); add "
                        "\"data_parallel\": \"replica\" to the writer, or remove checkpoint.writer")
    if device_type == "cpu" and stage >= 1 and writer.get("decoupled") is True:
        problems.append("checkpoint.writer.decoupled: true hands each checkpoint to a writer process through a queue, "
                        "and torch refuses to send the ZeRO optimizer's state across it (by hand on 2 CPU ranks: "
                        "the run stopped at its first checkpoint, 'Cowardly refusing to serialize non-leaf tensor "
                        "which requires_grad'); set it to false")
    if device_type == "cpu" and isinstance(kind, str) and kind.strip().lower() == "fast":
        problems.append("checkpoint.writer.type: DeepSpeed's fast checkpoint writer (a writer block's default type) "
                        "pins its I/O buffer for the async_io kernel when the engine starts, which the CPU "
                        "accelerator cannot (every rank would fail); set \"type\": \"python\" or remove "
                        "checkpoint.writer")


def _async_io_available() -> bool:
    try:
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
        return bool(builder is not None and builder.is_compatible(False))
    except Exception:  # noqa: BLE001 - any failure means it cannot run
        return False


def _dtype_problems(cfg: dict, device_type: str, problems: list[str]) -> None:
    for path, value in (("communication_data_type", cfg.get("communication_data_type")),
                        ("seq_parallel_communication_data_type", cfg.get("seq_parallel_communication_data_type")),
                        ("torch_autocast.dtype", (cfg.get("torch_autocast") or {}).get("dtype")
                         if isinstance(cfg.get("torch_autocast"), dict) else None),
                        ("data_types.grad_accum_dtype", (cfg.get("data_types") or {}).get("grad_accum_dtype")
                         if isinstance(cfg.get("data_types"), dict) else None)):
        if value is None:
            continue
        if path in ("torch_autocast.dtype", "data_types.grad_accum_dtype") and isinstance(value, str):
            value = value.removeprefix("torch.")  # DeepSpeed also takes torch's names there (its DtypeEnum)
        if not isinstance(value, str) or value.lower() not in _DTYPES:
            problems.append(f"{path}: must be one of fp32, fp16, bf16, file says {value!r}")
        elif device_type == "cpu" and value.lower() in _HALF:
            problems.append(f"{path}: fp16 does not run on the CPU accelerator; use \"bf16\" or \"fp32\"")
        elif path == "data_types.grad_accum_dtype" and describe_zero(cfg)["stage"] == 0 \
                and not precision_left_open(cfg):  # else it decides the run's precision (ds_config)
            weights = next((k for k in ("bf16", "fp16") if _enabled(cfg.get(k))), "fp32")
            if _CANONICAL_DTYPE[value.lower()] != weights:
                problems.append(f"{path}: {value} with {weights} weights needs ZeRO stage 1 or more (at stage 0 "
                                f"DeepSpeed stops at start-up: 'unsupported mix of model_dtype and grad_accum_dtype'); "
                                f"set it to \"{weights}\" or drop it")


def _unused_sections(cfg: dict, problems: list[str]) -> None:
    """Sections for machinery dstrain does not run: refused rather than silently ignored."""
    pipe = cfg.get("pipeline")
    if isinstance(pipe, dict) and pipe:
        problems.append("pipeline: DeepSpeed's pipeline engine needs a PipelineModule, which dstrain's models are "
                        "not; remove the section (dstrain parallelises with parallel.tp / parallel.sp)")
    tp = cfg.get("tensor_parallel")
    problems += foreign_section_problems(cfg)  # tensor_parallel.tp_size, a checkpoint path (ds_foreign)
    if isinstance(tp, dict) and "tp_size" not in tp and (tp.get("autotp_size") or 1) not in (0, 1):
        problems.append("tensor_parallel: DeepSpeed's AutoTP is not used by dstrain; remove the section and use "
                        "--parallel.tp=N")
    ep = cfg.get("expert_parallel")
    if isinstance(ep, dict) and ep.get("enabled") not in (None, False, 0, ""):  # DeepSpeed reads any other as on
        problems.append("expert_parallel.enabled: DeepSpeed's AutoEP replaces a model's MoE layers, and dstrain's "
                        "models have none (with a preset_model or pattern DeepSpeed raises 'no MoE layers "
                        "detected' on every rank); set it to false or remove the section")
    sp = cfg.get("sequence_parallel_size")
    if sp not in (None, 1):
        problems.append(f"sequence_parallel_size: dstrain splits sequences itself; remove the key and use "
                        f"--parallel.sp={sp}")
    for key, why in (("autotuning", "dstrain does not run DeepSpeed's autotuner (dstrain plan chooses the profile)"),
                     ("hybrid_engine", "the hybrid engine is for DeepSpeed-Chat's RLHF loop, not used by dstrain"),
                     ("data_efficiency", "dstrain's samplers feed the data, so DeepSpeed's data sampling "
                      "(curriculum, dynamic batching) never runs, and its data routing (random-LTD) needs DeepSpeed's "
                      "layer wrappers in the model, which dstrain's models do not use")):
        if _enabled(cfg.get(key)):
            problems.append(f"{key}.enabled: {why}; set it to false or remove the section")
    comp = cfg.get("compile")
    if isinstance(comp, dict) and comp.get("deepcompile") is True:  # older keys: ds_copied
        problems.append("compile: dstrain compiles the model itself; remove the section and use --train.compile=true")


def _monitor_problems(cfg: dict, problems: list[str], notes: list[str]) -> None:
    if cfg.get("dataloader_drop_last") is True:  # HF-style templates set it; DeepSpeed accepts it
        notes.append("dataloader_drop_last: only DeepSpeed's own dataloader reads it; dstrain's sampler never yields "
                     "a partial batch, so every step is a full batch either way")
    steps_per_print_check(cfg, problems, notes)
    for section, package in (("wandb", "wandb"), ("comet", "comet_ml")):
        if _enabled(cfg.get(section)) and importlib.util.find_spec(package) is None:
            problems.append(f"{section}.enabled: the {package} package is not installed here (pip install {package}; "
                            f"{'WANDB_MODE=offline without network' if section == 'wandb' else 'offline mode'}), "
                            "or set it to false")
    for section in ("tensorboard", "csv_monitor", "wandb", "comet", "flops_profiler", "comms_logger"):
        if _enabled(cfg.get(section)):
            notes.append(f"{section}: on, as DeepSpeed runs it")
    ac = cfg.get("activation_checkpointing")
    if isinstance(ac, dict) and ac.get("number_checkpoints") not in (None, 0, False):
        problems.append("activation_checkpointing.number_checkpoints: only models that call "
                        "deepspeed.checkpointing read it, which dstrain's models do not; remove it and use "
                        "--deepspeed.activation_checkpointing=true")
    if cfg.get("seq_parallel_communication_data_type") is not None and cfg.get("sequence_parallel_size") in (None, 1):
        notes.append("seq_parallel_communication_data_type: unused: only DeepSpeed's Ulysses sequence parallelism "
                     "(sequence_parallel_size > 1) reads it; dstrain's parallel.sp exchanges activations in the "
                     "model's own dtype")
    opt = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), dict) else {}
    lr = opt.get("params", {}).get("lr") if isinstance(opt.get("params"), dict) else None
    if sets_lr_itself(cfg) and isinstance(lr, (int, float)) and not isinstance(lr, bool):
        peak = cfg["scheduler"]["params"]["warmup_max_lr"]
        if lr != peak:
            notes.append(f"optimizer.params.lr: unused ({lr:g}): {cfg['scheduler']['type']} sets the learning rate "
                         f"from the first step, warming up to warmup_max_lr {peak:g}, the run's lr")
    sched = cfg.get("scheduler") if isinstance(cfg.get("scheduler"), dict) else {}
    kind = sched.get("type")  # these two overwrite the optimizer's lr when DeepSpeed builds them (lr_schedules.py)
    first = {"OneCycle": ("cycle_min_lr", None), "LRRangeTest": ("lr_range_test_min_lr", 1e-3)}.get(str(kind))
    if first and isinstance(lr, (int, float)) and not isinstance(lr, bool) and isinstance(sched.get("params"), dict):
        start = sched["params"].get(first[0], first[1])
        if isinstance(start, (int, float)) and not isinstance(start, bool) and start != lr:
            notes.append(f"optimizer.params.lr: unused ({lr:g}): {kind} sets the learning rate from the first step, "
                         f"starting at {first[0]} {start:g}")
    if "disable_allgather" in cfg:
        notes.append("disable_allgather: unused: DeepSpeed parses it and nothing reads it")
    aio = cfg.get("aio")
    zo = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    nvme = any(isinstance(zo.get(k), dict) and str(zo[k].get("device", "")).lower() == "nvme"
               for k in ("offload_optimizer", "offload_param"))
    if isinstance(aio, dict) and aio and not nvme:
        notes.append("aio: kept, but only NVMe offload uses it and this file offloads to no NVMe device")


def _plain_section_keys(cfg: dict, problems: list[str]) -> None:
    import difflib

    from dstrain.engine.ds_files import old_profiler_key_problem
    for section, known in PLAIN_SECTION_KEYS.items():
        block = cfg.get(section)
        if not isinstance(block, dict):
            continue
        for key in block:
            old = section == "flops_profiler" and old_profiler_key_problem(key, block[key], section)
            if key not in known and old:
                problems.append(old)
            elif key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                problems.append(f"{section}.{key}: unknown key{hint}; DeepSpeed would silently ignore it")


def _optimizer_problems(cfg: dict, device_type: str, problems: list[str]) -> None:
    """The optimizer block DeepSpeed would build: a type it can build here, params it accepts, ZeRO's vetting."""
    opt = cfg.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str) \
            or opt["type"].strip().lower() == "auto":  # named by the filling
        return
    name, kind = opt["type"], opt["type"].lower()
    zo = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    offload = describe_zero(cfg)["offload_optimizer"]
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    problems += clipping_in_params(params)  # one line each, not again as a param the class does not take
    params = {k: v for k, v in params.items() if k not in CLIPPING_KEYS}
    if kind in REMOVED_OPTIMIZERS:
        problems.append(f"optimizer.type: {name!r}: DeepSpeed 0.19 no longer has its {REMOVED_OPTIMIZERS[kind]} "
                        f"optimizer (it would look for torch.optim.{name} and stop at start-up, on any device); use "
                        "\"AdamW\" (or remove the optimizer block: dstrain then builds AdamW from the run config)")
        return
    if device_type == "cpu" and (kind in CUDA_ONLY_OPTIMIZERS or (kind == "lion" and not offload)):
        kernel = CUDA_ONLY_OPTIMIZERS.get(kind, "FusedLion")
        alt = " (or offload the optimizer to \"cpu\": DeepSpeed's CPU Lion)" if kind == "lion" else \
            " (or remove the optimizer block: dstrain then builds AdamW from the run config)"
        problems.append(f"optimizer.type: {name!r} runs DeepSpeed's {kernel} CUDA kernel, which the CPU "
                        f"accelerator does not have; use \"AdamW\"{alt}")
        return
    if kind in ("muadam", "muadamw", "musgd") and importlib.util.find_spec("mup") is None:
        problems.append(f"optimizer.type: {name!r} is DeepSpeed's wrapper of the mup package, which is not "
                        "installed here (DeepSpeed would stop at start-up); pip install mup, or use \"AdamW\"")
        return
    if kind in ("adam", "adamw"):
        _adam_params_problem(kind, params, offload, problems)
    if kind in DEEPSPEED_OPTIMIZER_TYPES or kind in CUDA_ONLY_OPTIMIZERS:
        return
    torch_classes = _torch_optimizers()
    cls = torch_classes.get(name)
    if cls is None:
        import difflib
        known = ["Adam", "AdamW", "Adagrad", "Lamb", "Lion", "AdamATan2"] + sorted(torch_classes)
        close = difflib.get_close_matches(name, known, n=1) or [k for k in known if k.lower() == kind]
        hint = f" (did you mean {close[0]!r}?" + (" names of torch.optim classes are case-sensitive)"
                                                  if close and close[0].lower() == kind else ")") if close else ""
        hint = dotted_type_hint(name, known, "optimizer") or hint  # "torch.optim.AdamW": a module path
        problems.append(f"optimizer.type: {name!r} is neither one of DeepSpeed's optimizers nor a torch.optim "
                        f"class{hint}; DeepSpeed would fail at start-up")
        return
    import inspect
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    extra = sorted(k for k in params if k not in accepted)
    if extra:
        problems.append(f"optimizer.params.{', '.join(extra)}: torch.optim.{name} does not take "
                        f"{'it' if len(extra) == 1 else 'them'} (it takes {', '.join(sorted(accepted))})")
    stage = zo.get("stage", 0)
    if isinstance(stage, int) and stage >= 1 and cfg.get("zero_allow_untested_optimizer") is not True \
            and name not in ("Adam", "AdamW", "Adagrad"):
        problems.append(f"optimizer.type: ZeRO stage {stage} accepts torch.optim.{name} only with "
                        "\"zero_allow_untested_optimizer\": true (DeepSpeed asserts at start-up); add it, or use "
                        "\"AdamW\"")


def _adam_params_problem(kind: str, params: dict, offload: bool, problems: list[str]) -> None:
    """An Adam/AdamW block's params that the class DeepSpeed builds from it does not take (it stops at start-up
    with a TypeError): DeepSpeedCPUAdam under optimizer offload, torch.optim.Adam/AdamW with ``torch_adam``, else
    FusedAdam. (dstrain builds torch's AdamW itself only when every param has a counterpart there.)"""
    import inspect

    from dstrain.engine.ds_check import accelerator_untouched
    from dstrain.engine.optim import _MAPPED
    if set(params) <= _MAPPED and not offload:
        return
    torch_adam = params.get("torch_adam") is True
    with accelerator_untouched():
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam as cls
        elif torch_adam:
            import torch.optim
            cls = torch.optim.AdamW if kind == "adamw" or params.get("adam_w_mode", True) else torch.optim.Adam
        else:
            from deepspeed.ops.adam import FusedAdam as cls
    taken = set(inspect.signature(cls.__init__).parameters) - {"self", "params", "model_params", "adamw_mode"}
    extra = sorted(k for k in params if k not in taken | {"torch_adam", "adam_w_mode"})
    if extra:
        name = f"torch.optim.{cls.__name__}" if torch_adam and not offload else f"DeepSpeed's {cls.__name__}"
        them = "it" if len(extra) == 1 else "them"
        alt = "" if torch_adam or offload else " (or set \"torch_adam\": true if torch.optim.AdamW takes " + them + ")"
        problems.append(f"optimizer.params.{', '.join(extra)}: {name}, which DeepSpeed builds from this block, does "
                        f"not take {them} (it takes {', '.join(sorted(taken))}) and DeepSpeed would stop at start-up; "
                        f"remove {them}{alt}")


def _scheduler_problems(cfg: dict, problems: list[str]) -> None:
    """The scheduler block DeepSpeed builds as ``getattr(lr_schedules or torch.optim.lr_scheduler, type)(optimizer,
    **params)``: a type it finds as spelled, params that class takes, the ones it needs (but those dstrain fills)."""
    sched = cfg.get("scheduler")
    if not isinstance(sched, dict) or not isinstance(sched.get("type"), str) \
            or sched["type"].strip().lower() == "auto":  # named by the filling
        return
    import inspect

    import torch.optim.lr_scheduler as torch_schedules

    from dstrain.engine.ds_check import accelerator_untouched
    from dstrain.engine.ds_config import _SCHED_FILL_MISSING
    with accelerator_untouched():
        from deepspeed.runtime import lr_schedules
    name = sched["type"]
    ours = {n: getattr(lr_schedules, n) for n in lr_schedules.VALID_LR_SCHEDULES}
    torch_classes = {n: c for n, c in vars(torch_schedules).items() if isinstance(c, type)
                     and issubclass(c, torch_schedules.LRScheduler) and not n.startswith("_") and n != "LRScheduler"}
    cls = ours.get(name) or torch_classes.get(name)
    if cls is None:
        import difflib
        same = [n for n in [*ours, *torch_classes] if n.lower() == name.lower()]
        close = same or difflib.get_close_matches(name, [*ours, *torch_classes], n=1)
        hint = f" (did you mean {close[0]!r}?{' the names are case-sensitive' if same else ''})" if close else ""
        hint = dotted_type_hint(name, [*ours, *torch_classes], "scheduler") or hint
        problems.append(f"scheduler.type: {name!r} is neither one of DeepSpeed's schedulers ({', '.join(ours)}) nor "
                        f"a torch.optim.lr_scheduler class{hint}; DeepSpeed would stop at start-up")
        return
    if name not in ours:  # torch's schedulers take only a torch.optim.Optimizer, and DeepSpeed hands them its own
        half = {k for k in ("bf16", "fp16") if isinstance(cfg.get(k), dict)
                and (cfg[k].get("enabled") is True or str(cfg[k].get("enabled")).strip().lower() == "auto")}
        autocast = isinstance(cfg.get("torch_autocast"), dict) and cfg["torch_autocast"].get("enabled") is True
        stage = describe_zero(cfg)["stage"]
        if stage or "fp16" in half or ("bf16" in half and not autocast):
            wrapper = f"ZeRO stage {stage}" if stage else f"{'/'.join(sorted(half))}"
            problems.append(f"scheduler.type: torch.optim.lr_scheduler.{name} takes only a torch optimizer, and with "
                            f"{wrapper} DeepSpeed hands it its optimizer wrapper (torch raises '... is not an "
                            f"Optimizer' at start-up); use one of DeepSpeed's schedulers ({', '.join(ours)}), remove "
                            "the block (dstrain's warm-up + cosine), or train at ZeRO stage 0 in fp32")
    params = sched.get("params") if isinstance(sched.get("params"), dict) else {}
    signature = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, optimizer
    accepted = {p.name for p in signature}
    extra = sorted(k for k in params if k not in accepted)
    filled = _SCHED_FILL_MISSING.get(name.lower(), ())
    missing = [p.name for p in signature if p.default is inspect.Parameter.empty and p.name not in params
               and p.name not in filled and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if extra:
        them = "it" if len(extra) == 1 else "them"
        problems.append(f"scheduler.params.{', '.join(extra)}: {name} does not take {them} (it takes "
                        f"{', '.join(sorted(accepted))}); DeepSpeed would stop at start-up")
    if missing:
        problems.append(f"scheduler.params: {name} needs {', '.join(missing)}, which the file does not give; "
                        "DeepSpeed would stop at start-up")


def _torch_optimizers() -> dict[str, type]:
    """torch.optim's optimizer classes by name."""
    import torch.optim
    return {n: c for n, c in vars(torch.optim).items()
            if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and n != "Optimizer"}


def section_problems(cfg: dict, device_type: str) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` for a user's DeepSpeed JSON on ``device_type`` ("cpu" or "cuda").

    Problems are refusals, each naming its key and the reason; notes say how an honoured
    section runs. Checked: fp16 and half-precision communication on the CPU, optimizer
    types with CUDA-only kernels, ZeRO keys the file's stage does not read (and optimizer
    offload at stage 0), NVMe offload without async-io, sections for engines dstrain does
    not run (pipeline, AutoTP, autotuning, hybrid engine, data efficiency, DeepSpeed's
    compile), monitors whose package is missing, unknown keys in DeepSpeed's dict-based
    sections (flops_profiler, activation_checkpointing, aio).
    """
    problems: list[str] = []
    notes: list[str] = []
    if not isinstance(cfg, dict):
        return problems, notes
    if device_type == "cpu" and _enabled(cfg.get("fp16")):
        problems.append("fp16.enabled: fp16 does not run on the CPU accelerator (DeepSpeed raises 'Type fp16 is not "
                        "supported'); use bf16 (\"bf16\": {\"enabled\": true}) or fp32 (fp16.enabled false or \"auto\")")
    from dstrain.engine.ds_typeless import typeless_problems
    problems += typeless_problems(cfg)
    _optimizer_problems(cfg, device_type, problems)
    _scheduler_problems(cfg, problems)
    _zero_problems(cfg, device_type, problems, notes)
    _dtype_problems(cfg, device_type, problems)
    _gradient_scaling_problems(cfg, problems)
    _unused_sections(cfg, problems)
    _checkpoint_writer_problems(cfg, device_type, problems)
    _monitor_problems(cfg, problems, notes)
    notes += precision_auto_notes(cfg)
    _plain_section_keys(cfg, problems)
    _quoted_flags(cfg, problems)
    problems += class_problems(cfg, device_type, problems)
    notes += class_notes(cfg)
    problems += engine_key_problems(cfg, device_type, problems) + unread_problems(cfg)
    from dstrain.engine.ds_foreign import ignored_key_notes
    copied, copied_notes = copied_checks(cfg)
    notes += ignored_key_notes(cfg)
    scalars, scalar_notes = scalar_checks(cfg, device_type)
    return problems + copied + scalars, notes + copied_notes + scalar_notes


def _quoted_flags(cfg: dict, problems: list[str]) -> None:
    """``"wall_clock_breakdown": "false"``: DeepSpeed passes the text on, so "false" counts as true (and
    wall_clock_breakdown / flops_profiler.enabled stop its parser: ``bool | str``). The words for true are read
    as true before this (``ds_files.canonical_forms``): what is left here is refused."""
    from dstrain.engine.ds_files import PLAIN_FLAGS, _STRING_BOOLEANS
    for path in PLAIN_FLAGS:
        head, _, key = path.rpartition(".")
        node = cfg.get(head) if head else cfg
        value = node.get(key) if isinstance(node, dict) else None
        if isinstance(value, str):
            plain = {True: "true", False: "false"}.get(_STRING_BOOLEANS.get(value.strip().lower()), "true or false")
            problems.append(f"{path}: file says {value!r} in quotes, which DeepSpeed does not read as a boolean (any "
                            f"text counts as true to it, \"false\" too); write {plain} without quotes")


def bf16_overflow_check(resolved: dict, template: dict, nonfinite: str) -> tuple[dict, str]:
    """DeepSpeed's bf16 ``check_grad_overflow`` (default true) makes ZeRO-1/2 test every gradient of the
    partition for NaN/Inf before the step, one tensor at a time: about a dozen kernel launches per gradient
    (2,640 dispatched operations of 4,104 in ZeRO-2's step for GPT large's 220 tensors, see
    ``benchmarks/step_ops.py``), then a host synchronisation. With ``train.nonfinite`` stop or skip, dstrain's
    own guard has already checked every gradient and the loss before the step (and stops or skips the
    update), so the factory turns DeepSpeed's check off unless the file sets it. Returns the config and a
    note for plan.txt ("" when nothing changed)."""
    key = "bf16" if "bf16" in resolved else "bfloat16"
    block = resolved.get(key)
    if nonfinite == "off" or not isinstance(block, dict) or block.get("enabled") is not True:
        return resolved, ""
    if "check_grad_overflow" in (template.get(key) or {}):
        return resolved, ""
    return ({**resolved, key: {**block, "check_grad_overflow": False}},
            f"{key}.check_grad_overflow -> false: dstrain's non-finite guard (train.nonfinite={nonfinite}) checks "
            "the gradients and the loss before every step, in place of DeepSpeed's per-gradient check")
