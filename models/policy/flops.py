"""The attention share of a Hugging Face causal LM's training FLOPs per token (the weights' share is
``PolicyModel.num_matmul_params``).

Softmax attention costs ``6 * heads * (qk_dim + v_dim)`` per (query, key) pair in training (the scores ``q.k``
and the weighted sum of values, forward and backward), in the layers that have it: a hybrid (Jamba, Bamba, Zamba2,
RecurrentGemma, LFM2, Qwen3-Next, Granite-MoE-hybrid) attends in some layers only and runs a recurrence,
convolution or linear attention (cost linear in the length, counted with their weights) in the others; a pure state
space model (Mamba, Mamba-2) has no softmax attention at all. Multi-latent attention (DeepSeek-V2/V3) has query/key
heads of ``qk_nope_head_dim + qk_rope_head_dim`` and value heads of ``v_head_dim``.

The pairs are counted per layer from the mask transformers builds for it (:func:`layer_masks`): a full layer joins
every query to every key; a sliding-window layer (Mistral, Phi-3, Starcoder2's ``sliding_window``; the
``sliding_attention`` layers of Gemma-2/3, GPT-OSS, Cohere-2, Qwen2/3 with ``use_sliding_window`` from
``max_window_layers`` on; RecurrentGemma's attention blocks) joins a query to the ``sliding_window - 1`` keys before
it; a chunked layer (Llama-4's ``chunked_attention`` layers) to the keys of its own ``attention_chunk_size`` chunk.
As in PaLM's count (``6 N + 12 L d T``, which dstrain's other models use too), the causal half is not taken off:
every pair the mask joins counts in either direction (a full layer: ``T * T`` pairs; a window ``w``: the band
``|i - j| < w``; a chunk: its square), so at a length within the window the count is PaLM's.
"""

from __future__ import annotations

from torch import nn


def _is_attention(module: nn.Module) -> bool:
    """A softmax attention module, as transformers names them (``LlamaAttention``, ``GPT2Attention``,
    ``DeepseekV3Attention``, ``RecurrentGemmaSdpaAttention``...); linear attention, recurrences and convolutions
    (``Qwen3NextGatedDeltaNet``, ``MambaMixer``, ``Lfm2ShortConv``, ``RecurrentGemmaRglru``) are not."""
    name = type(module).__name__
    return name.endswith("Attention") and "Linear" not in name


def _layers(hf: nn.Module, count: int) -> nn.ModuleList | None:
    """The decoder layers: the first ``nn.ModuleList`` of ``count`` entries."""
    for module in hf.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    return None


def _text_config(hf: nn.Module):
    return hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config


def _attending(hf: nn.Module) -> list[bool] | None:
    """Per decoder layer, whether an attention module is among its submodules (a block shared by several layers,
    as Zamba2's, counts in each that calls it); None where no layer list is found."""
    count = int(getattr(_text_config(hf), "num_hidden_layers", 0) or 0)
    layers = _layers(hf, count) if count else None
    if layers is None:
        return None
    return [any(_is_attention(m) for m in layer.modules()) for layer in layers]


def attention_layers(hf: nn.Module) -> int:
    """How many layers of ``hf`` run softmax attention (see :func:`_attending`); where no layer list is found, the
    attention modules of the whole model."""
    flags = _attending(hf)
    if flags is None:
        return sum(1 for m in hf.modules() if _is_attention(m))
    return sum(flags)


def _positive(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def layer_masks(config, count: int) -> list[tuple[str, int | None]]:
    """Per decoder layer of a text config, the mask its attention runs under: ``("full", None)``, ``("sliding",
    w)`` (a query sees itself and the ``w - 1`` keys before it) or ``("chunked", c)`` (the keys of its own chunk of
    ``c`` positions, up to itself). ``layer_types`` (transformers' per-layer list) decides where the config has one;
    otherwise a ``sliding_window`` (Mistral, Phi-3, Starcoder2, Mixtral: every layer) or RecurrentGemma's
    ``attention_window_size``; GPT-Neo's ``attention_layers`` ("local": its ``window_size``)."""
    window = _positive(getattr(config, "sliding_window", None))
    chunk = _positive(getattr(config, "attention_chunk_size", None))
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == count:
        return [("sliding", window) if t == "sliding_attention" and window else
                ("chunked", chunk) if t == "chunked_attention" and chunk else ("full", None) for t in types]
    neo = getattr(config, "attention_layers", None)
    if isinstance(neo, (list, tuple)) and len(neo) == count and _positive(getattr(config, "window_size", None)):
        return [("sliding", config.window_size) if t == "local" else ("full", None) for t in neo]
    window = window or _positive(getattr(config, "attention_window_size", None))
    return [("sliding", window) if window else ("full", None)] * count


def mask_pairs(kind: str, size: int | None, seq_len: int) -> int:
    """(query, key) pairs a layer's mask joins over ``seq_len`` positions, each counted in both directions (the
    causal half not taken off, as PaLM counts): full ``T * T``; sliding window ``w``: pairs with ``|i - j| < w``;
    chunks of ``c``: the sum of the chunks' squares."""
    t = int(seq_len)
    if kind == "sliding" and size and size < t:
        return (2 * size - 1) * t - size * (size - 1)
    if kind == "chunked" and size and size < t:
        full, rest = divmod(t, size)
        return full * size * size + rest * rest
    return t * t


def attention_flops_per_token(hf: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token of ``hf``'s softmax attention over sequences of ``seq_len`` tokens: ``6 * heads *
    (qk_dim + v_dim)`` times the pairs of every attention layer's mask (:func:`mask_pairs`), over ``seq_len``
    (rounded; 0 for a model without attention)."""
    c = _text_config(hf)
    flags = _attending(hf)
    if flags is None:  # no layer list: every attention module a full layer
        masks = [("full", None)] * attention_layers(hf)
    else:
        masks = [m for m, on in zip(layer_masks(c, len(flags)), flags) if on]
    if not masks:
        return 0
    heads = int(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    nope, rope = getattr(c, "qk_nope_head_dim", None), getattr(c, "qk_rope_head_dim", None)
    qk = int(nope + rope) if isinstance(nope, int) and isinstance(rope, int) else int(head_dim)
    v = getattr(c, "v_head_dim", None)
    v = int(v) if isinstance(v, int) else int(head_dim)
    pairs = sum(mask_pairs(kind, size, seq_len) for kind, size in masks)
    return (6 * heads * (qk + v) * pairs + seq_len // 2) // seq_len
