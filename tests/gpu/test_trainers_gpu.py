"""GRPO, SCoRe and HRM through `dstrain launch` on one GPU: each starts, trains a few steps on the GPU and
logs finite numbers. (On CPU the same runs are tests/dist; these catch what only a GPU machine shows:
device placement, NCCL collectives on host tensors, the sandbox run as root.)"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import child_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
POLICY = ["--task.warm_start_steps=10", "--task.n_train=64", "--task.n_eval=4", "--train.log_every=1",
          "--train.eval_every=0", "--checkpoint.every=0"]
RUNS = {
    "grpo": ("models/policy/recipes/grpo_debug.json", [*POLICY, "--task.eval_k=0", "--task.num_generations=4",
                                                       "--task.max_new_tokens=12"]),
    "score": ("models/policy/recipes/score_debug.json", [*POLICY, "--task.stage_one_steps=2",
                                                         "--task.guidance_every=2"]),
    "hrm": ("models/hrm/recipes/sudoku_debug.json", ["--model.size=tiny", "--task.train_puzzles=64",
                                                     "--task.eval_puzzles=32", "--task.global_batch=16",
                                                     "--train.log_every=1", "--train.eval_every=0",
                                                     "--checkpoint.every=0"]),
}


def launch(recipe: str, extra: list[str], out: Path, steps: int, env: dict | None = None):
    return subprocess.run(
        [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "1", recipe, *extra, f"--train.steps={steps}",
         f"--output.dir={out}", "--output.progress=false"],
        cwd=ROOT, env=child_env(env), capture_output=True, text=True,
        timeout=600)


@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_runs_on_one_gpu(name, tmp_path):
    recipe, extra = RUNS[name]
    proc = launch(recipe, extra, tmp_path, steps=3)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), rows
    assert (tmp_path / "summary.json").is_file()
    plan = (tmp_path / "plan.txt").read_text()
    assert f"hardware: {torch.cuda.get_device_name()}" in plan, plan  # planned for the GPU, not the CPU


def test_hrm_skips_a_nan_step_on_the_device_by_default(tmp_path):
    """``train.nonfinite_check=auto`` defers on CUDA: step 3's NaN gradients are left out on the device (fused
    AdamW's found_inf, the puzzle-embedding rows), the host counts the skip a step later, training goes on."""
    from dstrain import checkpoint as ckpt
    recipe, extra = RUNS["hrm"]
    extra = [e for e in extra if not e.startswith("--checkpoint.every")]
    proc = launch(recipe, [*extra, "--train.nonfinite=skip", "--checkpoint.every=1", "--checkpoint.keep=10"],
                  tmp_path, steps=4, env={"DSTRAIN_FAULT_RANK": "0", "DSTRAIN_FAULT_NAN_GRAD_STEP": "3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "non-finite gradient at step 3 on rank 0: update skipped" in proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["nonfinite_check"] == "deferred" and summary["skipped_steps"] == 1, summary
    root = tmp_path / "checkpoints"
    weights = {s: ckpt.consolidated_state_dict(root / ckpt.tag_for(s))[0] for s in (2, 3, 4)}
    assert all(torch.equal(weights[2][k], weights[3][k]) for k in weights[2])
    assert not all(torch.equal(weights[3][k], weights[4][k]) for k in weights[3])
    assert all(torch.isfinite(v).all() for v in weights[4].values())
