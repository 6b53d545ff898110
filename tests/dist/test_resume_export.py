"""Kill a run while it writes a checkpoint, resume it, and get the uninterrupted run's weights;
export any stage's checkpoint to safetensors that load into the plain model."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dstrain import checkpoint as ckpt
from dstrain.config import load_run_config
from tests.dist import harness
from tests.reference import build_model, plain_training, token_streams

STEPS, EVERY = harness.REFERENCE_STEPS, harness.REFERENCE_EVERY  # 8, 2


def _export(out, dest):
    """``dstrain export OUT DEST``; DEST is a .safetensors file or a folder that receives one."""
    from dstrain.cli import main
    assert main(["export", str(out), str(dest)]) == 0
    return load_file(str(dest if dest.suffix == ".safetensors" else dest / "model.safetensors"))


@pytest.mark.parametrize("profile", [pytest.param("zero1", marks=pytest.mark.slow), "zero3"])  # (suite time: zero3 by default)
def test_killed_during_save_then_resumed_equals_uninterrupted(profile, gpt_reference, tmp_path):
    broken = tmp_path / "broken"
    args = harness.reference_overrides(broken, profile)  # the uninterrupted run's (conftest.py gpt_reference)

    # Rank 0 dies after DeepSpeed wrote step 8's files but before the COMPLETE marker.
    with harness.beside(args, env={"DSTRAIN_FAULT_IN_SAVE": str(STEPS)}) as job:
        full = gpt_reference(profile)  # launched meanwhile unless another test already did
    proc = job.result(check=False)
    assert proc.returncode != 0
    root = broken / "checkpoints"
    assert (root / ckpt.tag_for(STEPS)).is_dir() and not ckpt.is_complete(root / ckpt.tag_for(STEPS))
    assert ckpt.find_latest(root) == ckpt.tag_for(STEPS - EVERY)

    proc = harness.launch([*args, "--resume"])
    assert "resumed from" in proc.stdout + proc.stderr
    assert ckpt.find_latest(root) == ckpt.tag_for(STEPS)

    a = _export(full, tmp_path / "full.safetensors")
    b = _export(broken, tmp_path / "broken.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    # The resumed half logged the same losses as the uninterrupted run.
    la, lb = harness.metrics(full), harness.metrics(broken)
    assert [lb[s] for s in range(STEPS - EVERY + 1, STEPS + 1)] == pytest.approx(
        [la[s] for s in range(STEPS - EVERY + 1, STEPS + 1)], rel=1e-6)


def test_zero3_export_loads_into_plain_model(gpt_reference, tmp_path):
    out = gpt_reference("zero3")  # 8 steps at ZeRO-3; its latest checkpoint is step 8's
    cfg = load_run_config(harness.RECIPE, harness.reference_overrides(out, "zero3"))
    state = _export(out, tmp_path / "export")

    model = build_model(cfg)
    model.load_state_dict(state, strict=True)
    # Same weights as plain PyTorch trained on the same data ...
    _, reference = plain_training(cfg, world_size=2, steps=STEPS)
    x = torch.arange(64).remainder(250).view(1, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-4)
    # ... and the same outputs as the DeepSpeed engine had: its final validation loss.
    _, val = token_streams(cfg)
    from dstrain.data.sampler import WindowSampler, get_batch
    sampler = WindowSampler(len(val), cfg.data.seq_len, cfg.data.seed)
    losses = []
    with torch.no_grad():
        for rank in range(2):
            idx = sampler.local_batch_indices(0, cfg.train.micro_batch, 1, rank, 2)[0]
            losses.append(model(*get_batch(val, idx, cfg.data.seq_len)).item())
    summary = json.loads((out / "summary.json").read_text())
    assert sum(losses) / 2 == pytest.approx(summary["val_loss"], rel=1e-5)
