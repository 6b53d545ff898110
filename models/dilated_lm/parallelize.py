"""Apply tensor parallelism, sequence parallelism and activation checkpointing to a :class:`DilatedLM`.

Order, as torchtitan does it: tensor parallelism (fairscale layers, shards copied
from the dense weights), then sequence parallelism (each attention core replaced
by a sequence-parallel one, positions offset by the rank's chunk), then
activation checkpointing. Without ``state`` (or with degrees of 1) only
checkpointing is applied, which is what the planner's trace uses.
"""
from __future__ import annotations

from torch import nn

from dstrain.parallel import tensor as tp_layers
from dstrain.parallel.dims import ParallelState

from .model import DilatedLM


def apply_tensor_parallel(model: DilatedLM, state: ParallelState) -> None:
    """Q/K/V and MLP up column-parallel, attention out and MLP down row-parallel, vocab-parallel ends."""
    tp, rank = state.dims.tp, state.tp_rank
    cfg = model.config
    if cfg.n_head % tp:
        raise ValueError(f"n_head {cfg.n_head} is not divisible by tp = {tp}")
    if cfg.padded_vocab % tp:
        raise ValueError(f"padded vocabulary {cfg.padded_vocab} is not divisible by tp = {tp}")
    model.tok_emb = tp_layers.vocab_parallel_embedding(model.tok_emb)
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (tp_layers.column_parallel(p)
                                                 for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        attn.out_proj = tp_layers.row_parallel(attn.out_proj)
        attn.core.head_offset = rank * (cfg.n_head // tp)
        mlp.up_proj = tp_layers.column_parallel(mlp.up_proj)
        mlp.down_proj = tp_layers.row_parallel(mlp.down_proj)
        mlp.hidden_dropout = tp_layers.model_parallel_dropout
    model.lm_head = tp_layers.column_parallel(model.lm_head)
    model.loss_fn = tp_layers.vocab_parallel_loss


def apply_sequence_parallel(model: DilatedLM, state: ParallelState, mode: str = "auto") -> None:
    """Replace every attention core by a sequence-parallel one over ``state.sp_group``."""
    from dstrain.parallel.sequence import SequenceParallelDilatedCore
    cfg = model.config
    sp_groups = state.dims.sp_groups()
    segment_groups: dict = {}  # one set of segment groups for every layer
    for block in model.blocks:
        core = block.attn.core
        block.attn.core = SequenceParallelDilatedCore(
            core.branches, cfg.causal, state.sp_group, sp_groups, mode=mode, head_offset=core.head_offset,
            sparse_block=cfg.sparse_block, sparse_keep=cfg.sparse_keep, segment_groups=segment_groups)
    model.seq_shard = (state.sp_rank, state.dims.sp)


def layout_problem(cfg, tp: int, sp: int, sp_mode: str, seq_len: int) -> tuple[str, str] | None:
    """``(key, why)`` when ``cfg`` cannot train on tp x sp with ``sp_mode`` at ``seq_len`` tokens, else None: what
    the layers would raise in every rank (the sequence-parallel mode at the first forward), asked at config load."""
    if cfg.n_head % tp:
        return "parallel.tp", f"n_head {cfg.n_head} is not divisible by tp = {tp}"
    if cfg.padded_vocab % tp:
        return "parallel.tp", f"padded vocabulary {cfg.padded_vocab} is not divisible by tp = {tp}"
    if seq_len % sp:
        return None  # (refused as data.seq_len)
    from dstrain.ops.dilated import make_branches
    from dstrain.parallel.sequence import choose_mode
    branches = make_branches(cfg.segment_lengths, cfg.dilation_rates)
    if sp > 1:
        try:
            mode = choose_mode(sp_mode, branches, seq_len, sp, cfg.n_head // tp, cfg.sparse_keep < 1.0)
        except ValueError as err:
            return "parallel.sp_mode", str(err)
        refuses = mode == "ulysses" and (not cfg.causal or cfg.sparse_keep < 1.0)  # as the layer checks it
    else:  # dstrain.ops.dilated.dilated_attention pads a length the segments do not tile only for these
        refuses = not (cfg.causal and (cfg.sparse_block == 0 or cfg.sparse_keep >= 1.0))
    try:
        for br in branches if refuses else ():
            br.effective(seq_len)
    except ValueError as err:
        return "data.seq_len", str(err)
    return None


def parallelize_dilated_lm(model: nn.Module, activation_checkpointing: bool = False,
                           state: ParallelState | None = None, sp_mode: str = "auto") -> nn.Module:
    """Prepare ``model`` for training on ``state``'s layout and return it (changed in place)."""
    if not isinstance(model, DilatedLM):
        raise TypeError(f"parallelize_dilated_lm expects a DilatedLM, got {type(model).__name__}")
    if state is not None and state.dims.tp > 1:
        apply_tensor_parallel(model, state)
    if state is not None and state.dims.sp > 1:
        apply_sequence_parallel(model, state, sp_mode)
    model.set_activation_checkpointing(activation_checkpointing)
    return model
