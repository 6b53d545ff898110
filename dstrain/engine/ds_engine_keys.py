"""Keys DeepSpeed's config parser accepts and its engine trips over later, when it starts or steps.

DeepSpeed 0.19 stores these as they are written and acts on them only inside
``deepspeed.initialize``, ``engine.step()`` or ``load_checkpoint``: a ``log_level`` it
cannot name, a ``datastates_ckpt`` block (any value but false turns DataStates
checkpointing on), ``managed_gradient_accumulation: false`` (the caller then owns the
accumulation boundary), ``checkpoint.load_universal`` (every resume then expects a
universal checkpoint), ``zero_optimization.legacy_stage1``, ``compute_grad_norm: false``
beside clipping or offload, torch optimizers and schedulers that cannot run under DeepSpeed's step (LBFGS,
SparseAdam, ReduceLROnPlateau, ``capturable`` on the CPU), a warm-up type its
schedulers replace by the log curve with only a warning, LRRangeTest / OneCycle step sizes
they raise on, a ``last_batch_iteration`` that starts a fresh run partway into the schedule,
``weight_quantization`` (inference-only, or acting only inside ``zero.Init``), torch schedulers
whose arguments are Python objects, and (:func:`run_length_problems`, called by
``ds_preflight.check_run``) a torch OneCycleLR shorter than the run. Each is refused here, by key,
with the fix; :func:`engine_key_problems` is called by ``ds_sections.section_problems``.
"""
from __future__ import annotations

import difflib
import importlib.util

from dstrain.engine.ds_reading import DEEPSPEED_OPTIMIZER_TYPES, _is_auto, describe_zero

#: DeepSpeed's log levels (deepspeed.utils.logging.log_levels), and the numbers of Python's logging for them.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_LEVEL_NUMBERS = {10: "debug", 20: "info", 30: "warning", 40: "error", 50: "critical"}

#: DeepSpeed's schedulers that read ``warmup_type`` (anything but these two words becomes "log", with a warning).
_WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_WARMUP_TYPES = ("log", "linear")

#: torch.optim classes that cannot run under DeepSpeed's ``step()`` with dstrain's models, and why.
_UNRUNNABLE_TORCH_OPTIMIZERS = {
    "LBFGS": "re-evaluates the loss through a closure that DeepSpeed's step() never passes, and refuses the "
             "decay / no-decay parameter groups the optimizer is built with ('LBFGS doesn't support per-parameter "
             "options' on every rank)",
    "SparseAdam": "takes only sparse gradients, and dstrain's models produce dense ones (torch raises at the first "
                  "step)",
}


def _log_level_problem(cfg: dict) -> str | None:
    level = cfg.get("log_level")
    if level is None or (isinstance(level, str) and level.lower() in LOG_LEVELS):
        return None
    if isinstance(level, int) and not isinstance(level, bool) and level in _LEVEL_NUMBERS:
        fix = _LEVEL_NUMBERS[level]
    else:
        close = difflib.get_close_matches(str(level).lower(), LOG_LEVELS, n=1, cutoff=0.6)
        fix = close[0] if close else "info"
    return (f"log_level: DeepSpeed takes one of {', '.join(LOG_LEVELS)} (as text), file says {level!r} (its engine "
            f"raises on any other value when it starts, on every rank); write \"{fix}\"")


def _datastates_problem(cfg: dict) -> str | None:
    """DeepSpeed's test is ``param_dict.get("datastates_ckpt", False) is not False``: a block (even one saying
    ``"enabled": false``) turns DataStates on, and without the package every rank stops in initialize."""
    if "datastates_ckpt" not in cfg or cfg["datastates_ckpt"] is False:
        return None
    if importlib.util.find_spec("datastates") is not None:
        return None
    block = cfg["datastates_ckpt"]
    said = " (an \"enabled\": false inside the block does not turn it off)" \
        if isinstance(block, dict) and block.get("enabled") in (False, "false") else ""
    return ("datastates_ckpt: DeepSpeed turns DataStates asynchronous checkpointing on for any value but false"
            f"{said}, and the datastates package is not installed here (every rank would stop when the engine "
            "starts); remove the key or set \"datastates_ckpt\": false")


def _load_universal_problem(cfg: dict) -> str | None:
    """``checkpoint.load_universal: true`` makes DeepSpeed read every checkpoint as a universal one; dstrain saves
    DeepSpeed's ordinary ones, so the first resume stopped on every rank ('zero/optimizer_state.pt ... missing')."""
    ck = cfg.get("checkpoint")
    if not isinstance(ck, dict) or ck.get("load_universal") in (None, False):
        return None
    return ("checkpoint.load_universal: DeepSpeed would load every checkpoint as a universal one, and dstrain saves "
            "ordinary ones (a resume stops on every rank: 'optimizer_state.pt containing optimizer global state is "
            "missing'); dstrain converts a checkpoint itself when the number of ranks changes; remove it or set "
            "it false")


