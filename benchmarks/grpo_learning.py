"""GRPO's learning check: the same run twice, with the recipe's learning rate and with 0.

    python benchmarks/grpo_learning.py                       # models/policy/recipes/grpo_debug.json, 2 ranks
    python benchmarks/grpo_learning.py --steps 40 --out /tmp/grpo --extra=--task.n_train=64
    python benchmarks/grpo_learning.py --steps 80 --dynamic      # + a third run with DAPO dynamic sampling

Both runs share everything else: the warm start (done once by the first run and
reused by the second through a copied ``warm_start/``), the prompts of every step and
the sampling seeds. With learning rate 0 the policy stays the warm-started one, so its
curve is what sampling noise alone gives. Writes ``<out>/grpo_learning_<device>.json``
(per-step mean reward of both runs, the means of the last half, held-out pass@1 /
pass@k before and after) and a PNG of the two curves.

``--dynamic`` adds a third run at the recipe's learning rate with
``task.dynamic_sampling`` on (same prompts in its first round, same seeds) and records,
for every run, the mean step time split (``time/*``), the generation rounds per step
and the fraction of groups dropped, and the dynamic run's step-time overhead over plain
GRPO. Its curve is the verifier reward of each step's regular prompts (the first round),
so the three curves are comparable. ``--rest-steps K`` adds one more dynamic run in which
prompts whose latest group agreed rest for K steps (``task.dynamic_sampling_rest_steps``),
with the same overhead figures (its regular prompts are then partly swapped: its curve is
not the same prompts' reward). ``--carry`` adds one more dynamic run that keeps informative
groups beyond the share for the next step (``task.dynamic_sampling_carry``), with the same figures.
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


LOADS: dict[str, list] = {}


def run(recipe: str, out: Path, lr: float | None, steps: int, nproc: int, extra: list[str]) -> float:
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(nproc), recipe,
           f"--output.dir={out}", f"--train.steps={steps}", "--output.progress=false", "--checkpoint.every=0",
           *([f"--train.lr={lr}"] if lr is not None else []), *extra]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    before = [round(x, 2) for x in os.getloadavg()]
    code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if code:  # the launch has said why (one line above); a traceback of this script would only bury it
        print(f"grpo_learning: the {out.name} run failed (dstrain launch exit status {code}); "
              "its own message is above" + ("; an override it names goes to every run of this script as "
                                            "--extra=--section.key=value" if code == 2 else ""),
              file=sys.stderr)
        raise SystemExit(code)
    LOADS[out.name] = {"before": before, "after": [round(x, 2) for x in os.getloadavg()]}
    return time.perf_counter() - start


def clear_out(out: Path) -> None:
    """Empty ``--out`` for a new check: only a folder that holds nothing but what this script writes (its run
    folders and result files) is removed; anything else (``--out runs``, ``--out benchmarks/results``) is refused
    in one line, before a run starts."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"grpo_learning: --out {out} is a file: name a folder for the runs and results")
    ours = {"grpo", "lr0", "dynamic", "dynamic_rest", "dynamic_carry"}
    ours |= {f"grpo_learning_{tag}.{ext}" for tag in ("cpu", "gpu") for ext in ("json", "png")}
    other = sorted(p.name for p in out.iterdir() if p.name not in ours)
    if other:
        raise SystemExit(f"grpo_learning: --out {out} holds what this benchmark did not write "
                         f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}), and is emptied first: "
                         f"name a new folder, or one an earlier grpo_learning.py wrote")
    shutil.rmtree(out)


def rewards(out: Path, key: str = "train/reward_mean") -> dict[int, float]:
    values = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            values[record["step"]] = record[key]
    return values


def means(out: Path, keys: tuple[str, ...]) -> dict[str, float]:
    """Mean over the logged steps of each key present (time split, dynamic sampling)."""
    found = {}
    for key in keys:
        curve = rewards(out, key)
        if curve:
            found[key] = sum(curve.values()) / len(curve)
    return found


