"""Keys DeepSpeed 0.19.8 reads somewhere other than where a file puts them, and values it reads only late.

Each passes DeepSpeed's config parser and then either does nothing (the run trains as the file does not say) or
stops every rank inside ``deepspeed.initialize``:

* an optimizer's or scheduler's settings written beside ``"type"`` instead of inside ``"params"``
  (``{"type": "AdamW", "lr": 1e-4}``): DeepSpeed reads only ``params`` and builds the class with its defaults;
* an optimizer's or scheduler's boolean param quoted as false (``"adam_w_mode": "false"``): DeepSpeed passes the
  text on, and the class reads it as true (AdamW instead of Adam with L2, Nesterov momentum, momentum cycling);
* an ``enabled`` random-LTD or curriculum block inside a ``data_efficiency`` section whose own ``enabled`` is false:
  DeepSpeed reads each inner switch by itself, so the block is on (random-LTD's scheduler is built, curriculum
  is left to DeepSpeed's own dataloader, which dstrain does not use; so is dynamic batching, DeepSpeed's
  variable batch size and lr);
* a monitor path starting with ``~``: DeepSpeed joins it as written (no ``expanduser``), so the logs land in a
  folder named ``~``;
* ``data_types`` dtypes in upper case ("FP32") and a ``buffer_dtype`` that is not one of DeepSpeed's dtype names:
  read only when the engine starts, through the case-sensitive ``DtypeEnum``, which raises ValueError on every
  rank;
* a ``gradient_predivide_factor`` of 0 or in quotes: DeepSpeed's all-reduce divides by it at the first step;
* a ``comms_logger.prof_ops`` name no op logs under (``"allreduce"``, the wrapper ``"reduce_scatter_fn"``): with
  ``prof_all`` false only the listed names are profiled, so it never is.

:func:`unread_problems` is called by ``ds_sections.section_problems``.
"""
from __future__ import annotations

import difflib
import os

#: The keys DeepSpeed reads in an optimizer / scheduler block (runtime/config.py: type, params, legacy_fusion).
_BLOCK_KEYS = {"optimizer": ("type", "params", "legacy_fusion"), "scheduler": ("type", "params")}

#: DeepSpeed's dtype names (runtime/config.py DtypeEnum), as ``data_types.buffer_dtype`` takes them.
_DTYPE_NAMES = ("fp16", "torch.float16", "float16", "half", "fp32", "torch.float32", "float32", "float",
                "bf16", "torch.bfloat16", "bfloat16", "int8", "torch.int8")

#: Monitor paths DeepSpeed opens or joins as written.
_MONITOR_PATHS = (("tensorboard", "output_path"), ("csv_monitor", "output_path"), ("flops_profiler", "output_file"))


def beside_type(path: str) -> bool:
    """A dotted path of a key written in an optimizer or scheduler block beside ``"type"`` (``optimizer.lr``),
    which :func:`unread_problems` names; not the block itself nor what is under ``type`` / ``params``."""
    head, _, rest = path.partition(".")
    return head in _BLOCK_KEYS and bool(rest) and rest.split(".")[0] not in _BLOCK_KEYS[head]


def _them(keys) -> str:
    return "it" if len(keys) == 1 else "them"


