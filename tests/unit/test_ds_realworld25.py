"""Round 25 of real-world DeepSpeed JSONs: DeepSpeed's first flops-profiler README (``"flops_profiler": true`` with
top-level ``profile_*`` keys, and a block with ``start_step`` / ``end_step``), an optimizer block with params but no
type (a Transformers notes page's "Configuration with Trainer"), DeepSpeedExamples' variable batch size and lr
example (dynamic batching), DeepSpeed issue 2721's ``aio`` block inside ``zero_optimization``, and an empty
scheduler block as a YAML dump writes it.

Fixed in the round:

* A section DeepSpeed reads only as an object given ``true`` or a string (``"flops_profiler": true``,
  ``"tensorboard": true``, ``"csv_monitor": "yes"``): check_ds_file and the launch checks stopped on an
  AttributeError; the others were named only by DeepSpeed's own exception text. Each is now one line naming the
  key, with ``{"enabled": true}`` where the section has that switch.
* The first profiler's keys (top-level ``profile_start_step``, ``profile_end_step``, ``profile_depth``,
  ``profile_top_num``; ``start_step`` / ``end_step`` in the block) name DeepSpeed 0.19's key and value.
* An optimizer or scheduler block that names no type: DeepSpeed builds nothing from it and drops its params; the
  optimizer's was accepted and every rank stopped at the first backward ("must provide optimizer during init").
* An empty scheduler block: DeepSpeed builds no scheduler, so the lr stays constant (dstrain's schedule is off too,
  as before); plan.txt said "the DeepSpeed JSON's scheduler block".
* ``data_efficiency.data_sampling.dynamic_batching`` on under ``data_efficiency.enabled`` false was accepted (DeepSpeed
  parses it whatever the section's switch says; only its dataloader helper applies it); on without ``max_tokens`` it
  was DeepSpeed's assertion text.
* A top-level key inside zero_optimization (``aio``) and a zero_optimization key beside an optimizer's type
  (``offload_optimizer``, which was told to move into "params") say where they belong.
* ``scheduler.params.cos_min_ratio`` above 1: check-config stopped naming ``train.min_lr_ratio``; now the file's key.
* ``"allgather_size"`` beside ``"zero_optimization": true`` (DeepSpeed's first ZeRO form, still read by 0.19.8 as that
  form's allgather bucket) was refused as a key DeepSpeed ignores; it is now read as DeepSpeed reads it, and refused
  with the section's key where DeepSpeed does ignore it (beside a zero_optimization object).
* An enabled flops profiler's numbers in quotes (or a null ``top_modules``) were accepted: DeepSpeed never profiles
  (``profile_step`` "1" never equals the step count) or stops every rank at the profile step with a TypeError when it
  prints the profile (trained by hand before the fix: ``module_depth`` "-1", ``top_modules`` null and
  ``recompute_fwd_factor`` "0.5" each stopped the run there).
"""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_files import load_ds_json
from tests.unit.ds_rounds import CONFIGS, deepspeed_config, refusals

PROFILER_V1 = CONFIGS / "dsdocs_flops_profiler_readme_v1_true_top_level_steps.json"
PROFILER_BLOCK = CONFIGS / "dsdocs_flops_profiler_readme_megatron_start_end_step.json"
NO_TYPE = CONFIGS / "hf_trainer_notes_optimizer_params_without_type.json"
DYNAMIC = CONFIGS / "dsexamples_variable_batch_size_and_lr_dynamic_batching.json"
DYNAMIC_OFF = CONFIGS / "dsexamples_dynamic_batching_left_on_data_efficiency_off.json"
AIO_INSIDE = CONFIGS / "hf_zero3_offload_aio_inside_zero_optimization.json"
EMPTY_SCHEDULER = CONFIGS / "yaml_dump_empty_scheduler_block.json"
ZERO_BOOL = CONFIGS / "dsdocs_zero_bool_form_allgather_size.json"
QUOTED_PROFILER = CONFIGS / "generated_flops_profiler_quoted_numbers.json"


def _file(tmp_path, cfg: dict):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **cfg}))
    return path


