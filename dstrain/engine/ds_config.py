"""Fill a DeepSpeed JSON's "auto" values from the run, reject what DeepSpeed would get wrong.

DeepSpeed 0.19 silently ignores unknown top-level keys and silently drops a key set to
"auto" inside a pydantic section, so a profile with a typo or an unfilled "auto" trains
with a value nobody chose. This module fills every "auto" it knows from the run's own
values, collects every disagreement between the file and the run, and raises them
together in one :class:`DSConfigError`. Finding and reading the files is
``ds_files.py``'s job (its names are re-exported here).

The module is pure: no deepspeed or torch import.
"""
from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import dataclass

from dstrain.engine.ds_files import (DEEPSPEED_NATIVE_AUTO, KNOWN_TOP_LEVEL_KEYS, NOT_ADOPTED,  # noqa: F401
                                     REMOVED_TOP_LEVEL_KEYS, DSConfigError, ds_configs_dir,
                                     format_override, list_profiles, load_ds_json,
                                     resolve_profile_path, validate_top_level, _top_level_problems)
from dstrain.engine.ds_key_rules import fill_precision_autos, fill_stage_defaults
from dstrain.engine.ds_reading import (AUTO, _WEIGHT_DTYPES, _is_auto, _offloads, _param_dtype_value,  # noqa: F401
                                       describe_zero, open_weights_dtype, param_dtype, pinned_weights,
                                       pinned_weights_dtype, precision_left_open)

PRECISIONS = ("fp32", "bf16", "fp16")
_REL_TOL = 1e-6
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_ADAM_TYPES = {"adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"}
# scheduler type (lower case) -> params filled even when the key is missing, because
# DeepSpeed's defaults for them (1000 warm-up steps, lr 1e-3, ...) are never what the run means
_SCHED_FILL_MISSING = {
    "warmupcosinelr": ("total_num_steps", "warmup_num_steps", "cos_min_ratio"),
    "warmupdecaylr": ("total_num_steps", "warmup_num_steps", "warmup_max_lr"),
    "warmuplr": ("warmup_num_steps", "warmup_max_lr"),
}


class _Problems(list):
    """Problems found while filling, plus the run-config overrides that would fix the disagreements."""

    def __init__(self, *args):
        super().__init__(*args)
        self.fixes: dict[str, str] = {}
        self.unfixable: set[str] = set()
        self.mismatches = 0

    def mismatch(self, text: str, run_key: str | None, value) -> None:
        self.append(text)
        self.mismatches += 1
        if run_key is None:
            return
        shown = format_override(value)
        if self.fixes.get(run_key, shown) != shown:
            self.unfixable.add(run_key)
        self.fixes[run_key] = shown

    def error(self, source: str) -> DSConfigError:
        fixes = {k: v for k, v in self.fixes.items() if k not in self.unfixable}
        return DSConfigError(source, list(self), fixes if not self.unfixable else {}, self.mismatches)


#: Where each value a DeepSpeed JSON may fix lives in the run config.
RUN_KEYS: dict[str, str] = {
    "train_micro_batch_size_per_gpu": "train.micro_batch",
    "gradient_accumulation_steps": "train.grad_accum",
    "gradient_clipping": "train.grad_clip",
    "optimizer.params.lr": "train.lr",
    "optimizer.params.betas": "train.betas",
    "optimizer.params.eps": "train.eps",
    "optimizer.params.weight_decay": "train.weight_decay",
    "scheduler.params.total_num_steps": "train.steps",
    "scheduler.params.warmup_num_steps": "train.warmup_steps",
    "scheduler.params.cos_min_ratio": "train.min_lr_ratio",
    "scheduler.params.warmup_max_lr": "train.lr",
    "bf16.enabled": "deepspeed.precision",
    "fp16.enabled": "deepspeed.precision",
}


