"""Every ZeRO profile is the same mathematics: 2-rank losses equal a plain single-process run (ZeRO-1 and the two
partial offload profiles with ``-m slow``; zero3_offload, which offloads both, by default). The runs are the shared
8-step references (tests/dist/conftest.py ``gpt_reference``), also resumed, restarted and exported elsewhere."""
import json

import pytest

from tests.dist import harness
from tests.reference import plain_training

STEPS = harness.REFERENCE_STEPS  # 8
PROFILES = {  # profile -> (stage, offload_optimizer, offload_param)
    "zero0": (0, False, False), "zero1": (1, False, False), "zero2": (2, False, False),
    "zero2_offload": (2, True, False), "zero3": (3, False, False),
    "zero3_offload_optimizer": (3, True, False), "zero3_offload": (3, True, True),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = harness.run_config(tmp_path_factory.mktemp("ref"), STEPS)
    losses, norms, _ = plain_training(cfg, world_size=2, norms=True)
    return losses, norms


# zero3_offload (both offloads) runs by default. ZeRO-1 is DeepSpeed's ZeRO-2 optimizer class without gradient
# partitioning; in the default suite it trains as plain PyTorch in test_pipeline.py (pp 2 x dp 2) and takes
# DeepSpeed's own norm and first update in test_grad_clip.py, so its run here waits for -m slow (suite time).
SLOW = ("zero1", "zero2_offload", "zero3_offload_optimizer")


@pytest.mark.parametrize("profile", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p for p in PROFILES])
def test_profile_matches_plain_pytorch(profile, reference, gpt_reference, request):
    # The profiles of this test that run in this session (not deselected, not skipped as slow): the next one's
    # run is launched beside this one's.
    chosen = [item.callspec.params["profile"] for item in request.session.items
              if item.originalname == request.node.originalname and item.module is request.module
              and not item.get_closest_marker("skip")]
    out = gpt_reference(profile, *chosen[chosen.index(profile) + 1 if profile in chosen else len(chosen):])
    ds = json.loads((out / "ds_config.json").read_text())
    zero = ds["zero_optimization"]
    stage, off_opt, off_param = PROFILES[profile]
    assert zero["stage"] == stage
    assert ("offload_optimizer" in zero) == off_opt and ("offload_param" in zero) == off_param
    assert ds["train_batch_size"] == 2 * 2 * 2
    ref_losses, ref_norms = reference
    losses = harness.metrics(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    got = [losses[s] for s in range(1, STEPS + 1)]
    # Same maths; only summation order and Adam kernels differ. The logged loss is the mean
    # over both ranks (rank 0's own loss would not match the global batch).
    assert got == pytest.approx(ref_losses, rel=2e-5, abs=2e-5), (got, ref_losses)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # and it learns, so the comparison means something
    norms = harness.metrics(out, "train/grad_norm")
    got_norms = [norms[s] for s in range(1, STEPS + 1)]
    assert got_norms == pytest.approx(ref_norms, rel=1e-4), (got_norms, ref_norms)
