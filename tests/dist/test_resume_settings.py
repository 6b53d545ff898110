"""A run resumed with ``train.lr`` and ``train.weight_decay`` changed trains with them, through DeepSpeed's own
ZeRO-2 checkpoint loading on 2 ranks (``dstrain.engine.resume_settings``; the unit tests in
``tests/unit/test_faults_round3.py`` use a stand-in for DeepSpeed). Before, the resumed steps ran at the
checkpoint's rate."""
import pytest

from dstrain.config import load_run_config
from dstrain.engine.factory import WarmupCosine
from tests.dist import harness


@pytest.mark.slow
def test_a_resume_with_a_lower_learning_rate_trains_at_it(tmp_path):
    out = tmp_path / "run"
    extra = ("--deepspeed.profile=zero2", "--checkpoint.every=2")
    harness.launch(harness.overrides(out, 4, *extra))
    proc = harness.launch([*harness.overrides(out, 6, *extra, "--train.lr=0.0005", "--train.weight_decay=0.05"),
                           "--resume"])
    assert "train.lr 0.002 -> 0.0005, train.weight_decay 0.1 -> 0.05" in proc.stdout, proc.stdout[-3000:]
    t = load_run_config(str(harness.RECIPE), harness.overrides(out, 6)).train
    schedule = WarmupCosine(t.warmup_steps, 6, t.min_lr_ratio)
    lr = harness.metrics(out, "train/lr")
    for step in (5, 6):
        assert lr[step] == pytest.approx(0.0005 * schedule(step), rel=1e-9), (step, lr)