@dataclass(frozen=True)
class RunValues:
    """The run's own numbers that a profile's "auto" entries stand for."""

    micro_batch: int
    grad_accum: int
    dp_world_size: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    grad_clip: float
    precision: str  # "fp32" | "bf16" | "fp16"
    hidden_size: int
    total_steps: int
    warmup_steps: int
    min_lr_ratio: float

    def __post_init__(self):
        keys = {"micro_batch": "train.micro_batch", "grad_accum": "train.grad_accum",
                "dp_world_size": "data-parallel world size", "hidden_size": "model hidden size",
                "total_steps": "train.steps"}
        for name, key in keys.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be a non-negative integer, got {self.warmup_steps!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"deepspeed.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if len(tuple(self.betas)) != 2:
            raise ValueError(f"train.betas must be two numbers, got {self.betas!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")

    @property
    def train_batch_size(self) -> int:
        """Global batch: micro-batch x gradient accumulation x data-parallel ranks."""
        return self.micro_batch * self.grad_accum * self.dp_world_size


def _same(file_value, run_value) -> bool:
    """Compare a file value with a run value: ints exactly, floats with a relative tolerance."""
    if isinstance(run_value, (tuple, list)):
        if not isinstance(file_value, (tuple, list)) or len(file_value) != len(run_value):
            return False
        return all(_same(f, r) for f, r in zip(file_value, run_value))
    if isinstance(run_value, bool) or isinstance(file_value, bool):
        return file_value is run_value
    if not isinstance(file_value, (int, float)):
        return False
    if isinstance(run_value, int) and isinstance(file_value, int):
        return file_value == run_value
    return math.isclose(float(file_value), float(run_value), rel_tol=_REL_TOL, abs_tol=1e-12)


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _fill(section: dict, key: str, value, path: str, problems: list[str], *,
          fill_missing: bool, run_text: str | None = None) -> None:
    """Fill ``section[key]`` if "auto" (or missing and ``fill_missing``); else record a mismatch."""
    if key not in section:
        if fill_missing:
            section[key] = value
        return
    current = section[key]
    if _is_auto(current):
        section[key] = value
    elif not _is_number_like(current, value):
        problems.append(number_problem(path, current, pair=isinstance(value, (list, tuple))))
        if isinstance(current, list) and any(_is_auto(x) for x in current):
            section[key] = value  # named once here, not again as leftover "auto"s
    elif (bad := range_problem(path, current)) is not None:
        problems.append(bad)  # no override fixes it: the run refuses such a value too
    elif not _same(current, value):
        text = f"{path}: file says {_fmt(current)}, run gives {run_text or _fmt(value)}"
        if isinstance(problems, _Problems):
            problems.mismatch(text, RUN_KEYS.get(path), current)
        else:
            problems.append(text)


def number_problem(path: str, value, pair: bool = False) -> str:
    """The refusal of a value that is not a number (or two): DeepSpeed would hand a string on as text."""
    if isinstance(value, (list, tuple)) and any(_is_auto(v) for v in value):
        name = path.rsplit(".", 1)[-1]
        return (f"{path}: \"auto\" stands for the whole value (\"{name}\": \"auto\"), not for one of its numbers, "
                f"file says {_fmt(value)}; write \"{name}\": \"auto\" or the numbers")
    quoted = any(isinstance(v, str) for v in (value if isinstance(value, (list, tuple)) else [value]))
    return (f"{path}: must be {'two numbers' if pair else 'a number'} or \"auto\", file says {_fmt(value)}"
            + (" (a string: write the number without quotes; DeepSpeed would pass the text on and fail)"
               if quoted else ""))


#: What a file's number must be where the run (or the optimizer DeepSpeed builds) refuses others.
_RANGES = {"gradient_clipping": (0.0, None, "a number >= 0 (0 turns clipping off)"),
           "optimizer.params.lr": (0.0, None, "a number >= 0"),
           "optimizer.params.eps": (0.0, None, "a number > 0"),
           "optimizer.params.weight_decay": (0.0, None, "a number >= 0 (torch's AdamW and DeepSpeed's Adam refuse "
                                                        "negative ones)"),
           "optimizer.params.betas": (0.0, 1.0, "two numbers in [0, 1)"),
           # DeepSpeed 0.19's WarmupLR / WarmupDecayLR / WarmupCosineLR raise ValueError on 0 ("must be a positive
           # integer"); 1 is the shortest warm-up they take (they run at least 2 internally)
           "scheduler.params.warmup_num_steps": (1, None, "a positive integer (DeepSpeed's warm-up schedulers raise "
                                                          "on 0; 1 is the shortest warm-up)"),
           "scheduler.params.total_num_steps": (1, None, "a positive integer"),
           "scheduler.params.cos_min_ratio": (0.0, 1.0, "a number in [0, 1]"),
           "scheduler.params.warmup_max_lr": (0.0, None, "a number >= 0")}


def range_problem(path: str, value) -> str | None:
    """The refusal of a number outside what ``path`` takes (non-finite, negative, ...); None if it is fine."""
    if path not in _RANGES:
        return None
    low, high, want = _RANGES[path]
    numbers = list(value) if isinstance(value, (list, tuple)) else [value]
    ok = all(math.isfinite(x) and x >= low and (high is None or x <= high) for x in numbers)
    if path == "optimizer.params.eps":
        ok = ok and value > 0
    elif path == "optimizer.params.betas":
        ok = ok and len(numbers) == 2 and all(x < 1.0 for x in numbers)
    elif isinstance(low, int) and not isinstance(low, float):
        ok = ok and isinstance(value, int)
    return None if ok else f"{path}: must be {want} or \"auto\", file says {_fmt(value)}"


def sets_lr_itself(cfg: dict) -> bool:
    """DeepSpeed's WarmupLR / WarmupDecayLR with an explicit ``warmup_max_lr``: they set the optimizer's
    learning rate from the first step (warmup_min_lr up to warmup_max_lr), so ``optimizer.params.lr`` is unused."""
    sched = cfg.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    return (isinstance(params, dict) and str(sched.get("type", "")).lower() in ("warmuplr", "warmupdecaylr")
            and _is_number_like(params.get("warmup_max_lr"), 0.0))


def _is_number_like(file_value, run_value) -> bool:
    """A file value of the same kind as the run's (so an override can carry it)."""
    if isinstance(run_value, (list, tuple)):
        return isinstance(file_value, (list, tuple)) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in file_value)
    return isinstance(file_value, (int, float)) and not isinstance(file_value, bool)


