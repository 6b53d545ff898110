"""Learning curve and checkpoint evaluation of an HRM run.

    python -m models.hrm.report RUN_DIR --out benchmarks/results/hrm_sudoku_debug \
        [--puzzles ../shared/data/sudoku_diabolical.txt --limit 1000] \
        [--held-out] [--blanks 16,20,24,26 --per-blanks 200] [--compare OTHER_RUN --compare-label ...] \
        [--halt-threshold 2.0]

writes ``<out>.json`` (the train/val curves from ``metrics.jsonl``, the run's summary and,
with ``--puzzles``, the exact accuracy of the latest complete checkpoint on those
puzzles) and ``<out>.png`` (loss, exact accuracy and mean ACT steps against step; a
``--compare`` run is drawn beside it). ``--held-out`` re-creates the run's held-out
generated puzzles and ``--blanks`` generates fresh ones with those numbers of blanks;
both are evaluated segment by segment (:mod:`models.hrm.evaluate`): exact accuracy after
one segment, after ``halt_max_steps`` and with adaptive halting, and mean ACT steps, by
number of blanks and by propagation rounds (written to ``<out>_difficulty.png``).
``--halt-threshold`` replaces the ``q_halt`` threshold of runs trained with
``halt_rule = "solved"`` for those adaptive scores (an evaluation-time choice; the
exact accuracy after ``halt_max_steps`` does not depend on it).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

CURVE_KEYS = ("train/loss", "train/accuracy", "train/exact_accuracy", "train/steps", "train/q_halt_accuracy",
              "train/segments_per_s", "val/loss", "val/accuracy", "val/exact_accuracy", "val/q_halt_accuracy",
              "val/raw_exact_accuracy")


def read_curve(run_dir: str | Path) -> dict[str, list[list[float]]]:
    """``key -> [[step, value], ...]`` from a run's metrics.jsonl (later lines win on a step)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run folder?)")
    curve: dict[str, dict[int, float]] = {k: {} for k in CURVE_KEYS}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key in CURVE_KEYS:
            if key in record:
                curve[key][int(record["step"])] = float(record[key])
    return {k: sorted([s, v] for s, v in points.items()) for k, points in curve.items() if points}


