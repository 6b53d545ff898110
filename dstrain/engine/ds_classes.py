"""What the classes DeepSpeed 0.19.8 builds from a file's optimizer and scheduler blocks accept, and what they change
without a word.

DeepSpeed hands ``optimizer.params`` to the class it picks as keyword arguments, and its config parser never looks
inside, so these pass every parse and then stop every rank in ``deepspeed.initialize`` or train as the file does not
say:

* an ``Adagrad`` block with params its class does not take (Adam's ``betas``; torch's ``lr_decay`` under optimizer
  offload, where DeepSpeed builds its CPU Adagrad), a ``Lion`` block with Adam's ``eps`` (neither its CPU nor its
  fused Lion takes one): TypeError in initialize; ``amsgrad`` for Adam under offload (DeepSpeed's CPU Adam takes the
  argument and raises on true);
* a torch.optim class given values its constructor refuses (SGD with ``nesterov`` and no momentum): ValueError in
  initialize; the class is built once here on a stand-in parameter (and :func:`stand_in_optimizer` gives the torch
  schedulers checked in ``ds_engine_keys`` the file's optimizer class, so that CyclicLR's or OneCycleLR's momentum
  cycling is tried on Adagrad as DeepSpeed would build it);
* a ``Muon`` block with settings DeepSpeed's Muon never reads (``nesterov``, ``ns_steps``: the Newton-Schulz steps of
  other Muon implementations): DeepSpeed splits the block into its Muon and Adam halves by a fixed list of keys and
  drops the rest;
* ``LRRangeTest`` from ``lr_range_test_min_lr`` 0, or with a ``lr_range_test_step_rate`` of 0 or less: its lr is that
  minimum times (1 + rate x interval), so it stays 0, never moves, or falls below 0;
* ``OneCycle`` momentum cycling: DeepSpeed cycles the first of the optimizer's ``betas`` and writes 0.99 as the
  second at every step (a beta2 of 0.95 or 0.999 is replaced), and where the optimizer has no ``betas`` (SGD,
  Adagrad) it turns cycling off with only a warning. Both are DeepSpeed's OneCycle working as built, so they are
  notes (:func:`class_notes`, :func:`run_notes`), not refusals: such files train as DeepSpeed trains them;
* an enabled flops profiler's ``profile_step``, ``module_depth``, ``top_modules`` or ``recompute_fwd_factor`` of the
  wrong kind (in quotes, null): never profiled, or a TypeError on every rank at the profile step;
* a ``flops_profiler.profile_step`` the run never reaches: DeepSpeed profiles the step whose count of finished steps
  equals it, so nothing is profiled (:func:`run_problems`, which needs the run's length);
* a deprecated ZeRO key written beside the key replacing it (``cpu_offload`` with ``offload_optimizer``): DeepSpeed's
  assertion named neither the key to remove nor the one to keep (:func:`deprecated_pair_problem`).

:func:`class_problems` and :func:`class_notes` are called by ``ds_sections.section_problems``; :func:`run_problems` and
:func:`run_notes` by ``ds_preflight.check_run`` and ``ds_check.check_ds_file``.
"""
from __future__ import annotations

import inspect
import json
import re

from dstrain.engine.ds_reading import DEEPSPEED_OPTIMIZER_TYPES, _is_auto, describe_zero

#: OneCycle's second beta (deepspeed/runtime/lr_schedules.py, ``_initialize_momentum``: ``(mom, 0.99)``).
ONECYCLE_BETA2 = 0.99

#: OneCycle's momentum keys: writing any of them asks for momentum cycling.
_MOMENTUM_KEYS = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate")

#: Keys DeepSpeed's engine takes out of an Adam / Muon block before it builds the class (never passed on there).
_POPPED = {"torch_adam", "adam_w_mode", "fp32_optimizer_states"}


def _them(keys) -> str:
    return "it" if len(keys) == 1 else "them"


