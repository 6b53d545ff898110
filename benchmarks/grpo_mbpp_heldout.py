"""Greedy and sampled pass@1 of finished GRPO runs on MBPP problems they never trained on.

    python benchmarks/grpo_mbpp_heldout.py runs/grpo_mbpp/grpo runs/grpo_mbpp/lr0 \
        --into benchmarks/results/grpo_learning_mbpp_cpu.json

For each run folder (a ``grpo_learning.py`` run of an MBPP recipe) the last checkpoint's
consolidated weights are loaded into the policy its run config names, and completions are
scored in the sandbox on two sets shaped like the recipe's tasks
(``mbpp_max_reference_chars``, ``mbpp_signature``): the MBPP validation and test splits
(held out: never seen in warm start or RL) and the train split (the problems the run
trained on). Per set: greedy pass@1, and with ``--samples N`` (default 8; 0: off) the
sampled pass rate, N completions per problem at the run's ``task.temperature`` with the
fixed ``--seed`` (the same for every run, so two runs are compared on equal terms).

With two or more runs, the first is compared with each of the others (for
``grpo_learning.py``: ``grpo`` minus ``lr0``) problem by problem, paired: the greedy
difference with Newcombe's paired score interval, the sampled-rate difference with a
paired bootstrap over problems (95%; ``--bootstrap`` resamples, fixed seed). A weaker,
more sensitive signal is reported beside it: the share of sampled programs that ran to
their tests (sandbox status passed or failed: no syntax error, exception or timeout).

``--into`` adds the figures to a ``grpo_learning.py`` result JSON under ``"mbpp_splits"``
(and the comparisons under ``"mbpp_paired"``); they are printed either way. MBPP comes
from the run's ``task.path`` (relative to the repository), ``--data`` or ``$DSTRAIN_DATA_DIR``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HELDOUT = "heldout (validation + test)"
RAN = ("passed", "failed")
"""Sandbox statuses of a program that ran to its tests (no syntax error, exception or timeout)."""


def statuses(results) -> dict[str, int]:
    """Count of each sandbox status (passed, failed, error, timeout, crash) among ``results``."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return dict(sorted(counts.items()))


def mbpp_file(task: dict, data: str | None) -> str:
    if data:
        return str(Path(data) / "mbpp.jsonl")
    if os.environ.get("DSTRAIN_DATA_DIR"):
        return str(Path(os.environ["DSTRAIN_DATA_DIR"]) / "mbpp.jsonl")
    path = Path(task["path"])
    return str(path if path.is_absolute() else ROOT / path)


