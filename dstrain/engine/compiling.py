"""Whether, what and how the engine compiles (``train.compile``, ``train.compile_mode``, ``train.compile_scope``),
and the plan's line for the attention kernels it asks for (``train.attention_backend``).

Scope ``model`` compiles the whole module inside the DeepSpeed engine (DeepSpeed's own
``engine.compile``). Scope ``regions`` compiles only the submodules a model names
(``ModelSpec.compile_regions``) in place, each traced once and reused by every call: a
recurrent model such as HRM calls the same module many times per forward, and compiling
the whole forward traces every call again (on a 2-core CPU, cold caches, HRM's Sudoku size took
119.6 s to compile whole and 24.2 s by regions, and no longer per step after). ``auto`` picks
regions where the model names them and the mode records no CUDA graphs (a region called
several times per step would replay over outputs still in use), else the whole model.
"""
from __future__ import annotations

from typing import Callable

from dstrain.config import ConfigError, RunConfig


def compile_kwargs(mode: str) -> dict:
    """torch.compile's keyword arguments for ``train.compile_mode``: static shapes, and ``mode``
    unless it is "default" (then torch.compile's own default)."""
    return {"dynamic": False, **({} if mode == "default" else {"mode": mode})}


def records_cuda_graphs(mode: str) -> bool:
    """Whether torch.compile's ``mode`` replays CUDA graphs, whose outputs live in the graphs' memory
    pool and are overwritten by the next run: a caller keeping an output (a recurrent carry, a loss
    read later) must copy it first."""
    return mode in ("reduce-overhead", "max-autotune")


def copy_graph_outputs(out):
    """``out`` (a tensor, or tuples, lists and dicts of them) with every tensor copied: what a caller
    keeps of a CUDA-graph replay's outputs (:func:`records_cuda_graphs`)."""
    import torch
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


def compile_choice(cfg: RunConfig, device_type: str, pipeline: bool) -> tuple[bool, str]:
    """``(compile, why)``: ``train.compile`` if set; auto compiles on CUDA, except for trainers whose
    shapes change every step (``trainers.VARIABLE_SHAPES``). The pipeline engine runs uncompiled."""
    from dstrain.trainers import VARIABLE_SHAPES
    if pipeline:
        return False, ": the pipeline engine runs its layers uncompiled"
    if isinstance(cfg.train.compile, bool):
        return cfg.train.compile, ""
    if device_type == "cuda" and cfg.trainer in VARIABLE_SHAPES:
        return False, (f": the {cfg.trainer} trainer's sequence widths change every step, and static-shape "
                       "compilation would compile again for each")
    return device_type == "cuda", ""


def compile_scope(cfg: RunConfig, regions: Callable | None) -> str:
    """``model`` or ``regions`` for ``train.compile_scope`` (``regions``: the model's
    ``ModelSpec.compile_regions``, None where it names none). ConfigError where regions cannot be had."""
    scope, mode = cfg.train.compile_scope, cfg.train.compile_mode
    if scope == "regions" and regions is None:
        raise ConfigError("run config", "train.compile_scope",
                          f"regions needs a model that names its compile regions; {cfg.model.name} names none "
                          "(use model or auto)")
    if scope == "regions" and records_cuda_graphs(mode):
        raise ConfigError("run config", "train.compile_scope",
                          f"regions cannot run under compile_mode {mode} (CUDA graphs): a region called several "
                          "times per step would replay over its own outputs; use compile_scope model, or a mode "
                          "without CUDA graphs")
    if scope == "auto":
        return "regions" if regions is not None and not records_cuda_graphs(mode) else "model"
    return scope


def describe(scope: str, model_name: str) -> str:
    """The plan's words for a scope (none for the whole model, the usual case)."""
    return f", scope regions: the modules the {model_name} model names" if scope == "regions" else ""


def compile_engine(ds_engine, mode: str = "default", regions: Callable | None = None) -> None:
    """``torch.compile`` inside the DeepSpeed engine (static shapes, ``mode`` unless "default").

    Without ``regions``: the whole module, through DeepSpeed's own ``engine.compile``, which
    compiles it in place and keeps ZeRO's hooks working (ZeRO-3's parameter hooks run as graph
    breaks). With ``regions`` (module -> submodules): each submodule compiled in place
    (``nn.Module.compile``: parameter names and the state dict stay as they were), with the
    backend DeepSpeed's accelerator names.
    """
    if regions is None:
        ds_engine.compile(compile_kwargs=compile_kwargs(mode))
        return
    from deepspeed.accelerator import get_accelerator
    for region in regions(ds_engine.module):
        region.compile(backend=get_accelerator().get_compile_backend(), **compile_kwargs(mode))


def attention_note(cfg: RunConfig, device_type: str = "cpu", precision: str = "bf16") -> str:
    """The plan's line for ``train.attention_backend``: on a GPU what PyTorch's own order runs first (on a CPU,
    where no FlashAttention kernel exists, none)."""
    if cfg.train.attention_backend == "auto":
        if device_type != "cuda":
            return ""
        if precision == "fp32":
            return ("attention: PyTorch's SDPA order on the GPU, its memory-efficient kernel for fp32 "
                    "(FlashAttention-2 takes bf16/fp16 only; train.attention_backend=auto)")
        return ("attention: FlashAttention-2 first on the GPU (PyTorch's SDPA order, train.attention_backend=auto; "
                "=cudnn tries cuDNN's fused attention first)")
    return (f"attention: SDPA tries {cfg.train.attention_backend}'s kernels first in every forward "
            "(train.attention_backend; falls back in PyTorch's order where they cannot serve)")
