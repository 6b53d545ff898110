"""Keys DeepSpeed 0.19.8 reads in a way a file's author may not expect, checked as DeepSpeed reads them.

* ``steps_per_print``: the engine logs its progress line on rank 0 when ``(step + 1) % steps_per_print == 0``
  (``runtime/engine.py``, ``_take_model_step``). A negative number is therefore every ``|n|`` steps (-1: every
  step), which runs, so it is accepted with a note; 0 stops rank 0 at its first step (ZeroDivisionError); text and
  booleans are refused as before.
* ``zero_optimization.overlap_comm: "auto"``: the parser drops "auto" and its validator then sets the key to
  ``stage == 3`` (``runtime/zero/config.py``, ``overlap_comm_valid``), a default that depends on the stage and so is
  not among ``ds_config.zero_defaults``.
* ``gradient_clipping`` (or Hugging Face's ``max_grad_norm``) among ``optimizer.params``: DeepSpeed hands every param
  to the optimizer's class, which stops at start-up (or, for ``max_grad_norm``, refuses it by name); the key
  belongs at the top level.
* A key of the ``bf16`` / ``fp16`` sections other than ``enabled`` set to "auto" (``"auto_cast": "auto"`` beside
  fp16 off): both are DeepSpeed config models, whose parser drops "auto", so the key gets its default.
"""
from __future__ import annotations

import functools
import json

#: ZeRO keys whose DeepSpeed default depends on the stage: the default at each stage.
STAGE_DEFAULTS = {"overlap_comm": lambda stage: stage == 3}

#: clipping keys written among an optimizer's params (HF's TrainingArguments name and DeepSpeed's).
CLIPPING_KEYS = ("gradient_clipping", "max_grad_norm")


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def steps_per_print_check(cfg: dict, problems: list[str], notes: list[str]) -> None:
    """``steps_per_print`` as DeepSpeed's step uses it: a modulus (absent, null and "auto" pass unread)."""
    spp = cfg.get("steps_per_print")
    if spp is None or _is_auto(spp):
        return
    if isinstance(spp, bool) or not isinstance(spp, (int, float)):
        problems.append(f"steps_per_print: must be a number (or null), file says {json.dumps(spp)} (DeepSpeed takes "
                        "the step count modulo it at every step, and rank 0 stops at the first one on anything else)")
    elif spp == 0:
        problems.append("steps_per_print: 0 stops rank 0 at its first step (DeepSpeed takes the step count modulo it: "
                        "ZeroDivisionError); write null (the default) for no progress line, or a positive number")
    elif spp < 0:
        every = abs(spp)
        notes.append(f"steps_per_print: {spp:g}: DeepSpeed logs its progress line when the step count modulo "
                     f"{spp:g} is 0, which is every {every:g} step{'s' if every != 1 else ''}, as {every:g} would "
                     "(null, the default, turns the line off)")


def fill_stage_defaults(zo: dict, stage) -> None:
    """Set each "auto" key of :data:`STAGE_DEFAULTS` in ``zo`` to DeepSpeed's default at ``stage`` (an int)."""
    if isinstance(stage, int) and not isinstance(stage, bool):
        for key, default in STAGE_DEFAULTS.items():
            if _is_auto(zo.get(key)):
                zo[key] = default(stage)


def stage_default_notes(zo: dict) -> list[str]:
    """``"key stage-default"`` for each "auto" key of :data:`STAGE_DEFAULTS` in ``zo`` (for the section's note)."""
    stage = zo.get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool):
        return []
    return [f"{key} {default(stage)} (at stage {stage})" for key, default in STAGE_DEFAULTS.items()
            if _is_auto(zo.get(key))]


def clipping_in_params(params: dict) -> list[str]:
    """One line per clipping key among the optimizer's ``params``, saying to move it to the top level."""
    lines = []
    for key in CLIPPING_KEYS:
        if key in params:
            why = ("DeepSpeed refuses it by name at start-up" if key == "max_grad_norm" else "DeepSpeed passes "
                   "every param to the optimizer's class, which does not take it, and stops at start-up")
            lines.append(f"optimizer.params.{key}: gradient clipping is a top-level key, not an optimizer param "
                         f"({why}); move it to the top level: \"gradient_clipping\": {json.dumps(params[key])}")
    return lines


@functools.cache
def precision_defaults(section: str) -> dict[str, object]:
    """DeepSpeed's default of each key of its ``bf16`` or ``fp16`` section but ``enabled`` (dstrain fills that)."""
    from dstrain.engine.ds_check import accelerator_untouched
    with accelerator_untouched():
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    model = {"bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config}[section]
    return {name: field.get_default(call_default_factory=True) for name, field in model.model_fields.items()
            if name != "enabled"}


def fill_precision_autos(cfg: dict) -> None:
    """Set each "auto" key but ``enabled`` of the bf16 / fp16 sections to DeepSpeed's default (its parser's reading)."""
    for section in ("bf16", "fp16"):
        block = cfg.get(section)
        if isinstance(block, dict) and any(map(_is_auto, block.values())):
            defaults = precision_defaults(section)
            block.update({k: defaults[k] for k, v in block.items() if _is_auto(v) and k in defaults})


def precision_auto_notes(cfg: dict) -> list[str]:
    """The note for each section :func:`fill_precision_autos` fills, naming the keys and their defaults."""
    notes = []
    for section in ("bf16", "fp16"):
        block = cfg.get(section)
        if isinstance(block, dict):
            known = [f"{k} {json.dumps(precision_defaults(section)[k])}" for k, v in block.items()
                     if _is_auto(v) and k in precision_defaults(section)]
            if known:
                notes.append(f"{section}: \"auto\" is DeepSpeed's default there (its parser drops \"auto\"): "
                             + ", ".join(known))
    return notes