def _params(cfg: dict) -> tuple[str, dict]:
    opt = cfg.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
        return "", {}
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    return opt["type"], params


def _taken(cls, skip=("self", "params", "model_params")) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - set(skip)


def _torch_optimizer(name: str):
    import torch.optim
    cls = getattr(torch.optim, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _deepspeed_class(kind: str, offload: bool, device_type: str):
    """The class DeepSpeed 0.19.8 builds for an Adagrad / Lion block (engine ``_configure_basic_optimizer``), and how
    it is named; None where another check speaks (Lion without offload on the CPU has no kernel at all)."""
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        if kind == "adagrad" and offload:
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
            return DeepSpeedCPUAdagrad, "DeepSpeed's CPU Adagrad (its class under optimizer offload)"
        if kind == "adagrad":
            import torch.optim
            return torch.optim.Adagrad, "torch.optim.Adagrad (DeepSpeed's class for Adagrad without offload)"
        if kind == "lion" and offload:
            from deepspeed.ops.lion import DeepSpeedCPULion
            return DeepSpeedCPULion, "DeepSpeed's CPU Lion (its class under optimizer offload)"
        if kind == "lion" and device_type != "cpu":
            from deepspeed.ops.lion import FusedLion
            return FusedLion, "DeepSpeed's FusedLion"
    return None, ""


def _stand_in_problem(cls, label: str, params: dict) -> str | None:
    """Build ``cls`` once on a one-element parameter with the file's explicit params: the values its constructor
    refuses (it would refuse them on every rank in deepspeed.initialize)."""
    import warnings

    import torch
    given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()
             if k not in _POPPED and not _is_auto(v)}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls([torch.nn.Parameter(torch.zeros(1))], **given)
    except (TypeError, ValueError, RuntimeError) as err:
        reason = " ".join(str(err).split())[:200]
        keys = [k for k in given if k.lower() in reason.lower()]  # the keys torch's message names
        path = f"optimizer.params.{', '.join(keys)}" if keys else "optimizer.params"
        return (f"{path}: {label} refuses the file's value{'s' if len(given) != 1 else ''} ({reason}); DeepSpeed "
                "builds it from this block and would stop at start-up, on every rank; change "
                f"{_them(keys) if keys else 'them'} as the message says")
    return None


def stand_in_optimizer(cfg: dict, groups: list[dict]):
    """An optimizer of the torch class DeepSpeed would build from the file's block (torch's Adagrad for "Adagrad", the
    torch.optim class named, with the block's explicit numbers; torch's AdamW for the Adam family, for no block and
    where the class cannot be built here), on ``groups``: what a torch scheduler checks it for (momentum, betas)."""
    import warnings

    import torch
    name, params = _params(cfg)
    kind = name.strip().lower()
    cls = torch.optim.Adagrad if kind == "adagrad" else (
        None if kind in DEEPSPEED_OPTIMIZER_TYPES or not name else _torch_optimizer(name))
    if cls is not None:
        taken = _taken(cls)
        given = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()
                 if k in taken and isinstance(v, (int, float, list)) and not isinstance(v, bool)}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return cls(groups, **{"lr": 1e-3, **given})
        except (TypeError, ValueError, RuntimeError):
            pass  # named by class_problems
    return torch.optim.AdamW(groups, lr=1e-3)


def _muon_problem(params: dict) -> str | None:
    """DeepSpeed's Muon reads the keys of its two halves (``DeepSpeedEngine._MUON_HALF_KEYS`` / ``_ADAM_HALF_KEYS``),
    ``muon_lr`` / ``adam_lr`` and what its auxiliary Adam pops; any other key is dropped without a word."""
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        from deepspeed.runtime.engine import DeepSpeedEngine
    read = set(DeepSpeedEngine._MUON_HALF_KEYS) | set(DeepSpeedEngine._ADAM_HALF_KEYS) | {"muon_lr", "adam_lr"}
    read |= _POPPED | ({"foreach"} if params.get("torch_adam") is True else set())
    extra = sorted(k for k in params if k not in read)
    if not extra:
        return None
    return (f"optimizer.params.{', '.join(extra)}: DeepSpeed's Muon never reads {_them(extra)} (it takes "
            f"{', '.join(sorted(read))}; its Newton-Schulz steps and Nesterov momentum are fixed inside it), so the "
            f"run would train without {_them(extra)}, not as the file says; remove {_them(extra)}")


