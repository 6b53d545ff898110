"""HRM through `dstrain launch` on 2 CPU ranks: loss falls, metrics reach TensorBoard, resume continues."""
import json
import os
import subprocess
import sys

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dstrain import checkpoint as ckpt
from tests.dist import harness

RECIPE = harness.ROOT / "models" / "hrm" / "recipes" / "sudoku_debug.json"
QUICK = ["--model.size=tiny", "--task.train_puzzles=64", "--task.eval_puzzles=32", "--task.global_batch=16",
         "--task.puzzle_ids=group", "--task.time_limit_s=0", "--task.puzzle_emb_lr=0.01", "--task.ema=0.9",
         "--train.lr=0.003", "--train.warmup_steps=5", "--train.log_every=5", "--train.eval_every=0",
         "--output.progress=false"]
TAGS = {f"train/{k}" for k in ("loss", "lm_loss", "accuracy", "exact_accuracy", "steps", "q_halt_accuracy",
                               "grad_norm", "puzzle_emb_lr")} | {"val/exact_accuracy", "val/accuracy", "val/loss",
                                                    "val/raw_exact_accuracy"}


def launch(out, steps, *extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(RECIPE), *QUICK,
           f"--train.steps={steps}", f"--output.dir={out}", *extra]
    proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_two_rank_hrm_run_learns_logs_and_resumes(tmp_path):
    out = tmp_path / "run"
    launch(out, 30, "--checkpoint.every=15")
    lm = harness.metrics(out, "train/lm_loss")
    assert sorted(lm) == [5, 10, 15, 20, 25, 30]
    assert lm[30] < lm[5] - 0.05, lm  # the per-sequence cross-entropy falls
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert TAGS <= set(events.Tags()["scalars"]), TAGS - set(events.Tags()["scalars"])
    assert ckpt.complete_tags(out / "checkpoints") == ["step_00000015", "step_00000030"]
    state = out / "checkpoints" / "step_00000030" / "hrm"
    assert {p.name for p in state.iterdir()} == {"carry_rank_0.pt", "carry_rank_1.pt", "puzzle_emb.pt", "ema.pt"}
    assert torch.load(state / "ema.pt", weights_only=True)["updates"] == 30
    carry = torch.load(state / "carry_rank_1.pt", weights_only=True)
    assert carry["z_H"].shape[0] == 8 and carry["inputs"].shape == (8, 81)  # 16 puzzles over 2 ranks
    table = torch.load(state / "puzzle_emb.pt", weights_only=True)["weight"]
    assert table.shape[0] == 65 and torch.all(table[0] == 0)  # id 0 (held-out puzzles) is never trained
    assert (table[1:].abs().sum(1) > 0).sum() > 16  # rows of the groups seen so far moved
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 16 and summary["val_loss"] > 0

    launch(out, 34, "--checkpoint.every=0", "--resume", "--task.data_workers=1")  # batches from a worker process
    assert max(harness.metrics(out, "train/loss")) == 34
    assert json.loads((out / "summary.json").read_text())["step"] == 34
    ema = torch.load(out / "checkpoints" / "step_00000034" / "hrm" / "ema.pt", weights_only=True)
    assert ema["updates"] == 34  # the average resumed from step 30's, not from the weights
