"""The models' ``flops_per_token`` (the numerator of every MFU figure) against torch's own FLOP counter.

``torch.utils.flop_counter.FlopCounterMode`` counts the matmuls a real forward (and
backward) dispatches. Fused attention kernels are invisible to it on the CPU, so
attention runs as plain matmuls here: PyTorch's math SDPA for GPT and the policy, the
dilated path's math stand-in for the dilated LM. The convention being checked is
PaLM's: 2 FLOPs per matmul weight per token forward and 4 backward, attention's two
matmuls over every (query, key) pair the kernel is given (no causal halving).
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models import registry
from models.dilated_lm import DilatedLM
from models.gpt.model import GPT, GPTConfig
from models.policy import PolicyConfig, build_policy


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _forward_and_backward(model, ids):
    def run():
        model(ids, ids).backward()
    return run


@pytest.mark.parametrize("b, t", [(2, 64), (1, 48)])
def test_gpt_forward_and_backward(b, t):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=32, vocab_size=53))
    ids = torch.randint(0, 53, (b, t))
    with sdpa_kernel(SDPBackend.MATH):
        counted = _counted(_forward_and_backward(model, ids))
    assert counted == model.flops_per_token(t) * b * t


def test_policy_forward_and_backward():
    torch.manual_seed(0)
    model = build_policy(PolicyConfig(**registry.get_spec("policy").sizes["tiny"]))
    t = 40
    ids = torch.randint(3, 200, (2, t))
    with sdpa_kernel(SDPBackend.MATH):
        counted = _counted(_forward_and_backward(model, ids))
    expected = model.flops_per_token(t) * 2 * t
    # Some transformers releases build the RoPE table as a matmul of inv_freq [head_dim / 2, 1] by the
    # positions [1, t] (counted: 2 * head_dim / 2 * t, forward only); others by broadcasting (not counted).
    cfg = model.hf.config
    rope_table = 2 * (cfg.hidden_size // cfg.num_attention_heads // 2) * t
    assert counted in (expected, expected + rope_table), (counted, expected)


@pytest.mark.parametrize("t", [128, 64])
def test_dilated_lm_forward(monkeypatch, t):
    """Forward only, times 3: the math stand-in's backward recomputes the scores (one matmul more
    than a kernel that keeps them), so its backward count is not the convention's."""
    from dstrain.ops import attention
    monkeypatch.setattr(attention, "kernel_for", lambda q, fused=True, masked=False: "math")
    torch.manual_seed(0)
    cfg = registry.make_model_config("dilated_lm", "debug", {})
    model = DilatedLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, t))
    with torch.no_grad():
        forward = _counted(lambda: model(ids))
    assert 3 * forward == model.flops_per_token(t) * 2 * t
