"""The engine's GPU-facing choices, checked without a GPU: arch list, optimizer, mixed precision, compile."""
import importlib

import pytest
import torch

from dstrain.engine import cuda_env
from dstrain.engine.ds_config import RunValues
from dstrain.engine.factory import mixed_precision
from dstrain.engine.optim import choose_optimizer

VALUES = RunValues(micro_batch=4, grad_accum=1, dp_world_size=1, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                   weight_decay=0.1, grad_clip=1.0, precision="bf16", hidden_size=64, total_steps=10,
                   warmup_steps=1, min_lr_ratio=0.1)


@pytest.mark.parametrize("raw, fixed", [
    ("9.0a", "9.0"), ("9.0", "9.0"), ("8.0 9.0a+PTX", "8.0;9.0+PTX"), ("10.0f;9.0a", "9.0;10.0"),
    ("9.0;9.0+PTX", "9.0+PTX"), ("Hopper", "9.0"), ("Ampere+PTX", "8.0+PTX;8.6+PTX"), ("7.5,8.6", "7.5;8.6"),
])
def test_sanitize_arch_list(raw, fixed):
    assert cuda_env.sanitize_arch_list(raw) == fixed


def test_unreadable_arch_list_is_removed_and_readable_one_left_alone():
    env = {"TORCH_CUDA_ARCH_LIST": "sm_90"}
    note = cuda_env.apply(env)
    assert "TORCH_CUDA_ARCH_LIST" not in env and "sm_90" in note
    env = {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}
    assert cuda_env.apply(env) is None and env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    assert cuda_env.apply({}) is None


def test_deepspeed_op_builder_fails_on_9_0a_and_works_after_apply(monkeypatch):
    """DeepSpeed's own CUDA FusedAdam builder parses the arch list on any machine: reproduce, then fix."""
    builder = importlib.import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    assert "9.0" in cuda_env.apply()
    args = builder.compute_capability_args()
    assert any("sm_90" in a for a in args)


def test_no_optimizer_block_gets_torch_adamw_from_the_run_config():
    choice, ds = choose_optimizer({"zero_optimization": {"stage": 1}}, "auto", "cuda", VALUES)
    assert choice.implementation == "torch_fused" and choice.decoupled
    assert choice.params == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert "optimizer" not in ds and "run config" in choice.description


def test_block_numbers_are_used_and_block_removed():
    cfg = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-6,
                                                    "weight_decay": 0.0, "adam_w_mode": False}}}
    choice, ds = choose_optimizer(cfg, "auto", "cpu", VALUES)
    assert choice.implementation == "torch_foreach" and not choice.decoupled
    assert choice.params == {"lr": 1e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.0}
    assert "optimizer" not in ds and "optimizer" in cfg  # the input is not modified
    opt = choice.factory()([torch.nn.Parameter(torch.zeros(3))])
    assert type(opt) is torch.optim.Adam and opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["foreach"]


@pytest.mark.parametrize("cfg, requested, why", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "auto", "Lamb"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "bias_correction": False}}}, "auto", "bias_correction"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "auto", "offload"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "deepspeed", "train.optimizer=deepspeed"),
])
def test_deepspeed_keeps_the_optimizer_where_it_must(cfg, requested, why):
    choice, ds = choose_optimizer(cfg, requested, "cuda", VALUES)
    assert choice.implementation == "deepspeed" and why in choice.description
    assert choice.factory() is None
    assert ds["optimizer"]["params"]["lr"] == cfg.get("optimizer", {}).get("params", {}).get("lr", 3e-4)


def test_fused_needs_cuda_or_cpu():
    choice, _ = choose_optimizer({}, "torch_fused", "cpu", VALUES)  # PyTorch has a fused CPU AdamW too
    assert choice.implementation == "torch_fused" and "fused kernel" in choice.description
    with pytest.raises(ValueError, match="needs CUDA or a CPU"):
        choose_optimizer({}, "torch_fused", "mps", VALUES)


