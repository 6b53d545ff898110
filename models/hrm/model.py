"""The Hierarchical Reasoning Model (Wang et al., 2025) with adaptive computation time.

One call of :meth:`HRM.forward` is one ACT *segment* for a batch of rows, each of which
carries its own state from the previous call:

* Rows flagged in ``reset`` (halted last time, now holding a new puzzle) restart from
  the fixed initial states ``H_init`` / ``L_init`` with a step count of 0.
* The segment runs ``H_cycles x L_cycles`` updates: L is updated ``L_cycles`` times
  per H update, L from ``z_L + z_H + x`` and H from ``z_H + z_L`` (input injection).
  Only the last L and the last H update keep a graph (the one-step gradient
  approximation); every other update runs under ``no_grad`` and the carried state
  is detached.
* A Q-head on the first position gives ``(q_halt, q_continue)`` logits. In training a
  row halts at ``halt_max_steps``, or once ``q_halt > q_continue`` and at least a
  random minimum of steps has run (drawn with probability ``halt_exploration_prob``);
  ``q_continue`` learns from a bootstrapped target taken from one more no-grad
  segment. With ``halt_rule = "solved"`` a row halts once ``q_halt > halt_threshold``
  (default 0) instead and ``q_continue`` is unused. In evaluation every row runs
  ``halt_max_steps`` segments.
* Loss: (stablemax or softmax) cross-entropy averaged over each row's labelled
  tokens, plus ``0.5 * (BCE(q_halt, row is correct) + BCE(q_continue, target))``,
  summed over rows and divided by the rows of this call.

The puzzle embedding is not part of this module: the trainer looks the rows up in a
sparse table and passes them as ``puzzle_emb`` ``[B, puzzle_emb_len * hidden]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from .layers import ReasoningModule, Rotary, lecun_init_, swiglu_width, trunc_normal_

IGNORE_LABEL = -100
BLANK_TOKEN = 1


@dataclass
class HRMConfig:
    """Hyper-parameters of :class:`HRM`; checked in ``__post_init__``."""

    hidden_size: int
    num_heads: int
    H_layers: int
    L_layers: int
    H_cycles: int
    L_cycles: int
    halt_max_steps: int
    expansion: float = 4.0
    """SwiGLU inner width is ``expansion * hidden * 2/3``, rounded up to ``mlp_multiple_of``."""
    mlp_multiple_of: int = 256
    halt_exploration_prob: float = 0.1
    vocab_size: int = 11
    seq_len: int = 81
    puzzle_emb_len: int = 1
    """Positions prepended for the puzzle embedding (0: none)."""
    pos_encodings: str = "rope"
    """rope | learned."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    loss: str = "stablemax"
    """stablemax | softmax cross-entropy."""
    act: bool = True
    """False: adaptive halting off (fixed segments): every puzzle runs ``halt_max_steps``
    segments in training as in evaluation, and the Q-head is not trained."""
    halt_rule: str = "compare"
    """compare (the reference): a row halts once ``q_halt > q_continue``, and ``q_continue``
    learns a bootstrapped target from one more no-grad segment. solved (as TRM): a row halts
    once ``q_halt > halt_threshold`` (the Q-head thinks it is solved); ``q_continue`` is not used or
    trained, and no extra segment runs. Under both, exploration draws a minimum of steps."""
    halt_threshold: float = 0.0
    """``solved`` rule only: halt once ``q_halt > halt_threshold`` (a logit: 0 is a predicted
    probability of 0.5 that the row is right; higher halts later and more surely)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be an int, got {value!r}")
        for name in ("hidden_size", "num_heads", "H_layers", "L_layers", "H_cycles", "L_cycles",
                     "halt_max_steps", "mlp_multiple_of", "vocab_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.puzzle_emb_len < 0:
            raise ValueError(f"puzzle_emb_len must not be negative, got {self.puzzle_emb_len}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.pos_encodings == "rope" and (self.hidden_size // self.num_heads) % 2:
            raise ValueError("rope needs an even head dimension (hidden_size / num_heads)")
        if not 0.0 <= self.halt_exploration_prob <= 1.0:
            raise ValueError(f"halt_exploration_prob must be within [0, 1], got {self.halt_exploration_prob}")
        if self.expansion <= 0:
            raise ValueError(f"expansion must be positive, got {self.expansion}")
        if not isinstance(self.act, bool):
            raise ValueError(f"act must be true or false, got {self.act!r}")
        if self.pos_encodings not in ("rope", "learned"):
            raise ValueError(f"pos_encodings must be rope or learned, got {self.pos_encodings!r}")
        if self.halt_rule not in ("compare", "solved"):
            raise ValueError(f"halt_rule must be compare or solved, got {self.halt_rule!r}")
        if isinstance(self.halt_threshold, bool) or not isinstance(self.halt_threshold, (int, float)) \
                or not math.isfinite(self.halt_threshold):
            raise ValueError(f"halt_threshold must be a finite number, got {self.halt_threshold!r}")
        if self.halt_threshold and self.halt_rule != "solved":
            raise ValueError("halt_threshold applies to halt_rule solved only")
        if self.loss not in ("stablemax", "softmax"):
            raise ValueError(f"loss must be stablemax or softmax, got {self.loss!r}")

    @property
    def total_len(self) -> int:
        """Positions the blocks see: puzzle-embedding prefix plus the puzzle's tokens."""
        return self.puzzle_emb_len + self.seq_len


