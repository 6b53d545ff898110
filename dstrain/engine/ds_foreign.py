"""Keys from other tools' configs found in a training DeepSpeed JSON: DeepSpeed-inference's (``deepspeed.init_inference``
/ MII: ``dtype``, ``replace_with_kernel_inject``, ``enable_cuda_graph``, ``tensor_parallel.tp_size``, a ``checkpoint``
path), SageMaker model parallelism's (smp) parameters and its string ``"pipeline"`` mode, Determined's
``overwrite_deepspeed_args`` and its ``deepspeed_config`` file name, and a DeepSpeed config nested two levels down
(verl's / RL trainers' per-model ``actor.deepspeed_config``), GPT-NeoX's ``precision`` / ``fp32_allreduce``,
transformers' ``low_cpu_mem_usage`` (xtuner's ZeRO-3 configs), and a training script's own settings file that names
its DeepSpeed JSON (Firefly's TrainingArguments files, DeepSpeedExamples' OPSD configs: :func:`app_config_problem`).
DeepSpeed's training engine ignores the top-level ones silently and stops its parser on the section ones; each is
refused with the key and what to do (or noted, by :func:`ignored_key`, where it changes nothing).
"""
from __future__ import annotations

import json

#: Inference-config fields too generic to name as inference keys (a typo hint serves better), or also training keys.
_GENERIC = frozenset({"config", "args", "tm", "tp", "mpu", "zero", "checkpoint", "tensor_parallel"})

#: SageMaker model parallelism's (smp) parameters, written beside a DeepSpeed config in SageMaker's examples.
SMP_KEYS = frozenset({"partitions", "microbatches", "optimize", "placement_strategy", "ddp", "auto_partition",
                      "default_partition", "active_microbatches", "tensor_parallel_degree", "pipeline_parallel_degree",
                      "sharded_data_parallel_degree", "memory_weight", "prescaled_batch", "shard_optimizer_state",
                      "delayed_parameter_initialization", "offload_activations", "activation_loading_horizon",
                      "skip_tracing", "fp16_params"})

_DTYPES = {**dict.fromkeys(("fp16", "float16", "half", "torch.float16", "torch.half"), "fp16"),
           **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"),
           **dict.fromkeys(("fp32", "float32", "float", "torch.float32", "torch.float"), "fp32")}


def inference_keys() -> frozenset[str]:
    """Top-level keys (names and aliases) of DeepSpeed's inference config that its training config does not have."""
    from dstrain.engine.ds_check import accelerator_untouched
    from dstrain.engine.ds_files import KNOWN_TOP_LEVEL_KEYS
    with accelerator_untouched():
        from deepspeed.inference.config import DeepSpeedInferenceConfig
    names = set()
    for name, field in DeepSpeedInferenceConfig.model_fields.items():
        names.update(n for n in (name, field.alias) if n)
    return frozenset(names - _GENERIC - set(KNOWN_TOP_LEVEL_KEYS))


def _dtype_fix(value) -> str:
    dtype = _DTYPES.get(str(value).strip().lower())
    if dtype == "fp32":
        return " (a file that enables neither bf16 nor fp16 trains in fp32)"
    if dtype:
        return f" (to train in {dtype}, write \"{dtype}\": {{\"enabled\": true}})"
    return " (training's precision is set by the \"bf16\" / \"fp16\" sections)"


def foreign_key_problem(key: str, cfg: dict) -> str | None:
    """The refusal for an unknown top-level ``key`` that belongs to another tool's config; None for any other key."""
    from dstrain.engine.ds_files import NESTING_KEYS, nests_ds_config
    value = cfg[key]
    if key in inference_keys():
        fix = ("; dstrain's tensor parallelism is --parallel.tp=N" if key in ("mp_size", "training_mp_size")
               else _dtype_fix(value) if key == "dtype" else "")
        return (f"unknown top-level key {key!r}: a DeepSpeed-inference key (deepspeed.init_inference / MII), which "
                f"training never reads and DeepSpeed would silently ignore; remove it{fix}")
    if key in SMP_KEYS:
        return (f"unknown top-level key {key!r}: a SageMaker model-parallel (smp) parameter, which smp reads from "
                "the estimator's distribution (mp_parameters) and DeepSpeed would silently ignore; remove it (dstrain "
                "parallelises with parallel.tp / parallel.sp)")
    if key == "overwrite_deepspeed_args":
        return (f"unknown top-level key {key!r}: Determined's overrides, which Determined merges into the DeepSpeed "
                "config itself and DeepSpeed would silently ignore here; write their values into the file's own keys "
                "and remove it")
    if key in NESTING_KEYS and isinstance(value, str):
        return (f"top-level key {key!r} names another file ({value!r}, as Determined's hyperparameters do); "
                "DeepSpeed would silently ignore it: give that file itself as --deepspeed.profile")
    if isinstance(value, dict):
        inner = [f"{key}.{k}" for k in NESTING_KEYS if nests_ds_config(value, k)]
        if inner:
            return (f"top-level key {key!r} holds a DeepSpeed config two levels down, at {', '.join(inner)} (as "
                    "verl's and other RL trainers' dumps nest one per model); DeepSpeed reads only top-level keys and "
                    f"would silently ignore it: give the object at {inner[0]} alone as the file")
    return None


