"""Values DeepSpeed 0.19.8 reads as written, with ``dict.get`` or its ``get_scalar_param``, and uses later.

No pydantic model stands between these keys and the code that uses them, so a value of the wrong kind is
either an opaque error from DeepSpeed's config parser (``'bool' object has no attribute 'upper'`` for a
``checkpoint.tag_validation`` of ``false``; ``value of 'true' is invalid`` for a quoted
``checkpoint.parallel_write.pipeline_stage``; ``not all arguments converted during string formatting`` for a
quoted ``vocabulary_size``), reached only after dstrain's other checks pass, or a setting that silently does
something else: Lightning's DeepSpeedStrategy still writes ``aio.thread_count``, which DeepSpeed renamed
``intra_op_parallelism`` and no longer reads; HF Transformers' 2021 ZeRO-3 example writes
``cpu_offload_use_pin_memory``, a deprecated key DeepSpeed 0.19 maps to nothing; under NVMe offload the ``aio``
values go to the async-io handle as written (text stops every rank); an enabled ``torch_autocast`` imports each
``lower_precision_safe_modules`` name in initialize (a bare ``"Linear"`` stops every rank) and asserts against
ZeRO++ quantized weights; and an fp16 ``hysteresis`` of 0 (or less)
makes DeepSpeed's dynamic loss scaler count the hysteresis down past 1 at every overflow, so the scale never falls
and every overflowing step is skipped. DeepSpeed's ``activation_checkpointing`` features are also named here, where
``dstrain check-config`` sees them (the launch refused them in the factory, after check-config had passed).
:func:`scalar_checks` also runs ds_autocast's checks (``torch_autocast`` beside bf16 / fp16, its ``dtype``) and
ds_paths' (a monitor ``job_name`` written as a path).

:func:`scalar_checks` returns ``(problems, notes)``, each naming its key; pure.
"""
from __future__ import annotations

import json

#: DeepSpeed's checkpoint tag-validation modes (it upper-cases the text before comparing).
TAG_VALIDATION_MODES = ("Ignore", "Warn", "Fail")

#: The features of DeepSpeed's activation-checkpointing block, which act only through deepspeed.checkpointing.
CHECKPOINTING_FEATURES = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                          "synchronize_checkpoint_boundary", "profile")


def activation_checkpointing_problem(block) -> str | None:
    """The refusal for a DeepSpeed ``activation_checkpointing`` block that turns a feature on, else None.

    dstrain's models checkpoint through their own ``parallelize`` (``deepspeed.activation_checkpointing``), never
    through ``deepspeed.checkpointing``, so none of the block's features would act."""
    if not isinstance(block, dict):
        return None
    on = [k for k in CHECKPOINTING_FEATURES if block.get(k) is True]
    if not on:
        return None
    return (f"activation_checkpointing.{on[0]}: DeepSpeed's activation-checkpointing block only acts on models that "
            "call deepspeed.checkpointing, which dstrain's models do not; remove the block and use "
            "--deepspeed.activation_checkpointing=true")


def _tag_validation(cfg: dict) -> list[str]:
    ck = cfg.get("checkpoint")
    if not isinstance(ck, dict) or "tag_validation" not in ck:
        return []
    value = ck["tag_validation"]
    if isinstance(value, str) and value.upper() in (m.upper() for m in TAG_VALIDATION_MODES):
        return []
    modes = ", ".join(f'"{m}"' for m in TAG_VALIDATION_MODES)
    if isinstance(value, bool) or value is None:
        fix = {True: ' ("Warn" is DeepSpeed\'s default)', False: ' ("Ignore" turns the check off)'}.get(value, "")
        why = f"{str(value).lower() if value is not None else 'null'}, not a mode"
        return [f"checkpoint.tag_validation: {why}; DeepSpeed's parser upper-cases the text and stops on anything "
                f"else ('{type(value).__name__}' object has no attribute 'upper'); write one of {modes}{fix}"]
    return [f"checkpoint.tag_validation: {value!r} is not one of {modes} (DeepSpeed's parser stops on it); write one "
            "of those"]


def _parallel_write(cfg: dict) -> list[str]:
    """``checkpoint.parallel_write``: DeepSpeed's parser takes ``.get`` of the block and accepts a ``pipeline_stage``
    only ``in [True, False]``; anything else stops it with a message that names neither the fix nor, while another
    check fails first, the key at all."""
    ck = cfg.get("checkpoint")
    if not isinstance(ck, dict) or "parallel_write" not in ck:
        return []
    block = ck["parallel_write"]
    if not isinstance(block, dict):
        return [f"checkpoint.parallel_write: {json.dumps(block)}, where DeepSpeed wants a block (its parser calls "
                ".get on it and stops); write {\"pipeline_stage\": true} (each data-parallel rank of a pipeline stage "
                "writes part of its layers) or remove it"]
    value = block.get("pipeline_stage", False)
    if value in (True, False):
        return []
    said = str(value).strip().lower() if isinstance(value, str) else None
    fix = f"write {said} without quotes" if said in ("true", "false") else "write true or false"
    return [f"checkpoint.parallel_write.pipeline_stage: file says {json.dumps(value)}, and DeepSpeed's parser accepts "
            f"only true or false and stops on anything else (\"value of {value!r} is invalid\"); {fix}"]


