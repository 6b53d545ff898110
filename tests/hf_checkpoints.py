"""Tiny random-weight Hugging Face checkpoints of real architectures, built locally.

``build_checkpoint(kind, out_dir, **tokenizer_options)`` writes a ``save_pretrained``
directory (model + tokenizer + generation config) that ``--model.args.path`` loads.
Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a small text (or a
SentencePiece-style Unigram / BPE with byte fallback, :func:`build_sp_tokenizer`).
Each build takes well under a second.
"""

from __future__ import annotations

import os

import torch

TEXT = ("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
        "The quick brown fox jumps over the lazy dog. 0123456789 = + - * / ( ) [ ] { } : ;\n"
        "for i in range(10):\n    x = x * 2 + i\n") * 4

# kind -> (transformers class, config class, config kwargs)
_ARCHS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",
             dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "llama": ("LlamaForCausalLM", "LlamaConfig",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "mistral": ("MistralForCausalLM", "MistralConfig",
                dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     sliding_window=None)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=256)),
    "opt": ("OPTForCausalLM", "OPTConfig",
            dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                 word_embed_proj_dim=32, max_position_embeddings=256)),
    "phi": ("PhiForCausalLM", "PhiConfig",
            dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=256)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config",
             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256)),
    # round 4: soft-capped Gemma-2 (no SDPA path), Gemma-3 text, Qwen3 (q/k norms), StableLM (partial rotary),
    # Falcon (new decoder, GQA), GPT-J (rotary_dim), Bloom and MPT (ALiBi, no SDPA), Cohere (logit_scale),
    # OLMo-2, Granite (its multipliers), SmolLM3 (layers without rotary), GPT-BigCode (MQA, learned positions)
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=256,
                    sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=256,
                    sliding_window=4, final_logit_softcapping=3.0)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256)),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig",
                 dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)),
    "falcon": ("FalconForCausalLM", "FalconConfig",
               dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
                    num_kv_heads=2)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=4)),
    "mpt": ("MptForCausalLM", "MptConfig", dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=256)),
    "cohere": ("CohereForCausalLM", "CohereConfig",
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, logit_scale=0.5)),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)),
    "granite": ("GraniteForCausalLM", "GraniteConfig",
                dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, embedding_multiplier=2.0,
                     logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config",
                dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, no_rope_layer_interval=2)),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig",
                    dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, multi_query=True)),
    # round 6: mixture-of-experts (top-2 of 4 experts, fused 3-D expert weights in transformers 5), Qwen2-MoE
    # with a shared expert, Qwen3-MoE, OLMoE
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=32)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, max_position_embeddings=256, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2)),
    # round 7: hybrid / recurrent caches (Mamba, Mamba-2, Jamba, Bamba, Falcon-H1, Zamba2, RecurrentGemma, LFM2,
    # Qwen3-Next's linear attention, Granite-MoE-hybrid), multi-latent attention and grouped routers (DeepSeek-V2/V3,
    # GLM-4-MoE), Ernie 4.5 MoE, GPT-OSS (attention sinks, sliding window), Phi-MoE, Llama-4 text (chunked attention)
    "mamba": ("MambaForCausalLM", "MambaConfig",
              dict(hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4, time_step_rank=4)),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config",
               dict(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1,
                    expand=2, conv_kernel=4, chunk_size=8)),
    "jamba": ("JambaForCausalLM", "JambaConfig",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                   expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                   mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, max_position_embeddings=256)),
    "bamba": ("BambaForCausalLM", "BambaConfig",
              dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                   mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=256)),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config",
                  dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                       mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
                       max_position_embeddings=256)),
    "zamba2": ("Zamba2ForCausalLM", "Zamba2Config",
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_d_conv=4,
                    mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4, chunk_size=8, num_mem_blocks=1,
                    adapter_rank=8, use_mamba_kernels=False, max_position_embeddings=256)),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=1, lru_width=32, attention_window_size=8, conv1d_width=4,
                             block_types=["recurrent", "attention"])),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config",
             dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "full_attention"], conv_L_cache=3,
                  block_auto_adjust_ff_dim=False, max_position_embeddings=256)),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                        layer_types=["linear_attention", "full_attention"], max_position_embeddings=256)),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                         dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              shared_intermediate_size=32, layer_types=["mamba", "attention"], mamba_n_heads=4,
                              mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                              mamba_chunk_size=8, max_position_embeddings=256)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config",
                    dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, topk_method="group_limited_greedy",
                         first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                         qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=256)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                         max_position_embeddings=256)),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeConfig",
                 dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, n_shared_experts=1,
                      num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                      max_position_embeddings=256)),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
                     dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4, moe_k=2,
                          moe_num_shared_experts=1, moe_layer_start_index=1, max_position_embeddings=256)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig",
                dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256)),
    "phimoe": ("PhimoeForCausalLM", "PhimoeConfig",
               dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)),
    "llama4": ("Llama4ForCausalLM", "Llama4TextConfig",
               dict(hidden_size=32, intermediate_size=16, intermediate_size_mlp=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
                    max_position_embeddings=256)),
}

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def available() -> list[str]:
    """The kinds whose classes the installed transformers has."""
    import transformers

    return [k for k, (m, c, _) in _ARCHS.items() if hasattr(transformers, m) and hasattr(transformers, c)]