def paired_bootstrap(first: list[float], second: list[float], resamples: int = 10000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """``(mean difference, low, high)`` of ``second - first`` over paired per-problem values:
    percentile interval of the mean difference over ``resamples`` resamplings of the problems
    (with replacement, ``random.Random(seed)``: deterministic). The bounds are the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles of the resampled means, linearly interpolated between order
    statistics (numpy's default percentile; before, the upper bound took the order statistic one
    above it, so the interval was not symmetric in its tails)."""
    if len(first) != len(second) or not first:
        raise ValueError(f"paired_bootstrap needs two equally long, non-empty lists, got {len(first)} "
                         f"and {len(second)}")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"resamples must be >= 1 and level within (0, 1), got {resamples}, {level}")
    diffs = [b - a for a, b in zip(first, second)]
    n, rng = len(diffs), random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return sum(diffs) / n, _quantile(means, tail), _quantile(means, 1 - tail)


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly (Hyndman and Fan's type 7, numpy's default)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def compare(first: dict, second: dict, resamples: int = 10000, seed: int = 0) -> dict:
    """Paired comparison ``second - first`` of two runs' figures on one problem set (same task ids):
    ``first`` is the baseline (the lr-0 control), ``second`` the run (GRPO); pairs of figures are
    ``{"baseline": ..., "run": ...}``."""
    from dstrain.rl.score_math import paired_difference_interval
    ids = first["task_ids"]
    if second["task_ids"] != ids:
        raise ValueError("the two runs were scored on different problems")
    g1, g2 = set(first["passed"]), set(second["passed"])
    both = sum(t in g1 and t in g2 for t in ids)
    only1, only2 = sum(t in g1 and t not in g2 for t in ids), sum(t in g2 and t not in g1 for t in ids)
    diff, low, high = paired_difference_interval(both, only1, only2, len(ids) - both - only1 - only2)
    out = {"problems": len(ids), "greedy_passed": pair(len(g1), len(g2)),
           "greedy_only_baseline": only1, "greedy_only_run": only2,
           "greedy_difference": diff, "greedy_ci95_newcombe": [low, high]}
    # sampled pass rates, then a weaker signal: the rate of samples whose code runs to its tests
    for key, name in (("sampled_passes", "sampled"), ("sampled_ran", "sampled_ran")):
        if key not in first or key not in second:
            continue
        r1 = [c / first["samples"] for c in first[key]]
        r2 = [c / second["samples"] for c in second[key]]
        mean, low, high = paired_bootstrap(r1, r2, resamples, seed)
        out.update({f"{name}_rate": pair(sum(r1) / len(r1), sum(r2) / len(r2)), f"{name}_difference": mean,
                    f"{name}_ci95_bootstrap": [low, high]})
        if key == "sampled_passes":
            out.update(bootstrap_resamples=resamples,
                       problems_any_sample_passed=pair(sum(c > 0 for c in first[key]), sum(c > 0 for c in second[key])))
    return out


def pair(baseline, run) -> dict:
    return {"baseline": baseline, "run": run}


def evaluate(run: Path, data: str | None, samples: int = 0, seed: int = 0) -> dict:
    import torch

    from dstrain.checkpoint import consolidated_state_dict
    from dstrain.data.tasks import load_mbpp
    from dstrain.rewards import SandboxLimits, SandboxPool
    from dstrain.rewards.code import evaluate_tasks
    from models import registry
    cfg = json.loads((run / "run_config.json").read_text())
    task = cfg["task"]
    shape = dict(max_reference_chars=int(task.get("mbpp_max_reference_chars", 0)),
                 signature=bool(task.get("mbpp_signature", False)))
    path = mbpp_file(task, data)
    sets = {HELDOUT: [t for s in ("validation", "test") for t in load_mbpp(path, s, **shape)],
            "train": load_mbpp(path, "train", **shape)}
    spec = registry.get_spec(cfg["model"]["name"])
    args = {k: v for k, v in cfg["model"].get("args", {}).items() if k != "path"}
    mcfg = registry.make_model_config(cfg["model"]["name"], cfg["model"]["size"], args)
    torch.manual_seed(0)
    model = spec.rl.build(mcfg)
    state, _ = consolidated_state_dict(run / "checkpoints")
    model.load_state_dict(state)
    tok = spec.rl.load_tokenizer(mcfg)
    max_new = int(task.get("max_new_tokens", 96))
    temperature, top_p = float(task.get("temperature", 1.0)), float(task.get("top_p", 1.0))
    out = {}
    with SandboxPool(2, SandboxLimits(wall_seconds=5.0, memory_bytes=512 << 20)) as pool:
        for name, tasks in sets.items():
            stops = tuple(dict.fromkeys(s for t in tasks for s in t.stop))
            prompts = [t.prompt for t in tasks]
            greedy = spec.rl.generate(model, tok, prompts, greedy=True, max_new_tokens=max_new, stop=stops)
            results = evaluate_tasks(tasks, [c.text for c in greedy], pool)
            passed = [t.task_id for t, r in zip(tasks, results) if r.status == "passed"]
            fig = {"tasks": len(tasks), "greedy_pass@1": len(passed) / max(len(tasks), 1), "passed": passed,
                   "task_ids": [t.task_id for t in tasks], "greedy_statuses": statuses(results)}
            if samples:
                sampled = spec.rl.generate(model, tok, prompts, num_samples=samples, temperature=temperature,
                                           top_p=top_p, max_new_tokens=max_new, stop=stops, seed=seed)
                got = evaluate_tasks([t for t in tasks for _ in range(samples)], [c.text for c in sampled], pool)
                rows = [got[i * samples:(i + 1) * samples] for i in range(len(tasks))]
                counts = [sum(r.status == "passed" for r in row) for row in rows]
                ran = [sum(r.status in RAN for r in row) for row in rows]
                fig.update(samples=samples, temperature=temperature, seed=seed, sampled_passes=counts,
                           sampled_pass_rate=sum(counts) / max(samples * len(tasks), 1), sampled_ran=ran,
                           sampled_ran_rate=sum(ran) / max(samples * len(tasks), 1), sampled_statuses=statuses(got))
            out[name] = fig
    return out