def foreign_section_problems(cfg: dict) -> list[str]:
    """Sections written in DeepSpeed-inference's shape: ``tensor_parallel`` with its ``tp_size`` (training's
    TPTrainingConfig forbids it: a pydantic 'Extra inputs are not permitted') and ``checkpoint`` as a path
    (training's is an object: DeepSpeed's parser stops on "'str' object has no attribute 'get'")."""
    problems = []
    tp = cfg.get("tensor_parallel")
    inference_tp = sorted(k for k in ("tp_size", "tp_grain_size", "tp_group", "mpu", "enabled")
                          if isinstance(tp, dict) and k in tp)
    if inference_tp:
        problems.append(f"tensor_parallel.{', '.join(inference_tp)}: DeepSpeed-inference's tensor-parallel keys "
                        "(deepspeed.init_inference / MII); DeepSpeed's training section reads only autotp_size and its "
                        "parser rejects these; remove the section (dstrain's tensor parallelism is --parallel.tp=N)")
    pipe = cfg.get("pipeline")
    if pipe is not None and not isinstance(pipe, dict):
        problems.append(f"pipeline: file says {json.dumps(pipe)}, as SageMaker model parallelism (smp) writes its "
                        "pipeline mode; DeepSpeed reads \"pipeline\" as an object of its pipeline engine's options "
                        f"and its parser stops on anything else ('{type(pipe).__name__}' object has no attribute "
                        "'items'); remove it (dstrain parallelises with parallel.tp / parallel.sp)")
    ckpt = cfg.get("checkpoint")
    if isinstance(ckpt, str):
        problems.append(f"checkpoint: file says {ckpt!r}, DeepSpeed-inference's checkpoint path (init_inference); "
                        "training's \"checkpoint\" is an object of saving options, and DeepSpeed's parser stops on a "
                        "string ('str' object has no attribute 'get'); remove it (dstrain resumes with --resume)")
    return problems


#: DeepSpeedConfig's attribute names written as keys (LLaMA-Factory's ZeRO-3 examples) -> the top-level section
#: DeepSpeed reads instead; and the monitors a ``monitor_config`` object may hold.
ATTRIBUTE_KEYS = {"comms_config": "comms_logger section",
                  "monitor_config": "tensorboard / csv_monitor / wandb / comet sections"}
_MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")


def _on(node) -> bool:
    return isinstance(node, dict) and (node.get("enabled") is True or str(node.get("enabled")).lower() == "true")


def _comment(key: str, value) -> bool:
    """``"_comment": "..."`` (JSON has no comments): a key starting with "_" or named comment(s), holding text."""
    text = isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    return text and (key.startswith("_") or key.lower().strip("_") in ("comment", "comments", "note", "notes"))


