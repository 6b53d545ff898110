"""Shapes of DeepSpeed JSON that come from copying another project's file as it stands (round 12).

* Unfilled template placeholders: Megatron-DeepSpeed's example scripts keep ``ds_config_*_TEMPLATE.json`` files whose
  values are bare words (``"train_batch_size": CONFIG_BATCH_SIZE,``) and write the numbers in with sed before each
  run. DeepSpeed's hjson loader reads such a word as text running to the end of its line, comma included
  (``"CONFIG_BATCH_SIZE,"``), so a template used as it stands is refused key by key; here every placeholder is named
  at once, with the fix.
* ``compile`` keys of older DeepSpeed (``enabled`` / ``disable`` / ``backend`` / ``kwargs``: its torch.compile
  switches, as axolotl's ``zero1_torch_compile.json`` still writes them): DeepSpeed 0.19's ``compile`` section sets up
  DeepCompile only and rejects them as unknown keys; dstrain compiles the model itself (``train.compile``).
* ``gradient_predivide_factor`` beside ``"prescale_gradients": true`` where DeepSpeed accepts both (ZeRO stage 0 and
  1, stage 2 without reduce_scatter): its all-reduce then divides by the data-parallel size before summing and never
  reads the factor, so a note says the factor does nothing.

:func:`template_placeholders` is called by ``ds_files.load_ds_json`` (hjson-read files only); :func:`copied_checks`
by ``ds_sections.section_problems``.
"""
from __future__ import annotations

import re

#: A bare upper-case word after a key's colon: what a template keeps where its script writes a value (with an
#: underscore, ``ZERO_STAGE``, or six letters or more, ``GBSIZE``; not a log level or a dtype written in capitals),
#: or a shell variable (``$ZERO_STAGE``, ``${GLOBAL_BATCH}``: a run script's heredoc copied out as it stands).
_PLACEHOLDER_LINE = re.compile(r"""["']?[\w.]+["']?\s*:\s*([A-Z][A-Z0-9]*_[A-Z0-9_]*|[A-Z]{6,}|"""
                               r"""\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)\s*,?\s*(?:#.*|//.*)?$""", re.MULTILINE)
_NOT_PLACEHOLDERS = {"WARNING", "CRITICAL", "NOTSET"}

#: The torch.compile switches of DeepSpeed before DeepCompile (0.19 rejects each as an unknown ``compile`` key).
LEGACY_COMPILE_KEYS = ("enabled", "disable", "backend", "kwargs")


def _walk(node, path: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")
    else:
        yield path, node


def template_placeholders(text: str, data: dict) -> str | None:
    """One problem naming every unfilled placeholder of a template read by hjson, or None if there is none."""
    words = set(_PLACEHOLDER_LINE.findall(text)) - _NOT_PLACEHOLDERS
    if not words:
        return None
    found = []
    for path, value in _walk(data):
        word = value.rstrip().rstrip(",").rstrip() if isinstance(value, str) else None
        if word in words:
            found.append(f"{path} ({word})")
    if not found:
        return None
    return (f"{', '.join(found)}: unfilled template placeholders, which DeepSpeed's hjson loader reads as text (the "
            "file is a template: Megatron-DeepSpeed's example scripts write the values in with sed or a shell heredoc "
            "before launch); replace each with its value, or with \"auto\" where the run may fill it")


def _compile_problems(cfg: dict) -> list[str]:
    comp = cfg.get("compile")
    if not isinstance(comp, dict):
        return []
    legacy = [k for k in LEGACY_COMPILE_KEYS if k in comp]
    if not legacy or comp.get("deepcompile") is True:  # ds_sections refuses the whole section then
        return []
    wants = comp.get("enabled") is True or comp.get("disable") is False
    fix = ("and pass --train.compile=true (dstrain compiles the model inside the engine with torch.compile)" if wants
           else "(dstrain's train.compile decides whether torch.compile runs)")
    them = "it" if len(legacy) == 1 else "them"
    return [f"compile.{', '.join(legacy)}: torch.compile settings of DeepSpeed before DeepCompile; DeepSpeed 0.19's "
            f"compile section configures DeepCompile only and rejects {them} as unknown keys; remove {them} {fix}"]


def _predivide_note(cfg: dict) -> list[str]:
    from dstrain.engine.ds_config import describe_zero
    factor = cfg.get("gradient_predivide_factor")
    if cfg.get("prescale_gradients") is not True or not isinstance(factor, (int, float)) or isinstance(factor, bool):
        return []
    if factor == 1.0:
        return []
    zo = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), dict) else {}
    stage = describe_zero(cfg)["stage"]
    if stage == 3 or (stage == 2 and zo.get("reduce_scatter", True) is not False):
        return []  # refused by ds_sections (DeepSpeed asserts)
    return [f"gradient_predivide_factor: {factor} is unused: with \"prescale_gradients\": true DeepSpeed divides each "
            "gradient by the data-parallel size before the all-reduce and never reads the factor (the average is the "
            "same); remove it, or set prescale_gradients to false to divide by it instead"]


def copied_checks(cfg: dict) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` for the shapes this module's docstring lists."""
    if not isinstance(cfg, dict):
        return [], []
    return _compile_problems(cfg), _predivide_note(cfg)
