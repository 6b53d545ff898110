"""Round 20 of real-world DeepSpeed JSONs: sources not covered before: InternLM/xtuner's DeepSpeed configs (ZeRO-2
offload and ZeRO-3 with fp16, zero_force_ds_cpu_optimizer false, transformers' ``low_cpu_mem_usage``; its example
with AdamW at lr 1e-8 and wall_clock_breakdown on), LianjiaTech/BELLE's (ZeRO-3 offload with the flops profiler at
step 50, its PPO config's torch AdamW, its inference config's stage-3 thresholds of 0), OptimalScale/LMFlow's
(steps_per_print 2e16, a disabled comms_logger, fp32 with no ZeRO section, ZeRO-3 offload without an optimizer
block), QwenLM/Qwen's and DeepSeek-Coder's finetune configs (offload "none", WarmupCosineLR's warmup_min_ratio 0.1),
yangjianxin1/Firefly's TrainingArguments files and DeepSpeedExamples' newer training/ configs (the OPSD app config,
the expert-parallel ZeRO-3 config with a Qwen3.5-MoE leaf class). Each file's source project and path are in
tests/configs/expectations_late.py.

Fixed in the round:

* A training script's own settings file given as the DeepSpeed JSON, one that names its DeepSpeed file under
  "deepspeed" (Firefly's TrainingArguments JSONs) or "deepspeed_config" (DeepSpeedExamples' OPSD config): refused
  with a line per key, 26 for Firefly's, several with a misleading close match (train_file -> train_batch_size,
  per_device_train_batch_size -> train_batch_size, optim -> optimizer) and the named file "as Determined's
  hyperparameters do". Now one line: which key names the DeepSpeed file, how many keys are not DeepSpeed's, and to
  give that file as --deepspeed.profile. A file that is mostly DeepSpeed's own keys (Determined's) is still checked
  key by key.
* xtuner's ZeRO-3 ``"low_cpu_mem_usage": false`` (a transformers from_pretrained argument that nothing reads from a
  DeepSpeed config): refused as an unknown key with no fix, so xtuner's file could not train even on a GPU. Now a
  note (false asks for nothing); true is refused, named, with the fix (remove it).
* ``zero_optimization.leaf_module.classes`` naming classes the run's model does not have (the Qwen3.5-MoE block of
  DeepSpeedExamples' expert-parallel config): accepted in silence; DeepSpeed marks nothing, warns, and hooks every
  module. Now a note says so and names the model's blocks.

Checked and correct as they were: fp16 (xtuner's, BELLE's inference config) is refused on the CPU only, and the
xtuner files are accepted on GPUs; BELLE's profile_step 50 is refused for a 3-step run with the fix; the expert-
parallel config's 1000 scheduler steps are refused for a 3-step run with the fix (accepted with --train.steps=1000);
the seven accepted files pass the DeepSpeedConfig cross-check in tests/configs. BELLE's PPO config (ZeRO-3, torch
AdamW), xtuner's example (ZeRO-2, wall_clock_breakdown) and LMFlow's ZeRO-3 offload config trained 3 steps on 2 CPU
ranks by hand (and run with -m slow).
"""
from __future__ import annotations

import json

from dstrain.engine.ds_check import check_ds_file
from tests.unit.ds_rounds import CONFIGS, RECIPE, refusals
from tests.unit.test_ds_realworld6 import _cpu_accelerator, _gpt  # noqa: F401 (the fixture is autouse here too)

FIREFLY = CONFIGS / "firefly_training_args_deepspeed_path.json"
OPSD = CONFIGS / "dsexamples_opsd_app_config_deepspeed_config_path.json"
XTUNER_Z3 = CONFIGS / "xtuner_zero3_low_cpu_mem_usage_key.json"
LEAF = CONFIGS / "dsexamples_expert_parallel_zero3_leaf_cosine.json"