def file_data_parallel(cfg: dict, dp: int) -> int:
    """The data-parallel ranks DeepSpeed divides the file's batch keys among: a file's own ``sequence_parallel_size``
    (refused by the section checks: dstrain splits sequences with --parallel.sp) takes its ranks out of data
    parallelism (DeepSpeedConfig's world size is the ranks / sequence_parallel_size), so keys that agree there are
    not called a disagreement beside that refusal."""
    sp = cfg.get("sequence_parallel_size") if isinstance(cfg, dict) else None
    return dp // sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 and dp % sp == 0 else dp


def implied_batch(cfg: dict, dp: int, micro_batch: int, grad_accum: int) -> tuple[int | None, int | None, list[str]]:
    """The micro-batch and gradient accumulation a file's explicit batch keys imply on ``dp`` ranks.

    DeepSpeed's rule: any two of train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps fix the third with the data-parallel world size; a lone
    train_batch_size or micro-batch leaves the other to the run (DeepSpeed itself would take
    gradient accumulation 1). Returns ``(micro, accum, problems)``; ``None`` where the file
    leaves the value to the run, problems for keys that cannot agree on any run.
    """
    explicit = {k: cfg[k] for k in _BATCH_KEYS if k in cfg and not _is_auto(cfg[k])}
    problems = []
    for key, value in explicit.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{key}: must be a positive integer or \"auto\", file says {_fmt(value)}")
    if problems:
        return None, None, problems
    tb = explicit.get("train_batch_size")
    mb = explicit.get("train_micro_batch_size_per_gpu")
    ga = explicit.get("gradient_accumulation_steps")
    ranks = f"{dp} data-parallel rank{'s' if dp != 1 else ''}"
    if tb is not None and mb is not None and ga is not None:
        if tb != mb * ga * dp:
            problems.append(
                f"batch keys disagree among themselves: train_batch_size {tb} != train_micro_batch_size_per_gpu "
                f"{mb} x gradient_accumulation_steps {ga} x {dp} data-parallel ranks = {mb * ga * dp} "
                "(DeepSpeed asserts this at start-up; set one of them to \"auto\")")
        return mb, ga, problems
    if tb is not None and mb is not None:
        if tb % (mb * dp):
            problems.append(f"train_batch_size {tb} is not a multiple of train_micro_batch_size_per_gpu {mb} x "
                            f"{ranks} (so no gradient_accumulation_steps fits)")
            return mb, None, problems
        return mb, tb // (mb * dp), problems
    if tb is not None and ga is not None:
        if tb % (ga * dp):
            problems.append(f"train_batch_size {tb} is not a multiple of gradient_accumulation_steps {ga} x "
                            f"{ranks} (so no micro-batch fits)")
            return None, ga, problems
        return tb // (ga * dp), ga, problems
    if tb is not None:
        if tb % dp:
            problems.append(f"train_batch_size {tb} is not a multiple of the {ranks} (DeepSpeed splits it evenly "
                            f"over them and stops at start-up); set it to a multiple of {dp} or \"auto\", or run on "
                            f"a number of data-parallel ranks that divides {tb}")
            return None, None, problems
        per_rank = tb // dp
        if per_rank == micro_batch * grad_accum:
            return micro_batch, grad_accum, problems
        accum = grad_accum if per_rank % grad_accum == 0 else 1
        return per_rank // accum, accum, problems
    return mb, ga, problems


