"""Round 22 of real-world DeepSpeed JSONs: sources not covered before: DeepSpeedExamples' CIFAR-10 script's in-code
config (bf16, stage 0, ``"cpu_offload": false``), a protein language model (ESM) fine-tuning script's in-code config
(fp32, OneCycle), a project scaffolding generator's ds_config.json for two GPUs (numbers as text, batch keys that
disagree, fp16 and bf16 both on), Megatron-DeepSpeed's MoE template as its run scripts fill it (the legacy
top-level curriculum block, off), and a language-model pruning example's ZeRO-3 config (Apex's opt_level in the fp16
block, warmup_type "cosine"). Each file's source project and path are in tests/configs/expectations_late.py.

Fixed in the round:

* Numbers written as text in the params of DeepSpeed's own schedulers beyond the four the run fills:
  ``"warmup_min_lr": "0"``, ``"warmup_min_ratio": "0.1"``, OneCycle's ``cycle_min_lr`` / ``decay_lr_rate`` /
  ``cycle_min_mom`` / stair counts, LRRangeTest's ``lr_range_test_min_lr`` / ``lr_range_test_step_rate``. DeepSpeed
  hands them to the class as written and its arithmetic fails (TypeError) when the engine builds or first steps the
  scheduler, on every rank; dstrain accepted them. Now each is refused by key with the number to write
  (dstrain/engine/ds_sched_text.py, which reads the numeric params from the classes' signatures).
* ``dstrain check-ds`` (check_ds_file) stopped at the numbers values_from_file reads (a quoted lr, batch size, ...)
  and named nothing else: the generated two-GPU file showed 2 of its 6 problems. The rest of the file is now checked
  with those keys as "auto", and every problem is named at once. ``dstrain launch`` with values_from_file stopped
  at batch keys that disagree before reading the file's numbers; it now names both kinds in one refusal.
* ``"fp16": {..., "opt_level": "O2"}`` (Apex AMP's level, kept from an Apex-era config) was "fp16.opt_level: unknown
  key; DeepSpeed rejects it"; the line now says what the key is and why DeepSpeed's fp16 has no such level.
* ``"cpu_offload": false`` (and ``cpu_offload_param``) was noted as "DeepSpeed reads it as offload_optimizer.device
  'cpu'"; DeepSpeed's deprecated-field hook sets no offload for false. The note now says so.
* A removed top-level block said only that it is "no longer supported", and the legacy ``curriculum_learning``'s fix
  pointed at data_efficiency's curriculum, which dstrain refuses in turn (its samplers feed the data). The line now
  says DeepSpeed stops on the key whatever it holds and to remove it; a block that is off (``"enabled": false``, as
  Megatron-DeepSpeed's MoE scripts fill the template) says removing it changes nothing.

Checked and correct as they were: the CIFAR and ESM configs are accepted and pass the DeepSpeedConfig cross-check in
tests/configs (both trained 3 steps on 2 CPU ranks by hand; they run with -m slow); the generated file's batch
disagreement names the three numbers; fp16 and bf16 both on, fp16 on the CPU, and the pruning config's warmup_type
"cosine" (DeepSpeed warns and warms up on the log curve) are refused with the fix.
"""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_sched_text import numeric_params, quoted_scheduler_numbers
from tests.unit.ds_rounds import CONFIGS, deepspeed_config, dry_run, refusals
from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401 (the fixture is autouse here too)

