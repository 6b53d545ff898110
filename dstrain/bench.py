"""Throughput benchmark: dstrain's engine against a plain PyTorch loop, same model and batch.

``dstrain bench RECIPE [--a.b=c ...] [--profiles zero1,zero3] [--steps 20] [--warmup 3]
[--nproc 2] [--out benchmarks/results/NAME.json] [--plot]``

The parent process (no torch.distributed) launches, per profile, two jobs through
the deepspeed launcher, each running ``python -m dstrain.bench --worker``: one
times dstrain (``plan_engine`` + ``create_engine`` with the profile forced), the
other a plain loop (the same model and seed, torch DDP when world > 1, torch
AdamW over dstrain's ``param_groups``, ``no_sync`` on non-final micro-steps,
gradient clipping, the same learning-rate schedule). Separate processes give
separate peak-memory figures (RSS peaks only grow). The order alternates per
profile (plain first, then dstrain first, ...) so slow drift of the machine does
not favour one side.

Each step is timed with ``perf_counter`` after a barrier (data already on the
device; ``cuda.synchronize`` on GPUs); a step's time is the maximum over ranks,
and the reported figure is the median over the timed steps. MFU divides the
achieved FLOP/s of one rank by the peak of one rank: a GPU's datasheet figure,
or on a CPU a matmul measured by every rank at once in every job of the run
(the best of those is used for all jobs: other load only lowers a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dstrain.bench_report import format_table, plot  # noqa: F401 (re-exported)

GOALS = {0: 1.05, 1: 1.05, 2: 1.05, 3: 1.25}
"""Largest acceptable dstrain/plain step-time ratio per ZeRO stage (offload profiles have none)."""
RESULT_FIELDS = ("benchmark", "command", "git_commit", "date", "device", "world_size", "model",
                 "batch", "precision", "threads_per_rank", "peak_flops", "versions", "load_average",
                 "method", "profiles")
METRIC_FIELDS = ("step_time_s", "tokens_per_s", "flops_per_s", "mfu", "peak_memory_bytes")
MODES = ("plain", "plain_compiled", "dstrain")
"""plain: eager PyTorch (DDP); plain_compiled: the same with torch.compile and fused AdamW; dstrain: the engine."""


@dataclass
class BenchOptions:
    recipe: str
    overrides: list[str] = field(default_factory=list)
    profiles: list[str] | None = None
    steps: int = 20
    warmup: int = 3
    nproc: int = 2
    out: str | None = None
    plot: bool = False
    plain: str = "each"
    compiled_baseline: str = "auto"
    timeout: int = 1800
    scaling: list[int] | None = None
    # worker only
    worker: bool = False
    mode: str = "dstrain"
    profile: str | None = None
    result: str | None = None


def parse_args(argv: list[str]) -> BenchOptions:
    """Recipe, dotted ``--section.key=value`` overrides (passed to the run config) and bench options."""
    from dstrain.bench_args import count, counts
    p = argparse.ArgumentParser(prog="dstrain bench", allow_abbrev=False,
                                description="dstrain vs plain PyTorch step time, per DeepSpeed profile. "
                                            "--section.key=value overrides (e.g. --train.micro_batch=16 "
                                            "--data.seq_len=256) change the run config of every job.")
    p.add_argument("recipe", help="run config JSON, e.g. models/gpt/recipes/tiny.json")
    p.add_argument("--profiles", type=lambda s: [x for x in s.split(",") if x],
                   help="comma-separated ds_configs profiles (default: the recipe's, or the factory's pick)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--nproc", type=int, default=2, help="world size (processes on this machine)")
    p.add_argument("--out", help="result JSON (default benchmarks/results/throughput_<recipe>.json)")
    p.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    p.add_argument("--plain", choices=("each", "once"), default="each",
                   help="run the plain loop beside every profile (default) or once")
    p.add_argument("--compiled-baseline", choices=("auto", "on", "off"), default="auto",
                   help="also time plain + torch.compile + fused AdamW once (auto: on GPUs)")
    p.add_argument("--timeout", type=count(1), default=1800, help="seconds per launched job")
    p.add_argument("--scaling", type=counts(1),
                   help="world sizes, e.g. 1,2: strong and weak scaling of the dstrain engine instead of the "
                        "plain comparison, with communication logged (dstrain/bench_scaling.py)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="dstrain", help=argparse.SUPPRESS)
    p.add_argument("--profile", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args, extra = p.parse_known_args(argv)
    overrides = []
    for item in extra:
        if item.startswith("--local_rank"):
            continue
        if not (item.startswith("--") and "=" in item and "." in item.split("=", 1)[0]):
            from dstrain.cli_flags import close_flag
            meant = close_flag(item, p)
            p.error(f"unrecognized argument {item!r} " + (f"(did you mean {meant}?)" if meant else
                                                          "(overrides look like --section.key=value)"))
        overrides.append(item)
    for name in ("steps", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    if args.scaling is not None and (not args.scaling or min(args.scaling) < 1 or 1 not in args.scaling):
        p.error("--scaling takes world sizes that include 1, e.g. --scaling 1,2")
    return BenchOptions(**{k: v for k, v in vars(args).items()}, overrides=overrides)


# ---------------------------------------------------------------- pure summaries

def summarize(times: list[float]) -> dict[str, float]:
    """Median, mean, p90, min and max of step times (p90 by linear interpolation)."""
    if not times:
        raise ValueError("no step times to summarize")
    xs = sorted(times)
    pos = 0.9 * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    p90 = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "p90": p90,
            "min": xs[0], "max": xs[-1]}


def goal_for(stage: int, offload: bool) -> float | None:
    return None if offload else GOALS.get(stage)


def compare(dstrain_median: float, plain_median: float, goal: float | None) -> dict:
    ratio = dstrain_median / plain_median
    return {"ratio": ratio, "goal": goal, "goal_met": None if goal is None else ratio <= goal}


def rates(step_s: float, tokens_per_step: int, world: int, flops_per_token: float | None,
          peak_per_rank: float | None) -> dict:
    """Global tokens/s and FLOP/s of one step time; MFU = per-rank FLOP/s / per-rank peak.

    ``tokens_per_step``: the whole job's, counted once per data-parallel replica
    (:func:`dstrain.bench_parallel.tokens_per_step`); ``world``: the devices (one per rank) sharing them."""
    tps = tokens_per_step / step_s
    flops = tps * flops_per_token if flops_per_token else None
    mfu = flops / world / peak_per_rank if flops and peak_per_rank else None
    return {"tokens_per_s": tps, "flops_per_s": flops, "mfu": mfu}


def job_metrics(job: dict, tokens_per_step: int, world: int, flops_per_token, peak) -> dict:
    step = summarize(job["step_times_s"])
    return {"step_time_s": step, "cpu_time_s": summarize(job["cpu_times_s"]),
            **rates(step["median"], tokens_per_step, world, flops_per_token, peak),
            "peak_memory_bytes": job["peak_memory_bytes"], "start_memory_bytes": job["start_memory_bytes"],
            "final_loss": job["losses"][-1], "step_times_s": job["step_times_s"]}


def build_profiles(jobs: list[dict], tokens_per_step: int, world: int, flops_per_token, peak) -> dict:
    """Per profile: both sides' metrics, the ratio and the goal. ``jobs`` come from the workers."""
    plains = {j["pair"]: j for j in jobs if j["mode"] == "plain"}
    compiled = next((j for j in jobs if j["mode"] == "plain_compiled"), None)
    c = job_metrics(compiled, tokens_per_step, world, flops_per_token, peak) if compiled else None
    out = {}
    for job in (j for j in jobs if j["mode"] == "dstrain"):
        plain = plains[job["pair"]]
        d = job_metrics(job, tokens_per_step, world, flops_per_token, peak)
        b = job_metrics(plain, tokens_per_step, world, flops_per_token, peak)
        goal = goal_for(job["zero"]["stage"], job["zero"].get("offload_optimizer", False)
                        or job["zero"].get("offload_param", False))
        out[job["profile"]] = {"stage": job["zero"]["stage"], "zero": job["zero"], "order": job["order"],
                               "ds_optimizer": job.get("optimizer"), "plain_optimizer": plain.get("optimizer"),
                               "nonfinite_check": job.get("nonfinite"),
                               "nonfinite_check_mode": job.get("nonfinite_check"),
                               **compare(d["step_time_s"]["median"], b["step_time_s"]["median"], goal),
                               "min_ratio": d["step_time_s"]["min"] / b["step_time_s"]["min"],
                               "cpu_time_ratio": d["cpu_time_s"]["median"] / b["cpu_time_s"]["median"],
                               "dstrain": d, "plain": b,
                               "estimated_memory_bytes": job.get("estimated_memory_bytes")}
        if c is not None:
            out[job["profile"]].update(
                plain_compiled=c, plain_compiled_optimizer=compiled.get("optimizer"),
                speedup_vs_compiled=c["step_time_s"]["median"] / d["step_time_s"]["median"])
    return out


