"""DeepSpeed JSON files: find a profile, read it strictly, check its top-level keys.

``ds_config.py`` fills and checks what is inside a file; this module only finds
and reads files and knows which top-level keys DeepSpeed reads. Pure: no
deepspeed or torch import.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

from dstrain.config_text import no_duplicate_keys

#: Every top-level key DeepSpeed 0.19.8 reads (deepspeed/runtime/config.py, runtime/constants.py,
#: deepspeed/__init__.py and the section parsers they call).
KNOWN_TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    # batch
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation",
    # optimizer / scheduler
    "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "gradient_clipping",
    # precision
    "bf16", "bfloat16", "fp16", "torch_autocast", "data_types",
    # communication
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "gradient_allreduce_op", "disable_allgather",
    # ZeRO and parallelism
    "zero_optimization", "pipeline", "tensor_parallel", "expert_parallel",
    "use_data_before_expert_parallelism", "sequence_parallel_size", "data_parallel_size",
    "hybrid_engine",
    # memory / activations
    "activation_checkpointing", "aio",
    # logging and monitoring
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "log_level",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "timers",
    # checkpointing
    "checkpoint", "datastates_ckpt",
    # misc
    "compile", "autotuning", "data_efficiency", "dataloader_drop_last", "disable_python_gc",
    "vocabulary_size", "weight_quantization",
})

#: Top-level keys DeepSpeed 0.19 removed; DeepSpeed itself raises on them at start-up.
REMOVED_TOP_LEVEL_KEYS: dict[str, str] = {
    "amp": "NVIDIA Apex AMP was removed from DeepSpeed; use bf16, fp16 or torch_autocast",
    "elasticity": "elastic training was removed from DeepSpeed; set the batch keys directly",
    "nebula": "Nebula checkpointing was removed from DeepSpeed",
    "compression_training": "the compression library was removed from DeepSpeed",
    "quantize_training": "MoQ / quantize_training was removed from DeepSpeed",
    "sparse_gradients": "sparse_gradients was removed from DeepSpeed",
    "eigenvalue": "eigenvalue MoQ was removed from DeepSpeed",
    "sparse_attention": "sparse attention was removed from DeepSpeed",
    "graph_harvesting": "graph harvesting was removed from DeepSpeed",
    "curriculum_learning": "DeepSpeed's curriculum moved to data_efficiency.data_sampling.curriculum_learning, which "
                           "only DeepSpeed's own dataloader applies (dstrain's samplers feed the data: no curriculum "
                           "either way)",
    "progressive_layer_drop": "progressive layer drop was removed from DeepSpeed",
}

#: Top-level keys whose null (an empty entry of a YAML-to-JSON dump: ``zero_optimization:`` with nothing under it)
#: stops DeepSpeed 0.19.8's config parser ("'NoneType' object has no attribute 'get'", "argument after ** must be a
#: mapping"); its other keys take null as their default.
NULL_STOPS_PARSER: frozenset[str] = frozenset({
    "activation_checkpointing", "autotuning", "bfloat16", "checkpoint", "comet", "comms_logger", "compile",
    "csv_monitor", "data_efficiency", "data_types", "flops_profiler", "fp16", "gradient_allreduce_op",
    "hybrid_engine", "optimizer", "pipeline", "scheduler", "tensor_parallel", "tensorboard", "timers",
    "torch_autocast", "wall_clock_breakdown", "wandb", "weight_quantization", "zero_optimization",
})

#: Sections DeepSpeed 0.19.8 reads only as objects: its parser stops on ``true`` or a string in their place
#: ("'bool' object has no attribute 'get'", "argument after ** must be a mapping", a pydantic model_type error).
#: (bf16 / fp16, optimizer / scheduler, pipeline and zero_optimization have their own refusals or readings.)
OBJECT_SECTIONS: frozenset[str] = NULL_STOPS_PARSER - {
    "bf16", "bfloat16", "fp16", "optimizer", "scheduler", "pipeline", "zero_optimization", "gradient_allreduce_op",
    "wall_clock_breakdown"} | {"aio", "expert_parallel"}
#: Of those, the ones switched on by an "enabled" key (a boolean in their place says which way).
_ENABLED_SECTIONS = frozenset({"tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger",
                               "hybrid_engine", "torch_autocast", "data_efficiency", "expert_parallel", "autotuning"})

#: The flops profiler's top-level keys of DeepSpeed's first profiler README (with ``"flops_profiler": true``), and
#: the same keys DeepSpeed 0.19 reads inside its "flops_profiler" section (None: it profiles one step, so none).
OLD_PROFILER_KEYS: dict[str, str | None] = {
    "profile_start_step": "profile_step", "profile_end_step": None, "profile_depth": "module_depth",
    "profile_top_num": "top_modules", "start_step": "profile_step", "end_step": None}


def section_shape_problem(key, value) -> str | None:
    """The refusal for a section DeepSpeed reads only as an object, given something else (None: nothing to say)."""
    if key not in OBJECT_SECTIONS or value is None or isinstance(value, dict) \
            or (key == "checkpoint" and isinstance(value, str)):  # an inference checkpoint path: its own refusal
        return None
    fix = ""
    if isinstance(value, bool) and key in _ENABLED_SECTIONS:
        fix = f"; write \"{key}\": {{\"enabled\": {json.dumps(value)}}}" + ("" if value else " or remove it")
    why = ("DeepSpeed's config parser stops on anything else at start-up" if key != "timers" or value is True else
           "DeepSpeed reads only an object there and would silently ignore this")  # ("throughput" in "yes")
    return (f"{key}: must be an object (a section of keys), file says {json.dumps(value)}; "
            f"{why}{fix or '; write its keys inside {} or remove it'}")


def old_profiler_key_problem(key, value, section: str = "") -> str | None:
    """The refusal for a flops-profiler key of DeepSpeed's first profiler (top level, or ``section`` "flops_profiler"
    for its start_step / end_step there), naming DeepSpeed 0.19's own key."""
    if key not in OLD_PROFILER_KEYS or (section == "") == (key in ("start_step", "end_step")):
        return None
    new = OLD_PROFILER_KEYS[key]
    where = f"{section}.{key}" if section else f"unknown top-level key {key!r}"
    said = "the flops profiler's key in DeepSpeed's first profiler" + (
        "" if section else " (beside \"flops_profiler\": true)")
    if new is None:
        return (f"{where}: {said}; DeepSpeed 0.19 profiles one step (flops_profiler.profile_step) and would silently "
                "ignore it; remove it")
    return (f"{where}: {said}; DeepSpeed 0.19 reads it as flops_profiler.{new} and would silently ignore this one; "
            f"write \"flops_profiler\": {{\"{new}\": {json.dumps(value)}}} in its place")