def test_autocast_only_where_it_is_the_factory_s_call():
    resolved = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    auto = {"bf16": {"enabled": "auto"}}
    out, note = mixed_precision(resolved, auto, "auto", "cuda")
    assert out["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and not out["bf16"]["enabled"]
    assert note
    for template, device, stage in ((auto, "cpu", 0), ({"bf16": {"enabled": True}}, "cuda", 0), (auto, "cuda", 2)):
        r = {**resolved, "zero_optimization": {"stage": stage}}
        assert mixed_precision(r, template, "auto", device) == (r, "")
    forced, _ = mixed_precision({**resolved, "zero_optimization": {"stage": 2}}, auto, "autocast", "cpu")
    assert forced["torch_autocast"]["enabled"]
    fp32 = {"bf16": {"enabled": False}}
    assert mixed_precision(fp32, auto, "autocast", "cuda") == (fp32, "")


def test_plan_for_a_gpu_compiles_fuses_and_says_so(tmp_path):
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    cfg = load_run_config("models/gpt/recipes/tiny.json", [f"--output.dir={tmp_path}"])
    hw = Hardware("cuda", 80 * 10**9, 256 * 10**9, 8, True, True, "test GPU")
    plan = plan_engine(cfg, 1, hw=hw)
    assert plan.compile and plan.optimizer.implementation == "torch_fused"
    assert "optimizer" not in plan.ds_config and plan.ds_config["torch_autocast"]["enabled"]
    assert "torch.compile on" in plan.explanation and "fused kernel" in plan.explanation
    cpu = plan_engine(load_run_config("models/gpt/recipes/tiny.json",
                                      [f"--output.dir={tmp_path}", "--deepspeed.precision=fp32"]), 1,
                      hw=Hardware("cpu", 8 * 10**9, 8 * 10**9, 1, False, False, "cpu"))
    assert not cpu.compile and cpu.optimizer.implementation == "torch_foreach"
    assert "torch_autocast" not in cpu.ds_config


def test_auto_zero_sizes_scale_with_the_model_and_keep_numbers():
    from dstrain.engine.zero_tuning import fill_zero_sizes, zero_sizes
    assert zero_sizes(886_144, 128)["reduce_bucket_size"] == 886_144  # small model: one bucket
    assert zero_sizes(710_000_000, 1280)["reduce_bucket_size"] == 50_000_000
    assert zero_sizes(10_000, 1024)["reduce_bucket_size"] == 1024 * 1024  # never below hidden**2
    assert zero_sizes(1, 64)["stage3_param_persistence_threshold"] == 100_000
    template = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": 7,
                                      "overlap_comm": True}}
    out = fill_zero_sizes(template, 710_000_000, 1280)
    assert out["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 50_000_000,
                                        "stage3_prefetch_bucket_size": 7, "overlap_comm": True}
    assert template["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_replaced_parameters_get_the_state_their_optimizer_builds():
    """DeepSpeed's 16-bit wrapper swaps an Adagrad's parameters for fp32 copies after construction:
    the stale state goes and the copies get Adagrad's initial state (torch 2.11's Adagrad has no lazy
    init and failed with KeyError 'sum'), so a step equals a fresh Adagrad's step on the copies."""
    from types import SimpleNamespace

    from dstrain.optim.lazy_state import drop_stale_optimizer_state, init_missing_state
    torch.manual_seed(0)
    half = [torch.nn.Parameter(torch.randn(3, 2).bfloat16()), torch.nn.Parameter(torch.randn(4).bfloat16())]
    opt = torch.optim.Adagrad(half, lr=0.1, initial_accumulator_value=0.5, eps=1e-8)
    copies = [torch.nn.Parameter(p.detach().float()) for p in half]
    opt.param_groups[0]["params"] = copies
    assert drop_stale_optimizer_state(SimpleNamespace(optimizer=SimpleNamespace(optimizer=opt))) == 2
    assert set(opt.state) == set(copies)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in copies]
    ref = torch.optim.Adagrad(twins, lr=0.1, initial_accumulator_value=0.5, eps=1e-8)
    for ps in (copies, twins):
        for p in ps:
            p.grad = torch.ones_like(p)
    opt.step()
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(copies, twins))
    assert opt.state_dict()["state"][0]["sum"].tolist() == ref.state_dict()["state"][0]["sum"].tolist()
    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    init_missing_state(adam)  # builds its state in step: nothing to add
    assert len(adam.state) == 0