def _fill_batch(cfg: dict, v: RunValues, problems: list[str]) -> None:
    mb, ga, found = implied_batch(cfg, v.dp_world_size, v.micro_batch, v.grad_accum)
    problems += found
    if found:
        return
    explicit = [k for k in _BATCH_KEYS if k in cfg and not _is_auto(cfg[k])]
    said = ", ".join(f"{k} {cfg[k]}" for k in explicit)
    on = f" on {v.dp_world_size} data-parallel rank{'s' if v.dp_world_size != 1 else ''}"
    for key, implied, run in (("train_micro_batch_size_per_gpu", mb, v.micro_batch),
                              ("gradient_accumulation_steps", ga, v.grad_accum)):
        if implied is None or implied == run:
            continue
        if key in explicit:
            text = f"{key}: file says {implied}, run gives {run}"
        else:
            text = f"{key}: file implies {implied} ({said}{on}), run gives {run}"
        if isinstance(problems, _Problems):
            problems.mismatch(text, RUN_KEYS[key], implied)
        else:
            problems.append(text)
    cfg["train_batch_size"] = v.train_batch_size
    cfg["train_micro_batch_size_per_gpu"] = v.micro_batch
    cfg["gradient_accumulation_steps"] = v.grad_accum


def _fill_optimizer(cfg: dict, v: RunValues, problems: list[str]) -> None:
    opt = cfg.get("optimizer")
    if opt is None:
        return
    if not isinstance(opt, dict):
        problems.append(f"optimizer: must be an object, file says {_fmt(opt)}"  # a bare name: say how
                        + (f"; write {{\"type\": {_fmt(opt)}}}" if isinstance(opt, str) else ""))
        return
    kind = str(opt.get("type", "")).lower()
    is_adam = kind in _ADAM_TYPES
    params = opt.get("params")
    if params is None and is_adam:
        params = opt["params"] = {}
    if not isinstance(params, dict):
        return
    run = {"lr": v.lr, "betas": [float(b) for b in v.betas], "eps": v.eps, "weight_decay": v.weight_decay}
    for key, value in run.items():
        if key == "lr" and sets_lr_itself(cfg) and _is_number_like(params.get("lr"), 0.0) \
                and not _same(params["lr"], cfg["scheduler"]["params"]["warmup_max_lr"]):
            continue  # unused: the scheduler's warmup_max_lr is the run's lr (compared there)
        # lr always matters; the Adam family also silently defaults the others (AdamATan2: all but eps)
        missing = is_adam or key == "lr" or (kind == "adamatan2" and key != "eps")
        _fill(params, key, value, f"optimizer.params.{key}", problems, fill_missing=missing)


