"""Communication logging on a real 2-rank job: the bytes DeepSpeed moves match the model's size.

ZeRO-0 data parallelism all-reduces every gradient once per optimizer step, so the
logged all-reduce volume must be P x (bytes of the communication dtype), give or take
DeepSpeed's few scalar reductions; asking for bf16 communication must halve it.
"""
from __future__ import annotations

import contextlib

import pytest

from tests.dist.harness import beside, metrics, run_config
from models import registry


def _params() -> int:
    cfg = run_config(__import__("pathlib").Path("unused"), 1)
    model = registry.get_spec(cfg.model.name).build(
        registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args))
    return sum(p.numel() for p in model.parameters())


CASES = {"auto": 4, "bf16": 2}  # deepspeed.comm_dtype -> bytes per parameter


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``comm_dtype -> run folder``: both jobs, launched side by side (independent: on 2 cores their start-ups
    overlap)."""
    outs, jobs = {}, []
    with contextlib.ExitStack() as stack:
        for comm_dtype in CASES:
            outs[comm_dtype] = out = tmp_path_factory.mktemp("comms") / comm_dtype
            jobs.append(stack.enter_context(beside(
                ["--data.seq_len=64", "--data.max_bytes=1000000", "--train.micro_batch=2", "--train.grad_accum=2",
                 "--train.log_every=2", "--train.steps=4", "--train.warmup_steps=2", "--train.eval_batches=1",
                 "--output.tensorboard=false", "--output.progress=false", "--deepspeed.precision=fp32",
                 "--deepspeed.profile=zero0", "--output.comms=true", f"--deepspeed.comm_dtype={comm_dtype}",
                 f"--output.dir={out}"])))
    for job in jobs:
        job.result()
    return outs


@pytest.mark.parametrize("comm_dtype,bytes_per_param", CASES.items())
def test_logged_allreduce_volume_is_one_gradient_per_step(runs, comm_dtype, bytes_per_param):
    out = runs[comm_dtype]
    volume = metrics(out, "comm/all_reduce_bytes")
    assert sorted(volume) == [2, 4]
    expected = bytes_per_param * _params()
    # steps 3-4 hold no start-up traffic: one gradient all-reduce per step plus a few scalars
    assert expected <= volume[4] <= expected + 256, (volume, expected)
    share = metrics(out, "comm/share")[4]
    assert 0.0 < share < 1.0
    assert metrics(out, "comm/total_ms")[4] > 0.0
    assert "communication logged per step" in (out / "plan.txt").read_text()