def test_compile_mode_reaches_torch_compile_and_the_plan(tmp_path):
    """``train.compile_mode`` (reduce-overhead: CUDA graphs) goes to DeepSpeed's engine.compile as torch.compile's
    mode, and plan.txt says it; "default" passes no mode; anything else is a config error."""
    from types import SimpleNamespace

    from dstrain.config import ConfigError, load_run_config
    from dstrain.engine.compiling import compile_engine
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    hw = Hardware("cuda", 80 * 10**9, 256 * 10**9, 8, True, True, "test GPU")
    cfg = load_run_config("models/gpt/recipes/tiny.json", [f"--output.dir={tmp_path}",
                                                           "--train.compile_mode=reduce-overhead"])
    plan = plan_engine(cfg, 1, hw=hw)
    assert plan.compile and plan.compile_mode == "reduce-overhead"
    assert "torch.compile on (train.compile=auto, mode reduce-overhead)" in plan.explanation
    seen = []
    engine = SimpleNamespace(compile=lambda compile_kwargs: seen.append(compile_kwargs))
    compile_engine(engine, plan.compile_mode)
    compile_engine(engine)
    assert seen == [{"dynamic": False, "mode": "reduce-overhead"}, {"dynamic": False}]
    with pytest.raises(ConfigError, match="train.compile_mode: must be one of default, reduce-overhead"):
        load_run_config("models/gpt/recipes/tiny.json", [f"--output.dir={tmp_path}", "--train.compile_mode=fast"])


@pytest.mark.parametrize("recipe", ["models/policy/recipes/grpo_debug.json", "models/policy/recipes/score_debug.json"])
def test_auto_compile_leaves_variable_shape_trainers_eager(tmp_path, recipe):
    """RL batches are padded to each step's longest completion: with static shapes torch.compile would
    compile again at every new width, so train.compile=auto does not compile them (true still does)."""
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    hw = Hardware("cuda", 80 * 10**9, 256 * 10**9, 8, True, True, "test GPU")
    plan = plan_engine(load_run_config(recipe, [f"--output.dir={tmp_path}"]), 1, hw=hw)
    assert not plan.compile and "sequence widths change every step" in plan.explanation
    forced = plan_engine(load_run_config(recipe, [f"--output.dir={tmp_path}", "--train.compile=true"]), 1, hw=hw)
    assert forced.compile and "torch.compile on (train.compile=True" in forced.explanation


def test_zero_init_auto_stays_off_under_tensor_parallelism(tmp_path):
    """zero_init auto builds under zero.Init when full copies would crowd the host, but never with tp or sp
    > 1: their layers split full weights after the build (a 2-rank tp run died on a [0]-shaped shard)."""
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    hw = Hardware("cpu", 64 * 10**9, 10**6, 2, False, False, "cpu with little host memory")
    recipe = "models/dilated_lm/recipes/debug.json"
    base = [f"--output.dir={tmp_path}", "--deepspeed.profile=zero3", "--deepspeed.precision=fp32"]
    assert plan_engine(load_run_config(recipe, [*base, "--parallel.sp=1"]), 2, hw=hw).shard_at_build
    for layout in (["--parallel.sp=1", "--parallel.tp=2"], ["--parallel.sp=2"]):
        assert not plan_engine(load_run_config(recipe, [*base, *layout]), 2, hw=hw).shard_at_build