def load_checkpoint_model(run_dir: str | Path, weights: str = "ema"):
    """(model in eval mode, its config, the run config, puzzle embedding row 0 or None, tag,
    the weights loaded: ``ema`` or ``raw``).

    ``weights``: ``ema`` loads the run's weight average (``task.ema``) where the checkpoint has
    one, else the trained weights; ``raw`` always the trained weights."""
    if weights not in ("ema", "raw"):
        raise ValueError(f"weights must be ema or raw, got {weights!r}")
    from dstrain import checkpoint as ckpt
    from models import registry

    root, tag = ckpt.resolve_checkpoint(run_dir)
    state, run_cfg = ckpt.consolidated_state_dict(root / tag)
    spec = registry.get_spec(run_cfg["model"]["name"])
    mcfg = registry.make_model_config(run_cfg["model"]["name"], run_cfg["model"]["size"], run_cfg["model"]["args"])
    model = spec.build(mcfg)
    model.load_state_dict(state)
    ema_file = root / tag / "hrm" / "ema.pt"
    loaded = "ema" if weights == "ema" and ema_file.is_file() else "raw"
    if loaded == "ema":
        from dstrain.optim.ema import EMA
        ema = EMA(model, 0.5)
        # (map_location: a GPU run's ema.pt holds CUDA tensors; this reads it on any machine)
        ema.load_state_dict(torch.load(ema_file, weights_only=True, map_location="cpu"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in ema.shadow:
                    p.copy_(ema.shadow[name])
    model.eval()
    emb_file = root / tag / "hrm" / "puzzle_emb.pt"
    emb = torch.load(emb_file, weights_only=True, map_location="cpu")["weight"][0] if emb_file.is_file() else None
    return model, mcfg, run_cfg, emb, tag, loaded


def evaluate_checkpoint(run_dir: str | Path, puzzle_file: str | Path, limit: int, batch: int = 100,
                        weights: str = "ema") -> dict:
    """Exact/token accuracy of the latest complete checkpoint on the first ``limit`` puzzles of a file."""
    from dstrain.data import sudoku
    from dstrain.trainers.hrm import evaluate_rows

    model, mcfg, run_cfg, emb, tag, loaded = load_checkpoint_model(run_dir, weights)
    puzzles, solutions = sudoku.read_puzzle_file(puzzle_file, limit=limit)
    if puzzles.shape[1] != mcfg.seq_len:  # a 9x9 file against a 6x6 run: said here, not by the model's forward
        raise ValueError(f"{puzzle_file}: puzzles of {puzzles.shape[1]} cells, but the run's model reads "
                         f"{mcfg.seq_len} (a {int(mcfg.seq_len ** 0.5)}x{int(mcfg.seq_len ** 0.5)} grid)")
    inputs, labels = sudoku.encode(puzzles, solutions, run_cfg["task"].get("mask_givens", False))
    start = time.perf_counter()
    stats = evaluate_rows(model, mcfg.halt_max_steps, inputs, labels, batch, puzzle_emb=emb)
    return {"checkpoint": tag, "weights": loaded, "puzzles": len(puzzles), "file": Path(puzzle_file).name,
            "mean_blanks": float((puzzles == 0).sum(1).mean()), "seconds": time.perf_counter() - start, **stats}


def evaluate_difficulty(run_dir: str | Path, held_out: bool, blanks: list[int], per_blanks: int,
                        seed: int = 424242, weights: str = "ema", halt_threshold: float | None = None) -> dict:
    """Segment-by-segment evaluation (see :mod:`models.hrm.evaluate`) of generated puzzles.

    ``halt_threshold`` (runs trained with ``halt_rule = "solved"`` only; others ignore it)
    replaces the model's threshold for the adaptive-halting scores: an evaluation-time choice."""
    import dataclasses

    import numpy as np

    from dstrain.config import run_config_from_dict
    from dstrain.data import sudoku
    from dstrain.trainers import task_config
    from dstrain.trainers.hrm import load_sudoku
    from models.hrm import evaluate

    model, mcfg, run_cfg, emb, tag, loaded = load_checkpoint_model(run_dir, weights)
    if halt_threshold is not None and getattr(mcfg, "halt_rule", "compare") == "solved":
        mcfg = model.config = dataclasses.replace(mcfg, halt_threshold=float(halt_threshold))
    task = task_config(run_config_from_dict(run_cfg, "run_config.json"))
    sets = {}
    if held_out:
        _, _, ep, es = load_sudoku(task, run_cfg["data"]["seed"])
        sets["held_out"] = (ep, es)
    for b in blanks:
        sets[f"blanks_{b}"] = sudoku.generate_many(per_blanks, b, seed + b, size=task.grid)
    out = {"checkpoint": tag, "weights": loaded, "halt_max_steps": mcfg.halt_max_steps, "act": mcfg.act,
           "halt_rule": mcfg.halt_rule, "halt_threshold": mcfg.halt_threshold}
    for name, (puzzles, solutions) in sets.items():
        inputs, labels = sudoku.encode(puzzles, solutions, task.mask_givens)
        correct, halt = evaluate.run_segments(model, inputs, labels, mcfg.halt_max_steps, puzzle_emb=emb)
        rounds = np.array([sudoku.propagation_rounds(p) for p in puzzles])
        out[name] = {"mean_blanks": float((puzzles == 0).sum(1).mean()),
                     "by_rounds": evaluate.summarise(correct, halt, rounds)["by_group"],
                     **evaluate.summarise(correct, halt)}
    return out


def plot_difficulty(result: dict, title: str, path: Path) -> None:
    """Mean ACT steps and exact accuracy (1 segment, max segments, adaptive) by blanks and by rounds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    blank_sets = sorted((v["mean_blanks"], v["all"]) for k, v in result.items() if k.startswith("blanks_"))
    rounds: dict[int, list] = {}
    for k, v in result.items():
        if isinstance(v, dict) and "by_rounds" in v and k.startswith("blanks_"):
            for r, stats in v["by_rounds"].items():
                rounds.setdefault(int(r), []).append(stats)
    for ax, (xs, rows, label) in zip(axes, (
            ([b for b, _ in blank_sets], [s for _, s in blank_sets], "blank cells"),
            (sorted(r for r in rounds if r > 0), [_pool(rounds[r]) for r in sorted(r for r in rounds if r > 0)],
             "propagation rounds (generated sets pooled)"))):
        if not xs:
            continue
        for key, style in (("exact_1_segment", "v--"), ("exact_max_segments", "s-"), ("exact_adaptive", "o-")):
            ax.plot(xs, [r[key] for r in rows], style, label=key.replace("_", " "))
        ax.set_xlabel(label)
        ax.set_ylabel("exact accuracy")
        ax.set_ylim(0, 1.02)
        twin = ax.twinx()
        twin.plot(xs, [r["mean_act_steps"] for r in rows], "k^:", label="mean ACT steps")
        twin.set_ylabel("mean ACT steps (adaptive)")
        twin.set_ylim(0, result["halt_max_steps"] + 0.5)
        ax.legend(loc="lower left", fontsize=8)
        twin.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pool(stats: list[dict]) -> dict:
    n = sum(s["puzzles"] for s in stats)
    keys = ("exact_1_segment", "exact_max_segments", "exact_adaptive", "mean_act_steps")
    return {k: sum(s[k] * s["puzzles"] for s in stats) / n for k in keys}


def plot(curves: dict[str, dict], title: str, path: Path) -> None:
    """Loss, exact accuracy and mean ACT steps against step; one line style per run label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    panels = ((("train/loss", "-"), ("val/loss", "o-")),
              (("train/exact_accuracy", "-"), ("val/exact_accuracy", "o-"), ("val/raw_exact_accuracy", "x:"),
               ("val/accuracy", "s--")),
              (("train/steps", "-"),))
    for ax, keys, ylabel in zip(axes, panels, ("loss", "accuracy (val/accuracy: tokens)", "mean ACT steps (halted rows)")):
        for i, (label, curve) in enumerate(curves.items()):
            for key, style in keys:
                if key in curve:
                    steps, values = zip(*curve[key])
                    ax.plot(steps, values, style, color=f"C{i}", alpha=0.6 if key.startswith("train") else 1.0,
                            label=f"{label} {key}" if len(curves) > 1 else key, markersize=3)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    axes[1].set_ylim(0, 1.02)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_record(run: Path) -> dict:
    return {"run_config": json.loads((run / "run_config.json").read_text()),
            "summary": json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else None,
            "curve": read_curve(run)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="output path without extension (.json and .png written)")
    parser.add_argument("--puzzles", help="puzzle file to evaluate the latest checkpoint on")
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--held-out", action="store_true", help="evaluate the run's held-out generated puzzles")
    parser.add_argument("--blanks", default="", help="comma-separated blank counts of fresh generated puzzles")
    parser.add_argument("--per-blanks", type=int, default=200)
    parser.add_argument("--label", default="ACT")
    parser.add_argument("--compare", action="append", default=[], help="another run drawn beside (repeatable)")
    parser.add_argument("--compare-label", action="append", default=[])
    parser.add_argument("--title", default="HRM on Sudoku")
    parser.add_argument("--weights", choices=("ema", "raw"), default="ema",
                        help="checkpoint weights to evaluate: the run's average (task.ema) where it has one, or raw")
    parser.add_argument("--halt-threshold", type=float, default=None,
                        help="evaluation-time q_halt threshold for runs trained with halt_rule solved "
                             "(default: the run's own)")
    args = parser.parse_args(argv)
    if len(args.compare_label) not in (0, len(args.compare)):
        parser.error("give one --compare-label per --compare run, or none")
    run = Path(args.run_dir)
    for folder in (run, *map(Path, args.compare)):  # a mistyped folder: one line, not a traceback
        if not (folder / "run_config.json").is_file():
            parser.error(f"{folder} is not a run folder (no run_config.json there)")
        if not (folder / "metrics.jsonl").is_file():  # a run that stopped before its first logged step
            parser.error(f"{folder}: no metrics.jsonl there (the run has logged no step yet)")
    if args.puzzles and not Path(args.puzzles).is_file():  # before the curves are read: one line, not a traceback
        parser.error(f"--puzzles {args.puzzles}: no such puzzle file (relative paths are read from {Path.cwd()})")
    result = _run_record(run)
    curves = {args.label: result["curve"]}
    labels = args.compare_label or [Path(c).name for c in args.compare]
    if args.compare:
        result["compare"] = {}
    for label, other in zip(labels, args.compare):
        result["compare"][label] = _run_record(Path(other))
        curves[label] = result["compare"][label]["curve"]
    if args.puzzles:
        try:
            result["checkpoint_eval"] = evaluate_checkpoint(run, args.puzzles, args.limit, weights=args.weights)
        except ValueError as err:  # a malformed file, or another grid size than the run's
            parser.error(str(err))
        result["checkpoint_eval"]["file"] = Path(args.puzzles).name
    blanks = [int(b) for b in args.blanks.split(",") if b.strip()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.held_out or blanks:
        result["difficulty"] = evaluate_difficulty(run, args.held_out, blanks, args.per_blanks,
                                                   weights=args.weights, halt_threshold=args.halt_threshold)
        for label, other in zip(labels, args.compare):
            result["compare"][label]["difficulty"] = evaluate_difficulty(
                other, args.held_out, blanks, args.per_blanks, weights=args.weights,
                halt_threshold=args.halt_threshold)
        if blanks:
            plot_difficulty(result["difficulty"], f"{args.title}: {args.label} by difficulty",
                            out.with_name(out.name + "_difficulty.png"))
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(curves, args.title, out.with_suffix(".png"))
    brief = {k: v for k, v in result.items() if k not in ("curve", "compare", "run_config")}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
