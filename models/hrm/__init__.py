"""HRM, the Hierarchical Reasoning Model: model, named sizes, parallelization plug-in."""

import torch

from models.registry import ModelSpec

from .model import HRM, HRMConfig
from .parallelize import parallelize_hrm
from .sizes import SIZES


def example_inputs(config: HRMConfig, micro_batch: int, seq_len: int) -> tuple:
    """One fresh training segment: ``(inputs, labels, puzzle_emb)``.

    The puzzle length is fixed by the model (``config.seq_len``), so ``seq_len`` (the
    run config's LM setting) is not used.
    """
    del seq_len
    inputs = torch.ones(micro_batch, config.seq_len, dtype=torch.long)
    labels = torch.full((micro_batch, config.seq_len), 2, dtype=torch.long)
    emb = torch.zeros(micro_batch, config.puzzle_emb_len * config.hidden_size)
    return inputs, labels, emb


SPEC = ModelSpec(
    name="hrm",
    config_cls=HRMConfig,
    sizes=SIZES,
    build=HRM,
    parallelize=parallelize_hrm,
    example_inputs=example_inputs,
    compile_regions=HRM.compile_regions,
)

__all__ = ["HRM", "HRMConfig", "SIZES", "SPEC", "example_inputs", "parallelize_hrm"]
