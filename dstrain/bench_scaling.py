"""Scaling benchmark: the dstrain engine at 1..N ranks, strong and weak, with its communication share.

``dstrain bench RECIPE --scaling 1,2[,4] [--profiles zero2] [--a.b=c ...]``

- weak scaling keeps each rank's batch (micro_batch x grad_accum): the global batch
  grows with the ranks; ideal step time stays T(1), efficiency = T(1) / T(n);
- strong scaling keeps the global batch of the one-rank job: at n ranks
  grad_accum becomes grad_accum / n (it must divide); ideal step time is T(1) / n,
  efficiency = T(1) / (n T(n)).

The one-rank job serves both. Every job logs DeepSpeed's collectives
(``output.comms``, :mod:`dstrain.comms`), so each point also reports the
milliseconds and bytes per step spent in communication (rank 0's view) and their
share of the step. On a CPU the ranks share the machine's cores (threads per rank
= cores / ranks), so the figures measure the framework's overheads and
communication on that machine, not a cluster.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path


def scaling_jobs(sizes: list[int], grad_accum: int) -> list[tuple[str, int, int]]:
    """(kind, world size, grad_accum) of every job: the one-rank job, then strong and weak per size."""
    sizes = sorted(set(sizes))
    if 1 not in sizes:
        raise ValueError("scaling needs the one-rank job: include 1 in the world sizes")
    bad = [n for n in sizes if grad_accum % n]
    if bad:
        raise ValueError(f"strong scaling keeps the global batch, so train.grad_accum ({grad_accum}) must be "
                         f"divisible by every world size; it is not by {', '.join(map(str, bad))} "
                         f"(use --train.grad_accum={grad_accum * max(bad)} or other sizes)")
    jobs = [("base", 1, grad_accum)]
    for n in (m for m in sizes if m > 1):
        jobs += [("strong", n, grad_accum // n), ("weak", n, grad_accum)]
    return jobs


def efficiency(kind: str, world: int, step_s: float, base_step_s: float) -> float:
    """Achieved / ideal speed: strong T(1) / (n T(n)); weak (and the base) T(1) / T(n)."""
    if kind == "strong":
        return base_step_s / (world * step_s)
    return base_step_s / step_s


def point(kind: str, job: dict, base_step_s: float | None, seq_len: int, micro_batch: int) -> dict:
    from dstrain.bench import summarize
    step = summarize(job["step_times_s"])
    median = step["median"]
    world = job["world_size"]
    comm_ms = statistics.median(job["comm_ms"]) if job.get("comm_ms") else None
    dp = (job.get("parallel") or {}).get("dp", world)  # a job's data-parallel replicas share out the batch
    tokens = micro_batch * job["grad_accum"] * seq_len * dp
    return {"kind": kind, "world_size": world, "grad_accum": job["grad_accum"], "tokens_per_step": tokens,
            "step_time_s": step, "tokens_per_s": tokens / median,
            "efficiency": efficiency(kind, world, median, base_step_s if base_step_s else median),
            "comm_ms_per_step": comm_ms,
            "comm_bytes_per_step": statistics.median(job["comm_bytes"]) if job.get("comm_bytes") else None,
            "comm_share": comm_ms / 1e3 / median if comm_ms is not None else None,
            "comm_logged": job.get("comm_logged"), "final_loss": job["losses"][-1],
            "threads_per_rank": job["threads_per_rank"], "peak_memory_bytes": job["peak_memory_bytes"]}


def format_table(result: dict) -> str:
    head = ("kind", "ranks", "accum", "step s", "tok/s", "efficiency", "comm ms", "comm MB", "comm share")
    rows = [head]
    for p in result["points"]:
        rows.append((p["kind"], str(p["world_size"]), str(p["grad_accum"]), f"{p['step_time_s']['median']:.4f}",
                     f"{p['tokens_per_s']:.0f}", f"{100 * p['efficiency']:.1f}%",
                     "-" if p["comm_ms_per_step"] is None else f"{p['comm_ms_per_step']:.1f}",
                     "-" if p["comm_bytes_per_step"] is None else f"{p['comm_bytes_per_step'] / 1e6:.2f}",
                     "-" if p["comm_share"] is None else f"{100 * p['comm_share']:.1f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = result["points"]
    base = next(p for p in pts if p["kind"] == "base")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for kind, marker in (("strong", "o"), ("weak", "s")):
        xs = [1] + [p["world_size"] for p in pts if p["kind"] == kind]
        ys = [100 * base["efficiency"]] + [100 * p["efficiency"] for p in pts if p["kind"] == kind]
        left.plot(xs, ys, marker=marker, label=f"{kind} scaling")
    left.axhline(100, color="black", linestyle="--", linewidth=1, label="ideal")
    left.set_xlabel("ranks")
    left.set_ylabel("scaling efficiency (%)")
    left.set_xticks(sorted({p["world_size"] for p in pts}))
    left.legend(fontsize=8)
    names = [f"{p['kind']}\n{p['world_size']} rank(s)" for p in pts]
    comm = [(p["comm_ms_per_step"] or 0.0) / 1e3 for p in pts]
    rest = [p["step_time_s"]["median"] - c for p, c in zip(pts, comm)]
    right.bar(names, rest, label="compute and other")
    right.bar(names, comm, bottom=rest, label="communication (logged collectives)")
    right.set_ylabel("median step time (s)")
    right.legend(fontsize=8)
    m, b = result["model"], result["batch"]
    fig.suptitle(f"{m['name']}-{m['size']}, profile {result['profile']}, micro-batch {b['micro_batch']} x seq "
                 f"{b['seq_len']}, {result['precision']}; {result['device']['name']}; load average "
                 f"{result['load_average']['before'][0]:.1f} before, {result['load_average']['after'][0]:.1f} after",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_scaling(opts, argv: list[str]) -> int:
    from dstrain import bench
    from dstrain.config import load_run_config
    from dstrain.engine.ds_config import resolve_profile_path

    cfg = load_run_config(opts.recipe, opts.overrides)
    from dstrain.bench_parallel import refusal
    problem = refusal(cfg, sorted(set(opts.scaling)))
    if problem:
        print(f"dstrain bench: error: {problem}", file=sys.stderr)
        return 2
    try:
        jobs = scaling_jobs(opts.scaling, cfg.train.grad_accum)
    except ValueError as err:  # a grad_accum the world sizes cannot split: one line, no traceback
        print(f"dstrain bench: error: {err}", file=sys.stderr)
        return 2
    cuda, overrides, note = bench.job_overrides(opts, cfg)
    overrides.append("--output.comms=true")
    profile = (opts.profiles or bench.default_profiles(cfg, max(opts.scaling)))[0]
    resolve_profile_path(profile)
    out = Path(opts.out or f"benchmarks/results/scaling_{Path(opts.recipe).stem}.json")
    load_before = os.getloadavg()
    done = []
    with tempfile.TemporaryDirectory(prefix="dstrain-scaling-") as tmp:
        for n, (kind, world, accum) in enumerate(jobs):
            print(f"[scaling] {kind}: {world} rank(s), grad_accum {accum}, profile {profile}",
                  file=sys.stderr, flush=True)
            job_overrides = overrides + [f"--train.grad_accum={accum}", f"--output.dir={tmp}/run"]
            try:
                job = bench._launch(opts, job_overrides, "dstrain", profile, Path(tmp, f"job{n}.json"),
                                    Path(tmp, f"job{n}.log"), nproc=world)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                print(f"dstrain bench: scaling job {kind} x {world} failed: {err}", file=sys.stderr)
                return 1
            job["grad_accum"] = accum
            done.append((kind, job))
    base_step = statistics.median(done[0][1]["step_times_s"])
    first = done[0][1]
    commit, dirty = bench._git_commit()
    result = {
        "benchmark": "scaling", "command": bench.command_line(argv), "git_commit": commit, "git_dirty": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": bench._describe_device(cuda),
        "profile": profile, "precision": first["precision"], "precision_note": note,
        "model": {"name": cfg.model.name, "size": cfg.model.size, "params": first["params"]},
        "batch": {"seq_len": cfg.data.seq_len, "micro_batch": cfg.train.micro_batch,
                  "grad_accum_one_rank": cfg.train.grad_accum},
        "versions": {"torch": bench._version("torch"), "deepspeed": bench._version("deepspeed")},
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "method": {"timed_steps": opts.steps, "warmup_steps": opts.warmup,
                   "timing": "as dstrain bench: per step the max over ranks after a barrier; medians",
                   "strong": "global batch of the one-rank job kept (grad_accum / n); efficiency T1 / (n Tn)",
                   "weak": "per-rank batch kept; efficiency T1 / Tn",
                   "communication": "DeepSpeed's comms logger (each collective synchronised and timed), rank 0, "
                                    "median per step; share = comm time / step time"},
        "points": [point(kind, job, base_step, cfg.data.seq_len, cfg.train.micro_batch) for kind, job in done],
    }
    bench.write_result(result, out, opts.plot, plot, format_table)
    return 0
