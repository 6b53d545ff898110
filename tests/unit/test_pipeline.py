"""Pipeline stages without processes: the LayerSpec cut is the plain model, splits, name mapping, the plan."""
import itertools

import pytest
import torch

from dstrain.engine.profiles import (Activations, Hardware, PlanError, balanced_split, choose_pipeline_plan,
                                     stage_estimates, suggest_pp, uniform_split)
from dstrain.parallel.pipeline import partition, plain_state_dict, stage_split
from models import registry

MODELS = [("gpt", "tiny"), ("dilated_lm", "debug")]


def _parts_and_plain(name, size):
    spec = registry.get_spec(name)
    mcfg = registry.make_model_config(name, size, {"n_layer": 3})
    torch.manual_seed(0)
    return spec.pipeline(mcfg, False), spec.build(mcfg)


@pytest.mark.parametrize("name,size", MODELS)
def test_layers_in_sequence_are_the_plain_model(name, size):
    parts, plain = _parts_and_plain(name, size)
    state = plain.state_dict()
    layers, used = [], set()
    for spec, prefix in zip(parts.layers, parts.prefixes):
        layer = spec.build()
        own = {k: state[prefix + k] for k in layer.state_dict()}
        layer.load_state_dict(own, strict=True)
        used |= {prefix + k for k in own}
        layers.append(layer)
    assert used == set(state)  # every plain parameter lands in exactly one layer
    assert sum(parts.param_counts()) == plain.num_params()
    ids = torch.randint(0, 257, (2, 64))
    targets = torch.randint(0, 257, (2, 64))
    x = ids
    for layer in layers:
        x = layer(x)
    loss = parts.loss_fn(x, targets)
    ref = plain(ids, targets)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-6)
    loss.backward()
    ref.backward()
    for layer, prefix in zip(layers, parts.prefixes):
        for k, p in layer.named_parameters():
            torch.testing.assert_close(p.grad, dict(plain.named_parameters())[prefix + k].grad,
                                       rtol=1e-5, atol=1e-7, msg=prefix + k)


def test_checkpointed_block_gives_the_same_gradients():
    parts, _ = _parts_and_plain("gpt", "tiny")
    spec = registry.get_spec("gpt")
    ckpt_parts = spec.pipeline(registry.make_model_config("gpt", "tiny", {"n_layer": 3}), True)
    torch.manual_seed(1)
    a = parts.layers[1].build()
    b = ckpt_parts.layers[1].build()
    b.load_state_dict(a.state_dict())
    assert b.checkpointing and not a.checkpointing
    x = torch.randn(2, 16, 128, requires_grad=True)
    a(x).square().sum().backward()
    ga = x.grad.clone()
    x.grad = None
    b(x).square().sum().backward()
    torch.testing.assert_close(x.grad, ga)


