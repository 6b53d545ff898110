"""Numbers written as text in the params of DeepSpeed's own schedulers.

DeepSpeed 0.19 hands a scheduler block's params to WarmupLR / WarmupDecayLR / WarmupCosineLR /
OneCycle / LRRangeTest as written, and those classes do arithmetic on them when the engine builds
or first steps them: ``"warmup_min_lr": "0"`` stops every rank in ``deepspeed.initialize`` with
``unsupported operand type(s) for -: 'float' and 'str'``. The four params the run fills
(total_num_steps, warmup_num_steps, cos_min_ratio, warmup_max_lr) are named where they are filled
(``ds_config``), the step sizes by ``ds_engine_keys``, quoted false words by ``ds_unread``; this
module names the rest, reading which params are numbers from the classes' own signatures.
"""
from __future__ import annotations

import inspect

from dstrain.engine.ds_reading import _is_auto
from dstrain.engine.ds_unread import _FALSE_WORDS  # (named there as quoted booleans)

#: DeepSpeed's own scheduler classes (deepspeed.runtime.lr_schedules).
DEEPSPEED_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")

#: Params checked elsewhere (filled by the run, or with their own checks and fixes).
_NAMED_ELSEWHERE = frozenset({"total_num_steps", "warmup_num_steps", "cos_min_ratio", "warmup_max_lr",
                              "lr_range_test_step_size", "cycle_first_step_size", "cycle_second_step_size",
                              "last_batch_iteration", "optimizer"})


def numeric_params(name: str) -> frozenset[str]:
    """The params of DeepSpeed's scheduler ``name`` that are numbers: a number as default, or none (required)."""
    from deepspeed.runtime import lr_schedules
    cls = getattr(lr_schedules, name, None)
    if name not in DEEPSPEED_SCHEDULERS or cls is None:
        return frozenset()
    out = set()
    for param in inspect.signature(cls.__init__).parameters.values():
        default = param.default
        if param.name in ("self", *_NAMED_ELSEWHERE) or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if default is inspect.Parameter.empty or (isinstance(default, (int, float)) and not isinstance(default, bool)):
            out.add(param.name)
    return frozenset(out)


def _text(value) -> bool:
    return isinstance(value, str) and not _is_auto(value) and value.strip().lower() not in _FALSE_WORDS


def quoted_scheduler_numbers(name: str, params: dict) -> list[str]:
    """One refusal per param of DeepSpeed's scheduler ``name`` that is a number written as text (or a list with
    one), with the number to write."""
    out = []
    for key in sorted(numeric_params(name) & set(params)):
        value = params[key]
        items = value if isinstance(value, list) else [value]
        if not any(_text(v) for v in items):
            continue
        try:
            [float(v) for v in items if _text(v)]
            shown = [v.strip() if _text(v) else str(v) for v in items]
            fix = f"write {'[' + ', '.join(shown) + ']' if isinstance(value, list) else shown[0]} without quotes"
        except ValueError:
            fix = "write a number"
        out.append(f"scheduler.params.{key}: file says {value!r}, a number as text, which DeepSpeed hands to {name} "
                   "as written; its arithmetic on it fails when the engine builds or first steps the scheduler "
                   f"(TypeError, on every rank); {fix}")
    return out