def _managed_accumulation_problem(cfg: dict) -> str | None:
    value = cfg.get("managed_gradient_accumulation", True)
    if value is None or isinstance(value, str) or value:  # quoted text: refused as a quoted flag (ds_sections)
        return None
    return ("managed_gradient_accumulation: false hands the accumulation boundary to the training loop (DeepSpeed "
            "then updates at every step() call), while dstrain's trainers let DeepSpeed count the "
            "gradient_accumulation_steps micro-batches: every update would be taken for a skipped one and no step "
            "logged; remove the key (or set it true) and set the accumulation with --train.grad_accum=N")


def _grad_norm_problems(cfg: dict) -> list[str]:
    """``zero_optimization.compute_grad_norm: false`` (ZeRO-1/2: skip the global norm), where DeepSpeed's ZeRO
    optimizer raises when the engine starts: with clipping, optimizer offload, ZenFlow, and at stage 1 with bf16
    weights accumulating in fp32."""
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict) or zo.get("compute_grad_norm", True) is not False:
        return []
    stage = zo.get("stage", 0)
    if stage not in (1, 2):
        return []  # DeepSpeed's own parser rejects it at other stages (named by the strict parse)
    clip = cfg.get("gradient_clipping", 1.0)  # DeepSpeed's default where the file leaves it out
    out = []
    if not _is_auto(clip) and isinstance(clip, (int, float)) and not isinstance(clip, bool) and clip > 0:
        out.append(f"zero_optimization.compute_grad_norm: false needs \"gradient_clipping\": 0 (clipping at "
                   f"{clip:g} needs the norm it turns off; DeepSpeed's ZeRO optimizer raises when the engine starts); "
                   "set \"gradient_clipping\": 0 in the file (with --train.grad_clip=0), or remove compute_grad_norm")
    offload = describe_zero(cfg)["offload_optimizer"]
    if offload:
        out.append("zero_optimization.compute_grad_norm: false does not work with optimizer offload (DeepSpeed's ZeRO "
                   "optimizer raises when the engine starts); remove compute_grad_norm or the offload")
    if zo.get("zenflow") is not None:
        out.append("zero_optimization.compute_grad_norm: false does not work with ZenFlow (DeepSpeed's ZeRO optimizer "
                   "raises when the engine starts); remove compute_grad_norm")
    dtypes = cfg.get("data_types") if isinstance(cfg.get("data_types"), dict) else {}
    bf16 = isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled") is True
    accum = str(dtypes.get("grad_accum_dtype", "")).lower() in ("fp32", "float32", "float", "torch.float32")
    if stage == 1 and bf16 and accum and not offload:
        out.append("zero_optimization.compute_grad_norm: false does not work at ZeRO stage 1 with bf16 weights and "
                   "fp32 gradient accumulation (DeepSpeed raises when the engine starts); remove compute_grad_norm "
                   "or data_types.grad_accum_dtype")
    return out


def _legacy_stage1(cfg: dict) -> list[str]:
    """``legacy_stage1: true`` (templates of DeepSpeed < 0.5.9): its ZeRO set-up raises at stages 1-3."""
    zo = cfg.get("zero_optimization")
    if not isinstance(zo, dict) or zo.get("legacy_stage1") is not True or zo.get("stage", 0) not in (1, 2, 3):
        return []
    return ["zero_optimization.legacy_stage1: true asks for the ZeRO stage 1 of DeepSpeed < 0.5.9, which DeepSpeed "
            "0.19 no longer has (it raises when the engine starts, on every rank); remove it or set it false (the "
            "current stage 1 partitions the optimizer states the same way)"]


def _torch_optimizer_problems(cfg: dict, device_type: str) -> list[str]:
    opt = cfg.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        return []
    name = opt["type"]
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    if name in _UNRUNNABLE_TORCH_OPTIMIZERS:
        return [f"optimizer.type: torch.optim.{name} {_UNRUNNABLE_TORCH_OPTIMIZERS[name]}; use \"AdamW\" (or "
                "remove the optimizer block: dstrain then builds AdamW from the run config)"]
    if device_type != "cpu" or params.get("capturable") is not True:
        return []
    offload = describe_zero(cfg)["offload_optimizer"]
    kind = name.lower()
    torch_class = (kind in ("adam", "adamw") and params.get("torch_adam") is True) or \
        kind not in DEEPSPEED_OPTIMIZER_TYPES
    if offload or not torch_class:
        return []  # DeepSpeed's own classes do not take it (named by ds_sections)
    return ["optimizer.params.capturable: true keeps torch's optimizer step on a GPU (CUDA graphs); on the CPU "
            "torch asserts at the first step ('params and state_steps must be on supported devices'); remove it"]


