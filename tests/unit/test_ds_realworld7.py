"""Round 7 of real-world DeepSpeed JSONs: DeepSpeed 0.19's checkpoint ``writer`` block (its default type, "fast",
pins an I/O buffer for the async_io kernel when the engine starts, so every rank failed on the CPU after a clean
check; now refused with the fix, "type": "python", which trains and checkpoints), an AutoEP ``expert_parallel``
section (DeepSpeed raises "no MoE layers detected" on dstrain's models; refused), ``"warmup_num_steps": 0`` (DeepSpeed
0.19's warm-up schedulers raise on it, and the refusal offered ``--train.warmup_steps=0``, which fills 1 and is
refused again; now a range problem: a positive integer), a ``zero_hpz_partition_size`` whose blocks do not divide
the data-parallel ranks (DeepSpeed asserts; refused with a divisor), ``offload_param`` below stage 3 (refused
without a fix; now it names one), and plan.txt saying "DeepSpeed's CPU Adam" for Lion, Adagrad and ``torch_adam``
under optimizer offload (DeepSpeed builds its CPU Lion / CPU Adagrad / torch's AdamW there).
Also in the round, handled before it and pinned by tests/configs: Adam with ``"adam_w_mode": false`` (L2, torch's
Adam), an optimizer block without params and a WarmupLR without params, CPU Adagrad / CPU Lion / ``torch_adam`` /
``fp32_optimizer_states`` under offload, ``torch.optim.Adafactor`` with ``zero_allow_untested_optimizer``, LRRangeTest
staircase, flops_profiler ``recompute_fwd_factor``, ``checkpoint.parallel_write``, ZeRO-3 with no prefetch and no
live parameters, hpZ larger than the world, and refusals of MoQ ``quantize_training``, random-LTD, MiCS (even
``mics_shard_size: -1``: DeepSpeed rejects the key), LoCo ZeRO++ and parameter NVMe offload without libaio."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError, range_problem
from dstrain.engine.ds_sections import section_problems

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


from tests.unit.test_ds_realworld6 import _cpu_accelerator, _write  # noqa: F401 (the fixture is autouse here too)


# --------------------------------------------------------------------------- checkpoint writer


@pytest.mark.parametrize("writer", [{"type": "fast", "io_buffer_size": 1e9}, {"type": "FAST"}, {"decoupled": False}])
def test_the_fast_checkpoint_writer_is_refused_on_the_cpu_with_the_fix(writer):
    """Before: it passed the checks and every rank failed in ``deepspeed.initialize`` (``_setup_for_aio`` pins the
    writer's buffer: 'Cannot access accelerator device when none is available')."""
    # with a data_parallel unit: without one (below stage 3) every rank stops earlier, refused since round 11
    cfg = {"checkpoint": {"tag_validation": "Warn", "writer": {**writer, "data_parallel": "replica"}}}
    problems, _ = section_problems(cfg, "cpu")
    assert problems == ["checkpoint.writer.type: DeepSpeed's fast checkpoint writer (a writer block's default type) "
                        "pins its I/O buffer for the async_io kernel when the engine starts, which the CPU "
                        "accelerator cannot (every rank would fail); set \"type\": \"python\" or remove "
                        "checkpoint.writer"]
    assert section_problems(cfg, "cuda")[0] == []


def test_the_python_writer_and_other_checkpoint_keys_pass():
    # load_universal true is refused since round 8 (every resume stopped): test_ds_realworld8.py; the "mock" writer
    # since round 11 (it writes empty checkpoint files): test_ds_realworld11.py
    for ck in ({"writer": {"type": "python", "data_parallel": "replica"}},
               {"parallel_write": {"pipeline_stage": True}}, {"load_universal": False, "use_node_local_storage": True}):
        assert section_problems({"checkpoint": ck}, "cpu")[0] == [], ck


# --------------------------------------------------------------------------- AutoEP


def test_an_enabled_autoep_section_is_refused_and_a_disabled_one_passes():
    problems, _ = section_problems({"expert_parallel": {"enabled": True, "autoep_size": 2,
                                                        "preset_model": "mixtral"}}, "cpu")
    assert len(problems) == 1 and problems[0].startswith("expert_parallel.enabled: DeepSpeed's AutoEP replaces a "
                                                         "model's MoE layers, and dstrain's models have none")
    assert problems[0].endswith("set it to false or remove the section")
    assert section_problems({"expert_parallel": {"enabled": False, "autoep_size": 2}}, "cpu")[0] == []


def test_deepspeed_itself_finds_no_moe_layer_in_dstrains_gpt():
    """What the refusal prevents: DeepSpeed's AutoEP raises on every rank for the tiny GPT with a preset."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config

    from models import registry
    model = registry.get_spec("gpt").build(registry.make_model_config("gpt", "tiny", None))
    with pytest.raises(ValueError, match="AutoEP: no MoE layers detected for preset_model='mixtral'"):
        AutoEP(model, parse_autoep_config({"enabled": True, "autoep_size": 2, "preset_model": "mixtral"})).ep_parser()


# --------------------------------------------------------------------------- warm-up of 0 steps


def test_zero_warmup_steps_is_a_range_problem_not_an_override_that_cannot_help(tmp_path):
    """Before: 'file says 0, run gives 1; use --train.warmup_steps=0', but the run fills warm-up 0 as 1 (DeepSpeed
    0.19's WarmupLR / WarmupDecayLR / WarmupCosineLR raise 'warmup_num_steps must be a positive integer' on 0)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    import torch
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=0)
    assert range_problem("scheduler.params.warmup_num_steps", 1) is None
    with pytest.raises(DSConfigError) as err:
        check_ds_file(CONFIGS / "warmup_cosine_zero_warmup_steps.json", device_type="cpu", world_size=2)
    assert err.value.problems == [
        "scheduler.params.warmup_num_steps: must be a positive integer (DeepSpeed's warm-up schedulers raise on 0; 1 "
        "is the shortest warm-up) or \"auto\", file says 0"]
    assert "--train.warmup_steps" not in str(err.value)


# --------------------------------------------------------------------------- hpZ


@pytest.mark.parametrize("hpz, world, expected", [
    (3, 4, "set 2 (a divisor of 4, as the GPUs per node are) or 1 (off)"), (3, 5, "set 1 (off)"),
    (8, 2, None), (3, 6, None), (4, 8, None)])
def test_hpz_blocks_that_do_not_divide_the_ranks_are_refused(tmp_path, hpz, world, expected):
    """DeepSpeed groups the ranks in blocks of min(hpz, world) and asserts that they divide the world."""
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 3, "zero_hpz_partition_size": hpz}})
    if expected is None:
        assert "ZeRO stage 3" in check_ds_file(path, device_type="cpu", world_size=world)
        return
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=world)
    assert err.value.problems == [
        f"zero_optimization.zero_hpz_partition_size: {hpz} groups the {world} data-parallel ranks in blocks of "
        f"{min(hpz, world)}, which do not divide them (DeepSpeed asserts it when it builds the ZeRO-3 parameter "
        f"groups); {expected}"]