def _fill_scheduler(cfg: dict, v: RunValues, problems: list[str]) -> None:
    sched = cfg.get("scheduler")
    if sched is None:
        return
    if not isinstance(sched, dict):
        problems.append(f"scheduler: must be an object, file says {_fmt(sched)}"  # a bare name: say how
                        + (f"; write {{\"type\": {_fmt(sched)}}}" if isinstance(sched, str) else ""))
        return
    params = sched.get("params")
    fill_missing = _SCHED_FILL_MISSING.get(str(sched.get("type", "")).lower(), ())
    if params is None and fill_missing:
        params = sched["params"] = {}
    if not isinstance(params, dict):
        return
    # DeepSpeed's warm-up schedulers need warmup_num_steps >= 1 (and use at least 2 internally)
    run = {"total_num_steps": v.total_steps, "warmup_num_steps": max(1, v.warmup_steps),
           "cos_min_ratio": v.min_lr_ratio, "warmup_max_lr": v.lr}
    for key, value in run.items():
        _fill(params, key, value, f"scheduler.params.{key}", problems, fill_missing=key in fill_missing)
    for key, default in (("warmup_min_ratio", 0.0), ("warmup_min_lr", 0.0)):
        if _is_auto(params.get(key)):
            params[key] = default
        elif _is_number_like(params.get(key), 0.0) and params[key] < 0:  # DeepSpeed checks neither
            problems.append(f"scheduler.params.{key}: must be a number >= 0 or \"auto\", file says "
                            f"{_fmt(params[key])} (the warm-up starts from it: DeepSpeed would set a negative learning "
                            "rate, training uphill, for the first steps)")


def _fill_precision(cfg: dict, v: RunValues, problems: list[str]) -> None:
    bf16_key = "bf16" if "bf16" in cfg or "bfloat16" not in cfg else "bfloat16"
    if all(isinstance(cfg.get(k), dict) and cfg[k].get("enabled") is True for k in (bf16_key, "fp16")):
        problems.append(f"{bf16_key}.enabled, fp16.enabled: both true; DeepSpeed allows only one (it asserts at "
                        "start-up): set one of them to false")
        return
    said = {}  # what the file itself sets bf16 / fp16 "enabled" to
    from dstrain.engine.ds_autocast import autocast_precision, autocast_precision_problem
    by_autocast = autocast_precision(cfg)  # the file's torch_autocast section gives the run its bf16 (fp32 weights)
    for key, kind in ((bf16_key, "bf16"), ("fp16", "fp16")):
        want = v.precision == kind
        section = cfg.get(key)
        if section is None:
            if want and by_autocast != kind:
                cfg[key] = {"enabled": True}
            continue
        if not isinstance(section, dict):
            problems.append(f"{key}: must be an object, file says {_fmt(section)}")
            continue
        current = section.get("enabled", AUTO)
        said[kind] = current
        if _is_auto(current):
            section["enabled"] = want
        elif not isinstance(current, bool):
            problems.append(f"{key}.enabled: must be true, false or \"auto\", file says {_fmt(current)}")
        elif current != want and not (current is False and kind == by_autocast):  # (False beside the section
            # that gives the run its bf16: the autocast form over fp32 weights, as dstrain's own plan writes it)
            text = f"{key}.enabled: file says {_fmt(current)}, run precision is {v.precision}"
            if isinstance(problems, _Problems) and current:
                problems.mismatch(text, "deepspeed.precision", kind)
            else:
                problems.append(text)
    on = [kind for kind, value in said.items() if value is True]
    fixed = on[0] if on else "fp32" if said and all(value is False for value in said.values()) else None
    _check_param_dtype(cfg, v, problems, fixed)
    if (text := autocast_precision_problem(cfg, v.precision)) is not None:
        if isinstance(problems, _Problems):
            problems.mismatch(text, "deepspeed.precision", by_autocast)
        else:
            problems.append(text)
    pinned, key = pinned_weights(cfg)
    if key == "data_types.grad_accum_dtype" and not fixed and any(_is_auto(x) for x in said.values()) \
            and pinned != v.precision and isinstance(problems, _Problems):
        # the file leaves the precision open: the run's must be the dtype stage 0 accumulates in
        problems.mismatch(f"{key}: file says {_fmt(cfg['data_types']['grad_accum_dtype'])}, run precision is "
                          f"{v.precision} (at ZeRO stage 0 DeepSpeed accumulates only in the weights' dtype)",
                          "deepspeed.precision", pinned)


