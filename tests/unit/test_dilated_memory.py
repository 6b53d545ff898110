"""Memory of dilated attention: what autograd saves, and the peak of one forward+backward.

Saved for backward: q, k, v, the merged output and the merged lse, whatever the number
of branches, the kernel (fused CPU, math stand-in) or the device (meta, as the planner
traces it). Peak: measured by the profiler's allocation events (CPU allocator), it
grows in proportion to N and does not grow with the number of branches.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dstrain.ops.dilated import dilated_attention, make_branches

B, H, D = 1, 4, 16
LADDERS = {
    1: ([64], [1]),
    3: ([64, 128, 256], [1, 2, 4]),
    6: ([64, 128, 256, 512, 1024, 64], [1, 2, 4, 8, 16, 4]),
}


def _saved_bytes(n: int, branches: int, fused: bool = True, device: str = "cpu") -> int:
    """Bytes of the distinct storages autograd saves during one forward."""
    q, k, v = (torch.randn(B, H, n, D, device=device).requires_grad_() for _ in range(3))
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dilated_attention(q, k, v, make_branches(*LADDERS[branches]), causal=True, fused=fused)
    assert out.shape == q.shape
    return sum(storages.values())


def _peak_bytes(n: int, branches: int) -> int:
    """Peak bytes allocated (above what existed before) during one forward+backward."""
    q, k, v, up = (torch.randn(B, H, n, D) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = dilated_attention(q, k, v, make_branches(*LADDERS[branches]), causal=True)
        out.backward(up)
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:  # positive: allocation, negative: free
        live += nbytes
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("branches", [1, 3, 6])
@pytest.mark.parametrize("fused, device", [(True, "cpu"), (False, "cpu"), (True, "meta")])
def test_saved_bytes_are_q_k_v_out_lse(branches, fused, device):
    """Four [B, H, N, D] fp32 tensors and one [B, H, N] fp32 lse: constant per token, at every N."""
    for n in (1024, 2048, 4096):
        assert _saved_bytes(n, branches, fused, device) == B * H * n * (4 * D + 1) * 4


def test_peak_memory_is_linear_in_n_and_flat_in_branches():
    peaks = {(n, br): _peak_bytes(n, br) for n in (1024, 4096) for br in (3, 6)}
    full = B * H * 1024 * D * 4  # one [B, H, N, D] fp32 tensor at N = 1024
    assert peaks[1024, 3] > 5 * full  # it measured something: out, lse, dq, dk, dv at least
    for n in (1024, 4096):
        assert peaks[n, 6] <= 1.02 * peaks[n, 3], peaks
    for br in (3, 6):
        assert 3.8 <= peaks[4096, br] / peaks[1024, br] <= 4.2, peaks