def _optimizer_class_problems(cfg: dict, device_type: str, named: bool) -> list[str]:
    name, params = _params(cfg)
    kind = name.strip().lower()
    if not name or _is_auto(name) or named:
        return []
    if kind == "muon":
        problem = _muon_problem(params)
        return [problem] if problem else []
    offload = describe_zero(cfg)["offload_optimizer"]
    if kind in ("adagrad", "lion"):
        cls, label = _deepspeed_class(kind, offload, device_type)
        if cls is None:
            return []
        taken = _taken(cls)
        extra = sorted(k for k in params if k not in taken)
        if extra:
            return [f"optimizer.params.{', '.join(extra)}: {label} does not take {_them(extra)} (it takes "
                    f"{', '.join(sorted(taken))}) and DeepSpeed would stop at start-up, on every rank; remove "
                    f"{_them(extra)}"]
        if kind == "adagrad" and not offload:
            problem = _stand_in_problem(cls, label, params)
            return [problem] if problem else []
        return []
    if kind in ("adam", "adamw") and offload and params.get("amsgrad") is True and params.get("torch_adam") is not True:
        return ["optimizer.params.amsgrad: true under optimizer offload, where DeepSpeed builds its CPU Adam, which "
                "refuses it ('DeepSpeedCPUAdam does not support the AMSGrad variant' in initialize, on every rank); "
                "remove it, or drop the offload (the AdamW dstrain builds itself takes amsgrad)"]
    if kind in DEEPSPEED_OPTIMIZER_TYPES:
        return []
    cls = _torch_optimizer(name)
    if cls is None or set(params) - _taken(cls):  # not a torch class, or params it does not take: named before
        return []
    problem = _stand_in_problem(cls, f"torch.optim.{name}", params)
    return [problem] if problem else []


def _has_betas(cfg: dict) -> bool | None:
    """Whether the optimizer DeepSpeed's OneCycle sees keeps ``betas`` in its defaults (None: unknown)."""
    name, _ = _params(cfg)
    kind = name.strip().lower()
    if not name:
        return True  # no block: dstrain builds torch's AdamW
    if kind in ("adam", "adamw", "lion", "lamb", "adamatan2"):
        return True
    if kind == "adagrad":
        return False
    if kind in DEEPSPEED_OPTIMIZER_TYPES:
        return None
    cls = _torch_optimizer(name)
    return None if cls is None else "betas" in _taken(cls)


def _cycles_momentum(params: dict) -> bool:
    value = params.get("cycle_momentum", True)
    return value is True or (isinstance(value, int) and not isinstance(value, bool) and value != 0)


def _scheduler_params(cfg: dict, kind: str) -> dict | None:
    """The ``params`` of the file's scheduler block when its type is ``kind`` ({} when it has none), else None."""
    sched = cfg.get("scheduler")
    if not isinstance(sched, dict) or sched.get("type") != kind:
        return None
    return sched.get("params") if isinstance(sched.get("params"), dict) else {}


def _onecycle_without_betas(cfg: dict) -> list[str]:
    params = _scheduler_params(cfg, "OneCycle")
    if params is None:
        return []
    asked = params.get("cycle_momentum") is True or ("cycle_momentum" not in params
                                                     and any(k in params for k in _MOMENTUM_KEYS))
    if not asked or _has_betas(cfg) is not False:
        return []
    key = "cycle_momentum" if "cycle_momentum" in params else next(k for k in _MOMENTUM_KEYS if k in params)
    name = _params(cfg)[0]
    return [f"scheduler.params.{key}: OneCycle cycles momentum through the optimizer's betas, and {name} has none "
            "(DeepSpeed turns the cycling off with only a warning: the run does not cycle momentum); set "
            "\"cycle_momentum\": false to say so, or use an optimizer with betas (AdamW) to cycle it"]


