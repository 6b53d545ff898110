"""What a DeepSpeed JSON says about the run, read without filling or checking anything: whether a value is
"auto", the weights' dtype the file pins (``data_types``) or leaves open (bf16 / fp16 ``"enabled": "auto"``), and
its ZeRO stage and offloads, and the optimizer types DeepSpeed builds itself. ``ds_config.py`` (which fills and
checks) and the pre-launch checks read files through these.

The module is pure: no deepspeed or torch import.
"""
from __future__ import annotations

AUTO = "auto"

#: Optimizer types DeepSpeed builds itself (lower case); any other name is looked up in torch.optim as spelled.
DEEPSPEED_OPTIMIZER_TYPES = frozenset({"adam", "adamw", "adagrad", "lamb", "lion", "muadam", "muadamw", "musgd",
                                       "muon", "adamatan2"})


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _offloads(zo: dict, key: str, legacy: str) -> bool:
    block = zo.get(key)
    if isinstance(block, dict) and str(block.get("device", "none")).lower() not in ("none", "auto"):
        return True
    return zo.get(legacy) is True


def describe_zero(cfg: dict) -> dict:
    """Summarise a config's ZeRO setup: ``{"stage", "offload_optimizer", "offload_param"}``."""
    zo = cfg.get("zero_optimization", {})
    if isinstance(zo, bool):  # DeepSpeed's deprecated boolean form means stage 1
        return {"stage": 1 if zo else 0, "offload_optimizer": False, "offload_param": False}
    if not isinstance(zo, dict):
        zo = {}
    stage = zo.get("stage", 0)
    return {"stage": int(stage) if isinstance(stage, int) else 0,
            "offload_optimizer": _offloads(zo, "offload_optimizer", "cpu_offload"),
            "offload_param": _offloads(zo, "offload_param", "cpu_offload_param")}


#: DeepSpeed's DtypeEnum spellings of the weights' dtypes.
_WEIGHT_DTYPES = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
                  **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16"),
                  **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16")}


def _param_dtype_value(cfg: dict):
    """``data_types.param_dtype`` as the file writes it; None when absent or "auto"."""
    dt = cfg.get("data_types")
    value = dt.get("param_dtype") if isinstance(dt, dict) else None
    return None if value is None or _is_auto(value) else value


def param_dtype(cfg: dict) -> str | None:
    """The weights' dtype ``data_types.param_dtype`` names (fp32, bf16, fp16); None where it names none."""
    value = _param_dtype_value(cfg)
    return None if value is None else _WEIGHT_DTYPES.get(str(value).lower())


def pinned_weights(cfg: dict) -> tuple[str | None, str]:
    """``(dtype, key)``: the weights' dtype the file pins outside bf16 / fp16: ``data_types.param_dtype``
    (DeepSpeed asserts it), else at ZeRO stage 0 ``data_types.grad_accum_dtype`` (DeepSpeed's stage 0
    accumulates only in the weights' dtype). ``(None, "")`` where neither pins it."""
    if param_dtype(cfg) is not None:
        return param_dtype(cfg), "data_types.param_dtype"
    dt = cfg.get("data_types")
    acc = dt.get("grad_accum_dtype") if isinstance(dt, dict) else None
    if isinstance(acc, str) and acc.lower() in _WEIGHT_DTYPES and describe_zero(cfg)["stage"] == 0:
        return _WEIGHT_DTYPES[acc.lower()], "data_types.grad_accum_dtype"
    return None, ""


def pinned_weights_dtype(cfg: dict) -> str | None:
    return pinned_weights(cfg)[0]


def open_weights_dtype(cfg: dict) -> str | None:
    """:func:`pinned_weights_dtype` where the file's bf16 / fp16 sections leave the precision open (neither
    sets ``enabled`` other than "auto"): the weights' dtype DeepSpeed then asserts. None otherwise."""
    for key in ("bf16", "fp16"):
        section = cfg.get(key)
        said = section.get("enabled") if isinstance(section, dict) else None
        if said is not None and not _is_auto(said):
            return None
    dtype, key = pinned_weights(cfg)
    if key == "data_types.grad_accum_dtype" and not precision_left_open(cfg):
        return None  # no bf16 / fp16 "auto": the weights are fp32, as the file reads
    return dtype


def precision_left_open(cfg: dict) -> bool:
    """A bf16 or fp16 section with ``"enabled": "auto"``: the precision is the run's (the factory's) choice."""
    return any(isinstance(cfg.get(k), dict) and _is_auto(cfg[k].get("enabled")) for k in ("bf16", "fp16"))


def dotted_type_hint(name: str, known, block: str) -> str:
    """The hint for an optimizer / scheduler ``type`` written as a module path: one whose last part is a class
    DeepSpeed finds (``"torch.optim.AdamW"``) names that class; a project's own class (CogVideo's SAT configs'
    ``"sat.ops.FusedEmaAdam"``, which its training script builds itself) says DeepSpeed never imports a path and
    what to write instead. "" for a name without a dot, and for an unknown class under torch / deepspeed."""
    if "." not in name:
        return ""
    tail = name.rpartition(".")[2]
    if tail in known:
        return f" (write {tail!r}: DeepSpeed looks the bare class name up itself)"
    if name.split(".")[0] in ("torch", "deepspeed"):
        return ""  # a misspelt class of theirs ("torch.optim.Adamm"): the close-match hint says it
    optimizer = block == "optimizer"
    own = ("its own optimizers (Adam, AdamW, Adagrad, Lamb, Lion, ...) and torch.optim's classes" if optimizer
           else "its own schedulers and torch.optim.lr_scheduler's classes")
    instead = "dstrain builds AdamW from the run config" if optimizer else "dstrain runs its warm-up + cosine schedule"
    article = "an" if optimizer else "a"
    return (f" (a module path to a project's own class: DeepSpeed looks {article} {block} type up by bare name among "
            f"{own} and never imports a module; write one of those, or remove the {block} block and {instead})")
