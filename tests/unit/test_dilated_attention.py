"""The fast dilated-attention path against the brute-force reference (tests/dilated_reference.py)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from dstrain.ops.attention import attention_with_lse, merge_attention
from dstrain.ops.dilated import block_sparse_mask, dilated_attention, make_branches
from tests.dilated_reference import reference_dilated

TOL = 1e-5


@st.composite
def configs(draw):
    log_n = draw(st.integers(2, 5))                      # N in 4..32
    n = 2 ** log_n
    n_branches = draw(st.integers(1, 3))
    segs, rates = [], []
    for _ in range(n_branches):
        log_w = draw(st.integers(1, log_n + 1))          # may exceed N: the whole sequence is one segment
        log_r = draw(st.integers(0, min(log_w, log_n)))
        segs.append(2 ** log_w)
        rates.append(2 ** log_r)
    return dict(n=n, segs=segs, rates=rates, b=draw(st.integers(1, 2)), h=draw(st.integers(1, 4)),
                d=draw(st.sampled_from([4, 8])), causal=draw(st.booleans()),
                head_offset=draw(st.integers(0, 3)), seed=draw(st.integers(0, 2**16)))


def _inputs(c, dtype=torch.float32):
    g = torch.Generator().manual_seed(c["seed"])
    return [torch.randn(c["b"], c["h"], c["n"], c["d"], generator=g, dtype=dtype).requires_grad_()
            for _ in range(3)]


def _compare(c, sparse_block=0, sparse_keep=1.0):
    q, k, v = _inputs(c)
    out = dilated_attention(q, k, v, make_branches(c["segs"], c["rates"]), c["causal"], c["head_offset"],
                            sparse_block, sparse_keep)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference_dilated(*ref_in, c["segs"], c["rates"], c["causal"], c["head_offset"],
                            sparse_block, sparse_keep)
    torch.testing.assert_close(out.double(), ref, atol=TOL, rtol=TOL)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    for fast, slow in zip((q, k, v), ref_in):
        torch.testing.assert_close(fast.grad.double(), slow.grad, atol=TOL, rtol=TOL)


@settings(max_examples=40, deadline=None)
@given(configs())
def test_fast_path_matches_brute_force(c):
    _compare(c)


@settings(max_examples=15, deadline=None)
@given(configs(), st.sampled_from([1, 2]), st.sampled_from([0.25, 0.5, 0.75]))
def test_block_sparse_matches_brute_force(c, block, keep):
    _compare(c, sparse_block=block, sparse_keep=keep)


def test_block_sparse_drops_blocks():
    mask = block_sparse_mask(8, 2, 0.5, causal=True)
    kept = (mask == 0).float()
    assert kept.sum() < torch.ones(8, 8).tril().sum()  # something was dropped
    assert kept.diagonal().all()  # every query keeps itself
    assert block_sparse_mask(8, 2, 1.0, causal=True) is None


@pytest.mark.parametrize("causal", [True, False])
def test_one_full_branch_is_dense_attention(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    out = dilated_attention(q, k, v, make_branches([64], [1]), causal)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, dense, atol=TOL, rtol=TOL)


def test_lse_gradient_is_honoured():
    """The fused kernel's lse output carries the right gradient (checked against plain autograd)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g, requires_grad=True) for _ in range(3))
    grads = []
    for fused in (True, False):
        out, lse = attention_with_lse(q, k, v, causal=True, fused=fused)
        loss = (out * torch.arange(8.0)).sum() + (lse * torch.linspace(-2, 2, 16)).sum()
        grads.append(torch.autograd.grad(loss, (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL)


def test_merge_of_split_keys_is_full_softmax():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    full, full_lse = attention_with_lse(q, k, v)
    halves = [attention_with_lse(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 3), slice(3, 6))]
    out, lse = merge_attention(halves)
    torch.testing.assert_close(out, full, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse, full_lse, atol=TOL, rtol=TOL)


def test_uncovered_positions_get_zero():
    """Two heads, one branch with r = 4: head j sees only positions = j mod 4; the rest is 0."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    out = dilated_attention(q, k, v, make_branches([8], [4]), causal=True)
    assert torch.all(out[0, 0, [1, 2, 3, 5, 6, 7]] == 0) and torch.all(out[0, 1, [0, 2, 3, 4, 6, 7]] == 0)
    assert out[0, 0, 0].abs().sum() > 0 and out[0, 1, 1].abs().sum() > 0


@pytest.mark.parametrize("segs,rates,match", [([8, 16], [1], "same length"), ([6], [4], "multiple"),
                                              ([0], [1], "positive")])
def test_bad_branches_are_rejected(segs, rates, match):
    with pytest.raises(ValueError, match=match):
        make_branches(segs, rates)


def test_sequence_that_does_not_tile_is_rejected():
    q = torch.randn(1, 1, 12, 4)
    with pytest.raises(ValueError, match="does not tile"):
        dilated_attention(q, q, q, make_branches([8], [1]))