def ignored_key(key: str, cfg: dict) -> tuple[str, bool] | None:
    """``(text, refused)`` for a top-level key DeepSpeed 0.19 never reads that comes from a known source: refused
    where it turns something on (DeepSpeed would silently train without it), a note where it turns nothing on
    (nothing is lost); None for any other key."""
    value = cfg[key]
    if _comment(key, value):
        return f"{key}: a comment (DeepSpeed ignores the key)", False
    if key in ATTRIBUTE_KEYS and isinstance(value, dict):
        where = f"not a DeepSpeed key (DeepSpeedConfig's attribute name, as LLaMA-Factory's examples write it), " \
                f"which DeepSpeed silently ignores: it reads the top-level {ATTRIBUTE_KEYS[key]}"
        on = [m for m in _MONITORS if _on(value.get(m))] if key == "monitor_config" else \
            (["comms_logger"] if _on(value) else [])
        if on:
            moves = ", ".join(f"{key}.{m}" for m in on) if key == "monitor_config" else key
            return (f"{key}: {where}, so {moves} would never be enabled; move {'them' if len(on) > 1 else 'it'} to the "
                    f"top level as {' / '.join(on)}"), True
        return f"{key}: {where}; it enables nothing here, so nothing is lost", False
    if key == "fp8" and isinstance(value, dict):
        if not _on(value):
            return "fp8: not a DeepSpeed 0.19 section (ignored by it); it is off here", False
        return ("unknown top-level key 'fp8': DeepSpeed 0.19 has no fp8 training section (FP8 runs through Transformer "
                "Engine or torchao, set up by the trainer, as LLaMA-Factory's and Accelerate's fp8 options do) and "
                "would silently train without it, in the precision of the bf16 / fp16 sections; remove it (dstrain "
                "trains in bf16 or fp32: --deepspeed.precision)"), True
    if key in ("precision", "fp32_allreduce"):
        return _neox_key(key, cfg)
    if key == "low_cpu_mem_usage" and isinstance(value, bool):
        where = ("transformers' from_pretrained argument (load the weights without a full CPU copy first; xtuner's "
                 "ZeRO-3 configs carry it), which DeepSpeed never reads")
        if not value:
            return f"low_cpu_mem_usage: false, {where}; false asks for nothing, so nothing is lost", False
        return (f"unknown top-level key 'low_cpu_mem_usage': true, {where} and would silently ignore (dstrain builds "
                "its models itself, and transformers refuses it with ZeRO-3 anyway); remove it"), True
    if key == "sequence_parallel" and isinstance(value, dict):
        if not _on(value):
            return "sequence_parallel: LLaMA-Factory's sequence-parallel section, which DeepSpeed ignores; off here", \
                False
        ulysses = value.get("ulysses")
        size = value.get("size", ulysses.get("degree") if isinstance(ulysses, dict) else None)
        fix = f"--parallel.sp={size}" if isinstance(size, int) and not isinstance(size, bool) else "--parallel.sp=N"
        return ("unknown top-level key 'sequence_parallel': LLaMA-Factory's sequence-parallel (ALST / Ulysses) section, "
                "which its own trainer sets up and DeepSpeed would silently ignore (each rank would train on whole "
                f"sequences); remove it and use dstrain's sequence parallelism, {fix}"), True
    return None


def neox_dtype(value) -> str | None:
    """"bf16", "fp16" or "fp32" for a precision as GPT-NeoX writes it ("bfloat16", "fp16", "float32"); None else."""
    return _DTYPES.get(str(value).strip().lower()) if isinstance(value, str) else None


def _enabled(cfg: dict, section: str) -> bool:
    node = cfg.get(section, cfg.get("bfloat16")) if section == "bf16" else cfg.get(section)
    return _on(node)


def _neox_key(key: str, cfg: dict) -> tuple[str, bool] | None:
    """GPT-NeoX's ``precision`` and ``fp32_allreduce``, pasted with the DeepSpeed parts of a NeoX YAML: NeoX turns
    them into DeepSpeed settings itself; DeepSpeed ignores them. Refused where the file's own sections do not do the
    same (the run would silently differ), a note where they do."""
    value = cfg[key]
    if key == "precision" and (dtype := neox_dtype(value)) is not None:
        where = ("precision: GPT-NeoX's precision setting (NeoX writes DeepSpeed's bf16 / fp16 section from it), "
                 "which DeepSpeed ignores")
        on = [s for s in ("bf16", "fp16") if _enabled(cfg, s)]
        if on == ([] if dtype == "fp32" else [dtype]):
            return f"{where}; the file's own sections train in {dtype} already, so nothing is lost", False
        fix = ("enable neither bf16 nor fp16" if dtype == "fp32"
               else f'write "{dtype}": {{"enabled": true}}' + (" (and turn the other section off)" if on else ""))
        now = " and ".join(on) or "fp32"
        return (f"unknown top-level key {key!r}: file says {value!r}, {where.split(': ', 1)[1]}: the run would "
                f"silently train in {now}; {fix} and remove it"), True
    if key == "fp32_allreduce" and isinstance(value, bool):
        where = ("fp32_allreduce: GPT-NeoX's switch to all-reduce bf16 gradients in fp32, which DeepSpeed ignores "
                 "(its own key is communication_data_type)")
        fp16 = cfg.get("fp16") if isinstance(cfg.get("fp16"), dict) else {}
        bf16 = _enabled(cfg, "bf16") or "bf16" in (neox_dtype(cfg.get("precision")), neox_dtype(fp16.get("type")))
        if not value or not bf16 or cfg.get("communication_data_type") not in (None, "auto"):
            return f"{where}; nothing is lost here", False
        return (f"unknown top-level key {key!r}: {where.split(': ', 1)[1]}; with bf16 the gradients would silently be "
                "reduced in bf16 (DeepSpeed's default with bf16); write \"communication_data_type\": \"fp32\" and "
                "remove it"), True
    return None


def ignored_key_notes(cfg: dict) -> list[str]:
    """The notes of :func:`ignored_key` for the top-level keys of ``cfg`` DeepSpeed ignores and nothing loses."""
    from dstrain.engine.ds_files import KNOWN_TOP_LEVEL_KEYS
    found = [ignored_key(k, cfg) for k in cfg if isinstance(k, str) and k not in KNOWN_TOP_LEVEL_KEYS]
    return [text for text, refused in filter(None, found) if not refused]


