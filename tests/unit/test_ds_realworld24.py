"""Round 24 of real-world DeepSpeed JSONs: sources not covered before. kohya-ss sd-scripts' DeepSpeed plugin dicts
(Accelerate's dump of the batch it computes, bf16, and fp16 with its initial_scale_power 0), a fp16 block written by
someone moving from ColossalAI or torch.amp (GradScaler's names for the loss scaler), the ZeRO++ tutorial's block
with hpZ alone on fewer ranks than its partition, and DeepSpeed-Chat step 2's generated reward-model config
("bfloat16", stage-3 keys at stage 2, hybrid_engine off).

Fixed in the round:

* ``"fp16": {"initial_scale": 65536, "growth_interval": 1000, "min_scale": 1, "growth_factor": 2,
  "backoff_factor": 0.5}`` (GradScaler's / ColossalAI's DynamicGradScaler's names): DeepSpeed's fp16 section
  rejects each at start-up, and dstrain refused each as "unknown key; DeepSpeed rejects it", with "did you mean
  'initial_scale_power'?" for a number that is not a power (65536 where DeepSpeed wants 16) and "did you mean
  'min_loss_scale'?" alone. Each now names DeepSpeed's key with the value it takes (initial_scale_power 16,
  loss_scale_window 1000, min_loss_scale 1), or says why there is none: DeepSpeed's scaler always doubles and
  halves (a factor 2 / 0.5 is its own behaviour; any other is one its config cannot set) and has no ceiling.

Checked and correct as they were: sd-scripts' fp16 initial_scale_power 0 trains on a GPU from a scale of 1 (DeepSpeed
reads 2**0); its bf16 dump and DeepSpeed-Chat's step-2 config resolve to the plan DeepSpeed reads (stage-3 keys at
stage 2 noted); hpZ 16 on 2 ranks is accepted (DeepSpeed groups min(16, world)). Trained by hand 3 steps on 2 CPU
ranks: kohya_sdscripts_zero2_bf16_accelerate_dump.json, dsdocs_zeropp_tutorial_hpz_only_multinode.json and
dschat_step2_reward_zero2_bfloat16_stage3_keys_hybrid_off.json.
"""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_check import check_ds_file
from tests.unit.ds_rounds import CONFIGS, deepspeed_config, refusals

MIGRANT = CONFIGS / "colossalai_migrant_zero2_fp16_gradscaler_keys.json"
KOHYA_FP16 = CONFIGS / "kohya_sdscripts_zero2_fp16_initial_scale_power_zero.json"


def test_gradscaler_keys_are_refused_with_deepspeeds_own_key_and_value():
    lines = refusals(MIGRANT, device_type="cuda")
    by_key = {line.split(":", 1)[0]: line for line in lines}
    assert 'write "initial_scale_power": 16 in its place (DeepSpeed starts at 2**16)' in by_key["fp16.initial_scale"]
    assert 'write "loss_scale_window": 1000 in its place' in by_key["fp16.growth_interval"]
    assert 'write "min_loss_scale": 1 in its place' in by_key["fp16.min_scale"]
    for key in ("fp16.growth_factor", "fp16.backoff_factor"):
        assert "DeepSpeed's scaler does the same" in by_key[key] and by_key[key].endswith("remove it")
    assert "did you mean" not in " ".join(line for line in lines if line.startswith("fp16."))
    assert "did you mean 'overlap_comm'" in by_key["zero_optimization.overlap_communication"]


def test_gradscaler_values_deepspeed_cannot_express_say_so(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "fp16": {
        "enabled": True, "init_scale": 3000.0, "growth_factor": 4, "max_scale": 2 ** 24}}))
    by_key = {line.split(":", 1)[0]: line for line in refusals(path, device_type="cuda")}
    assert "a power of two" in by_key["fp16.init_scale"]  # 3000 is not 2**N: no value is made up
    assert "a factor its config does not set" in by_key["fp16.growth_factor"]
    assert "no ceiling" in by_key["fp16.max_scale"]


@pytest.mark.parametrize("key, value", [("initial_scale", 65536), ("growth_interval", 1000), ("min_scale", 1),
                                        ("growth_factor", 2), ("backoff_factor", 0.5)])
def test_deepspeed_itself_rejects_the_gradscaler_keys(key, value):
    with pytest.raises(Exception, match=key):
        deepspeed_config({"fp16": {"enabled": True, key: value}})


def test_sd_scripts_fp16_scale_power_zero_is_taken_on_a_gpu_from_a_scale_of_one():
    assert "ZeRO stage 2" in str(check_ds_file(KOHYA_FP16, device_type="cuda", world_size=2))
    cfg = json.loads(KOHYA_FP16.read_text())
    assert deepspeed_config({"fp16": cfg["fp16"]}).float16_config.initial_dynamic_scale() == 1
