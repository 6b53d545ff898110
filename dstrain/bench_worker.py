"""One rank of one throughput-benchmark job (started by ``python -m dstrain.bench --worker``).

The parent side (``dstrain/bench.py``) launches each job through the deepspeed
launcher; every rank builds the model (plain loop or dstrain's engine), warms up,
times its steps, and rank 0 writes the job's JSON, which the parent reads.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dstrain.bench import BenchOptions


def _device_sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_now() -> int:
    import psutil
    return int(psutil.Process().memory_info().rss)


def _plain_step_fn(model, cfg, precision, device, world, compiled: bool = False, parallel=None):
    """The reference: torch DDP (world > 1), torch AdamW over dstrain's param groups, clipping.

    ``compiled``: the strongest plain loop: ``torch.compile`` on the model (in the run's
    ``train.compile_mode``, as the engine compiles) and AdamW's fused kernel on CUDA (foreach on CPU).
    ``parallel`` (tensor or sequence parallelism: the model already parallelized on it): DDP averages the
    gradients over its replica group (dp x sp ranks holding the same tensor shard), as the engine does; the
    clipping norm is each rank's own (its tensor shard's), a plain loop's approximation of the global one.
    """
    import torch
    from dstrain.engine.factory import param_groups, scheduler_factory
    t = cfg.train
    group = parallel.replica_group if parallel is not None else None
    ddp = (parallel.dims.replica_size if parallel is not None else world) > 1
    groups = param_groups(model, t.weight_decay)
    if compiled:
        from dstrain.engine.compiling import compile_kwargs
        model = torch.compile(model, **compile_kwargs(t.compile_mode))
    if ddp:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
    fused = {"fused": True} if compiled and device.type == "cuda" else {}
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, **fused)
    sched = scheduler_factory(t)(opt)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(micro):
        losses = []
        for k, (x, y) in enumerate(micro):
            sync = model.no_sync() if ddp and k < len(micro) - 1 else contextlib.nullcontext()
            amp = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
            with sync:
                with amp:
                    loss = model(x, y)
                scaler.scale(loss / len(micro)).backward()
            losses.append(loss.item())
        if t.grad_clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    model.train()
    return step, f"torch.optim.{type(opt).__name__} (foreach={opt.defaults.get('foreach')}, " \
                 f"fused={opt.defaults.get('fused')})" + (" + DDP" if ddp else "") + \
        (f" + torch.compile ({t.compile_mode})" if compiled else "")


def _dstrain_step_fn(engine):
    def step(micro):
        losses = []
        for x, y in micro:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return sum(losses) / len(losses)

    engine.train()
    inner = getattr(engine.ds.optimizer, "optimizer", None)
    name = type(engine.ds.optimizer).__name__ + (f" over {type(inner).__name__}" if inner is not None else "")
    return step, name


def run_worker(opts: BenchOptions) -> int:
    """One rank of one job: build, warm up, time, gather, and (rank 0) write the job's JSON."""
    import torch
    import torch.distributed as dist
    from dstrain import runtime
    from dstrain.bench_parallel import bench_dims, local_batches, tokens_per_step
    from dstrain.config import load_run_config
    from dstrain.engine import hardware
    from dstrain.engine.factory import create_engine, plan_engine
    from dstrain.metrics import peak_memory_bytes
    from dstrain.trainers.lm import _parallel_layout, load_token_streams
    from models import registry

    cfg = load_run_config(opts.recipe, opts.overrides)
    cfg.deepspeed.profile = opts.profile
    world = runtime.init_distributed()
    start_memory = _rss_now()
    spec = registry.get_spec(cfg.model.name)
    mcfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    train_tokens, _ = load_token_streams(cfg, world)
    plan = plan_engine(cfg, world.world_size, ranks_per_node=world.local_world_size,
                       device_type=world.device.type) if world.is_main else None
    plan = runtime.broadcast_object(plan)
    if plan.pipeline is not None:  # the parent refuses parallel.pp > 1 (bench_parallel.refusal) before any launch
        raise RuntimeError(f"the throughput benchmark runs no pipeline stages (pp = {plan.pipeline.pp})")
    # The recipe's layout, as `dstrain train` builds it: batches per data-parallel replica, sequences sliced
    # across sp ranks, tensor shards over tp ranks (trainers/lm.py).
    dims = bench_dims(cfg, world.world_size)
    parallel = _parallel_layout(cfg, world)[0]

    # Every rank measures the matmul peak at the same time: what one rank gets while all are busy.
    runtime.barrier()
    peak, how = hardware.peak_flops(plan.precision)
    peaks = runtime.all_gather_object(peak) if world.device.type == "cpu" else [peak]

    t, seq = cfg.train, cfg.data.seq_len
    total = opts.warmup + opts.steps
    batches = [[tuple(v.to(world.device) for v in xy) for xy in micro]
               for micro in local_batches(train_tokens, cfg, dims, world.rank, total)]

    runtime.seed_everything(t.seed)  # identical initial weights on every rank and in both jobs
    check = None
    if opts.mode in ("plain", "plain_compiled"):
        on = {"state": parallel, "sp_mode": cfg.parallel.sp_mode} if parallel is not None else {}
        model = spec.parallelize(spec.build(mcfg), activation_checkpointing=plan.activation_checkpointing, **on)
        step, optimizer = _plain_step_fn(model.to(world.device), cfg, plan.precision, world.device,
                                         world.world_size, compiled=opts.mode == "plain_compiled", parallel=parallel)
    else:
        engine = create_engine(lambda: spec.build(mcfg), spec.parallelize, plan, t, parallel=parallel,
                               sp_mode=cfg.parallel.sp_mode)
        if t.nonfinite != "off":  # what `dstrain train` runs: the gradient watch and its per-step check
            from dstrain.resilience import NonFiniteGuard
            engine.watch(NonFiniteGuard(t.nonfinite, t.max_consecutive_skips, world.rank, world.world_size),
                         check=t.nonfinite_check)  # its loop has no per-step updates of its own
        step, optimizer = _dstrain_step_fn(engine)
        check = engine.nonfinite_check
    runtime.seed_everything(t.seed + 7919 * (world.rank // dims.tp + 1))  # tp ranks share dropout, as in training

    times, cpu_times, losses, comm = [], [], [], []
    from dstrain.comms import CommsMeter
    meter = CommsMeter(0)  # reads DeepSpeed's comms logger when output.comms switched it on
    prof_dir = os.environ.get("DSTRAIN_BENCH_CPROFILE")  # where the time goes: one .pstats per rank
    prof = None
    for s in range(total):
        if prof_dir and s == opts.warmup:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        runtime.barrier()
        _device_sync(world.device)
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(batches[s]))
        _device_sync(world.device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        comm.append(meter.read(s + 1))
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(prof_dir, f"{opts.mode}_{opts.profile}_rank{world.rank}.pstats"))

    stats = torch.tensor(times[opts.warmup:] + cpu_times[opts.warmup:]
                         + [float(peak_memory_bytes()), float(start_memory)],
                         dtype=torch.float64, device=world.device)
    mean_losses = torch.tensor(losses, dtype=torch.float64, device=world.device)
    if world.world_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        dist.all_reduce(mean_losses)
        mean_losses /= world.world_size
    if world.is_main:
        with torch.device("meta"):
            meta_model = spec.build(mcfg)
        fpt = meta_model.flops_per_token(seq) if hasattr(meta_model, "flops_per_token") else None
        values = stats.tolist()
        job = {"mode": opts.mode, "profile": opts.profile, "zero": plan.zero, "precision": plan.precision,
               "activation_checkpointing": plan.activation_checkpointing, "optimizer": optimizer,
               "nonfinite": t.nonfinite if opts.mode == "dstrain" else None,
               "nonfinite_check": check if opts.mode == "dstrain" else None,
               "step_times_s": values[:opts.steps], "cpu_times_s": values[opts.steps:-2],
               "peak_memory_bytes": int(values[-2]), "estimated_memory_bytes": _estimate(plan, opts.profile),
               "compiled": plan.compile if opts.mode == "dstrain" else opts.mode == "plain_compiled",
               "start_memory_bytes": int(values[-1]), "losses": mean_losses.tolist(),
               "peak_flops": {"per_rank": peaks, "how": how}, "threads_per_rank": torch.get_num_threads(),
               "flops_per_token": fpt, "comm_ms": [c.get("total_ms", 0.0) for c in comm[opts.warmup:]],
               "comm_bytes": [c.get("total_bytes", 0.0) for c in comm[opts.warmup:]],
               "comm_logged": meter.active(), "params": sum(p.numel() for p in meta_model.parameters()),
               "tokens_per_step": tokens_per_step(cfg, dims), "world_size": world.world_size,
               "parallel": {"dp": dims.dp, "tp": dims.tp, "sp": dims.sp, "pp": dims.pp}}
        Path(opts.result).write_text(json.dumps(job))
    runtime.barrier()
    if world.device.type == "cpu":
        runtime.release_cpu_comm_buffer(world.rank)
    runtime.shutdown_distributed()
    return 0


def _estimate(plan, profile: str) -> int | None:
    """The factory's device-memory estimate for ``profile`` (None when it was not planned)."""
    if plan.plan is None:
        return None
    for e in plan.plan.estimates:
        if e.profile == profile and e.activation_checkpointing == plan.activation_checkpointing:
            return int(e.device_total)
    return None
