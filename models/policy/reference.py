"""The frozen reference policy of the KL term, on the CPU or in an inference-only DeepSpeed engine.

Placement (``placement=``):

* ``"cpu"``: a plain module on the CPU in eval mode with ``requires_grad=False``.
  Inputs are moved to the CPU and the log-probs back to the caller's device. Costs
  host RAM (a full fp32 copy per rank) and CPU time, no accelerator memory.
* ``"engine"``: ``deepspeed.initialize`` without optimizer. If the trained policy
  uses ZeRO-3, the reference does too, with its parameters offloaded to the CPU
  (``offload_param``), partitioned over the ranks and gathered layer by layer on
  the accelerator during the forward; otherwise a plain stage-0 engine (one full
  copy on each device). The JSON comes from :func:`reference_ds_config`. Its
  forward is collective under ZeRO-3: every rank must call ``token_logprobs`` the
  same number of times.

Initial weights: the reference must equal the trained policy at step 0. With
``cfg.path`` both load the same checkpoint. Built from config there is no
checkpoint, so the caller passes either ``state_dict=`` (exact whatever happened
before: take :func:`~models.policy.model.full_state_dict` of the policy right after
it was built, before any step) or ``seed=`` (the reference is built after
``torch.manual_seed(seed)``, which reproduces a policy built right after seeding
with the same seed, as dstrain's trainers do; cheaper, but only as exact as that
promise). Building never changes the caller's RNG state.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from .config import PolicyConfig
from .model import PolicyModel, build_policy, is_partitioned, is_zero3, token_logprobs

PLACEMENTS = ("cpu", "engine")


def reference_ds_config(train_ds_config: Mapping | None = None, *, pin_memory: bool = False) -> dict:
    """DeepSpeed JSON of the reference's inference-only engine, from the trained policy's JSON.

    ZeRO stage 3 with ``offload_param`` to the CPU when the policy trains at stage 3,
    else stage 0; the policy's bf16/fp16 setting is kept; micro-batch as the policy's
    (1 if absent or "auto"), gradient accumulation 1. No optimizer or scheduler.
    """
    train = dict(train_ds_config or {})
    micro = train.get("train_micro_batch_size_per_gpu", 1)
    zero: dict = {"stage": 0}
    if is_zero3(train):
        zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": bool(pin_memory)}}
    cfg = {"train_micro_batch_size_per_gpu": micro if isinstance(micro, int) else 1,
           "gradient_accumulation_steps": 1, "zero_optimization": zero,
           "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    for key in ("bf16", "fp16"):
        if (train.get(key) or {}).get("enabled") is True:
            cfg[key] = {"enabled": True}
    return cfg


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``model.state_dict()``, gathered first if ZeRO-3 partitioned (collective)."""
    if not is_partitioned(model):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict into ``model``, module by module under ZeRO-3."""
    if not is_partitioned(model):
        model.load_state_dict(dict(state))
        return
    import deepspeed

    missing = set(model.state_dict()) - set(state)
    if missing:
        raise KeyError(f"state dict lacks {sorted(missing)[:5]}")
    for prefix, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                for pname, p in params:
                    p.data.copy_(state[f"{prefix}.{pname}" if prefix else pname])


def save_pretrained(model: PolicyModel, directory: str, tokenizer=None) -> None:
    """Write a Hugging Face checkpoint of ``model`` (and ``tokenizer``) that ``path=`` loads.

    Gathers first under ZeRO-3 (collective: every rank calls it); rank 0 writes. The weights are
    written as the model holds them (fp32 when training); where that is not the dtype its checkpoint
    came in (bf16, fp16), ``config.json`` keeps that one as ``dstrain_export_dtype``, so that a run that
    starts from this folder (a warm start) still exports in the user's dtype.
    """
    import torch.distributed as dist

    from .hf_files import EXPORT_DTYPE_KEY, declared_dtype

    state = full_state_dict(model)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    source = declared_dtype(model.config.path) if model.config.path else torch.float32
    written = next(v.dtype for v in state.values() if v.is_floating_point())
    before = model.hf.config.to_dict().get(EXPORT_DTYPE_KEY)  # read from a folder written like this one
    if hasattr(model.hf.config, EXPORT_DTYPE_KEY):
        delattr(model.hf.config, EXPORT_DTYPE_KEY)
    if source != written:
        setattr(model.hf.config, EXPORT_DTYPE_KEY, str(source).replace("torch.", ""))
    from .hf_files import no_hf_bars
    try:
        with no_hf_bars():
            model.hf.save_pretrained(directory, state_dict={k[len("hf."):]: v for k, v in state.items()})
    finally:
        if hasattr(model.hf.config, EXPORT_DTYPE_KEY):
            delattr(model.hf.config, EXPORT_DTYPE_KEY)
        if before is not None:
            setattr(model.hf.config, EXPORT_DTYPE_KEY, before)
    _usual_file_mode(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def _usual_file_mode(directory: str) -> None:
    """Give the weight files ``save_pretrained`` wrote the mode any new file gets here: safetensors creates
    them 0600, and a checkpoint folder is for others to load (a warm start, ``dstrain export``)."""
    import os
    from pathlib import Path

    mask = os.umask(0)
    os.umask(mask)
    for f in Path(directory).glob("*.safetensors"):
        os.chmod(f, 0o666 & ~mask)


def export_pretrained(state: Mapping[str, torch.Tensor], config, directory: str) -> None:
    """Write consolidated weights (the policy's ``hf.``-prefixed names) as a Hugging Face checkpoint.

    The architecture, tokenizer and generation config come from ``config`` (its ``path``
    checkpoint, else the Llama-style build and the byte tokenizer); the folder loads
    with ``path=directory`` or ``AutoModelForCausalLM.from_pretrained``. An output head
    tied to the embedding may be absent from ``state``. The weights are written in the dtype the
    ``path`` checkpoint declares (``config.json`` ``dtype``/``torch_dtype``: a bf16 checkpoint comes
    back bf16, not twice its size in the fp32 that training kept), fp32 without one.
    """
    from .hf_files import declared_dtype
    from .model import build_policy
    from .tokenizer import load_tokenizer

    model = build_policy(config)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    head = model.hf.get_output_embeddings()
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)
            if head is not None and p is head.weight and model._tied()}
    if unexpected or set(missing) - tied:
        raise KeyError(f"weights do not fit the policy of {config.path or 'the config'}: missing "
                       f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if config.path:
        model.to(declared_dtype(config.path))
    save_pretrained(model, directory, load_tokenizer(config))


class ReferencePolicy:
    """A frozen copy of the initial policy: ``token_logprobs(input_ids, attention_mask, temperature)``."""

    def __init__(self, module: PolicyModel, placement: str, engine=None):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.module, self.placement, self.engine = module, placement, engine

    @classmethod
    def from_policy_config(cls, cfg: PolicyConfig, placement: str = "cpu",
                           train_ds_config: Mapping | None = None, *,
                           state_dict: Mapping[str, torch.Tensor] | None = None,
                           seed: int | None = None) -> "ReferencePolicy":
        """Build the reference of the policy described by ``cfg`` (see the module docstring).

        Raises:
            ValueError: unknown placement, or a built-from-config policy with neither
                ``state_dict`` nor ``seed``.
        """
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        if not cfg.path and state_dict is None and seed is None:
            raise ValueError("a reference of a policy built from config (path empty) needs "
                             "state_dict= (the policy's initial weights) or seed=")
        ds_config = reference_ds_config(train_ds_config) if placement == "engine" else None
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            module = build_policy(cfg, ds_config)
        if state_dict is not None and not cfg.path:
            load_full_state_dict(module, state_dict)
        module.requires_grad_(False)
        module.eval()
        if placement == "cpu":
            return cls(module.to("cpu"), placement)
        import deepspeed

        engine, *_ = deepspeed.initialize(model=module, config=ds_config)
        engine.eval()
        return cls(module, placement, engine)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.engine is None else self.engine.device

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, V]`` on the reference's device."""
        ids = input_ids.to(self.device)
        mask = attention_mask.to(self.device) if attention_mask is not None else None
        run = self.module if self.engine is None else self.engine
        return run(ids, attention_mask=mask)

    @torch.no_grad()
    def token_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       temperature: float = 1.0) -> torch.Tensor:
        """``[B, T-1]`` fp32 log-probs of each next token (see ``token_logprobs``), on ``input_ids``' device."""
        logits = self.logits(input_ids, attention_mask)
        out = token_logprobs(logits, input_ids.to(logits.device), temperature)
        return out.to(input_ids.device)