#: Places where "auto" is a value DeepSpeed itself understands, so it is left alone.
DEEPSPEED_NATIVE_AUTO: frozenset[str] = frozenset({
    "pipeline.stages", "data_types.keep_in_fp32_modules",
    "zero_optimization.zenflow.select_strategy", "zero_optimization.zenflow.select_interval",
    "zero_optimization.zenflow.update_interval",
    "expert_parallel.score_apply", "expert_parallel.combine_impl",
    "expert_parallel.row_weighting_impl", "expert_parallel.score_func", "expert_parallel.top_k",
    "expert_parallel.routed_scaling_factor",
})


class DSConfigError(ValueError):
    """A DeepSpeed JSON profile that dstrain refuses; the message names the file and every problem.

    ``fixes`` maps run-config keys to the values that would make the run agree with the
    file (``{"train.lr": "0.0003"}``); when every problem is such a disagreement the
    message is one line ending with the overrides to use.
    """

    def __init__(self, source: str, problems: str | list[str], fixes: dict[str, str] | None = None,
                 mismatches: int = 0, switch_on: bool = False):
        self.source = str(source)
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.fixes = dict(fixes or {})
        self.mismatches = mismatches
        hint = ""
        if self.fixes:  # switch_on: deepspeed.values_from_file is already on, so it is not offered
            adoptable = set(self.fixes) - NOT_ADOPTED - (set(self.fixes) if switch_on else set())
            hint = (f"use {' '.join(f'--{k}={v}' for k, v in self.fixes.items())}, or set them to \"auto\" in "
                    "the file" + (", or pass --deepspeed.values_from_file=true to take them from the file"
                                  if adoptable else ""))
        if mismatches and mismatches == len(self.problems) and hint:
            msg = f"{self.source}: the file disagrees with the run config: {'; '.join(self.problems)}; {hint}"
        elif len(self.problems) == 1 and not hint:
            msg = f"{self.source}: {self.problems[0]}"
        else:
            items = self.problems + ([hint] if hint else [])
            body = "\n".join(f"  - {p}" for p in items)
            msg = f"{self.source}: {len(self.problems)} problems:\n{body}"
        super().__init__(msg)


