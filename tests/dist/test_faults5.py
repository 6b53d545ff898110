"""``torchrun --max-restarts 1`` run by hand (its own agent restarts the ranks; no ``--resume`` on the command
line): rank 0 dies after step 3 with step 2's checkpoint on disk. Before: each restart failed (rank 0 of the
new attempt read its dead peers' addresses from the agent's store: gloo 'Connection refused'; past that, the
folder was refused for holding the first attempt's checkpoint, exit 2) and torchrun gave up. After: the
restart continues from step 2 and the job finishes (tests/unit/test_faults5.py has the details)."""
from dstrain import checkpoint as ckpt
from tests.dist import harness


def test_torchruns_own_restart_continues_the_jobs_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = harness.torchrun_restarting(harness.overrides(out, 4, "--checkpoint.every=2"),
                                      {"DSTRAIN_FAULT_AFTER_STEP": "3", "DSTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    log = proc.stdout + proc.stderr
    assert (tmp_path / "fired").exists(), "the fault never fired"
    assert proc.returncode == 0, log[-4000:]
    assert "torchrun restart 1: continuing this job's checkpoint step_00000002" in log, log[-4000:]
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'} at step 2" in log
    assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(4)
    assert sorted(harness.metrics(out)) == [1, 2, 3, 4]
