"""Tensor parallelism from fairscale's ``model_parallel`` layers, tagged for DeepSpeed.

Models are written for one device; a model's ``parallelize.py`` swaps its layers
for the parallel ones with the helpers here, which copy this rank's shard out of
the already initialised dense weights (so a tensor-parallel model starts from
exactly the single-device model's numbers, whatever its init):

* :func:`column_parallel` - output features split (Q/K/V per head, MLP up, vocab head);
* :func:`row_parallel` - input features split, outputs all-reduced (attention out, MLP down);
* :func:`vocab_parallel_embedding` - embedding rows split by vocabulary id;
* :func:`vocab_parallel_loss` - cross-entropy on vocabulary-sharded logits;
* :func:`model_parallel_dropout` - dropout on sharded activations.

Every sharded parameter gets ``model_parallel = True``: DeepSpeed's gradient-norm
code counts a parameter on each tensor-parallel rank only if it carries that
attribute (otherwise it counts tp rank 0's copy only), and fairscale never sets it.
The row-parallel bias is replicated, so it stays untagged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _fs():
    from fairscale.nn.model_parallel import initialize, layers
    if not initialize.model_parallel_is_initialized():
        raise RuntimeError("tensor parallelism needs dstrain.parallel.dims.init_parallel(tp=...) first")
    return initialize, layers


def _tp() -> tuple[int, int]:
    initialize, _ = _fs()
    return initialize.get_model_parallel_rank(), initialize.get_model_parallel_world_size()


def _shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    rank, size = _tp()
    if t.shape[dim] % size:
        raise ValueError(f"cannot split dimension {dim} of size {t.shape[dim]} over {size} tensor-parallel ranks")
    return t.chunk(size, dim=dim)[rank]


def tag_model_parallel(*params: torch.nn.Parameter) -> None:
    for p in params:
        p.model_parallel = True


def _no_init(_: torch.Tensor) -> torch.Tensor:
    return _  # weights are copied from the dense layer right after construction


@torch.no_grad()
def column_parallel(linear: nn.Linear, gather_output: bool = False) -> nn.Module:
    """A ColumnParallelLinear holding this rank's rows of ``linear.weight`` (output features)."""
    _, layers = _fs()
    layer = layers.ColumnParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                        gather_output=gather_output, init_method=_no_init)
    layer.weight.copy_(_shard(linear.weight, 0))
    tag_model_parallel(layer.weight)
    if linear.bias is not None:
        layer.bias.copy_(_shard(linear.bias, 0))
        tag_model_parallel(layer.bias)
    return layer.to(linear.weight.device)


@torch.no_grad()
def row_parallel(linear: nn.Linear, input_is_parallel: bool = True) -> nn.Module:
    """A RowParallelLinear holding this rank's columns of ``linear.weight`` (input features)."""
    _, layers = _fs()
    layer = layers.RowParallelLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                     input_is_parallel=input_is_parallel, init_method=_no_init)
    layer.weight.copy_(_shard(linear.weight, 1))
    tag_model_parallel(layer.weight)
    if linear.bias is not None:
        layer.bias.copy_(linear.bias)  # added once after the all-reduce: replicated, not tagged
    return layer.to(linear.weight.device)


@torch.no_grad()
def vocab_parallel_embedding(emb: nn.Embedding) -> nn.Module:
    """A VocabParallelEmbedding holding this rank's rows (a contiguous id range)."""
    _, layers = _fs()
    layer = layers.VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, init_method=_no_init)
    layer.weight.copy_(_shard(emb.weight, 0))
    tag_model_parallel(layer.weight)
    return layer.to(emb.weight.device)


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (fp32) of vocabulary-sharded logits ``[B, T, V / tp]``."""
    from fairscale.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy(logits.float(), targets.long()).mean()


def model_parallel_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout on a tensor-parallel shard: a different mask on each tp rank, reproducible.

    The seed of the mask is drawn from the default generator (identical on the tp
    ranks, and restored by activation checkpointing's recomputation) and offset by
    the tp rank. This plays the role of fairscale's RNG tracker, which is CUDA-only
    and whose private state a recomputation in ``torch.utils.checkpoint`` would not
    rewind.
    """
    if p <= 0 or not training:
        return x
    rank, _ = _tp()
    seed = int(torch.randint(0, 2**62, (1,)).item()) + 1_000_003 * rank
    gen = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * keep / (1.0 - p)


def plain_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p > 0 else x