def _outside_params(cfg: dict) -> list[str]:
    out = []
    for block, known in _BLOCK_KEYS.items():
        node = cfg.get(block)
        if not isinstance(node, dict):
            continue
        extra = [k for k in node if k not in known]
        typos = {k: difflib.get_close_matches(str(k), known, n=1, cutoff=0.75) for k in extra}
        for key in [k for k in extra if typos[k]]:
            out.append(f"{block}.{key}: unknown key (did you mean {typos[key][0]!r}?); DeepSpeed would silently "
                       "ignore it")
        from dstrain.engine.ds_files import KNOWN_TOP_LEVEL_KEYS
        for key in [k for k in extra if not typos[k] and k in KNOWN_TOP_LEVEL_KEYS]:  # gradient_clipping, ...
            out.append(f"{block}.{key}: a top-level key, which DeepSpeed never reads inside {block}; move it to the "
                       "top level")
        zero = [k for k in extra if not typos[k] and k not in KNOWN_TOP_LEVEL_KEYS and _zero_key(k)]
        for key in zero:  # offload_optimizer beside the optimizer's type
            out.append(f"{block}.{key}: a zero_optimization key, which DeepSpeed never reads inside {block}; move it "
                       "into \"zero_optimization\"")
        loose = [k for k in extra if not typos[k] and k not in KNOWN_TOP_LEVEL_KEYS and k not in zero]
        if loose:
            kind = node.get("type")
            out.append(f"{block}.{', '.join(loose)}: written beside \"type\", where DeepSpeed never reads "
                       f"{_them(loose)} (it reads only {block}.params, and would build {kind!r} with its own "
                       f"defaults instead); move {_them(loose)} into \"params\"")
    return out


def _zero_key(key) -> bool:
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    fields = DeepSpeedZeroConfig.model_fields
    return key in fields or any(f.alias == key for f in fields.values())


#: Words for false that a generated file quotes; to the optimizer / scheduler DeepSpeed builds they are true.
_FALSE_WORDS = ("false", "no", "off")  # not "0": a quoted number is named as one (ds_config)


def _quoted_false_params(cfg: dict) -> list[str]:
    """``"adam_w_mode": "false"``, ``"nesterov": "false"``, ``"cycle_momentum": "false"``: DeepSpeed hands the params
    to the class as written (popping adam_w_mode / torch_adam and testing them with ``if``), so the text is true."""
    out = []
    for block in _BLOCK_KEYS:
        node = cfg.get(block)
        params = node.get("params") if isinstance(node, dict) else None
        for key, value in (params.items() if isinstance(params, dict) else ()):
            if isinstance(value, str) and value.strip().lower() in _FALSE_WORDS:
                out.append(f"{block}.params.{key}: file says {value!r} in quotes, which DeepSpeed passes on as text "
                           f"and the {block} reads as true (any text is, \"false\" too); write false without quotes")
    return out


def _data_efficiency_inner(cfg: dict) -> list[str]:
    block = cfg.get("data_efficiency")
    if not isinstance(block, dict) or block.get("enabled") is True:
        return []  # absent, or on: refused as a whole (ds_sections)
    routing = block.get("data_routing") if isinstance(block.get("data_routing"), dict) else {}
    sampling = block.get("data_sampling") if isinstance(block.get("data_sampling"), dict) else {}
    ltd = routing.get("random_ltd") if isinstance(routing.get("random_ltd"), dict) else {}
    curriculum = sampling.get("curriculum_learning") if isinstance(sampling.get("curriculum_learning"), dict) else {}
    out = []
    if ltd.get("enabled") not in (None, False, 0):
        out.append("data_efficiency.data_routing.random_ltd.enabled: DeepSpeed reads it whatever data_efficiency."
                   "enabled and data_routing.enabled say, and builds random-LTD's scheduler, while dstrain's models "
                   "have none of its token-dropping layers (the run would train without it, not as the file says); "
                   "set it to false or remove the data_efficiency section")
    if curriculum.get("enabled") not in (None, False, 0):
        out.append("data_efficiency.data_sampling.curriculum_learning.enabled: DeepSpeed reads it whatever "
                   "data_efficiency.enabled says, and only its own dataloader applies a curriculum (dstrain's "
                   "samplers feed the data: no curriculum, not as the file says); set it to false or remove the "
                   "data_efficiency section")
    dynamic = sampling.get("dynamic_batching") if isinstance(sampling.get("dynamic_batching"), dict) else {}
    if dynamic.get("enabled") not in (None, False, 0) and "max_tokens" not in dynamic:
        out.append("data_efficiency.data_sampling.dynamic_batching.max_tokens: missing, and DeepSpeed's parser asserts "
                   "it whenever dynamic_batching.enabled is on, whatever data_efficiency.enabled says (every rank "
                   "would stop at start-up); set dynamic_batching.enabled to false or remove the data_efficiency "
                   "section")
    elif dynamic.get("enabled") not in (None, False, 0):
        out.append("data_efficiency.data_sampling.dynamic_batching.enabled: DeepSpeed reads it whatever "
                   "data_efficiency.enabled says, and only its variable-batch dataloader helper (which a training "
                   "script calls itself) packs batches by max_tokens and scales the lr; dstrain's samplers feed "
                   "fixed batches (not as the file says); set it to false or remove the data_efficiency section")
    return out


