"""SCoRe's self-correction check: the recipe, the same run without the guidance model, and stage II only.

    python benchmarks/score_selfcorrect.py                     # runs the three (two at a time), then reports
    python benchmarks/score_selfcorrect.py --parallel 1        # one after the other (timings undisturbed)
    python benchmarks/score_selfcorrect.py --report-only       # only read the three run folders
    python benchmarks/score_selfcorrect.py --extra=--train.steps=60 --out runs/sc_short

Runs (``models/policy/recipes/score_selfcorrect_cpu.json``, same seed, tasks and steps):

* ``score``: stage I then stage II, hints written by the guidance model (which is shown the answer key);
* ``no_guidance``: ``task.guidance=none`` (every turn-2 prompt carries the same fixed hint);
* ``stage2_only``: ``task.stage_one_steps=0``.

Reads each run's ``metrics.jsonl``: held-out ``val/*`` (greedy two-turn episodes on the
``task.n_eval`` held-out tasks: accuracy at turn 1 and 2, incorrect->correct and
correct->incorrect rates, Newcombe's 95% interval of the difference) and the training
episodes' ``train/*`` rates, against steps. Writes ``<results>/score_selfcorrect_<device>.json``
with the commands, the machine and its load, and a PNG of the curves.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "models/policy/recipes/score_selfcorrect_cpu.json"
RUNS = {"score": [], "no_guidance": ["--task.guidance=none", "--task.guidance_key=false"],
        "stage2_only": ["--task.stage_one_steps=0"]}
VAL_KEYS = ("accuracy@t1", "accuracy@t2", "delta(t1,t2)", "incorrect_to_correct", "correct_to_incorrect",
            "delta_ci95_low", "delta_ci95_high", "hint_leak", "tasks")
TRAIN_KEYS = ("accuracy@t1", "accuracy@t2", "incorrect_to_correct", "correct_to_incorrect", "reward_t1",
              "reward_t2", "hint_leak", "stage")


def command(name: str, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dstrain.cli", "train", RECIPE, f"--output.dir={out / name}",
            "--output.progress=false", *RUNS[name], *extra]


def load() -> list[float]:
    return list(os.getloadavg())


WARM_STARTS = {"no_guidance": ("warm_start",), "stage2_only": ("warm_start", "guidance/warm_start")}
"""The score run's supervised warm starts (policy, guidance) each ablation reuses: all three runs start
from the same weights (the policy's warm start teaches turn 2 both with verdict hints and with the
fixed hint of runs without guidance)."""


def share_warm_start(out: Path, name: str, poll_s: float = 10.0, check=lambda: None) -> None:
    """Wait for the score run's warm starts that ``name`` needs, then copy them into its folder (the
    trainer reuses a finished warm start it finds there); ``check()`` runs at every poll (it raises
    when a run failed)."""
    done = [out / "score" / w / "WARM_START_COMPLETE" for w in WARM_STARTS[name]]
    while not all(d.is_file() for d in done):
        check()
        time.sleep(poll_s)
    for w in WARM_STARTS[name]:
        shutil.copytree(out / "score" / w, out / name / w, dirs_exist_ok=True)


def launch(names: list[str], out: Path, extra: list[str], parallel: int) -> dict[str, dict]:
    """Start the runs, at most ``parallel`` at a time (score first: the others wait for its warm
    starts); each process gets ``OMP_NUM_THREADS = cpus // parallel`` unless the caller set it."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // parallel))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "OMP_NUM_THREADS": threads}
    out.mkdir(parents=True, exist_ok=True)
    info, procs = {}, {}
    names = sorted(names, key=list(RUNS).index)
    for name in names:
        while len(procs) >= parallel:
            _reap(procs, info)
        shared = name in WARM_STARTS and "score" in names
        if shared:
            print(f"{name}: waiting for the score run's warm start, to start from the same weights", flush=True)
            share_warm_start(out, name, check=lambda: _reap(procs, info))
        while len(procs) >= parallel:  # a slot may have been taken while waiting
            _reap(procs, info)
        cmd = command(name, out, extra)
        print("$", " ".join(cmd[1:]), flush=True)
        info[name] = {"command": " ".join(["python", *cmd[1:]]), "load_at_start": load(),
                      "omp_num_threads": int(threads), "runs_at_once": parallel}
        if shared:
            info[name]["warm_start_copied_from"] = "score"
        log = open(out / f"{name}.log", "w")
        start = time.perf_counter()
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), start, log)
    while procs:  # each run's end is taken when it ends, not when the one before it does
        _reap(procs, info)
    return info