def build_tokenizer(vocab: int = 300, *, pad: str | None = "<pad>", eos: str = "<|endoftext|>",
                    bos: str | None = None, add_bos: bool = False, add_eos: bool = False, chat: bool = False,
                    padding_side: str = "right", extra_special: tuple[str, ...] = ()):
    """A byte-level BPE trained on :data:`TEXT`, as a ``PreTrainedTokenizerFast``.

    ``pad`` None: no pad token; ``pad == eos``: pad is the EOS token. ``add_bos``:
    a post-processor puts ``bos`` in front of every encoding (as Llama's tokenizers do); ``add_eos``:
    it also appends ``eos`` (a Llama tokenizer saved with ``add_eos_token=True``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [t for t in dict.fromkeys([eos, pad, bos, *extra_special,
                                          *(("<|im_start|>", "<|im_end|>") if chat else ())]) if t]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([TEXT], trainer=trainer)
    if add_bos or add_eos:
        head, tail = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
        used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        core.post_processor = processors.TemplateProcessing(
            single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B{tail}",
            special_tokens=[(t, core.token_to_id(t)) for t in dict.fromkeys(used)])
    kw = dict(eos_token=eos, padding_side=padding_side, clean_up_tokenization_spaces=False)
    if pad:
        kw["pad_token"] = pad
    if bos:
        kw["bos_token"] = bos
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **kw)
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_sp_tokenizer(model: str = "unigram", *, bos: str = "<s>", eos: str = "</s>", add_bos: bool = True,
                       pad: str | None = None, chat: bool = False, padding_side: str = "right"):
    """A SentencePiece-style tokenizer (Llama-2 / Mistral / Gemma shape) trained on :data:`TEXT` with ``tokenizers``.

    ``model``: ``"unigram"`` or ``"bpe"``; both with byte fallback (``<0x00>``..``<0xFF>`` are ordinary
    vocabulary entries, so any text encodes), a ``Metaspace`` pre-tokenizer (spaces as ``▁``, one put in
    front of the text) and the SentencePiece decoder (``▁`` back to spaces, bytes fused, the first space
    stripped). ``add_bos``: a post-processor puts ``bos`` in front. ``<unk>`` is id 0.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [t for t in dict.fromkeys(["<unk>", bos, eos, pad, *(("<|im_start|>", "<|im_end|>") if chat else ())])
                if t]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    meta = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    core = Tokenizer(models.Unigram() if model == "unigram" else models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = meta
    trainer = (trainers.UnigramTrainer(vocab_size=200, special_tokens=specials, unk_token="<unk>", show_progress=False)
               if model == "unigram" else
               trainers.BpeTrainer(vocab_size=200, special_tokens=specials, show_progress=False))
    core.train_from_iterator([TEXT], trainer=trainer)
    learnt = json.loads(core.to_str())["model"]
    if model == "unigram":  # the byte pieces after the learnt ones, least likely
        vocab = [tuple(v) for v in learnt["vocab"]]
        have = {p for p, _ in vocab}
        vocab += [(p, -20.0) for p in byte_pieces if p not in have]
        core = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    else:
        vocab = dict(learnt["vocab"])
        for p in byte_pieces:
            vocab.setdefault(p, len(vocab))
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
        core = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    core.pre_tokenizer = meta
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    core.add_special_tokens(specials)
    if add_bos:
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, core.token_to_id(bos))])
    kw = dict(bos_token=bos, eos_token=eos, unk_token="<unk>", padding_side=padding_side,
              clean_up_tokenization_spaces=False)
    if pad:
        kw["pad_token"] = pad
    tok = PreTrainedTokenizerFast(tokenizer_object=core, **kw)
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    return tok