def check_result(result: dict) -> list[str]:
    """Problems with a result dict (missing fields, non-positive numbers); empty when it is complete."""
    problems = [f"missing {k}" for k in RESULT_FIELDS if k not in result]
    for name, prof in result.get("profiles", {}).items():
        for side in ("dstrain", "plain"):
            for key in METRIC_FIELDS:
                value = prof.get(side, {}).get(key)
                value = value["median"] if isinstance(value, dict) else value
                if not isinstance(value, (int, float)) or value <= 0:
                    problems.append(f"{name}.{side}.{key} is {value!r}")
        if not isinstance(prof.get("ratio"), float) or "goal_met" not in prof:
            problems.append(f"{name}: no ratio/goal")
    return problems


# ---------------------------------------------------------------- parent (launches the jobs)

def job_schedule(profiles: list[str], plain: str = "each",
                 compiled: bool = False) -> list[tuple[str, str, int, str]]:
    """(mode, profile, pair, order) of every job, in launch order.

    ``each``: a plain job beside every profile, plain first for even-numbered
    profiles and dstrain first for odd ones. ``once``: one plain job first.
    ``compiled``: one plain + torch.compile job, first.
    """
    head = [("plain_compiled", profiles[0], 0, "compiled plain once, first")] if compiled else []
    if plain == "once":
        return head + [("plain", profiles[0], 0, "plain once, first")] + [
            ("dstrain", p, 0, "plain once, first") for p in profiles]
    jobs = []
    for i, profile in enumerate(profiles):
        order = ("plain", "dstrain") if i % 2 == 0 else ("dstrain", "plain")
        jobs += [(mode, profile, i, f"{order[0]} first") for mode in order]
    return head + jobs