def _step_size_problems(name: str, params: dict) -> list[str]:
    """The step sizes DeepSpeed 0.19's LRRangeTest / OneCycle check only when the engine builds them (a ValueError
    on every rank in initialize): ``lr_range_test_step_size`` a positive int (2.0 fails too), ``cycle_first_step_size``
    > 0 and ``cycle_second_step_size`` >= 0."""
    if name == "LRRangeTest":
        wants = {"lr_range_test_step_size": (1, "a positive integer")}
    elif name == "OneCycle":
        wants = {"cycle_first_step_size": (0, "a number > 0"), "cycle_second_step_size": (-1, "a number >= 0")}
    else:
        return []
    out = []
    for key, (low, want) in wants.items():
        value = params.get(key)
        if value is None or _is_auto(value):
            continue  # DeepSpeed's default, or a leftover "auto" (named by the checks of "auto")
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if name == "OneCycle" and isinstance(value, str):
            try:
                number = float(value)  # DeepSpeed's OneCycle reads the sizes through float()
            except ValueError:
                number = None
        if name == "LRRangeTest":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        else:
            ok = number is not None and number > 0 if low == 0 else number is not None and number >= 0
        if ok:
            continue
        whole = number is not None and float(number).is_integer() and number >= max(low, 1)
        fix = f"write {int(number)}" if whole else f"write {want} (the number of steps per lr change)"
        out.append(f"scheduler.params.{key}: {name} needs {want}, file says {value!r} (DeepSpeed raises "
                   f"ValueError when the engine builds the scheduler, on every rank); {fix}")
    return out


def _weight_quantization_problems(cfg: dict) -> list[str]:
    """DeepSpeed's ``weight_quantization`` block (ZeRO-Inference's recipes). ``post_init_quant`` is read only by its
    inference helper ``_init_group_wise_weight_quantization``: the training engine ignores it. ``quantized_initialization``
    (read whatever ``enabled`` says) acts only inside ``zero.Init``: where dstrain builds the model without it the
    weights train unquantized, and under it on the CPU the first step's gradient was non-finite on every rank."""
    block = cfg.get("weight_quantization")
    if not isinstance(block, dict):
        return []
    out = []
    if block.get("quantized_initialization"):
        out.append("weight_quantization.quantized_initialization: DeepSpeed quantizes the weights only inside zero.Init "
                   "(without it they train unquantized, not as the file says; with it, on the CPU, the first step's "
                   "gradient is non-finite); remove it (or the weight_quantization block) for training")
    if block.get("post_init_quant") and block.get("enabled", True) not in (False, "false"):
        out.append("weight_quantization.post_init_quant: read only by DeepSpeed's inference quantization, never by "
                   "the training engine (the weights would train unquantized, not as the file says); remove it (or "
                   "the weight_quantization block) for training")
    return out


#: torch.optim.lr_scheduler classes whose arguments are Python objects a JSON file cannot hold (DeepSpeed passes the
#: params as written: a string lr_lambda is called, scheduler names are stepped).
_OBJECT_SCHEDULERS = {"LambdaLR": "lr_lambda", "MultiplicativeLR": "lr_lambda", "SequentialLR": "schedulers",
                      "ChainedScheduler": "schedulers"}


def run_length_problems(cfg: dict, steps: int, per_step: int = 1) -> list[str]:
    """torch's OneCycleLR raises ('Tried to step N times') at the first step past its total_steps (or epochs x
    steps_per_epoch): a file shorter than the run stopped every rank partway, after its checkpoints. The
    scheduler counts optimizer updates: ``per_step`` of them per run step (GRPO's task.num_iterations)."""
    sched = cfg.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) and isinstance(sched.get("params"), dict) else {}
    if not isinstance(sched, dict) or sched.get("type") != "OneCycleLR":
        return []
    updates = steps * per_step
    total = params.get("total_steps")
    if total is None and all(isinstance(params.get(k), int) for k in ("epochs", "steps_per_epoch")):
        total, key = params["epochs"] * params["steps_per_epoch"], "epochs x steps_per_epoch"
    else:
        key = "total_steps"
    if total is None:
        return ["scheduler.params.total_steps: torch's OneCycleLR needs total_steps (or epochs and steps_per_epoch; "
                f"it raises when the engine builds it, on every rank); write \"total_steps\": {updates}"]
    if isinstance(total, int) and not isinstance(total, bool) and total < updates:
        named = "total_steps" if key == "total_steps" else "epochs"
        run = (f"the run {steps}" if per_step == 1 else
               f"the run's {steps} steps x {per_step} optimizer updates (task.num_iterations) = {updates}")
        where = "step" if per_step == 1 else "optimizer update"
        shorter = f", or run --train.steps={total // per_step}" if total >= per_step else ""
        return [f"scheduler.params.{named}: torch's OneCycleLR runs {total} steps ({key}) and {run} (it "
                f"raises 'Tried to step {total + 1} times' at {where} {total + 1}, on every rank); write "
                f"\"total_steps\": {updates}{shorter}"]
    return []


