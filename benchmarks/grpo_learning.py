"""GRPO's learning check: the same run twice, with the recipe's learning rate and with 0.

    python benchmarks/grpo_learning.py                       # models/policy/recipes/grpo_debug.json, 2 ranks
    python benchmarks/grpo_learning.py --steps 40 --out /tmp/grpo --extra=--task.n_train=64

Both runs share everything else: the warm start (done once by the first run and
reused by the second through a copied ``warm_start/``), the prompts of every step and
the sampling seeds. With learning rate 0 the policy stays the warm-started one, so its
curve is what sampling noise alone gives. Writes ``<out>/grpo_learning_<device>.json``
(per-step mean reward of both runs, the means of the last half, held-out pass@1 /
pass@k before and after) and a PNG of the two curves.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(recipe: str, out: Path, lr: float | None, steps: int, nproc: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(nproc), recipe,
           f"--output.dir={out}", f"--train.steps={steps}", "--output.progress=false", "--checkpoint.every=0",
           *([f"--train.lr={lr}"] if lr is not None else []), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return time.perf_counter() - start


def rewards(out: Path) -> dict[int, float]:
    values = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train/reward_mean" in record:
            values[record["step"]] = record["train/reward_mean"]
    return values


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("grpo", "-"), ("lr0", "--")):
        curve = result["runs"][name]["reward_mean"]
        label = f"lr {result['runs'][name]['lr']:g}" + (" (GRPO)" if name == "grpo" else " (no update)")
        ax.plot([int(k) for k in curve], list(curve.values()), style, marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"mean reward (log window of {result['log_every']} steps)")
    ax.set_title(f"GRPO on {result['recipe']} ({result['device']}, {result['nproc']} ranks)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="models/policy/recipes/grpo_debug.json")
    ap.add_argument("--steps", type=int, default=None, help="default: the recipe's train.steps")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", default="runs/grpo_learning")
    ap.add_argument("--extra", action="append", default=[], help="override passed to both runs (repeatable)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from dstrain.config import load_run_config
    cfg = load_run_config(ROOT / args.recipe, args.extra)
    steps = args.steps or cfg.train.steps
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    seconds = {"grpo": run(args.recipe, out / "grpo", None, steps, args.nproc, args.extra)}
    warm = out / "grpo" / "warm_start"
    if warm.is_dir():
        shutil.copytree(warm, out / "lr0" / "warm_start")
    seconds["lr0"] = run(args.recipe, out / "lr0", 0.0, steps, args.nproc, args.extra)

    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"recipe": args.recipe, "device": device, "nproc": args.nproc, "steps": steps,
              "log_every": cfg.train.log_every, "overrides": args.extra,
              "command": " ".join(["python", "benchmarks/grpo_learning.py", *(argv or sys.argv[1:])]), "runs": {}}
    for name in ("grpo", "lr0"):
        curve = rewards(out / name)
        half = [v for k, v in curve.items() if k > steps / 2]
        summary = json.loads((out / name / "summary.json").read_text())
        result["runs"][name] = {"lr": cfg.train.lr if name == "grpo" else 0.0, "seconds": seconds[name],
                                "reward_mean": {str(k): v for k, v in sorted(curve.items())},
                                "reward_mean_last_half": sum(half) / max(len(half), 1),
                                "eval_before": summary.get("eval_before"), "eval_after": summary.get("eval_after")}
    tag = "cpu" if device == "cpu" else "gpu"
    (out / f"grpo_learning_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"grpo_learning_{tag}.png")
    g, z = (result["runs"][n]["reward_mean_last_half"] for n in ("grpo", "lr0"))
    print(f"mean reward over the last half: GRPO {g:.3f}, lr 0 {z:.3f} (wrote {out}/grpo_learning_{tag}.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