def format_override(value) -> str:
    """A value as it is written after ``--key=`` on the command line (JSON, no spaces)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_override(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    return str(value)


#: Run-config keys that ``deepspeed.values_from_file`` never takes from the file (the run decides its length).
NOT_ADOPTED = frozenset({"train.steps"})

def ds_configs_dir() -> Path:
    """The folder of shipped profiles: ``$DSTRAIN_DS_CONFIGS`` if set, else the repo's ``ds_configs/``."""
    env = os.environ.get("DSTRAIN_DS_CONFIGS")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "ds_configs"


def list_profiles() -> list[str]:
    """Names (file stems) of the ``*.json`` profiles in :func:`ds_configs_dir`, sorted."""
    folder = ds_configs_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.json") if p.is_file())


def resolve_profile_path(name_or_path: str) -> Path:
    """Turn a profile name (``"zero2"``) or a path to a ``.json`` file into an existing path."""
    text = str(name_or_path)
    as_path = Path(text).expanduser()
    looks_like_path = text.endswith(".json") or os.sep in text or "/" in text
    if looks_like_path:
        if as_path.is_file():
            return as_path
        if text.endswith(".json") and os.sep not in text and "/" not in text:
            candidate = ds_configs_dir() / text
            if candidate.is_file():
                return candidate
        raise DSConfigError(text, "no such DeepSpeed config file")
    candidate = ds_configs_dir() / f"{text}.json"
    if candidate.is_file():
        return candidate
    names = list_profiles()
    hint = difflib.get_close_matches(text, names, n=1)
    msg = f"unknown DeepSpeed profile {text!r}; available in {ds_configs_dir()}: {', '.join(names) or '(none)'}"
    if hint:
        msg += f" (did you mean {hint[0]!r}?)"
    raise DSConfigError(text, msg)


def _as_hjson(text: str):
    """``text`` as DeepSpeed's loader reads it (hjson: JSON plus comments, trailing commas, ...); None if not."""
    try:
        import hjson
        return hjson.loads(text, object_pairs_hook=no_duplicate_keys)
    except Exception:  # noqa: BLE001 - not readable that way either: the JSON error is the one to show
        return None


def load_ds_json(path) -> dict:
    """Read a DeepSpeed JSON file; bad JSON or duplicate keys give a DSConfigError with line and column.

    What DeepSpeed's own loader (hjson) reads is read too: comments (``#``, ``//``), trailing commas.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DSConfigError(str(path), f"cannot read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:  # DeepSpeed's open() stops on it too
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DSConfigError(str(path), f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, column {col} "
                                       "(DeepSpeed reads its JSON as UTF-8); save the file as UTF-8") from None
    if not text.strip().lstrip("\ufeff"):
        raise DSConfigError(str(path), "the file is empty (DeepSpeed would read it as {} and then stop for lack of "
                                       "a batch size); write {} to leave every value to the run")
    constants: list[str] = []
    try:
        data = json.loads(text, object_pairs_hook=no_duplicate_keys, parse_float=_hjson_float,
                          parse_constant=lambda name: constants.append(name) or _NonFinite(name))
    except json.JSONDecodeError as exc:
        data = _as_hjson(text)
        if data is None:
            raise DSConfigError(str(path), f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
                                + _python_dict_hint(text)) from exc
        from dstrain.engine.ds_copied import template_placeholders
        unfilled = template_placeholders(text, data) if isinstance(data, dict) else None
        if unfilled:
            raise DSConfigError(str(path), unfilled) from None
    except ValueError as exc:  # duplicate key
        raise DSConfigError(str(path), str(exc)) from exc
    if not isinstance(data, dict):
        raise DSConfigError(str(path), f"top level must be a JSON object, got {type(data).__name__}")
    from dstrain.engine.ds_foreign import app_config_problem
    if (app := app_config_problem(data)) is not None:  # one line, not one per key of the script's settings
        raise DSConfigError(str(path), app)
    if constants:
        raise DSConfigError(str(path), [f"{where}: {name} is not a JSON number (DeepSpeed's hjson loader reads it as "
                                         "text); write a finite number or \"auto\"" for where, name in _non_finite(data)])
    return canonical_forms(data)


def _python_dict_hint(text: str) -> str:
    """The fix for a Python dict printed or pasted as the file (``{'stage': 2, 'enabled': True}``)."""
    import re
    if not re.search(r"""[{,]\s*'[^'"]+'\s*:""", text):
        return ""
    return (" (the file is a Python dict: single-quoted keys, True / False / None, which DeepSpeed's JSON / hjson "
            "loader cannot read either); write it with json.dump(config, file)")