def _max_stage(weights, bounds):
    return max(sum(weights[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1))


@pytest.mark.parametrize("weights,parts", [([5, 1, 1, 1, 1, 5], 2), ([1, 9, 1, 1, 1, 1, 9], 3),
                                           ([3, 3, 3, 3], 4), ([0, 7, 2, 2, 2, 0], 3)])
def test_balanced_split_is_optimal(weights, parts):
    bounds = balanced_split(weights, parts)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == parts + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # no empty stage
    best = min(_max_stage(weights, [0, *cuts, len(weights)])
               for cuts in itertools.combinations(range(1, len(weights)), parts - 1))
    assert _max_stage(weights, bounds) == best


def test_uniform_and_refusals():
    assert uniform_split(6, 4) == [0, 2, 4, 5, 6]
    assert partition([1] * 5, 2, "uniform") == [0, 3, 5]
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages; use pp <= 3"):
        partition([1, 1, 1], 4)
    with pytest.raises(ValueError, match="unknown pipeline partition method 'profile'"):
        partition([1, 1], 2, "profile")


def test_split_methods_on_the_gpt():
    parts, _ = _parts_and_plain("gpt", "tiny")  # embedding, 3 blocks, head
    counts = parts.param_counts()
    assert stage_split(parts, 2, "parameters")[0] == balanced_split(counts, 2)
    assert stage_split(parts, 2, "uniform")[0] == [0, 3, 5]
    bounds, costs = stage_split(parts, 2, "cost", micro_batch=1, seq_len=32)
    assert costs[1] == costs[2] == costs[3] > 0  # one block timed, standing for all
    assert bounds == balanced_split(costs, 2)


def test_plain_state_dict_from_layer_files(tmp_path):
    parts, plain = _parts_and_plain("gpt", "tiny")
    for idx, spec in enumerate(parts.layers):
        layer = spec.build()
        layer.load_state_dict({k: plain.state_dict()[parts.prefixes[idx] + k] for k in layer.state_dict()})
        torch.save(layer.state_dict(), tmp_path / f"layer_{idx:02d}-model_states.pt")
    state = plain_state_dict(tmp_path, parts.prefixes)
    assert state.keys() == plain.state_dict().keys()
    for k, v in plain.state_dict().items():
        assert torch.equal(state[k], v)
    with pytest.raises(ValueError, match="layer 4 saved but the model has 3 layers"):
        plain_state_dict(tmp_path, parts.prefixes[:3])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a pipeline checkpoint"):
        plain_state_dict(tmp_path / "empty", parts.prefixes)


# ---------------------------------------------------------------- the plan (a made-up small device)

GB = 10**9
HW = Hardware("cuda", device_memory=1 * GB, host_memory=64 * GB, ranks_per_node=8,
              bf16_supported_fast=True, fp16_supported=True, name="made-up 1 GB")  # budget 850 MB
LAYERS = [10_000_000] + [20_000_000] * 8 + [10_000_000]  # embedding, 8 blocks, head: 180M parameters
ACTS = Activations(per_sample=100 * 10**6, per_sample_checkpointed=10 * 10**6)  # fp32 bytes, whole model


def test_stage_memory_counts_in_flight_micro_batches():
    bounds = [0, 5, 10]
    st = stage_estimates("zero0", LAYERS, bounds, ACTS, dp=1, micro_batch=2, grad_accum=8, precision="bf16",
                         ckpt=False)
    assert [e.in_flight for e in st] == [2, 1]              # 1F1B: pp - s micro-batches on stage s
    assert st[0].params == st[1].params == 90_000_000
    assert st[0].model_states == 16 * 90_000_000             # ZeRO-0 bf16: 16 bytes per parameter
    assert st[0].activations == 100 * 10**6 // 2 * 2 * 2 // 2  # half the layers, micro 2, 2 in flight, 16-bit
    assert st[0].activations == 2 * st[1].activations
    z1 = stage_estimates("zero1", LAYERS, bounds, ACTS, dp=4, micro_batch=2, grad_accum=1, precision="bf16",
                         ckpt=False)
    assert z1[0].model_states == 4 * 90_000_000 + 12 * 90_000_000 // 4
    assert [e.in_flight for e in z1] == [1, 1]              # never more than grad_accum
    with pytest.raises(ValueError, match="zero2 is incompatible with pipeline parallelism"):
        stage_estimates("zero2", LAYERS, bounds, ACTS, 1, 1, 1, "bf16", False)


def test_pipeline_plan_walks_zero0_zero1_then_checkpointing():
    # 8 stages: the fullest holds 30M parameters (480 MB) + 8 in-flight micro-batches' activations (80 MB).
    plan, stages = choose_pipeline_plan(LAYERS, balanced_split(LAYERS, 8), HW, ACTS, dp=1, micro_batch=1,
                                        grad_accum=8)
    assert (plan.profile, plan.activation_checkpointing) == ("zero0", False)
    assert max(e.total for e in stages) == 480 * 10**6 + 80 * 10**6
    # 2 stages x dp 4: ZeRO-0 needs 1.44 GB a stage, ZeRO-1 630 MB + 50 MB.
    plan, _ = choose_pipeline_plan(LAYERS, [0, 5, 10], HW, ACTS, dp=4, micro_batch=1, grad_accum=8)
    assert (plan.profile, plan.activation_checkpointing) == ("zero1", False)
    assert "zero0 stage 0 needs 1.5 GB > 850.0 MB budget" in plan.reason
    # micro-batch 8: 400 MB of activations on stage 0 -> ZeRO-1 with checkpointing (40 MB).
    plan, _ = choose_pipeline_plan(LAYERS, [0, 5, 10], HW, ACTS, dp=4, micro_batch=8, grad_accum=8)
    assert (plan.profile, plan.activation_checkpointing) == ("zero1", True)
    assert [(e.profile, e.activation_checkpointing, e.fits) for e in plan.estimates] == [
        ("zero0", False, False), ("zero1", False, False), ("zero0", True, False), ("zero1", True, True)]
    with pytest.raises(PlanError, match="no profile fits"):  # 2 stages x dp 1: 1.44 GB a stage
        choose_pipeline_plan(LAYERS, [0, 5, 10], HW, ACTS, dp=1, micro_batch=1, grad_accum=8)


def test_suggest_pp_is_the_smallest_degree_that_fits():
    assert suggest_pp(LAYERS, HW, ACTS, world_size=8, micro_batch=1, grad_accum=8) == 2   # zero1 x dp 4
    assert suggest_pp(LAYERS, HW, ACTS, world_size=4, micro_batch=1, grad_accum=8) == 4   # 2 x dp 2: 900 MB
    assert suggest_pp(LAYERS, HW, ACTS, world_size=3, micro_batch=1, grad_accum=8) is None


# ---------------------------------------------------------------- the factory and the run config

def _cfg(*overrides):
    from pathlib import Path

    from dstrain.config import load_run_config
    root = Path(__file__).resolve().parents[2]
    return load_run_config(root / "models" / "gpt" / "recipes" / "tiny.json",
                           ["--data.seq_len=64", "--deepspeed.precision=fp32", *overrides])


def _hw(memory=16 * GB):
    return Hardware("cpu", device_memory=memory, host_memory=2 * memory, ranks_per_node=4,
                    bf16_supported_fast=False, fp16_supported=False, name="cpu")


def test_plan_shows_the_stage_split():
    plan = plan_engine_(_cfg("--parallel.pp=2", "--train.grad_accum=4"), 4)
    assert plan.pipeline.bounds == [0, 3, 6] and plan.pipeline.dp == 2
    assert plan.ds_config["train_batch_size"] == 8 * 4 * 2  # micro x accum x dp (not x pp)
    text = plan.explanation
    assert "pipeline: 2 stages x dp 2, split by parameters" in text
    assert "bubble (p - 1) / (m + p - 1) = 0.20" in text
    assert "stage 0: layers 0..2 (embedding, block x2), 459,392 params" in text
    assert "stage 1: layers 3..5 (block x2, head), 426,752 params" in text
    assert "(2 in flight)" in text and "(1 in flight)" in text


def plan_engine_(cfg, world, memory=16 * GB):
    from dstrain.engine.factory import plan_engine
    return plan_engine(cfg, world_size=world, hw=_hw(memory))


@pytest.mark.parametrize("profile", ["zero2", "zero3"])
def test_zero2_and_zero3_refused_with_pp_in_one_line(profile):
    with pytest.raises(ValueError, match=f"ZeRO stage {profile[-1]} cannot run with pipeline parallelism") as err:
        plan_engine_(_cfg("--parallel.pp=2", f"--deepspeed.profile={profile}"), 2)
    assert "\n" not in str(err.value)


def test_run_config_refuses_pp_with_tp_and_unknown_partition():
    from dstrain.config import ConfigError
    with pytest.raises(ConfigError, match="parallel.pp.*supported with data parallelism only"):
        _cfg("--parallel.pp=2", "--parallel.tp=2")
    with pytest.raises(ConfigError, match="parallel.pp_partition.*must be parameters, uniform or cost"):
        _cfg("--parallel.pp=2", "--parallel.pp_partition=type:Block")
    with pytest.raises(ValueError, match="world size 3 is not divisible by tp x sp x pp = 1 x 1 x 2 = 2"):
        plan_engine_(_cfg("--parallel.pp=2"), 3)


def test_auto_considers_pp_when_only_zero3_fits():
    # tiny GPT, fp32, 2 ranks: ZeRO-2 needs 12 bytes a parameter (10.6 MB, + activations), ZeRO-3 10 (+ the largest
    # module gathered), one stage of pp = 2 (459k parameters) 20 bytes at ZeRO-0 (9.2 MB).
    cfg = _cfg("--train.micro_batch=1", "--deepspeed.margin=1.0", "--deepspeed.activation_checkpointing=true")
    plan = plan_engine_(cfg, 2, memory=int(10.6e6))
    assert plan.profile == "zero3"
    assert "pipeline alternative: --parallel.pp=2 fits with ZeRO-0/1 per stage (dp 1)" in plan.explanation
    roomy = plan_engine_(cfg, 2)
    assert roomy.profile == "zero0" and "pipeline alternative" not in roomy.explanation


def test_tied_layers_and_other_trainers_are_refused():
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from dstrain.config import ConfigError
    from dstrain.parallel.pipeline import PipelineParts
    with pytest.raises(ValueError, match="tied layers"):
        PipelineParts([TiedLayerSpec("emb", torch.nn.Embedding, 8, 4), LayerSpec(torch.nn.Linear, 4, 8)],
                      ["", ""], lambda out, y: out.sum())
    with pytest.raises(ConfigError, match="pipeline parallelism runs the supervised LM trainer only"):
        _cfg("--parallel.pp=2", "--trainer=hrm")


def test_preflight_counts_data_parallel_ranks_without_the_stages(tmp_path):
    import json

    from dstrain.engine import ds_config as dsc
    from dstrain.engine.ds_preflight import check_run, data_parallel_size
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
                                "zero_optimization": {"stage": 1}}))
    cfg = _cfg("--parallel.pp=2", f"--deepspeed.profile={path}", "--train.micro_batch=8")
    assert data_parallel_size(cfg, 4) == 2
    check_run(cfg, 4, "cpu")  # 8 x 1 x dp 2 = 16: agrees
    with pytest.raises(dsc.DSConfigError, match="train_batch_size"):
        check_run(_cfg(f"--deepspeed.profile={path}", "--train.micro_batch=8"), 4, "cpu")  # dp 4 without pp


