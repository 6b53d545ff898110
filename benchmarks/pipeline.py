"""Pipeline bubble: measured idle share of DeepSpeed's 1F1B schedule against (p - 1) / (m + p - 1).

    python benchmarks/pipeline.py [--pp 2] [--micro-batches 1,2,4,8] [--model gpt] [--size tiny]
        [--model-args n_layer=8,n_embd=256] [--micro-batch 4] [--seq-len 128] [--steps 6] [--warmup 2]
        [--partition parameters] [--out benchmarks/results/pipeline_cpu.json]

For each m (micro-batches per optimizer step = gradient accumulation) the script starts
``pp`` processes (gloo on CPU, NCCL on GPUs; one rank per stage, dp = 1), cuts the model
with dstrain's pipeline layers, and runs DeepSpeed's pipeline engine. On every rank it
times each ``train_batch`` and, inside it, the instructions that compute
(``ForwardPass``, ``BackwardPass``) and those that run after the schedule (gradient
reduction, optimizer step). A rank's bubble fraction is

    1 - compute / (step - after-schedule work)

(the share of the schedule the stage spends waiting for its neighbours or sending).
The printed figure is the mean over stages and timed steps; with equal stages and free
communication 1F1B gives (p - 1) / (m + p - 1) ("theory"). Stages are rarely equal (the last
one also computes the output layer and the loss), so the "unequal" column gives what 1F1B
would leave idle with the measured per-stage times t_s: a schedule of about
sum_s t_s + (m - 1) max_s t_s, of which stage s computes m t_s. Results go to a JSON with the command,
machine and load average beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.bench_args import check_out, count, counts  # noqa: E402


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=count(1), default=2, help="stages (one process each)")
    p.add_argument("--micro-batches", type=counts(1), default="1,2,4,8", help="comma-separated m values")
    p.add_argument("--model", default="gpt", help="a model with pipeline stages: gpt or dilated_lm")
    p.add_argument("--size", default="tiny")
    p.add_argument("--model-args", default="n_layer=8,n_embd=256,n_head=4",
                   help="comma-separated key=int changes to the size")
    p.add_argument("--micro-batch", type=count(1), default=4)
    p.add_argument("--seq-len", type=count(1), default=128)
    p.add_argument("--steps", type=count(1), default=6)
    p.add_argument("--warmup", type=count(0), default=2)
    p.add_argument("--partition", default="parameters", choices=("parameters", "uniform", "cost"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pipeline_cpu.json"),
                   help="result JSON file (default: benchmarks/results/pipeline_cpu.json)")
    args = p.parse_args(argv)
    check_out(p, args.out)
    problem = _model_problem(args)
    if problem:
        p.error(problem)
    return args


def _model_problem(args) -> str | None:
    """Why the model, size or model args cannot be cut into ``--pp`` stages (checked before any process
    starts), else None."""
    from models import registry
    try:
        mcfg = registry.make_model_config(args.model, args.size, _model_args(args.model_args))
    except (KeyError, ValueError) as err:
        return str(err.args[0] if err.args else err)
    if getattr(registry.get_spec(args.model), "pipeline", None) is None:
        return f"--model {args.model}: has no pipeline stages (gpt and dilated_lm have)"
    layers = getattr(mcfg, "n_layer", None)
    if layers is not None and layers < args.pp:
        return f"--pp {args.pp}: more stages than the model's {layers} layers"
    return None


def _model_args(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--model-args: {item!r} is not key=whole number (e.g. n_layer=8,n_embd=256)") \
                from None
    return out


def _timed(engine, instruction, bucket: dict, key: str) -> None:
    """Time the engine's handler of ``instruction`` (a schedule class); seconds add up in ``bucket[key]``.

    On a GPU a handler returns once its kernels are queued: the device is waited for before (work queued
    earlier, a receive among it, is not this instruction's) and after (its own kernels), so the seconds are
    the instruction's device time. Host-timed alone, a forward or backward counted its launches only, and the
    bubble came out near 1 whatever the schedule."""
    import torch
    original = type(engine)._INSTRUCTION_MAP[instruction]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def run(self, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return original(self, **kwargs)
        finally:
            sync()
            bucket[key] += time.perf_counter() - start
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, instruction: run}


def _worker(rank, world, port, args, m, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    torch.set_num_threads(1)
    import deepspeed

    from dstrain.parallel.dims import ParallelDims
    from dstrain.parallel.pipeline import build_pipeline_module, stage_split
    from models import registry

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    deepspeed.init_distributed(dist_backend=backend)
    torch.manual_seed(0)
    spec = registry.get_spec(args.model)
    mcfg = registry.make_model_config(args.model, args.size, _model_args(args.model_args))
    parts = spec.pipeline(mcfg, False)
    bounds, _ = stage_split(parts, args.pp, args.partition, args.micro_batch, args.seq_len)
    module = build_pipeline_module(parts, bounds, ParallelDims.from_world(world, pp=args.pp).topology())
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": m,
              "train_batch_size": args.micro_batch * m, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                           config=config)
    bucket = {"compute": 0.0, "after": 0.0}
    from deepspeed.runtime.pipe import schedule as s
    for instruction, key in ((s.ForwardPass, "compute"), (s.BackwardPass, "compute"), (s.ReduceGrads, "after"),
                             (s.ReduceTiedGrads, "after"), (s.OptimizerStep, "after")):
        _timed(engine, instruction, bucket, key)

    vocab = getattr(mcfg, "vocab_size", 257)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen),
                torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen)) for _ in range(m)]
    rows = []
    for step in range(args.warmup + args.steps):
        torch.distributed.barrier()
        bucket.update(compute=0.0, after=0.0)
        start = time.perf_counter()
        engine.train_batch(iter(batches))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        total = time.perf_counter() - start
        if step >= args.warmup:
            schedule_s = total - bucket["after"]
            rows.append({"step_s": total, "schedule_s": schedule_s, "compute_s": bucket["compute"],
                         "bubble": 1.0 - bucket["compute"] / schedule_s})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "stage": engine.stage_id, "bounds": bounds, "rows": rows}, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, m: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(args.pp, _free_port(), args, m, out), nprocs=args.pp, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.pp)]
    bubbles = [row["bubble"] for r in ranks for row in r["rows"]]
    per_stage = {r["stage"]: statistics.mean(row["bubble"] for row in r["rows"]) for r in ranks}
    step = statistics.median(max(r["rows"][i]["step_s"] for r in ranks) for i in range(args.steps))
    # 1F1B with unequal stages: the schedule lasts about sum_s t_s + (m - 1) max_s t_s (t_s: one
    # micro-batch's forward + backward on stage s); equal stages give (p - 1) / (m + p - 1).
    t = [statistics.median(row["compute_s"] for row in r["rows"]) / m for r in ranks]
    span = sum(t) + (m - 1) * max(t)
    return {"m": m, "theory": (args.pp - 1) / (m + args.pp - 1), "measured": statistics.mean(bubbles),
            "expected_for_measured_stages": 1 - statistics.mean(m * x for x in t) / span,
            "stage_micro_batch_s": t,
            "measured_stdev": statistics.stdev(bubbles) if len(bubbles) > 1 else 0.0,
            "per_stage": per_stage, "step_s_median": step, "bounds": ranks[0]["bounds"]}


def main(argv=None) -> int:
    args = _parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = []
    print(f"pp={args.pp} {args.model}/{args.size} {args.model_args} micro-batch {args.micro_batch} x "
          f"{args.seq_len} tokens, {args.steps} timed steps")
    print(f"{'m':>3}  {'theory':>7}  {'unequal':>7}  {'measured':>8}  {'stdev':>6}  per stage  step (s)")
    for m in args.micro_batches:
        r = measure(args, m)
        results.append(r)
        stages = " ".join(f"{v:.3f}" for _, v in sorted(r["per_stage"].items()))
        print(f"{m:>3}  {r['theory']:7.3f}  {r['expected_for_measured_stages']:7.3f}  {r['measured']:8.3f}  {r['measured_stdev']:6.3f}  {stages}  "
              f"{r['step_s_median']:.3f}", flush=True)
    import torch
    machine = {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
               "load_average_after": os.getloadavg(), "python": platform.python_version(),
               "torch": torch.__version__}
    record = {"command": "python benchmarks/pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": machine, "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
