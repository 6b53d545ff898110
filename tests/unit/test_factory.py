"""The engine factory's inputs and decisions, checked against measurements and hand values."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dstrain.config import load_run_config
from dstrain.engine import hardware
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.factory import WarmupCosine, plan_engine
from dstrain.engine.hardware import MatmulRate
from dstrain.engine.profiles import Hardware
from models import registry
from tests.reference import lr_at

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


def cpu(bf16_fast=False, memory=16 * 10**9):
    return Hardware(device_type="cpu", device_memory=memory, host_memory=2 * memory, ranks_per_node=2,
                    bf16_supported_fast=bf16_fast, fp16_supported=False, name="cpu")


@pytest.mark.parametrize("flags, fp32, bf16, expected, verdict", [
    (["avx512_bf16"], 115e9, 0.3e9, False, "bf16 under the 1.5x"),  # emulated bf16 (the DESIGN's 2-core machine)
    (["avx512_bf16"], 166e9, 700e9, True, "bf16 is fast"),          # native and measured 4x faster
    (["amx_bf16"], 100e9, 146e9, False, "bf16 under the 1.5x"),     # native, faster, but not worth the casts
    ([], 100e9, 700e9, False, "no native bf16"),                    # no native support reported: never bf16
])
def test_cpu_bf16_decided_by_flags_and_measurement(monkeypatch, flags, fp32, bf16, expected, verdict):
    rates = {torch.float32: fp32, torch.bfloat16: bf16}
    monkeypatch.setattr(hardware, "matmul_rate",
                        lambda dtype, size, **kw: MatmulRate(str(dtype), size, rates[dtype]))
    monkeypatch.setattr(hardware, "cpu_bf16_flags", lambda: flags)
    fast, note = hardware.cpu_bf16_is_fast()
    assert fast is expected and "GFLOP/s" in note and verdict in note  # the verdict says why, not "slower"


def test_cpu_without_fast_bf16_trains_fp32_at_zero0():
    cfg = load_run_config(TINY)
    plan = plan_engine(cfg, world_size=2, hw=cpu())
    assert (plan.profile, plan.precision, plan.activation_checkpointing) == ("zero0", "fp32", False)
    assert plan.ds_config["bf16"]["enabled"] is False and plan.ds_config["fp16"]["enabled"] is False
    assert plan.ds_config["train_batch_size"] == 8 * 1 * 2
    assert "auto" not in json.dumps(plan.ds_config)
    assert "zero0" in plan.explanation and "fits" in plan.explanation


def test_memory_pressure_moves_to_checkpointing_then_offload():
    cfg = load_run_config(TINY, ["--train.micro_batch=64", "--data.seq_len=256"])
    stats_plan = plan_engine(cfg, world_size=2, hw=cpu(memory=10**12))
    acts = stats_plan.plan.estimates[-1].activations
    states = stats_plan.plan.estimates[-1].model_states
    # Budget between checkpointed and full activations: checkpointing switches on.
    tight = plan_engine(cfg, world_size=2, hw=cpu(memory=int((states + acts / 2) / 0.85)))
    assert tight.activation_checkpointing and tight.profile == "zero0"


def test_named_profile_with_contradicting_value_lists_every_mismatch(tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds["train_micro_batch_size_per_gpu"] = 3
    ds["gradient_clipping"] = 0.25
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(ds))
    cfg = load_run_config(TINY, [f"--deepspeed.profile={path}"])
    with pytest.raises(DSConfigError) as err:
        plan_engine(cfg, world_size=2, hw=cpu())
    assert "train_micro_batch_size_per_gpu" in str(err.value) and "gradient_clipping" in str(err.value)


def test_model_stats_match_the_real_model():
    mcfg = registry.make_model_config("gpt", "tiny")
    stats = hardware.model_stats(lambda: registry.get_spec("gpt").build(mcfg))
    model = registry.get_spec("gpt").build(mcfg)
    assert stats.params == sum(p.numel() for p in model.parameters())
    owned = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    assert stats.largest_module_params == max(owned) == 128 * 512  # the MLP up-projection
    assert (stats.hidden_size, stats.num_layers) == (128, 4)


MEASURE = textwrap.dedent("""
    import json, psutil, torch
    from models import registry
    torch.set_num_threads(1)
    spec = registry.get_spec("gpt")
    cfg = registry.make_model_config("gpt", "tiny", {"n_layer": 4, "n_embd": 256, "block_size": 512})
    model = spec.build(cfg)
    x = torch.randint(0, 257, (4, 512))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}
    def pack(t):
        s = t.untyped_storage(); saved[s.data_ptr()] = s.nbytes(); return t
    rss = psutil.Process().memory_info().rss
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, x)
    grown = psutil.Process().memory_info().rss - rss
    print(json.dumps({"saved": sum(v for k, v in saved.items() if k not in params), "rss": grown}))