def test_hpz_below_stage_3_is_not_checked(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 3}})
    check_ds_file(path, device_type="cpu", world_size=4)


# --------------------------------------------------------------------------- refusals that name the fix


def test_param_offload_below_stage_3_names_the_fix():
    with pytest.raises(DSConfigError) as err:
        check_ds_file(CONFIGS / "zero1_param_offload_below_stage3.json", device_type="cpu", world_size=2)
    assert err.value.problems == [
        "zero_optimization.offload_param: parameter offload is only valid with ZeRO stage 3, file has stage 1 "
        "(DeepSpeed would silently keep parameters on the device); set \"stage\": 3, or remove offload_param"]


# --------------------------------------------------------------------------- optimizers under offload


@pytest.mark.parametrize("block, says", [
    ({"type": "Lion", "params": {"lr": 1e-4}}, "DeepSpeed builds its CPU Lion"),
    ({"type": "Adagrad", "params": {"lr": 1e-2}}, "DeepSpeed builds its CPU Adagrad"),
    ({"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "DeepSpeed builds torch.optim's Adam/AdamW"),
    ({"type": "AdamW", "params": {"lr": 1e-4}}, "DeepSpeed builds its CPU Adam"),
    (None, "DeepSpeed builds its CPU Adam")])
def test_plan_names_the_optimizer_deepspeed_builds_under_offload(block, says):
    """Before: 'optimizer offload runs DeepSpeed's CPU Adam' for every type (DeepSpeed's _configure_basic_optimizer
    builds DeepSpeedCPULion / DeepSpeedCPUAdagrad, or torch's AdamW with torch_adam)."""
    from dstrain.engine.ds_config import RunValues
    from dstrain.engine.optim import choose_optimizer
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    if block:
        cfg["optimizer"] = block
    run = RunValues(micro_batch=1, grad_accum=1, dp_world_size=2, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                    weight_decay=0.1, grad_clip=1.0, precision="fp32", hidden_size=64, total_steps=3,
                    warmup_steps=1, min_lr_ratio=0.1)
    choice, out = choose_optimizer(cfg, "auto", "cpu", run)
    assert choice.implementation == "deepspeed" and says in choice.description
    assert out["optimizer"]["type"] == (block or {"type": "AdamW"})["type"]


def test_adam_in_l2_mode_is_torch_adam_and_adamw_ignores_the_flag():
    """DeepSpeed: type Adam is AdamW unless "adam_w_mode": false; type AdamW is AdamW whatever the flag says."""
    from dstrain.engine.optim import choose_optimizer
    adam = json.loads((CONFIGS / "adam_l2_mode_weight_decay.json").read_text())
    choice, out = choose_optimizer(adam, "auto", "cpu", None)
    assert not choice.decoupled and choice.params["weight_decay"] == 0.01 and "optimizer" not in out
    assert "torch.optim.Adam (foreach)" in choice.description
    adamw = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "adam_w_mode": False}}}
    assert choose_optimizer(adamw, "auto", "cpu", None)[0].decoupled


# --------------------------------------------------------------------------- a real run of the writer's fix


@pytest.mark.dist
@pytest.mark.slow  # 34 s: the suite keeps a few representative launches (this one passed when the round was added)
def test_the_python_checkpoint_writer_trains_and_saves_on_two_cpu_ranks(tmp_path):
    """The fix the refusal names, run: 3 steps on 2 CPU ranks, then DeepSpeed's checkpoint through the writer."""
    from tests.configs.test_compat import _launch
    out = tmp_path / "run"
    proc = _launch("checkpoint_python_writer_replica.json", out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in text, text[-4000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == [1, 2, 3]
    resolved = json.loads((out / "ds_config.json").read_text())
    assert resolved["checkpoint"]["writer"]["type"] == "python"
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*/*.pt"))
    assert "mp_rank_00_model_states.pt" in saved and len([n for n in saved if "optim_states" in n]) == 2