def _range_test_from_zero(cfg: dict) -> list[str]:
    """LRRangeTest's lr is ``lr_range_test_min_lr x (1 + step_rate x interval)``: a product, so a minimum of 0 (a
    range test "from 0") keeps the lr at 0 for the whole run, and DeepSpeed says nothing."""
    params = _scheduler_params(cfg, "LRRangeTest")
    if params is None:
        return []
    low, rate = params.get("lr_range_test_min_lr"), params.get("lr_range_test_step_rate")
    values = low if isinstance(low, list) else [low]
    out = []
    if any(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in values):
        out.append(f"scheduler.params.lr_range_test_min_lr: file says {low!r}; LRRangeTest multiplies it by (1 + "
                   "lr_range_test_step_rate x interval), so the lr would stay at 0 (or below) for the whole run, and "
                   "DeepSpeed says nothing; set the smallest lr to test, above 0 (1e-5, say)")
    if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate <= 0:
        moves = "never move from lr_range_test_min_lr" if rate == 0 else "fall, and go below 0 (training uphill)"
        out.append(f"scheduler.params.lr_range_test_step_rate: file says {rate!r}; LRRangeTest's lr is "
                   f"lr_range_test_min_lr x (1 + step_rate x interval), so it would {moves}, and DeepSpeed says "
                   "nothing; set a rate above 0 (DeepSpeed's default is 1.0)")
    return out


def class_problems(cfg: dict, device_type: str, problems: list[str]) -> list[str]:
    """Problems with the optimizer class DeepSpeed builds from the file, OneCycle's momentum cycling and LRRangeTest's
    starting lr; an optimizer already named in ``problems`` is not looked at again."""
    named = any(p.startswith("optimizer") for p in problems)
    return _optimizer_class_problems(cfg, device_type, named) + _range_test_from_zero(cfg) + _profiler_values(cfg)


def class_notes(cfg: dict) -> list[str]:
    """What DeepSpeed's OneCycle does with momentum cycling asked of an optimizer without betas (a note: DeepSpeed
    trains, as it was built to, and says so in a warning only)."""
    return _onecycle_without_betas(cfg)


def _betas(cfg: dict, run_betas) -> tuple[tuple | None, str]:
    """The betas the optimizer gets, and where they come from: the file's, or the run's (``train.betas``) where
    the block says "auto", leaves them out of an Adam-family block, or there is no block (dstrain's AdamW)."""
    name, params = _params(cfg)
    kind = name.strip().lower()
    betas = params.get("betas")
    if isinstance(betas, list) and len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
        return tuple(betas), "optimizer.params.betas"
    from dstrain.engine.ds_config import _ADAM_TYPES
    if run_betas is not None and (not name or (kind in _ADAM_TYPES and (betas is None or _is_auto(betas)))):
        return tuple(run_betas), "train.betas"
    return None, ""


def _onecycle_beta2(cfg: dict, run_betas) -> list[str]:
    params = _scheduler_params(cfg, "OneCycle")
    if params is None or _has_betas(cfg) is not True:
        return []
    if not _cycles_momentum(params):
        return []
    betas, source = _betas(cfg, run_betas)
    if betas is None or abs(float(betas[1]) - ONECYCLE_BETA2) < 1e-12:
        return []
    said = "the file's" if source.startswith("optimizer") else "the run's"
    fix = (f"write \"betas\": [{betas[0]:g}, {ONECYCLE_BETA2:g}]" if source.startswith("optimizer")
           else f"use --train.betas=[{betas[0]:g},{ONECYCLE_BETA2:g}]")
    on = "it is on by default" if "cycle_momentum" not in params else "\"cycle_momentum\": true"
    return [f"scheduler.params.cycle_momentum: OneCycle's momentum cycling ({on}) sets the optimizer's betas to "
            f"(cycled momentum, {ONECYCLE_BETA2:g}) at every step, so {said} beta2 {betas[1]:g} ({source}) is "
            f"replaced by {ONECYCLE_BETA2:g} (DeepSpeed says nothing); set \"cycle_momentum\": false to keep the "
            f"betas, or {fix}"]


