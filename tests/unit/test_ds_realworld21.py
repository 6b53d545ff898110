"""Round 21 of real-world DeepSpeed JSONs: sources not covered before: an ``accelerate config`` file in its JSON form
(its DeepSpeed-plugin settings with a zero_optimization block pasted inline), CogVideo's SAT training config (bf16
ZeRO-2 with SAT's own FusedEmaAdam), PKU-YuanGroup/Open-Sora-Plan's Accelerate DeepSpeed JSON (communication_data_type
fp32, 512 Mi-element buckets), turbo-alignment's sequence-parallel test config (ZeRO-3 without an optimizer block,
allgather_partitions, batch 1), a ZeRO-3 offload config generated in code with an fp16 loss-scale window in its bf16
section, DeepSpeed's docs' NVMe parameter offload, and DeepSpeed's communication switches (reduce_scatter,
contiguous_gradients, round_robin_gradients, allgather_partitions, gradient_predivide_factor) at stages 2 and 3.
Each file's source project and path are in tests/configs/expectations_late.py.

Fixed in the round:

* ``zero_optimization.allgather_partitions``: DeepSpeed 0.19.8 parses it and reads it nowhere (the engine's
  ``zero_allgather_partitions()`` has no caller; the ZeRO-1/2 optimizer takes no such argument and always
  all-gathers, ZeRO-3 gathers parameters itself). At stage 3 only allgather_bucket_size was noted unused beside it;
  now it is noted too, and at stages 1/2 a false (a broadcast that never happens) is noted. True at 1/2 says nothing.
* An ``accelerate config`` file given as the DeepSpeed JSON: 13 lines, one "unknown top-level key" per Accelerate key,
  and "deepspeed_config holds a DeepSpeed config one level down: move its keys to the top level", which would have
  left Accelerate's plugin keys (zero_stage, zero3_init_flag, offload_*_device) unread. Now one line: what the file
  is, and the file its deepspeed_config_file names or the DeepSpeed JSON its settings stand for (that JSON passes).
* ``"bf16": {"enabled": true, "loss_scale_window": 250}``: DeepSpeed's bf16 section rejects fp16's loss-scaling keys
  and stops at start-up; dstrain said "bf16.loss_scale_window: unknown key; DeepSpeed rejects it". Now the line says
  it is fp16's dynamic-loss-scaling key, which bf16 does not use, and to remove it; several such keys (an fp16 block
  renamed bf16, as tests/configs' bf16_with_fp16_loss_scale_keys.json and LLaMA-Factory's ALST config have) are one
  line, not five identical "unknown key" lines.
* An optimizer / scheduler type that is a module path to a project's own class (SAT's ``"sat.ops.FusedEmaAdam"``):
  "neither one of DeepSpeed's optimizers nor a torch.optim class" with no fix. Now it says DeepSpeed looks types up
  by bare name and never imports a module, and what to write (one of those, or no block: dstrain's AdamW / schedule).

Checked and correct as they were: Open-Sora-Plan's ZeRO-2 (fp32 communication), the stage-3 file with reduce_scatter
and contiguous_gradients false and the stage-2 file with reduce_scatter false and a predivide factor are accepted and
pass the DeepSpeedConfig cross-check in tests/configs; turbo-alignment's batch 1 is refused on 2 ranks with the fix;
the NVMe offload is refused on the CPU with "use cpu". The three accepted files trained 3 steps on 2 CPU ranks by hand
(and run with -m slow).
"""
from __future__ import annotations

import inspect
import json

import pytest

from dstrain.engine.ds_check import check_ds_file
from tests.unit.ds_rounds import CONFIGS, deepspeed_config, refusals
from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401 (the fixture is autouse here too)

ACCELERATE = CONFIGS / "accelerate_config_json_inline_deepspeed_config.json"
STAGE3 = CONFIGS / "zero3_stage12_comm_switches_round_robin.json"
LOSS_WINDOW = CONFIGS / "generated_zero3_offload_bf16_loss_scale_window.json"
SAT = CONFIGS / "cogvideo_sat_zero2_bf16_fused_ema_adam.json"


def _write(tmp_path, cfg: dict, name: str = "ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


def test_deepspeed_reads_allgather_partitions_at_no_stage():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    for cls in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):  # what the note rests on
        assert "allgather_partitions" not in inspect.signature(cls.__init__).parameters
    assert "allgather_bucket_size" in inspect.signature(DeepSpeedZeroOptimizer.__init__).parameters


def test_allgather_partitions_is_noted_beside_the_other_stage_12_keys_at_stage_3():
    said = check_ds_file(STAGE3, device_type="cpu", world_size=2)
    assert "zero_optimization: stage 3 does not use allgather_bucket_size, round_robin_gradients" in said
    assert ("zero_optimization.allgather_partitions: unused at stage 3, which gathers the parameters itself "
            "(DeepSpeed 0.19 reads the key at no stage") in said


@pytest.mark.parametrize("stage, value, noted", [(1, False, True), (2, "false", True), (2, True, False),
                                                 (3, True, True)])
def test_allgather_partitions_at_each_stage(tmp_path, stage, value, noted):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": stage, "allgather_partitions": value}})
    said = check_ds_file(path, device_type="cpu", world_size=2)
    assert ("zero_optimization.allgather_partitions:" in said) is noted, said
    if noted and stage < 3:
        assert f"its ZeRO-{stage} optimizer all-gathers the updated partitions anyway" in said


