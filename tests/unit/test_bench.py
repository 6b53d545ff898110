"""Unit tests for the pure parts of dstrain.bench: arguments, statistics, goals, the result JSON."""
from __future__ import annotations

import json

import pytest

from dstrain import bench


# ---------------------------------------------------------------- arguments

def test_parse_args_defaults_and_overrides():
    opts = bench.parse_args(["r.json", "--train.micro_batch=8", "--data.seq_len=128"])
    assert opts.recipe == "r.json"
    assert opts.overrides == ["--train.micro_batch=8", "--data.seq_len=128"]
    assert (opts.profiles, opts.steps, opts.warmup, opts.nproc, opts.out, opts.plot) == (None, 20, 3, 2, None, False)
    assert opts.plain == "each" and not opts.worker


def test_parse_args_bench_options_mixed_with_overrides():
    opts = bench.parse_args(["r.json", "--profiles", "zero0,zero3", "--train.lr=1e-3", "--steps", "5",
                             "--warmup", "0", "--nproc", "4", "--out", "x/y.json", "--plot", "--plain", "once"])
    assert opts.profiles == ["zero0", "zero3"]
    assert (opts.steps, opts.warmup, opts.nproc, opts.out, opts.plot, opts.plain) == (5, 0, 4, "x/y.json", True, "once")
    assert opts.overrides == ["--train.lr=1e-3"]


def test_parse_args_worker_options():
    opts = bench.parse_args(["--worker", "--mode", "plain", "--profile", "zero2", "--result", "j.json",
                             "r.json", "--local_rank=0", "--deepspeed.precision=fp32"])
    assert opts.worker and opts.mode == "plain" and opts.profile == "zero2" and opts.result == "j.json"
    assert opts.overrides == ["--deepspeed.precision=fp32"]  # --local_rank from the launcher is dropped


@pytest.mark.parametrize("argv", [["r.json", "--bogus"], ["r.json", "--steps", "0"], ["r.json", "--warmup", "-1"],
                                  ["r.json", "--nproc", "0"], ["r.json", "--train.lr"], ["r.json", "extra"]])
def test_parse_args_rejects(argv, capsys):
    with pytest.raises(SystemExit) as err:
        bench.parse_args(argv)
    assert err.value.code == 2


# ---------------------------------------------------------------- statistics and goals

def test_summarize_median_mean_p90():
    s = bench.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s["median"] == 3.0 and s["mean"] == 3.0 and s["min"] == 1.0 and s["max"] == 5.0
    assert s["p90"] == pytest.approx(4.6)  # linear interpolation between 4 and 5
    even = bench.summarize([1.0, 2.0, 10.0, 3.0])
    assert even["median"] == 2.5  # an outlier moves the mean, not the median
    assert even["mean"] == 4.0
    with pytest.raises(ValueError):
        bench.summarize([])


@pytest.mark.parametrize("stage,offload,goal", [(0, False, 1.05), (1, False, 1.05), (2, False, 1.05),
                                                (3, False, 1.25), (2, True, None), (3, True, None)])
def test_goal_for(stage, offload, goal):
    assert bench.goal_for(stage, offload) == goal


def test_compare_ratio_and_goal():
    assert bench.compare(1.04, 1.0, 1.05) == {"ratio": pytest.approx(1.04), "goal": 1.05, "goal_met": True}
    assert bench.compare(1.2, 1.0, 1.05)["goal_met"] is False
    assert bench.compare(1.2, 1.0, 1.25)["goal_met"] is True
    assert bench.compare(2.0, 1.0, None)["goal_met"] is None
    assert bench.compare(0.5, 1.0, 1.05)["ratio"] == 0.5


def test_rates_global_tokens_flops_and_per_rank_mfu():
    r = bench.rates(step_s=0.5, tokens_per_step=2048, world=2, flops_per_token=1e6, peak_per_rank=1e9)
    assert r["tokens_per_s"] == 4096
    assert r["flops_per_s"] == pytest.approx(4.096e9)
    assert r["mfu"] == pytest.approx(4.096e9 / 2 / 1e9)
    assert bench.rates(0.5, 2048, 2, None, 1e9)["mfu"] is None
    assert bench.rates(0.5, 2048, 2, 1e6, None)["mfu"] is None