def _torch_scheduler_problem(name: str, params: dict, cfg: dict) -> str | None:
    """A torch.optim.lr_scheduler class built with the file's params on a stand-in optimizer, as DeepSpeed builds it
    in initialize: torch's own value checks (LinearLR's start_factor 0, CosineAnnealingWarmRestarts' T_0 0, ...)
    raised there on every rank; the stand-in is of the file's optimizer class (CyclicLR / OneCycleLR cycle momentum,
    which torch's Adagrad does not have). Skipped where a value is "auto" (filled later) or not a JSON number / list."""
    import warnings

    import torch

    from dstrain.engine.ds_classes import stand_in_optimizer
    cls = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type) or not all(isinstance(v, (int, float, list)) for v in params.values()):
        return None
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(stand_in_optimizer(cfg, groups), **params)
    except (ValueError, TypeError, ZeroDivisionError) as err:
        return (f"scheduler.params: torch's {name} refuses the file's params ({err}); DeepSpeed builds it when the "
                "engine starts and would stop there on every rank; fix the value torch names")
    return None


def _scheduler_problems(cfg: dict, problems: list[str]) -> list[str]:
    sched = cfg.get("scheduler")
    if not isinstance(sched, dict) or not isinstance(sched.get("type"), str):
        return []
    name = sched["type"]
    params = sched.get("params") if isinstance(sched.get("params"), dict) else {}
    out = []
    if name == "ReduceLROnPlateau" and not any(p.startswith("scheduler.type:") for p in problems):
        out.append("scheduler.type: torch's ReduceLROnPlateau steps on a metric, which DeepSpeed's step() does not "
                   "pass (it retries with the batch size, so the lr would fall by 'factor' every patience + 1 "
                   "steps whatever the loss does); use one of DeepSpeed's schedulers (WarmupCosineLR, "
                   "WarmupDecayLR, ...) or remove the block (dstrain's warm-up + cosine)")
    out += _step_size_problems(name, params)
    deepspeed_own = name in _WARMUP_SCHEDULERS + ("OneCycle", "LRRangeTest")
    if deepspeed_own:
        from dstrain.engine.ds_sched_text import quoted_scheduler_numbers
        out += quoted_scheduler_numbers(name, params)
    start = params.get("last_batch_iteration", -1)
    if deepspeed_own and start != -1 and not _is_auto(start):
        out.append(f"scheduler.params.last_batch_iteration: {start!r} starts a fresh run partway into {name} (and "
                   "DeepSpeed then leaves the first step at optimizer.params.lr, not the schedule's lr); remove it "
                   "(or write -1): dstrain's --resume restores the scheduler's position from the checkpoint")
    if not deepspeed_own and name not in _OBJECT_SCHEDULERS and name != "ReduceLROnPlateau" and \
            not any(p.startswith("scheduler.") for p in problems):
        out += [p for p in (_torch_scheduler_problem(name, params, cfg),) if p is not None]
    if name in _OBJECT_SCHEDULERS:
        out.append(f"scheduler.type: torch's {name} takes Python objects as {_OBJECT_SCHEDULERS[name]}, which a JSON "
                   "file cannot hold (DeepSpeed passes the text on and torch fails when the engine builds it); use "
                   "one of DeepSpeed's schedulers (WarmupCosineLR, WarmupDecayLR, ...) or remove the block "
                   "(dstrain's warm-up + cosine)")
    kind = params.get("warmup_type")
    if name in _WARMUP_SCHEDULERS and kind is not None and kind not in _WARMUP_TYPES:
        same = [t for t in _WARMUP_TYPES if isinstance(kind, str) and t == kind.strip().lower()]
        fix = f"write \"{same[0]}\" (the names are lower case)" if same else "write \"linear\" or \"log\""
        out.append(f"scheduler.params.warmup_type: {name} knows only \"log\" and \"linear\", file says {kind!r} "
                   f"(DeepSpeed would warn and warm up on the log curve instead); {fix}")
    return out


def engine_key_problems(cfg: dict, device_type: str, problems: list[str]) -> list[str]:
    """Problems (key, reason, fix) with keys DeepSpeed accepts and its engine fails on, or silently misreads."""
    out = [p for p in (_log_level_problem(cfg), _datastates_problem(cfg), _managed_accumulation_problem(cfg),
                       _load_universal_problem(cfg)) if p is not None]
    out += _legacy_stage1(cfg) + _grad_norm_problems(cfg) + _weight_quantization_problems(cfg)
    out += _torch_optimizer_problems(cfg, device_type)
    out += _scheduler_problems(cfg, problems)
    return out
