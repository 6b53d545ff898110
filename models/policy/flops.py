"""The attention share of a Hugging Face causal LM's training FLOPs per token (the weights' share is
``PolicyModel.num_matmul_params``).

Softmax attention costs ``6 * heads * (qk_dim + v_dim) * seq_len`` per token and layer in training (the scores
``q.k`` and the weighted sum of values, forward and backward), in the layers that have it: a hybrid (Jamba, Bamba,
Zamba2, RecurrentGemma, LFM2, Qwen3-Next, Granite-MoE-hybrid) attends in some layers only and runs a recurrence,
convolution or linear attention (cost linear in the length, counted with their weights) in the others; a pure state
space model (Mamba, Mamba-2) has no softmax attention at all. Multi-latent attention (DeepSeek-V2/V3) has query/key
heads of ``qk_nope_head_dim + qk_rope_head_dim`` and value heads of ``v_head_dim``.
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


def attention_layers(hf: nn.Module) -> int:
    """How many layers of ``hf`` run softmax attention: per decoder layer, whether an attention module is among its
    submodules (a block shared by several layers, as Zamba2's, counts in each that calls it); where no layer list is
    found, the attention modules of the whole model."""
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    count = int(getattr(config, "num_hidden_layers", 0) or 0)
    layers = _layers(hf, count) if count else None
    if layers is None:
        return sum(1 for m in hf.modules() if _is_attention(m))
    return sum(1 for layer in layers if any(_is_attention(m) for m in layer.modules()))


def attention_flops_per_token(hf: nn.Module, seq_len: int) -> int:
    """Training FLOPs per token of ``hf``'s softmax attention at ``seq_len`` (0 for a model without any)."""
    n = attention_layers(hf)
    if n == 0:
        return 0
    c = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    heads = int(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    nope, rope = getattr(c, "qk_nope_head_dim", None), getattr(c, "qk_rope_head_dim", None)
    qk = int(nope + rope) if isinstance(nope, int) and isinstance(rope, int) else int(head_dim)
    v = getattr(c, "v_head_dim", None)
    v = int(v) if isinstance(v, int) else int(head_dim)
    return 6 * n * heads * (qk + v) * seq_len