CIFAR = CONFIGS / "dsexamples_cifar_bf16_stage0_cpu_offload_false.json"
ESM = CONFIGS / "esm_finetune_onecycle_fp32_offload_none.json"
GENERATED = CONFIGS / "generated_two_gpu_zero2_quoted_lrs_batch_disagree.json"
MOE = CONFIGS / "megatron_ds_moe_template_filled_curriculum_off.json"

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
QUOTED = [("WarmupLR", {"warmup_min_lr": "0", "warmup_max_lr": 1e-4, "warmup_num_steps": 1}, "warmup_min_lr", "0"),
          ("WarmupDecayLR", {"warmup_min_lr": ["0"], "total_num_steps": 3}, "warmup_min_lr", "[0]"),
          ("WarmupCosineLR", {"total_num_steps": 3, "warmup_min_ratio": "0.1", "warmup_num_steps": 1},
           "warmup_min_ratio", "0.1"),
          ("OneCycle", {"cycle_min_lr": "1e-5", "cycle_max_lr": 1e-4, "cycle_first_step_size": 1}, "cycle_min_lr",
           "1e-5"),
          ("OneCycle", {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-4, "cycle_first_step_size": 1,
                        "decay_lr_rate": " 0.1"}, "decay_lr_rate", "0.1"),
          ("OneCycle", {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-4, "cycle_first_step_size": 1,
                        "cycle_min_mom": "0.85"}, "cycle_min_mom", "0.85"),
          ("LRRangeTest", {"lr_range_test_min_lr": "1e-5", "lr_range_test_step_size": 1}, "lr_range_test_min_lr",
           "1e-5"),
          ("LRRangeTest", {"lr_range_test_min_lr": 1e-5, "lr_range_test_step_size": 1,
                           "lr_range_test_step_rate": "1.0"}, "lr_range_test_step_rate", "1.0")]


def _write(tmp_path, cfg: dict, name: str = "ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("name, params, key, written", QUOTED)
def test_a_quoted_number_in_deepspeeds_scheduler_is_refused_by_key(tmp_path, name, params, key, written):
    import torch
    from deepspeed.runtime import lr_schedules
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-4)
    with pytest.raises(TypeError):  # what DeepSpeed itself does with it, building and stepping the scheduler
        sched = getattr(lr_schedules, name)(opt, **params)
        for _ in range(3):
            sched.step()
    (line,) = refusals(_write(tmp_path, {**BASE, "scheduler": {"type": name, "params": params}}))
    assert line.startswith(f"scheduler.params.{key}: file says {params[key]!r}, a number as text, which DeepSpeed "
                           f"hands to {name} as written")
    assert line.endswith(f"(TypeError, on every rank); write {written} without quotes")
    fixed = {**params, key: json.loads(written)}  # the fix it gives trains
    check_ds_file(_write(tmp_path, {**BASE, "scheduler": {"type": name, "params": fixed}}, "fixed.json"),
                  device_type="cpu", world_size=2)


def test_the_numeric_params_come_from_deepspeeds_signatures_and_leave_others_alone():
    assert {"warmup_min_lr", "warmup_min_ratio"} <= numeric_params("WarmupCosineLR") | numeric_params("WarmupLR")
    assert {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_stair_count"} <= numeric_params("OneCycle")
    for name in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"):
        # text params, switches, and what other checks name with their own fixes
        assert not numeric_params(name) & {"warmup_type", "cycle_momentum", "lr_range_test_staircase",
                                           "warmup_max_lr", "total_num_steps", "cycle_first_step_size"}
    assert numeric_params("StepLR") == frozenset()  # torch's classes: built and checked by torch (ds_engine_keys)
    assert quoted_scheduler_numbers("OneCycle", {"cycle_min_lr": "auto", "cycle_max_mom": "false"}) == []
    (line,) = quoted_scheduler_numbers("WarmupLR", {"warmup_min_lr": "zero"})
    assert line.endswith("; write a number")


def test_check_ds_file_names_every_problem_of_the_generated_two_gpu_file():
    lines = refusals(GENERATED)
    assert [line.split(":")[0] for line in lines] == [
        "optimizer.params.lr", "scheduler.params.warmup_max_lr", "batch keys disagree among themselves",
        "bf16.enabled, fp16.enabled", "fp16.enabled", "scheduler.params.warmup_min_lr"]
    assert ("batch keys disagree among themselves: train_batch_size 32 != train_micro_batch_size_per_gpu 16 x "
            "gradient_accumulation_steps 4 x 2 data-parallel ranks = 128") in lines[2]
    assert "write 0 without quotes" in lines[5]


def test_a_false_cpu_offload_sets_no_offload_and_is_noted_so():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    assert DeepSpeedZeroConfig(stage=1, cpu_offload=False).offload_optimizer is None  # DeepSpeed: no offload
    assert DeepSpeedZeroConfig(stage=3, cpu_offload_param=False).offload_param is None
    said = check_ds_file(CIFAR, device_type="cpu", world_size=2)
    assert said.startswith(f"{CIFAR}: valid DeepSpeed config for cpu: ZeRO stage 0; batch 8 x 1 x 2 ranks")
    assert ("zero_optimization.cpu_offload: deprecated spelling, and false sets no offload_optimizer (DeepSpeed "
            "offloads nothing for it); remove it") in said
    assert "reads it as offload_optimizer" not in said


def test_a_true_cpu_offload_is_still_read_as_offload(tmp_path):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "cpu_offload": True}}
    said = check_ds_file(_write(tmp_path, cfg), device_type="cpu", world_size=2)
    assert "ZeRO stage 2, offload optimizer" in said
    assert "zero_optimization.cpu_offload: deprecated spelling, DeepSpeed reads it as offload_optimizer.device" in said