class _NonFinite(str):
    """A NaN / Infinity / -Infinity literal, kept as its text so that its key can be named."""


def _non_finite(node, path: str = "") -> list[tuple[str, str]]:
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in _non_finite(v, f"{path}[{i}]")]
    return [(path or "top level", str(node))] if isinstance(node, _NonFinite) else []


def _hjson_float(text: str):
    """A JSON float as DeepSpeed's hjson loader reads it: integral values (``4.0``, ``5e8``) as ints."""
    value = float(text)
    try:
        import hjson
        read = hjson.loads(text)
    except Exception:  # noqa: BLE001 - no hjson: JSON's reading
        return value
    return read if isinstance(read, int) and not isinstance(read, bool) and read == value else value


#: Sections whose ``enabled`` DeepSpeed reads with pydantic, which takes "true" / "False" / "1" ... as booleans.
PYDANTIC_ENABLED = ("bf16", "fp16", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "hybrid_engine")

#: Booleans DeepSpeed reads as they are (``get_scalar_param``, no pydantic): quoted, any text is true to it (so
#: canonical_forms reads the words for true as true, and ds_sections refuses the rest).
PLAIN_FLAGS = ("wall_clock_breakdown", "memory_breakdown", "prescale_gradients", "zero_allow_untested_optimizer",
               "zero_force_ds_cpu_optimizer", "dump_state", "disable_allgather", "dataloader_drop_last",
               "use_data_before_expert_parallelism", "flops_profiler.enabled", "flops_profiler.detailed",
               "torch_autocast.enabled", "autotuning.enabled", "data_efficiency.enabled",
               "activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing",
               "activation_checkpointing.contiguous_memory_optimization",
               "activation_checkpointing.synchronize_checkpoint_boundary", "activation_checkpointing.profile",
               "managed_gradient_accumulation", "disable_python_gc", "checkpoint.use_node_local_storage",
               "checkpoint.checkpoint_serialization")


#: Strings DeepSpeed's (pydantic) precision sections accept for a boolean.
_STRING_BOOLEANS = {**dict.fromkeys(("true", "1", "yes", "y", "on", "t"), True),
                    **dict.fromkeys(("false", "0", "no", "n", "off", "f"), False)}


def canonical_forms(cfg: dict) -> dict:
    """The forms DeepSpeed still reads under older spellings, as their current ones: a ``"bfloat16"``
    section (DeepSpeed-Chat writes it) as ``"bf16"`` when there is no ``"bf16"``, and the boolean
    ``"zero_optimization": true`` (DeepSpeed's getting-started tutorial) as ``{"stage": 1}`` (false:
    stage 0; a top-level ``allgather_size`` beside true as its ``allgather_bucket_size``), a stage written as a
    string (``"2"``) as the number, and a bf16 / fp16 ``enabled`` or a
    boolean ZeRO key (its offload blocks' too) written as a string DeepSpeed's parser reads as a boolean
    (``"true"``, ``"False"``, ``"1"``, ``"yes"``, ...) as that boolean."""
    out = dict(cfg)
    if "bfloat16" in out and "bf16" not in out:
        out = {("bf16" if k == "bfloat16" else k): v for k, v in out.items()}
    if isinstance(out.get("zero_optimization"), bool):
        on = out["zero_optimization"]
        out["zero_optimization"] = {"stage": 1 if on else 0}
        if on and "allgather_size" in out:  # that form's bucket size, which DeepSpeed 0.19 still reads beside it
            out["zero_optimization"]["allgather_bucket_size"] = out.pop("allgather_size")
    zo = out.get("zero_optimization")
    if isinstance(zo, dict) and isinstance(zo.get("stage"), str) and zo["stage"].strip() in ("0", "1", "2", "3"):
        out["zero_optimization"] = {**zo, "stage": int(zo["stage"])}  # DeepSpeed's pydantic parser reads "2" as 2
    for key in PYDANTIC_ENABLED:
        section = out.get(key)
        if isinstance(section, dict) and isinstance(section.get("enabled"), str):
            out[key] = {**section, "enabled": _as_boolean(section["enabled"])}
        elif isinstance(section, dict) and _zero_or_one(section.get("enabled")):  # pydantic reads 1 / 0 as booleans
            out[key] = {**section, "enabled": bool(section["enabled"])}
    for path in PLAIN_FLAGS:  # "true" is true to DeepSpeed too; "false" is left for ds_sections to refuse
        head, _, key = path.rpartition(".")
        node = out.get(head) if head else out
        value = node.get(key) if isinstance(node, dict) else None
        if (isinstance(value, str) and _as_boolean(value) is True) or _zero_or_one(value):  # 1 / 0: as truthy to it
            flag = True if isinstance(value, str) else bool(value)
            if head:
                out[head] = {**node, key: flag}
            else:
                out[key] = flag
    if isinstance(out.get("gradient_clipping"), bool):  # DeepSpeed clips at max_norm True (1.0); False is off (0)
        out["gradient_clipping"] = float(out["gradient_clipping"])
    zo = out.get("zero_optimization")
    if isinstance(zo, dict) and any(isinstance(v, str) or _zero_or_one(v) for v in _walk_values(zo)):
        out["zero_optimization"] = _zero_string_booleans(zo)
    return out