def test_step_reports_an_update_deepspeeds_loss_scaler_skipped():
    """fp16: DeepSpeed skips an update whose gradients overflowed (skipped_steps + 1); Engine.step says so,
    so HRM's puzzle-embedding update and EMA skip it too rather than writing inf/NaN into the table."""
    from types import SimpleNamespace

    from dstrain.engine.factory import Engine
    overflow = [False, True, False]

    def ds_step():
        ds.global_steps += 1
        ds.skipped_steps += overflow[ds.global_steps - 1]

    ds = SimpleNamespace(skipped_steps=0, global_steps=0, step=ds_step, is_gradient_accumulation_boundary=lambda: True)
    engine = Engine(ds, SimpleNamespace(zero={"stage": 0}, precision="fp16", compile=False, compile_mode="default",
                                    attention_backend="auto"))
    assert [engine.step() for _ in overflow] == [True, False, True]
    assert engine.updates == 2 and engine.last_step_taken


@pytest.mark.parametrize("mode, copied", [("reduce-overhead", True), ("max-autotune", True), ("default", False),
                                          ("max-autotune-no-cudagraphs", False)])
def test_engine_copies_outputs_out_of_cuda_graph_memory(mode, copied):
    """Under CUDA graphs a replay's outputs are overwritten by the next replay; a recurrent carry (HRM's z_H,
    read by the next segment) or a loss logged at the end of the step must be copies."""
    from types import SimpleNamespace

    from dstrain.engine.factory import Engine
    carry, loss = torch.ones(2, 3), torch.ones((), requires_grad=True) * 2
    engine = Engine(lambda *a: (loss, {"z_H": carry, "metrics": {"n": 4}}),
                    SimpleNamespace(zero={"stage": 0}, precision="bf16", compile=True, compile_mode=mode,
                                    attention_backend="auto"))
    got_loss, out = engine()
    assert (out["z_H"].data_ptr() != carry.data_ptr()) == copied and torch.equal(out["z_H"], carry)
    assert (got_loss is not loss) == copied and out["metrics"] == {"n": 4}
    got_loss.backward()  # the copy stays in the autograd graph


@pytest.mark.parametrize("nonfinite, file_says, expected", [("stop", None, False), ("skip", None, False),
                                                            ("off", None, None), ("stop", True, True)])
def test_deepspeeds_bf16_overflow_check_gives_way_to_dstrains_guard(tmp_path, nonfinite, file_says, expected):
    """ZeRO-1/2 bf16: DeepSpeed tests every gradient for NaN/Inf (a dozen launches each) unless told not to;
    dstrain's guard already checks them, so the factory turns it off unless the guard is off or the file
    sets it."""
    import json

    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    profile = json.loads(open("ds_configs/zero2.json").read())
    if file_says is not None:
        profile["bf16"] = {**profile.get("bf16", {}), "check_grad_overflow": file_says}
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps(profile))
    cfg = load_run_config("models/gpt/recipes/tiny.json", [f"--output.dir={tmp_path}", f"--deepspeed.profile={path}",
                                                           "--deepspeed.precision=bf16", f"--train.nonfinite={nonfinite}"])
    plan = plan_engine(cfg, 2, ranks_per_node=2, device_type="cpu")
    assert plan.ds_config["bf16"]["enabled"] is True
    assert plan.ds_config["bf16"].get("check_grad_overflow") is expected
    assert ("check_grad_overflow -> false" in plan.explanation) == (expected is False)


@pytest.mark.parametrize("sections, expected", [({}, "fp32"), ({"fp16": {"enabled": False}}, "fp32"),
                                                ({"bf16": {"enabled": True}}, "bf16"),
                                                ({"bfloat16": {"enabled": True}}, "bf16"),
                                                ({"bf16": {"enabled": "auto"}}, "bf16"),
                                                # strings DeepSpeed's parser reads as booleans
                                                ({"bf16": {"enabled": "true"}}, "bf16"),
                                                ({"bf16": {"enabled": "False"}}, "fp32")])
