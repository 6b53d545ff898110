"""GPU readiness, round 2: the commits since the last GPU session, read for what only a GPU machine would show.

Found and fixed (checked here with a stand-in device clock; passes on a GPU machine too):

* The LM trainer's tokens/s left evaluations and checkpoint saves out of its window (``Throughput.exclude``) by
  timing them from the host's clock. On a GPU the host runs ahead of the kernels (the deferred non-finite check
  waits for nothing), so when an evaluation or a save began the step's kernels were still running, and the
  evaluation's first loss read (or the save's first copy) waited for them inside the span set aside: each
  evaluation or save off a log step took a step's device time out of the window, and the logged tokens/s and
  MFU came out too high (on the CPU every kernel is done when the host moves on, so tests saw nothing). Now the
  device's queued work is waited for before the aside starts (``metrics.wait_for_device``), only on steps that
  evaluate or save: other steps still never wait. The HRM trainer's segments/s had the same flaw, fixed alike.

* The LM trainer kept each micro-batch's MoE router aux loss (the tensor the policy's forward leaves on the
  module) to average at the log step. A CUDA (``auto``) run compiles the model, and under ``compile_mode``
  ``reduce-overhead`` (CUDA graphs) that tensor lives in the graph's memory: the next micro-batch's replay
  overwrote it (or torch refused to read it), so the logged ``router_aux_loss`` was the last micro-batch's, not
  the mean (the engine copies only the forward's return value). Now a copy is kept.
  The same for GRPO's and SCoRe's ``take_router_aux`` (SCoRe runs both turns' forwards before adding their
  two losses): it now hands back a copy (differentiable).

Read and found fine (no change): the MoE router aux loss in the policy forward (cast to fp32 before it is added
to the fp32 cross-entropy, on the logits' device), in the LM trainer (kept on the device, one read per log) and
in GRPO / SCoRe (read with ``.item()`` beside the loss read those loops already had); ``mean_of_taken`` (verdicts
moved to the loss's device); the window rates (``window_stats``, host floats); the DAPO carry (stored
log-probabilities brought back to the CPU, moved to the engine's device with the batch, ``with_stored`` on one
device); ``supervised_batch``'s attention mask (the warm start's model is built on the CPU); ``to_device``;
``all_reduce`` of host tensors under NCCL; HRM's fp32 rotary tables and initial states under a 16-bit
``zero.Init``; ``merge_attention``'s ``where``; ``ranks_use_cuda`` in peak FLOP/s, peak memory, RNG state and
plans; the GPU tests (``tests/gpu``: skipped without CUDA, ``child_env`` leaves ``DS_ACCELERATOR`` out of the
runs they launch; head dim 256 added to the lse-gradient test, which the kernel choice now serves).
"""
from __future__ import annotations

import time
import types

import pytest
import torch

from dstrain import metrics
from dstrain.trainers import lm


class _DeviceClock:
    """A GPU's queue, simulated: a step queues ``step_s`` of kernels and returns at once; a sync waits for them."""

    def __init__(self, step_s: float):
        self.step_s, self.queued, self.syncs = step_s, 0.0, []

    def queue(self):
        self.queued += self.step_s

    def synchronize(self, device=None):
        self.syncs.append(str(device))
        time.sleep(self.queued)
        self.queued = 0.0


def _trainer(tmp_path, clock, steps, log_every, eval_every, save_every):
    """An LMTrainer whose engine is on "cuda:0" and whose steps, evaluation and save run on ``clock``."""
    tr = object.__new__(lm.LMTrainer)
    tr.cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(steps=steps, log_every=log_every, eval_every=eval_every),
        checkpoint=types.SimpleNamespace(every=save_every), tokens_per_step=1000,
        output=types.SimpleNamespace(tensorboard=False, progress=False))
    tr.out, tr.start_step, tr.flops_per_token, tr.dp_world, tr.router_aux = tmp_path, 0, 6.0, 1, []
    tr.world = types.SimpleNamespace(rank=0, is_main=True, world_size=1)
    tr.plan = types.SimpleNamespace(profile="zero0", precision="fp32")
    tr.stop = types.SimpleNamespace(set=False)
    tr.guards = types.SimpleNamespace(settle=lambda *a: None, phase=lambda *a: None, close=lambda: None,
                                      stop_agreed=False, skipped=0)
    tr.saver = types.SimpleNamespace(wait=lambda: None, stalls=0.0, breakdown={})
    tr.engine = types.SimpleNamespace(device=torch.device("cuda", 0), train=lambda: None, lr=1e-3, grad_norm=None,
                                      nonfinite_check="deferred")
    tr.train_step = lambda i: clock.queue()  # the step's kernels queued; nothing read (no loss to log)

    def evaluate():  # its first loss read waits for the queue, then its own forwards
        clock.synchronize("evaluation")
        time.sleep(0.01)
        return 1.0
    tr.evaluate = evaluate
    tr.save = lambda step: clock.synchronize("save")  # (the state's copy to the host waits too)
    return tr


@pytest.fixture
def clock(monkeypatch):
    clock = _DeviceClock(step_s=0.05)
    monkeypatch.setattr(torch.cuda, "synchronize", clock.synchronize)
    monkeypatch.setattr(lm, "peak_memory_bytes", lambda: 0)
    return clock


