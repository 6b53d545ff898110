"""Gradient communication in fp32 against bf16: step time, bytes moved and the loss curve.

    python benchmarks/comm_dtype.py [RECIPE] [--nproc 2] [--steps 200] [--profile zero2]
        [--dtypes fp32,bf16] [--out benchmarks/results/comm_dtype_cpu.json] [--a.b=c ...]

Runs ``dstrain launch`` once per communication dtype (``--deepspeed.comm_dtype``),
fp32 training, the same seed and data, with ``output.comms`` on, then compares the
runs: logged bytes and milliseconds of communication per step, step time (from the
logged tokens/s), and the training-loss curves (largest and final differences).
Writes JSON and a PNG of the curves.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dstrain.bench_args import check_out, count  # noqa: E402


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for key, value in rec.items():
            if key != "step" and isinstance(value, (int, float)):
                series.setdefault(key, {})[rec["step"]] = float(value)
    return series


def later_steps(steps: list[int]) -> list[int]:
    """The logged steps past start-up (after step 3 or the first tenth); a short run (--steps 3) keeps
    the steps after the first, or all of them, so that it still gives medians."""
    return [s for s in steps if s > max(3, len(steps) // 10)] or steps[1:] or steps


def run(recipe: str, dtype: str, args, extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(args.nproc), recipe,
           f"--train.steps={args.steps}", "--train.log_every=1", f"--deepspeed.profile={args.profile}",
           "--deepspeed.precision=fp32", f"--deepspeed.comm_dtype={dtype}", "--output.comms=true",
           "--output.tensorboard=false", "--output.progress=false", "--checkpoint.every=0",
           f"--output.dir={out}", *extra]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"run with comm_dtype={dtype} failed:\n{proc.stderr[-3000:]}")
    m = read_metrics(out / "metrics.jsonl")
    steps = sorted(m["train/loss"])
    later = later_steps(steps)  # past start-up
    tps = statistics.median(m["train/tokens_per_s"][s] for s in later)
    tokens_per_step = None
    cfg = json.loads((out / "run_config.json").read_text())
    if cfg:
        t = cfg["train"]
        tokens_per_step = t["micro_batch"] * t["grad_accum"] * cfg["data"]["seq_len"] * args.nproc
    return {"comm_dtype": dtype, "loss": [m["train/loss"][s] for s in steps], "steps": steps,
            "tokens_per_s": tps, "step_time_s": tokens_per_step / tps if tokens_per_step else None,
            "comm_ms_per_step": statistics.median(m["comm/total_ms"][s] for s in later),
            "comm_bytes_per_step": statistics.median(m["comm/total_bytes"][s] for s in later),
            "comm_share": (statistics.median(m["comm/total_ms"][s] for s in later) / 1e3 / (tokens_per_step / tps)
                           if tokens_per_step else statistics.median(m["comm/share"][s] for s in later)),
            "comm_share_median_of_steps": statistics.median(m["comm/share"][s] for s in later)}


def _dtypes(text: str) -> list[str]:
    """``--dtypes``: comm dtypes DeepSpeed takes (refused here, before the first run, not after it)."""
    from dstrain.comms import COMM_DTYPES
    names = [x.strip() for x in text.split(",") if x.strip()]
    wrong = [x for x in names if x not in COMM_DTYPES]
    if wrong or not names:
        raise argparse.ArgumentTypeError(f"{','.join(wrong) or repr(text)}: not a comm dtype; the dtypes are "
                                         f"{', '.join(COMM_DTYPES)}")
    return names


def figure(result: dict):
    """The loss curves (the reference solid, the others dashed over it: they often coincide), then the
    communication time and the bytes per step, each panel with its own unit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = result["runs"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4))
    for i, r in enumerate(runs):
        a.plot(r["steps"], r["loss"], label=f"gradients reduced in {r['comm_dtype']}",
               linewidth=2.5 if i == 0 else 1.2, linestyle="-" if i == 0 else "--", alpha=0.6 if i == 0 else 1.0)
    a.set(xlabel="step", ylabel="training loss", title="loss")
    a.legend(fontsize=8)
    names = [r["comm_dtype"] for r in runs]
    b.bar(names, [r["comm_ms_per_step"] for r in runs], 0.5, color="tab:blue")
    b.set(ylabel="ms per step (median)", title="communication time")
    c.bar(names, [r["comm_bytes_per_step"] / 1e6 for r in runs], 0.5, color="tab:orange")
    c.set(ylabel="MB per step (median)", title="communication volume")
    fig.suptitle(f"{result['recipe']}, {result['nproc']} ranks, {result['profile']}, fp32 training; load average "
                 f"{result['load_average']['before'][0]:.1f} before", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe", nargs="?", default="models/gpt/recipes/tiny.json",
                   help="run config trained once per dtype (default: %(default)s); --section.key=value overrides "
                        "follow it")
    p.add_argument("--nproc", type=count(1), default=2, help="ranks of each run (default: %(default)s)")
    p.add_argument("--steps", type=count(1), default=200, help="training steps of each run (default: %(default)s)")
    p.add_argument("--profile", default="zero2", help="ds_configs profile of both runs (default: %(default)s)")
    p.add_argument("--dtypes", type=_dtypes, default="fp32,bf16",
                   help="comma-separated deepspeed.comm_dtype values, the first the reference")
    p.add_argument("--out", default="benchmarks/results/comm_dtype_cpu.json",
                   help="result JSON file, its PNG beside it (default: the committed benchmarks/results/"
                        "comm_dtype_cpu.json)")
    args, extra = p.parse_known_args(argv)
    check_out(p, args.out)
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dstrain-commdtype-") as tmp:
        for dtype in args.dtypes:
            print(f"[comm_dtype] {dtype}: {args.nproc} ranks, {args.steps} steps", file=sys.stderr, flush=True)
            runs.append(run(args.recipe, dtype, args, extra, Path(tmp, dtype)))
    ref = runs[0]
    for r in runs[1:]:
        diffs = [abs(a - b) for a, b in zip(r["loss"], ref["loss"])]
        r["vs_" + ref["comm_dtype"]] = {
            "max_abs_loss_diff": max(diffs), "final_loss_diff": r["loss"][-1] - ref["loss"][-1],
            "mean_last_10pct_loss_diff": statistics.fmean(
                a - b for a, b in list(zip(r["loss"], ref["loss"]))[-max(1, len(diffs) // 10):]),
            "bytes_ratio": r["comm_bytes_per_step"] / ref["comm_bytes_per_step"],
            "comm_ms_ratio": r["comm_ms_per_step"] / ref["comm_ms_per_step"],
            "step_time_ratio": (r["step_time_s"] / ref["step_time_s"]) if r["step_time_s"] else None}
    result = {"benchmark": "comm_dtype", "command": "python benchmarks/comm_dtype.py " + " ".join(argv or sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "recipe": args.recipe, "profile": args.profile, "nproc": args.nproc, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib.pyplot as plt
    fig = figure(result)
    fig.savefig(out.with_suffix(".png"), dpi=100)
    plt.close(fig)
    for r in runs:
        cmp = next((v for k, v in r.items() if k.startswith("vs_")), {})
        print(f"{r['comm_dtype']}: step {r['step_time_s']:.4f} s, comm {r['comm_ms_per_step']:.1f} ms "
              f"({100 * r['comm_share']:.1f}%), {r['comm_bytes_per_step'] / 1e6:.2f} MB/step, final loss "
              f"{r['loss'][-1]:.4f}" + (f", max |loss diff| {cmp['max_abs_loss_diff']:.2e}" if cmp else ""))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
