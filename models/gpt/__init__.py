"""Dense GPT baseline: model, named sizes and parallelization plug-in."""

from models.registry import ModelSpec

from .model import GPT, GPTConfig
from .parallelize import parallelize_gpt
from .sizes import SIZES

SPEC = ModelSpec(
    name="gpt",
    config_cls=GPTConfig,
    sizes=SIZES,
    build=GPT,
    parallelize=parallelize_gpt,
)

__all__ = ["GPT", "GPTConfig", "SIZES", "SPEC", "parallelize_gpt"]