@pytest.mark.parametrize("name,size", MODELS)
def test_layer_traces_add_up_to_the_whole_model(name, size):
    from dstrain.engine import hardware
    from dstrain.parallel.pipeline import layer_activations
    spec = registry.get_spec(name)
    mcfg = registry.make_model_config(name, size, {})
    plain, ckpt = layer_activations(spec, mcfg, 64)
    from torch._subclasses.fake_tensor import FakeTensorMode
    whole = hardware.trace_activations(lambda: spec.build(mcfg), lambda: spec.inputs_for_trace(mcfg, 1, 64),
                                       lambda m, flag: spec.parallelize(m, activation_checkpointing=flag))
    with FakeTensorMode():
        model = spec.build(mcfg)
        saved = hardware._saved_bytes(model, lambda: spec.inputs_for_trace(mcfg, 1, 64))
        spec.parallelize(model, activation_checkpointing=True)
        kept = hardware._saved_bytes(model, lambda: spec.inputs_for_trace(mcfg, 1, 64)).total
    # The same saved tensors, counted layer by layer (the plain model's position index aside); the plan takes
    # the forward and backward's live peak, a few % above them (the logits, gradients in flight).
    assert sum(plain) == pytest.approx(saved.total, abs=1024)
    assert saved.total <= whole.per_sample == saved.peak <= 1.15 * saved.total
    # checkpointed: the kept inputs, plus the block the backward recomputes, at most the whole trace's peak
    recomputed = max(p for p, c in zip(plain, ckpt) if p != c)
    assert sum(ckpt) == pytest.approx(kept, abs=1024)
    assert sum(ckpt) + recomputed <= whole.per_sample_checkpointed + 1024
    assert plain[1] == plain[2] > 10 * ckpt[1]          # blocks: everything vs their input only
    assert plain[-1] == ckpt[-1] > 0                     # the head is not recomputed: logits and loss