def log_stablemax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log of stablemax: s(x) = x + 1 for x >= 0, 1 / (1 - x) below, normalised over ``dim``."""
    # Each branch sees only its own half of x, so the other branch's gradient cannot be inf.
    s = torch.where(x < 0, 1.0 / (1.0 - x.clamp(max=0.0)), x.clamp(min=0.0) + 1.0)
    return torch.log(s / s.sum(dim=dim, keepdim=True))


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token loss ``[B, T]`` (0 where the label is ignored); stablemax runs in float64."""
    mask = labels != IGNORE_LABEL
    safe = torch.where(mask, labels, 0)
    if kind == "stablemax":
        logp = log_stablemax(logits.double())
        loss = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    else:
        loss = F.cross_entropy(logits.float().flatten(0, 1), safe.flatten(), reduction="none").view(safe.shape)
    return torch.where(mask, loss, torch.zeros_like(loss)).float()


class HRM(nn.Module):
    """H and L recurrent modules, token/position embeddings, LM head and Q-head."""

    def __init__(self, cfg: HRMConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        inner = swiglu_width(h, cfg.expansion, cfg.mlp_multiple_of)
        self.embed_scale = math.sqrt(h)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if cfg.pos_encodings == "learned":
            self.embed_pos = nn.Embedding(cfg.total_len, h)
            self.rotary = None
        else:
            self.rotary = Rotary(h // cfg.num_heads, cfg.total_len, cfg.rope_theta)
        self.H_level = ReasoningModule(cfg.H_layers, h, cfg.num_heads, inner, cfg.rms_norm_eps)
        self.L_level = ReasoningModule(cfg.L_layers, h, cfg.num_heads, inner, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        self.q_head = nn.Linear(h, 2, bias=True)
        # .float(): under a 16-bit zero.Init ``torch.empty`` gives bf16/fp16, and the initial states
        # are fp32 buffers in any other build (DeepSpeed leaves buffers' dtype alone)
        self.register_buffer("H_init", torch.empty(h).float())
        self.register_buffer("L_init", torch.empty(h).float())
        self.reset_parameters()

    # ---------------------------------------------------------------- init and sizes
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise from the global torch seed (see :meth:`init_module`)."""
        for name, module in self.named_modules():
            self.init_module(name, module)

    @torch.no_grad()
    def init_module(self, name: str, module: nn.Module) -> None:
        """LeCun truncated normal for projections, std 1/sqrt(hidden) for embeddings and the
        LM head, Q-head weight 0 and bias -5 (halting starts improbable), initial states
        truncated normal with std 1."""
        std = 1.0 / math.sqrt(self.config.hidden_size)
        if module is self:
            trunc_normal_(self.H_init, 1.0)
            trunc_normal_(self.L_init, 1.0)
        elif name == "q_head":
            nn.init.zeros_(module.weight)
            nn.init.constant_(module.bias, -5.0)
        elif name == "lm_head" or isinstance(module, nn.Embedding):
            lecun_init_(module.weight, std)
        elif isinstance(module, nn.Linear):
            lecun_init_(module.weight)

    def compile_regions(self) -> list[nn.Module]:
        """The modules ``train.compile_scope=regions`` compiles one by one: the H and L reasoning
        modules, which hold all but a few percent of the FLOPs. A segment calls them
        ``H_cycles * (L_cycles + 1)`` times (twice that with the Q target), so compiling the whole
        forward traces every call again; a region is traced once per grad mode and reused by
        every call, and the ACT bookkeeping around it (the carry, halting, the loss) stays eager."""
        return [self.H_level, self.L_level]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.H_layers + self.config.L_layers

    def set_activation_checkpointing(self, flag: bool) -> None:
        """Recompute block activations of the gradient-carrying updates in backward."""
        self.H_level.activation_checkpointing = bool(flag)
        self.L_level.activation_checkpointing = bool(flag)

    def flops_per_segment_token(self) -> int:
        """Forward+backward matmul FLOPs per token of one training segment (no attention scores).

        Forward: ``H_cycles*L_cycles`` L updates and ``H_cycles`` H updates, plus the same
        again for the Q target (ACT only); backward (2x forward) only for the last L and H update.
        """
        c = self.config
        block = sum(p.numel() for p in self.H_level.layers[0].parameters()) if c.H_layers else 0
        fwd = 2 * block * (c.H_cycles * c.L_cycles * c.L_layers + c.H_cycles * c.H_layers)
        bwd = 4 * block * (c.L_layers + c.H_layers)
        target = fwd if c.act and c.halt_max_steps > 1 and c.halt_rule == "compare" else 0  # Q target's segment
        return fwd + target + bwd

    # ---------------------------------------------------------------- segment
    def _rotary(self):
        return None if self.rotary is None else (self.rotary.cos, self.rotary.sin)

    def input_embeddings(self, inputs: torch.Tensor, puzzle_emb: torch.Tensor | None) -> torch.Tensor:
        """``embed_scale * [puzzle prefix; token embeddings]`` (plus learned positions)."""
        c = self.config
        x = self.embed_tokens(inputs)
        if c.puzzle_emb_len:
            if puzzle_emb is None:
                puzzle_emb = x.new_zeros(x.shape[0], c.puzzle_emb_len * c.hidden_size)
            if puzzle_emb.shape != (x.shape[0], c.puzzle_emb_len * c.hidden_size):
                raise ValueError(f"puzzle_emb must be [{x.shape[0]}, {c.puzzle_emb_len * c.hidden_size}], "
                                 f"got {list(puzzle_emb.shape)}")
            prefix = puzzle_emb.to(x.dtype).view(x.shape[0], c.puzzle_emb_len, c.hidden_size)
            x = torch.cat([prefix, x], dim=1)
        if c.pos_encodings == "learned":
            x = 0.707106781 * (x + self.embed_pos.weight.to(x.dtype))
        return self.embed_scale * x

    def segment(self, z_H: torch.Tensor, z_L: torch.Tensor, x: torch.Tensor,
                one_step_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``H_cycles x L_cycles`` updates; with ``one_step_grad`` only the last L and H keep a graph."""
        c, rot = self.config, self._rotary()
        with torch.set_grad_enabled(torch.is_grad_enabled() and not one_step_grad):
            for h in range(c.H_cycles):
                for l in range(c.L_cycles):
                    if h < c.H_cycles - 1 or l < c.L_cycles - 1:
                        z_L = self.L_level(z_L, z_H + x, rot)
                if h < c.H_cycles - 1:
                    z_H = self.H_level(z_H, z_L, rot)
        z_L = self.L_level(z_L, z_H + x, rot)
        z_H = self.H_level(z_H, z_L, rot)
        return z_H, z_L

    def heads(self, z_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token logits ``[B, seq_len, vocab]`` and Q logits ``[B, 2]`` (halt, continue), fp32."""
        logits = self.lm_head(z_H[:, self.config.puzzle_emb_len:])
        q = self.q_head(z_H[:, 0]).float()
        return logits, q

    def wants_halt(self, q_halt: torch.Tensor, q_continue: torch.Tensor) -> torch.Tensor:
        """The Q-head's halting decision ``bool[B]`` under ``halt_rule`` (before the minimum
        of steps and the ``halt_max_steps`` cap)."""
        if self.config.halt_rule == "solved":
            return q_halt > self.config.halt_threshold
        return q_halt > q_continue

    def initial_state(self, batch: int, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.config.total_len, self.config.hidden_size)
        dtype = dtype or self.H_init.dtype
        return (self.H_init.to(device=device, dtype=dtype).expand(shape).clone(),
                self.L_init.to(device=device, dtype=dtype).expand(shape).clone())

    # ---------------------------------------------------------------- ACT step
    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, puzzle_emb: torch.Tensor | None = None,
                z_H: torch.Tensor | None = None, z_L: torch.Tensor | None = None,
                steps: torch.Tensor | None = None, reset: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict]:
        """One ACT segment -> ``(loss, out)``.

        Args: ``inputs``/``labels`` ``int64[B, seq_len]`` (labels may hold -100);
        ``puzzle_emb`` ``[B, puzzle_emb_len*hidden]``; the carry ``z_H``, ``z_L``
        ``[B, total_len, hidden]`` and ``steps`` ``int[B]`` (None: a fresh start for
        every row); ``reset`` ``bool[B]``: rows that start a new puzzle now.

        ``out`` holds the next carry (``z_H``, ``z_L`` detached, ``steps``, ``halted``),
        ``preds`` (argmax digits), ``q_halt``/``q_continue`` logits and ``metrics``:
        sums over this call's rows (see :meth:`_metrics`).
        """
        c = self.config
        if inputs.dim() != 2 or inputs.shape[1] != c.seq_len:
            raise ValueError(f"inputs must be [B, {c.seq_len}], got {list(inputs.shape)}")
        if labels.shape != inputs.shape:
            raise ValueError(f"labels {list(labels.shape)} must match inputs {list(inputs.shape)}")
        b, device = inputs.shape[0], inputs.device
        x = self.input_embeddings(inputs, puzzle_emb)
        init_H, init_L = self.initial_state(b, device, x.dtype)
        if z_H is None or z_L is None or steps is None:
            z_H, z_L, steps = init_H, init_L, torch.zeros(b, dtype=torch.int64, device=device)
        elif reset is not None:
            r = reset.view(b, 1, 1)
            z_H = torch.where(r, init_H, z_H.to(x.dtype))
            z_L = torch.where(r, init_L, z_L.to(x.dtype))
            steps = torch.where(reset, torch.zeros_like(steps), steps)
        z_H, z_L = self.segment(z_H.detach(), z_L.detach(), x)
        logits, q = self.heads(z_H)
        q_halt, q_continue = q[:, 0], q[:, 1]
        steps = steps + 1

        target_q = None
        with torch.no_grad():
            is_last = steps >= c.halt_max_steps
            halted = is_last
            if self.training and c.act and c.halt_max_steps > 1:
                halted = halted | self.wants_halt(q_halt, q_continue)
                explore = torch.rand(b, device=device) < c.halt_exploration_prob
                min_steps = explore * torch.randint(2, c.halt_max_steps + 1, (b,), device=device)
                halted = halted & (steps >= min_steps)
                if c.halt_rule == "compare":
                    nz_H, _ = self.segment(z_H.detach(), z_L.detach(), x.detach())
                    _, next_q = self.heads(nz_H)
                    target_q = torch.sigmoid(torch.where(is_last, next_q[:, 0],
                                                         torch.maximum(next_q[:, 0], next_q[:, 1])))

        loss, metrics = self._loss(inputs, labels, logits, q_halt, q_continue, target_q, halted, steps)
        out = {"z_H": z_H.detach(), "z_L": z_L.detach(), "steps": steps, "halted": halted,
               "preds": logits.detach().argmax(-1), "q_halt": q_halt.detach(),
               "q_continue": q_continue.detach(), "wants_halt": self.wants_halt(q_halt, q_continue).detach(),
               "metrics": metrics}
        return loss, out

    def _loss(self, inputs, labels, logits, q_halt, q_continue, target_q, halted, steps):
        """Loss and metric sums; metrics count rows that halted in this call (as HRM logs them).

        ``exact`` is all blanks right (cells whose input is the blank token), ``accuracy``
        the mean over labelled tokens of each row, ``q_halt_accuracy`` whether
        ``q_halt >= 0`` agrees with the row being correct.
        """
        mask = labels != IGNORE_LABEL
        counts = mask.sum(-1)
        divisor = counts.clamp_min(1)
        token_loss = token_cross_entropy(logits, labels, self.config.loss)
        lm_loss = (token_loss.sum(-1) / divisor).sum()
        with torch.no_grad():
            preds = logits.argmax(-1)
            correct = mask & (preds == labels)
            seq_correct = correct.sum(-1) == counts
            blank = inputs == BLANK_TOKEN
            blanks_right = ((preds == labels) | ~blank).all(-1)
            valid = halted & (counts > 0)
        q_halt_loss = F.binary_cross_entropy_with_logits(q_halt, seq_correct.to(q_halt.dtype), reduction="sum")
        total = lm_loss + 0.5 * q_halt_loss if self.config.act else lm_loss
        q_cont_loss = torch.zeros_like(q_halt_loss)
        if target_q is not None:
            q_cont_loss = F.binary_cross_entropy_with_logits(q_continue, target_q, reduction="sum")
            total = total + 0.5 * q_cont_loss
        with torch.no_grad():
            metrics = {
                "rows": torch.tensor(float(inputs.shape[0]), device=inputs.device),
                "count": valid.sum().float(),
                "accuracy": torch.where(valid, correct.sum(-1) / divisor, 0.0).sum().float(),
                "exact_accuracy": (valid & blanks_right).sum().float(),
                "q_halt_accuracy": (valid & ((q_halt >= 0) == seq_correct)).sum().float(),
                "steps": torch.where(valid, steps, 0).sum().float(),
                "lm_loss": lm_loss.detach().float(),
                "q_halt_loss": q_halt_loss.detach().float(),
                "q_continue_loss": q_cont_loss.detach().float(),
            }
        return total / inputs.shape[0], metrics
