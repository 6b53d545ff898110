"""The real throughput benchmark, once: ZeRO-1 against plain DDP, 2 CPU ranks, tiny model.

Checks that the launched jobs run and that the JSON they produce is complete,
not how fast anything is (speed belongs in benchmarks/results, not in tests).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dstrain import bench

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


def test_bench_zero1_two_ranks(tmp_path):
    out = tmp_path / "results" / "smoke.json"
    cmd = [sys.executable, "-m", "dstrain.cli", "bench", str(RECIPE), "--data.seq_len=64",
           "--train.micro_batch=2", "--data.max_bytes=1000000", "--profiles", "zero1", "--nproc", "2",
           "--warmup", "2", "--steps", "3", "--out", str(out), "--plot"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    result = json.loads(out.read_text())
    assert bench.check_result(result) == []
    assert out.with_suffix(".png").stat().st_size > 0
    assert result["world_size"] == 2 and result["precision"] == "fp32"
    assert result["threads_per_rank"] == 1
    assert result["peak_flops"]["per_rank"] > 0 and len(result["peak_flops"]["measurements"]) == 4
    assert result["batch"] == {"seq_len": 64, "micro_batch": 2, "grad_accum": 1, "tokens_per_step_global": 256}
    z1 = result["profiles"]["zero1"]
    assert z1["stage"] == 1 and z1["goal"] == 1.05 and isinstance(z1["goal_met"], bool)
    assert z1["nonfinite_check"] == "stop"  # the engine is timed with the check `dstrain train` attaches
    for side in ("plain", "dstrain"):
        assert len(z1[side]["step_times_s"]) == 3
        assert 0 < z1[side]["mfu"] < 1
        assert z1[side]["peak_memory_bytes"] > 50 * 2**20  # an RSS peak, not a tensor count
    assert z1["ratio"] == z1["dstrain"]["step_time_s"]["median"] / z1["plain"]["step_time_s"]["median"]
    # Same seed, same data, same AdamW update: the two loops train the same model.
    assert abs(z1["plain"]["final_loss"] - z1["dstrain"]["final_loss"]) < 1e-3
    assert "zero1" in proc.stdout and "ratio" in proc.stdout