def _check_param_dtype(cfg: dict, v: RunValues, problems: list[str], fixed: str | None) -> None:
    """``data_types.param_dtype`` must be the weights' dtype: DeepSpeed asserts it at start-up. ``fixed`` is the
    weights' precision when the file's bf16 / fp16 sections decide it: a disagreement is then the file's own."""
    value = _param_dtype_value(cfg)
    if value is None:
        return
    kind = _WEIGHT_DTYPES.get(str(value).lower())
    if kind is None:
        problems.append(f"data_types.param_dtype: must be one of fp32, bf16, fp16, file says {_fmt(value)}")
    elif kind != (fixed or v.precision):
        text = (f"data_types.param_dtype: file says {_fmt(value)}, "
                + (f"its bf16 / fp16 sections make the weights {fixed}" if fixed
                   else f"run precision is {v.precision}") + " (DeepSpeed asserts they match at start-up)")
        if isinstance(problems, _Problems) and not fixed:
            problems.mismatch(text, "deepspeed.precision", kind)
        else:
            problems.append(text)


@functools.cache
def zero_defaults(block: str = "") -> dict[str, object]:
    """DeepSpeed's default of each ``zero_optimization`` key (``block``: of its ``offload_param`` or
    ``offload_optimizer`` block) with a plain (number / bool) default, by name and alias: what its parser
    uses for a key set to "auto" (it drops "auto" values). Callers only read it."""
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                           DeepSpeedZeroOffloadParamConfig)
    model = {"": DeepSpeedZeroConfig, "offload_param": DeepSpeedZeroOffloadParamConfig,
             "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig}[block]
    out = {}
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, (bool, int, float)) and name != "stage":
            out.update({key: default for key in (name, field.alias) if key})
    return out


def _fill_zero(cfg: dict, v: RunValues, problems: list[str]) -> None:
    zo = cfg.get("zero_optimization")
    if zo is None or isinstance(zo, bool):
        return
    if not isinstance(zo, dict):
        problems.append(f"zero_optimization: must be an object, file says {_fmt(zo)}")
        return
    h = v.hidden_size
    sizes = {"reduce_bucket_size": h * h, "allgather_bucket_size": h * h,
             "stage3_prefetch_bucket_size": int(0.9 * h * h), "prefetch_bucket_size": int(0.9 * h * h),
             "stage3_param_persistence_threshold": 10 * h, "param_persistence_threshold": 10 * h}
    for key, value in sizes.items():
        if _is_auto(zo.get(key)):
            zo[key] = value
    autos = [key for key, value in zo.items() if _is_auto(value) and key != "stage"]
    defaults = zero_defaults() if autos else {}
    for key in autos:  # DeepSpeed's parser drops "auto": its default applies (OpenRLHF writes these)
        if key in defaults:
            zo[key] = defaults[key]
    for name in ("offload_param", "offload_optimizer"):  # so do its offload blocks' (buffer_size "auto": 1e8)
        block = zo.get(name)
        if isinstance(block, dict) and any(map(_is_auto, block.values())):
            plain = zero_defaults(name)
            block.update({key: plain[key] for key, value in block.items() if _is_auto(value) and key in plain})
    stage = zo.get("stage", 0)
    fill_stage_defaults(zo, stage)  # overlap_comm "auto": DeepSpeed's default is stage == 3
    if _is_auto(stage):  # a file's stage is its own choice; dstrain chooses only with its own profiles
        zo["stage"] = None  # reported here, not again as a leftover "auto"
        problems.append("zero_optimization.stage: \"auto\" is not filled from a DeepSpeed JSON (DeepSpeed "
                        "would silently run stage 0); set 0, 1, 2 or 3, or drop --deepspeed.profile "
                        "(deepspeed.profile=auto) to let dstrain choose the stage, offload and precision")
        return
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        problems.append(f"zero_optimization.stage: must be 0, 1, 2 or 3, file says {_fmt(stage)}")
        return
    if isinstance(zo.get("zenflow"), dict) and v.grad_accum > 1:
        problems.append(f"zero_optimization.zenflow: ZenFlow updates the selected parameters at every micro-batch "
                        f"and replaces gradient_accumulation_steps by its update_interval, so the run's gradient "
                        f"accumulation {v.grad_accum} would not happen; use gradient accumulation 1 (a larger "
                        "micro-batch)")
    hpz = zo.get("zero_hpz_partition_size")
    if stage == 3 and isinstance(hpz, int) and not isinstance(hpz, bool) and hpz > 1:
        # DeepSpeed groups the ranks in blocks of min(hpz, world size) and asserts that they divide the world
        group, world = min(hpz, v.dp_world_size), v.dp_world_size
        if world % group:
            fits = [d for d in range(2, group) if world % d == 0]
            problems.append(f"zero_optimization.zero_hpz_partition_size: {hpz} groups the {world} data-parallel ranks "
                            f"in blocks of {group}, which do not divide them (DeepSpeed asserts it when it builds the "
                            f"ZeRO-3 parameter groups); set "
                            + (f"{fits[-1]} (a divisor of {world}, as the GPUs per node are) or " if fits else "")
                            + "1 (off)")
    if stage < 3 and _offloads(zo, "offload_param", "cpu_offload_param"):
        problems.append(f"zero_optimization.offload_param: parameter offload is only valid with ZeRO stage 3, "
                        f"file has stage {stage} (DeepSpeed would silently keep parameters on the device); set "
                        f"\"stage\": 3, or remove offload_param")


