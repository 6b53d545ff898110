"""GRPO step-time split with rollouts in the ranks (local) and on Ray actors (ray).

    python benchmarks/rollout_backends.py [--nproc 2] [--steps 10] [--out benchmarks/results/rollout_backends_cpu.json]
        [--a.b=c ...]

Runs the grpo_debug recipe (short warm start) once per backend through ``dstrain launch``
and reads each run's ``summary.json`` time split: generation, reward, reference forward,
training, weight sync (ray) and the rest, with the mean step time and the final losses
(the two backends must train identically, see tests/dist/test_rollout_ray.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dstrain.bench_args import check_out, count  # noqa: E402
RECIPE = "models/policy/recipes/grpo_debug.json"
QUICK = ["--task.warm_start_steps=20", "--task.n_train=64", "--task.n_eval=2", "--task.num_generations=4",
         "--task.eval_k=0", "--task.max_new_tokens=16", "--train.micro_batch=8", "--train.log_every=1",
         "--train.eval_every=0", "--output.progress=false", "--output.tensorboard=false", "--checkpoint.every=0"]


def run(backend: str, args, extra: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(args.nproc), RECIPE, *QUICK,
           f"--train.steps={args.steps}", f"--rollout.backend={backend}", f"--output.dir={out}", *extra]
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{proc.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    losses = [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in line]
    split = summary["time_split"]
    return {"backend": backend, "steps": args.steps, "mean_step_s": split["step"]["seconds"] / args.steps,
            "split": split, "losses": losses}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=count(1), default=2)
    p.add_argument("--steps", type=count(1), default=10)
    p.add_argument("--out", default="benchmarks/results/rollout_backends_cpu.json",
                   help="result JSON file, its PNG beside it (default: the committed benchmarks/results/"
                        "rollout_backends_cpu.json)")
    args, extra = p.parse_known_args(argv)
    check_out(p, args.out)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dstrain-rollout-") as tmp:
        runs = []
        for backend in ("local", "ray"):
            print(f"[rollout] {backend}: {args.nproc} ranks, {args.steps} steps", file=sys.stderr, flush=True)
            runs.append(run(backend, args, extra, Path(tmp, backend)))
    same = runs[0]["losses"] == runs[1]["losses"]
    result = {"benchmark": "rollout_backends",
              "command": "python benchmarks/rollout_backends.py " + " ".join(argv or sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "recipe": RECIPE, "overrides": QUICK + extra, "identical_losses": same, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = sorted({k for r in runs for k in r["split"] if k != "step"})
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(runs)
    for part in parts:
        values = [r["split"].get(part, {}).get("seconds", 0.0) / r["steps"] for r in runs]
        ax.bar([r["backend"] for r in runs], values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_ylabel("seconds per step")
    ax.set_title(f"GRPO debug, {args.nproc} ranks, load average {load_before[0]:.1f}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    for r in runs:
        split = ", ".join(f"{k} {v['seconds'] / r['steps']:.3f}" for k, v in r["split"].items() if k != "step")
        print(f"{r['backend']}: {r['mean_step_s']:.3f} s/step ({split})")
    print(f"identical losses: {same}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
