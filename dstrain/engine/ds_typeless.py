"""An optimizer or scheduler block that names no "type".

DeepSpeed 0.19.8 reads both blocks through their type alone (``runtime/config.py``: ``get_optimizer_name`` and
``get_optimizer_params`` return None without one, likewise for the scheduler), so such a block builds nothing and
its params are dropped without a word. For the optimizer that stops the run: the engine has no optimizer (dstrain,
like Hugging Face's Trainer, leaves the optimizer to a file that has the block) and its first backward asserts
"must provide optimizer during init". For the scheduler the learning rate stays where the optimizer put it, for
the whole run. Both are refused before launch; an empty block, which asks for nothing, is left alone.
"""
from __future__ import annotations

import json

_BUILT = {"optimizer": "an optimizer", "scheduler": "a learning-rate scheduler"}
_EXAMPLE = {"optimizer": "AdamW", "scheduler": "WarmupDecayLR"}
_WITHOUT = {"optimizer": "DeepSpeed's engine then has no optimizer and stops at the first backward (\"must provide "
                         "optimizer during init\")",
            "scheduler": "the learning rate would stay at the optimizer's for the whole run, not as the block says"}
_ELSE = {"optimizer": "remove the block (dstrain then builds AdamW from the run config)",
         "scheduler": "remove the block (dstrain's warm-up + cosine)"}


def untyped(block) -> bool:
    """``block`` is a non-empty object that names no type (absent, null or blank)."""
    if not isinstance(block, dict) or not block:
        return False
    kind = block.get("type")
    return kind is None or (isinstance(kind, str) and not kind.strip())


def typeless_problems(cfg: dict) -> list[str]:
    """One line for each of the optimizer and scheduler blocks that has keys but no type."""
    out = []
    for key in ("optimizer", "scheduler"):
        block = cfg.get(key)
        if not untyped(block) or (isinstance(block.get("type"), str) and key == "optimizer"):
            continue  # a blank optimizer type: named as an unknown class (ds_sections)
        said = "null" if "type" in block else "no \"type\""
        has = ", ".join(sorted(str(k) for k in block if k != "type"))
        said += f" (the block has {has})" if has else ", the block's only key"
        out.append(f"{key}.type: {said}; DeepSpeed builds {_BUILT[key]} from the block only by "
                   f"its type and silently drops the rest: {_WITHOUT[key]}; add \"type\": "
                   f"{json.dumps(_EXAMPLE[key])} (or the one meant), or {_ELSE[key]}")
    return out
