"""FLOPs and MFU against the conventions written out by hand: PaLM's ``6 N + 12 L H Q T`` per token
for GPT (N the matmul weights, H Q = d_model, T the sequence, no causal halving), for the dilated
LM the (query, key) pairs its kernels are given, enumerated position by position, and MFU as the
achieved FLOP/s of one rank over the datasheet peak of the precision that ran."""
from __future__ import annotations

import pytest
import torch

from dstrain.bench import rates
from dstrain.engine.hardware import gpu_peak
from models import registry
from models.dilated_lm import DilatedLM
from models.gpt.model import GPT, GPTConfig


@pytest.mark.parametrize("L,d,V,ratio,T", [(2, 32, 53, 4, 64), (3, 48, 257, 2, 17)])
def test_gpt_flops_per_token_is_palms_count(L, d, V, ratio, T):
    with torch.device("meta"):
        model = GPT(GPTConfig(block_size=64, n_layer=L, n_head=4, n_embd=d, vocab_size=V, mlp_ratio=ratio))
    n = L * (3 * d * d + d * d + 2 * ratio * d * d) + V * d  # qkv, out, MLP up/down; lm_head; no embeddings
    assert model.flops_per_token(T) == 6 * n + 12 * L * d * T


def _pairs_per_head(T: int, w: int, r: int, offset: int) -> int:
    """(query, key) pairs one head's kernel call is given in branch (w, r): per segment, the positions
    p with p mod r == offset attend to every such position of the segment (no causal halving)."""
    w = min(w, T)
    total = 0
    for start in range(0, T, w):
        picked = [p for p in range(start, start + w) if (p - start) % r == offset]
        total += len(picked) ** 2
    return total


@pytest.mark.parametrize("T", [64, 128, 256])
def test_dilated_lm_counts_the_pairs_its_branches_compute(T):
    cfg = registry.make_model_config("dilated_lm", "debug", {"segment_lengths": [32, 64, 128],
                                                             "dilation_rates": [1, 2, 4]})
    with torch.device("meta"):
        model = DilatedLM(cfg)
    matmul = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    head_dim = cfg.n_embd // cfg.n_head
    pairs = sum(_pairs_per_head(T, w, r, h % r) for w, r in zip(cfg.segment_lengths, cfg.dilation_rates)
                for h in range(cfg.n_head))
    attention = 12 * head_dim * pairs * cfg.n_layer / T  # 4 FLOPs per pair and head dim forward, x 3
    assert model.flops_per_token(T) == pytest.approx(6 * matmul + attention, abs=1.0)


def test_mfu_is_per_rank_flops_over_the_precisions_datasheet_peak():
    out = rates(step_s=0.5, tokens_per_step=4096, world=4, flops_per_token=6e9, peak_per_rank=989e12)
    assert out["tokens_per_s"] == 8192
    assert out["flops_per_s"] == pytest.approx(8192 * 6e9)
    assert out["mfu"] == pytest.approx(8192 * 6e9 / 4 / 989e12)


@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 80GB HBM3", "fp32", 67e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H100 NVL", "bf16", 835e12),
    ("NVIDIA H200", "bf16", 989e12), ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "fp16", 312e12), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA A10", "bf16", 125e12), ("Tesla V100-SXM2-32GB", "fp16", 125e12), ("NVIDIA T4", "fp16", None)])
def test_datasheet_peak_by_device_name_and_precision(name, precision, peak):
    assert gpu_peak(name, precision) == peak
