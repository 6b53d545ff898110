"""Independent single-process computations the distributed runs are checked against.

Plain PyTorch only: no DeepSpeed, no dstrain engine. The data order and the model
come from the same definitions as the run (that is what is being trained); the
optimizer, schedule, clipping and averaging are written out here on their own.
"""
from __future__ import annotations

import math

import torch

from dstrain.config import RunConfig
from dstrain.data.corpus import ByteTokenizer, build_token_streams, load_documents
from dstrain.data.sampler import WindowSampler, get_batch
from models import registry


def lr_at(cfg: RunConfig, k: int) -> float:
    """Linear warm-up (k+1)/W, then cosine to min_lr_ratio at k = steps."""
    t = cfg.train
    if k < t.warmup_steps:
        return t.lr * (k + 1) / t.warmup_steps
    progress = min(1.0, (k - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def token_streams(cfg: RunConfig, cache_dir: str | None = None):
    docs = load_documents(cfg.data.corpus, cache_dir=cache_dir, max_bytes=cfg.data.max_bytes)
    return build_token_streams(docs, ByteTokenizer(), val_every=cfg.data.val_every)


def build_model(cfg: RunConfig) -> torch.nn.Module:
    torch.manual_seed(cfg.train.seed)
    spec = registry.get_spec(cfg.model.name)
    return spec.build(registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args))


def plain_training(cfg: RunConfig, world_size: int, steps: int | None = None, cache_dir=None,
                   norms: bool = False):
    """Train like the distributed run would, in one process on the whole global batch.

    Returns (per-step losses, model), or with ``norms=True`` also the per-step gradient
    norms before clipping. The global batch of a step is the union of all
    ranks' micro-batches; its mean loss equals the average of the ranks' means.
    """
    t = cfg.train
    train_tokens, _ = token_streams(cfg, cache_dir)
    sampler = WindowSampler(len(train_tokens), cfg.data.seq_len, cfg.data.seed)
    model = build_model(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    global_batch = t.micro_batch * t.grad_accum * world_size
    losses, grad_norms = [], []
    for k in range(steps if steps is not None else t.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, k)
        x, y = get_batch(train_tokens, sampler.global_indices(k, global_batch), cfg.data.seq_len)
        loss = model(x, y)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), t.grad_clip if t.grad_clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return (losses, grad_norms, model) if norms else (losses, model)
