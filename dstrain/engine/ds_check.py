"""``dstrain check-config`` for DeepSpeed JSON files: dstrain's checks plus DeepSpeed's own parser.

A standalone DeepSpeed JSON has no run config beside it, so the "auto" values are
filled from the file's own explicit numbers where it has them (and dstrain's
defaults otherwise); then the sections go through DeepSpeed's pydantic models in
strict mode, which reject unknown keys (DeepSpeed's default drops some silently).
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

from dstrain.config import TrainConfig
from dstrain.engine.ds_config import (DSConfigError, RunValues, describe_zero, fill_ds_config,
                                      load_ds_json, number_problem, open_weights_dtype, range_problem,
                                      sets_lr_itself)


def _explicit(value):
    return None if isinstance(value, str) and value.strip().lower() == "auto" else value


def _number(cfg: dict, path: str, kind, positive: bool = True):
    """An explicit number at dotted ``path`` of ``cfg`` (None when absent or "auto"); DSConfigError-ready text else."""
    node = cfg
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    value = _explicit(node)
    if value is None:
        return None, None
    ok = isinstance(value, kind) and not isinstance(value, bool) and (value > 0 if positive else value >= 0)
    if not ok and isinstance(value, str):  # a number in quotes
        return None, number_problem(path, value)
    if not ok:
        want = ("a positive integer" if positive else "an integer >= 0") if kind is int else \
            ("a positive number" if positive else "a number >= 0")
        return None, f"{path}: must be {want} or \"auto\", file says {value!r}"
    beyond = range_problem(path, value)  # (a cos_min_ratio above 1 stopped check-config on train.min_lr_ratio)
    return (None, beyond) if beyond else (value, None)


def values_from_file(cfg: dict, hidden_size: int = 1024, world_size: int | None = None) -> RunValues:
    """The run numbers a DeepSpeed JSON implies by itself (defaults where it says "auto").

    The batch keys follow DeepSpeed's derivation (any two of the three with the world
    size). Without ``world_size`` it is inferred from all three keys when the file has
    them, else 1. Numbers of the wrong kind raise DSConfigError naming their key.
    """
    from dstrain.engine.ds_config import file_data_parallel, implied_batch
    t = TrainConfig()
    problems = []
    found = {}
    for path, kind, positive in (("train_batch_size", int, True), ("train_micro_batch_size_per_gpu", int, True),
                                 ("gradient_accumulation_steps", int, True), ("gradient_clipping", (int, float), False),
                                 ("optimizer.params.lr", (int, float), False),
                                 ("optimizer.params.eps", (int, float), True),
                                 ("optimizer.params.weight_decay", (int, float), False),
                                 ("scheduler.params.total_num_steps", int, True),
                                 ("scheduler.params.warmup_num_steps", int, False),
                                 ("scheduler.params.cos_min_ratio", (int, float), False),
                                 ("scheduler.params.warmup_max_lr", (int, float), False)):
        value, problem = _number(cfg, path, kind, positive)
        if problem:
            problems.append(problem)
        found[path] = value
    if problems:
        raise DSConfigError("", problems)
    tb, mb, ga = (found[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps"))
    world = world_size
    if world is None:
        world = max(1, tb // (mb * ga)) if tb and mb and ga else 1
    world = file_data_parallel(cfg, world) if world_size is not None else world  # a file's own sequence parallelism
    micro, accum, _ = implied_batch(cfg, world, mb or t.micro_batch, ga or t.grad_accum)
    params = cfg.get("optimizer", {}).get("params", {}) if isinstance(cfg.get("optimizer"), dict) else {}
    params = params if isinstance(params, dict) else {}
    betas = _explicit(params.get("betas"))
    betas = betas if isinstance(betas, list) and len(betas) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas) else None  # else named by filling
    from dstrain.engine.ds_autocast import autocast_precision
    # the torch_autocast section's, or the weights' dtype DeepSpeed asserts, where bf16 / fp16 leave it open
    precision = autocast_precision(cfg) or open_weights_dtype(cfg) or "fp32"
    for key in ("bf16", "fp16"):
        section = cfg.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            precision = key
    pick = lambda path, default: default if found[path] is None else found[path]  # noqa: E731
    return RunValues(
        micro_batch=micro or mb or t.micro_batch, grad_accum=accum or ga or t.grad_accum, dp_world_size=world,
        # the warm-up peak is the lr where the optimizer block leaves it "auto" (as values_from_file adopts it)
        lr=pick("scheduler.params.warmup_max_lr", t.lr) if sets_lr_itself(cfg) else
        pick("optimizer.params.lr", pick("scheduler.params.warmup_max_lr", t.lr)), betas=tuple(betas or t.betas),
        eps=pick("optimizer.params.eps", t.eps), weight_decay=pick("optimizer.params.weight_decay", t.weight_decay),
        grad_clip=pick("gradient_clipping", t.grad_clip), precision=precision, hidden_size=hidden_size,
        total_steps=pick("scheduler.params.total_num_steps", t.steps),
        warmup_steps=pick("scheduler.params.warmup_num_steps", t.warmup_steps),
        min_lr_ratio=pick("scheduler.params.cos_min_ratio", t.min_lr_ratio))


def _placeholders(node, key: str = ""):
    """A copy with every "auto" replaced by a value of the right kind, for section checks only."""
    if isinstance(node, dict):
        return {k: _placeholders(v, k) for k, v in node.items()}
    if isinstance(node, list):
        return [_placeholders(v, key) for v in node]
    if _explicit(node) is None and node is not None:
        return False if key == "enabled" else 1
    return node


def _strict_sections():
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.runtime.config import HybridEngineConfig
    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config,
            "tensorboard": TensorBoardConfig, "csv_monitor": CSVConfig, "wandb": WandbConfig, "comet": CometConfig,
            "comms_logger": CommsLoggerConfig, "hybrid_engine": HybridEngineConfig, "compile": CompileConfig}


def _numeric_text(value) -> bool:
    """A string that reads as a finite number (``"5e8"``, ``"1e6"``): what a config written by hand quotes."""
    try:
        return isinstance(value, str) and math.isfinite(float(value))
    except ValueError:
        return False


def _neox_precision_type(section: str, loc: tuple, value) -> str | None:
    """GPT-NeoX's ``"fp16": {"type": "bfloat16"}`` (its DeeperSpeed fork trains bf16 from the fp16 section): the
    refusal with the section DeepSpeed reads instead; None for any other unknown key."""
    if section != "fp16" or tuple(loc) != ("type",) or not isinstance(value, str):
        return None
    from dstrain.engine.ds_foreign import neox_dtype
    dtype = neox_dtype(value)
    fix = ('write "bf16": {"enabled": true} in place of the fp16 section' if dtype == "bf16"
           else "remove it (the fp16 section alone trains in fp16)" if dtype == "fp16"
           else "remove it (the bf16 / fp16 sections set the precision)")
    return (f"fp16.type: file says {value!r}, GPT-NeoX's way of choosing the precision in the fp16 section (its "
            f"DeepSpeed fork, DeeperSpeed, reads it); DeepSpeed rejects the key; {fix}")


def _loss_scaler_argument(section: str, loc: tuple, block: dict | None) -> str | None:
    """``"fp16": {"raise_error_at_min_scale": false}``: an argument of DeepSpeed's DynamicLossScaler that its fp16
    section has no key for (projects that set it patch DeepSpeed's get_dynamic_loss_scale_args); the refusal with
    what removing it changes. None for any other unknown key."""
    if section != "fp16" or tuple(loc) != ("raise_error_at_min_scale",):
        return None
    static = isinstance(block, dict) and block.get("loss_scale") not in (0, None, "auto")
    when = (f" (unused here: loss_scale {block.get('loss_scale')!r} is a static scale)" if static else "")
    return ("fp16.raise_error_at_min_scale: an argument of DeepSpeed's dynamic loss scaler, not a key of its fp16 "
            "section, which rejects it (projects that set it patch DeepSpeed's get_dynamic_loss_scale_args); "
            "without it DeepSpeed stops the run when a step overflows at min_loss_scale, where false skips the step "
            f"and goes on{when}; remove it")


#: The fp16 section's dynamic-loss-scaling keys (DeepSpeedFP16Config), none of which its bf16 section has.
_LOSS_SCALING_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                      "min_loss_scale")


def _bf16_loss_scaling_key(section: str, loc: tuple, block: dict | None) -> str | None:
    """fp16 loss-scaling keys in the bf16 section (``"bf16": {"enabled": true, "loss_scale_window": 100}``, as
    configs generated from one fp16/bf16 template write it): DeepSpeed's bf16 section rejects them at start-up. One
    refusal for all of them, saying why they have no place there, at the first ("" at the others); None for any other
    unknown key."""
    name = str(loc[0]) if len(loc) == 1 else ""
    if section not in ("bf16", "bfloat16") or name not in _LOSS_SCALING_KEYS:
        return None
    names = [k for k in (block or {}) if k in _LOSS_SCALING_KEYS] or [name]
    if name != names[0]:
        return ""
    why = "which bf16 does not use (its exponent range needs no loss scale); DeepSpeed's " + section + " section"
    if len(names) == 1:
        return (f"{section}.{name}: file says {json.dumps(block.get(name) if block else None)}, a key of fp16's "
                f"dynamic loss scaling, {why} rejects it and stops at start-up; remove it")
    return (f"{section}.{', '.join(names)}: keys of fp16's dynamic loss scaling, {why} rejects them and stops at "
            "start-up; remove them")


def _apex_opt_level(section: str, loc: tuple, value) -> str | None:
    """Apex AMP's ``opt_level`` in the fp16 section (``"fp16": {"enabled": true, "opt_level": "O2"}``, as configs of
    the Apex era write it): DeepSpeed's fp16 section rejects it at start-up. None for any other key."""
    if section != "fp16" or tuple(loc) != ("opt_level",):
        return None
    return (f"fp16.opt_level: file says {json.dumps(value)}, Apex AMP's optimisation level, which DeepSpeed's fp16 "
            "section does not take (DeepSpeed's fp16 is one mode: fp16 weights with fp32 master copies in the "
            "optimizer, as Apex's O2) and rejects at start-up; remove it")


