"""``torchrun --max-restarts 1`` run by hand, one rank sent SIGTERM after step 2 (a scheduler's stop reaching the
ranks; torchrun's agent does not see it). Every rank saves at step 3 and exits 143, which torchrun takes for a failure
and restarts. Before: the restart continued this job's checkpoint and trained to the end, exit 0: the stop was
undone without a word (a preempted job kept its node until the scheduler's SIGKILL, losing what it trained since).
After: the restarted ranks leave at once, saying the job was stopped (by which signal, at which step, the
checkpoint saved) and how to continue it; the stop's checkpoint stays the latest
(tests/unit/test_faults6.py has the details)."""
from dstrain import checkpoint as ckpt
from tests.dist import harness


def test_torchrun_restart_of_ranks_stopped_by_a_signal_does_not_train_on(tmp_path):
    out = tmp_path / "run"
    proc = harness.torchrun_restarting(harness.overrides(out, 6, "--checkpoint.every=100"),
                                      {"DSTRAIN_FAULT_SIGTERM_STEP": "2", "DSTRAIN_FAULT_RANK": "1",
                                       "DSTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    log = proc.stdout + proc.stderr
    assert (tmp_path / "fired").exists(), "the fault never fired"
    assert proc.returncode != 0, log[-4000:]
    assert ("torchrun restart 1: not training on: this job was stopped by SIGTERM at step 3 (checkpoint "
            "step_00000003 is saved)") in log, log[-4000:]
    assert "start the job again with --resume" in log
    assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(3)  # the stop's save (the signal came after step 2)
    assert max(harness.metrics(out)) == 3
