"""A Hugging Face causal LM wrapped for dstrain, and per-token log-probabilities.

:class:`PolicyModel` holds the ``transformers`` model in ``.hf`` and gives it the
interface dstrain's engine factory and LM trainer use (``forward(input_ids, targets)``
returning the loss, ``init_module`` for sharded initialisation, FLOP counts).
:func:`build_policy` builds or loads it, sharded at load time under ZeRO-3.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .config import PolicyConfig
from .hf_files import no_hf_bars
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

_CHUNK_ELEMENTS = 1 << 26
"""Logits elements converted to fp32 at a time by token_logprobs/token_entropy (256 MB)."""


# --------------------------------------------------------------------- log-probabilities
def _blocks(logits: torch.Tensor):
    """(row, start, end) blocks of the predicting positions 0..T-2, about _CHUNK_ELEMENTS each."""
    b, t, v = logits.shape
    step = max(1, _CHUNK_ELEMENTS // max(v, 1))
    for row in range(b):
        for start in range(0, t - 1, step):
            yield row, start, min(start + step, t - 1)


def _fp(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(logits: torch.Tensor, temperature: float) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")


class _NextTokenLogprob(torch.autograd.Function):
    """log softmax(logits[:, t] / temperature)[ids[:, t + 1]], a block of positions at a time.

    Saves only the logits (already alive) and one log-sum-exp per position; the
    backward pass recomputes the softmax block by block. Peak extra memory is one
    fp32 block, never a full fp32 copy of the logits.
    """

    @staticmethod
    def forward(ctx, logits, input_ids, temperature):
        b, t, _ = logits.shape
        dt = _fp(logits.dtype)
        out = logits.new_zeros((b, max(t - 1, 0)), dtype=dt)
        lse = torch.zeros_like(out)
        for row, s, e in _blocks(logits):
            x = logits[row, s:e].to(dt) / temperature
            lse[row, s:e] = torch.logsumexp(x, dim=-1)
            out[row, s:e] = x.gather(-1, input_ids[row, s + 1:e + 1, None]).squeeze(-1) - lse[row, s:e]
        ctx.save_for_backward(logits, input_ids, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        logits, input_ids, lse = ctx.saved_tensors
        temp = ctx.temperature
        grad_logits = torch.zeros_like(logits)
        for row, s, e in _blocks(logits):
            x = logits[row, s:e].to(lse.dtype) / temp
            g = grad[row, s:e, None].to(lse.dtype)
            block = torch.exp(x - lse[row, s:e, None]).mul_(-g)
            block.scatter_add_(-1, input_ids[row, s + 1:e + 1, None], g)
            grad_logits[row, s:e] = block.div_(temp)
        return grad_logits, None, None


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token: ``out[b, t] = log p(input_ids[b, t+1] | ..t)``.

    ``logits`` ``[B, T, V]`` from a forward over ``input_ids`` ``[B, T]``; returns fp32
    ``[B, T-1]`` (fp64 for fp64 logits) of ``log_softmax(logits / temperature)``
    gathered at the next token, as ``logit - logsumexp`` over blocks of positions
    (see :class:`_NextTokenLogprob`). Differentiable with respect to ``logits``.
    """
    _check(logits, temperature)
    if input_ids.shape != logits.shape[:2]:
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} != logits shape[:2] "
                         f"{tuple(logits.shape[:2])}")
    return _NextTokenLogprob.apply(logits, input_ids.long(), float(temperature))


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits[:, t] / temperature)`` for t < T-1: ``[B, T-1]``, fp32.

    Covers the same positions as :func:`token_logprobs` (the ones predicting a
    token of the sequence). Computed block by block in fp32; differentiable.
    """
    _check(logits, temperature)
    b, t, _ = logits.shape
    rows = [[] for _ in range(b)]
    for row, s, e in _blocks(logits):
        logp = F.log_softmax(logits[row, s:e].to(_fp(logits.dtype)) / temperature, dim=-1)
        rows[row].append(-(logp.exp() * logp).sum(-1))
    if t < 2:
        return logits.new_zeros((b, 0), dtype=_fp(logits.dtype))
    return torch.stack([torch.cat(r) for r in rows])


# --------------------------------------------------------------------- positions
def _rope_sets(cfg) -> list[dict]:
    """The rope parameter dicts of a transformers config (one per layer type where it has several)."""
    rp = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(rp, dict):
        return []
    if "rope_type" in rp or "type" in rp:
        return [rp]
    return [v for v in rp.values() if isinstance(v, dict)]


def rope_length_problem(config, length: int) -> str | None:
    """Why sequences of ``length`` tokens get other log-probs with a KV cache than without, else None.

    Rotary scaling of type ``dynamic`` (NTK) recomputes its frequencies from the longest position
    seen once a sequence passes ``max_position_embeddings``, and ``longrope`` switches to its long
    factors past ``original_max_position_embeddings``: generation with a KV cache keeps the keys it
    computed at shorter lengths, the training forward scores every token at the full length, so the
    sampled distribution is not the one the log-probs (GRPO's ratio and KL) are taken under.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    for rp in _rope_sets(cfg):
        kind = rp.get("rope_type", rp.get("type"))
        if kind == "dynamic":
            limit = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        elif kind in ("longrope", "su"):
            limit = int(rp.get("original_max_position_embeddings")
                        or getattr(cfg, "original_max_position_embeddings", 0) or 0)
        else:
            continue
        if limit and length > limit:
            return (f"the checkpoint's rotary scaling ({kind!r}, config.json rope_scaling) changes its frequencies "
                    f"for sequences past {limit} tokens, and {length} (prompt + max_new_tokens) would pass it: "
                    "tokens sampled with a KV cache and the same tokens scored without one would get different "
                    "log-probabilities (GRPO's ratio and KL would be off from the first step). Shorten "
                    f"task.max_new_tokens or the prompts to stay within {limit} tokens")
    return None


_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
"""Names transformers gives a learned absolute position table (GPT-2, GPT-BigCode, GPT-Neo: ``wpe``; OPT:
``embed_positions``, its rows offset by 2)."""


def learned_position_limit(hf: nn.Module) -> int | None:
    """The longest sequence a model with learned absolute positions can embed (its position table's rows less
    the table's ``offset``), or None for rotary / ALiBi models (no table, no hard limit)."""
    for name, module in hf.named_modules():
        if isinstance(module, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES:
            return int(module.num_embeddings) - int(getattr(module, "offset", 0) or 0)
    return None


def position_limit_problem(limit: int | None, length: int, what: str) -> str | None:
    """Why ``length`` tokens cannot go through a model whose position table holds ``limit`` rows, else None."""
    if limit is None or length <= limit:
        return None
    return (f"{what} is {length} tokens, past the {limit} positions the checkpoint has learnt embeddings for "
            "(config.json n_positions / max_position_embeddings: absolute positions, as in GPT-2 or OPT, have "
            f"none past them): keep prompt + task.max_new_tokens, or data.seq_len, within {limit}")


# --------------------------------------------------------------------- the module
def _normal_(param: torch.Tensor, std: float) -> None:
    """N(0, std) drawn in fp32 from the CPU generator, whatever the device and dtype of ``param``.

    So a build sharded on an accelerator (zero.Init, bf16) gets the numbers of a CPU build.
    """
    param.copy_(torch.empty(param.shape, dtype=torch.float32, device="cpu").normal_(0.0, std))


def is_partitioned(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are ZeRO-3 partitioned (carry ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


@functools.lru_cache(maxsize=64)
def _takes_position_ids(forward) -> bool:
    """Whether ``forward`` (a module's forward function) has a ``position_ids`` parameter; read once per function,
    not at every forward."""
    import inspect

    return "position_ids" in inspect.signature(forward).parameters


def positions_from_mask(module: nn.Module, attention_mask: torch.Tensor | None) -> dict:
    """``{"position_ids": ...}`` counted from each row's first real token, for a transformers
    module that takes them, else ``{}``.

    A left-padded row gets ``0..len-1`` on its tokens, as unpadded, where absolute-position
    models (GPT-2) would otherwise shift it by its padding; a right-padded (or unpadded)
    row keeps ``0..T-1``.
    """
    if attention_mask is None or not _takes_position_ids(getattr(module.forward, "__func__", module.forward)):
        return {}
    t = attention_mask.shape[-1]
    first = (attention_mask != 0).long().argmax(dim=-1, keepdim=True)  # leading padding per row
    return {"position_ids": (torch.arange(t, device=attention_mask.device) - first).clamp_(min=0)}


class PolicyModel(nn.Module):
    """A causal LM (``self.hf``, a ``transformers`` ``*ForCausalLM``) with dstrain's interface.

    ``forward(input_ids, targets=None, attention_mask=None)`` returns logits
    ``[B, T, V]``, or with ``targets`` (aligned with the logits: ``targets[b, t]`` is
    the token that should follow ``input_ids[b, t]``; -100 = ignore) the mean
    cross-entropy in fp32, plus ``router_aux_coef * router_aux_loss`` in a training forward of a
    mixture of experts whose coefficient is above 0 (as transformers adds it; a logits-returning
    forward leaves adding it to the trainer: see :func:`take_router_aux`). With an
    ``attention_mask`` the position ids count from each row's first real token
    (:func:`positions_from_mask`), so left- and right-padded rows score as unpadded ones
    (absolute positions included); without one they are ``0..T-1``.
    """

    def __init__(self, hf: nn.Module, config: PolicyConfig, weights_loaded: bool = False,
                 hf_ds_config=None):
        super().__init__()
        self.hf = hf
        self.config = config
        self.weights_loaded = weights_loaded
        """True when the weights came from a checkpoint (then init_module does nothing)."""
        self.hf_ds_config = hf_ds_config
        """transformers' HfDeepSpeedConfig used at load (kept alive: transformers holds a weakref)."""
        self._position_limit: int | None = -1
        self.router_aux_coef = 0.0
        """Weight of a mixture of experts' router load-balancing loss in training (0: not computed; set by
        :func:`build_policy` from ``config.router_aux_loss_coef`` and the checkpoint's config)."""
        self.router_aux_loss: torch.Tensor | None = None
        """That loss (coefficient-free, with its graph) of the last training forward (train mode, gradients on)
        where the coefficient is above 0, else None. Over the real tokens: ``attention_mask``'s ones."""

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if self._position_limit == -1:  # read once: the position table never changes
            self._position_limit = learned_position_limit(self.hf)
        if (why := position_limit_problem(self._position_limit, input_ids.shape[1], "the sequence")):
            raise ValueError(why)
        from .moe import router_logits

        aux = self.router_aux_coef > 0 and self.training and torch.is_grad_enabled()
        extra = {**positions_from_mask(self.hf, attention_mask), **router_logits(self.hf, aux)}
        out = self.hf(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        if aux or self.router_aux_loss is not None:  # a dense model's forward sets nothing
            self.router_aux_loss = out.aux_loss if aux else None
        if targets is None:
            return out.logits
        if targets.shape != input_ids.shape:
            raise ValueError(f"targets shape {tuple(targets.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        loss = F.cross_entropy(out.logits.float().reshape(-1, out.logits.size(-1)),
                               targets.reshape(-1).long(), ignore_index=-100)
        return loss if self.router_aux_loss is None else loss + self.router_aux_coef * self.router_aux_loss.float()

    # --- initialisation ----------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every module in ``named_modules`` order (see :meth:`init_module`)."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """Initialise the parameters ``module`` owns directly, from the global torch RNG.

        Linear and Embedding weights ~ N(0, initializer_range) (the padding row
        zeroed), biases 0, RMSNorm gains 1 (transformers' Llama scheme); an output
        head tied to the embedding is left alone. Replayed per module on gathered
        parameters by dstrain's factory under ``zero.Init`` (same numbers as an
        unsharded build). Does nothing when the weights came from a checkpoint.
        """
        if self.weights_loaded or any(p.is_meta for p in module.parameters(recurse=False)):
            return
        std = getattr(self.hf.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            if module is self.hf.get_output_embeddings() and self._tied():
                return
            _normal_(module.weight, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            _normal_(module.weight, std)
            if module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
        elif "RMSNorm" in type(module).__name__ or "LayerNorm" in type(module).__name__:
            for pname, p in module.named_parameters(recurse=False):
                (nn.init.ones_ if pname == "weight" else nn.init.zeros_)(p)

    def _tied(self) -> bool:
        out, emb = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        return out is not None and out.weight is emb.weight

    # --- sizes and behaviour ---------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.hf.config.hidden_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf.config.num_hidden_layers)

    def num_params(self) -> int:
        """Distinct parameters (a tied head counted once)."""
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters())

    def num_matmul_params(self) -> int:
        """Weights a token is multiplied by: every ``nn.Linear`` (attention, MLP and output head, tied or not) and
        transformers' ``Conv1D`` (GPT-2's projections: a Linear with its weight transposed) and, in a mixture of
        experts, the routers' weights and the share of the 3-D expert weights its ``num_experts_per_tok`` experts
        hold."""
        from transformers.pytorch_utils import Conv1D

        from .moe import expert_params, router_params

        return (sum(getattr(p, "ds_numel", p.numel()) for m in self.modules()
                    if isinstance(m, (nn.Linear, Conv1D)) for p in m.parameters(recurse=False))
                + router_params(self.hf) + expert_params(self.hf)[1])

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: ``6 * matmul params + 12 * layers * heads * head_dim * seq_len``, the second
        term over the layers with softmax attention only, over the keys each layer's sliding window or chunk lets a
        query see (:func:`~models.policy.flops.attention_flops_per_token`; 0 for Mamba)."""
        from .flops import attention_flops_per_token

        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        return 6 * self.num_matmul_params() + attention_flops_per_token(self.hf, seq_len)

    def set_activation_checkpointing(self, flag: bool) -> None:
        """transformers' activation (gradient) checkpointing per decoder layer, non-reentrant.

        Active in training mode only (transformers' rule); generation is unaffected.
        """
        hf = self.hf
        if hasattr(hf, "activation_checkpointing_enable"):  # the names of transformers >= 5.2x
            enable, disable = hf.activation_checkpointing_enable, hf.activation_checkpointing_disable
        else:
            enable, disable = hf.gradient_checkpointing_enable, hf.gradient_checkpointing_disable
        if flag:
            enable({"use_reentrant": False})
        elif self.activation_checkpointing:
            disable()

    @property
    def activation_checkpointing(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) for m in self.hf.modules())


# --------------------------------------------------------------------- building
def is_zero3(ds_config: Mapping | None) -> bool:
    return bool(ds_config) and int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


def llama_config(cfg: PolicyConfig):
    """The ``transformers.LlamaConfig`` of a policy built from ``cfg``'s fields."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_positions,
        rope_theta=cfg.rope_theta, attention_dropout=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, initializer_range=0.02, rms_norm_eps=1e-6, attention_bias=False,
        mlp_bias=False)


class _Zero3Config:
    """Stand-in for ``HfDeepSpeedConfig`` where ``accelerate`` (its base class) is not installed."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return is_zero3(self.config)


@contextlib.contextmanager
def _hf_deepspeed(ds_config: Mapping | None):
    """transformers' ZeRO-3 switch for one load: set (yielding the object to keep alive) or off.

    transformers decides whether from_pretrained/from_config build under
    ``deepspeed.zero.Init`` from a process-global weak reference to an
    ``HfDeepSpeedConfig``. A load without a stage-3 config switches it off for its
    duration (so e.g. a CPU reference model is never partitioned by the trained
    policy's setting) and restores it afterwards.
    """
    from transformers.integrations import deepspeed as hfds

    if ds_config is not None:
        try:
            yield hfds.HfDeepSpeedConfig(dict(ds_config))  # registers itself globally
        except ImportError:  # it needs `accelerate`; transformers reads only .config and .is_zero3()
            marker = _Zero3Config(dict(ds_config))
            hfds.set_hf_deepspeed_config(marker)
            yield marker
        return
    previous = hfds._hf_deepspeed_config_weak_ref
    hfds.unset_hf_deepspeed_config()
    try:
        yield None
    finally:
        if previous is not None and previous() is not None:
            hfds.set_hf_deepspeed_config(previous())


def _inside_zero_init() -> bool:
    try:
        from deepspeed.runtime.zero import partition_parameters as pp
    except ImportError:
        return False
    return pp.zero_init_context > 0


def _abstract_device() -> bool:
    """Building on the meta device or under FakeTensorMode (the factory's planning builds)."""
    probe = torch.empty(0)
    return probe.is_meta or type(probe).__name__ == "FakeTensor"


def _fix_rope_buffers(hf: nn.Module) -> None:
    """Recompute rotary frequency buffers outside ``zero.Init`` (it may cast them to 16 bits)."""
    from deepspeed.runtime.zero.partition_parameters import restore_init_context, shutdown_init_context

    for module in hf.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "config"):
            shutdown_init_context()
            try:
                fresh = type(module)(module.config)
            finally:
                restore_init_context()
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf.to(getattr(module, name).device))


def set_dropout(hf: nn.Module, p: float) -> int:
    """Set every dropout probability inside ``hf`` to ``p``; returns how many were changed.

    Covers ``nn.Dropout`` modules (GPT-2's ``attn_pdrop``/``resid_pdrop``/``embd_pdrop``)
    and the float attributes modules pass to functional dropout or attention
    (``attention_dropout``, OPT's ``dropout``, Phi's ``resid_pdrop``...). A mixture of
    experts' router jitter (Mixtral's ``router_jitter_noise``: hidden states scaled by
    random factors before routing, in train mode) is switched off, whatever ``p``: like
    dropout it made train-mode log-probs differ from the sampler's. PhiMoE's routers sample
    their experts in train mode: they route as in eval mode (its ``router_jitter_noise``, a
    routing threshold there, is kept; ``moe.deterministic_routers``). The checkpoint's
    ``config.json`` is left as it is.
    """
    from .moe import deterministic_routers

    changed, sampling = 0, deterministic_routers(hf)  # PhiMoE: routes as in eval mode, its threshold kept
    for module in hf.modules():
        if isinstance(module, nn.Dropout):
            changed += module.p != p
            module.p = p
            continue
        for name, value in list(vars(module).items()):
            if not isinstance(value, float) or (id(module) in sampling and name == "router_jitter_noise"):
                continue
            want = 0.0 if "jitter" in name else p if ("dropout" in name or "pdrop" in name) else value
            if value != want:
                setattr(module, name, want)
                changed += 1
    return changed


def attention_implementation(hf_config) -> str:
    """The attention transformers runs for ``hf_config``: ``"sdpa"`` (PyTorch's fused kernels), or
    ``"eager"`` where the architecture has no SDPA path (Gemma-2, whose attention logits are soft-capped,
    Bloom, MPT: ``from_pretrained`` refuses ``sdpa`` for them)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", True) is not False else "eager"


def missing_weights_problem(path: str, hf_cfg, missing) -> str | None:
    """Why a checkpoint whose files lack some of the model's weights cannot be the policy, else None.

    transformers fills weights missing from the files with random numbers and only logs a table: a reward model or
    classifier (``LlamaForSequenceClassification``: a ``score`` head, no ``lm_head``), a bare ``LlamaModel``, or an
    untied checkpoint saved without its ``lm_head`` loaded with a random output head and trained from it."""
    missing = sorted(missing or ())
    if not missing:
        return None
    archs = [a for a in (getattr(hf_cfg, "architectures", None) or []) if isinstance(a, str)]
    other = [a for a in archs if not a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))]
    why = (f"config.json architectures names {', '.join(other)}, not a causal language model: its output head is "
           "not a next-token head" if other else
           "an incomplete checkpoint (an untied output head needs lm_head.weight; tie_word_embeddings in "
           "config.json says whether it is tied)")
    return (f"{path}: {len(missing)} weight(s) of the causal LM are not in the checkpoint's files "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}) and would start random: {why}")


# A stage-3 config for transformers when an outer zero.Init (the factory's) already partitions.
_NESTED_ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def build_policy(cfg: PolicyConfig, ds_config: Mapping | None = None) -> PolicyModel:
    """Build (``cfg.path`` empty) or load (``cfg.path`` set) a :class:`PolicyModel` in fp32.

    ZeRO-3 (``ds_config`` with ``zero_optimization.stage == 3``): an
    ``HfDeepSpeedConfig`` is created first and kept on the model, so transformers
    constructs under ``deepspeed.zero.Init`` and, from a checkpoint, loads each
    tensor into its shards: no rank ever holds a full copy. Every rank must call
    this together. Built from config, weights equal an unsharded build from the same
    seed (rank 0 initialises each gathered module). Called inside an outer
    ``zero.Init`` (dstrain's factory with ``shard_at_build``) the model is partitioned
    by it; the caller replays :meth:`PolicyModel.init_module` (a no-op for loaded
    weights). On the meta device / under FakeTensorMode only the architecture is built.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    abstract, outer = _abstract_device(), _inside_zero_init()
    zero3 = is_zero3(ds_config) and not abstract
    hf_cfg = AutoConfig.from_pretrained(cfg.path, local_files_only=True) if cfg.path else llama_config(cfg)
    kw = dict(dtype=torch.float32, attn_implementation=attention_implementation(hf_cfg))
    if cfg.path and not abstract:
        if outer and not zero3:
            ds_config, zero3 = _NESTED_ZERO3, True
        with _hf_deepspeed(ds_config if zero3 else None) as hf_ds, no_hf_bars():
            hf, info = AutoModelForCausalLM.from_pretrained(cfg.path, local_files_only=True, output_loading_info=True,
                                                            **kw)
        if (why := missing_weights_problem(cfg.path, hf_cfg, info.get("missing_keys"))):
            raise ValueError(why)
        set_dropout(hf, cfg.dropout)  # RL needs the same log-probs in train and eval mode
        model = PolicyModel(hf, cfg, weights_loaded=True, hf_ds_config=hf_ds)
    else:
        # fork_rng: under ZeRO-3 transformers initialises on rank 0 only; init_module draws next
        with _hf_deepspeed(ds_config if zero3 else None) as hf_ds, no_init_weights(), \
                torch.random.fork_rng(devices=[]):
            hf = AutoModelForCausalLM.from_config(hf_cfg, **kw)
        hf.tie_weights()  # no_init_weights also skipped the tying
        if abstract:  # planning: experts that FakeTensorMode can trace
            from .moe import traceable_experts
            traceable_experts(hf)
        if cfg.path:
            set_dropout(hf, cfg.dropout)
        model = PolicyModel(hf, cfg, weights_loaded=False, hf_ds_config=hf_ds)
        if not is_partitioned(model):
            model.reset_parameters()
        elif not outer:
            import deepspeed

            for name, module in model.named_modules():
                params = list(module.parameters(recurse=False))
                if params:
                    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                        model.init_module(name, module)
    if is_partitioned(model) or outer:
        _fix_rope_buffers(model.hf)
    from .moe import router_aux_coef
    model.router_aux_coef = router_aux_coef(cfg.router_aux_loss_coef, model.hf)
    return model


def take_router_aux(module) -> tuple[torch.Tensor | None, float]:
    """(the router load-balancing loss of ``module``'s last training forward, or None; its coefficient), the loss
    cleared from the module. A trainer adds ``coef * loss`` to its own loss (any model without one: ``(None, 0)``).
    The loss is a copy (differentiable): under CUDA graphs (``compile_mode`` reduce-overhead) the module's tensor
    is the graph's output memory, which the next forward's replay rewrites (SCoRe runs two before using either)."""
    aux = getattr(module, "router_aux_loss", None)
    if aux is not None:
        module.router_aux_loss = None
        aux = aux.clone()
    return aux, float(getattr(module, "router_aux_coef", 0.0) or 0.0)