#: PyTorch's GradScaler / ColossalAI's DynamicGradScaler names for the loss scaler's settings (configs of projects
#: that moved from either write them in DeepSpeed's fp16 section): what DeepSpeed's fp16 section calls each.
_GRAD_SCALER_KEYS = {"init_scale": "initial_scale_power", "initial_scale": "initial_scale_power",
                     "growth_interval": "loss_scale_window", "min_scale": "min_loss_scale", "max_scale": None,
                     "growth_factor": None, "backoff_factor": None}


def _grad_scaler_key(section: str, loc: tuple, value) -> str | None:
    """A GradScaler-style key in the fp16 section (``"fp16": {"initial_scale": 65536, "growth_interval": 1000}``):
    DeepSpeed's fp16 section rejects it at start-up; the refusal names DeepSpeed's key with the value converted (the
    starting scale as a power of two), or why there is none (DeepSpeed's scaler always doubles and halves, and has
    no ceiling). None for any other key."""
    name = str(loc[0]) if len(loc) == 1 else ""
    if section != "fp16" or name not in _GRAD_SCALER_KEYS:
        return None
    head = (f"fp16.{name}: file says {json.dumps(value)}, PyTorch GradScaler's / ColossalAI's name for a loss-scaler "
            "setting, which DeepSpeed's fp16 section does not take (it rejects it at start-up)")
    ours = _GRAD_SCALER_KEYS[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if ours == "initial_scale_power":
        power = math.log2(value) if number else None
        if power is not None and power == int(power) and power >= 0:
            n = int(power)
            return f"{head}; write \"initial_scale_power\": {n} in its place (DeepSpeed starts at 2**{n})"
        return f"{head}; write \"initial_scale_power\": N in its place (DeepSpeed starts at 2**N, a power of two)"
    if ours is not None:
        return f"{head}; write {json.dumps(ours)}: {json.dumps(value)} in its place (the same setting)"
    if name == "max_scale":
        return f"{head}; DeepSpeed's dynamic scaler has no ceiling; remove it"
    same = (name == "growth_factor" and value == 2) or (name == "backoff_factor" and value == 0.5)
    what = ("DeepSpeed's scaler does the same (it doubles the scale after loss_scale_window clean steps and halves it "
            "on an overflow)" if same else "DeepSpeed's scaler always doubles the scale after loss_scale_window clean "
            "steps and halves it on an overflow, a factor its config does not set")
    return f"{head}; {what}; remove it"


def _pydantic_problems(section: str, model, err: Exception, block: dict | None = None) -> list[str]:
    """One line per error of a pydantic ValidationError, named by dotted key (unknown keys with a hint)."""
    from dstrain.engine.ds_classes import deprecated_pair_problem
    errors = getattr(err, "errors", None)
    if errors is None:
        pair = deprecated_pair_problem(section, str(err), block or {})
        return [pair or f"{section}: DeepSpeed rejects it: {' '.join(str(err).split())[:300]}"]
    fields = getattr(model, "model_fields", {})
    known = sorted(set(fields) | {f.alias for f in fields.values() if getattr(f, "alias", None)})
    out = []
    for item in errors():
        loc = ".".join(str(x) for x in (section, *item.get("loc", ())))
        value = item.get("input")
        if item.get("type") == "extra_forbidden":
            name = str(item.get("loc", ("",))[-1])
            close = _close_key(name, known) if len(item.get("loc", ())) == 1 else None
            hint = f" (did you mean {close!r}?)" if close else ""
            neox = (_neox_precision_type(section, item.get("loc", ()), value)
                    or _loss_scaler_argument(section, item.get("loc", ()), block)
                    or _apex_opt_level(section, item.get("loc", ()), value)
                    or _grad_scaler_key(section, item.get("loc", ()), value)
                    or _bf16_loss_scaling_key(section, item.get("loc", ()), block))  # last: its "" means said
            if neox != "":  # "": said with another key of the section
                out.append(neox or _top_level_inside(section, item.get("loc", ()))
                           or f"{loc}: unknown key{hint}; DeepSpeed rejects it")
        elif not item.get("loc"):  # a check of the whole section: its input is the parsed section, not the file's
            msg = str(item.get("msg", "invalid")).removeprefix("Assertion failed, ").removeprefix("Value error, ")
            out.append(f"{loc}: {msg.rstrip('.')}; DeepSpeed rejects it")
        elif item.get("type") == "int_parsing_size":
            out.append(f"{loc}: file says {item.get('input')!r}, more than DeepSpeed's integer holds (it rejects it); "
                       "write a number below 2**63, such as 5e8")
        elif item.get("type") in ("int_parsing", "float_parsing") and _numeric_text(item.get("input")):
            text = item["input"].strip()
            out.append(f"{loc}: file says {item['input']!r}, a number in quotes, which DeepSpeed's parser does not "
                       f"read as a number (it rejects it); write it without the quotes: {text}")
        elif isinstance(value, list):  # the autotuner's way of listing the values to try
            out.append(f"{loc}: file says {json.dumps(value)}, a list where DeepSpeed's parser takes one value (it "
                       "rejects it; a list of values to try is how DeepSpeed's autotuner writes its tuning space, and "
                       "dstrain does not run the autotuner); write one value")
        elif item.get("type") == "int_from_float":
            default = getattr(fields.get(str(item["loc"][-1])), "default", None) if len(item["loc"]) == 1 else None
            such = f", such as {default} (DeepSpeed's default)" if type(default) is int else ""
            out.append(f"{loc}: file says {json.dumps(value)}, a fraction where DeepSpeed's parser takes a whole "
                       f"number (it rejects it); write a whole number{such}")
        else:
            out.append(f"{loc}: {item.get('msg', 'invalid')}, file says {value!r}")
    return out


def _top_level_inside(section: str, loc: tuple) -> str | None:
    """A top-level key written inside a section (``"aio"`` in zero_optimization, as DeepSpeed's NVMe tutorial readers
    often place it): where it belongs, not "unknown key"."""
    from dstrain.engine.ds_files import KNOWN_TOP_LEVEL_KEYS
    if len(loc) != 1 or loc[0] not in KNOWN_TOP_LEVEL_KEYS:
        return None
    return (f"{section}.{loc[0]}: a top-level key, which DeepSpeed reads only at the top level (its {section} parser "
            f"rejects it here); move it out of \"{section}\" to the top level")


def _close_key(name: str, known: list[str]) -> str | None:
    """The key ``name`` most likely meant: a close spelling, else the same words in another order
    (``comm_overlap`` for ``overlap_comm``, which difflib does not find)."""
    import difflib
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return close[0]
    words = sorted(name.lower().split("_"))
    return next((key for key in known if sorted(key.split("_")) == words), None)


def deepspeed_problems(cfg: dict, full_parse: bool = True) -> list[str]:
    """Problems DeepSpeed's own config classes find in a filled config (strict: unknown keys too).

    The pydantic sections are parsed with ``strict=True`` (DeepSpeed's default drops unknown
    keys silently); then the whole config goes through ``DeepSpeedConfig``, which sees a
    world of one rank outside a job: the batch identity (checked by dstrain with the real
    world size) is given to it as one rank's share. DeepSpeed's accelerator choice is left
    as it was (:func:`accelerator_untouched`).
    """
    with accelerator_untouched():
        strict = _strict_sections()
        from deepspeed.utils import logger as ds_logger
        level = ds_logger.level
        ds_logger.setLevel("ERROR")  # its deprecation warnings go to stdout, which a dry run keeps for the command
        try:
            return _parse_problems(cfg, strict, full_parse)
        finally:
            ds_logger.setLevel(level)


def _keys(problem: str) -> set[str]:
    """Dotted keys a problem line names before its first ": " (``"zero_optimization.a, b: ..."`` names two)."""
    head = problem.split(": ", 1)[0]
    first, *rest = head.split(", ")
    section = first.rsplit(".", 1)[0] + "." if "." in first else ""
    return {first, *(section + name for name in rest)}


UNFILLABLE_AUTO = '"auto" is not a value dstrain can fill'


def beside_unfillable(found: list[str], filling: list[str]) -> list[str]:
    """``found`` without the lines about a key the filling already refused as an unfillable "auto": checked as
    the text "auto" or as its placeholder, it would be named twice, once with a value the file does not hold."""
    auto = set().union(*(_keys(p) for p in filling if UNFILLABLE_AUTO in p)) if filling else set()
    return [p for p in found if not _keys(p) & auto]


def merge_problems(found: list[str], parsed: list[str]) -> list[str]:
    """dstrain's problems, then DeepSpeed's parser's about keys dstrain has not already named."""
    named = set().union(*map(_keys, found)) if found else set()
    return found + [p for p in parsed if not _keys(p) & named]


@contextmanager
def accelerator_untouched():
    """Run DeepSpeed code (imports, config parsing) without fixing this process's accelerator.

    DeepSpeed picks its accelerator once per process, on the first ``get_accelerator()``, and
    keeps it in a module global; parsing a ZeRO-3 section calls it. A check run inside a
    training process on a GPU machine must not leave the CPU accelerator there (the engine then
    kept the model on the CPU and NCCL failed with "No backend type associated with device type
    cpu"). On a machine without CUDA, ``DS_ACCELERATOR=cpu`` is set for the duration, as the
    ranks get it; afterwards the variable and DeepSpeed's choice are what they were before.
    """
    import sys

    import torch
    saved = os.environ.get("DS_ACCELERATOR")
    if saved is None and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    module = sys.modules.get("deepspeed.accelerator.real_accelerator")
    chosen = getattr(module, "ds_accelerator", None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
        module = sys.modules.get("deepspeed.accelerator.real_accelerator")
        if module is not None:
            module.ds_accelerator = chosen


def _parse_problems(cfg: dict, strict: dict, full_parse: bool) -> list[str]:
    from deepspeed.runtime.config import DeepSpeedConfig
    problems = []
    for key, model in strict.items():
        section = cfg.get(key)
        if isinstance(section, dict):
            try:
                model(strict=True, **section)
            except Exception as err:  # pydantic's ValidationError: report, do not crash
                problems += _pydantic_problems(key, model, err, section)
    if not problems and full_parse:
        one_rank = dict(cfg)
        mb, ga = cfg.get("train_micro_batch_size_per_gpu"), cfg.get("gradient_accumulation_steps")
        if isinstance(mb, int) and isinstance(ga, int):
            one_rank["train_batch_size"] = mb * ga
        try:
            DeepSpeedConfig(one_rank)
        except Exception as err:
            problems.append(f"DeepSpeed's config parser: {' '.join(str(err).split())[:400]}")
    return problems


def check_ds_file(path: str | Path, device_type: str | None = None, world_size: int | None = None) -> str:
    """Validate a DeepSpeed JSON; return a one-line summary or raise DSConfigError listing every problem.

    ``device_type`` ("cpu" / "cuda", default: this machine's) decides what the device can
    run (fp16 on a CPU); ``world_size`` the batch derivation (default: inferred).
    """
    source = str(path)
    cfg = load_ds_json(path)
    if device_type is None:
        device_type = this_device()
    try:
        values = values_from_file(cfg, world_size=world_size)
    except DSConfigError as err:  # the file's other problems too, all at once
        raise DSConfigError(source, err.problems + _problems_beside(cfg, err.problems, device_type, world_size)) \
            from None
    return _check_values(cfg, values, source, device_type)


def _problems_beside(cfg: dict, named: list[str], device_type: str, world_size: int | None) -> list[str]:
    """The problems of ``cfg`` besides ``named`` (the numbers values_from_file refused: a quoted lr, batch size,
    ...), checked with those keys set to "auto", so that one look at the file names every problem in it."""
    import copy
    keys = set().union(*map(_keys, named))
    rest = copy.deepcopy(cfg)
    for path in keys:
        *parents, last = path.split(".")
        node = rest
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            node[last] = "auto"
    try:
        _check_values(rest, values_from_file(rest, world_size=world_size), "", device_type)
    except DSConfigError as err:
        return [p for p in err.problems if not _keys(p) & keys]
    return []


def _check_values(cfg: dict, values, source: str, device_type: str) -> str:
    """:func:`check_ds_file` from the run numbers on: fill, check every section, parse as DeepSpeed does."""
    from dstrain.engine.ds_classes import run_notes
    from dstrain.engine.ds_sections import section_problems
    try:
        filled, problems = fill_ds_config(cfg, values, source), []
    except DSConfigError as err:
        filled, problems = _placeholders(cfg), list(err.problems)
    found, notes = section_problems(filled, device_type)
    found = beside_unfillable(found, problems)
    notes += run_notes(filled, values.betas)  # the run's length is not known here (run_problems)
    problems = merge_problems(problems + found, deepspeed_problems(filled, full_parse=not problems + found))
    if problems:
        raise DSConfigError(source, problems)
    zero = describe_zero(filled)
    autos = sorted(k for k, v in cfg.items() if _explicit(v) is None and v is not None)
    offload = [name for name in ("optimizer", "param") if zero[f"offload_{name}"]]
    batch = (f"; batch {filled['train_micro_batch_size_per_gpu']} x {filled['gradient_accumulation_steps']} x "
             f"{values.dp_world_size} rank{'s' if values.dp_world_size != 1 else ''}")
    return (f"{source}: valid DeepSpeed config for {device_type}: ZeRO stage {zero['stage']}"
            f"{', offload ' + ' and '.join(offload) if offload else ''}{batch}"
            f"{'; filled by the run: ' + ', '.join(autos) if autos else ''}"
            f"{''.join('; ' + n for n in notes)}")


def this_device() -> str:
    """The ranks' device here: "cuda" where :func:`dstrain.runtime.ranks_use_cuda` says so, else "cpu"."""
    try:
        from dstrain.runtime import ranks_use_cuda
        return "cuda" if ranks_use_cuda() else "cpu"
    except ImportError:  # (no torch)
        return "cpu"
