"""Apply parallelism to a single-device :class:`~models.gpt.model.GPT`.

Order (as in torchtitan's ``parallelize_*``): tensor parallelism, then
activation checkpointing, then compilation. Only activation checkpointing exists
today; tensor parallelism (fairscale layers from ``dstrain.parallel.tensor``)
arrives in a later issue.
"""

from __future__ import annotations

from torch import nn

from .model import GPT


def parallelize_gpt(model: nn.Module, activation_checkpointing: bool = False) -> nn.Module:
    """Prepare ``model`` for training and return it (modified in place).

    Args:
        model: a :class:`GPT` built on one device.
        activation_checkpointing: recompute each transformer block's activations
            in the backward pass (``torch.utils.checkpoint``, non-reentrant).

    Tensor parallelism is not implemented yet (a later issue swaps the attention
    and MLP Linears for fairscale column/row-parallel layers here).
    """
    if not isinstance(model, GPT):
        raise TypeError(f"parallelize_gpt expects a models.gpt.GPT, got {type(model).__name__}")
    model.set_activation_checkpointing(activation_checkpointing)
    return model