def test_stage_activations_follow_the_layer_traces():
    layer_acts = ([0, 10, 10, 10, 10, 40], [0, 1, 1, 1, 1, 40])
    acts = Activations(per_sample=81, per_sample_checkpointed=44)
    st = stage_estimates("zero0", [1] * 6, [0, 3, 6], acts, dp=1, micro_batch=1, grad_accum=4, precision="fp32",
                         ckpt=False, layer_acts=layer_acts)
    assert [e.activations for e in st] == [20 * 2, 60 * 1]  # stage 0: 2 micro-batches in flight
    st = stage_estimates("zero0", [1] * 6, [0, 3, 6], acts, dp=1, micro_batch=1, grad_accum=4, precision="fp32",
                         ckpt=True, layer_acts=layer_acts)
    assert [e.activations for e in st] == [2 * 2 + 10, 42 * 1 + 10]  # + one recomputed block (not the head)


def test_pipeline_plan_on_a_gpu_keeps_deepspeed_bf16_and_no_compile():
    from dstrain.engine.factory import plan_engine
    gpu = Hardware("cuda", device_memory=80 * GB, host_memory=512 * GB, ranks_per_node=8,
                   bf16_supported_fast=True, fp16_supported=True, name="made-up GPU")
    plan = plan_engine(_cfg("--parallel.pp=2", "--deepspeed.precision=auto"), world_size=2, hw=gpu)
    assert plan.precision == "bf16" and plan.ds_config["bf16"]["enabled"] is True
    assert "torch_autocast" not in plan.ds_config and plan.compile is False
    assert plan_engine(_cfg("--deepspeed.precision=auto"), world_size=2, hw=gpu).compile is True


