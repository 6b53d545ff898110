"""Dense GPT baseline: model, named sizes and parallelization plug-in."""

from models.registry import ModelSpec

from .model import GPT, GPTConfig
from .parallelize import parallelize_gpt
from .sizes import SIZES


def _pipeline_parts(cfg, activation_checkpointing=False):
    """Pipeline layers (imported when asked for: they need DeepSpeed)."""
    from .pipeline import pipeline_parts
    return pipeline_parts(cfg, activation_checkpointing)


SPEC = ModelSpec(
    name="gpt",
    config_cls=GPTConfig,
    sizes=SIZES,
    build=GPT,
    parallelize=parallelize_gpt,
    pipeline=_pipeline_parts,
)

__all__ = ["GPT", "GPTConfig", "SIZES", "SPEC", "parallelize_gpt"]