def test_job_schedule_alternates_and_once():
    each = bench.job_schedule(["zero0", "zero1", "zero2"])
    assert [(m, p) for m, p, _, _ in each] == [("plain", "zero0"), ("dstrain", "zero0"), ("dstrain", "zero1"),
                                              ("plain", "zero1"), ("plain", "zero2"), ("dstrain", "zero2")]
    assert [pair for _, _, pair, _ in each] == [0, 0, 1, 1, 2, 2]
    assert each[2][3] == "dstrain first" and each[0][3] == "plain first"
    once = bench.job_schedule(["zero1", "zero3"], plain="once")
    assert [(m, p, pair) for m, p, pair, _ in once] == [("plain", "zero1", 0), ("dstrain", "zero1", 0),
                                                       ("dstrain", "zero3", 0)]


# ---------------------------------------------------------------- result JSON from fake timings

def _job(mode, profile, pair, times, stage, mem=500 * 2**20, offload=False):
    return {"mode": mode, "profile": profile, "pair": pair, "order": "plain first",
            "zero": {"stage": stage, "offload_optimizer": offload, "offload_param": False},
            "precision": "fp32", "activation_checkpointing": False, "optimizer": f"{mode} adam",
            "step_times_s": times, "cpu_times_s": [x * 0.9 for x in times], "peak_memory_bytes": mem,
            "start_memory_bytes": 300 * 2**20,
            "losses": [5.6, 5.5, 5.4], "peak_flops": {"per_rank": [4e10, 6e10], "how": "measured matmul"},
            "threads_per_rank": 1, "flops_per_token": 5e6, "params": 886144, "tokens_per_step": 2048,
            "world_size": 2}


def _fake_result(tmp_path, monkeypatch):
    from dstrain.config import load_run_config
    from pathlib import Path
    recipe = Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json"
    cfg = load_run_config(recipe, ["--data.seq_len=128"])
    jobs = [_job("plain", "zero1", 0, [0.50, 0.52, 0.48, 0.90], 1),
            _job("dstrain", "zero1", 0, [0.51, 0.53, 0.50, 0.52], 1),
            _job("dstrain", "zero3", 1, [0.70, 0.80, 0.75], 3, mem=400 * 2**20),
            _job("plain", "zero3", 1, [0.50, 0.50, 0.50], 3)]
    opts = bench.parse_args([str(recipe), "--profiles", "zero1,zero3"])
    monkeypatch.chdir(tmp_path)
    device = {"type": "cpu", "name": "test CPU", "cpus": 2}
    return bench.assemble(opts, [str(recipe), "--profiles", "zero1,zero3"], cfg, jobs, device,
                          (0.1, 0.2, 0.3), (0.4, 0.5, 0.6), "fp32 forced")


def test_assembled_result_schema_and_numbers(tmp_path, monkeypatch):
    result = _fake_result(tmp_path, monkeypatch)
    assert bench.check_result(result) == []
    assert set(bench.RESULT_FIELDS) <= set(result)
    json.loads(json.dumps(result))  # serialisable as is
    assert result["peak_flops"]["per_rank"] == 6e10  # the best measurement of all jobs
    assert result["load_average"] == {"before": [0.1, 0.2, 0.3], "after": [0.4, 0.5, 0.6]}
    z1, z3 = result["profiles"]["zero1"], result["profiles"]["zero3"]
    assert z1["plain"]["step_time_s"]["median"] == pytest.approx(0.51)
    assert z1["dstrain"]["step_time_s"]["median"] == pytest.approx(0.515)
    assert z1["ratio"] == pytest.approx(0.515 / 0.51) and z1["goal"] == 1.05 and z1["goal_met"] is True
    assert z3["ratio"] == pytest.approx(1.5) and z3["goal"] == 1.25 and z3["goal_met"] is False
    assert z3["plain"]["step_time_s"]["median"] == 0.5  # paired with its own plain job
    assert z1["cpu_time_ratio"] == pytest.approx(0.515 / 0.51)
    assert z1["min_ratio"] == pytest.approx(0.50 / 0.48) and z3["min_ratio"] == pytest.approx(1.4)
    assert z1["dstrain"]["cpu_time_s"]["median"] == pytest.approx(0.9 * 0.515)
    d = z1["dstrain"]
    assert d["tokens_per_s"] == pytest.approx(2048 / 0.515)
    assert d["flops_per_s"] == pytest.approx(2048 / 0.515 * 5e6)
    assert d["mfu"] == pytest.approx(2048 / 0.515 * 5e6 / 2 / 6e10)
    assert z3["dstrain"]["peak_memory_bytes"] == 400 * 2**20
    table = bench.format_table(result)
    assert "zero1" in table and "zero3" in table and "NO" in table and "yes" in table


