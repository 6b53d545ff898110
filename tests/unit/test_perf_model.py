"""The scaling model's arithmetic, checked by hand."""
from __future__ import annotations

import pytest

from dstrain.perf_model import Layout, Links, Workload, allreduce_s, ring_allreduce_s, scenarios, step_time

NO_LATENCY = Links(gpus_per_node=8, intra_bw=400e9, inter_bw=50e9, intra_latency=0.0, inter_latency=0.0)


def test_ring_allreduce_moves_two_n_minus_one_over_n():
    assert ring_allreduce_s(1e9, 4, 1e9, 0.0) == pytest.approx(1.5)
    assert ring_allreduce_s(1e9, 4, 1e9, 1e-3) == pytest.approx(1.5 + 6e-3)
    assert ring_allreduce_s(1e9, 1, 1e9, 1.0) == 0.0


def test_hierarchical_allreduce_across_nodes():
    # 16 GPUs, 8 a node, 8 GB: reduce-scatter + all-gather inside (2 x 7/8 x 8e9 / 400e9 = 0.035 s),
    # then each GPU's 1 GB share all-reduced between 2 nodes at 50 GB/s (2 x 1/2 x 1e9 / 50e9 = 0.02 s)
    assert allreduce_s(8e9, 16, NO_LATENCY) == pytest.approx(0.055)
    assert allreduce_s(8e9, 8, NO_LATENCY) == pytest.approx(2 * 7 / 8 * 8e9 / 400e9)


def test_data_parallel_step_hides_gradients_behind_backward():
    w = Workload(params=1_000_000_000, compute_s=0.3, tokens_per_gpu=16384, n_layer=24, hidden=2048,
                 seq_len=1024, micro_batch=16, grad_bytes=2.0)
    r = step_time(w, 8, Layout(overlap=1.0), NO_LATENCY)
    dp = 2 * 7 / 8 * 2e9 / 400e9
    assert r["dp_comm_s"] == pytest.approx(dp)
    assert r["dp_exposed_s"] == 0.0  # 8.75 ms hides behind 200 ms of backward
    none = step_time(w, 8, Layout(overlap=0.0), NO_LATENCY)
    assert none["step_s"] == pytest.approx(0.3 + dp)
    assert none["efficiency"] == pytest.approx(0.3 / (0.3 + dp))


def test_pipeline_bubble_and_tensor_parallel_traffic():
    w = Workload(params=8_000_000_000, compute_s=1.6, tokens_per_gpu=8192, n_layer=32, hidden=4096,
                 seq_len=1024, micro_batch=1, grad_bytes=2.0)
    # pp 2 on 2 GPUs: replica tokens 8192 x 2 = 16 micro-batches; compute per GPU 1.6 s; bubble 1/16 of it
    r = step_time(w, 2, Layout(pp=2, overlap=0.0), NO_LATENCY, tokens_per_gpu=16384)
    assert r["compute_s"] == pytest.approx(1.6)
    assert r["bubble_s"] == pytest.approx(1.6 / 16)
    act = 1 * 1024 * 4096 * 2
    assert r["pp_comm_s"] == pytest.approx(2 * 16 * act / 400e9)
    # tp 2: 4 all-reduces per layer per micro-batch of the activations
    t = step_time(w, 2, Layout(tp=2, overlap=0.0), NO_LATENCY, tokens_per_gpu=16384)
    assert t["tp_comm_s"] == pytest.approx(4 * 32 * 16 * ring_allreduce_s(act, 2, 400e9, 0.0))
    with pytest.raises(ValueError, match="do not split"):
        step_time(w, 6, Layout(tp=4), NO_LATENCY)


def test_scenarios_cover_weak_and_strong_and_skip_impossible_layouts():
    w = Workload(params=710_000_000, compute_s=0.18, tokens_per_gpu=16384, n_layer=36, hidden=1280,
                 seq_len=1024, micro_batch=16)
    rows = scenarios(w, gpu_counts=(8, 64), global_tokens=64 * 16384)
    kinds = {(r["scaling"], r["gpus"], r["layout"]) for r in rows}
    assert ("weak", 8, "dp, bf16 grads") in kinds and ("strong", 64, "dp, bf16 grads") in kinds
    assert not any(r["gpus"] == 8 and r["layout"].startswith("pp 4") for r in rows)  # 8 GPUs < tp 8 x pp 4
    # compressing gradients never makes a step slower
    for n in (8, 64):
        by = {r["layout"]: r["step_s"] for r in rows if r["gpus"] == n and r["scaling"] == "weak"}
        assert by["dp, 1-bit compressed"] <= by["dp, bf16 grads"] <= by["dp, fp32 grads"]
