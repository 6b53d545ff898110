"""``dstrain launch --max-restarts``: a rank dies at a random step, the job restarts from the latest
complete checkpoint on its own, and ends with the uninterrupted run's weights (fp32, CPU, 1e-6); the
faulty run writes its checkpoints asynchronously (``checkpoint.async_write``), the reference
synchronously. A rank that hangs is ended by the watchdog, which names rank, phase and step, and
the job is restarted the same way."""
import random
import re

import torch
from safetensors.torch import load_file

from dstrain import checkpoint as ckpt
from tests.dist import harness

STEPS, EVERY = harness.REFERENCE_STEPS, harness.REFERENCE_EVERY  # 8, 2


def _export(out, dest):
    from dstrain.cli import main
    assert main(["export", str(out), str(dest)]) == 0
    return load_file(str(dest))


def test_killed_rank_restarts_from_checkpoint_and_matches_uninterrupted(tmp_path, gpt_reference):
    faulty = tmp_path / "faulty"
    step = random.Random().randint(EVERY + 1, STEPS - 1)  # after a checkpoint, before the end
    rank = random.Random().randint(0, 1)
    with harness.beside([*harness.reference_overrides(faulty, "zero2"), "--checkpoint.async_write=true",
                         "--max-restarts", "2"],
                        env={"DSTRAIN_FAULT_AFTER_STEP": str(step), "DSTRAIN_FAULT_RANK": str(rank),
                             "DSTRAIN_FAULT_ONCE": str(tmp_path / "fired")}) as job:
        full = gpt_reference("zero2")  # the uninterrupted run (shared, conftest.py), launched meanwhile if not yet
    proc = job.result()
    assert (tmp_path / "fired").exists(), "the fault never fired"
    log = proc.stdout + proc.stderr
    assert "restart 1/2 from checkpoint" in log and "restart 2/2" not in log, log[-3000:]
    assert ckpt.find_latest(faulty / "checkpoints") == ckpt.tag_for(STEPS)

    a, b = _export(full, tmp_path / "a.safetensors"), _export(faulty, tmp_path / "b.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


def test_without_restarts_the_failure_is_the_exit_status(rank_killed_after_step_3):
    _, proc = rank_killed_after_step_3  # rank 0 killed after step 3, step 2's checkpoint on disk (conftest.py)
    assert proc.returncode != 0 and "job failed" not in proc.stdout + proc.stderr  # no restart attempted


def test_hung_rank_is_reported_and_restarted(tmp_path):
    out = tmp_path / "run"
    # The watchdog's timeout (torch's own: 15 s) only has to outlast this job's longest normal phase: its
    # steps, saves and evals take well under a second, the ranks' rendezvous a few (compile is off on the CPU).
    args = harness.overrides(out, 4, "--deepspeed.profile=zero2", "--checkpoint.every=2",
                             "--train.collective_timeout_s=10")
    proc = harness.launch([*args, "--max-restarts", "1"],
                          env={"DSTRAIN_FAULT_HANG_STEP": "3", "DSTRAIN_FAULT_RANK": "1",
                               "DSTRAIN_FAULT_ONCE": str(tmp_path / "fired")})
    log = proc.stdout + proc.stderr
    assert (tmp_path / "fired").exists(), "the hang never started"
    assert re.search(r"hang: rank [01] waited \d+s in (forward|backward|allreduce|step) of step 3", log), log[-3000:]
    assert "restart 1/1 from checkpoint step_00000002" in log, log[-3000:]
    assert ckpt.find_latest(out / "checkpoints") == ckpt.tag_for(4)