def _by_key(lines: list[str]) -> dict[str, str]:
    return {line.split(":", 1)[0]: line for line in lines}


def test_profiler_readme_v1_is_refused_by_key_with_deepspeeds_own_names():
    by_key = _by_key(refusals(PROFILER_V1))
    assert 'write "flops_profiler": {"enabled": true}' in by_key["flops_profiler"]
    assert 'write "flops_profiler": {"profile_step": 5}' in by_key["unknown top-level key 'profile_start_step'"]
    assert 'write "flops_profiler": {"module_depth": -1}' in by_key["unknown top-level key 'profile_depth'"]
    assert 'write "flops_profiler": {"top_modules": 3}' in by_key["unknown top-level key 'profile_top_num'"]
    assert "profiles one step" in by_key["unknown top-level key 'profile_end_step'"]
    with pytest.raises(AttributeError):  # what DeepSpeed itself does with the section: stop at start-up
        deepspeed_config({"flops_profiler": True})


@pytest.mark.parametrize("key, value", [("tensorboard", True), ("csv_monitor", "yes"), ("flops_profiler", False),
                                        ("checkpoint", True), ("data_types", True), ("comms_logger", True)])
def test_a_section_given_a_scalar_is_one_line_naming_it(tmp_path, key, value):
    lines = refusals(_file(tmp_path, {key: value}))
    line = next(x for x in lines if x.startswith(f"{key}: must be an object"))
    assert f"file says {json.dumps(value)}" in line and "stops on anything else at start-up" in line
    if key in ("tensorboard", "flops_profiler", "comms_logger"):
        assert f'write "{key}": {{"enabled": {json.dumps(value)}}}' in line
    assert not any("object has no attribute" in x for x in lines)  # DeepSpeed's exception text is not the answer


def test_profiler_block_start_and_end_step_name_profile_step():
    by_key = _by_key(refusals(PROFILER_BLOCK))
    assert 'write "flops_profiler": {"profile_step": 2}' in by_key["flops_profiler.start_step"]
    assert by_key["flops_profiler.end_step"].endswith("remove it")
    cfg = json.loads(PROFILER_BLOCK.read_text())["flops_profiler"]
    assert deepspeed_config({"flops_profiler": cfg}).flops_profiler_config.profile_step == 1  # start_step unread


def test_optimizer_block_without_a_type_is_refused_before_launch():
    line = _by_key(refusals(NO_TYPE))["optimizer.type"]
    assert 'no "type" (the block has params)' in line and '"must provide optimizer during init"' in line
    assert 'add "type": "AdamW"' in line
    parsed = deepspeed_config({"optimizer": {"params": {"lr": 1e-4}}})
    assert parsed.optimizer_name is None and parsed.optimizer_params is None  # DeepSpeed builds nothing from it


def test_scheduler_block_without_a_type_is_refused_and_an_empty_one_left_alone(tmp_path):
    line = _by_key(refusals(_file(tmp_path, {"scheduler": {"params": {"warmup_num_steps": 5}}})))["scheduler.type"]
    assert "the learning rate would stay at the optimizer's for the whole run" in line
    assert "ZeRO stage 2" in check_ds_file(EMPTY_SCHEDULER, device_type="cpu", world_size=2)
    assert deepspeed_config({"scheduler": {"params": {"warmup_num_steps": 5}}}).scheduler_name is None


def test_empty_scheduler_block_is_planned_as_a_constant_lr():
    from dstrain.engine.factory import _schedule_line
    assert "the lr stays constant" in _schedule_line({"scheduler": {}})
    assert "the lr stays constant" in _schedule_line({"scheduler": {"type": None}})
    assert _schedule_line({"scheduler": {"type": "WarmupLR"}}).endswith("the DeepSpeed JSON's scheduler block")
    assert "dstrain's warm-up + cosine" in _schedule_line({})