def test_a_file_that_never_enables_16_bit_trains_fp32(tmp_path, sections, expected):
    """As DeepSpeed reads it: a user's JSON without an enabled (or "auto") bf16/fp16 section is fp32, even on
    a machine with fast bf16 (the hardware below has it); "auto" leaves the choice to the factory."""
    import json

    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1},
                                **sections}))
    cfg = load_run_config("models/gpt/recipes/tiny.json", [f"--output.dir={tmp_path}", f"--deepspeed.profile={path}"])
    hw = Hardware(device_type="cpu", device_memory=64 << 30, host_memory=64 << 30, ranks_per_node=2,
                  bf16_supported_fast=True, fp16_supported=False, name="test cpu")
    assert plan_engine(cfg, 2, hw=hw).precision == expected


def test_compile_scope_regions_for_models_that_name_them(tmp_path):
    """HRM names its H and L modules as compile regions: auto compiles those on a GPU (each traced once for the
    many calls of a segment) unless the mode records CUDA graphs; the whole model otherwise, and for models
    that name none. A scope that cannot be had is a config error naming the key."""
    from dstrain.config import ConfigError, load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    from models.hrm import SPEC
    hw = Hardware("cuda", 80 * 10**9, 256 * 10**9, 8, True, True, "test GPU")
    hrm = "models/hrm/recipes/sudoku_debug.json"

    def plan(recipe, *extra):
        return plan_engine(load_run_config(recipe, [f"--output.dir={tmp_path}", *extra]), 1, hw=hw)

    auto = plan(hrm)
    assert auto.compile and auto.compile_regions is SPEC.compile_regions
    assert "scope regions: the modules the hrm model names" in auto.explanation
    assert plan(hrm, "--train.compile_scope=model").compile_regions is None
    graphs = plan(hrm, "--train.compile_mode=reduce-overhead")
    assert graphs.compile and graphs.compile_regions is None and "scope regions" not in graphs.explanation
    with pytest.raises(ConfigError, match="train.compile_scope: regions cannot run under compile_mode reduce-overhead"):
        plan(hrm, "--train.compile_scope=regions", "--train.compile_mode=reduce-overhead")
    gpt = plan("models/gpt/recipes/tiny.json")
    assert gpt.compile and gpt.compile_regions is None
    with pytest.raises(ConfigError, match="train.compile_scope: regions needs a model that names its compile regions; gpt"):
        plan("models/gpt/recipes/tiny.json", "--train.compile_scope=regions")
    with pytest.raises(ConfigError, match="train.compile_scope: must be one of auto, model, regions"):
        load_run_config(hrm, [f"--output.dir={tmp_path}", "--train.compile_scope=layers"])


def test_compile_engine_compiles_the_regions_in_place():
    """compile_engine with regions marks HRM's H and L modules compiled in place (torch.compile is lazy: nothing
    is traced here) and leaves the rest of the model, and every parameter name, as it was."""
    from types import SimpleNamespace

    from dstrain.engine.compiling import compile_engine
    from models import registry
    spec = registry.get_spec("hrm")
    model = spec.build(registry.make_model_config("hrm", "tiny", {}))
    names = [n for n, _ in model.named_parameters()]
    compile_engine(SimpleNamespace(module=model), "default", spec.compile_regions)
    regions = spec.compile_regions(model)
    assert [id(r) for r in regions] == [id(model.H_level), id(model.L_level)]
    assert all(r._compiled_call_impl is not None for r in regions)
    assert model._compiled_call_impl is None and model.lm_head._compiled_call_impl is None
    assert [n for n, _ in model.named_parameters()] == names


