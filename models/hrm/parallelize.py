"""Apply parallelism to a single-device :class:`~models.hrm.model.HRM`.

Only activation checkpointing applies today (of the block calls that keep a graph:
the last L and H update of each segment). HRM's blocks are small and its batch is
the unit of data parallelism; tensor parallelism would swap the attention and SwiGLU
projections for fairscale column/row-parallel layers here.
"""
from __future__ import annotations

from torch import nn

from .model import HRM


def parallelize_hrm(model: nn.Module, activation_checkpointing: bool = False) -> nn.Module:
    """Prepare ``model`` for training and return it (modified in place)."""
    if not isinstance(model, HRM):
        raise TypeError(f"parallelize_hrm expects a models.hrm.HRM, got {type(model).__name__}")
    model.set_activation_checkpointing(activation_checkpointing)
    return model
