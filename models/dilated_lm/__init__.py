"""LongNet-style dilated-attention LM: model, named sizes and parallelization plug-in."""

import torch

from models.registry import ModelSpec

from .model import DilatedLM, DilatedLMConfig
from .parallelize import layout_problem, parallelize_dilated_lm
from .sizes import SIZES


def _pipeline_parts(cfg, activation_checkpointing=False):
    """Pipeline layers (imported when asked for: they need DeepSpeed)."""
    from .pipeline import pipeline_parts
    return pipeline_parts(cfg, activation_checkpointing)


def example_inputs(config: DilatedLMConfig, micro_batch: int, seq_len: int) -> tuple:
    """``(input_ids, targets)`` for activation tracing; ids stay below the real vocabulary."""
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
    return ids, ids


SPEC = ModelSpec(
    name="dilated_lm",
    config_cls=DilatedLMConfig,
    sizes=SIZES,
    build=DilatedLM,
    parallelize=parallelize_dilated_lm,
    example_inputs=example_inputs,
    pipeline=_pipeline_parts,
    layout_problem=layout_problem,
)

__all__ = ["DilatedLM", "DilatedLMConfig", "SIZES", "SPEC", "parallelize_dilated_lm"]