def _reap(procs: dict, info: dict) -> None:
    for name in [n for n, (p, _, _) in procs.items() if p.poll() is not None]:
        _wait(name, procs.pop(name), info)
    time.sleep(2)


def _wait(name: str, proc, info: dict) -> None:
    p, start, log = proc
    rc = p.wait()
    log.close()
    info[name].update(wall_s=time.perf_counter() - start, load_at_end=load(), returncode=rc)
    if rc:
        raise SystemExit(f"run {name} failed with exit status {rc}; see its .log")


def series(path: Path, prefix: str, keys: tuple[str, ...]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {k: {} for k in keys}
    for line in (path / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for k in keys:
            if f"{prefix}/{k}" in record:
                out[k][record["step"]] = record[f"{prefix}/{k}"]
    return out


def summarise(path: Path) -> dict:
    val, train = series(path, "val", VAL_KEYS), series(path, "train", TRAIN_KEYS)
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    steps = sorted(val["accuracy@t2"])
    final = {k: val[k][steps[-1]] for k in VAL_KEYS if steps and steps[-1] in val[k]}
    first = {k: val[k][steps[0]] for k in VAL_KEYS if steps and steps[0] in val[k]}
    return {"val": val, "train": train, "held_out_before": first, "held_out_final": final,
            "rl_seconds": summary.get("seconds"),
            "warm_start": (path / "warm_start" / "WARM_START_COMPLETE").read_text().strip()
            if (path / "warm_start" / "WARM_START_COMPLETE").is_file() else None}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = {"score": "C0", "no_guidance": "C1", "stage2_only": "C2"}
    for name, run in result["runs"].items():
        val, train = run["val"], run["train"]
        for key, style in (("accuracy@t1", "--"), ("accuracy@t2", "-")):
            xs = sorted(int(s) for s in val[key])
            axes[0].plot(xs, [100 * val[key][s] for s in xs], style, marker="o", ms=3, color=colours[name],
                         label=f"{name} {key[-2:]}")
        for ax, key in ((axes[1], "incorrect_to_correct"), (axes[2], "correct_to_incorrect")):
            xs = sorted(int(s) for s in train[key])
            ax.plot(xs, [100 * train[key][s] for s in xs], ":", color=colours[name], alpha=0.6,
                    label=f"{name} (training episodes)")
            xs = sorted(int(s) for s in val[key])
            ax.plot(xs, [100 * val[key][s] for s in xs], "-", marker="o", ms=3, color=colours[name],
                    label=f"{name} (held-out, greedy)")
    axes[0].set_title("held-out accuracy at turn 1 (--) and turn 2 (-)")
    axes[1].set_title("incorrect -> correct (%)")
    axes[2].set_title("correct -> incorrect (%)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("%")
    fig.suptitle(f"SCoRe self-correction ({result['device']}), {RECIPE}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/score_selfcorrect", help="folder of the three runs")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results"),
                    help="folder of score_selfcorrect_<device><NAME>.json and .png (default: benchmarks/results, "
                         "over the committed figures)")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    ap.add_argument("--parallel", type=int, default=2, help="runs at once (1: one after the other)")
    ap.add_argument("--report-only", action="store_true", help="read existing run folders, start nothing")
    ap.add_argument("--extra", action="append", default=[], help="override passed to every run (repeatable)")
    ap.add_argument("--name", default="", help="suffix of the result files")
    args = ap.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        ap.error(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    out = Path(args.out)
    info = {} if args.report_only else launch(names, out, args.extra, args.parallel)
    device = "cpu"
    result = {"recipe": RECIPE, "device": device, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                               "processor": platform.processor() or platform.machine()},
              "load_at_report": load(), "extra": args.extra, "runs": {}}
    for name in names:
        run = summarise(out / name)
        run.update(info.get(name, {"command": " ".join(["python", *command(name, out, args.extra)[1:]])}))
        result["runs"][name] = run
        f = run["held_out_final"]
        if f:
            print(f"{name:12s} held-out n={f['tasks']:.0f}: t1 {100 * f['accuracy@t1']:.1f}% t2 "
                  f"{100 * f['accuracy@t2']:.1f}% delta {100 * f['delta(t1,t2)']:+.1f} points "
                  f"(95% CI {100 * f['delta_ci95_low']:+.1f} to {100 * f['delta_ci95_high']:+.1f}); "
                  f"i->c {100 * f['incorrect_to_correct']:.1f}% c->i {100 * f['correct_to_incorrect']:.1f}%")
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = f"score_selfcorrect_{device}{args.name}"
    (results / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, results / f"{stem}.png")
    print(f"wrote {results / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
