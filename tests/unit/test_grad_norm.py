"""dstrain's ZeRO-0 gradient norm and clipping (``dstrain.engine.grad_norm``) against torch's
``clip_grad_norm_`` computed independently in float64, and its cost: a fixed number of dispatched
operations however many parameters the model has."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dstrain.engine.grad_norm import clip_to, total_grad_norm


def _params(n: int, seed: int = 0, dtypes=(torch.float32,)):
    g = torch.Generator().manual_seed(seed)
    params = []
    for i in range(n):
        p = torch.nn.Parameter(torch.zeros(3 + i % 5, 4, dtype=dtypes[i % len(dtypes)]))
        p.grad = (torch.randn(p.shape, generator=g) * (i + 1)).to(p.dtype)
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no gradient: left out, as DeepSpeed does
    return params


def _reference(params, max_norm):
    grads = [p.grad.double() for p in params if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return norm, [g * coef for g in grads]


@pytest.mark.parametrize("max_norm", [0.5, 1e9])  # clipping, and a bound the gradients stay under
def test_norm_and_clipped_gradients_equal_an_independent_float64_computation(max_norm):
    params = _params(12)
    ref_norm, ref_grads = _reference(params, max_norm)
    norm = total_grad_norm(params)
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(ref_norm, rel=1e-6)
    clip_to(params, max_norm, norm)
    got = [p.grad.double() for p in params if p.grad is not None]
    assert all(torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(got, ref_grads))
    if max_norm > ref_norm:
        assert all(torch.equal(a, b) for a, b in zip(got, ref_grads))  # factor exactly 1


def test_mixed_dtypes_are_grouped_and_16_bit_norms_taken_in_fp32():
    params = _params(9, seed=3, dtypes=(torch.float32, torch.bfloat16, torch.float64))
    ref_norm, _ = _reference(params, 1.0)
    assert float(total_grad_norm(params)) == pytest.approx(ref_norm, rel=1e-5)
    clip_to(params, 1.0, total_grad_norm(params))
    assert float(total_grad_norm(params)) == pytest.approx(1.0, rel=1e-2)  # bf16 gradients round


def test_non_finite_gradient_gives_a_non_finite_norm():
    params = _params(4)
    params[2].grad[0, 0] = float("nan")
    assert not torch.isfinite(total_grad_norm(params))
    params[2].grad[0, 0] = float("inf")
    assert not torch.isfinite(total_grad_norm(params))


def test_no_gradients_at_all():
    assert float(total_grad_norm([torch.nn.Parameter(torch.ones(3))])) == 0.0


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops(fn) -> int:
    with _Count() as count:
        fn()
    return count.ops


def test_cost_does_not_grow_with_the_number_of_parameters():
    """DeepSpeed's ``clip_grad_norm_`` dispatches a norm and a multiply per parameter (hundreds of kernel
    launches for a GPT); this dispatches the same few operations for 10 or 200 parameters."""
    few, many = _params(10), _params(200)
    counts = [_ops(lambda ps=ps: clip_to(ps, 0.5, total_grad_norm(ps))) for ps in (few, many)]
    assert counts[0] == counts[1] and counts[1] <= 20, counts