def _logged_rates(tmp_path) -> list[float]:
    import json
    return [r["train/tokens_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
            if "train/tokens_per_s" in r]


def test_evaluations_off_log_steps_keep_the_steps_device_time_in_the_window(tmp_path, clock):
    """4 steps of 0.05 s device time each, evaluated after each, one log at step 4. Before: every step's kernels
    ran inside the evaluation's span and were set aside with it; the window held almost no time and logged
    tokens/s hundreds of times too high. Now steps 1-3 are in it (step 4's kernels, queued at the log, go to the
    next window, as a log step's always did)."""
    _trainer(tmp_path, clock, steps=4, log_every=4, eval_every=1, save_every=0).run()
    [rate] = _logged_rates(tmp_path)
    assert rate <= 4000 / 0.12, rate  # >= 3 steps' device time in the window (about 26,700 tokens/s)


def test_saves_off_log_steps_are_timed_after_the_queued_step(tmp_path, clock):
    _trainer(tmp_path, clock, steps=4, log_every=4, eval_every=0, save_every=2).run()
    rate = _logged_rates(tmp_path)[0]
    assert rate <= 4000 / 0.07, rate  # step 1 and 2's kernels (0.1 s) in the window; before, step 2's set aside


def test_steps_that_neither_evaluate_nor_save_never_wait_for_the_device(tmp_path, clock):
    """The deferred non-finite check exists so that the host never waits per step: the aside's wait comes only
    with an evaluation or a save (which waits anyway)."""
    _trainer(tmp_path, clock, steps=6, log_every=3, eval_every=0, save_every=0).run()
    assert clock.syncs == ["save", "evaluation"]  # the run's end: its last save and evaluation, none in the loop
    clock.syncs.clear()
    (tmp_path / "b").mkdir()
    _trainer(tmp_path / "b", clock, steps=6, log_every=3, eval_every=0, save_every=4).run()
    assert clock.syncs == ["cuda:0", "save", "save", "evaluation"]  # step 4's save waits once before its aside


def test_wait_for_device_waits_only_for_a_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(str(device)))
    metrics.wait_for_device(torch.device("cpu"))
    metrics.wait_for_device("cuda:1")
    assert calls == ["cuda:1"]


def test_hrm_segments_per_second_keep_the_steps_device_time(tmp_path, clock):
    """The HRM trainer's own window (segments/s), same stand-in clock: 4 steps queued 0.05 s each, a save after
    step 2 (off the log step, 4). Before: step 1 and 2's kernels ran inside the save's span and were set aside."""
    import json

    import dstrain.trainers.hrm as hrm
    tr = hrm.HRMTrainer.__new__(hrm.HRMTrainer)
    base = _trainer(tmp_path, clock, steps=4, log_every=4, eval_every=0, save_every=2)
    for name in ("cfg", "out", "start_step", "world", "plan", "stop", "guards", "saver", "engine", "save",
                 "evaluate"):
        setattr(tr, name, getattr(base, name))
    tr.cfg.train.lr = 1e-3
    tr.guards.begin = lambda step: None
    tr.task = types.SimpleNamespace(time_limit_s=0)
    tr.global_batch, tr.sparse_opt, tr._batches = 100, None, None
    one = torch.ones(())

    def train_step(step):
        clock.queue()
        return one, {"rows": one * 100, "count": one, "lm_loss": one}
    tr.train_step, tr.evaluate = train_step, lambda: (clock.synchronize("evaluation"), {"loss": 1.0})[1]
    tr.run()
    rates = [r["train/segments_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "train/segments_per_s" in r]
    assert rates and rates[0] <= 400 / 0.07, rates  # step 1 and 2's 0.1 s of kernels in the window


def test_lm_trainer_keeps_a_copy_of_each_micro_batchs_router_aux_loss():
    """The policy's forward leaves its aux loss on the module; under CUDA graphs it is a static output that the
    next replay rewrites in place (simulated here: one tensor, rewritten by each forward)."""
    from tests.unit.test_gpu_readiness import bare_lm_trainer

    class Engine:
        device, step_ok = torch.device("cpu"), None

        def __init__(self):
            self.module, self.static, self.calls = types.SimpleNamespace(router_aux_loss=None), torch.zeros(()), 0

        def __call__(self, x, y):
            self.calls += 1
            self.static.copy_(torch.tensor(float(self.calls)))  # the graph's output memory, rewritten by each replay
            self.module.router_aux_loss = self.static
            return (x.float() - y.float()).pow(2).mean().requires_grad_()

        def backward(self, loss):
            pass

        def step(self):
            return True

    tr = bare_lm_trainer(Engine())
    tr.train_step(0)
    assert lm.mean_of_taken(tr.router_aux, "router_aux_loss") == {"router_aux_loss": 2.0}  # (1 + 2 + 3) / 3


def test_take_router_aux_hands_back_a_copy_that_the_next_forward_leaves_alone():
    from models.policy.model import take_router_aux
    static = torch.tensor(1.0, requires_grad=True) * 1.0  # a graph output (with a history), rewritten below
    module = types.SimpleNamespace(router_aux_loss=static, router_aux_coef=0.01)
    aux1, coef = take_router_aux(module)
    with torch.no_grad():
        static.fill_(5.0)  # the second turn's forward replays into the same memory
    module.router_aux_loss = static
    aux2, _ = take_router_aux(module)
    assert (aux1.item(), aux2.item(), coef, module.router_aux_loss) == (1.0, 5.0, 0.01, None)
    assert aux1.requires_grad  # still part of the loss's graph
