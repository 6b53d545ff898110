"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE...): their expert weights, the share of them a
token runs through, and what ``dstrain plan`` says of them.

transformers (5.x) keeps each layer's experts as one module whose weights are 3-D tensors (``[experts, out, in]``,
``gate_up_proj`` and ``down_proj``), not ``nn.Linear`` modules; a token runs through ``num_experts_per_tok`` of them.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

TRACE_EXPERTS = "dstrain_trace"
"""The experts implementation of a policy built for planning (FakeTensorMode; see :func:`traceable_experts`)."""


def expert_modules(hf: nn.Module) -> Iterator[tuple[nn.Module, list[torch.Tensor]]]:
    """(module, its 3-D expert weights) of each experts module in ``hf`` (a module with an integer ``num_experts``
    owning parameters whose first dimension is that number). A ZeRO-3 partitioned weight is judged by its full shape
    (``ds_shape``: its own tensor is an empty or flat shard)."""
    def shape(p) -> tuple:
        return tuple(getattr(p, "ds_shape", p.shape))

    for module in hf.modules():
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or n < 2:
            continue
        weights = [p for p in module.parameters(recurse=False) if len(shape(p)) == 3 and shape(p)[0] == n]
        if weights:
            yield module, weights


def _per_token(config) -> int | None:
    """A config's experts per token (``num_experts_per_tok``; Ernie 4.5's ``moe_k``), or None."""
    for name in ("num_experts_per_tok", "moe_k"):
        k = getattr(config, name, None)
        if isinstance(k, int) and not isinstance(k, bool):
            return k
    return None


def experts_per_token(module: nn.Module, model_config=None) -> int:
    """How many of ``module``'s experts one token runs through: its own config's ``num_experts_per_tok``, else the
    model's (``model_config``: Llama-4's experts module keeps no config; counting all of its experts made the FLOPs
    of a top-1-of-16 model those of a dense one); all of them where neither says."""
    k = _per_token(getattr(module, "config", None))
    if k is None and model_config is not None:
        k = _per_token(model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config)
    return int(k) if isinstance(k, int) and 0 < k <= module.num_experts else int(module.num_experts)


def expert_params(hf: nn.Module) -> tuple[int, int]:
    """(expert weights in all, those one token runs through): each experts module's weights times
    ``num_experts_per_tok / num_experts``. ZeRO-3 partitioned weights count by their full size."""
    total = active = 0
    for module, weights in expert_modules(hf):
        n = sum(int(getattr(p, "ds_numel", p.numel())) for p in weights)
        total += n
        active += n * experts_per_token(module, getattr(hf, "config", None)) // module.num_experts
    return total, active


def router_params(hf: nn.Module) -> int:
    """The routers' weights (each a module with an integer ``num_experts`` owning a 2-D ``[experts, hidden]`` weight
    that is not an ``nn.Linear``, as transformers 5 builds Mixtral's, Qwen-MoE's and OLMoE's ``TopKRouter``): every
    token is multiplied by them. An experts module's own 2-D tensors are not routers (GPT-OSS's per-expert biases
    ``[experts, out]``: they counted as router weights). ZeRO-3 partitioned weights count by their full size."""
    experts = {id(m) for m, _ in expert_modules(hf)}
    total = 0
    for module in hf.modules():
        n = getattr(module, "num_experts", None)
        if not isinstance(n, int) or n < 2 or isinstance(module, nn.Linear) or id(module) in experts:
            continue
        for p in module.parameters(recurse=False):
            shape = tuple(getattr(p, "ds_shape", p.shape))
            if len(shape) == 2 and shape[0] == n:
                total += int(getattr(p, "ds_numel", p.numel()))
    return total


SAMPLING_ROUTERS = ("PhimoeTopKRouter",)
"""Routers that draw their experts at random in train mode: PhiMoE's SparseMixer picks each of its two experts by
Gumbel sampling among those whose score is within ``2 x router_jitter_noise`` (relative) of the best, where eval mode
takes the best; its ``router_jitter_noise`` is that threshold (eval mode uses it too), not noise."""


def _routing_as_in_eval(module: nn.Module, args) -> None:
    module.training = False


def deterministic_routers(hf: nn.Module) -> set[int]:
    """Make ``hf``'s :data:`SAMPLING_ROUTERS` route in train mode as in eval mode (a forward pre-hook clears their
    ``training`` flag; gradients still reach the router through the chosen experts' weights), as dropout is switched
    off: GRPO's train-mode log-probs must be the sampler's. Returns their ids (their ``router_jitter_noise`` is kept:
    it shapes eval-mode routing)."""
    ids = set()
    for module in hf.modules():
        if type(module).__name__ in SAMPLING_ROUTERS:
            if not getattr(module, "_dstrain_eval_routing", False):
                module.register_forward_pre_hook(_routing_as_in_eval)
                module._dstrain_eval_routing = True
            ids.add(id(module))
    return ids