def app_config_problem(cfg: dict) -> str | None:
    """The refusal of a training script's own settings file given as the DeepSpeed JSON: one whose "deepspeed" /
    "deepspeed_config" / "ds_config" names a file and whose other keys are mostly not DeepSpeed's (Firefly's
    TrainingArguments JSONs, DeepSpeedExamples' OPSD app configs). One line in place of a line per key (each "unknown
    top-level key", some with a misleading close match: train_file -> train_batch_size); None for any other file."""
    from dstrain.engine.ds_files import KNOWN_TOP_LEVEL_KEYS, NESTING_KEYS
    if (accelerate := accelerate_config_problem(cfg)) is not None:
        return accelerate
    named = next((k for k in NESTING_KEYS if isinstance(cfg.get(k), str)), None)
    if named is None:
        return None
    others = [k for k in cfg if k not in KNOWN_TOP_LEVEL_KEYS and k not in NESTING_KEYS]
    if len(others) <= len(cfg) - len(others) - 1:  # mostly DeepSpeed's own keys (Determined's file): key by key
        return None
    shown = ", ".join(map(str, others[:4])) + (", ..." if len(others) > 4 else "")
    return (f"{named}: file says {cfg[named]!r}: this is a training script's own settings file, which names its "
            f"DeepSpeed JSON there, not a DeepSpeed config: {len(others)} of its {len(cfg)} top-level keys are not "
            f"DeepSpeed's ({shown}) and DeepSpeed would silently ignore them; give {cfg[named]!r} itself as "
            "--deepspeed.profile (a path relative to the folder the script runs in), and the script's own settings as "
            "dstrain flags")


#: Accelerate's DeepSpeed-plugin keys (``accelerate config``'s ``deepspeed_config``) and the DeepSpeed keys its
#: DeepSpeedPlugin writes from them (dotted: inside zero_optimization).
_ACCELERATE_PLUGIN = {"zero_stage": "zero_optimization.stage",
                      "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
                      "offload_param_device": "zero_optimization.offload_param.device",
                      "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
                      "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
                      "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                      "gradient_accumulation_steps": "gradient_accumulation_steps",
                      "gradient_clipping": "gradient_clipping"}


def accelerate_config_problem(cfg: dict) -> str | None:
    """The refusal of an ``accelerate config`` file (its JSON form, or its YAML converted) given as the DeepSpeed JSON:
    ``distributed_type`` / ``compute_environment`` beside a ``deepspeed_config`` object of Accelerate's DeepSpeed-plugin
    settings, from which Accelerate writes the DeepSpeed config itself (DeepSpeed reads none of them). One line that
    names the file its ``deepspeed_config_file`` points to, or the DeepSpeed JSON its settings stand for; None for
    any other file. Before, each of its keys was an "unknown top-level key" and ``deepspeed_config`` was said to hold
    a DeepSpeed config to move up, which would have left Accelerate's own keys (zero_stage, zero3_init_flag) unread."""
    plugin = cfg.get("deepspeed_config")
    if not isinstance(plugin, dict) or not ({"distributed_type", "compute_environment"} & set(cfg)):
        return None
    shown = ", ".join(f"{k} {cfg[k]!r}" if k == "distributed_type" else k
                      for k in ("compute_environment", "distributed_type") if k in cfg)
    head = (f"deepspeed_config: this is an Accelerate config file (`accelerate config`'s output: {shown}, ...), not a "
            "DeepSpeed config: Accelerate writes the DeepSpeed JSON itself "
            "from its deepspeed_config, and DeepSpeed would silently ignore every key here")
    named = plugin.get("deepspeed_config_file")
    if isinstance(named, str) and named.strip():
        return f"{head}; give {named!r} (its deepspeed_config_file) as --deepspeed.profile"
    out: dict = {}
    for key, dotted in _ACCELERATE_PLUGIN.items():
        value = plugin.get(key)
        if value is None or (key.endswith("_device") and value == "none"):
            continue
        node = out
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    zo = plugin.get("zero_optimization")
    if isinstance(zo, dict):  # a DeepSpeed section pasted inside the plugin settings: it stands as written
        out["zero_optimization"] = {**out.get("zero_optimization", {}), **zo}
    precision = cfg.get("mixed_precision")
    if precision in ("bf16", "fp16"):
        out[precision] = {"enabled": True}
    rest = sorted(k for k in plugin if k not in _ACCELERATE_PLUGIN and k != "zero_optimization")
    unread = f" ({', '.join(rest)}: Accelerate's own, with no DeepSpeed key)" if rest else ""
    return (f"{head}; write its settings as a DeepSpeed JSON{unread} and give that file as --deepspeed.profile: "
            f"{json.dumps(out)}")
