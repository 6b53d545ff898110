"""Round 9 of real-world DeepSpeed JSONs: scheduler and quantization keys DeepSpeed 0.19.8's config parser stores
as written and acts on only once the engine builds the scheduler or the model. Each passed dstrain's checks before
this round:
``lr_range_test_step_size`` 0 or 2.5 (LRRangeTest raises ValueError 'must be a positive integer' in initialize, on
every rank), OneCycle's ``cycle_first_step_size`` 0 and a negative ``cycle_second_step_size`` (ValueError the same
way), ``last_batch_iteration`` other than -1 in WarmupLR / WarmupDecayLR / WarmupCosineLR / OneCycle / LRRangeTest (a
fresh run started partway into the schedule, and DeepSpeed left the first step at ``optimizer.params.lr``: it trained
as no one wrote it), and a ``weight_quantization`` block: ``post_init_quant`` is read only by DeepSpeed's inference
quantization (the run trained unquantized) and ``quantized_initialization`` acts only inside ``zero.Init`` (without
it: unquantized; with ``--deepspeed.zero_init=true`` on the CPU the first step's gradient was non-finite, exit 3),
torch's ``LambdaLR`` / ``SequentialLR`` (and ``MultiplicativeLR`` / ``ChainedScheduler``: their arguments are Python
objects; DeepSpeed passed the JSON's text on and torch failed building them) and a torch ``OneCycleLR`` shorter than
``train.steps`` (torch raised 'Tried to step 3 times' at step 3 of a 3-step run, after the step-2 checkpoint; now
compared with the run's length before launch, in dstrain.engine.ds_preflight.check_run), and values torch's own
scheduler constructors refuse (``LinearLR`` ``start_factor`` 0, ``CosineAnnealingWarmRestarts`` ``T_0`` 0: the
class is now built once on a stand-in optimizer before launch).
Each is now refused before launch naming the key and the fix (dstrain.engine.ds_engine_keys).
Also in the round, handled before it and pinned by tests/configs: bf16 weights with fp16 accumulation on the CPU, a
negative ``gradient_clipping``, per-group lists of ``warmup_max_lr`` (refused), and, trained 3 steps with a checkpoint
at step 2, AdamW with ``adam_w_mode: false`` (still AdamW, for DeepSpeed and dstrain), OneCycle with
``decay_step_size`` 0, OpenRLHF's ZeRO-2 bf16 file with fp32 accumulation and stage-3 leftovers, ZeRO-2 with
``allgather_bucket_size`` 0, ``reduce_scatter`` false and ``load_from_fp32_weights`` false (resumed too), ZeRO-3 with
``sub_group_size`` 0, ``stage3_prefetch_bucket_size`` 0 and parameter offload ``buffer_count`` 0, and torch's
``OneCycleLR`` with ``total_steps`` past the run's length."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_sections import section_problems

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


def _refusals(name: str) -> list[str]:
    with pytest.raises(DSConfigError) as err:
        check_ds_file(CONFIGS / name, device_type="cpu", world_size=2)
    return err.value.problems


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


def _scheduler(kind: str, **params) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": kind, "params": params}}


# --------------------------------------------------------------------------- LRRangeTest / OneCycle step sizes


@pytest.mark.parametrize("size", [0, 2.5, -3])
def test_an_lr_range_test_step_size_deepspeed_raises_on_is_refused(size):
    from deepspeed.runtime.lr_schedules import LRRangeTest
    with pytest.raises(ValueError, match="lr_range_test_step_size must be a positive integer"):
        LRRangeTest(_optimizer(), lr_range_test_step_size=size)  # before: in initialize, on every rank
    problems, _ = section_problems(_scheduler("LRRangeTest", lr_range_test_step_size=size), "cpu")
    assert problems == [f"scheduler.params.lr_range_test_step_size: LRRangeTest needs a positive integer, file says "
                        f"{size!r} (DeepSpeed raises ValueError when the engine builds the scheduler, on every rank); "
                        "write a positive integer (the number of steps per lr change)"]


def test_lr_range_test_and_one_cycle_sizes_deepspeed_takes_pass():
    from deepspeed.runtime.lr_schedules import LRRangeTest, OneCycle
    LRRangeTest(_optimizer(), lr_range_test_step_size=2)
    OneCycle(_optimizer(), 1e-4, 1e-3, cycle_first_step_size="2000", cycle_momentum=False, decay_step_size=0)
    for cfg in (_scheduler("LRRangeTest", lr_range_test_step_size=2),
                _scheduler("OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size="2000",
                           cycle_second_step_size=0, decay_step_size=0, cycle_momentum=False)):
        assert section_problems(cfg, "cpu")[0] == []
    assert "ZeRO stage 0" in check_ds_file(CONFIGS / "onecycle_decay_step_size_zero.json", device_type="cpu",
                                           world_size=2)


@pytest.mark.parametrize("key, size, want", [("cycle_first_step_size", 0, "a number > 0"),
                                             ("cycle_second_step_size", -1, "a number >= 0")])
def test_one_cycle_step_sizes_deepspeed_raises_on_are_refused(key, size, want):
    from deepspeed.runtime.lr_schedules import OneCycle
    sizes = {"cycle_first_step_size": 2, key: size}
    with pytest.raises(ValueError, match=f"{key} must be"):
        OneCycle(_optimizer(), 1e-4, 1e-3, cycle_momentum=False, **sizes)
    problems, _ = section_problems(_scheduler("OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, **sizes), "cpu")
    assert len(problems) == 1 and problems[0].startswith(f"scheduler.params.{key}: OneCycle needs {want}, file says "
                                                         f"{size}")


def test_the_step_size_files_are_refused_in_one_line_each():
    assert _refusals("lr_range_test_step_size_zero.json")[0].startswith("scheduler.params.lr_range_test_step_size:")
    assert "file says 2.5" in _refusals("lr_range_test_step_size_fraction.json")[0]
    assert _refusals("onecycle_first_step_size_zero.json")[0].startswith("scheduler.params.cycle_first_step_size:")
    assert _refusals("onecycle_second_step_size_negative.json")[0].startswith(
        "scheduler.params.cycle_second_step_size:")


# --------------------------------------------------------------------------- last_batch_iteration


def test_a_schedule_started_partway_leaves_the_first_step_at_the_optimizer_lr_and_is_refused():
    from deepspeed.runtime.lr_schedules import WarmupLR
    fresh, partway = _optimizer(), _optimizer()
    WarmupLR(fresh, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=10)
    WarmupLR(partway, warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=10, last_batch_iteration=5)
    assert fresh.param_groups[0]["lr"] == 0.0  # the schedule sets the first step's lr
    assert partway.param_groups[0]["lr"] == 1e-3  # before: the first step trained at optimizer.params.lr
    for kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        problems, _ = section_problems(_scheduler(kind, last_batch_iteration=5), "cpu")
        assert [p for p in problems if p.startswith("scheduler.params.last_batch_iteration:")] == [
            f"scheduler.params.last_batch_iteration: 5 starts a fresh run partway into {kind} (and DeepSpeed then "
            "leaves the first step at optimizer.params.lr, not the schedule's lr); remove it (or write -1): dstrain's "
            "--resume restores the scheduler's position from the checkpoint"]
    assert section_problems(_scheduler("WarmupLR", last_batch_iteration=-1, warmup_num_steps=2), "cpu")[0] == []
    assert "WarmupLR" in _refusals("warmuplr_last_batch_iteration.json")[0]
    assert "WarmupCosineLR" in _refusals("warmup_cosine_last_batch_iteration.json")[0]


# --------------------------------------------------------------------------- weight_quantization


def test_post_init_quant_is_never_read_by_the_training_engine_and_is_refused():
    import inspect

    from deepspeed.runtime import engine
    from deepspeed.runtime.zero import partition_parameters
    from deepspeed.inference.quantization import quantization
    assert "post_init_quant" in inspect.getsource(quantization)  # DeepSpeed's inference helper reads it ...
    for module in (engine, partition_parameters):  # ... its training engine never does (before: trained unquantized)
        assert "post_init_quant" not in inspect.getsource(module)
    block = {"post_init_quant": {"fc": {"num_bits": 8, "group_size": 64}}}
    problems, _ = section_problems({"weight_quantization": block}, "cpu")
    assert problems == ["weight_quantization.post_init_quant: read only by DeepSpeed's inference quantization, never "
                        "by the training engine (the weights would train unquantized, not as the file says); remove "
                        "it (or the weight_quantization block) for training"]
    assert section_problems({"weight_quantization": {**block, "enabled": False}}, "cpu")[0] == []
    assert _refusals("zero3_weight_quantization_post_init_quant.json")[0].startswith(
        "weight_quantization.post_init_quant:")


def test_quantized_initialization_is_refused_whatever_enabled_says():
    from deepspeed.runtime.config import DeepSpeedConfig
    block = {"enabled": False, "quantized_initialization": {"num_bits": 8, "group_size": 64}}
    parsed = DeepSpeedConfig({"train_batch_size": 8, "weight_quantization": block})
    assert parsed.weight_quantization_config.quantized_initialization  # what zero.Init tests: "enabled" is not read
    problems, _ = section_problems({"zero_optimization": {"stage": 3}, "weight_quantization": block}, "cpu")
    assert len(problems) == 1 and problems[0].startswith(
        "weight_quantization.quantized_initialization: DeepSpeed quantizes the weights only inside zero.Init")
    assert "remove it (or the weight_quantization block)" in _refusals(
        "zero3_weight_quantization_quantized_init.json")[0]


# --------------------------------------------------------------------------- torch schedulers a JSON cannot drive


@pytest.mark.parametrize("kind, arg, params", [("LambdaLR", "lr_lambda", {"lr_lambda": "lambda s: 1.0"}),
                                               ("SequentialLR", "schedulers",
                                                {"schedulers": ["LinearLR"], "milestones": [2]})])
def test_torch_schedulers_that_take_python_objects_are_refused(kind, arg, params):
    scheduler = getattr(torch.optim.lr_scheduler, kind)
    with pytest.raises((TypeError, AttributeError)):  # before: what DeepSpeed hit building it, on every rank
        scheduler(_optimizer(), **params)
    problems, _ = section_problems(_scheduler(kind, **params), "cpu")
    assert problems == [f"scheduler.type: torch's {kind} takes Python objects as {arg}, which a JSON file cannot hold "
                        "(DeepSpeed passes the text on and torch fails when the engine builds it); use one of "
                        "DeepSpeed's schedulers (WarmupCosineLR, WarmupDecayLR, ...) or remove the block (dstrain's "
                        "warm-up + cosine)"]


def test_a_torch_one_cycle_lr_shorter_than_the_run_is_refused_with_the_run_length():
    from dstrain.engine.ds_engine_keys import run_length_problems
    optimizer = _optimizer()
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, epochs=1, steps_per_epoch=2)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    optimizer.step()
    with pytest.raises(ValueError, match="Tried to step 3 times"):  # before: every rank stopped at step 3
        scheduler.step()
    short = _scheduler("OneCycleLR", max_lr=1e-3, epochs=1, steps_per_epoch=2)
    assert run_length_problems(short, 3) == [
        "scheduler.params.epochs: torch's OneCycleLR runs 2 steps (epochs x steps_per_epoch) and the run 3 (it raises "
        "'Tried to step 3 times' at step 3, on every rank); write \"total_steps\": 3, or run --train.steps=2"]
    assert run_length_problems(short, 2) == []
    assert run_length_problems(_scheduler("OneCycleLR", max_lr=1e-3, total_steps=5), 6)[0].startswith(
        "scheduler.params.total_steps: torch's OneCycleLR runs 5 steps (total_steps) and the run 6")
    assert run_length_problems(_scheduler("OneCycleLR", max_lr=1e-3), 4)[0].startswith(
        "scheduler.params.total_steps: torch's OneCycleLR needs total_steps")
    assert run_length_problems(_scheduler("WarmupLR", warmup_num_steps=2), 4) == []


@pytest.mark.parametrize("kind, params, message", [
    ("LinearLR", {"start_factor": 0, "total_iters": 2}, "Starting multiplicative factor expected to be greater than 0"),
    ("CosineAnnealingWarmRestarts", {"T_0": 0}, "Expected positive integer T_0, but got 0")])
def test_values_torch_schedulers_refuse_are_named_before_launch(kind, params, message):
    with pytest.raises(ValueError, match=message):  # before: raised in initialize, on every rank
        getattr(torch.optim.lr_scheduler, kind)(_optimizer(), **params)
    problems, _ = section_problems(_scheduler(kind, **params), "cpu")
    assert len(problems) == 1 and problems[0].startswith(f"scheduler.params: torch's {kind} refuses the file's "
                                                         f"params ({message}")
    good = {"start_factor": 0.5, "total_iters": 2} if kind == "LinearLR" else {"T_0": 2}
    assert section_problems(_scheduler(kind, **good), "cpu")[0] == []