def _portable(text: str) -> str:
    """Paths of this machine made relative to the working directory (or ~)."""
    cwd, home = os.getcwd().rstrip("/") + "/", os.path.expanduser("~").rstrip("/") + "/"
    return text.replace(cwd, "").replace(home, "~/")


def command_line(argv: list[str]) -> str:
    prog = sys.argv[0] if sys.argv else ""
    name = os.path.basename(prog)
    if name == "dstrain":
        head = "dstrain bench"
    elif prog.endswith(os.path.join("dstrain", "bench.py")):
        head = "python -m dstrain.bench"
    elif prog.endswith(".py") and name != "__main__.py" and "pytest" not in prog:
        head = "python " + _portable(os.path.abspath(prog))
    else:
        head = "python -m dstrain.bench"
    return _portable(" ".join([head, shlex.join(argv)]))


def _git_commit() -> tuple[str | None, bool | None]:
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
        return head, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def _describe_device(cuda: bool) -> dict:
    if cuda:
        import torch
        return {"type": "cuda", "name": torch.cuda.get_device_name(), "count": torch.cuda.device_count()}
    name = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    from dstrain.launcher import available_cpus
    return {"type": "cpu", "name": name, "cpus": available_cpus()}


def _version(dist_name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _launch(opts: BenchOptions, overrides: list[str], mode: str, profile: str, result: Path,
            log: Path, nproc: int | None = None) -> dict:
    """One job through the deepspeed launcher (``nproc`` ranks, default ``opts.nproc``); rank 0's JSON."""
    from dstrain import launcher
    nproc = nproc or opts.nproc
    spec = launcher.LaunchSpec(recipe=opts.recipe, overrides=tuple(overrides), nproc=nproc,
                               master_port=launcher.find_free_port())
    argv, env = launcher.build_deepspeed_command(spec)
    # Same launcher flags as `dstrain launch`; only the module each rank runs differs.
    argv = argv[:argv.index("--module") + 1] + [
        "dstrain.bench", "--worker", "--mode", mode, "--profile", profile, "--steps", str(opts.steps),
        "--warmup", str(opts.warmup), "--result", str(result), opts.recipe, *overrides]
    env["PYTHONUNBUFFERED"] = "1"
    with open(log, "w") as fh:
        proc = subprocess.run(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=opts.timeout)
    keep = os.environ.get("DSTRAIN_BENCH_LOGS")  # a folder that keeps every job's full log
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(log, Path(keep, f"{mode}_{Path(profile).stem}_{nproc}.log"))
    if proc.returncode != 0 or not result.is_file():
        text = log.read_text(errors="replace")
        start = text.find("Traceback")
        raise RuntimeError(f"{mode} job for {profile} failed (exit {proc.returncode}):\n"
                           + (text[start:start + 4000] if start >= 0 else text[-3000:]))
    return json.loads(result.read_text())


def job_overrides(opts: BenchOptions, cfg) -> tuple[bool, list[str], str]:
    """(CUDA in use, the overrides every job gets, a note on precision): on a CPU an ``auto``
    precision becomes fp32, so that the comparison does not hinge on the CPU's bf16 speed."""
    from dstrain import launcher
    cuda = os.environ.get("DS_ACCELERATOR", "") != "cpu" and launcher.detect_accelerator() == "cuda"
    if not cuda and cfg.deepspeed.precision == "auto":
        return cuda, [*opts.overrides, "--deepspeed.precision=fp32"], \
            "fp32 forced by the benchmark on CPU (deepspeed.precision was auto)"
    return cuda, list(opts.overrides), "as configured"


def write_result(result: dict, out: Path, with_plot: bool, plot_fn, table_fn) -> None:
    """The result JSON (and its PNG), then the table and where they went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if with_plot:
        plot_fn(result, out.with_suffix(".png"))
    print(table_fn(result))
    print(f"wrote {_portable(str(out.resolve()))}" + (" (+ .png)" if with_plot else ""))


def default_profiles(cfg, nproc: int) -> list[str]:
    if cfg.deepspeed.profile != "auto":
        return [cfg.deepspeed.profile]
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.ds_check import this_device  # the ranks' device (DS_ACCELERATOR=cpu beside a GPU: the CPU)
    return [plan_engine(cfg, nproc, ranks_per_node=nproc, device_type=this_device()).profile]


def assemble(opts: BenchOptions, argv: list[str], cfg, jobs: list[dict], device: dict,
             load_before, load_after, precision_note: str) -> dict:
    first = jobs[0]
    measured = [x for j in jobs for x in j["peak_flops"]["per_rank"] if x]
    peak = max(measured) if measured else None  # other load can only lower a measurement
    how = first["peak_flops"]["how"]
    if device["type"] == "cpu" and measured:
        how += (f", run by all {first['world_size']} ranks at once ({first['threads_per_rank']} thread(s) "
                f"each) in every job; the best of {len(measured)} measurements")
    commit, dirty = _git_commit()
    tokens = first["tokens_per_step"]
    return {
        "benchmark": "throughput", "command": command_line(argv), "git_commit": commit, "git_dirty": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device,
        "world_size": first["world_size"],
        "model": {"name": cfg.model.name, "size": cfg.model.size, "args": cfg.model.args,
                  "params": first["params"], "flops_per_token": first["flops_per_token"]},
        "batch": {"seq_len": cfg.data.seq_len, "micro_batch": cfg.train.micro_batch,
                  "grad_accum": cfg.train.grad_accum, "tokens_per_step_global": tokens},
        "parallel": first.get("parallel"),
        "precision": first["precision"], "precision_note": precision_note,
        "activation_checkpointing": first["activation_checkpointing"],
        "threads_per_rank": first["threads_per_rank"],
        "peak_flops": {"per_rank": peak, "how": how, "measurements": measured},
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "deepspeed": _version("deepspeed")},
        "load_average": {"before": list(load_before), "after": list(load_after)},
        "method": {
            "timed_steps": opts.steps, "warmup_steps": opts.warmup,
            "order": ("one plain job and one dstrain job per profile, in separate launcher jobs; plain first "
                      "for even-numbered profiles, dstrain first for odd ones" if opts.plain == "each"
                      else "one plain job, run first, compared with every profile"),
            "timing": ("perf_counter around each optimizer step (all micro-batches), after a barrier, batches "
                       "already on the device; per step the max over ranks; median over timed steps"),
            "cpu_time": ("process CPU seconds (all threads of a rank, gloo's included) per step, max over "
                         "ranks: less sensitive than wall time to other load on a shared CPU, blind to waiting"),
            "memory": ("peak RSS (ru_maxrss) of each rank, max over ranks; plain and dstrain in separate "
                       "processes; both include the Python/torch/deepspeed imports"
                       if device["type"] == "cpu" else "torch.cuda.max_memory_allocated, max over ranks"),
            "mfu": "achieved FLOP/s per rank (model.flops_per_token x tokens / step time) / peak_flops.per_rank",
            "tokens": ("micro_batch x grad_accum x seq_len per data-parallel replica, counted once per replica "
                       "(tp, sp and pp ranks of a replica share its tokens)"),
        },
        "profiles": build_profiles(jobs, tokens, first["world_size"], first["flops_per_token"], peak),
    }


def run_benchmark(opts: BenchOptions, argv: list[str]) -> int:
    from dstrain.config import load_run_config
    from dstrain.engine.ds_config import resolve_profile_path

    cfg = load_run_config(opts.recipe, opts.overrides)  # config errors now, once
    from dstrain.bench_parallel import refusal
    problem = refusal(cfg, [opts.nproc])
    if problem:
        print(f"dstrain bench: error: {problem}", file=sys.stderr)
        return 2
    cuda, overrides, note = job_overrides(opts, cfg)
    profiles = opts.profiles or default_profiles(cfg, opts.nproc)
    for p in profiles:
        resolve_profile_path(p)
    out = Path(opts.out or f"benchmarks/results/throughput_{Path(opts.recipe).stem}.json")
    device = _describe_device(cuda)
    load_before = os.getloadavg()
    jobs, failed, failed_pairs = [], set(), set()
    with tempfile.TemporaryDirectory(prefix="dstrain-bench-") as tmp:
        worker_overrides = overrides + [f"--output.dir={tmp}/run"]  # dataset cache, shared by the jobs
        compiled = opts.compiled_baseline == "on" or (opts.compiled_baseline == "auto" and cuda)
        for n, (mode, profile, pair, order) in enumerate(job_schedule(profiles, opts.plain, compiled)):
            if pair in failed_pairs:
                failed.add(profile)
                continue
            print(f"[bench] {profile}: {mode} ({opts.nproc} ranks, {opts.warmup}+{opts.steps} steps)",
                  file=sys.stderr, flush=True)
            for attempt in (1, 2):  # once more on failure: a port taken meanwhile, a stray signal
                try:
                    job = _launch(opts, worker_overrides, mode, profile, Path(tmp, f"job{n}.json"),
                                  Path(tmp, f"job{n}.log"))
                    break
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    print(f"[bench] attempt {attempt} failed: {err}", file=sys.stderr, flush=True)
            else:
                if mode == "plain_compiled":  # the comparison goes on without this baseline
                    failed.add("plain_compiled")
                    continue
                failed.add(profile)
                if mode == "plain" or opts.plain == "each":
                    failed_pairs.add(pair)
                continue
            job.update(pair=pair, order=order)
            print(f"[bench]   median step {statistics.median(job['step_times_s']):.4f} s",
                  file=sys.stderr, flush=True)
            jobs.append(job)
    jobs = [j for j in jobs if j["mode"] == "plain_compiled" or (
        j["pair"] not in failed_pairs and (j["mode"] == "plain" or j["profile"] not in failed))]
    if not jobs:
        print("dstrain bench: every job failed", file=sys.stderr)
        return 1
    result = assemble(opts, argv, cfg, jobs, device, load_before, os.getloadavg(), note)
    result["failed_profiles"] = sorted(failed)
    write_result(result, out, opts.plot, plot, format_table)
    if failed:
        print(f"dstrain bench: failed profiles: {', '.join(sorted(failed))}", file=sys.stderr)
    return 1 if failed else 0


def gpu_shortfall(opts: BenchOptions, gpu_count=None) -> str | None:
    """More ranks asked for than this machine shows GPUs (rank 1 would die on a device that does not
    exist): the problem, or None. CPU runs (``DS_ACCELERATOR=cpu`` or no GPU) are not judged."""
    from dstrain import launch_check, launcher
    if os.environ.get("DS_ACCELERATOR", "") == "cpu" or launcher.detect_accelerator() != "cuda":
        return None
    most = max([opts.nproc, *(opts.scaling or [])])
    count = launch_check.gpus_short_of(most, gpu_count)
    if count is None:
        return None
    return (f"{most} ranks asked for (--nproc{', --scaling' if opts.scaling else ''}; --nproc defaults to 2) but "
            f"this machine shows {count} GPU(s): use --nproc {count}, or DS_ACCELERATOR=cpu for CPU ranks")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = parse_args(argv)
    if opts.worker:
        from dstrain.bench_worker import run_worker
        return run_worker(opts)
    from dstrain.bench_args import out_problem
    problem = gpu_shortfall(opts) or (out_problem(opts.out) if opts.out else None)
    if problem:
        print(f"dstrain bench: error: {problem}", file=sys.stderr)
        return 2
    from dstrain.config import ConfigError
    from dstrain.engine.ds_config import DSConfigError
    try:
        if opts.scaling:
            from dstrain.bench_scaling import run_scaling
            return run_scaling(opts, argv)
        return run_benchmark(opts, argv)
    except (ConfigError, DSConfigError) as err:
        print(f"dstrain bench: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"dstrain bench: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    code = main()
    if "--worker" in sys.argv[1:]:  # a rank started by the launcher: skip the native teardown
        from dstrain.runtime import exit_rank
        exit_rank(code)
    sys.exit(code)