STEP_KEYS = ("time/step", "time/generation", "time/reward", "time/reference", "time/training",
             "dynamic/rounds", "dynamic/dropped_fraction", "dynamic/filled_fraction", "dynamic/generated_groups",
             "dynamic/round0_groups", "dynamic/generated_per_trained", "dynamic/refill_seconds",
             "dynamic/keep_rate_estimate", "dynamic/surplus_groups", "dynamic/carried_groups",
             "train/zero_variance_groups", "train/trained_zero_variance_groups")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, style in (("grpo", "-"), ("lr0", "--"), ("dynamic", "-."), ("dynamic_rest", ":"),
                        ("dynamic_carry", (0, (5, 1, 1, 1, 1, 1)))):
        if name not in result["runs"]:
            continue
        curve = result["runs"][name]["reward_mean"]
        label = f"lr {result['runs'][name]['lr']:g}" + {"grpo": " (GRPO)", "lr0": " (no update)",
                                                        "dynamic": " (GRPO + dynamic sampling)",
                                                        "dynamic_rest": " (dynamic sampling, resting prompts)",
                                                        "dynamic_carry": " (dynamic sampling, kept groups)"}[name]
        ax.plot([int(k) for k in curve], list(curve.values()), linestyle=style, marker="o", ms=3, label=label)
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
    ap.add_argument("--out", default="runs/grpo_learning",
                    help="folder of the runs and of grpo_learning_<device>.json / .png (emptied first: a new "
                         "folder, or one this script wrote)")
    ap.add_argument("--extra", action="append", default=[], help="override passed to every run (repeatable)")
    ap.add_argument("--dynamic", action="store_true", help="a third run with task.dynamic_sampling on")
    ap.add_argument("--max-rounds", type=int, default=4, help="task.dynamic_sampling_max_rounds of that run")
    ap.add_argument("--oversample", type=float, default=0.0, help="task.dynamic_sampling_oversample of that run")
    ap.add_argument("--sizing", choices=("cost", "target", "fixed"), default=None,
                    help="task.dynamic_sampling_sizing of that run (default: the config's)")
    ap.add_argument("--target", type=float, default=None, help="task.dynamic_sampling_target of that run")
    ap.add_argument("--rest-steps", type=int, default=0,
                    help="with --dynamic: one more dynamic run with task.dynamic_sampling_rest_steps of this")
    ap.add_argument("--carry", action="store_true",
                    help="with --dynamic: one more dynamic run with task.dynamic_sampling_carry on")
    ap.add_argument("--no-lr0", action="store_true", help="skip the lr-0 control (overhead measurements)")
    ap.add_argument("--warm-start", help="a finished warm_start/ folder of the same recipe to reuse instead of "
                                         "training one (the runs then start from it)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from dstrain.config import load_run_config
    cfg = load_run_config(ROOT / args.recipe, args.extra)
    steps = args.steps or cfg.train.steps
    out = Path(args.out).expanduser().absolute()  # the runs start in the repository: the same folder there
    clear_out(out)
    if args.warm_start:
        shutil.copytree(args.warm_start, out / "grpo" / "warm_start")
    seconds = {"grpo": run(args.recipe, out / "grpo", None, steps, args.nproc, args.extra)}
    warm = out / "grpo" / "warm_start"
    if warm.is_dir():
        shutil.copytree(warm, out / "lr0" / "warm_start")
    names = ["grpo"]
    if not args.no_lr0:
        seconds["lr0"] = run(args.recipe, out / "lr0", 0.0, steps, args.nproc, args.extra)
        names.append("lr0")
    dynamic_runs = {"dynamic": []} if args.dynamic else {}
    if args.dynamic and args.rest_steps:
        dynamic_runs["dynamic_rest"] = [f"--task.dynamic_sampling_rest_steps={args.rest_steps}"]
    if args.dynamic and args.carry:
        dynamic_runs["dynamic_carry"] = ["--task.dynamic_sampling_carry=true"]
    for name, rest in dynamic_runs.items():
        if warm.is_dir():
            shutil.copytree(warm, out / name / "warm_start")
        seconds[name] = run(args.recipe, out / name, None, steps, args.nproc, args.extra + [
            "--task.dynamic_sampling=true", f"--task.dynamic_sampling_max_rounds={args.max_rounds}",
            f"--task.dynamic_sampling_oversample={args.oversample}",
            *([f"--task.dynamic_sampling_sizing={args.sizing}"] if args.sizing else []),
            *([f"--task.dynamic_sampling_target={args.target}"] if args.target is not None else []), *rest])
        names.append(name)

    import torch
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    result = {"recipe": args.recipe, "device": device, "nproc": args.nproc, "steps": steps,
              "log_every": cfg.train.log_every, "overrides": args.extra,
              "command": " ".join(["python", "benchmarks/grpo_learning.py", *(argv or sys.argv[1:])]), "runs": {}}
    for name in names:
        curve = rewards(out / name)
        half = [v for k, v in curve.items() if k > steps / 2]
        summary = json.loads((out / name / "summary.json").read_text())
        result["runs"][name] = {"lr": 0.0 if name == "lr0" else cfg.train.lr, "seconds": seconds[name],
                                "reward_mean": {str(k): v for k, v in sorted(curve.items())},
                                "reward_mean_last_half": sum(half) / max(len(half), 1),
                                "eval_before": summary.get("eval_before"), "eval_after": summary.get("eval_after"),
                                "step_means": means(out / name, STEP_KEYS), "time_split": summary.get("time_split"),
                                "load_before_after": LOADS.get(name)}
    for name in dynamic_runs:
        p_means, d_means = (result["runs"][n]["step_means"] for n in ("grpo", name))
        plain, dyn = p_means.get("time/step"), d_means.get("time/step")
        if plain and dyn:
            def sampling(m):
                return m.get("time/generation", 0.0) + m.get("time/reward", 0.0)
            result[f"{name}_overhead"] = {
                "definition": "per-step means over the run, same recipe and trained batch: step_time_ratio = "
                              "dynamic / plain; extra_sampling_share = (dynamic - plain) generation + verifier "
                              "seconds, as a share of the dynamic step; refill_share = seconds of the rounds "
                              "after the first, as a share of the dynamic step",
                "step_time_ratio": dyn / plain,
                "extra_sampling_share": (sampling(d_means) - sampling(p_means)) / dyn,
                "refill_share": d_means.get("dynamic/refill_seconds", 0.0) / dyn,
                "rounds_per_step": d_means.get("dynamic/rounds"),
                "generated_per_trained": d_means.get("dynamic/generated_per_trained"),
                "dropped_fraction": d_means.get("dynamic/dropped_fraction")}
            print(f"{name}: {dyn:.2f} s/step vs {plain:.2f} s/step plain "
                  f"(x{dyn / plain:.2f}), {result[f'{name}_overhead']['rounds_per_step']:.2f} rounds per step")
    tag = "cpu" if device == "cpu" else "gpu"
    (out / f"grpo_learning_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"grpo_learning_{tag}.png")
    if "lr0" in result["runs"]:
        g, z = (result["runs"][n]["reward_mean_last_half"] for n in ("grpo", "lr0"))
        print(f"mean reward over the last half: GRPO {g:.3f}, lr 0 {z:.3f}")
    print(f"wrote {out}/grpo_learning_{tag}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
