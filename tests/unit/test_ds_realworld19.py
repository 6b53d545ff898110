"""Round 19 of real-world DeepSpeed JSONs: the scripts/zero2.json / zero3.json files of LLaVA-derived multimodal
projects (audio-flamingo's stage3_prefetch_bucket_size 0, Ovis' fp16 off beside bf16 "auto", Cambrian's and VILA's
explicit gradient_clipping, TinyLLaVA's ignore_unused_parameters, Osprey's and MoE-LLaVA's own numbers, UniWorld's
512 Mi-element buckets, VILA's CPU optimizer offload with a disabled flops_profiler), Fengshenbang's Erlangshen BERT
heredoc (fp16 with a flat WarmupLR and the flops profiler on) and transformers-framework's Lightning strategy dict.
Each file's source project and path are in tests/configs/expectations_late.py.

Fixed in the round:

* ``"fp16": {"raise_error_at_min_scale": false}`` (transformers-framework passes it to DeepSpeed's DynamicLossScaler
  by patching get_dynamic_loss_scale_args): refused as "fp16.raise_error_at_min_scale: unknown key; DeepSpeed rejects
  it", with no fix. Now the line says whose argument it is, what DeepSpeed does without it (it stops the run when a
  step overflows at min_loss_scale; false would skip the step and go on) and to remove it; where the file's
  loss_scale is static it says the key would be unused anyway.

Checked and correct as they were: the eight multimodal files are accepted (the DeepSpeedConfig cross-check in
tests/configs reads each), prefetch 0 is passed on as written, stage-3 sub_group_size at stage 2 is noted unused; VILA's,
audio-flamingo's and Ovis' files trained 3 steps on 2 CPU ranks (-m slow); the Erlangshen file is refused on the CPU
for its fp16 only (on a GPU it is accepted with the flops profiler on), and its profile_step 25 is refused for a
3-step run with the fix.
"""
from __future__ import annotations

import json

from tests.unit.ds_rounds import CONFIGS, refusals
from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401 (the fixture is autouse here too)

LIGHTNING = CONFIGS / "lightning_tf_framework_fp16_raise_error_at_min_scale.json"
SCALER = ("fp16.raise_error_at_min_scale: an argument of DeepSpeed's dynamic loss scaler, not a key of its fp16 "
          "section, which rejects it (projects that set it patch DeepSpeed's get_dynamic_loss_scale_args); without it "
          "DeepSpeed stops the run when a step overflows at min_loss_scale, where false skips the step and goes on")


def test_raise_error_at_min_scale_is_named_with_what_removing_it_changes():
    lines = refusals(LIGHTNING, device_type="cuda")
    assert lines[0].startswith("fp16.min_loss_scale: file says 0.1")
    assert lines[1] == SCALER + " (unused here: loss_scale 2 is a static scale); remove it"


def test_raise_error_at_min_scale_under_dynamic_scaling_has_no_unused_clause(tmp_path):
    cfg = json.loads(LIGHTNING.read_text())
    cfg["fp16"].update(loss_scale=0, min_loss_scale=1)
    path = tmp_path / "dynamic.json"
    path.write_text(json.dumps(cfg))
    assert refusals(path, device_type="cuda") == [SCALER + "; remove it"]
