"""Fault-injection round 12: the log window across a checkpoint for HRM and the policy-RL loop (GRPO, SCoRe), as
round 11 (``test_faults11.py``) did for the LM trainer.

* **HRM.** ``train/loss`` and the ACT metrics (accuracy, exact accuracy, halted fraction, Q losses, steps) are the
  sums of the steps since the last log, over the rows. A rank killed after the checkpoint of step 3 and before the
  log of step 4: before, the resumed run's step-4 record summed step 4 alone, where the uninterrupted run's summed
  steps 3 and 4 (step 3's metrics logged nowhere). After: a checkpoint carries the window's metric sums and
  per-step losses (``log_window`` in ``trainer_state.json``: ``{"sums": ..., "losses": [...]}``, each averaged
  over the ranks), the resumed run starts its window with them, and its step-4 record is the uninterrupted run's,
  bit-exact on one rank (the sums restored as the float32 tensors they were). ``segments_per_s`` counts only the
  steps this process timed (the carried ones took their time before the kill).
* **GRPO and SCoRe** (``rl_loop.RLLoop``). The window is a list of each step's metrics (reward, loss, KL, clip
  fraction, ``time/...``, the count and seconds behind ``gen_tokens_per_s``). Same gap, same fix: the checkpoint
  carries each step's metrics averaged over the ranks (``log_window``, a list of dicts); the trainer's resume
  passes its state to ``RLLoop.take_log_window``. Pinned below through ``RLLoop.run`` itself with a fake trainer:
  4 steps in one go against 3 steps, a checkpoint at 3, a crash in step 4, then ``--resume`` to 4; the step-4
  records of ``metrics.jsonl`` are equal to the bit. The run's time split (``summary.json``, the closing line)
  still covers only the steps the resumed process ran.

Run by hand on one CPU rank (``models/policy/recipes/grpo_debug.json``, warm start 150 steps, 8 generations,
micro-batch 16, ``train.log_every=4``, ``checkpoint.every=2``, one sandbox worker): 4 steps in one go against a kill
after step 2 (``DSTRAIN_FAULT_AFTER_STEP=2``) and ``--resume`` to 4. The final weights were already bit-exact; the
step-4 record was not: it averaged steps 3 and 4 (completion length 6.4375, reward 0.96875) where the
uninterrupted run's averaged steps 1 to 4 (7.84375, 0.984375). After: every record equal but the timings. The same
with dynamic sampling, its carry and rest table (``task.dynamic_sampling_carry``, ``dynamic_sampling_rest_steps=2``),
6 steps, a kill after step 3 and a resume from step 2: weights and records bit-exact but ``dynamic/refill_seconds``.
HRM likewise (``models/hrm/recipes/sudoku4_cpu.json``, 200 puzzles, global batch 16, ``task.ema=0.999``, 6 steps,
``train.log_every=4``, ``checkpoint.every=2``, a kill after step 3, a resume from step 2): the weights, the ACT
carry, the EMA and the puzzle embedding were already bit-exact at step 6; the step-4 record's ``train/loss`` was
1.98294 (steps 3 and 4) against 2.03333 (steps 1 to 4). After: every record equal but ``segments_per_s``.

An older checkpoint without ``log_window`` still resumes in each, its first window holding only the steps after it
(README says so).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dstrain.trainers import hrm, rl_loop


# ---------------------------------------------------------------- HRM

def _hrm(tmp_path, sums=None, losses=()):
    trainer = hrm.HRMTrainer.__new__(hrm.HRMTrainer)
    trainer.log_sums, trainer.log_losses = dict(sums or {}), list(losses)
    trainer.global_batch, trainer.device, trainer.ckpt_root = 4, torch.device("cpu"), tmp_path
    trainer.world = SimpleNamespace(rank=0, world_size=1, is_main=True)
    trainer.guards = SimpleNamespace(skipped=0, phase=lambda *a: None)
    trainer.puzzle_emb = trainer.ema = trainer.engine = None
    trainer.carry = {"halted": torch.ones(4, dtype=torch.bool)}
    return trainer


def _metrics(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps", "lm_loss", "q_halt_loss", "q_continue_loss")
    out = {k: (torch.rand((), generator=g) * 3).float() for k in keys}
    return {**out, "rows": torch.tensor(4.0), "count": torch.tensor(float(seed % 3 + 1))}


def _hrm_log(sums: dict, losses: list) -> dict:
    """What HRMTrainer.run logs from a window (one rank)."""
    values = {k: float(v) for k, v in sums.items()}
    losses = torch.stack(losses).double().cpu().tolist()
    return {**hrm.summarise(values), "loss": sum(losses) / len(losses)}


def _add(sums: dict, metrics: dict) -> dict:
    return {k: sums[k] + v if k in sums else v.clone() for k, v in metrics.items()}


def test_an_hrm_checkpoint_carries_the_window_and_the_resumed_log_is_the_uninterrupted_ones(tmp_path, monkeypatch):
    step3, step4 = _metrics(3), _metrics(4)
    loss3, loss4 = torch.tensor(1.2345678), torch.tensor(0.9876543)
    saved = {}
    trainer = _hrm(tmp_path, _add({}, step3), [loss3])
    trainer.saver = SimpleNamespace(save=lambda step, state, write: (saved.update(state), write(tmp_path / "t")))
    trainer.save(3)
    json.dumps(saved)  # trainer_state.json
    assert saved["log_window"]["losses"] == [float(loss3)] and saved["log_window"]["sums"]["count"] == 1.0

    tag = tmp_path / "step_00000003"
    (tag / "hrm").mkdir(parents=True)
    torch.save(trainer.carry, tag / "hrm" / "carry_rank_0.pt")
    monkeypatch.setattr(hrm, "carry_layout_problem", lambda *args: None)
    monkeypatch.setattr(hrm, "load_checkpoint", lambda *args: {"step": 3, **json.loads(json.dumps(saved))})
    resumed = _hrm(tmp_path)
    resumed._resume(tag.name)
    assert resumed.start_step == 3
    resumed.log_sums = _add(resumed.log_sums, step4)
    resumed.log_losses.append(loss4)
    uninterrupted = _hrm_log(_add(_add({}, step3), step4), [loss3, loss4])
    assert _hrm_log(resumed.log_sums, resumed.log_losses) == uninterrupted
    assert _hrm_log(_add({}, step4), [loss4]) != uninterrupted  # (what the resumed run logged before)


def test_an_older_hrm_checkpoint_without_the_window_resumes_with_an_empty_one(tmp_path, monkeypatch):
    tag = tmp_path / "step_00000003"
    (tag / "hrm").mkdir(parents=True)
    torch.save({"halted": torch.ones(4, dtype=torch.bool)}, tag / "hrm" / "carry_rank_0.pt")
    monkeypatch.setattr(hrm, "carry_layout_problem", lambda *args: None)
    monkeypatch.setattr(hrm, "load_checkpoint", lambda *args: {"step": 3, "global_batch": 4})
    resumed = _hrm(tmp_path, {"rows": torch.tensor(9.0)}, [torch.tensor(1.0)])
    resumed._resume(tag.name)
    assert resumed.log_sums == {} and resumed.log_losses == [] and resumed.start_step == 3
    assert hrm.hrm_window_state({}, []) == {}


# ---------------------------------------------------------------- the policy-RL loop (GRPO, SCoRe)

class _Crash(RuntimeError):
    pass


class _FakeRL(rl_loop.RLLoop):
    """RLLoop with deterministic steps, a checkpoint kept in memory and an optional crash."""
    RATES = {"gen_tokens_per_s": ("gen_tokens", "time/generation")}

    def __init__(self, out, steps, checkpoints, crash_at=None, resume=None):
        self.cfg = SimpleNamespace(train=SimpleNamespace(steps=steps, log_every=2, eval_every=0),
                                   output=SimpleNamespace(tensorboard=False, progress=False),
                                   checkpoint=SimpleNamespace(every=3))
        self.task, self.out, self.samples_per_step = SimpleNamespace(time_limit_s=0), out, 4
        self.world, self.stop, self.pool = SimpleNamespace(rank=0, world_size=1, is_main=True), \
            SimpleNamespace(set=False), SimpleNamespace(close=lambda: None)
        self.plan = SimpleNamespace(profile="fake", precision="fp32")
        self.guards = SimpleNamespace(begin=lambda *a: None, phase=lambda *a: None, stop_agreed=False, skipped=0,
                                      close=lambda: None, keep_last_good=lambda *a: None)
        self.saver = SimpleNamespace(wait=lambda: None)
        self.checkpoints, self.crash_at, self.start_step = checkpoints, crash_at, 0
        if resume is not None:
            state = json.loads(json.dumps(checkpoints[resume]))  # trainer_state.json
            self.start_step = state["step"]
            self.take_log_window(state)

    def one_step(self, step):
        if step + 1 == self.crash_at:
            raise _Crash(step)
        g = torch.Generator().manual_seed(step)
        r = torch.rand(4, generator=g).tolist()
        out = {"reward": r[0] / 3, "loss": r[1] * 0.7, "time/generation": r[2], "time/step": 1.0 + step,
               "gen_tokens": 100 + step}
        if step % 2:
            out["kl"] = r[3] / 7  # a key some steps have
        return out

    def save(self, step):
        self.checkpoints[step] = {"step": step, "log_window": rl_loop.window_state(self.window)}

    def evaluate(self, step):
        return {"pass_at_1": 0.5}

    def log_extras(self):
        return {"lr": 1e-6}

    def summary_extras(self):
        return {}


def _train_record(out, step):
    """The ``train/`` and ``time/`` records of ``step`` (the process's peak memory left out)."""
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if r.get("step") == step and not any(k.startswith("val/") for k in r)]
    assert len(records) == 2
    return {k: v for r in records for k, v in r.items() if k != "train/memory_gb"}


