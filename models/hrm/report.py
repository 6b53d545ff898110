"""Learning curve and checkpoint evaluation of an HRM run.

    python -m models.hrm.report RUN_DIR --out benchmarks/results/hrm_sudoku_debug \
        [--puzzles ../shared/data/sudoku_diabolical.txt --limit 1000]

writes ``<out>.json`` (the train/val curves from ``metrics.jsonl``, the run's summary and,
with ``--puzzles``, the exact accuracy of the latest complete checkpoint on those
puzzles) and ``<out>.png`` (loss, exact and token accuracy against step).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

CURVE_KEYS = ("train/loss", "train/accuracy", "train/exact_accuracy", "train/steps", "train/q_halt_accuracy",
              "val/loss", "val/accuracy", "val/exact_accuracy", "val/q_halt_accuracy")


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


def evaluate_checkpoint(run_dir: str | Path, puzzle_file: str | Path, limit: int, batch: int = 100) -> dict:
    """Exact/token accuracy of the latest complete checkpoint on the first ``limit`` puzzles of a file."""
    from dstrain import checkpoint as ckpt
    from dstrain.data import sudoku
    from dstrain.trainers.hrm import evaluate_rows
    from models import registry

    root, tag = ckpt.resolve_checkpoint(run_dir)
    state, run_cfg = ckpt.consolidated_state_dict(root / tag)
    spec = registry.get_spec(run_cfg["model"]["name"])
    mcfg = registry.make_model_config(run_cfg["model"]["name"], run_cfg["model"]["size"], run_cfg["model"]["args"])
    model = spec.build(mcfg)
    model.load_state_dict(state)
    emb_file = root / tag / "hrm" / "puzzle_emb.pt"
    emb = torch.load(emb_file, weights_only=True)["weight"][0] if emb_file.is_file() else None
    puzzles, solutions = sudoku.read_puzzle_file(puzzle_file, limit=limit)
    inputs, labels = sudoku.encode(puzzles, solutions, run_cfg["task"].get("mask_givens", False))
    start = time.perf_counter()
    stats = evaluate_rows(model, mcfg.halt_max_steps, inputs, labels, batch, puzzle_emb=emb)
    return {"checkpoint": tag, "puzzles": len(puzzles), "file": Path(puzzle_file).name,
            "mean_blanks": float((puzzles == 0).sum(1).mean()), "seconds": time.perf_counter() - start, **stats}


def plot(curve: dict, title: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train/loss", "-"), ("val/loss", "o-")):
        if key in curve:
            steps, values = zip(*curve[key])
            axes[0].plot(steps, values, style, label=key, markersize=3)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    for key, style in (("train/exact_accuracy", "-"), ("train/accuracy", "--"),
                       ("val/exact_accuracy", "o-"), ("val/accuracy", "s--")):
        if key in curve:
            steps, values = zip(*curve[key])
            axes[1].plot(steps, values, style, label=key, markersize=3)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("accuracy")
    axes[1].set_ylim(0, 1)
    axes[1].legend(loc="upper left", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--out", required=True, help="output path without extension (.json and .png written)")
    parser.add_argument("--puzzles", help="puzzle file to evaluate the latest checkpoint on")
    parser.add_argument("--limit", type=int, default=1000)
    parser.add_argument("--title", default="HRM on Sudoku")
    args = parser.parse_args(argv)
    run = Path(args.run_dir)
    result = {"run_config": json.loads((run / "run_config.json").read_text()),
              "summary": json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else None,
              "curve": read_curve(run)}
    if args.puzzles:
        result["checkpoint_eval"] = evaluate_checkpoint(run, args.puzzles, args.limit)
        result["checkpoint_eval"]["file"] = Path(args.puzzles).name
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result["curve"], args.title, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "curve"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
