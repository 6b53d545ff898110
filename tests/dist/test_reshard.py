"""Resume on another world size: a checkpoint written by 2 ranks continues on 1 and on 4 ranks
(ZeRO-2 and ZeRO-3 by default; stages 0 and 1 and 4 -> 2 with ``-m slow``), optimizer state
included, with the global batch kept (micro_batch x grad_accum x world = 8): the losses of the next
steps equal the uninterrupted 2-rank run's within 1e-5 relative (fp32).

Step 3's loss checks the weights; step 4's checks the Adam moments and step count (a fresh
optimizer would take a different step 3 update).
"""
import shutil

import pytest

from dstrain import checkpoint as ckpt
from tests.dist import harness

STEPS, SAVED = 4, 2
BATCH = {1: ("--train.micro_batch=2", "--train.grad_accum=4"),
         2: ("--train.micro_batch=2", "--train.grad_accum=2"),
         4: ("--train.micro_batch=2", "--train.grad_accum=1")}


def _skip_unless_slow(request):
    if "slow" in request.keywords and "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow: run with -m slow")


def _run(out, nproc, stage, *extra, resume=False):
    args = [*harness.overrides(out, STEPS, *BATCH[nproc], f"--deepspeed.profile=zero{stage}",
                               f"--checkpoint.every={SAVED}", "--checkpoint.keep=4", *extra)]
    return harness.launch([*args, *(["--resume"] if resume else [])], nproc=nproc)


_reference_runs = {}


def _reference(tmp_path_factory, stage, nproc):
    key = (stage, nproc)
    if key not in _reference_runs:
        out = tmp_path_factory.mktemp(f"ref_zero{stage}_{nproc}")
        _run(out, nproc, stage)
        _reference_runs[key] = out
    return _reference_runs[key]


CASES = [pytest.param(2, 2, 1, id="zero2-2to1"), pytest.param(2, 2, 4, id="zero2-2to4"),
         pytest.param(3, 2, 1, id="zero3-2to1", marks=pytest.mark.slow),  # (zero3 resume: test_resume_export.py)
         pytest.param(3, 2, 4, id="zero3-2to4", marks=pytest.mark.slow),
         pytest.param(0, 2, 1, id="zero0-2to1", marks=pytest.mark.slow),
         pytest.param(1, 2, 4, id="zero1-2to4", marks=pytest.mark.slow),
         pytest.param(1, 4, 2, id="zero1-4to2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("stage, saved_on, resumed_on", CASES)
def test_resume_on_another_world_size_matches_uninterrupted(request, tmp_path_factory, tmp_path, stage, saved_on,
                                                            resumed_on):
    _skip_unless_slow(request)
    ref = _reference(tmp_path_factory, stage, saved_on)
    out = tmp_path / "resumed"
    shutil.copytree(ref, out)
    (out / "metrics.jsonl").unlink()
    shutil.rmtree(out / "checkpoints" / ckpt.tag_for(STEPS))  # continue from step 2
    proc = _run(out, resumed_on, stage, resume=True)
    log = proc.stdout + proc.stderr
    assert f"written by {saved_on} ranks, this run has {resumed_on}" in log, log[-3000:]
    if stage > 0:
        assert "universal" in log and (out / "checkpoints" / ckpt.tag_for(SAVED) / "universal" / "CONVERTED").is_file()
    want, got = harness.metrics(ref), harness.metrics(out)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(STEPS)