def describe(figures: dict) -> dict:
    return {k: f"greedy {len(v['passed'])}/{v['tasks']}"
               + (f", sampled {v['sampled_pass_rate']:.4f} ({v['samples']} per problem; ran to the tests "
                  f"{v['sampled_ran_rate']:.4f})" if "samples" in v else "")
            for k, v in figures.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (each with run_config.json and checkpoints/)")
    ap.add_argument("--data", help="folder holding mbpp.jsonl (default: the run's task.path)")
    ap.add_argument("--into", help="a grpo_learning.py result JSON to add the figures to")
    ap.add_argument("--samples", type=int, default=8, help="sampled completions per problem (0: greedy only)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed, the same for every run")
    ap.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples of the paired interval")
    args = ap.parse_args(argv)
    if args.samples < 0:
        ap.error("--samples must not be negative")
    result, paired = {}, {}
    for run in map(Path, args.runs):
        result[run.name] = evaluate(run, args.data, args.samples, args.seed)
        print(run.name, describe(result[run.name]), flush=True)
    first = args.runs[0]
    for other in args.runs[1:]:
        key = f"{Path(first).name} - {Path(other).name}"
        paired[key] = {"run": Path(first).name, "baseline": Path(other).name}
        paired[key].update({name: compare(result[Path(other).name][name], result[Path(first).name][name],
                                          args.bootstrap, args.seed)
                            for name in result[Path(first).name]})
        for name, c in paired[key].items():
            if not isinstance(c, dict):
                continue
            line = (f"{key} on {name} ({c['problems']} problems): greedy {c['greedy_difference']:+.4f} "
                    f"[{c['greedy_ci95_newcombe'][0]:+.4f}, {c['greedy_ci95_newcombe'][1]:+.4f}]")
            if "sampled_difference" in c:
                line += (f", sampled {c['sampled_difference']:+.4f} [{c['sampled_ci95_bootstrap'][0]:+.4f}, "
                         f"{c['sampled_ci95_bootstrap'][1]:+.4f}]")
            if "sampled_ran_difference" in c:
                line += (f", ran to the tests {c['sampled_ran_difference']:+.4f} "
                         f"[{c['sampled_ran_ci95_bootstrap'][0]:+.4f}, {c['sampled_ran_ci95_bootstrap'][1]:+.4f}]")
            print(line, flush=True)
    if args.into:
        target = Path(args.into)
        doc = json.loads(target.read_text())
        doc["mbpp_splits"] = {"command": "python benchmarks/grpo_mbpp_heldout.py " + " ".join(argv or sys.argv[1:]),
                              "runs": result}
        if paired:
            doc["mbpp_paired"] = {"definition": "first run minus the other, per problem, paired: greedy with "
                                                "Newcombe's hybrid score interval, sampled pass rate with a "
                                                "percentile bootstrap over problems; 95%",
                                  "comparisons": paired}
        target.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
