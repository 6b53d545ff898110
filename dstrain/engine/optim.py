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

One type DeepSpeed does not know is dstrain's own: ``"type": "AdamATan2"`` in the
JSON, or ``train.optimizer_type=adam_atan2`` when the run config writes the block,
builds :class:`dstrain.optim.adam_atan2.AdamATan2` (foreach ops on every device; no
fused kernel, no DeepSpeed build, so not under optimizer offload).

Pure apart from the optimizer construction in :meth:`OptimizerChoice.factory`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

#: Optimizer "params" keys of DeepSpeed's Adam/AdamW that map onto torch.optim.Adam/AdamW.
_MAPPED = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "amsgrad"}
IMPLEMENTATIONS = ("auto", "torch_fused", "torch_foreach", "deepspeed")
#: ``train.optimizer_type`` -> the JSON block's ``type`` the run config writes.
TYPES = {"adamw": "AdamW", "adam_atan2": "AdamATan2"}
_ATAN2 = "adamatan2"
_ATAN2_PARAMS = {"lr", "betas", "weight_decay"}


@dataclass
class OptimizerChoice:
    implementation: str
    """torch_fused | torch_foreach | deepspeed."""
    decoupled: bool = True
    """AdamW (decoupled weight decay) or Adam (L2 added to the gradient)."""
    params: dict = field(default_factory=dict)
    """lr, betas, eps, weight_decay (and amsgrad) of the torch optimizer."""
    reason: str = ""
    algorithm: str = "adam"
    """adam (torch.optim.Adam/AdamW) | adam_atan2 (dstrain.optim.adam_atan2.AdamATan2)."""

    @property
    def description(self) -> str:
        if self.implementation == "deepspeed":
            return f"optimizer: built by DeepSpeed from the JSON's optimizer block ({self.reason})"
        if self.algorithm == "adam_atan2":
            return f"optimizer: dstrain.optim.AdamATan2 (foreach), built by dstrain ({self.reason})"
        name = "AdamW" if self.decoupled else "Adam"
        how = "fused kernel" if self.implementation == "torch_fused" else "foreach"
        return f"optimizer: torch.optim.{name} ({how}), built by dstrain ({self.reason})"

    def factory(self):
        """None (DeepSpeed builds it) or a callable DeepSpeed calls with the parameter groups.

        A callable, because DeepSpeed moves the model to its device first and the fused
        kernel wants its parameters there.
        """
        if self.implementation == "deepspeed":
            return None
        import torch
        kwargs = dict(self.params)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(kwargs["betas"])
        if self.algorithm == "adam_atan2":
            from dstrain.optim.adam_atan2 import AdamATan2
            return lambda groups: AdamATan2(groups, **kwargs)
        cls = torch.optim.AdamW if self.decoupled else torch.optim.Adam
        if self.implementation == "torch_fused":
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
        return lambda groups: cls(groups, **kwargs)


def group_weight_decay(choice: OptimizerChoice | None, ds_config: dict, run_value: float) -> float | None:
    """Weight decay of the decayed parameter group: the optimizer's own.

    The parameter groups carry it (biases and norm gains get 0), and a group's value
    overrides the optimizer's, so it must be the number the optimizer was meant to use:
    the block's (or the run's, when dstrain wrote the block) for the optimizers dstrain
    builds; for one DeepSpeed builds from the JSON, the block's explicit ``weight_decay``,
    else None: the optimizer's own default (SGD, Lamb, Lion: 0), not ``train.weight_decay``.
    """
    if choice is not None and choice.implementation != "deepspeed":
        return choice.params.get("weight_decay")
    block = ds_config.get("optimizer")
    if not isinstance(block, dict):
        return run_value
    params = block.get("params")
    return params.get("weight_decay") if isinstance(params, dict) else None


def _offloads_optimizer(ds_config: dict) -> bool:
    """offload_optimizer to a device, or DeepSpeed's deprecated ``cpu_offload: true``."""
    from dstrain.engine.ds_config import describe_zero
    return describe_zero(ds_config)["offload_optimizer"]


def _run_block(values, optimizer_type: str = "adamw") -> dict:
    params = {"lr": values.lr, "betas": list(values.betas), "eps": values.eps, "weight_decay": values.weight_decay}
    if optimizer_type == "adam_atan2":
        params.pop("eps")
    return {"type": TYPES[optimizer_type], "params": params}


def _all_auto(params) -> bool:
    return isinstance(params, dict) and all(isinstance(v, str) and v.strip().lower() == "auto"
                                            for v in params.values())


def apply_optimizer_type(template: dict, optimizer_type: str) -> dict:
    """The DeepSpeed JSON template with its optimizer block retyped to ``train.optimizer_type``.

    Only a block that pins nothing (type Adam/AdamW, every param "auto", as in the shipped
    profiles) is retyped; a block with numbers of its own is the user's and stays (then
    :func:`choose_optimizer` reports the disagreement). The input is not modified.
    """
    block = template.get("optimizer")
    if optimizer_type == "adamw" or not isinstance(block, dict):
        return template
    if str(block.get("type", "")).lower() not in ("adam", "adamw") or not _all_auto(block.get("params", {})):
        return template
    params = {k: v for k, v in (block.get("params") or {}).items() if k in _ATAN2_PARAMS}
    return {**template, "optimizer": {**block, "type": TYPES[optimizer_type], "params": params}}