def test_a_training_scripts_settings_file_is_named_in_one_line():
    assert refusals(FIREFLY) == [(
        "deepspeed: file says './train_args/ds_z3_config.json': this is a training script's own settings file, which "
        "names its DeepSpeed JSON there, not a DeepSpeed config: 24 of its 27 top-level keys are not DeepSpeed's "
        "(output_dir, model_name_or_path, train_file, template_name, ...) and DeepSpeed would silently ignore them; "
        "give './train_args/ds_z3_config.json' itself as --deepspeed.profile (a path relative to the folder the "
        "script runs in), and the script's own settings as dstrain flags")]
    (line,) = refusals(OPSD)
    assert line.startswith("deepspeed_config: file says 'configs/ds_zero3.json': this is a training script's own "
                           "settings file")
    assert "6 of its 7 top-level keys are not DeepSpeed's (student, teacher, rollout, distillation, ...)" in line


def test_a_file_mostly_of_deepspeed_keys_is_still_checked_key_by_key():
    lines = refusals(CONFIGS / "determined_hyperparameters_overwrite_args.json")
    assert lines[0].startswith("top-level key 'deepspeed_config' names another file ('ds_config.json', as "
                               "Determined's hyperparameters do)")
    assert lines[1].startswith("unknown top-level key 'overwrite_deepspeed_args': Determined's overrides")


def test_low_cpu_mem_usage_false_is_a_note_and_xtuners_zero3_file_is_accepted_on_gpus(tmp_path):
    said = check_ds_file(XTUNER_Z3, device_type="cuda", world_size=2)
    assert "low_cpu_mem_usage: false, transformers' from_pretrained argument" in said
    assert said.endswith("false asks for nothing, so nothing is lost")
    assert "fp16.enabled: fp16 does not run on the CPU accelerator" in refusals(XTUNER_Z3)[0]  # the CPU: fp16 only
    cfg = json.loads(XTUNER_Z3.read_text())
    cfg["low_cpu_mem_usage"] = True
    path = tmp_path / "true.json"
    path.write_text(json.dumps(cfg))
    assert refusals(path, device_type="cuda") == [(
        "unknown top-level key 'low_cpu_mem_usage': true, transformers' from_pretrained argument (load the weights "
        "without a full CPU copy first; xtuner's ZeRO-3 configs carry it), which DeepSpeed never reads and would "
        "silently ignore (dstrain builds its models itself, and transformers refuses it with ZeRO-3 anyway); remove "
        "it")]


def test_xtuners_fp16_offload_file_is_accepted_on_gpus():
    name = "xtuner_zero2_offload_fp16_force_ds_cpu_false.json"
    said = check_ds_file(CONFIGS / name, device_type="cuda", world_size=2)
    assert "ZeRO stage 2, offload optimizer" in said


def test_leaf_classes_the_model_does_not_have_are_noted():
    from dstrain.engine.zero_leaves import leaf_findings
    zo = json.loads(LEAF.read_text())["zero_optimization"]
    assert leaf_findings({"zero_optimization": zo}, _gpt()) == ([], [(
        "zero_optimization.leaf_module.classes: no module of the run's model (GPT) is "
        "'transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeSparseMoeBlock', so DeepSpeed marks no leaf "
        "for it and hooks every module as usual (it only warns); the model's blocks: \"classes\": [\"Block\"]")])
    for own in (["Block"], ["models.gpt.model.Block"]):  # DeepSpeed's two spellings of a class the model has
        assert leaf_findings({"zero_optimization": {**zo, "leaf_module": {"classes": own}}}, _gpt()) == ([], [])
    assert leaf_findings({"zero_optimization": {**zo, "stage": 2}}, _gpt()) == ([], [])  # read at stage 3 only


def test_the_leaf_note_is_among_the_run_checks_notes(tmp_path):
    from dstrain.config import load_run_config
    from dstrain.engine.ds_preflight import adopt_file_values, check_run
    cfg = load_run_config(RECIPE, [f"--deepspeed.profile={LEAF}", "--train.steps=1000",
                                   "--deepspeed.values_from_file=true", f"--output.dir={tmp_path / 'run'}"])
    adopt_file_values(cfg, 2)  # as dstrain launch does first
    notes = [n for n in check_run(cfg, 2, "cpu") if "leaf_module" in n]
    assert len(notes) == 1 and notes[0].startswith("zero_optimization.leaf_module.classes: no module of the run's")