def _profile_step(cfg: dict, steps: int) -> list[str]:
    block = cfg.get("flops_profiler")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return []
    step = block.get("profile_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or 0 <= step < steps:
        return []
    return [f"flops_profiler.profile_step: {step}, and the run takes {steps} steps (DeepSpeed profiles the step "
            f"started after profile_step finished steps, 0 to {steps - 1} here), so nothing would be profiled; set "
            f"it to a number from 0 to {steps - 1} (1: the second step), or run --train.steps={max(step + 1, 1)}"]


def _profiler_values(cfg: dict) -> list[str]:
    """An enabled flops profiler's numbers of the wrong kind: DeepSpeed reads the section with ``get_scalar_param``
    (no checks) and uses them only at the profile step, comparing the step count with ``profile_step`` as written
    (a quoted "1" never matches: nothing is profiled) and handing the others to the profile printout, which stops
    every rank there with a TypeError (a quoted module_depth or recompute_fwd_factor, a null top_modules)."""
    block = cfg.get("flops_profiler")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return []
    out = []
    for key in ("profile_step", "module_depth", "top_modules", "recompute_fwd_factor"):
        if key not in block:
            continue
        value = block[key]
        whole = key != "recompute_fwd_factor"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (not whole or isinstance(value, int)):
            continue
        said = (f"file says {value!r} in quotes" if isinstance(value, str) else f"file says {json.dumps(value)}")
        what = "a whole number" if whole else "a number"
        if key == "profile_step":
            why = "DeepSpeed compares the step count with it as written, so it never matches and nothing is profiled"
        else:
            why = "DeepSpeed's profiler uses it only when it prints the profile, and stops every rank there"
        fix = f"write {value.strip()} without quotes" if isinstance(value, str) and _numeric(value) else \
            f"write {what}" + (" (-1: every depth)" if key == "module_depth" else "") + " or remove it"
        out.append(f"flops_profiler.{key}: {said}, where DeepSpeed takes {what}; {why}; {fix}")
    return out


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def run_problems(cfg: dict, steps: int | None) -> list[str]:
    """What the run's length decides: a flops_profiler.profile_step never reached (``steps`` None: not known, not
    checked)."""
    return _profile_step(cfg, steps) if steps else []


def run_notes(cfg: dict, run_betas) -> list[str]:
    """What the run's betas decide: OneCycle's momentum cycling replacing a beta2 other than 0.99 (a note, not a
    refusal: DeepSpeed's OneCycle does so by design, and the files that use it train as DeepSpeed trains them)."""
    return _onecycle_beta2(cfg, run_betas)


_DEPRECATED_PAIR = re.compile(r"Cannot provide deprecated parameter '([\w.]+)' and replacing parameter '([\w. ]+)' "
                              r"together")


def deprecated_pair_problem(section: str, text: str, block: dict) -> str | None:
    """DeepSpeed's assertion on a deprecated key written beside its replacement (``cpu_offload`` with
    ``offload_optimizer``, ``stage3_gather_fp16_weights_on_model_save`` with ``stage3_gather_16bit_...``) as one line
    naming the key to remove and the one to keep."""
    match = _DEPRECATED_PAIR.search(text)
    if not match:
        return None
    old, new = match.groups()
    keep = next((k for k in block if k != old and (k == new or k.endswith("_" + new))), new)
    return (f"{section}.{old}: the deprecated spelling of {keep}, and the file has both (DeepSpeed rejects them "
            f"together: 'Cannot provide deprecated parameter ... together'); remove {old} and keep {keep}")
