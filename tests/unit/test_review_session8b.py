"""Second review of the commits after 5a7c107 (newcomer audit 11, sandbox round 30, DeepSpeed configs round 24, HF
round 8, faults rounds 11-12, adversarial inputs).

Checked, no bug found:

* ``rl_loop.window_state`` (GRPO, SCoRe): every key of a step's metrics is the same on every rank (DAPO's
  ``carried_groups`` / ``spare_groups`` follow ``carry_limit``, a config value; ``time/weight_sync`` follows the
  weight push every rank joins, an empty rank included; SCoRe's guidance keys follow the step number), so the
  all-reduce has the same length everywhere; ``lm.window_state``'s early return follows the verdicts, which the
  deferred check reduces over the ranks; ``hrm_window_state``'s keys are the step's metrics on every rank.
* Saves from the non-finite stop path (``keep_last_good``): the window then holds steps up to the good one or
  steps whose verdict is 0 (dropped); NaN in ``trainer_state.json`` reads back with Python's json.
* The config loader: every recipe in ``models/*/recipes`` loads (no duplicate key, no 1/0 boolean, no layer field
  past the cap); no tracked run-config JSON has a duplicate key (only DeepSpeed-config fixtures do, on purpose).
* ``SandboxPool.run_many``: only jobs cut by the batch budget that timed out on the wall clock run again; a job that
  finished keeps its result. ``ValueHead.hidden_states``: rows go back to their own indices (``out[rows, p:]``).
* ``ds_check._grad_scaler_key`` only speaks on keys DeepSpeed's fp16 section rejects; ``_what_would_fit`` only
  re-estimates.

Fixed:

* **A resumed LM run's log window on a GPU.** ``LMTrainer._resume`` rebuilt the checkpoint's window (and a policy
  MoE's router-loss window) as CPU tensors, while each new step's loss is on the engine's device. A GPU run resumed
  and saved again before its next log (``checkpoint.every`` not a multiple of ``train.log_every``, or a stop)
  called ``window_state`` over both, whose ``torch.stack`` raised "Expected all tensors to be on the same device":
  the save failed. Now the restored tensors are on the engine's device.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from dstrain.trainers import lm


def _resumed_trainer(tmp_path, monkeypatch, saved: dict, device: torch.device):
    """An LMTrainer resumed (``_resume``) from a checkpoint whose trainer state is ``saved``, on an engine at
    ``device``."""
    tag = tmp_path / "step_00000003"
    tag.mkdir()
    (tag / "ds_config.json").write_text(json.dumps({"train_batch_size": 2}))
    monkeypatch.setattr(lm, "load_checkpoint", lambda *args: saved)
    monkeypatch.setattr(lm, "warn_batch_change", lambda *args, **kwargs: None)
    trainer = lm.LMTrainer.__new__(lm.LMTrainer)
    trainer.window, trainer.router_aux, trainer.data_start, trainer.dp_world = [], [], (0, 0), 1
    trainer.cfg = SimpleNamespace(train=SimpleNamespace(micro_batch=2, grad_accum=1, steps=6),
                                  data=SimpleNamespace(seq_len=32))
    trainer.guards = SimpleNamespace(skipped=0, phase=lambda *a: None)
    trainer.engine, trainer.ckpt_root, trainer.world = SimpleNamespace(device=device), tmp_path, None
    trainer.plan = SimpleNamespace(ds_config={"train_batch_size": 2})
    trainer._resume(tag.name)
    return trainer


def test_a_resumed_lm_window_lives_on_the_engines_device(tmp_path, monkeypatch):
    device = torch.device("meta")  # a device other than the CPU, as a GPU's (the losses of new steps are there)
    trainer = _resumed_trainer(tmp_path, monkeypatch, {"step": 3, "samples": 6, "log_window": [5.0, 4.5],
                                                       "router_aux_window": [0.25]}, device)
    assert [loss.device for loss, _ in trainer.window + trainer.router_aux] == [device] * 3
    # a new step's loss on that device stacks with them, as window_state does at the next save
    new = torch.tensor(4.0, device=device)
    assert torch.stack([loss for loss, _ in trainer.window] + [new]).shape == (3,)


def test_the_window_values_come_back_on_the_cpu(tmp_path, monkeypatch):
    """(The values themselves, on the CPU engine of a CPU run: the window a checkpoint carried.)"""
    trainer = _resumed_trainer(tmp_path, monkeypatch, {"step": 3, "samples": 6, "log_window": [5.0, 4.5]},
                               torch.device("cpu"))
    trainer.window.append((torch.tensor(4.0), None))
    assert lm.window_state(trainer.window) == [5.0, 4.5, 4.0]
