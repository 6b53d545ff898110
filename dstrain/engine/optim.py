"""Which optimizer the engine runs, decided before DeepSpeed starts.

Left to itself, DeepSpeed builds the optimizer its JSON names; on GPUs that is
FusedAdam, a CUDA extension compiled on first use (a build that common
environments break, and a kernel PyTorch now ships itself). dstrain builds
PyTorch's AdamW instead (the fused CUDA kernel on GPUs, the foreach one on CPU)
from the numbers of the JSON's ``optimizer`` block, or from the run config when
the file has no such block, and hands it to ``deepspeed.initialize`` as the
client optimizer; the block is then removed from the JSON DeepSpeed gets, and
``plan.txt`` names the implementation.

DeepSpeed keeps building it where it must or where asked: optimizer offload
(DeepSpeed requires its CPU Adam there), optimizer types other than Adam/AdamW or
parameters PyTorch's AdamW has no equivalent for, and ``train.optimizer=deepspeed``.
A block is added from the run config when such a file has none.

Pure apart from the optimizer construction in :meth:`OptimizerChoice.factory`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

#: Optimizer "params" keys of DeepSpeed's Adam/AdamW that map onto torch.optim.Adam/AdamW.
_MAPPED = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad"}
IMPLEMENTATIONS = ("auto", "torch_fused", "torch_foreach", "deepspeed")


@dataclass
class OptimizerChoice:
    implementation: str
    """torch_fused | torch_foreach | deepspeed."""
    decoupled: bool = True
    """AdamW (decoupled weight decay) or Adam (L2 added to the gradient)."""
    params: dict = field(default_factory=dict)
    """lr, betas, eps, weight_decay (and amsgrad) of the torch optimizer."""
    reason: str = ""

    @property
    def description(self) -> str:
        if self.implementation == "deepspeed":
            return f"optimizer: built by DeepSpeed from the JSON's optimizer block ({self.reason})"
        name = "AdamW" if self.decoupled else "Adam"
        how = "fused CUDA kernel" if self.implementation == "torch_fused" else "foreach"
        return f"optimizer: torch.optim.{name} ({how}), built by dstrain ({self.reason})"

    def factory(self):
        """None (DeepSpeed builds it) or a callable DeepSpeed calls with the parameter groups.

        A callable, because DeepSpeed moves the model to its device first and the fused
        kernel wants its parameters there.
        """
        if self.implementation == "deepspeed":
            return None
        import torch
        cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        kwargs = dict(self.params)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        if self.implementation == "torch_fused":
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
        return lambda groups: cls(groups, **kwargs)


def _offloads_optimizer(ds_config: dict) -> bool:
    zero = ds_config.get("zero_optimization") or {}
    device = (zero.get("offload_optimizer") or {}).get("device", "none")
    return str(device).lower() not in ("none", "")


def _run_block(values) -> dict:
    return {"type": "AdamW", "params": {"lr": values.lr, "betas": list(values.betas), "eps": values.eps,
                                        "weight_decay": values.weight_decay}}


def choose_optimizer(ds_config: dict, requested: str, device_type: str, values) -> tuple[OptimizerChoice, dict]:
    """``(choice, the JSON DeepSpeed gets)`` for a resolved DeepSpeed JSON (no "auto" left).

    ``requested`` is ``train.optimizer``; ``values`` carries the run's lr, betas, eps and
    weight_decay (a :class:`dstrain.engine.ds_config.RunValues`), used when the file has no
    optimizer block.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"train.optimizer must be one of {', '.join(IMPLEMENTATIONS)}, got {requested!r}")
    out = copy.deepcopy(ds_config)
    block = out.get("optimizer")
    source = "the DeepSpeed JSON's optimizer block" if block else "the run config (the JSON has no optimizer block)"
    keep, why = None, ""
    if _offloads_optimizer(out):
        keep, why = True, "optimizer offload runs DeepSpeed's CPU Adam"
    elif requested == "deepspeed":
        keep, why = True, "train.optimizer=deepspeed"
    elif block:
        kind = str(block.get("type", "")).lower()
        extra = sorted(set((block.get("params") or {})) - _MAPPED)
        if kind not in ("adam", "adamw"):
            keep, why = True, f"type {block.get('type')!r} has no PyTorch counterpart here"
        elif extra:
            keep, why = True, f"params {', '.join(extra)} have no torch.optim.AdamW counterpart"
    if keep:
        if not block:
            out["optimizer"] = _run_block(values)
            why += "; block added from the run config"
        return OptimizerChoice("deepspeed", reason=why), out

    params = dict((block or _run_block(values))["params"])
    decoupled = True
    if block and str(block.get("type")).lower() == "adam":
        decoupled = bool(params.get("adam_w_mode", True))  # DeepSpeed's Adam is AdamW unless told otherwise
    for key in ("adam_w_mode", "torch_adam"):
        params.pop(key, None)
    impl = requested
    if impl == "auto":
        impl = "torch_fused" if device_type == "cuda" else "torch_foreach"
    if impl == "torch_fused" and device_type != "cuda":
        raise ValueError(f"train.optimizer=torch_fused needs CUDA; this run is on {device_type} "
                         "(use auto or torch_foreach)")
    out.pop("optimizer", None)
    return OptimizerChoice(impl, decoupled, params, f"numbers from {source}"), out