def build_checkpoint(kind: str, out_dir: str, *, extra_vocab: int = 0, tie: bool | None = None,
                     eos_list: bool = False, seed: int = 0, config: dict | None = None,
                     generation: dict | None = None, dtype: torch.dtype | None = None,
                     shard: str | None = None, weights: str = "safetensors", sp: str | None = None,
                     **tok_kw) -> str:
    """Write a tiny random ``kind`` checkpoint with its tokenizer to ``out_dir``; returns it.

    ``extra_vocab``: embedding rows beyond the tokenizer's (a padded vocabulary).
    ``eos_list``: ``generation_config.eos_token_id`` is a list (EOS and ``<|im_end|>``,
    Llama-3/Qwen style; needs ``chat=True``). ``tie``: tie the output head.
    ``config``: more ``config.json`` fields (``rope_scaling``, ``sliding_window``...);
    ``generation``: more ``generation_config.json`` fields (``temperature``, ``repetition_penalty``...).
    ``dtype``: the weights saved in it (``config.json`` then says so, as shipped bf16/fp16
    checkpoints do). ``shard``: ``save_pretrained``'s ``max_shard_size`` (e.g. ``"20KB"``: an
    index plus shards). ``weights="bin"``: only a ``pytorch_model.bin`` (older checkpoints).
    ``sp``: a SentencePiece-style tokenizer (:func:`build_sp_tokenizer`, ``"unigram"`` or ``"bpe"``)
    instead of the byte-level BPE; ``tok_kw`` then go to it.
    """
    import transformers

    model_cls, cfg_cls, arch = _ARCHS[kind]
    tok = build_sp_tokenizer(sp, **tok_kw) if sp else build_tokenizer(**tok_kw)
    n = len(tok) + extra_vocab
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id if tok.bos_token_id
               is not None else tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg = getattr(transformers, cfg_cls)(vocab_size=n, **{**arch, **(config or {})}, **ids)
    if tie is not None:
        cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # larger weights than the default init: distinct, peaked next-token choices
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    gen = transformers.GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")] if eos_list
        else tok.eos_token_id, bos_token_id=ids["bos_token_id"], pad_token_id=tok.pad_token_id,
        **(generation or {}))
    model.generation_config = gen
    os.makedirs(out_dir, exist_ok=True)
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(out_dir, **({"max_shard_size": shard} if shard else {}))
    if weights == "bin":  # the older format: one pickled state dict, no safetensors
        os.remove(os.path.join(out_dir, "model.safetensors"))
        torch.save(model.state_dict(), os.path.join(out_dir, "pytorch_model.bin"))
    tok.save_pretrained(out_dir)
    return out_dir
