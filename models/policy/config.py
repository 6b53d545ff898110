"""Hyper-parameters of an LLM policy and its named sizes."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields


@dataclass
class PolicyConfig:
    """What :func:`models.policy.build_policy` builds. Checked in ``__post_init__``.

    Two ways to get a model:

    * ``path`` set: a local Hugging Face checkpoint directory (``config.json`` plus
      ``*.safetensors``, optionally its tokenizer files) is loaded with
      ``from_pretrained(..., local_files_only=True)``. The architecture fields below are
      then IGNORED: the checkpoint's ``config.json`` rules. Nothing is downloaded.
    * ``path`` empty: a Llama-style decoder (``transformers.LlamaConfig``: RMSNorm,
      rotary positions, SwiGLU MLP, grouped-query attention) is built from the fields
      below, with the embedded byte-level tokenizer's vocabulary (259 ids), and
      initialised from the caller's ``torch.manual_seed``.
    """

    path: str = ""
    """Local Hugging Face checkpoint directory; empty = build from the fields below."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 4
    """Attention (query) heads; must divide ``hidden_size``."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``num_heads``."""
    intermediate_size: int = 192
    """Hidden width of the SwiGLU MLP."""
    max_positions: int = 512
    """Longest sequence (prompt + completion) the model is meant for."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Attention dropout probability in [0, 1) (Llama has no other dropout)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts checkpoints: the weight of the router's load-balancing (auxiliary) loss added to every
    training loss (SFT, GRPO, SCoRe), as transformers adds it. None (default): the checkpoint's
    ``router_aux_loss_coef`` where its ``config.json`` has ``output_router_logits: true``, else 0 (not added)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field if a value is impossible."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "path":
                if not isinstance(value, str):
                    raise ValueError(f"path must be a str, got {type(value).__name__}")
            elif f.name == "tie_embeddings":
                if not isinstance(value, bool):
                    raise ValueError(f"tie_embeddings must be a bool, got {type(value).__name__}")
            elif f.name == "router_aux_loss_coef":
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value < 0:
                    raise ValueError(f"router_aux_loss_coef must be a float >= 0 (or null: the checkpoint's), "
                                     f"got {value!r}")
                self.router_aux_loss_coef = float(value)
            elif f.name in ("rope_theta", "dropout"):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"{f.name} must be a float, got {type(value).__name__}")
            else:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{f.name} must be an int, got {type(value).__name__}")
                if value <= 0:
                    raise ValueError(f"{f.name} must be positive, got {value}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"hidden_size / num_heads = {self.hidden_size // self.num_heads} "
                             "must be even (rotary positions rotate pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide "
                             f"num_heads ({self.num_heads})")
        if self.path and not os.path.isfile(os.path.join(self.path, "config.json")) and \
                os.path.isfile(os.path.join(self.path, "adapter_config.json")):
            raise ValueError(f"path {self.path!r} holds a PEFT (LoRA) adapter (adapter_config.json), not a "
                             "checkpoint: dstrain loads full weights only; merge the adapter into its base model "
                             "(peft's merge_and_unload, then save_pretrained) and give that folder")
        if self.path and not os.path.isfile(os.path.join(self.path, "config.json")):
            raise ValueError(f"path {self.path!r} is not a Hugging Face checkpoint directory "
                             "(no config.json there)")
        if self.path:
            from models.registry import weights_optional

            from .hf_files import checkpoint_problem, weights_problem
            absent = weights_problem(self.path)
            if absent and weights_optional(
                    f"model.args.path {self.path}: {absent}; dstrain plan builds the model on "
                    "the meta device from its config.json: the weights were not read (train and launch need them)"):
                absent = None  # dstrain plan only: the planner reads no weights
            if (why := absent or checkpoint_problem(self.path, weights=False)):
                raise ValueError(f"path {self.path!r} cannot be loaded as a policy: {why}")
        if self.router_aux_loss_coef:
            self._check_router()

    def _check_router(self) -> None:
        """A load-balancing loss asked of a model without experts is refused (a dense checkpoint, or the model built
        from the size fields: Llama, dense)."""
        fields_ = None
        if self.path:
            from .hf_files import read_config, text_config
            from .moe import moe_fields
            fields_ = moe_fields(text_config(read_config(self.path)))
        if fields_ is None:
            what = f"the checkpoint at {self.path!r}" if self.path else "the model built from the size fields"
            raise ValueError(f"router_aux_loss_coef={self.router_aux_loss_coef}: {what} is dense (no mixture of "
                             "experts, no router); leave it unset or 0")


# Parameter counts measured with build_policy on the meta device (vocabulary 259).
SIZES = {
    # 0.13M parameters; a GRPO step on 2 CPU cores takes well under a second
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=192, max_positions=512),
    # 0.80M parameters; a GRPO step of grpo_mbpp_heldout_cpu.json on 2 CPU ranks: 5.5-7 s (load ~5)
    "mid": dict(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                intermediate_size=352, max_positions=1024),
    # 3.1M parameters
    "small": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=704, max_positions=1024),
}
"""Named sizes. A local checkpoint is used with any size plus ``path`` (e.g. the
run-config override ``--model.args.path=DIR``); its ``config.json`` then decides the
architecture, so the size only names the run."""
