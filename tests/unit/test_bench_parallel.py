"""The throughput benchmark under model parallelism (tp / sp / pp): tokens and FLOPs counted once per data-parallel
replica, batches split as `dstrain train` splits them, pipeline stages refused in one line; and a DeepSpeed JSON that
turns torch_autocast on itself planned with the fp32 row of model states. One process, no launch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dstrain import bench, bench_parallel
from dstrain.bench_scaling import point
from dstrain.config import load_run_config
from dstrain.parallel.dims import ParallelDims

ROOT = Path(__file__).resolve().parents[2]
DILATED = ROOT / "models" / "dilated_lm" / "recipes" / "debug.json"  # parallel.sp = 2
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


def _by_definition(cfg, dp: int) -> int:
    """Global batch x seq_len per optimizer step, once per data-parallel replica."""
    return cfg.train.micro_batch * cfg.train.grad_accum * dp * cfg.data.seq_len


@pytest.mark.parametrize("dims", [ParallelDims(dp=1, sp=2), ParallelDims(dp=1, tp=2), ParallelDims(dp=1, pp=2),
                                  ParallelDims(dp=2), ParallelDims(dp=2, sp=2), ParallelDims(dp=2, tp=2, sp=2)])
def test_tokens_and_mfu_count_each_replica_once(dims):
    cfg = load_run_config(DILATED, ["--train.grad_accum=3"])
    tokens = bench_parallel.tokens_per_step(cfg, dims)
    assert tokens == _by_definition(cfg, dims.dp)
    fpt, step_s, peak = 6.0e6, 0.25, 5.0e10
    got = bench.rates(step_s, tokens, dims.world_size, fpt, peak)
    assert got["tokens_per_s"] == pytest.approx(_by_definition(cfg, dims.dp) / step_s)
    # MFU = model FLOPs per step / step time / (peak per device x number of devices)
    want = fpt * _by_definition(cfg, dims.dp) / step_s / (peak * dims.world_size)
    assert got["mfu"] == pytest.approx(want)


def test_recipe_degrees_give_the_data_parallel_count():
    # debug.json at 2 ranks is one replica sliced over 2 sp ranks: 8 x 128 tokens a step, not 2 x that
    cfg = load_run_config(DILATED)
    dims = bench_parallel.bench_dims(cfg, 2)
    assert (dims.dp, dims.sp, dims.tp) == (1, 2, 1)
    assert bench_parallel.tokens_per_step(cfg, dims) == 8 * 128
    tp = load_run_config(DILATED, ["--parallel.sp=1", "--parallel.tp=2"])
    assert bench_parallel.tokens_per_step(tp, bench_parallel.bench_dims(tp, 4)) == 2 * 8 * 128


def test_scaling_point_counts_replicas_not_ranks():
    # a scaling job whose 2 ranks are one sequence-parallel replica trains 2 x 1 x 64 tokens a step
    job = {"step_times_s": [0.5, 0.5, 0.5], "world_size": 2, "grad_accum": 1, "comm_ms": [], "comm_bytes": [],
           "losses": [1.0], "threads_per_rank": 1, "peak_memory_bytes": 1, "parallel": {"dp": 1, "tp": 1, "sp": 2}}
    p = point("weak", job, base_step_s=0.5, seq_len=64, micro_batch=2)
    assert p["tokens_per_step"] == 2 * 64 and p["tokens_per_s"] == pytest.approx(2 * 64 / 0.5)
    job["parallel"]["dp"], job["parallel"]["sp"] = 2, 1
    assert point("weak", job, base_step_s=0.5, seq_len=64, micro_batch=2)["tokens_per_step"] == 2 * 2 * 64


def test_batches_follow_the_trainers_split():
    # sp ranks of a replica share its samples, each with its half of every sequence; tp ranks hold the same
    # tokens; replicas take different samples. Before, every rank drew its own samples as a dp rank.
    cfg = load_run_config(DILATED, ["--data.seq_len=16", "--train.micro_batch=2", "--train.grad_accum=2"])
    tokens = torch.arange(5000) % 251
    dims = ParallelDims(dp=2, sp=2)
    ranks = [bench_parallel.local_batches(tokens, cfg, dims, r, 2) for r in range(dims.world_size)]
    whole = [bench_parallel.local_batches(tokens, cfg, ParallelDims(dp=2), dp, 2) for dp in range(2)]
    for r, mine in enumerate(ranks):
        dp, sp, _ = dims.coords(r)
        for step, micro in enumerate(mine):
            for k, (x, y) in enumerate(micro):
                fx, fy = whole[dp][step][k]
                assert x.shape == (2, 8)
                assert torch.equal(x, fx[:, 8 * sp:8 * sp + 8]) and torch.equal(y, fy[:, 8 * sp:8 * sp + 8])
    assert not torch.equal(whole[0][0][0][0], whole[1][0][0][0])
    tp = ParallelDims(dp=1, tp=2)
    a, b = (bench_parallel.local_batches(tokens, cfg, tp, r, 1)[0] for r in range(2))
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert a[0][0].shape == (2, 16)


def _no_launch(*args, **kwargs):
    raise AssertionError("a job was launched")


@pytest.mark.parametrize("argv, says", [
    ([str(TINY), "--parallel.pp=2"], "parallel.pp = 2: the throughput benchmark compares dstrain with a plain"),
    ([str(DILATED), "--nproc", "3"], "3 rank(s) for parallel.tp = 1, sp = 2: world size 3 is not divisible"),
    ([str(DILATED), "--scaling", "1,2", "--train.grad_accum=2"], "1 rank(s) for parallel.tp = 1, sp = 2"),
])
def test_refused_in_one_line_before_any_launch(argv, says, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench, "_launch", _no_launch)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # CPU ranks (with one GPU visible, 2 ranks are refused first)
    assert bench.main([*argv, "--profiles", "zero1", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1 and err.startswith("dstrain bench: error: ")


def test_file_torch_autocast_plans_the_fp32_row(tmp_path, monkeypatch):
    # A user's JSON turning torch_autocast on itself, deepspeed.mixed_precision left auto: DeepSpeed runs bf16 as
    # autocast over fp32 weights (factory.mixed_precision), so ZeRO-1/2/3's model states are the fp32 row.
    from dstrain.engine import factory
    from dstrain.engine.profiles import Activations, Hardware, model_state_bytes
    template = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    template.pop("bf16")
    template.pop("fp16")
    template["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    path = tmp_path / "my_zero2_autocast.json"
    path.write_text(json.dumps(template))
    cfg = load_run_config(TINY, [f"--deepspeed.profile={path}"])
    gpu = Hardware("cuda", device_memory=80 * 2**30, host_memory=512 * 2**30, ranks_per_node=2,
                   bf16_supported_fast=True, fp16_supported=True, name="gpu")
    seen = {}
    real = factory.choose_plan

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(factory, "choose_plan", spy)
    traced = Activations(10**6, 10**5, ((10**6, 10**5), (10**5, 10**5)))  # the trace is not what is checked here
    monkeypatch.setattr(factory.hardware, "trace_activations", lambda *args, **kwargs: traced)
    plan = factory.plan_engine(cfg, 2, hw=gpu)
    assert plan.ds_config["torch_autocast"]["enabled"] is True and plan.precision == "bf16"
    assert seen["mixed_precision"] == "autocast"
    spec, mcfg = factory._model_parts(cfg)
    stats = factory.hardware.model_stats(lambda: spec.build(mcfg))
    est = real(stats, gpu, Activations(1, 1), 2, 8, profiles=("zero2",), activation_checkpointing=False,
               mixed_precision=seen["mixed_precision"]).estimates[0]  # the planner's zero2 row for this run
    assert est.model_states == model_state_bytes("zero2", stats, 2, "fp32", 2)[0]
    assert est.model_states != model_state_bytes("zero2", stats, 2, "bf16", 2)[0]
    # the same file with its bf16 switched on keeps DeepSpeed's 16-bit weights: no change there
    template["bf16"] = {"enabled": True}
    path.write_text(json.dumps(template))
    seen.clear()
    factory.plan_engine(load_run_config(TINY, [f"--deepspeed.profile={path}"]), 2, hw=gpu)
    assert seen["mixed_precision"] == "auto"

