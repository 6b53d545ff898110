"""Pipeline parallelism (DeepSpeed's pipeline engine, 1F1B) is the plain model's mathematics.

pp = 2 and pp = 2 x dp = 2 runs log the losses and gradient norms of one plain PyTorch
process trained on the same global batches; a pipeline checkpoint exports to the
plain model's weights (same logits as the plain run) and resumes to the same losses.
"""
import json

import pytest
import torch

from dstrain import checkpoint as ckpt
from dstrain.data.sampler import WindowSampler, get_batch
from tests.dist import harness
from tests.reference import build_model, plain_training, token_streams

STEPS = 4


def _steps(values):
    return [values[s] for s in range(1, STEPS + 1)]


def test_pp2_matches_plain_exports_and_resumes(tmp_path):
    out = tmp_path / "run"
    extra = ("--parallel.pp=2", "--checkpoint.every=2", "--checkpoint.keep=3")
    harness.launch(harness.overrides(out, STEPS, *extra))
    assert "pipeline: 2 stages x dp 1" in (out / "plan.txt").read_text()
    cfg = harness.run_config(out, STEPS, *extra)
    ref_losses, ref_norms, reference = plain_training(cfg, world_size=1, norms=True)
    assert _steps(harness.metrics(out)) == pytest.approx(ref_losses, rel=2e-5, abs=2e-5)
    assert _steps(harness.metrics(out, "train/grad_norm")) == pytest.approx(ref_norms, rel=1e-4)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learns, so equal losses mean something

    # Export: layer_XX files -> the plain model's names; same logits as the plain run.
    tag_dir = out / "checkpoints" / ckpt.tag_for(STEPS)
    assert max(p.name for p in tag_dir.glob("layer_*-model_states.pt")) == "layer_05-model_states.pt"
    state, _ = ckpt.consolidated_state_dict(out)
    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
    x = torch.arange(64).remainder(250).view(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-4)
    # ... and the pipeline engine's own evaluation (eval_batch) of the same weights.
    _, val = token_streams(cfg)
    idx = WindowSampler(len(val), cfg.data.seq_len, cfg.data.seed).local_batch_indices(
        0, cfg.train.micro_batch, 1, 0, 1)[0]
    with torch.no_grad():
        plain_val = model(*get_batch(val, idx, cfg.data.seq_len)).item()
    assert json.loads((out / "summary.json").read_text())["val_loss"] == pytest.approx(plain_val, rel=1e-5)

    # Resume through the pipeline engine: drop step 4's marker, continue from step 2.
    (tag_dir / ckpt.COMPLETE).unlink()
    proc = harness.launch([*harness.overrides(out, STEPS, *extra), "--resume"])
    assert "resumed from" in proc.stdout + proc.stderr
    resumed = harness.metrics(out)
    assert [resumed[3], resumed[4]] == pytest.approx(ref_losses[2:], rel=2e-5, abs=2e-5)
    again, _ = ckpt.consolidated_state_dict(out)
    for name in state:
        torch.testing.assert_close(again[name], state[name], rtol=0, atol=1e-6, msg=name)


def test_pp2_dp2_zero1_matches_plain(tmp_path):
    out = tmp_path / "run"
    extra = ("--parallel.pp=2", "--deepspeed.profile=zero1", "--checkpoint.every=0")
    harness.launch(harness.overrides(out, STEPS, *extra), nproc=4)
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 1 and ds["train_batch_size"] == 2 * 2 * 2
    assert "pipeline: 2 stages x dp 2" in (out / "plan.txt").read_text()
    cfg = harness.run_config(out, STEPS, *extra)
    ref_losses, ref_norms, _ = plain_training(cfg, world_size=2, norms=True)
    assert _steps(harness.metrics(out)) == pytest.approx(ref_losses, rel=2e-5, abs=2e-5)
    assert _steps(harness.metrics(out, "train/grad_norm")) == pytest.approx(ref_norms, rel=1e-4)