def test_pp_auto_pipelines_only_when_zero_without_partitioning_does_not_fit():
    cfg = lambda *extra: _cfg("--parallel.pp=auto", "--train.micro_batch=1", "--deepspeed.margin=1.0",  # noqa: E731
                              "--deepspeed.activation_checkpointing=true", *extra)
    tight = plan_engine_(cfg(), 2, memory=int(10.6e6))  # as above: only ZeRO-3 fits the whole model
    assert tight.pipeline is not None and tight.pipeline.pp == 2 and tight.pipeline.dp == 1
    assert "parallel.pp auto -> 2: ZeRO-0/1/2 does not fit the whole model on 2 ranks" in tight.explanation
    assert tight.profile in ("zero0", "zero1") and "stage 1: layers 3..5" in tight.explanation
    roomy = plan_engine_(cfg(), 2)
    assert roomy.pipeline is None and "parallel.pp auto -> 1: ZeRO-0/1/2 fits the whole model" in roomy.explanation
    named = plan_engine_(cfg("--deepspeed.profile=zero3"), 2, memory=int(10.6e6))
    assert named.pipeline is None and "pipelining needs deepspeed.profile auto" in named.explanation


@pytest.mark.parametrize("value", ["0", "two", "true"])
def test_pp_must_be_a_positive_integer_or_auto(value):
    from dstrain.config import ConfigError
    with pytest.raises(ConfigError, match="parallel.pp.*must be a positive integer or auto"):
        _cfg(f"--parallel.pp={value}")


def test_stages_in_checkpoint(tmp_path):
    from dstrain.parallel.pipeline import stages_in_checkpoint
    (tmp_path / "mp_rank_00_model_states.pt").touch()
    assert stages_in_checkpoint(tmp_path) == 1  # a plain DeepSpeed checkpoint
    for name in ("layer_00-model_states.pt", "layer_01-model_states.pt", "mp_rank_01_model_states.pt"):
        (tmp_path / name).touch()
    assert stages_in_checkpoint(tmp_path) == 2