def _home_paths(cfg: dict) -> list[str]:
    out = []
    for section, key in _MONITOR_PATHS:
        block = cfg.get(section)
        path = block.get(key) if isinstance(block, dict) else None
        if isinstance(block, dict) and block.get("enabled") not in (None, False, 0) and isinstance(path, str) \
                and path.startswith("~"):
            out.append(f"{section}.{key}: {path!r} starts with '~', which DeepSpeed does not expand (it would write "
                       "under a folder named '~'); write the full path "
                       f"({os.path.expanduser(path)}) or a relative one (kept inside the run's folder)")
    return out


def _dtype_names(cfg: dict) -> list[str]:
    """``data_types``' dtypes, which DeepSpeed's parser keeps as written and its engine reads through the
    case-sensitive ``DtypeEnum`` when it starts ("FP32" raises ValueError there, on every rank)."""
    types = cfg.get("data_types")
    out = []
    for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        value = types.get(key) if isinstance(types, dict) else None
        if value is None or (isinstance(value, str) and (value in _DTYPE_NAMES or value.strip().lower() == "auto")):
            continue
        same = str(value).strip().lower()
        if same in _DTYPE_NAMES:
            out.append(f"data_types.{key}: DeepSpeed's dtype names are lower case, file says {value!r} (its parser "
                       f"keeps it and the engine raises \"{value!r} is not a valid DtypeEnum\" when it starts, on "
                       f"every rank); write \"{same}\"")
        elif key == "buffer_dtype":  # the other two are named by ds_sections / ds_config
            out.append(f"data_types.buffer_dtype: must be one of DeepSpeed's dtype names (fp32, bf16, fp16, ...), "
                       f"file says {value!r} (its parser keeps it and the engine raises ValueError when it casts the "
                       "model for bf16 / fp16, on every rank); write \"fp32\" (or remove it: buffers keep their "
                       "dtype)")
    return out


def _predivide(cfg: dict) -> list[str]:
    """``gradient_predivide_factor``, which DeepSpeed's parser keeps as written and its all-reduce divides each
    gradient by (``1.0 / factor``) at the first step: at ZeRO stage 0 (and stage 1/2 without reduce_scatter) 0 raised
    ZeroDivisionError and a quoted number TypeError, on every rank."""
    value = cfg.get("gradient_predivide_factor")
    if value is None or isinstance(value, bool) or (isinstance(value, (int, float)) and value != 0):
        return []
    if isinstance(value, str) and _nonzero_number(value):
        return [f"gradient_predivide_factor: file says {value!r}, a number in quotes, which DeepSpeed keeps as text "
                "(its all-reduce computes 1.0 / factor: TypeError at the first step, on every rank); write it without "
                f"the quotes: {value.strip()}"]
    return [f"gradient_predivide_factor: must be a positive number, file says {value!r} (DeepSpeed's all-reduce "
            "divides the gradients by it: ZeroDivisionError or TypeError at the first step, on every rank); write "
            "1.0 (no pre-division) or remove it"]


