"""polyak_update_: the plain formula, name checks, and a measured bound on its extra memory."""
import gc
import re

import pytest
import torch
from torch import nn

from dstrain.rl.polyak import polyak_update_


def _small(seed: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, 7), nn.LayerNorm(7), nn.Embedding(11, 5), nn.BatchNorm1d(3)).to(dtype)


def _state(module):
    return {k: v.detach().clone() for k, v in module.named_parameters()}


@pytest.mark.parametrize("tau", [0.005, 0.3, 1.0])
@pytest.mark.parametrize("chunk", [1, 7, 50, 1 << 20])
def test_matches_plain_formula(tau, chunk):
    target, source = _small(0), _small(1)
    t0, s0 = _state(target), _state(source)
    polyak_update_(target, source, tau, chunk_numel=chunk)
    for name, p in target.named_parameters():
        expected = (1 - tau) * t0[name] + tau * s0[name]
        assert torch.allclose(p, expected, rtol=1e-6, atol=1e-7), name
        if tau == 1.0:
            assert torch.equal(p, s0[name])
        if not torch.equal(t0[name], s0[name]):
            assert not torch.equal(p, t0[name])  # it did change
    for name, q in source.named_parameters():
        assert torch.equal(q, s0[name])  # the source is read only


def test_repeated_updates_converge_geometrically():
    target, source = _small(0), _small(1)
    t0, s0 = _state(target), _state(source)
    for _ in range(5):
        polyak_update_(target, source, 0.1, chunk_numel=3)
    w = target[0].weight
    expected = s0["0.weight"] + 0.9 ** 5 * (t0["0.weight"] - s0["0.weight"])
    assert torch.allclose(w, expected, atol=1e-6)


def test_cross_dtype_source_and_no_grad():
    target = _small(0)
    source = _small(1, torch.float64)
    t0, s0 = _state(target), _state(source)
    polyak_update_(target, source, 0.25, chunk_numel=4)
    for name, p in target.named_parameters():
        assert p.dtype == torch.float32 and p.grad is None and p.requires_grad
        expected = (0.75 * t0[name].double() + 0.25 * s0[name]).float()
        assert torch.allclose(p, expected, atol=1e-6), name


def test_buffers_optional():
    target, source = _small(0), _small(1)
    with torch.no_grad():
        source[3].running_mean.fill_(2.0)
        source[3].num_batches_tracked.fill_(7)
    polyak_update_(target, source, 0.5)
    assert torch.equal(target[3].running_mean, torch.zeros(3))  # buffers untouched by default
    polyak_update_(target, source, 0.5, buffers=True)
    assert torch.allclose(target[3].running_mean, torch.ones(3))
    assert int(target[3].num_batches_tracked) == 7  # integer buffers are copied


@pytest.mark.parametrize("tau", [0, 0.0, -0.1, 1.0001, float("nan"), float("inf"), True, "0.1"])
def test_tau_validation(tau):
    with pytest.raises(ValueError, match="0 < tau <= 1"):
        polyak_update_(_small(0), _small(1), tau)


@pytest.mark.parametrize("chunk", [0, -1, 2.5, True])
def test_chunk_validation(chunk):
    with pytest.raises(ValueError, match="chunk_numel"):
        polyak_update_(_small(0), _small(1), 0.1, chunk_numel=chunk)


def test_mismatched_names_and_shapes_are_listed():
    target = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    source = nn.Sequential(nn.Linear(4, 5), nn.Linear(3, 2), nn.Linear(2, 2))
    before = _state(target)
    with pytest.raises(ValueError) as err:
        polyak_update_(target, source, 0.5)
    msg = str(err.value)
    assert "only in source: 2.bias, 2.weight" in msg
    assert "0.weight target [3, 4] vs source [5, 4]" in msg and "0.bias target [3] vs source [5]" in msg
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())  # nothing half-done
    with pytest.raises(ValueError, match="only in target: 2.bias, 2.weight"):
        polyak_update_(source, target, 0.5)


