"""Round 17 of the independent references: the activation memory ``dstrain plan`` counts
(``hardware.trace_activations``, a forward and backward under FakeTensorMode) against the peak a real CPU training
step allocates, float32, micro-batch 1: the GPT, the dilated LM, HRM (its ACT segment, with the no-grad segment
that computes the Q target) and a tiny policy under the SFT loss and under the GRPO loss (old and reference
log-probabilities given); and the parameter count the model-state part rests on.

The measured peak is the running sum of the CPU allocator's own records (``torch.profiler``'s ``[memory]`` events,
one per allocation and free, in time order), with the gradients allocated beforehand, so it is the activations,
the backward's gradients in flight and every temporary. (Round 16 summed each op's net memory at the op's start,
which smoothed the peak away: GPT tiny checkpointed read 1.60 MB for the allocator's 1.86.)

Found and fixed (``hardware._LiveBytes``, ``_peak``, ``_checkpointed_peak``): the plan counted the bytes autograd
saves, and under checkpointing those plus the largest recomputed block's saves. Measured peak / plan, before:

* without checkpointing: HRM debug 1.21 (``sudoku_debug.json``), 1.24 (``sudoku4_cpu.json``), 1.19 (sudoku size):
  the Q target's no-grad segment runs while the saved activations are alive (``sudoku6_cpu.json``, whose
  ``halt_rule`` "solved" has no Q target, 1.08); GPT tiny and the dilated LM debug 1.07, the GRPO loss 1.18;
* with checkpointing: 1.15-1.18 for the GPT and the dilated LM, 1.16-2.0 for HRM, 1.36 for the policy (the
  recomputed block's temporaries and gradients, HRM's no-grad segment beside the kept inputs).

The trace now also follows the bytes alive at once over the same fake forward and backward (a storage counted from
the op that made it until nothing holds it; parameters, their gradients and the inputs left out) and plans the
higher of that peak and the old figure: every case above within 0 to 11 % under the measured peak, the policy's
SFT step 10 % over it (the GRPO step 3 % under). Still no real forward: no memory, no compute.
"""
from __future__ import annotations

import gc

import pytest
import torch

from dstrain.engine import hardware
from models import registry


