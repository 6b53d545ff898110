"""Chunked linear cross-entropy against torch's own, values and gradients; the GPT switch."""
import pytest
import torch
import torch.nn.functional as F

from dstrain.ops.lm_head import linear_cross_entropy


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_matches_full_logits_cross_entropy_fp64(chunk):
    g = torch.Generator().manual_seed(chunk)
    x = torch.randn(3, 21, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (3, 21), generator=g)
    t[0, :5] = -100  # ignored positions
    ref = F.cross_entropy((x @ w.t()).reshape(-1, 50), t.reshape(-1), ignore_index=-100)
    gx, gw = torch.autograd.grad(ref * 1.7, (x, w))
    got = linear_cross_entropy(x, w, t, chunk=chunk)
    hx, hw = torch.autograd.grad(got * 1.7, (x, w))
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hx, gx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hw, gw, rtol=1e-10, atol=1e-12)


def test_no_grad_and_bad_input():
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    t = torch.randint(0, 10, (4,))
    with torch.no_grad():
        got = linear_cross_entropy(x, w, t, chunk=3)
    assert got == pytest.approx(F.cross_entropy(x @ w.t(), t).item(), rel=1e-5)
    with pytest.raises(ValueError, match="chunk"):
        linear_cross_entropy(x, w, t, chunk=0)
    with pytest.raises(ValueError, match="expects"):
        linear_cross_entropy(x, w, t[:3])


def test_gpt_loss_chunk_gives_the_same_loss_and_gradients():
    from models.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = dict(block_size=32, n_layer=2, n_head=2, n_embd=32)
    plain, chunked = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, loss_chunk=10))
    chunked.load_state_dict(plain.state_dict())
    x = torch.randint(0, 257, (2, 32))
    y = torch.randint(0, 257, (2, 32))
    a, b = plain(x, y), chunked(x, y)
    a.backward()
    b.backward()
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="loss_chunk"):
        GPTConfig(**cfg, loss_chunk=-1)