#: Boolean keys of DeepSpeed's offload_optimizer / offload_param blocks (pydantic models, as the ZeRO section).
_OFFLOAD_BOOLEANS = frozenset({"pin_memory", "pipeline_read", "pipeline_write", "pipeline", "fast_init",
                               "super_offload"})
#: ZeRO keys typed Optional[bool] (no boolean default, so not among zero_defaults' booleans).
_ZERO_OPTIONAL_BOOLEANS = frozenset({"overlap_comm", "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"})


def _walk_values(zo: dict):
    for key, value in zo.items():
        if key == "stage":
            continue
        yield from (value.values() if isinstance(value, dict) else (value,))


def _zero_or_one(value) -> bool:
    """An integer 1 or 0 where a boolean belongs (generated files write them): pydantic reads them as true / false,
    and DeepSpeed's plain flags test them by truthiness, so they are read as the booleans."""
    return isinstance(value, int) and not isinstance(value, bool) and value in (0, 1)


def _as_boolean(value):
    word = value.strip().lower() if isinstance(value, str) else None
    return _STRING_BOOLEANS[word] if word in _STRING_BOOLEANS else value


def _as_flag(value):
    """A boolean key's value as DeepSpeed's pydantic parser reads it: words and 1 / 0 as booleans."""
    return bool(value) if _zero_or_one(value) else _as_boolean(value)


def _zero_string_booleans(zo: dict) -> dict:
    """``zero_optimization``'s boolean keys written as strings (``"overlap_comm": "true"``, ``"pin_memory":
    "True"``, as configs generated from templates write them) as the booleans DeepSpeed's pydantic parser reads
    them as, so that dstrain's checks (``zero_quantized_*`` on the CPU, ``super_offload``, ``reduce_scatter``)
    see what DeepSpeed will run."""
    from dstrain.engine.ds_config import zero_defaults
    flags = {k for k, v in zero_defaults().items() if isinstance(v, bool)} | _ZERO_OPTIONAL_BOOLEANS
    out = {k: (_as_flag(v) if k in flags else v) for k, v in zo.items()}
    for key in ("offload_optimizer", "offload_param"):
        if isinstance(out.get(key), dict):
            out[key] = {k: (_as_flag(v) if k in _OFFLOAD_BOOLEANS else v) for k, v in out[key].items()}
    return out


#: Top-level keys under which trainers' dumps nest a whole DeepSpeed config (``"deepspeed"``: a YAML-to-JSON dump;
#: ``"deepspeed_config"`` / ``"ds_config"``: an argument or attribute dumped with its name, as Megatron-DeepSpeed's
#: ``--deepspeed_config`` and HF's ``hf_deepspeed_config`` are).
NESTING_KEYS = ("deepspeed", "deepspeed_config", "ds_config")


def nests_ds_config(data, key: str = "deepspeed") -> bool:
    """A top-level ``key`` object holding DeepSpeed's own top-level keys (for ``"deepspeed"``: not dstrain's
    deepspeed section)."""
    from dstrain.config import DeepSpeedConfig
    inner = data.get(key) if isinstance(data, dict) else None
    own = DeepSpeedConfig.__dataclass_fields__ if key == "deepspeed" else ()
    return isinstance(inner, dict) and any(k in KNOWN_TOP_LEVEL_KEYS and k not in own for k in inner)


