"""Resume on another world size: a checkpoint written by 2 ranks continues on 1 and on 4 ranks
(ZeRO-2 by default; ZeRO-3, stages 0 and 1 and 4 -> 2 with ``-m slow``), optimizer state
included, with the global batch kept (micro_batch x grad_accum x world = 8): the losses of the next
steps equal the uninterrupted 2-rank run's within 1e-5 relative (fp32).

The uninterrupted run is the shared 8-step reference (tests/dist/conftest.py ``gpt_reference``, a checkpoint
every 2 steps); the resumed runs continue from its step 6. Step 7's loss checks the weights; step 8's checks
the Adam moments and step count (a fresh optimizer would take a different step 7 update).
"""
import shutil

import pytest

from dstrain import checkpoint as ckpt
from tests.dist import harness

STEPS = harness.REFERENCE_STEPS
SAVED = STEPS - harness.REFERENCE_EVERY
BATCH = {1: ("--train.micro_batch=2", "--train.grad_accum=4"),
         2: ("--train.micro_batch=2", "--train.grad_accum=2"),  # (harness.QUICK's: the reference's batch)
         4: ("--train.micro_batch=2", "--train.grad_accum=1")}


def _skip_unless_slow(request):
    if "slow" in request.keywords and "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("slow: run with -m slow")


def _run(out, nproc, stage, *extra, resume=False):
    args = [*harness.reference_overrides(out, f"zero{stage}"), *BATCH[nproc], *extra]
    return harness.launch([*args, *(["--resume"] if resume else [])], nproc=nproc)


_reference_runs = {}


def _reference(gpt_reference, tmp_path_factory, stage, nproc):
    if nproc == 2:
        return gpt_reference(f"zero{stage}")
    if (stage, nproc) not in _reference_runs:
        out = tmp_path_factory.mktemp(f"ref_zero{stage}_{nproc}") / "run"
        _run(out, nproc, stage)
        _reference_runs[stage, nproc] = out
    return _reference_runs[stage, nproc]


CASES = [pytest.param(2, 2, 1, id="zero2-2to1"), pytest.param(2, 2, 4, id="zero2-2to4"),
         pytest.param(3, 2, 1, id="zero3-2to1", marks=pytest.mark.slow),  # (zero3 resume: test_resume_export.py)
         pytest.param(3, 2, 4, id="zero3-2to4", marks=pytest.mark.slow),
         pytest.param(0, 2, 1, id="zero0-2to1", marks=pytest.mark.slow),
         pytest.param(1, 2, 4, id="zero1-2to4", marks=pytest.mark.slow),
         pytest.param(1, 4, 2, id="zero1-4to2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("stage, saved_on, resumed_on", CASES)
def test_resume_on_another_world_size_matches_uninterrupted(request, gpt_reference, tmp_path_factory, tmp_path,
                                                            stage, saved_on, resumed_on):
    _skip_unless_slow(request)
    ref = _reference(gpt_reference, tmp_path_factory, stage, saved_on)
    out = tmp_path / "resumed"
    shutil.copytree(ref, out)  # (the reference is shared: read-only)
    (out / "metrics.jsonl").unlink()
    shutil.rmtree(out / "checkpoints" / ckpt.tag_for(STEPS))  # continue from step 6
    proc = _run(out, resumed_on, stage, resume=True)
    log = proc.stdout + proc.stderr
    assert f"written by {saved_on} ranks, this run has {resumed_on}" in log, log[-3000:]
    if stage > 0:
        assert "universal" in log and (out / "checkpoints" / ckpt.tag_for(SAVED) / "universal" / "CONVERTED").is_file()
    want, got = harness.metrics(ref), harness.metrics(out)
    assert sorted(got) == [SAVED + 1, STEPS]
    for step in (SAVED + 1, STEPS):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(STEPS)
