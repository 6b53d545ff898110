"""Scaling benchmark arithmetic: which jobs run, efficiencies, per-point communication share."""
from __future__ import annotations

from pathlib import Path

import pytest

from dstrain import bench
from dstrain.bench_scaling import efficiency, point, scaling_jobs


def test_jobs_share_the_one_rank_run_and_keep_the_global_batch_for_strong_scaling():
    assert scaling_jobs([2, 1, 4], grad_accum=4) == [
        ("base", 1, 4), ("strong", 2, 2), ("weak", 2, 4), ("strong", 4, 1), ("weak", 4, 4)]
    with pytest.raises(ValueError, match="divisible by every world size; it is not by 3"):
        scaling_jobs([1, 3], grad_accum=4)
    with pytest.raises(ValueError, match="include 1"):
        scaling_jobs([2, 4], grad_accum=4)


def test_efficiency_against_the_ideal_of_each_kind():
    # strong: ideal T(n) = T(1) / n; 1.0 s on one rank, 0.6 s on two -> 1.0 / 1.2
    assert efficiency("strong", 2, 0.6, 1.0) == pytest.approx(1 / 1.2)
    # weak: ideal T(n) = T(1); 1.0 s -> 1.25 s is 80%
    assert efficiency("weak", 4, 1.25, 1.0) == pytest.approx(0.8)
    assert efficiency("base", 1, 1.0, 1.0) == 1.0


def test_point_reports_tokens_and_communication_share():
    job = {"step_times_s": [0.5, 0.4, 0.6], "world_size": 2, "grad_accum": 2, "comm_ms": [100.0, 80.0, 120.0],
           "comm_bytes": [4e6, 4e6, 4e6], "comm_logged": True, "losses": [3.0, 2.5], "threads_per_rank": 1,
           "peak_memory_bytes": 10}
    p = point("weak", job, base_step_s=0.4, seq_len=64, micro_batch=2)
    assert p["tokens_per_step"] == 2 * 2 * 64 * 2
    assert p["tokens_per_s"] == pytest.approx(512 / 0.5)
    assert p["efficiency"] == pytest.approx(0.8)
    assert p["comm_share"] == pytest.approx(0.1 / 0.5)
    assert p["comm_bytes_per_step"] == 4e6


def test_scaling_option_parses_and_insists_on_one_rank():
    opts = bench.parse_args(["r.json", "--scaling", "1,2,4"])
    assert opts.scaling == [1, 2, 4]
    with pytest.raises(SystemExit):
        bench.parse_args(["r.json", "--scaling", "2,4"])


def test_a_grad_accum_the_ranks_cannot_split_is_one_line_and_exit_2(capsys):
    # tiny.json has grad_accum 1: 2 ranks cannot split it for strong scaling; said before any job starts
    from dstrain.bench_scaling import run_scaling
    recipe = Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json"
    opts = bench.parse_args([str(recipe), "--scaling", "1,2", "--profiles", "zero2"])
    assert run_scaling(opts, []) == 2
    err = capsys.readouterr().err
    assert err.startswith("dstrain bench: error: strong scaling keeps the global batch")
    assert "--train.grad_accum=2" in err and "Traceback" not in err