def _vocabulary_size(cfg: dict) -> list[str]:
    value = cfg.get("vocabulary_size")
    if value is None or isinstance(value, (int, float)):  # a number (True % 8 is 1 too): DeepSpeed at most warns
        return []
    plain = value.strip() if isinstance(value, str) else None
    fix = f"write {plain} without quotes" if plain and plain.lstrip("-").isdigit() else "write the number or remove it"
    return [f"vocabulary_size: file says {value!r}, not a number: DeepSpeed's parser takes it modulo 8 (to warn when "
            f"it is not a multiple of 8, its only use) and stops on text ('not all arguments converted during "
            f"string formatting'); {fix}"]


def _offloads_to_nvme(cfg: dict) -> bool:
    zo = cfg.get("zero_optimization")
    return isinstance(zo, dict) and any(isinstance(zo.get(k), dict) and str(zo[k].get("device", "")).lower() == "nvme"
                                        for k in ("offload_optimizer", "offload_param"))


def _aio_thread_count(cfg: dict, problems: list[str], notes: list[str]) -> None:
    """Lightning's DeepSpeedStrategy writes ``"thread_count": 1`` into ``aio``: DeepSpeed 0.19's swapper reads
    ``intra_op_parallelism`` (default 1) instead, so thread_count is ignored; a value other than the one DeepSpeed
    uses is refused where NVMe offload would read it, noted otherwise."""
    aio = cfg.get("aio")
    if not isinstance(aio, dict) or "thread_count" not in aio:
        return
    count, used = aio["thread_count"], aio.get("intra_op_parallelism", 1)
    if _offloads_to_nvme(cfg) and count != used and "intra_op_parallelism" not in aio:
        problems.append(f"aio.thread_count: {count!r}, which DeepSpeed 0.19 no longer reads (the key is "
                        f"intra_op_parallelism now): its NVMe swapper would use {used} thread(s); rename it "
                        "to intra_op_parallelism")
        return
    if _offloads_to_nvme(cfg):  # else the whole section is unused, and ds_sections says so
        notes.append(f"aio.thread_count: unused: DeepSpeed 0.19 reads intra_op_parallelism instead ({used})")


#: aio keys DeepSpeed hands its async-io handle as written: counts, and switches.
AIO_COUNTS = ("block_size", "queue_depth", "intra_op_parallelism")
AIO_SWITCHES = ("single_submit", "overlap_events", "use_gds")


def _aio_values(cfg: dict) -> list[str]:
    """Under NVMe offload DeepSpeed passes the aio values to its C++ handle as written (``get_scalar_param``):
    text such as ``"block_size": "1M"`` or ``"overlap_events": "false"`` stops every rank in initialize."""
    aio = cfg.get("aio")
    if not isinstance(aio, dict) or not _offloads_to_nvme(cfg):
        return []
    out = []
    for key in AIO_COUNTS:
        value = aio.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            out.append(f"aio.{key}: a positive whole number, file says {value!r} (DeepSpeed hands it to its async-io "
                       "handle as written, which stops every rank in initialize); write the number without quotes")
    for key in AIO_SWITCHES:
        value = aio.get(key)
        if isinstance(value, str) or not isinstance(value, (bool, int, float, type(None))):  # 1 / 0 pass as truth
            out.append(f"aio.{key}: true or false, file says {value!r} (DeepSpeed hands it to its async-io handle "
                       "as written, which stops every rank in initialize); write true or false without quotes")
    return out


def _autocast_problems(cfg: dict, device_type: str) -> list[str]:
    """An enabled ``torch_autocast``: DeepSpeed imports each ``lower_precision_safe_modules`` name as
    ``package.Class`` in initialize (a bare ``"Linear"``, a typo, or one string where a list belongs, which it walks
    letter by letter, stop every rank), and asserts against ZeRO++ quantized weights there."""
    import importlib
    import json
    block = cfg.get("torch_autocast")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return []
    out = []
    names = block.get("lower_precision_safe_modules")
    if isinstance(names, str):
        out.append(f"torch_autocast.lower_precision_safe_modules: one string, {json.dumps(names)}, where DeepSpeed "
                   "wants a list (it would import each letter as a module and stop every rank in initialize); write "
                   f"[{json.dumps(names)}]")
    elif isinstance(names, list):
        bad = []
        for name in names:
            if not isinstance(name, str):
                continue  # DeepSpeed's parser names it
            package, _, attr = name.rpartition(".")
            try:
                getattr(importlib.import_module(package), attr)  # as DeepSpeed looks it up (rsplit, getattr)
            except Exception:
                bad.append(name)
        if bad:
            out.append(f"torch_autocast.lower_precision_safe_modules: {', '.join(map(repr, bad))} not importable as "
                       "package.Class (DeepSpeed imports each name when the engine starts and stops every rank: "
                       "'Failed to import lower precision safe module'); write full class names such as "
                       "\"torch.nn.Linear\", or remove the key (DeepSpeed's default list)")
    zo = cfg.get("zero_optimization")
    if isinstance(zo, dict) and zo.get("zero_quantized_weights") is True and zo.get("stage") == 3 \
            and device_type != "cpu":  # on the CPU ZeRO++ itself is refused (ds_sections)
        out.append("zero_optimization.zero_quantized_weights: true beside torch_autocast, which DeepSpeed refuses when "
                   "the engine starts ('Cannot enable both torch autocast and zero quantized weights'); set it to "
                   "false or turn torch_autocast off")
    return out