def _atan2_choice(out: dict, block: dict, requested: str, source: str) -> tuple[OptimizerChoice, dict]:
    where = "optimizer type AdamATan2"
    if _offloads_optimizer(out):
        raise ValueError(f"{where} cannot run under optimizer offload (DeepSpeed's CPU Adam runs there): "
                         "drop offload_optimizer or use AdamW")
    if requested in ("deepspeed", "torch_fused"):
        raise ValueError(f"{where} is built by dstrain with foreach ops; train.optimizer={requested} has no "
                         "AdamATan2 (use auto or torch_foreach)")
    params = dict(block.get("params") or {})
    extra = sorted(set(params) - _ATAN2_PARAMS - {"eps"})
    if extra:
        raise ValueError(f"{where}: params {', '.join(extra)} are not AdamATan2's (it takes lr, betas, weight_decay)")
    note = "; eps dropped: atan2 needs none" if "eps" in params else ""
    params.pop("eps", None)
    out.pop("optimizer", None)
    if (out.get("zero_optimization") or {}).get("stage", 0) and "zero_allow_untested_optimizer" not in out:
        # DeepSpeed's ZeRO vets optimizers by class; an element-wise rule like this one partitions as Adam does.
        out["zero_allow_untested_optimizer"] = True
        note += "; zero_allow_untested_optimizer set (element-wise, partitions as Adam does)"
    return OptimizerChoice("torch_foreach", True, params, f"numbers from {source}{note}",
                           algorithm="adam_atan2"), out


def choose_optimizer(ds_config: dict, requested: str, device_type: str, values,
                     optimizer_type: str = "adamw") -> tuple[OptimizerChoice, dict]:
    """``(choice, the JSON DeepSpeed gets)`` for a resolved DeepSpeed JSON (no "auto" left).

    ``requested`` is ``train.optimizer``; ``values`` carries the run's lr, betas, eps and
    weight_decay (a :class:`dstrain.engine.ds_config.RunValues`), used when the file has no
    optimizer block, and ``optimizer_type`` (``train.optimizer_type``) the block's type then.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"train.optimizer must be one of {', '.join(IMPLEMENTATIONS)}, got {requested!r}")
    if optimizer_type not in TYPES:
        raise ValueError(f"train.optimizer_type must be one of {', '.join(TYPES)}, got {optimizer_type!r}")
    out = copy.deepcopy(ds_config)
    block = out.get("optimizer")
    kind = str(block.get("type", "")).lower() if block else ""
    if block and optimizer_type != "adamw" and kind != _ATAN2:
        raise ValueError(f"train.optimizer_type={optimizer_type} but the DeepSpeed JSON's optimizer block is "
                         f"type {block.get('type')!r}: set the block's type to {TYPES[optimizer_type]!r} or drop "
                         "the block, or leave train.optimizer_type at adamw")
    if not block and optimizer_type != "adamw":
        out["optimizer"] = _run_block(values, optimizer_type)
        return _atan2_choice(out, out["optimizer"], requested, "the run config (train.optimizer_type)")
    if kind == _ATAN2:
        return _atan2_choice(out, block, requested, "the DeepSpeed JSON's optimizer block")
    source = "the DeepSpeed JSON's optimizer block" if block else "the run config (the JSON has no optimizer block)"
    keep, why = None, ""
    if _offloads_optimizer(out):
        # what DeepSpeed's _configure_basic_optimizer builds under offload, by the block's type
        cpu = {"adagrad": "its CPU Adagrad", "lion": "its CPU Lion"}.get(kind, "its CPU Adam")
        if kind in ("adam", "adamw") and (block.get("params") or {}).get("torch_adam") is True:
            cpu = "torch.optim's Adam/AdamW (torch_adam)"
        elif block and kind not in ("adam", "adamw", "adagrad", "lion"):
            cpu = f"{block.get('type')!r} from the block"
        keep, why = True, f"optimizer offload: DeepSpeed builds {cpu}"
    elif requested == "deepspeed":
        keep, why = True, "train.optimizer=deepspeed"
    elif block:
        extra = sorted(set((block.get("params") or {})) - _MAPPED)
        if kind not in ("adam", "adamw"):
            keep, why = True, f"type {block.get('type')!r} is not Adam/AdamW, which dstrain builds itself"
            if "weight_decay" not in (block.get("params") or {}):
                why += "; weight decay: the optimizer's own default (the block sets none, train.weight_decay unused)"
            if kind == "adagrad":  # see dstrain.optim.lazy_state
                why += ("; dstrain hands DeepSpeed that same torch.optim.Adagrad, made to create the state of "
                        "the parameters DeepSpeed swaps in")
        elif extra:
            keep, why = True, f"params {', '.join(extra)} have no torch.optim.AdamW counterpart"
    if keep:
        if not block:
            out["optimizer"] = _run_block(values)
            why += "; block added from the run config"
        return OptimizerChoice("deepspeed", reason=why), out

    params = dict((block or _run_block(values))["params"])
    decoupled = True
    if kind == "adam":
        decoupled = bool(params.get("adam_w_mode", True))  # DeepSpeed's Adam is AdamW unless told otherwise
    for key in ("adam_w_mode", "torch_adam"):
        params.pop(key, None)
    impl = requested
    if impl == "auto":
        impl = "torch_fused" if device_type == "cuda" else "torch_foreach"
    if impl == "torch_fused" and device_type not in ("cuda", "cpu"):  # PyTorch's fused Adam: CUDA and CPU kernels
        raise ValueError(f"train.optimizer=torch_fused needs CUDA or a CPU; this run is on {device_type} "
                         "(use auto or torch_foreach)")
    out.pop("optimizer", None)
    return OptimizerChoice(impl, decoupled, params, f"numbers from {source}"), out