def test_the_rl_loop_resumed_after_a_crash_logs_the_uninterrupted_runs_step_4_record(tmp_path):
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    _FakeRL(whole, 4, {}).run()
    checkpoints = {}
    with pytest.raises(_Crash):
        _FakeRL(broken, 4, checkpoints, crash_at=4).run()
    assert list(checkpoints) == [3] and len(checkpoints[3]["log_window"]) == 1  # step 3, after the log of step 2
    summary = _FakeRL(broken, 4, checkpoints, resume=3).run()
    assert summary["time_split"]["step"]["seconds"] == 4.0  # step 4's only: step 3 ran in the crashed process
    resumed, uninterrupted = _train_record(broken, 4), _train_record(whole, 4)
    assert resumed == uninterrupted and "train/reward" in resumed and "train/gen_tokens_per_s" in resumed
    assert "time/generation" in resumed
    step4 = rl_loop.window_stats([_FakeRL(whole, 4, {}).one_step(3)], _FakeRL.RATES)
    assert resumed["train/reward"] != pytest.approx(step4["reward"])  # (what the resumed run logged before)


def test_an_older_rl_checkpoint_without_the_window_resumes_with_an_empty_one(tmp_path):
    trainer = _FakeRL(tmp_path, 4, {3: {"step": 3}}, resume=3)
    assert trainer.window == [] and rl_loop.window_state([]) == []
    assert rl_loop.window_state([{"a": 1.5, "b": 2}, {"a": 0.25}]) == [{"a": 1.5, "b": 2.0}, {"a": 0.25}]


def test_grpo_and_score_checkpoints_carry_the_window():
    from dstrain.trainers import grpo, score
    saved = {}
    g = grpo.GRPOTrainer.__new__(grpo.GRPOTrainer)
    g.samples_per_step, g.guards, g.keep_rate, g.prompt_rest, g.dynamic_reserve = 4, SimpleNamespace(skipped=0), \
        None, None, None
    g.saver, g.window = SimpleNamespace(save=lambda step, state, **kw: saved.update(grpo=state)), [{"reward": 0.5}]
    g.save(3)
    s = score.ScoreTrainer.__new__(score.ScoreTrainer)
    s.samples_per_step, s.guards, s._extra_engines = 4, SimpleNamespace(skipped=0), lambda: {}
    s.saver, s.window = SimpleNamespace(save=lambda step, state, **kw: saved.update(score=state)), [{"stage": 1.0}]
    s.save(3)
    assert saved["grpo"]["log_window"] == [{"reward": 0.5}] and saved["score"]["log_window"] == [{"stage": 1.0}]