def test_the_legacy_curriculum_block_off_is_named_with_remove_it():
    with pytest.raises(Exception, match="curriculum_learning"):  # DeepSpeed stops on it, off or not
        deepspeed_config({"curriculum_learning": {"enabled": False}})
    lines = refusals(MOE)
    (line,) = [p for p in lines if p.startswith("top-level key 'curriculum_learning'")]
    assert line.endswith("DeepSpeed stops at start-up on the key whatever it holds; the block is off (\"enabled\": "
                         "false): remove it, and nothing changes")
    assert "dstrain's samplers feed the data: no curriculum either way" in line
    assert any(p.startswith("fp16.enabled: fp16 does not run on the CPU accelerator") for p in lines)
    (line,) = refusals(CONFIGS / "legacy_curriculum_learning_top_level.json")  # on: no "nothing changes"
    assert line.endswith("whatever it holds; remove it") and "use data_efficiency" not in line


def test_the_esm_onecycle_config_is_accepted_as_fp32_with_its_notes():
    said = check_ds_file(ESM, device_type="cpu", world_size=2)
    assert said.startswith(f"{ESM}: valid DeepSpeed config for cpu: ZeRO stage 0; batch 2 x 1 x 2 ranks")
    assert "OneCycle sets the learning rate from the first step, starting at cycle_min_lr 0.0001" in said


def test_apex_opt_level_in_the_fp16_block_is_named_as_apexs():
    with pytest.raises(Exception, match="opt_level"):  # DeepSpeed's fp16 section rejects it
        deepspeed_config({"fp16": {"enabled": False, "opt_level": "O2"}})
    pruning = CONFIGS / "pruning_example_zero3_fp16_opt_level_cosine_warmup.json"
    said = refusals(pruning, device_type="cuda")  # on GPUs: the fp16 itself runs
    assert said == [
        "scheduler.params.warmup_type: WarmupDecayLR knows only \"log\" and \"linear\", file says 'cosine' (DeepSpeed "
        "would warn and warm up on the log curve instead); write \"linear\" or \"log\"",
        "fp16.opt_level: file says \"O2\", Apex AMP's optimisation level, which DeepSpeed's fp16 section does not "
        "take (DeepSpeed's fp16 is one mode: fp16 weights with fp32 master copies in the optimizer, as Apex's O2) "
        "and rejects at start-up; remove it"]
    assert refusals(pruning)[0].startswith("fp16.enabled: fp16 does not run on the CPU accelerator")


def test_a_launch_names_the_batch_disagreement_beside_the_quoted_numbers(capsys, monkeypatch, tmp_path):
    code, lines = dry_run(capsys, monkeypatch, tmp_path, GENERATED)
    assert code == 2 and lines[0].endswith(": 2 problems:")
    assert lines[1].startswith("  - batch keys disagree among themselves: train_batch_size 32")
    assert lines[2].startswith("  - optimizer.params.lr: must be a number or \"auto\", file says \"2e-5\"")