def _pin_memory_flag(cfg: dict, problems: list[str], notes: list[str]) -> None:
    """``cpu_offload_use_pin_memory`` (HF Transformers' 2021 ZeRO-3 example writes it beside ``cpu_offload``):
    DeepSpeed 0.19 keeps it as a deprecated key that sets nothing, so each offload pins by its own ``pin_memory``
    (default true). false is refused where an offload would pin anyway; otherwise a note."""
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict) or "cpu_offload_use_pin_memory" not in zo:
        return
    value = zo["cpu_offload_use_pin_memory"]
    blocks = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}
    pinned = []
    for block, legacy in blocks.items():
        node = zo.get(block)
        if isinstance(node, dict) and str(node.get("device", "none")).lower() in ("cpu", "nvme"):
            if node.get("pin_memory", True) is not False:
                pinned.append(f"{block}.pin_memory")
        elif zo.get(legacy) is True:
            pinned.append(f"{block}.pin_memory")
    if value is False and pinned:
        legacy = [old for old in blocks.values() if zo.get(old) is True]
        block = ' (an offload block {"device": "cpu", "pin_memory": false} in place of ' + ' and '.join(legacy) + ')' \
            if legacy else ""
        problems.append(f"zero_optimization.cpu_offload_use_pin_memory: false, which DeepSpeed 0.19 no longer reads "
                        f"(a deprecated key that sets nothing): its offload would pin host memory anyway "
                        f"({', '.join(pinned)} defaults to true); set {' and '.join(pinned)} to false instead{block}")
        return
    notes.append("zero_optimization.cpu_offload_use_pin_memory: unused: DeepSpeed 0.19 no longer reads it; each "
                 "offload block's pin_memory decides (default true)")


def _fp16_hysteresis(cfg: dict, device_type: str) -> list[str]:
    fp16 = cfg.get("fp16")
    if not isinstance(fp16, dict):
        return []
    on = fp16.get("enabled") is True or (device_type == "cuda" and fp16.get("enabled") == "auto")
    value, dynamic = fp16.get("hysteresis"), fp16.get("loss_scale", 0) in (0, 0.0)
    if not on or not dynamic or isinstance(value, bool) or not isinstance(value, int) or value >= 1:
        return []
    return [f"fp16.hysteresis: {value}, and DeepSpeed's dynamic loss scaler lowers the scale only when its hysteresis "
            f"count is 1: from {value} it counts down at every overflow and never lowers it, so every overflowing step "
            "would be skipped for the rest of the run; set it to 1 (lower the scale at the first overflow) or more, or "
            "remove it (default 2)"]


def _comms_logger_profiles_nothing(cfg: dict, notes: list[str]) -> None:
    """An enabled ``comms_logger`` with ``prof_all`` false and no ``prof_ops``: DeepSpeed times an op only when
    prof_all is on, the op is listed, or its caller passes ``prof=True`` (nothing in DeepSpeed's engine does), so the
    logger records nothing (and dstrain's comm/* metrics stay empty)."""
    block = cfg.get("comms_logger")
    if isinstance(block, dict) and block.get("enabled") is True and block.get("prof_all") is False \
            and not block.get("prof_ops"):
        notes.append("comms_logger: enabled with prof_all false and no prof_ops, so DeepSpeed's comms logger times "
                     "no op (only the listed ones, or all with prof_all true) and logs nothing; set prof_all to true "
                     "or list the ops in prof_ops")


def scalar_checks(cfg: dict, device_type: str) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` for the shapes this module's docstring lists."""
    if not isinstance(cfg, dict):
        return [], []
    problems = _tag_validation(cfg) + _parallel_write(cfg) + _vocabulary_size(cfg)
    problems += _fp16_hysteresis(cfg, device_type) + _aio_values(cfg)
    problems += _autocast_problems(cfg, device_type)
    ac = activation_checkpointing_problem(cfg.get("activation_checkpointing"))
    problems += [ac] if ac else []
    notes: list[str] = []
    _aio_thread_count(cfg, problems, notes)
    _pin_memory_flag(cfg, problems, notes)
    _comms_logger_profiles_nothing(cfg, notes)
    from dstrain.engine.ds_autocast import autocast_mix_checks
    from dstrain.engine.ds_paths import monitor_path_checks
    for more, more_notes in (autocast_mix_checks(cfg, device_type), monitor_path_checks(cfg)):
        problems += more
        notes += more_notes
    return problems, notes
