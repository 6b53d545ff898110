"""LLM policies for reinforcement learning: Hugging Face causal LMs behind dstrain's model interface.

See README.md in this folder for the API, padding conventions and ZeRO-3 notes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from models.registry import ModelSpec

from .config import SIZES, PolicyConfig
from .generation import Completion, generate, pack
from .heads import ValueHead
from .hf_files import checkpoint_dtype
from .model import (PolicyModel, build_policy, is_partitioned, is_zero3, take_router_aux, token_entropy,
                    token_logprobs)
from .reference import (ReferencePolicy, export_pretrained, full_state_dict, load_full_state_dict,
                        reference_ds_config, save_pretrained)
from .tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, byte_tokenizer, corpus_tokenizer, load_tokenizer


def parallelize_policy(model: torch.nn.Module, activation_checkpointing: bool = False,
                       **parallel) -> torch.nn.Module:
    """Prepare a :class:`PolicyModel` for training (in place): activation checkpointing if asked.

    Tensor and sequence parallelism are not supported for policies (use ZeRO).
    """
    if not isinstance(model, PolicyModel):
        raise TypeError(f"parallelize_policy expects a PolicyModel, got {type(model).__name__}")
    if parallel.get("state") is not None:
        raise NotImplementedError("policies support data parallelism (ZeRO) only: set tp = sp = 1")
    model.set_activation_checkpointing(activation_checkpointing)
    return model


def example_inputs(config: PolicyConfig, micro_batch: int, seq_len: int) -> tuple:
    """``(input_ids, targets)``, both ``LongTensor[micro_batch, seq_len]`` of byte ids."""
    ids = torch.full((micro_batch, seq_len), ord("a"), dtype=torch.long)
    return ids, ids


RL = SimpleNamespace(
    build=build_policy,                               # (config, ds_config=None) -> PolicyModel
    load_tokenizer=load_tokenizer,                    # (config) -> tokenizer, left padding
    corpus_tokenizer=corpus_tokenizer,                # (config) -> the LM trainer's corpus tokenizer or None (bytes)
    generate=generate,                                # (model, tokenizer, prompts, ...) -> [Completion]
    pack=pack,                                        # (completions, pad_id) -> dict of tensors
    token_logprobs=token_logprobs,                    # (logits, input_ids, temperature=1.0) -> [B, T-1]
    token_entropy=token_entropy,                      # (logits, temperature=1.0) -> [B, T-1]
    reference=ReferencePolicy.from_policy_config,     # (config, placement, train_ds_config=None, *, state_dict, seed)
    full_state_dict=full_state_dict,                  # (model) -> CPU state dict (gathered under ZeRO-3)
    save_pretrained=save_pretrained,                  # (model, directory, tokenizer=None): HF checkpoint
    export_pretrained=export_pretrained,              # (state with hf. names, config, directory): HF checkpoint
    value_head=ValueHead,                             # (backbone, hidden_size=None, init="normal"): critic / value
    checkpoint_dtype=checkpoint_dtype,                # (config) -> dtype the checkpoint's weights were saved in, or None
    take_router_aux=take_router_aux,                  # (model) -> (router load-balancing loss of its last training
                                                      #   forward or None, its coefficient)
)
"""The toolkit dstrain's RL trainers use (``ModelSpec.rl``)."""

SPEC = ModelSpec(
    name="policy",
    config_cls=PolicyConfig,
    sizes=SIZES,
    build=build_policy,
    parallelize=parallelize_policy,
    example_inputs=example_inputs,
    rl=RL,
)

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "RL", "SIZES", "SPEC", "VOCAB_SIZE", "Completion",
           "PolicyConfig", "PolicyModel", "ReferencePolicy", "ValueHead", "build_policy", "byte_tokenizer",
           "example_inputs", "full_state_dict", "generate", "is_partitioned", "is_zero3",
           "load_full_state_dict", "load_tokenizer", "pack", "parallelize_policy",
           "reference_ds_config", "save_pretrained", "token_entropy", "token_logprobs"]