def test_dynamic_batching_is_named_on_and_off():
    assert "(curriculum, dynamic batching) never runs" in _by_key(refusals(DYNAMIC))["data_efficiency.enabled"]
    line = _by_key(refusals(DYNAMIC_OFF))["data_efficiency.data_sampling.dynamic_batching.enabled"]
    assert "whatever data_efficiency.enabled says" in line and "fixed batches" in line
    cfg = json.loads(DYNAMIC_OFF.read_text())["data_efficiency"]
    parsed = deepspeed_config({"data_efficiency": cfg}).data_efficiency_config
    assert parsed["data_sampling"]["dynamic_batching"]["enabled"] is True  # DeepSpeed reads it with the section off


def test_dynamic_batching_without_max_tokens_names_the_key(tmp_path):
    path = _file(tmp_path, {"data_efficiency": {"enabled": False,
                                                "data_sampling": {"dynamic_batching": {"enabled": True}}}})
    assert "every rank would stop at start-up" in \
        _by_key(refusals(path))["data_efficiency.data_sampling.dynamic_batching.max_tokens"]


def test_keys_in_the_wrong_section_say_where_they_belong(tmp_path):
    line = _by_key(refusals(AIO_INSIDE))["zero_optimization.aio"]
    assert 'move it out of "zero_optimization" to the top level' in line
    path = _file(tmp_path, {"zero_optimization": {"stage": 2},
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4},
                                          "offload_optimizer": {"device": "cpu"}}})
    assert _by_key(refusals(path))["optimizer.offload_optimizer"].endswith('move it into "zero_optimization"')


def test_cos_min_ratio_above_one_is_refused_by_the_files_key(tmp_path):
    path = _file(tmp_path, {"scheduler": {"type": "WarmupCosineLR",
                                          "params": {"warmup_num_steps": 1, "cos_min_ratio": 1.5}}})
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=2)
    assert err.value.problems == ['scheduler.params.cos_min_ratio: must be a number in [0, 1] or "auto", file says 1.5']


def test_allgather_size_beside_the_boolean_zero_form_is_read_as_deepspeed_reads_it(tmp_path):
    assert "ZeRO stage 1" in check_ds_file(ZERO_BOOL, device_type="cpu", world_size=2)
    assert load_ds_json(ZERO_BOOL)["zero_optimization"] == {"stage": 1, "allgather_bucket_size": 200000000}
    raw = json.loads(ZERO_BOOL.read_text())
    parsed = deepspeed_config({"zero_optimization": raw["zero_optimization"], "allgather_size": raw["allgather_size"]})
    assert parsed.zero_optimization_stage == 1 and parsed.zero_config.allgather_bucket_size == 200000000
    path = _file(tmp_path, {"zero_optimization": {"stage": 1}, "allgather_size": 200000000})
    line = _by_key(refusals(path))["unknown top-level key 'allgather_size'"]
    assert line.endswith('write "zero_optimization": {"allgather_bucket_size": 200000000}')
    ignored = deepspeed_config({"zero_optimization": {"stage": 1}, "allgather_size": 1})
    assert ignored.zero_config.allgather_bucket_size == 500000000  # DeepSpeed ignores it there


def test_quoted_profiler_numbers_are_refused_by_key(tmp_path):
    by_key = _by_key(refusals(QUOTED_PROFILER))
    line = by_key["flops_profiler.profile_step"]
    assert "so it never matches and nothing is profiled; write 1 without quotes" in line
    assert by_key["flops_profiler.module_depth"].endswith("stops every rank there; write -1 without quotes")
    assert by_key["flops_profiler.top_modules"].endswith("write 1 without quotes")
    cfg = json.loads(QUOTED_PROFILER.read_text())["flops_profiler"]
    assert deepspeed_config({"flops_profiler": cfg}).flops_profiler_config.profile_step == "1"  # kept as text
    path = _file(tmp_path, {"flops_profiler": {"enabled": True, "top_modules": None, "recompute_fwd_factor": "x"}})
    by_key = _by_key(refusals(path))
    assert by_key["flops_profiler.top_modules"].endswith("write a whole number or remove it")
    assert by_key["flops_profiler.recompute_fwd_factor"].endswith("write a number or remove it")
    off = _file(tmp_path, {"flops_profiler": {"enabled": False, "profile_step": "1"}})  # off: DeepSpeed reads none
    assert "ZeRO stage 0" in check_ds_file(off, device_type="cpu", world_size=2)