#: comms_logger op names written for DeepSpeed's wrappers, which log under the name of the op they call.
_WRAPPED_COMM_OPS = {"reduce_scatter_fn": "reduce_scatter_tensor", "allgather_fn": "all_gather_into_tensor"}


def _comm_op_names() -> set[str]:
    """The names DeepSpeed's comms logger matches ``prof_ops`` against: each timed op's ``log_name`` default or, where
    it has none, its function name (deepspeed/comm/comm.py)."""
    import inspect
    import re

    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        from deepspeed.comm import comm
    source = inspect.getsource(comm)
    return set(re.findall(r"@timed_op\s*\ndef (\w+)", source)) | set(re.findall(r"log_name='(\w+)'", source))


def _comms_ops(cfg: dict) -> list[str]:
    """``comms_logger.prof_ops`` names no op logs under (a typo, or a wrapper such as ``reduce_scatter_fn``): with
    ``prof_all`` false DeepSpeed profiles only the listed names, so these are never profiled, without a word."""
    block = cfg.get("comms_logger")
    ops = block.get("prof_ops") if isinstance(block, dict) else None
    if not isinstance(ops, list) or block.get("enabled") is not True or block.get("prof_all", True) is not False:
        return []
    known = _comm_op_names()
    unknown = [op for op in ops if isinstance(op, str) and op not in known]
    if not unknown:
        return []
    close = {op: _WRAPPED_COMM_OPS.get(op) or next(iter(difflib.get_close_matches(op, sorted(known), n=1)), None)
             for op in unknown}
    hints = [f"{op!r} -> {close[op]!r}" if close[op] else f"{op!r}: no such op" for op in unknown]
    one = len(unknown) == 1
    return [f"comms_logger.prof_ops: {', '.join(map(repr, unknown))} "
            f"{'is not the name of an op' if one else 'are not names of ops'} DeepSpeed's comms logger logs (with "
            f"prof_all false it profiles only the names listed, so {'it' if one else 'they'} would never be profiled, "
            f"without a word); write the logged names ({'; '.join(hints)})"]


def _nonzero_number(text: str) -> bool:
    try:
        return float(text) != 0
    except ValueError:
        return False


def unread_problems(cfg: dict) -> list[str]:
    """Problems (key, reason, fix) with keys DeepSpeed reads elsewhere than the file puts them, or reads late."""
    return (_outside_params(cfg) + _quoted_false_params(cfg) + _data_efficiency_inner(cfg) + _home_paths(cfg)
            + _dtype_names(cfg) + _predivide(cfg) + _comms_ops(cfg))


def allgather_partitions_note(zo: dict, stage: int) -> str | None:
    """The note for ``zero_optimization.allgather_partitions``, which DeepSpeed 0.19.8 parses and reads nowhere: its
    engine's ``zero_allgather_partitions()`` has no caller, the ZeRO-1/2 optimizer takes no such argument and always
    all-gathers the updated partitions (``all_gather_dp_groups``), and ZeRO-3 gathers parameters itself. Said at
    stage 3 whatever the value (a stage-1/2 setting, as ``allgather_bucket_size`` is), and at stages 1/2 where it is
    false (the broadcast it asks for never happens; true is what DeepSpeed does anyway); stage 0's own note names it."""
    if "allgather_partitions" not in zo or stage not in (1, 2, 3):
        return None
    value = zo["allgather_partitions"]
    off = value is False or (isinstance(value, str) and value.strip().lower() in ("false", "no", "off", "0"))
    if stage == 3:
        return ("zero_optimization.allgather_partitions: unused at stage 3, which gathers the parameters itself "
                "(DeepSpeed 0.19 reads the key at no stage: its ZeRO-1/2 optimizer always all-gathers the updated "
                "partitions)")
    if not off:
        return None
    return (f"zero_optimization.allgather_partitions: false, which DeepSpeed 0.19 reads at no stage: its ZeRO-{stage} "
            "optimizer all-gathers the updated partitions anyway (no broadcast); the run trains the same either way")
