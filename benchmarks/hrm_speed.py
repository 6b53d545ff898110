"""HRM training speed: segments/s of the ACT training step and the projected wall time of a recipe.

    python benchmarks/hrm_speed.py [--sizes debug,sudoku] [--batch 16] [--steps 10] [--warmup 2] \
        [--device auto] [--precision fp32|bf16] [--compile] [--sync-every-step] \
        [--recipe models/hrm/recipes/sudoku_extreme.json] [--out benchmarks/results/hrm_speed_cpu.json] \
        [--grid 6 --model-args '{"seq_len": 36, "vocab_size": 8, "halt_rule": "solved"}']

One process, no DeepSpeed: the loop the HRM trainer runs on one rank, written out so
each speed change can be switched on and off. A step is one ACT segment for ``batch``
rows: halted rows take new puzzles (selected on the device with ``torch.where``: the
carry, the halting mask and the batch keep their shapes), the model's forward (with the
Q-target segment under the reference ``halt_rule`` and ACT on), backward, AdamW, and the
sparse sign-SGD update of the shared puzzle embedding.
Puzzles are generated beforehand and held on the device.

Options that change the loop: ``--compile`` (``torch.compile(model, dynamic=False)``, as
``train.compile`` does inside the engine; ``--compile-mode reduce-overhead`` as ``train.compile_mode``;
``--compile-scope`` auto (default, as ``train.compile_scope``: the H and L modules only, the whole
model under CUDA graphs), regions or model;
``warmup_seconds`` in the results is the time of the first steps, compilation included), ``--precision bf16`` (autocast, as the
factory's bf16 on GPUs), ``--sync-every-step`` (read the loss and metrics on the host
every step, as the trainer did before: on a GPU each read waits for the device).

Reported per size: dense parameters, seconds per step at ``--batch``, segments/s, and
``projected_recipe_hours``: the recipe's ``train.steps * task.global_batch`` segments at
the measured segments/s (a lower bound on a CPU, where a larger batch is no faster per row).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.bench_args import check_out, count  # noqa: E402
from dstrain.config import COMPILE_MODES  # noqa: E402
from dstrain.engine.compiling import compile_kwargs, copy_graph_outputs, records_cuda_graphs  # noqa: E402
from dstrain.data import sudoku  # noqa: E402
from dstrain.optim.sparse_sign_sgd import SparseEmbedding, SparseSignSGD  # noqa: E402
from models import registry  # noqa: E402


def make_pool(rows: int, blanks: int, seed: int, device, grid: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    puzzles, solutions = sudoku.generate_many(rows, blanks, seed, size=grid)
    inputs, labels = sudoku.encode(puzzles, solutions)
    return torch.from_numpy(inputs).to(device), torch.from_numpy(labels).to(device)


def time_size(size: str, args, device: torch.device) -> dict:
    cfg = registry.make_model_config("hrm", size, args.model_args)
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(cfg).to(device).train()
    dense = sum(p.numel() for p in model.parameters())
    step_fn = model
    scope = args.compile_scope
    if scope == "auto":
        scope = "model" if records_cuda_graphs(args.compile_mode) else "regions"
    if args.compile and scope == "regions":
        for region in registry.get_spec("hrm").compile_regions(model):
            region.compile(**compile_kwargs(args.compile_mode))
    elif args.compile:
        step_fn = torch.compile(model, **compile_kwargs(args.compile_mode))
    graphs = args.compile and records_cuda_graphs(args.compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            foreach=True)
    table = SparseEmbedding(1, cfg.puzzle_emb_len * cfg.hidden_size, device=device)
    sparse = SparseSignSGD(table, lr=1e-2, weight_decay=0.1, equal_counts=True)
    b, total = args.batch, args.warmup + args.steps
    pool_x, pool_y = make_pool(b * (total + 1), args.blanks, 0, device, args.grid)
    ids = torch.zeros(b, dtype=torch.long, device=device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext())
    carry = None
    x, y = pool_x[:b], pool_y[:b]
    sums = None

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    began = time.perf_counter()
    for step in range(total):
        if step == args.warmup:
            sync()
            start = time.perf_counter()
        new_x, new_y = pool_x[(step + 1) * b:(step + 2) * b], pool_y[(step + 1) * b:(step + 2) * b]
        if carry is None:
            reset = torch.ones(b, dtype=torch.bool, device=device)
            z_H = z_L = steps = None
        else:
            reset, z_H, z_L, steps = carry["halted"], carry["z_H"], carry["z_L"], carry["steps"]
            x = torch.where(reset[:, None], new_x, x)
            y = torch.where(reset[:, None], new_y, y)
        with autocast:
            loss, out = step_fn(x, y, table.lookup(ids), z_H, z_L, steps, reset)
        if graphs:  # the next replay overwrites the carry the next step reads
            out = copy_graph_outputs(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sparse.step()
        carry = out
        metrics = out["metrics"]
        if args.sync_every_step:
            _ = float(loss.item()), {k: float(v) for k, v in metrics.items()}
        else:
            sums = metrics if sums is None else {k: sums[k] + v for k, v in metrics.items()}
    sync()
    seconds = time.perf_counter() - start
    per_step = seconds / args.steps
    seg_s = b / per_step
    recipe = json.loads(Path(args.recipe).read_text())
    recipe_segments = recipe["train"]["steps"] * recipe["task"]["global_batch"]
    return {"size": size, "dense_params": dense, "batch": b, "steps": args.steps, "s_per_step": per_step,
            "warmup_seconds": start - began,  # the first steps, compilation included
            "segments_per_s": seg_s, "recipe_segments": recipe_segments,
            "projected_recipe_hours": recipe_segments / seg_s / 3600,
            "flops_per_segment_token": model.flops_per_segment_token(),
            "model_tflops": model.flops_per_segment_token() * cfg.total_len * seg_s / 1e12}


def machine(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "load_avg": os.getloadavg()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip()
    except OSError:
        pass
    return info


def rate(per_s: float) -> str:
    """Segments/s as printed: whole numbers where they are large, three figures below 100 (a CPU run of the
    Sudoku size does under one: "0 segments/s" read as nothing done)."""
    return f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="debug,sudoku", help="comma-separated HRM sizes (models/hrm/sizes.py)")
    parser.add_argument("--batch", type=count(0), default=0, help="rows per step (default: 16 on CPU, 384 on GPU)")
    parser.add_argument("--steps", type=count(1), default=10)
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--blanks", type=count(0), default=40, help="blank cells per generated puzzle")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                        help="torch.compile mode with --compile (reduce-overhead: CUDA graphs)")
    parser.add_argument("--compile-scope", default="auto", choices=("auto", "model", "regions"),
                        help="with --compile: the whole forward (model) or only the H and L reasoning modules "
                             "(regions: far less to compile); auto: as train.compile_scope=auto (regions unless "
                             "the mode records CUDA graphs)")
    parser.add_argument("--sync-every-step", action="store_true")
    parser.add_argument("--recipe", default=str(ROOT / "models" / "hrm" / "recipes" / "sudoku_extreme.json"))
    parser.add_argument("--grid", type=int, default=9, choices=(4, 6, 9), help="side of the generated puzzles")
    parser.add_argument("--model-args", default="{}",
                        help="JSON object of HRM config overrides, e.g. seq_len/vocab_size for --grid, act, halt_rule")
    parser.add_argument("--out", default="", help="result JSON file (default: none, printed only)")
    args = parser.parse_args(argv)
    try:
        args.model_args = json.loads(args.model_args)
    except json.JSONDecodeError as e:
        parser.error(f"--model-args must be a JSON object: {e}")
    if not isinstance(args.model_args, dict):
        parser.error("--model-args must be a JSON object")
    if args.compile_scope == "regions" and records_cuda_graphs(args.compile_mode):
        parser.error(f"--compile-scope regions cannot run under --compile-mode {args.compile_mode} (CUDA graphs: "
                     "a region called several times per step would replay over its own outputs)")
    problem = _options_problem(args)
    if problem:
        parser.error(problem)
    check_out(parser, args.out)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if not args.batch:
        args.batch = 384 if device.type == "cuda" else 16
    results = []
    for size in args.sizes:
        r = time_size(size, args, device)
        results.append(r)
        print(f"{size}: {r['dense_params']:,} params, batch {r['batch']}: {r['s_per_step'] * 1000:.1f} ms/step, "
              f"{rate(r['segments_per_s'])} segments/s, recipe ({r['recipe_segments']:,} segments) "
              f"~{r['projected_recipe_hours']:.2f} h; first {args.warmup} steps {r['warmup_seconds']:.1f} s", flush=True)
    from dstrain.bench import _portable  # no paths of this machine in a results file
    args_given = argv if argv is not None else sys.argv[1:]
    record = {"command": _portable("python benchmarks/hrm_speed.py " + " ".join(
                  "OUT" if x.startswith("/") else x for x in args_given)),  # no paths of this machine
              "options": {k: v for k, v in vars(args).items() if k not in ("out", "recipe")},
              "recipe": _portable(str(Path(args.recipe).resolve())), "machine": machine(device),
              "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _options_problem(args) -> str | None:
    """The first option that cannot run (an HRM size, a device, the recipe, the blanks a grid has), checked
    before the first size is timed; ``args.sizes`` becomes the list of sizes."""
    from models.hrm.sizes import SIZES
    args.sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown or not args.sizes:
        return f"--sizes {','.join(unknown) or repr('')}: not an HRM size; the sizes are {', '.join(SIZES)}"
    if args.device != "auto":
        try:
            dev = torch.device(args.device)
        except (RuntimeError, ValueError):
            return f"--device {args.device}: not a device (auto, cpu, cuda or cuda:N)"
        if dev.type == "cuda" and not torch.cuda.is_available():
            return f"--device {args.device}: torch sees no GPU here (use --device cpu or auto)"
        if dev.type not in ("cpu", "cuda"):
            return f"--device {args.device}: the benchmark runs on cpu or cuda"
    if args.blanks > sudoku.max_blanks(args.grid):
        return (f"--blanks {args.blanks}: a {args.grid}x{args.grid} puzzle with one solution has at most "
                f"{sudoku.max_blanks(args.grid)} blanks")
    try:
        recipe = json.loads(Path(args.recipe).read_text())
        recipe["train"]["steps"] * recipe["task"]["global_batch"]
    except OSError as err:
        return f"--recipe {args.recipe}: cannot read it ({err.strerror or err})"
    except ValueError as err:
        return f"--recipe {args.recipe}: not JSON ({err})"
    except (KeyError, TypeError):
        return f"--recipe {args.recipe}: not an HRM recipe (no train.steps and task.global_batch)"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
