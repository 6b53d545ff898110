"""ZeRO-3 leaf modules a user's DeepSpeed JSON asks for, checked against the run's model before launch.

DeepSpeed 0.19 makes modules "leaves" (their parameters gathered together, no hooks on their children) from
``zero_optimization.leaf_module`` (class or module names) or from ``stage3_module_granularity_threshold``
(every module, top-down, whose parameters per layer are at most the threshold). When the model itself becomes
a leaf, DeepSpeed's ZeRO-3 backward fails on every rank (a shape mismatch: "output with shape [1] doesn't
match the broadcast shape ...", "The size of tensor a (0) must match ..."), and the granularity rule reaches the model first: its average over all layers is about the
smallest there is. :func:`leaf_problems` finds that case on a meta-device build of the model, with DeepSpeed's
own rule, and names the fix (the model's blocks by class name).
"""
from __future__ import annotations

import sys

#: DeepSpeed's cap on a leaf's parameters (parameter_offload.Z3_MAX_LEAF_SIZE).
_MAX_LEAF_SIZE = 1e9


def _granularity(module, out: dict) -> tuple[int, int]:
    """DeepSpeed's ``_get_granularity_recursively``: (layers, params) under ``module``; ``out`` gets each
    module's granularity (params per layer; ``sys.maxsize`` where DeepSpeed never makes it a leaf)."""
    import torch
    if not list(module.parameters()):
        out[id(module)] = sys.maxsize
        return 0, 0
    params = sum(p.numel() for p in module.parameters(recurse=False))
    if not any(module.children()):
        out[id(module)] = sys.maxsize
        return 1, params
    layers = 0
    for child in module.children():
        c_layers, c_params = _granularity(child, out)
        layers, params = layers + c_layers, params + c_params
    if type(module).__name__ in torch.nn.modules.container.__all__:
        out[id(module)] = sys.maxsize
        return layers, params
    layers += 1
    out[id(module)] = params // layers if params <= _MAX_LEAF_SIZE else sys.maxsize
    return layers, params


def _child_classes(model) -> list[str]:
    """Class names of the modules that hold most of the model (its repeated blocks first)."""
    import torch
    names: dict[str, int] = {}
    for module in model.modules():
        if module is not model and any(module.children()) and \
                type(module).__name__ not in torch.nn.modules.container.__all__:
            names[type(module).__name__] = names.get(type(module).__name__, 0) + 1
    return sorted(names, key=lambda n: -names[n])


def leaf_problems(template: dict, build) -> list[str]:
    """Refusals for leaf settings that would make the whole model (built by ``build`` on the meta device) one
    ZeRO-3 leaf. ``template`` is the user's DeepSpeed JSON (after its canonical forms)."""
    return leaf_findings(template, build)[0]


def _matches(module, name: str) -> bool:
    """DeepSpeed's match of a leaf_module class name: the class's own name or its module-qualified name."""
    cls = type(module)
    return name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def leaf_findings(template: dict, build) -> tuple[list[str], list[str]]:
    """(refusals of :func:`leaf_problems`, notes): a note names the leaf_module classes no module of the run's model
    is (another model's blocks, as DeepSpeedExamples' Qwen3.5-MoE config names): DeepSpeed marks nothing for them,
    warns once and hooks every module as usual, which trains the same."""
    zo = template.get("zero_optimization") if isinstance(template, dict) else None
    if not isinstance(zo, dict) or zo.get("stage") != 3:
        return [], []
    threshold = zo.get("stage3_module_granularity_threshold", zo.get("module_granularity_threshold", 0))
    threshold = threshold if isinstance(threshold, (int, float)) and not isinstance(threshold, bool) else 0
    leaf = zo.get("leaf_module") if isinstance(zo.get("leaf_module"), dict) else {}
    classes = [c for c in (leaf.get("classes") or []) if isinstance(c, str)]
    if threshold <= 0 and not classes:
        return [], []
    import torch
    try:
        with torch.device("meta"):
            model = build()
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device: DeepSpeed will tell
        return [], []
    root = type(model).__name__
    blocks = _child_classes(model)
    instead = f" (e.g. \"classes\": [\"{blocks[0]}\"])" if blocks else ""
    problems = []
    if any(c == root or c.rsplit(".", 1)[-1] == root for c in classes):
        problems.append(f"zero_optimization.leaf_module.classes: {root!r} is the model itself, and DeepSpeed's ZeRO-3 "
                        f"backward fails when the whole model is one leaf module; name its blocks instead{instead}")
    if threshold > 0:
        found: dict[int, int] = {}
        _granularity(model, found)
        if found[id(model)] <= threshold:
            problems.append(f"zero_optimization.stage3_module_granularity_threshold: {threshold:g} makes the whole "
                            f"model ({root}, {found[id(model)]} parameters per layer) one leaf module, and DeepSpeed's "
                            "ZeRO-3 backward fails then; remove it and name the blocks in "
                            f"zero_optimization.leaf_module{instead}")
    unmatched = [c for c in classes if not any(_matches(m, c) for m in model.modules())]
    notes = [f"zero_optimization.leaf_module.classes: no module of the run's model ({root}) is "
             f"{', '.join(map(repr, unmatched))}, so DeepSpeed marks no leaf for {'them' if len(unmatched) > 1 else 'it'} "
             "and hooks every module as usual (it only warns)" + (f"; the model's blocks: \"classes\": [\"{blocks[0]}\"]"
                                                                  if blocks else "")] if unmatched else []
    return problems, notes