def _leftover_autos(node, path: str, found: list[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _leftover_autos(value, f"{path}.{key}" if path else str(key), found)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _leftover_autos(value, f"{path}[{i}]", found)
    elif _is_auto(node) and path not in DEEPSPEED_NATIVE_AUTO:
        found.append(path)


def fill_ds_config(template: dict, values: RunValues, source: str) -> dict:
    """Return a filled deep copy of ``template``; every problem is raised together in one DSConfigError.

    Fills "auto" (and a missing batch key, gradient_clipping, Adam params and the warm-up
    scheduler's step counts) from ``values``: the three batch keys, gradient_clipping,
    optimizer lr/betas/eps/weight_decay, scheduler total_num_steps / warmup_num_steps (at
    least 1, DeepSpeed refuses 0) / cos_min_ratio / warmup_max_lr (= lr) / warmup_min_ratio
    and warmup_min_lr (0.0), bf16/fp16 ``enabled`` from ``values.precision`` (adding the
    section when the run needs it), and ZeRO bucket sizes from the hidden size h:
    reduce/allgather buckets h*h, stage3 prefetch 0.9*h*h, stage3 persistence threshold 10*h.

    Rejected: explicit values that disagree with the run (floats with a relative tolerance;
    the batch keys as DeepSpeed derives them, any two of the three with the data-parallel
    size: :func:`implied_batch`), explicit batch keys that disagree among themselves, "auto"
    anywhere else (named by dotted path, since DeepSpeed would silently drop it), unknown
    top-level keys, offload_param below stage 3, and fp16 with bf16. When every problem is
    a disagreement the error is one line ending with the overrides that remove them
    (``DSConfigError.fixes``).
    """
    if not isinstance(template, dict):
        raise DSConfigError(source, f"config must be a JSON object, got {type(template).__name__}")
    cfg = copy.deepcopy(template)
    problems = _Problems(_top_level_problems(cfg))
    _fill_batch(cfg, values, problems)
    _fill(cfg, "gradient_clipping", float(values.grad_clip), "gradient_clipping", problems, fill_missing=True)
    _fill_optimizer(cfg, values, problems)
    _fill_scheduler(cfg, values, problems)
    _fill_precision(cfg, values, problems)
    _fill_zero(cfg, values, problems)
    fill_precision_autos(cfg)  # after _fill_precision: "enabled" is the run's
    leftovers: list[str] = []
    _leftover_autos({k: v for k, v in cfg.items() if k in KNOWN_TOP_LEVEL_KEYS}, "", leftovers)  # others: named
    from dstrain.engine.ds_unread import beside_type
    leftovers = [p for p in leftovers if not beside_type(p)]  # named by ds_unread
    problems += [f"{p}: \"auto\" is not a type dstrain chooses; name one, or remove the {p[:-5]} block (the run's "
                 "own is used then)" if p in ("optimizer.type", "scheduler.type") else
                 f"{p}: \"auto\" is read by DeepSpeed as its default, \"none\" (no offload), without a word; write "
                 "\"cpu\" or \"none\"" if p.endswith((".offload_param.device", ".offload_optimizer.device")) else
                 f"{p}: \"auto\" is not a value dstrain can fill (DeepSpeed itself keeps the text \"auto\"); set it explicitly"
                 for p in leftovers]
    if problems:
        raise problems.error(source)
    return cfg