def _measured_peak(spec, mcfg, seq: int, ckpt: bool, loss_fn=None) -> int:
    """Peak bytes the CPU allocator holds over one real forward and backward at micro-batch 1 (gradients and
    inputs allocated before), from the profiler's raw allocation and free records in time order."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    model = spec.parallelize(spec.build(mcfg), activation_checkpointing=ckpt)
    model.train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    inputs = spec.inputs_for_trace(mcfg, 1, seq)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(*inputs) if loss_fn is None else loss_fn(model, inputs)
        (out[0] if isinstance(out, (tuple, list)) else out).backward()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    live = peak = 0
    for _, n in records:
        live += n
        peak = max(peak, live)
    return peak


def _planned(spec, mcfg, seq: int):
    return hardware.trace_activations(lambda: spec.build(mcfg), lambda: spec.inputs_for_trace(mcfg, 1, seq),
                                      lambda m, flag: spec.parallelize(m, activation_checkpointing=flag))


@pytest.mark.parametrize("name,size,args,seq", [
    ("hrm", "debug", {}, 0),                                                       # sudoku_debug.json
    ("hrm", "debug", {"seq_len": 16, "vocab_size": 6, "halt_max_steps": 8, "pos_encodings": "learned"}, 0),
    ("gpt", "tiny", {}, 128),
])
def test_planned_peak_without_checkpointing_is_the_measured_peak(name, size, args, seq):
    """Before: the saved bytes, 1.21x (HRM debug), 1.24x (sudoku4) and 1.07x (GPT tiny) under the measured
    peak; now the traced live peak, equal to it."""
    spec = registry.get_spec(name)
    mcfg = registry.make_model_config(name, size, args)
    planned = _planned(spec, mcfg, seq).per_sample
    assert planned == pytest.approx(_measured_peak(spec, mcfg, seq, ckpt=False), rel=0.01)


@pytest.mark.parametrize("name,size,seq", [("hrm", "debug", 0), ("gpt", "tiny", 128), ("dilated_lm", "debug", 128)])
def test_planned_peak_with_checkpointing_against_the_measured_peak(name, size, seq):
    """Before: 0.86x (HRM debug), 0.85x (GPT tiny) and 0.87x (dilated LM) of the measured peak; now within 4 %
    under it (what the allocator holds outside any op: checkpointing's saved RNG state and the like)."""
    spec = registry.get_spec(name)
    mcfg = registry.make_model_config(name, size, {})
    planned = _planned(spec, mcfg, seq).per_sample_checkpointed
    peak = _measured_peak(spec, mcfg, seq, ckpt=True)
    assert 0.96 * peak <= planned <= 1.01 * peak, planned / peak


def test_planned_peak_of_a_grpo_step():
    """The plan traces the policy's SFT loss; a GRPO step (logits -> next-token log-probs -> clipped surrogate and
    k3 KL against given old and reference log-probs) peaked 1.18x its saved bytes. Now within 10 %."""
    from dstrain.rl.grpo_math import GRPOLossConfig, grpo_loss
    from models.policy.model import token_logprobs
    spec = registry.get_spec("policy")
    mcfg = registry.make_model_config("policy", "tiny", {})
    seq = 128
    torch.manual_seed(1)
    old = torch.randn(1, seq - 1) * 0.1 - 3.0
    ref, adv, mask = old + 0.01, torch.ones(1), torch.ones(1, seq - 1)

    def grpo(model, inputs):
        ids = inputs[0]
        logp = token_logprobs(model(ids, attention_mask=torch.ones_like(ids)), ids)
        return grpo_loss(logp, old, ref, adv, mask, GRPOLossConfig(beta=0.04))[0]

    planned = _planned(spec, mcfg, seq).per_sample
    peak = _measured_peak(spec, mcfg, seq, ckpt=False, loss_fn=grpo)
    assert 0.9 * peak <= planned <= 1.1 * peak, planned / peak


@pytest.mark.parametrize("name,size", [("gpt", "tiny"), ("dilated_lm", "debug"), ("hrm", "debug"),
                                       ("policy", "tiny")])
def test_model_state_parameter_count(name, size):
    """The model-state bytes rest on ``model_stats`` (a meta-device build): its parameter count is that of the
    real model's distinct parameters, and its largest module the most parameters one module owns directly."""
    spec = registry.get_spec(name)
    mcfg = registry.make_model_config(name, size, {})
    stats = hardware.model_stats(lambda: spec.build(mcfg))
    model = spec.build(mcfg)
    distinct = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert stats.params == sum(distinct.values()) > 0
    assert stats.largest_module_params == max(sum(p.numel() for p in m.parameters(recurse=False))
                                              for m in model.modules())


def test_a_sparse_gradient_does_not_stop_the_trace():
    """A model with nn.Embedding(sparse=True) (DeepSpeed's ``sparse_gradients``): its backward makes a sparse
    gradient, which has no storage. Before: NotImplementedError "Cannot access storage of SparseTensorImpl" from
    the live-bytes count, and no plan; now its dense activations are counted as for a dense embedding."""
    class Lookup(torch.nn.Module):
        def __init__(self, sparse: bool):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 16, sparse=sparse)
            self.head = torch.nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.embed(x)).sum()

    def trace(sparse: bool):
        return hardware.trace_activations(lambda: Lookup(sparse), lambda: (torch.randint(0, 100, (1, 8)),),
                                          lambda m, flag: None)
    sparse, dense = trace(True), trace(False)
    assert sparse.per_sample > 0 and sparse.per_sample <= dense.per_sample
