"""``train.nonfinite`` on 2 ranks, with a NaN loss injected on rank 1 at step 3 (DSTRAIN_FAULT_NAN_STEP)
in the LM trainer, plain and with two pipeline stages.

skip: every rank drops step 3's update (checkpoint 3 holds exactly checkpoint 2's weights, step 4
moves on) and ``train/skipped_steps`` counts it. stop: the job exits 3 with one line naming step 3
and rank 1, leaving checkpoint 2 (the last good state, equal to the skip run's) as the latest.
"""
import torch

from dstrain import checkpoint as ckpt
from tests.dist import harness

NAN_AT = {"DSTRAIN_FAULT_NAN_STEP": "3", "DSTRAIN_FAULT_RANK": "1"}


def _weights(tag_dir):
    return ckpt.consolidated_state_dict(tag_dir)[0]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nan_on_one_rank_skip_then_stop(tmp_path):
    extra = ("--deepspeed.profile=zero2", "--checkpoint.every=1", "--checkpoint.keep=10")
    skip, stop = tmp_path / "skip", tmp_path / "stop"
    with harness.beside(harness.overrides(stop, 4, "--deepspeed.profile=zero2", "--checkpoint.every=0",
                                          "--train.nonfinite=stop"), env=NAN_AT) as stopping:  # (independent)
        proc = harness.launch([*harness.overrides(skip, 4, *extra, "--train.nonfinite=skip")], env=NAN_AT)
    assert "non-finite loss at step 3 on rank 1: update skipped" in proc.stdout + proc.stderr
    skipped = harness.metrics(skip, "train/skipped_steps")
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 1}, skipped
    losses = harness.metrics(skip)
    assert all(torch.isfinite(torch.tensor(v)) for s, v in losses.items() if s != 3)
    root = skip / "checkpoints"
    w2, w3, w4 = (_weights(root / ckpt.tag_for(s)) for s in (2, 3, 4))
    assert _same(w2, w3), "the skipped step changed the weights"
    assert not _same(w3, w4) and all(torch.isfinite(v).all() for v in w4.values())

    proc = stopping.result(check=False)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dstrain: error:")]
    assert len(lines) == 1 and "non-finite loss at step 3 on rank 1: stopped" in lines[0], proc.stderr[-3000:]
    assert "job failed" not in proc.stderr  # no restart for a numerical stop
    assert ckpt.find_latest(stop / "checkpoints") == ckpt.tag_for(2)
    assert _same(_weights(stop / "checkpoints" / ckpt.tag_for(2)), w2)


def test_alone_under_the_deferred_check_stop_saves_the_bad_step_with_its_update_left_out(tmp_path):
    """One process, fused AdamW, ``train.nonfinite_check=deferred``: step 3's NaN loss reaches the optimizer as
    ``found_inf`` (its update is left out on the device); the host reads the verdict at step 4's optimizer
    step and stops.
    The bad step's own state is good and is the checkpoint kept: step 3, holding step 2's weights."""
    out = tmp_path / "stop"
    proc = harness.launch([*harness.overrides(out, 5, "--deepspeed.profile=zero0", "--checkpoint.every=2",
                                              "--train.log_every=5", "--train.nonfinite=stop",
                                              "--train.optimizer=torch_fused", "--train.nonfinite_check=deferred")],
                          env={**NAN_AT, "DSTRAIN_FAULT_RANK": "0"}, nproc=1, check=False)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dstrain: error:")]
    assert len(lines) == 1 and "non-finite loss at step 3 on rank 0: stopped" in lines[0], proc.stderr[-3000:]
    root = out / "checkpoints"
    assert ckpt.complete_tags(root) == [ckpt.tag_for(2), ckpt.tag_for(3)]
    assert _same(_weights(root / ckpt.tag_for(2)), _weights(root / ckpt.tag_for(3)))
    assert "train/loss" not in (out / "metrics.jsonl").read_text()  # stopped before its first log step (5)


def test_pipeline_stages_skip_together(tmp_path):
    """pp=2: the last stage (rank 1) holds the loss, both stages their gradients; the check runs inside
    DeepSpeed's train_batch, before its optimizer step. Checkpoints written in the background."""
    out = tmp_path / "pp"
    extra = ("--parallel.pp=2", "--checkpoint.every=1", "--checkpoint.keep=10", "--checkpoint.async_write=true",
             "--train.nonfinite=skip")
    proc = harness.launch(harness.overrides(out, 4, *extra), env=NAN_AT)
    assert "non-finite loss at step 3 on rank 1: update skipped" in proc.stdout + proc.stderr
    assert harness.metrics(out, "train/skipped_steps") == {1: 0, 2: 0, 3: 1, 4: 1}
    root = out / "checkpoints"
    w2, w3, w4 = (_weights(root / ckpt.tag_for(s)) for s in (2, 3, 4))
    assert _same(w2, w3) and not _same(w3, w4)
    assert all(torch.isfinite(v).all() for v in w4.values())