""")


def test_activation_estimate_matches_measured_memory():
    """The factory's traced estimate vs. real tensors saved and RSS growth of a real forward."""
    spec = registry.get_spec("gpt")
    mcfg = registry.make_model_config("gpt", "tiny", {"n_layer": 4, "n_embd": 256, "block_size": 512})
    acts = hardware.trace_activations(lambda: spec.build(mcfg), lambda: spec.inputs_for_trace(mcfg, 1, 512),
                                      lambda m, f: spec.parallelize(m, activation_checkpointing=f))
    out = subprocess.run([sys.executable, "-c", MEASURE], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    estimate = 4 * acts.per_sample
    # the saved tensors, plus what the step holds beside them at its peak (tests/unit/test_reference_round17.py)
    assert measured["saved"] <= estimate <= 1.1 * measured["saved"]
    assert estimate == pytest.approx(measured["rss"], rel=0.35)
    # checkpointed: the 4 block inputs kept, plus one block's activations while the backward recomputes it
    assert acts.per_sample / 4 < acts.per_sample_checkpointed < acts.per_sample / 2


def test_schedule_matches_reference_formula():
    cfg = load_run_config(TINY, ["--train.steps=50", "--train.warmup_steps=5", "--train.min_lr_ratio=0.1"])
    f = WarmupCosine(5, 50, 0.1)
    for k in range(60):
        assert cfg.train.lr * f(k) == pytest.approx(lr_at(cfg, k), rel=1e-12)
    assert f(0) > 0 and f(4) == 1.0 and f(50) == pytest.approx(0.1)


@pytest.mark.parametrize("name, size, args, seq", [("gpt", "tiny", {"n_layer": 3, "n_embd": 128, "block_size": 256}, 256),
                                                   ("dilated_lm", "debug", {}, 128)])
def test_autocast_activation_estimate_matches_a_real_autocast_forward(name, size, args, seq):
    """The planner's bf16-autocast activations (fake-tensor traces at micro-batches 1 and 2, split into
    per-sample and fixed bytes) against the bytes a real autocast forward saves at micro-batch 3, and
    against the fp32 rule it replaces on GPUs at ZeRO-0 (half the fp32 trace: too little)."""
    spec = registry.get_spec(name)
    mcfg = registry.make_model_config(name, size, args)
    acts = hardware.trace_activations(lambda: spec.build(mcfg), lambda: spec.inputs_for_trace(mcfg, 1, seq),
                                      lambda m, f: spec.parallelize(m, activation_checkpointing=f),
                                      lambda: spec.inputs_for_trace(mcfg, 2, seq))
    (per_sample, fixed), (per_sample_ckpt, fixed_ckpt) = acts.autocast
    torch.manual_seed(0)
    model = spec.build(mcfg).train()
    ids = torch.randint(0, mcfg.vocab_size, (3, seq))
    storages = {}

    def pack(t):
        storages[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, ids)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    measured = sum(v for k, v in storages.items() if k not in params)
    loss.backward()
    # the saved bytes, plus the logits and gradients in flight at the step's peak (the planner's live peak)
    assert measured <= 3 * per_sample + fixed <= 1.15 * measured
    assert fixed > 0 and per_sample > 0.5 * acts.per_sample  # weight copies; fp32 kept where autocast keeps it
    assert 0 < per_sample_ckpt < per_sample and fixed_ckpt >= 0


def test_gpu_zero0_plans_autocast_activations(tmp_path):
    """On a GPU the chosen ZeRO-0 runs bf16 as autocast: its estimate uses the autocast trace; ZeRO-2
    (DeepSpeed's 16-bit weights) keeps half the fp32 trace; the CPU plan traces no autocast at all."""
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    hw = Hardware("cuda", 80 * 10**9, 256 * 10**9, 8, True, True, "test GPU")
    cfg = load_run_config(TINY, [f"--output.dir={tmp_path}", "--train.micro_batch=4"])
    plan = plan_engine(cfg, 1, hw=hw)
    est = {e.profile: e for e in plan.plan.estimates}
    assert plan.profile == "zero0" and list(est) == ["zero0"]
    spec = registry.get_spec("gpt")
    mcfg = registry.make_model_config("gpt", cfg.model.size, cfg.model.args)
    acts = hardware.trace_activations(lambda: spec.build(mcfg), lambda: spec.inputs_for_trace(mcfg, 1, cfg.data.seq_len),
                                      lambda m, f: spec.parallelize(m, activation_checkpointing=f),
                                      lambda: spec.inputs_for_trace(mcfg, 2, cfg.data.seq_len))
    zero0 = est["zero0"]
    assert zero0.activations == 4 * acts.autocast[0][0] + acts.autocast[0][1]
    params = hardware.model_stats(lambda: spec.build(mcfg)).params  # fp32 gradients freed at each step
    assert zero0.device_total == max(zero0.model_states, zero0.model_states - 4 * params + zero0.activations)
    accum = plan_engine(load_run_config(TINY, [f"--output.dir={tmp_path}", "--train.micro_batch=4",
                                               "--train.grad_accum=2"]), 1, hw=hw).plan.estimates[0]
    assert accum.device_total == accum.model_states + accum.activations  # kept between micro-batches
    zero2 = plan_engine(load_run_config(TINY, [f"--output.dir={tmp_path}", "--train.micro_batch=4",
                                               "--deepspeed.profile=zero2"]), 1, hw=hw)
    assert zero2.plan.estimates[0].activations == est["zero0"].activations  # the table is the auto walk's
    from dstrain.engine.profiles import _estimate, autocast_runs
    assert not autocast_runs("zero2", "bf16", "cuda") and autocast_runs("zero2", "bf16", "cuda", "autocast")
    assert _estimate("zero2", False, hardware.ModelStats(10, 1, 0, 0), hw, acts, 1, 4, "bf16", 0.85).activations \
        == int(round(4 * acts.per_sample * 0.5))