def test_check_result_reports_missing_and_nonpositive(tmp_path, monkeypatch):
    result = _fake_result(tmp_path, monkeypatch)
    del result["git_commit"]
    result["profiles"]["zero1"]["dstrain"]["mfu"] = None
    result["profiles"]["zero3"]["plain"]["peak_memory_bytes"] = 0
    problems = bench.check_result(result)
    assert "missing git_commit" in problems
    assert any("zero1.dstrain.mfu" in p for p in problems)
    assert any("zero3.plain.peak_memory_bytes" in p for p in problems)


def test_command_line_has_no_machine_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = bench.command_line([str(tmp_path / "models" / "r.json"), "--out", str(tmp_path / "o.json")])
    assert str(tmp_path) not in line
    assert "models/r.json" in line and "o.json" in line


def test_plot_writes_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    result = _fake_result(tmp_path, monkeypatch)
    bench.plot(result, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compiled_baseline_runs_once_first_and_is_compared_with_every_profile():
    sched = bench.job_schedule(["zero0", "zero2"], plain="once", compiled=True)
    assert [(m, p) for m, p, _, _ in sched] == [("plain_compiled", "zero0"), ("plain", "zero0"),
                                              ("dstrain", "zero0"), ("dstrain", "zero2")]
    assert bench.job_schedule(["zero0"], compiled=False)[0][0] == "plain"
    jobs = [_job("plain_compiled", "zero0", 0, [0.40, 0.40], 0), _job("plain", "zero0", 0, [0.50, 0.50], 0),
            _job("dstrain", "zero0", 0, [0.32, 0.32], 0), _job("dstrain", "zero2", 0, [0.80, 0.80], 2)]
    out = bench.build_profiles(jobs, tokens_per_step=1000, world=1, flops_per_token=None, peak=None)
    assert out["zero0"]["speedup_vs_compiled"] == pytest.approx(1.25)
    assert out["zero2"]["speedup_vs_compiled"] == pytest.approx(0.5)
    assert out["zero0"]["ratio"] == pytest.approx(0.64)  # against the eager plain loop, as before
    assert "vs compiled" in bench.format_table({"profiles": out})


def test_more_ranks_than_gpus_is_refused_before_any_job(monkeypatch, capsys):
    """`--nproc` defaults to 2: on a one-GPU machine rank 1 of every job died on a device that does not exist."""
    import torch

    from dstrain import launcher
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(launcher, "detect_accelerator", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert bench.main(["models/gpt/recipes/tiny.json"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("dstrain bench: error: 2 ranks asked for (--nproc; --nproc defaults to 2) but this machine "
                           "shows 1 GPU(s): use --nproc 1, or DS_ACCELERATOR=cpu for CPU ranks")
    opts = bench.parse_args(["r.json", "--nproc", "1", "--scaling", "1,4"])
    assert "4 ranks asked for (--nproc, --scaling" in bench.gpu_shortfall(opts, gpu_count=lambda: 2)
    assert bench.gpu_shortfall(bench.parse_args(["r.json", "--nproc", "2"]), gpu_count=lambda: 2) is None
    assert bench.gpu_shortfall(bench.parse_args(["r.json"]), gpu_count=lambda: 0) is None  # no GPU seen here
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert bench.gpu_shortfall(bench.parse_args(["r.json", "--nproc", "8"]), gpu_count=lambda: 1) is None
