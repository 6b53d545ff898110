"""Fault-injection round 11: a run stopped and resumed from a checkpoint against the same run uninterrupted, per
trainer, on one CPU rank. Each case was run by hand (GPT tiny, ``data.seq_len`` 32, micro-batch 2, 6 steps,
``train.log_every=2``, ``checkpoint.every=3``): 6 steps in one go; 3 steps then a stop (``train.steps=3``, or a kill
after step 3, ``DSTRAIN_FAULT_AFTER_STEP=3``), ``--resume`` to 6; the
final weights and every ``metrics.jsonl`` record after step 3 compared. The weights, the optimizer, the schedule
(dstrain's warm-up + cosine, a user's JSON with ``WarmupDecayLR``), the data position and the RNG were already
restored bit-exact, with ``checkpoint.async_write`` too (the host copy and RNG are taken before training goes on).
Compare with ``deepspeed.precision`` pinned: on a CPU, ``auto`` measures bf16's matmul speed, and two fresh runs on a
busy machine chose differently (bf16 measured 1.31x fp32: fp32; 1.60x: bf16); a resume keeps the checkpoint's (README).

* **The log window across a checkpoint** (the LM trainer: GPT, the dilated LM, SFT). ``train/loss`` is the mean
  over the steps since the last log. A rank killed after the checkpoint of step 3 and before the log of step 4
  (a crash, a lost node, ``--max-restarts``): before, the resumed run's step-4 record averaged step 4 alone
  (4.7797) where the uninterrupted run's averaged steps 3 and 4 (4.9690), the step-3 loss logged nowhere. After:
  a checkpoint carries the losses of the steps since the last log (``log_window`` in ``trainer_state.json``, each
  averaged over the ranks), the resumed run starts its window with them, and its step-4 record is the
  uninterrupted run's, bit-exact on one rank (within float rounding on several). An older checkpoint without
  ``log_window`` still resumes, its first window holding only the steps after it (README says so). A run that
  ends or stops at the checkpoint's step logs that step first (its window is then empty): each step's loss is in
  exactly one record, as before.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from dstrain.trainers import lm


def _trainer(tmp_path, window=()):
    trainer = lm.LMTrainer.__new__(lm.LMTrainer)
    trainer.window, trainer.router_aux = list(window), []
    trainer.data_start, trainer.dp_world = (0, 0), 1
    trainer.cfg = SimpleNamespace(train=SimpleNamespace(micro_batch=2, grad_accum=1, steps=6),
                                  data=SimpleNamespace(seq_len=32))
    trainer.guards = SimpleNamespace(skipped=0, phase=lambda *a: None)
    trainer.engine, trainer.ckpt_root = SimpleNamespace(device=torch.device("cpu")), tmp_path
    trainer.world = SimpleNamespace(is_main=True)
    return trainer


def test_a_checkpoint_carries_the_steps_since_the_last_log_and_a_resume_starts_its_window_with_them(
        tmp_path, monkeypatch):
    """Step 3 (5.158182621002197) trained after the log of step 2, then the checkpoint of step 3: the resumed
    run's log of step 4 averages steps 3 and 4, as the uninterrupted run's does, to the bit."""
    step3, step4 = torch.tensor(5.158182621002197), torch.tensor(4.779717445373535)
    saved = {}
    trainer = _trainer(tmp_path, [(step3, None), (torch.tensor(float("nan")), torch.tensor(0.0))])  # (dropped)
    trainer.router_aux = [(torch.tensor(0.25), None)]  # a policy MoE's load-balancing loss, the same way
    trainer.saver = SimpleNamespace(save=lambda step, state: saved.update(state))
    trainer.save(3)
    assert saved["log_window"] == [float(step3)] and saved["samples"] == 6 and saved["router_aux_window"] == [0.25]
    json.dumps(saved)  # trainer_state.json

    tag = tmp_path / "step_00000003"
    tag.mkdir()
    (tag / "ds_config.json").write_text(json.dumps({"train_batch_size": 2}))
    monkeypatch.setattr(lm, "load_checkpoint", lambda *args: {"step": 3, **json.loads(json.dumps(saved))})
    monkeypatch.setattr(lm, "warn_batch_change", lambda *args, **kwargs: None)
    resumed = _trainer(tmp_path)
    resumed.plan = SimpleNamespace(ds_config={"train_batch_size": 2})
    resumed._resume(tag.name)
    assert lm.mean_of_taken(resumed.router_aux, "router_aux_loss") == {"router_aux_loss": 0.25}
    resumed.window.append((step4, None))
    uninterrupted = lm.mean_of_taken([(step3, None), (step4, None)])
    assert lm.mean_of_taken(resumed.window) == uninterrupted
    assert uninterrupted["loss"] != float(step4)  # (what the resumed run logged before)


def test_an_older_checkpoint_without_the_window_resumes_with_an_empty_one(tmp_path, monkeypatch):
    tag = tmp_path / "step_00000003"
    tag.mkdir()
    (tag / "ds_config.json").write_text(json.dumps({"train_batch_size": 2}))
    monkeypatch.setattr(lm, "load_checkpoint", lambda *args: {"step": 3, "samples": 6})
    monkeypatch.setattr(lm, "warn_batch_change", lambda *args, **kwargs: None)
    resumed = _trainer(tmp_path)
    resumed.plan = SimpleNamespace(ds_config={"train_batch_size": 2})
    resumed._resume(tag.name)
    assert resumed.window == resumed.router_aux == [] and resumed.data_start == (3, 6)


def test_a_window_of_steps_all_dropped_or_empty_saves_nothing():
    assert lm.window_state([]) == []
    assert lm.window_state([(torch.tensor(float("inf")), torch.tensor(0.0))]) == []
