"""GPU checks: run where CUDA exists (a lent H100/H200), skipped elsewhere."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import child_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def test_factory_picks_bf16_on_ampere_or_later():
    from dstrain.engine.hardware import detect_hardware
    from dstrain.engine.profiles import choose_precision
    hw, _ = detect_hardware()
    major, _ = torch.cuda.get_device_capability()
    assert choose_precision(hw)[0] == ("bf16" if major >= 8 else "fp16")


@pytest.mark.parametrize("profile", ["auto", "zero3"])
def test_gpu_training_learns(profile, tmp_path):
    nproc = min(2, torch.cuda.device_count())
    proc = subprocess.run(
        [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(nproc),
         "models/gpt/recipes/tiny.json", "--train.steps=60", "--train.log_every=10",
         f"--deepspeed.profile={profile}", f"--output.dir={tmp_path}", "--output.progress=false"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(l)["train/loss"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in l]
    assert losses[-1] < losses[0] - 1.0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] in ("bf16", "fp16")