#: Top-level spellings of the gradient-accumulation dtype (generated files write it beside
#: gradient_accumulation_steps, after the DeepSpeed change that added it as data_types.grad_accum_dtype).
GRAD_ACCUM_DTYPE_SPELLINGS = ("gradient_accumulation_dtype", "grad_accum_dtype")


def _misplaced(key, value) -> str | None:
    """The refusal for a key DeepSpeed reads only inside a section, written at the top level (where a close-match
    hint would name the wrong key: 'gradient_accumulation_dtype' is not 'gradient_accumulation_steps')."""
    if key in GRAD_ACCUM_DTYPE_SPELLINGS:
        return (f"unknown top-level key {key!r}: DeepSpeed reads the gradient-accumulation dtype only as "
                "data_types.grad_accum_dtype and would silently ignore this one (accumulating in its default dtype); "
                f"write \"data_types\": {{\"grad_accum_dtype\": {json.dumps(value)}}}")
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    fields = DeepSpeedZeroConfig.model_fields
    if key in fields or any(f.alias == key for f in fields.values()):
        return (f"unknown top-level key {key!r}: a zero_optimization key, which DeepSpeed reads only inside the "
                "\"zero_optimization\" section and would silently ignore at the top level; move it there")
    return None


def _top_level_problems(cfg: dict) -> list[str]:
    problems = []
    for key in cfg:
        if cfg[key] is None and key in NULL_STOPS_PARSER:
            fix = "a value" if key in ("gradient_allreduce_op", "wall_clock_breakdown") else "{} (an empty section)"
            problems.append(f"{key}: null (an empty entry, as a YAML-to-JSON dump writes one), which DeepSpeed's "
                            f"config parser stops on at start-up; remove the key, or write {fix}")
            continue
        shape = section_shape_problem(key, cfg[key])
        if shape:
            problems.append(shape)
            continue
        if key in KNOWN_TOP_LEVEL_KEYS:
            continue
        if key == "allgather_size":
            problems.append("unknown top-level key 'allgather_size': DeepSpeed reads it only beside the boolean "
                            "\"zero_optimization\": true (its first ZeRO form) and would silently ignore it here; "
                            f"write \"zero_optimization\": {{\"allgather_bucket_size\": {json.dumps(cfg[key])}}}")
            continue
        old = old_profiler_key_problem(key, cfg[key])
        if old:
            problems.append(old)
            continue
        if key in NESTING_KEYS and nests_ds_config(cfg, key):
            problems.append(f"top-level key {key!r} holds a DeepSpeed config one level down (as a trainer's "
                            "YAML-to-JSON dump nests it); DeepSpeed reads only top-level keys and would silently "
                            "ignore it: move its keys to the top level")
            continue
        if key in REMOVED_TOP_LEVEL_KEYS:
            off = isinstance(cfg[key], dict) and cfg[key].get("enabled") is False
            problems.append(f"top-level key {key!r} is no longer supported: {REMOVED_TOP_LEVEL_KEYS[key]}; DeepSpeed "
                            "stops at start-up on the key whatever it holds" + ("; the block is off (\"enabled\": "
                            "false): remove it, and nothing changes" if off else "; remove it"))
            continue
        from dstrain.engine.ds_foreign import foreign_key_problem, ignored_key
        ignored = ignored_key(key, cfg) if isinstance(key, str) else None
        if ignored is not None and not ignored[1]:
            continue  # turns nothing on: a note (ds_foreign.ignored_key_notes)
        placed = _misplaced(key, cfg[key]) or foreign_key_problem(key, cfg) or (ignored and ignored[0])
        if placed:
            problems.append(placed)
            continue
        hint = difflib.get_close_matches(str(key), sorted(KNOWN_TOP_LEVEL_KEYS), n=1, cutoff=0.6)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
        problems.append(f"unknown top-level key {key!r}{suggestion}; DeepSpeed would silently ignore it")
    return problems


def validate_top_level(cfg: dict, source: str) -> None:
    """Reject unknown or removed top-level keys, all of them at once, each with a close-match hint."""
    if not isinstance(cfg, dict):
        raise DSConfigError(source, f"config must be a JSON object, got {type(cfg).__name__}")
    problems = _top_level_problems(cfg)
    if problems:
        raise DSConfigError(source, problems)