def no_router_logits(hf: nn.Module) -> dict:
    """``{"output_router_logits": False}`` for a model whose config has that switch (a mixture of experts), else ``{}``.

    A ``config.json`` with ``output_router_logits: true`` made every forward compute the router's load-balancing
    loss; with a KV cache and an attention mask (batched generation) transformers' loss failed outright (the mask
    covers every past token, the router logits only the new one). Generation and scoring-only forwards ask for
    none; the training forward asks for it where :func:`router_aux_coef` is above 0 (see ``PolicyModel``)."""
    return router_logits(hf, False)


def router_logits(hf: nn.Module, on: bool) -> dict:
    """``{"output_router_logits": on}`` for a model whose config has that switch, else ``{}`` (a dense model's
    forward gets no extra argument)."""
    return {"output_router_logits": bool(on)} if hasattr(hf.config, "output_router_logits") else {}


def resolve_aux_coef(setting: float | None, output_router_logits: bool, config_coef) -> float:
    """The load-balancing loss coefficient a run trains with: ``setting`` (``model.args.router_aux_loss_coef``)
    where given, else the checkpoint's ``router_aux_loss_coef`` where its ``output_router_logits`` is true (what
    transformers adds to the loss then), else 0."""
    if setting is not None:
        return float(setting)
    if output_router_logits and isinstance(config_coef, (int, float)) and not isinstance(config_coef, bool):
        return float(config_coef)
    return 0.0


def computes_router_loss(hf: nn.Module) -> bool:
    """Whether ``hf``'s forward computes a router load-balancing loss when asked (``output_router_logits``): its
    config has the switch and its modeling code has transformers' ``load_balancing_loss_func``. DeepSeek-V2/V3,
    GLM-4-MoE and Llama-4 have the switch but no such loss (their ``aux_loss`` is None: DeepSeek-V3 and GLM-4-MoE
    balance their routers by a bias, not a loss)."""
    import sys

    if not hasattr(hf.config, "output_router_logits"):
        return False
    return hasattr(sys.modules.get(type(hf).__module__), "load_balancing_loss_func")


def router_aux_coef(setting: float | None, hf: nn.Module) -> float:
    """:func:`resolve_aux_coef` for a built transformers model (the config's coefficient only where its forward
    computes the loss: :func:`computes_router_loss`); a ValueError where ``setting`` asks for the loss of a model
    whose forward computes none (a dense model, a mixture of experts without that switch or without the loss)."""
    config = hf.config
    computes = computes_router_loss(hf)
    coef = resolve_aux_coef(setting, computes and bool(config.output_router_logits),
                            getattr(config, "router_aux_loss_coef", None))
    if coef > 0 and not computes:
        kind = "a mixture of experts" if any(True for _ in expert_modules(hf)) else "a dense model"
        why = ("transformers computes none for it" if hasattr(config, "output_router_logits")
               else "its config has no output_router_logits")
        raise ValueError(f"router_aux_loss_coef={coef}: {type(hf).__name__} is {kind} whose forward computes no "
                         f"router load-balancing loss ({why}); leave model.args.router_aux_loss_coef unset or 0")
    return coef


def _grouped_mm_traceable(self, *args, **kwargs):
    """transformers' ``grouped_mm`` experts forward with its portable grouped matmul (a custom op with a shape rule).

    ``torch._grouped_mm``'s shape rule accepts only bf16 while its CPU kernel runs fp32, so an fp32 model traced
    under FakeTensorMode (``dstrain plan``'s activation count) failed there; the portable op saves the same tensors
    for backward (the expert inputs and weights)."""
    from transformers.integrations import moe

    real = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda *a, **k: False
    try:
        return moe.grouped_mm_experts_forward(self, *args, **kwargs)
    finally:
        moe._can_use_grouped_mm = real


def traceable_experts(hf: nn.Module) -> bool:
    """Let ``hf``'s experts run under FakeTensorMode (for planning builds only); True where it has experts to switch.

    Only transformers' ``grouped_mm`` experts (what a real run uses) are switched, to :func:`_grouped_mm_traceable`."""
    if not any(True for _ in expert_modules(hf)):
        return False
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    if not (hasattr(moe, "_can_use_grouped_mm") and hasattr(moe, "grouped_mm_experts_forward")):
        return False
    config = hf.config
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return False
    moe.ALL_EXPERTS_FUNCTIONS[TRACE_EXPERTS] = _grouped_mm_traceable  # this interface's own entry, not a global one
    config._experts_implementation = TRACE_EXPERTS
    return True


def moe_fields(config: dict) -> dict | None:
    """A ``config.json``'s (text part's) mixture-of-experts fields: ``experts``, ``per_token`` and the router loss
    settings (``output_router_logits``, ``router_aux_loss_coef``); None for a dense model."""
    experts = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(config.get(k), int) and config[k] > 1), None)
    if experts is None:
        return None
    return {"experts": experts, "per_token": config.get("num_experts_per_tok", config.get("moe_k")),
            "output_router_logits": bool(config.get("output_router_logits")),
            "router_aux_loss_coef": config.get("router_aux_loss_coef")}
