"""Dilated attention on CUDA: flash (bf16) and efficient (fp32) kernels against independent references."""
import pytest
import torch

from dstrain.ops.dilated import dilated_attention, make_branches
from tests.dilated_reference import reference_dilated

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _grads(fn, q, k, v, up):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(up.to(out.dtype))
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
@pytest.mark.parametrize("segs, rates, n, heads, offset", [
    ([8, 16, 32], [1, 2, 4], 64, 4, 0),
    ([16, 32], [1, 2], 64, 3, 1),           # heads not a multiple of the rate: indexed selection
    ([64, 4], [2, 1], 32, 4, 1),             # N shorter than the largest segment (not a multiple of it)
])
def test_matches_brute_force_reference(dtype, tol, segs, rates, n, heads, offset):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, up = (torch.randn(2, heads, n, 64, device="cuda", generator=g) for _ in range(4))
    branches = make_branches(segs, rates)
    out, grads = _grads(lambda *t: dilated_attention(*t, branches, True, offset), *(x.to(dtype) for x in (q, k, v)),
                        up)
    ref, ref_grads = _grads(lambda *t: reference_dilated(*t, segs, rates, True, offset), *(x.cpu().double()
                                                                                           for x in (q, k, v)),
                            up.cpu().double())
    assert _rel(out.cpu(), ref) < tol
    for a, b in zip(grads, ref_grads):
        assert _rel(a.cpu(), b) < tol


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)])
def test_long_sequence_matches_the_math_stand_in_with_lse_gradient(dtype, tol):
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

    out, lse, grads = run(True, dtype)
    ref, ref_lse, ref_grads = run(False, torch.float32)
    assert _rel(out, ref) < tol and _rel(lse, ref_lse) < 1e-3
    for a, b in zip(grads, ref_grads):
        assert _rel(a, b) < tol
