"""Dilated attention on CUDA: flash and cuDNN (bf16) and efficient (fp32) kernels against independent references."""
import pytest
import torch

from dstrain.ops.attention import kernel_for, sdpa_priority
from dstrain.ops.dilated import dilated_attention, make_branches
from tests.dilated_reference import reference_dilated

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


#: (dtype, tolerance, attention backend): flash (bf16), efficient (fp32), cuDNN (bf16)
KERNELS = [(torch.bfloat16, 2e-2, "auto"), (torch.float32, 1e-4, "auto"), (torch.bfloat16, 2e-2, "cudnn")]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _grads(fn, q, k, v, up):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(up.to(out.dtype))
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("dtype, tol, backend", KERNELS)
@pytest.mark.parametrize("segs, rates, n, heads, offset", [
    ([8, 16, 32], [1, 2, 4], 64, 4, 0),
    ([16, 32], [1, 2], 64, 3, 1),           # heads not a multiple of the rate: indexed selection
    ([64, 4], [2, 1], 32, 4, 1),             # N shorter than the largest segment (not a multiple of it)
    ([8, 16, 32], [1, 2, 4], 75, 4, 0),      # N the segments do not tile: padded at the end to 96
])
def test_matches_brute_force_reference(dtype, tol, backend, segs, rates, n, heads, offset):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, up = (torch.randn(2, heads, n, 64, device="cuda", generator=g) for _ in range(4))
    branches = make_branches(segs, rates)
    expected = "efficient" if dtype == torch.float32 else {"auto": "flash", "cudnn": "cudnn"}[backend]
    with sdpa_priority(backend):
        assert kernel_for(q.to(dtype)) == expected
        out, grads = _grads(lambda *t: dilated_attention(*t, branches, True, offset),
                            *(x.to(dtype) for x in (q, k, v)), up)
    ref, ref_grads = _grads(lambda *t: reference_dilated(*t, segs, rates, True, offset), *(x.cpu().double()
                                                                                           for x in (q, k, v)),
                            up.cpu().double())
    assert _rel(out.cpu(), ref) < tol
    for a, b in zip(grads, ref_grads):
        assert _rel(a.cpu(), b) < tol


@pytest.mark.parametrize("dtype, tol, backend", KERNELS)
def test_long_sequence_matches_the_math_stand_in_with_lse_gradient(dtype, tol, backend):
    """N = 8192 with the model's branch ladder: kernels against the fp32 math path, output, lse and grads."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, up = (torch.randn(1, 12, 8192, 64, device="cuda", generator=g) for _ in range(4))
    gl = torch.randn(1, 12, 8192, device="cuda", generator=g)
    branches = make_branches([2048, 4096, 8192], [1, 2, 4])

    def run(fused, dt):
        x = [t.to(dt).clone().requires_grad_() for t in (q, k, v)]
        out, lse = dilated_attention(*x, branches, True, 0, return_lse=True, fused=fused)
        ((out.float() * up).sum() + (lse.float() * gl).sum()).backward()
        return out.detach().float(), lse.detach().float(), [t.grad.float() for t in x]

    with sdpa_priority(backend):
        out, lse, grads = run(True, dtype)
    ref, ref_lse, ref_grads = run(False, torch.float32)
    assert _rel(out, ref) < tol and _rel(lse, ref_lse) < 1e-3
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < tol


@pytest.mark.parametrize("dtype, kind, tol", [(torch.bfloat16, "flash", 2e-2), (torch.float16, "flash", 5e-3),
                                              (torch.float32, "efficient", 1e-4), (torch.bfloat16, "cudnn", 2e-2)])
@pytest.mark.parametrize("m", [40, 256])  # 40: the efficient kernel's lse is padded to 64 queries
def test_primitives_backward_from_merged_out_and_lse(dtype, kind, tol, m):
    """The CUDA kernels honour an out/lse given from outside (ring-attention style): the backward of two
    key halves against the MERGED out and lse equals the full attention's gradient (fp32 math path)."""
    from dstrain.ops.attention import flash_backward, flash_forward, kernel_for, merge_attention
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, dout = (torch.randn(2, 3, m, 64, device="cuda", generator=g) for _ in range(4))
    ref_out, ref_lse = flash_forward(q, k, v, fused=False)
    ref = flash_backward(dout, q, k, v, ref_out, ref_lse, fused=False)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    with sdpa_priority("cudnn" if kind == "cudnn" else "auto"):
        assert kernel_for(q) == kind
    halves = [slice(0, m // 3), slice(m // 3, m)]
    merged, lse = merge_attention([flash_forward(q, k[:, :, s], v[:, :, s], kind=kind) for s in halves])
    assert _rel(merged, ref_out) < tol and _rel(lse, ref_lse) < 1e-3
    dq = torch.zeros_like(q, dtype=torch.float32)
    for s in halves:
        gq, gk, gv = flash_backward(dout, q, k[:, :, s], v[:, :, s], merged, lse, kind=kind)
        dq += gq.float()
        assert _rel(gk, ref[1][:, :, s]) < tol and _rel(gv, ref[2][:, :, s]) < tol
    assert _rel(dq, ref[0]) < tol


@pytest.mark.parametrize("dtype, tol, backend", KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 256])  # 256: FlashAttention-2's forward, the lse-gradient backward past its limit
def test_attention_with_lse_gradient_on_cuda(dtype, tol, backend, causal, d):
    """attention_with_lse on CUDA kernels (the lse gradient through the extra head columns) against fp32 math."""
    from dstrain.ops.attention import attention_with_lse
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, up = (torch.randn(2, 4, 200, d, device="cuda", generator=g) for _ in range(4))
    gl = torch.randn(2, 4, 200, device="cuda", generator=g)

    def run(fused, dt):
        x = [t.to(dt).clone().requires_grad_() for t in (q, k, v)]
        out, lse = attention_with_lse(*x, causal=causal, fused=fused)
        ((out.float() * up).sum() + (lse.float() * gl).sum()).backward()
        return [out.detach().float(), lse.detach().float()] + [t.grad.float() for t in x]

    with sdpa_priority(backend):
        fused = run(True, dtype)
    for a, b in zip(fused, run(False, torch.float32)):
        assert _rel(a, b) < tol