def test_an_accelerate_config_file_is_named_in_one_line_with_the_deepspeed_json_it_stands_for(tmp_path):
    (line,) = refusals(ACCELERATE)
    assert line.startswith("deepspeed_config: this is an Accelerate config file (`accelerate config`'s output: "
                           "compute_environment, distributed_type 'DEEPSPEED', ...), not a DeepSpeed config")
    assert "(deepspeed_multinode_launcher, zero3_init_flag: Accelerate's own, with no DeepSpeed key)" in line
    fix = json.loads(line.rpartition("--deepspeed.profile: ")[2])
    assert fix["bf16"] == {"enabled": True}  # its mixed_precision
    zo = fix["zero_optimization"]
    assert zo["stage"] == 3 and zo["stage3_gather_16bit_weights_on_model_save"] is True  # zero3_save_16bit_model
    assert zo["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    said = check_ds_file(_write(tmp_path, fix), device_type="cpu", world_size=2)  # the JSON it gives passes
    assert "ZeRO stage 3, offload optimizer and param" in said


def test_an_accelerate_plugin_alone_and_one_naming_its_deepspeed_file(tmp_path):
    plugin = {"zero_stage": 2, "offload_optimizer_device": "cpu", "offload_param_device": "none",
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0, "zero3_init_flag": False}
    acc = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "deepspeed_config": plugin,
           "mixed_precision": "no", "num_processes": 2}
    (line,) = refusals(_write(tmp_path, acc))
    assert line.endswith("(zero3_init_flag: Accelerate's own, with no DeepSpeed key) and give that file as "
                         "--deepspeed.profile: {\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": "
                         "{\"device\": \"cpu\"}}, \"gradient_accumulation_steps\": 1, \"gradient_clipping\": 1}")
    acc["deepspeed_config"] = {"deepspeed_config_file": "configs/ds_zero3.json", "zero3_init_flag": True}
    (line,) = refusals(_write(tmp_path, acc, "named.json"))
    assert line.endswith("silently ignore every key here; give 'configs/ds_zero3.json' (its deepspeed_config_file) "
                         "as --deepspeed.profile")


def test_an_fp16_loss_scaling_key_in_the_bf16_section_is_named_with_the_fix(tmp_path):
    with pytest.raises(Exception, match="loss_scale_window"):  # DeepSpeed itself stops on it
        deepspeed_config({"bf16": {"enabled": True, "loss_scale_window": 250}})
    assert refusals(LOSS_WINDOW) == [(
        "bf16.loss_scale_window: file says 250, a key of fp16's dynamic loss scaling, which bf16 does not use (its "
        "exponent range needs no loss scale); DeepSpeed's bf16 section rejects it and stops at start-up; remove it")]
    cfg = json.loads(LOSS_WINDOW.read_text())
    cfg["bf16"] = {"enabled": True}
    assert "ZeRO stage 3, offload optimizer and param" in check_ds_file(_write(tmp_path, cfg), device_type="cpu",
                                                                        world_size=2)
    assert refusals(CONFIGS / "bf16_with_fp16_loss_scale_keys.json") == [(  # an fp16 block renamed: one line
        "bf16.loss_scale, loss_scale_window, hysteresis, min_loss_scale, initial_scale_power: keys of fp16's dynamic "
        "loss scaling, which bf16 does not use (its exponent range needs no loss scale); DeepSpeed's bf16 section "
        "rejects them and stops at start-up; remove them")]
    cfg["bf16"] = {"enabled": True, "loss_scale_windw": 1}  # any other unknown key: as before
    assert refusals(_write(tmp_path, cfg, "typo.json")) == [
        "bf16.loss_scale_windw: unknown key; DeepSpeed rejects it"]


def test_a_projects_own_optimizer_class_path_is_named_with_what_to_write(tmp_path):
    (line,) = refusals(SAT)
    assert line == ("optimizer.type: 'sat.ops.FusedEmaAdam' is neither one of DeepSpeed's optimizers nor a torch.optim "
                    "class (a module path to a project's own class: DeepSpeed looks an optimizer type up by bare name "
                    "among its own optimizers (Adam, AdamW, Adagrad, Lamb, Lion, ...) and torch.optim's classes and "
                    "never imports a module; write one of those, or remove the optimizer block and dstrain builds "
                    "AdamW from the run config); DeepSpeed would fail at start-up")
    cfg = json.loads(SAT.read_text())
    cfg["optimizer"]["type"] = "torch.optim.AdamW"  # a path to a class DeepSpeed finds: named as before
    assert "(write 'AdamW': DeepSpeed looks the bare class name up itself)" in refusals(_write(tmp_path, cfg))[0]
    del cfg["optimizer"]
    cfg["scheduler"] = {"type": "my_project.schedules.InverseSqrt", "params": {}}
    (line,) = refusals(_write(tmp_path, cfg, "sched.json"))
    assert "remove the scheduler block and dstrain runs its warm-up + cosine schedule)" in line
    cfg["scheduler"]["type"] = "torch.optim.lr_scheduler.StepLRR"  # a misspelt torch class: the close match says it
    assert "module path" not in refusals(_write(tmp_path, cfg, "typo.json"))[0]
