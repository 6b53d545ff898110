"""A scalar head on a causal-LM backbone: the critic Q(s, a) and the value V(s) of BiLevel SCoRe.

``ValueHead(backbone)`` reads the backbone's final hidden states (after its final norm)
and maps them through ``Linear(hidden, 1)``:

* per sequence (default): the value at each row's last real token, found from
  ``attention_mask`` (the last position where it is 1, so right padding, and left
  padding too, index correctly; a model whose recurrent layers read left padding,
  :data:`~models.policy.generation.LEFT_PADDING_LEAKS`, runs the rows of each left-pad
  length as their own batch with the pads cut off: RecurrentGemma's convolution ran over
  the pads and a left-padded row's value moved by 0.09 on a tiny checkpoint);
* per token (``per_token=True``): ``[B, T]``, every position.

The critic reads "prompt + action" text, the value function the state text alone.

Backbone: a Hugging Face ``AutoModelForCausalLM`` (or anything whose
``forward(input_ids, attention_mask=..., output_hidden_states=True)`` returns an object
with ``.hidden_states``). When it has a separate ``base_model`` (LlamaForCausalLM's
``.model``), that is called instead and its ``last_hidden_state`` used: the same tensor
as ``hidden_states[-1]``, without computing the ``[B, T, vocab]`` logits nor keeping
every layer's hidden states.

Router load-balancing loss (mixture-of-experts backbones): none is added to the critic's or
the value function's loss. transformers computes that loss in the causal-LM head's forward
only (``MixtralForCausalLM``; its base model returns the router logits, no loss) and its own
scalar heads (``MixtralForSequenceClassification``) add none; the critics' regression is what
they train on, as for a reward model.

Initialisation: ``init="normal"`` (default) draws the head's weight from
N(0, 1 / (hidden + 1)) with zero bias, as reward heads are commonly initialised
(Stiennon et al., 2020), so outputs start O(1) and gradients reach the backbone from the
first step; ``init="zero"`` starts every output at exactly 0 (the backbone then gets no
gradient until the head has moved).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .generation import left_padding_leaks
from .model import positions_from_mask


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: index of each row's last position with mask 1 (0 for a row with none)."""
    t = attention_mask.shape[-1]
    positions = torch.arange(1, t + 1, device=attention_mask.device)
    return ((attention_mask != 0).long() * positions).argmax(dim=-1)


class ValueHead(nn.Module):
    """Backbone + ``Linear(hidden, 1)``: one scalar per sequence (or per token)."""

    def __init__(self, backbone: nn.Module, hidden_size: int | None = None, init: str = "normal"):
        super().__init__()
        if hidden_size is None:
            hidden_size = getattr(getattr(backbone, "config", None), "hidden_size", None)
        if not hidden_size:
            raise ValueError("ValueHead needs hidden_size when the backbone has no config.hidden_size")
        if init not in ("normal", "zero"):
            raise ValueError(f"init must be 'normal' or 'zero', got {init!r}")
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        with torch.no_grad():
            if init == "zero":
                self.head.weight.zero_()
            else:
                self.head.weight.normal_(0.0, 1.0 / math.sqrt(hidden_size + 1))
            self.head.bias.zero_()

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T, hidden]``: the backbone's final hidden states (0 on the left pads of a model that leaks them)."""
        if attention_mask is not None and left_padding_leaks(self.backbone):
            lead = (attention_mask != 0).long().cumsum(-1).eq(0).sum(-1)  # [B] left pads per row
            lead = lead.clamp(max=input_ids.shape[-1] - 1)  # a row with no real token keeps its last
            if bool(lead.any()):
                out = None
                for p in lead.unique().tolist():
                    rows = (lead == p).nonzero(as_tuple=True)[0]
                    h = self._hidden(input_ids[rows, p:], attention_mask[rows, p:])
                    if out is None:
                        out = h.new_zeros(input_ids.shape + h.shape[-1:])
                    out[rows, p:] = h
                return out
        return self._hidden(input_ids, attention_mask)

    def _hidden(self, input_ids, attention_mask):
        body = getattr(self.backbone, "base_model", None)
        if isinstance(body, nn.Module) and body is not self.backbone:
            extra = positions_from_mask(body, attention_mask)
            return body(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        extra = positions_from_mask(self.backbone, attention_mask)
        out = self.backbone(input_ids, attention_mask=attention_mask, output_hidden_states=True, **extra)
        return out.hidden_states[-1]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                per_token: bool = False) -> torch.Tensor:
        """``[B]`` values at each row's last real token, or ``[B, T]`` with ``per_token=True``."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        h = self.hidden_states(input_ids, attention_mask)
        if not per_token:
            idx = last_token_index(attention_mask)
            h = h[torch.arange(h.shape[0], device=h.device), idx]
        return self.head(h.to(self.head.weight.dtype)).squeeze(-1)
