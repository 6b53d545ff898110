"""A rank that sees only its own GPU, as ``srun --gpus-per-task=1`` starts task 3 of a node, trains on it
(tests/unit/test_gpu_binding.py checks the same with torch.cuda faked). Run where CUDA exists."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import child_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_slurm_task_3_with_its_own_gpu_trains_at_zero3(tmp_path):
    """ZeRO-3: DeepSpeed's engine, its trace checks and gathers all turn LOCAL_RANK into a device themselves.
    Before: "invalid device ordinal" (cuda:3 of one visible GPU)."""
    own = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    env = {k: v for k, v in child_env().items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                              "MASTER_PORT", "DSTRAIN_FAILURE_DIR")}
    env.update(SLURM_PROCID="0", SLURM_LOCALID="3", SLURM_NTASKS="1", SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_ID="4242", MASTER_ADDR="127.0.0.1", CUDA_VISIBLE_DEVICES=own)
    proc = subprocess.run(
        [sys.executable, "-m", "dstrain.cli", "train", "models/gpt/recipes/tiny.json", "--train.steps=4",
         "--train.log_every=1", "--deepspeed.profile=zero3", f"--output.dir={tmp_path}", "--output.progress=false",
         "--checkpoint.every=0", "--train.eval_every=0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 4