@pytest.mark.slow  # about 20 s of Inductor compilation on 2 cores
def test_compiled_regions_train_like_the_eager_model():
    """compile_engine with regions compiles HRM's H and L modules in place (parameter names unchanged) and one
    ACT segment's loss and gradients equal the eager model's."""
    from types import SimpleNamespace

    from dstrain.engine.compiling import compile_engine
    from models import registry
    spec = registry.get_spec("hrm")
    cfg = registry.make_model_config("hrm", "tiny", {})
    torch.manual_seed(0)
    eager = spec.build(cfg).train()
    compiled = spec.build(cfg).train()
    compiled.load_state_dict(eager.state_dict())
    names = [n for n, _ in compiled.named_parameters()]
    compile_engine(SimpleNamespace(module=compiled), "default", spec.compile_regions)
    assert [n for n, _ in compiled.named_parameters()] == names
    assert all(r._compiled_call_impl is not None for r in spec.compile_regions(compiled))
    x = torch.randint(1, cfg.vocab_size, (4, cfg.seq_len))
    losses = []
    for model in (eager, compiled):
        torch.manual_seed(1)  # the same exploration draws
        loss, _ = model(x, x)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_attention_backend_orders_sdpa_inside_each_forward(tmp_path):
    """train.attention_backend=cudnn: every engine forward runs with cuDNN's attention first in SDPA's priority
    order (then PyTorch's own), restored afterwards; auto leaves PyTorch's order; on the CPU, where cuDNN
    cannot serve, GPT's output is the same bit for bit; anything else is a config error."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend

    from dstrain.config import ConfigError, load_run_config
    from dstrain.engine.factory import Engine, plan_engine
    from dstrain.ops.attention import sdpa_priority
    from models.gpt.model import GPT, GPTConfig
    default = torch._C._get_sdp_priority_order()
    seen = []

    def forward(*args):
        seen.append(torch._C._get_sdp_priority_order())
        return torch.zeros(())

    for backend in ("cudnn", "auto"):
        Engine(forward, SimpleNamespace(zero={"stage": 0}, precision="fp32", compile=False, compile_mode="default",
                                        attention_backend=backend))()
        assert torch._C._get_sdp_priority_order() == default
    assert seen[0][0] == int(SDPBackend.CUDNN_ATTENTION) and seen[0][1] == int(SDPBackend.FLASH_ATTENTION)
    assert seen[1] == default
    from dstrain.parallel.pipeline import PipelineEngine
    ds = SimpleNamespace(train_batch=lambda it: forward(), eval_batch=lambda it, num_micro_batches: forward())
    pipe = PipelineEngine(ds, SimpleNamespace(zero={"stage": 0}, precision="fp32", compile=False,
                                              compile_mode="default", attention_backend="cudnn"))
    pipe.train_batch(iter(()))
    pipe.eval_batch(iter(()))
    assert seen[2][0] == seen[3][0] == int(SDPBackend.CUDNN_ATTENTION)  # the pipeline engine's batches too
    assert torch._C._get_sdp_priority_order() == default
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32, vocab_size=53))
    x = torch.randint(0, 53, (2, 32))
    with sdpa_priority("cudnn"):
        ours = model(x, x)
    assert torch.equal(ours, model(x, x))
    plan = plan_engine(load_run_config("models/gpt/recipes/tiny.json",
                                       [f"--output.dir={tmp_path}", "--train.attention_backend=cudnn"]), 1)
    assert plan.attention_backend == "cudnn" and "attention: SDPA tries cudnn's kernels first" in plan.explanation
    with pytest.raises(ConfigError, match="train.attention_backend: must be auto or cudnn"):
        load_run_config("models/gpt/recipes/tiny.json", [f"--output.dir={tmp_path}", "--train.attention_backend=fa3"])
    with pytest.raises(ValueError, match="attention backend must be one of auto, cudnn"):
        sdpa_priority("fa3")