def test_non_contiguous_refused_before_any_write():
    target, source = nn.Linear(4, 3), nn.Linear(4, 3)
    with torch.no_grad():
        source.weight.data = source.weight.data.t().contiguous().t()  # same shape, strided
    before = _state(target)
    with pytest.raises(ValueError, match="contiguous tensors.*weight"):
        polyak_update_(target, source, 0.5)
    assert all(torch.equal(p, before[n]) for n, p in target.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_source_on_gpu_target_on_cpu():
    target, source = _small(0), _small(1).cuda()
    t0, s0 = _state(target), _state(source)
    polyak_update_(target, source, 0.3, chunk_numel=5)
    for name, p in target.named_parameters():
        assert p.device.type == "cpu"
        assert torch.allclose(p, 0.7 * t0[name] + 0.3 * s0[name].cpu(), atol=1e-6)


# ------------------------------------------------------------------ measured memory

def _hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def _peak_growth(fn) -> int:
    """Peak resident-set growth (bytes) while ``fn`` runs, from VmHWM after resetting it."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as err:
        pytest.skip(f"cannot reset the peak RSS: {err}")
    base = _hwm_bytes()
    fn()
    return _hwm_bytes() - base


class _Big(nn.Module):
    """~256 MB of fp32: one 192 MB matrix and four 16 MB ones."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.big = nn.Parameter(torch.empty(6144, 8192, dtype=dtype).uniform_(-1, 1))
        self.small = nn.ParameterList(nn.Parameter(torch.empty(2048, 2048, dtype=dtype).uniform_(-1, 1))
                                      for _ in range(4))


def test_peak_memory_is_one_chunk_not_a_model_copy():
    if not hasattr(torch.Tensor, "lerp_"):  # pragma: no cover
        pytest.skip("torch without lerp_")
    try:
        _peak_growth(lambda: None)
    except FileNotFoundError:  # pragma: no cover - not Linux
        pytest.skip("no /proc")
    polyak_update_(_small(0), _small(1), 0.5)  # warm up kernels outside the measurement
    target, source = _Big(), _Big()
    model_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    largest = target.big.numel() * 4
    assert 250e6 < model_bytes < 270e6
    mb = 1e6
    chunk = 1 << 20  # 4 MB of fp32 per temporary

    ours = _peak_growth(lambda: polyak_update_(target, source, 0.01, chunk_numel=chunk))
    src_bf16 = _Big(torch.bfloat16)  # conversion path: chunks go through one fp32 staging buffer
    convert = _peak_growth(lambda: polyak_update_(target, src_bf16, 0.01, chunk_numel=chunk))
    src_bf16 = None  # free it before the naive measurements

    def naive():
        for p, q in zip(target.parameters(), source.parameters()):
            with torch.no_grad():
                p.mul_(0.99).add_(0.01 * q)  # allocates 0.01 * q, one parameter large

    def state_dict_copy():
        new = {k: 0.99 * v + 0.01 * source.state_dict()[k] for k, v in target.state_dict().items()}
        target.load_state_dict(new)

    naive_growth = _peak_growth(naive)
    copy_growth = _peak_growth(state_dict_copy)
    print(f"model {model_bytes / mb:.0f} MB, largest parameter {largest / mb:.0f} MB; peak RSS growth: "
          f"polyak_update_ {ours / mb:.1f} MB, from a bf16 source (one fp32 staging chunk of {chunk * 4 / mb:.1f} MB) "
          f"{convert / mb:.1f} MB, "
          f"naive per-parameter {naive_growth / mb:.1f} MB, state_dict copy {copy_growth / mb:.1f} MB")
    # the measurement can fail: the naive forms do show up
    assert naive_growth > 0.7 * largest
    assert copy_growth > 0.9 * model_bytes
    # ours stays within a few chunks, far below one parameter, let alone the model
    assert ours < 2 * chunk * 4  # same dtype and device: no temporaries at all
    assert convert < 3 * chunk * 4  # one reused staging chunk (plus page rounding)
