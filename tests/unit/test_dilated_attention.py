"""The fast dilated-attention path against the brute-force reference (tests/dilated_reference.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from dstrain.ops.attention import attention_with_lse, flash_backward, flash_forward, merge_attention
from dstrain.ops.dilated import block_sparse_mask, dilated_attention, make_branches
from tests.dilated_reference import reference_dilated

TOL = {torch.float64: 1e-5, torch.float32: 1e-4}


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


def _inputs(c, dtype=torch.float64, seq_major=False):
    """q, k, v ``[B, H, N, D]``; ``seq_major``: laid out ``[B, N, H, D]`` in memory, as a model's projections."""
    g = torch.Generator().manual_seed(c["seed"])
    x = [torch.randn(c["b"], c["h"], c["n"], c["d"], generator=g, dtype=torch.float64).to(dtype) for _ in range(3)]
    if seq_major:
        x = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in x]
    return [t.requires_grad_() for t in x]


def _compare(c, sparse_block=0, sparse_keep=1.0, dtype=torch.float64, fused=True, with_lse=False,
             seq_major=False):
    """Output (and lse), and the gradients of q, k, v for a random loss on them, against the reference."""
    tol = TOL[dtype]
    q, k, v = _inputs(c, dtype, seq_major)
    out, lse = dilated_attention(q, k, v, make_branches(c["segs"], c["rates"]), c["causal"], c["head_offset"],
                                 sparse_block, sparse_keep, return_lse=True, fused=fused)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = reference_dilated(*ref_in, c["segs"], c["rates"], c["causal"], c["head_offset"],
                                     sparse_block, sparse_keep, return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(out.shape, generator=g, dtype=torch.float64)
    lse_weights = torch.randn(lse.shape, generator=g, dtype=torch.float64) if with_lse else None

    def loss(o, l):
        total = (o.double() * weights).sum()
        if with_lse:  # uncovered queries have lse = -inf and no gradient
            total = total + torch.where(torch.isfinite(l), l.double(), 0.0).mul(lse_weights).sum()
        return total

    loss(out, lse).backward()
    loss(ref, ref_lse).backward()
    for fast, slow in zip((q, k, v), ref_in):
        torch.testing.assert_close(fast.grad.double(), slow.grad, atol=tol, rtol=tol)


@settings(max_examples=40, deadline=None)
@given(configs())
def test_fast_path_matches_brute_force_fp64(c):
    """The CPU flash kernel in fp64 (it accepts fp64) against the fp64 reference, to 1e-5."""
    _compare(c)


@settings(max_examples=15, deadline=None)
@given(configs())
def test_fast_path_matches_brute_force_fp32(c):
    """The CPU flash kernel in fp32 against the fp64 reference, to 1e-4."""
    _compare(c, dtype=torch.float32)


@settings(max_examples=20, deadline=None)
@given(configs(), st.booleans())
def test_sequence_major_inputs_match_brute_force(c, fused):
    """q, k, v laid out [B, N, H, D] in memory (transposed views, as the model passes them)."""
    _compare(c, fused=fused, with_lse=True, seq_major=True)


@settings(max_examples=25, deadline=None)
@given(configs())
def test_lse_and_its_gradient_match_brute_force(c):
    """return_lse: the merged lse equals the reference's, and a loss on it back-propagates exactly."""
    _compare(c, with_lse=True)


@settings(max_examples=25, deadline=None)
@given(configs(), st.booleans())
def test_cuda_logic_with_the_math_stand_in(c, with_lse):
    """fused=False: the algorithm as it runs on CUDA (gather, merge, backward from the merged out/lse)
    with the math kernel in the flash kernels' place, fp64, to 1e-5."""
    _compare(c, fused=False, with_lse=with_lse)


@settings(max_examples=15, deadline=None)
@given(configs(), st.sampled_from([1, 2]), st.sampled_from([0.25, 0.5, 0.75]))
def test_block_sparse_matches_brute_force(c, block, keep):
    _compare(c, sparse_block=block, sparse_keep=keep, with_lse=True)


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
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_gradients(fused, causal):
    """Both outputs of attention_with_lse carry their exact gradient (against plain fp64 autograd)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w_out, w_lse = torch.randn(2, 3, 16, 8, generator=g, dtype=torch.float64), torch.linspace(-2, 2, 16)

    def plain(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(8)
        if causal:
            s = s.masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), float("-inf"))
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    grads = []
    for fn in (lambda *t: attention_with_lse(*t, causal=causal, fused=fused), plain):
        out, lse = fn(q, k, v)
        grads.append(torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), (q, k, v)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("fused", [True, False])
def test_backward_from_merged_out_and_lse_is_the_pieces_share(fused):
    """Ring-attention property of the primitives: flash_backward of each key half, given the MERGED
    out and lse, sums to the gradient of attention over all keys."""
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse = flash_forward(q, k, v, False, None, fused)
    full = flash_backward(dout, q, k, v, out, lse, False, None, fused)
    halves = [slice(0, 5), slice(5, 12)]
    pieces = [flash_forward(q, k[:, :, s], v[:, :, s], False, None, fused) for s in halves]
    merged, merged_lse = merge_attention(pieces)
    torch.testing.assert_close(merged, out, atol=1e-12, rtol=1e-12)
    dq = torch.zeros_like(q)
    for s in halves:
        gq, gk, gv = flash_backward(dout, q, k[:, :, s], v[:, :, s], merged, merged_lse, False, None, fused)
        dq += gq
        torch.testing.assert_close(gk, full[1][:, :, s], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(gv, full[2][:, :, s], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(dq, full[0], atol=1e-12, rtol=1e-12)


def test_merge_of_split_keys_is_full_softmax():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    full, full_lse = attention_with_lse(q, k, v)
    halves = [attention_with_lse(q, k[:, :, s], v[:, :, s]) for s in (slice(0, 3), slice(3, 6))]
    out, lse = merge_attention(halves)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse, atol=1e-5, rtol=1e-5)


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


def test_non_causal_or_block_sparse_sequence_that_does_not_tile_is_rejected():
    """Padding is exact only for causal dense segments: non-causal queries would see the padded keys, and the
    block-sparse variant keeps a number of blocks that depends on the segment's length."""
    q = torch.randn(1, 1, 12, 4)
    with pytest.raises(ValueError, match="does not tile a sequence of 12 tokens.*non-causal and block-sparse"):
        dilated_attention(q, q, q, make_branches([8], [1]), causal=False)
    with pytest.raises(ValueError, match="does not tile a sequence of 12 tokens"):
        dilated_attention(q, q, q, make_branches([8], [1]), causal=True, sparse_block=2, sparse_keep=0.5)


@st.composite
def ragged_configs(draw):
    """Causal, N not a multiple of the largest segment (nor, often, of any): the last segments are partial."""
    n_branches = draw(st.integers(1, 3))
    segs, rates = [], []
    for _ in range(n_branches):
        log_w = draw(st.integers(1, 5))
        segs.append(2 ** log_w)
        rates.append(2 ** draw(st.integers(0, min(log_w, 2))))
    n = draw(st.integers(3, 40).filter(lambda n: n % max(segs) != 0))
    return dict(n=n, segs=segs, rates=rates, b=draw(st.integers(1, 2)), h=draw(st.integers(1, 4)),
                d=draw(st.sampled_from([4, 8])), causal=True, head_offset=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=40, deadline=None)
@given(ragged_configs())
def test_causal_sequence_that_does_not_tile_matches_brute_force(c):
    """A causal sequence that the segments do not tile is padded at the end to one they do (the shortest,
    ``padded_length``); outputs, lse and gradients equal the reference's, whose last segments are partial."""
    _compare(c)


def test_padded_length_is_the_shortest_that_tiles():
    from dstrain.ops.dilated import padded_length, tiles
    branches = make_branches([2048, 4096, 8192], [1, 2, 4])
    assert padded_length(8192, branches) == 8192 and padded_length(8193, branches) == 16384
    assert padded_length(3000, branches) == 4096  # the 8192 branch shrinks to the padded sequence
    assert padded_length(5, make_branches([8, 4], [4, 2])) == 8
    for n in range(1, 70):
        p = padded_length(n, make_branches([16, 12], [4, 3]))
        assert tiles(p, make_branches([16, 12], [4, 3])) and not any(
            tiles(m, make_branches([16, 12], [4, 3])) for m in range(n, p))


@pytest.mark.parametrize("kind, dtype", [("flash", torch.bfloat16), ("efficient", torch.float32),
                                         ("cudnn", torch.bfloat16)])
def test_cuda_kernel_calls_type_check_on_the_meta_device(monkeypatch, kind, dtype):
    """The CUDA path's aten calls (argument order, lse shapes and padding, the lse-gradient columns)
    run on meta tensors, whose kernels check signatures and infer shapes: a wrong call fails here
    without a GPU. Values are not computed; tests/gpu compares them with the reference."""
    from dstrain.ops import attention
    monkeypatch.setattr(attention, "kernel_for", lambda q, fused=True, masked=False: kind)
    q, k, v = (torch.empty(1, 4096, 4, 64, device="meta", dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    for with_lse in (False, True):
        out, lse = dilated_attention(q, k, v, make_branches([512, 1024, 2048], [1, 2, 4]), causal=True,
                                     return_lse=True)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1, 4, 4096)
        (out.float().sum() + (lse.sum() if with_lse else 0)).backward()
        assert all(t.grad.shape == t.shape and t.grad.dtype == dtype for t in (q, k, v))
        q.grad = k.grad = v.grad = None


@settings(max_examples=15, deadline=None)
@given(configs())
def test_segments_split_into_groups_match_brute_force(c):
    """Long sequences are worked in groups of segments (GROUP_ELEMENTS); here one segment a group,
    so every branch's views start mid-sequence and in later batch rows."""
    from dstrain.ops import dilated_fused
    old = dilated_fused.GROUP_ELEMENTS
    dilated_fused.GROUP_ELEMENTS = 1
    try:
        _compare(c, with_lse=True, seq_major=c["seed"] % 2 == 0)
    finally:
        dilated_fused.GROUP_ELEMENTS = old


def test_output_gradient_with_zero_strides():
    """``out.sum().backward()`` hands the backward an expanded (stride-0) gradient."""
    c = dict(n=32, segs=[8, 16, 32], rates=[1, 2, 4], b=2, h=4, d=8, causal=True, head_offset=0, seed=3)
    q, k, v = _inputs(c)
    dilated_attention(q, k, v, make_branches(c["segs"], c["rates"])).sum().backward()
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    reference_dilated(*ref_in, c["segs"], c["rates"], True, 0).sum().backward()
    for fast, slow in zip((q, k, v), ref_in):
        torch.testing.assert_close(fast.grad, slow.grad, atol=1e-10, rtol=1e-10)


def test_one_call_dispatches_a_bounded_number_of_ops():
    """The per-call cost at GPU speed is the host's dispatch of every op; three branches' forward and
    backward took 407 aten calls when each selection was a reshape/diagonal/permute chain, about 200
    with one ``as_strided`` view per selection. A regression to the chain fails here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 64, 4, 8).transpose(1, 2).requires_grad_() for _ in range(3))
    with Count():
        dilated_attention(q, k, v, make_branches([16, 32, 64], [1, 2, 4])).backward(torch.randn(1, 4, 64, 8))
    assert Count.calls <= 260, Count.calls


@pytest.mark.parametrize("b", [1, 2])
def test_first_branch_results_are_not_copied(b):
    """Inputs laid out as a model's projections ([B, N, H, D] memory), every segment of every row in one
    call: the r = 1 branch's kernel output and input gradients become the full output and gradients, with
    no full-size copy (before: one for the output, three for the gradients). Values: the brute-force tests
    above, which cover both layouts and batch sizes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class FullCopies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "copy_" and args[0].numel() * b >= q.numel():  # a row or more
                FullCopies.count += 1
            return func(*args, **(kwargs or {}))

    c = dict(n=64, segs=[16, 32, 64], rates=[1, 2, 4], b=b, h=4, d=8, causal=True, head_offset=0, seed=5)
    q, k, v = _inputs(c, torch.float32, seq_major=True)
    with FullCopies():
        dilated_attention(q, k, v, make_branches(c["segs"], c["rates"])).backward(
            torch.randn(b, 64, 4, 8).transpose(1, 2))
    assert FullCopies.count == 0


def test_cudnn_preference_for_the_primitives():
    """sdpa_priority("cudnn") makes the primitives pick cuDNN for fp16/bf16 CUDA inputs whose head dim
    leaves room for the lse-gradient columns; fp32, the CPU and wide heads keep their kernels; leaving the
    context (also by an exception) restores the default."""
    from types import SimpleNamespace

    from dstrain.ops.attention import kernel_for, sdpa_priority

    def cuda(dtype, d):
        return SimpleNamespace(device=torch.device("cuda"), dtype=dtype, shape=(1, 2, 16, d))

    with sdpa_priority("cudnn"):
        assert kernel_for(cuda(torch.bfloat16, 64)) == kernel_for(cuda(torch.float16, 120)) == "cudnn"
        assert kernel_for(cuda(torch.bfloat16, 128)) == "flash"
        assert kernel_for(cuda(torch.float32, 64)) == "efficient"
        assert kernel_for(torch.zeros(1, 2, 16, 64)) == "cpu"
        assert kernel_for(cuda(torch.bfloat16, 64), fused=False) == "math"
    assert kernel_for(cuda(torch.bfloat16, 64)) == "flash"
    with pytest.raises(RuntimeError), sdpa_priority("cudnn"):
        raise RuntimeError("inside")
    assert kernel_for(cuda(torch.bfloat16, 64)) == "flash"
