"""Regressions a second review found in one session's rounds (references 8, DeepSpeed configs 16, sandbox split
and red team 21, newcomer audit 6, Hugging Face checkpoints 3), each pinned here.

- DeepSpeed configs 16 made an enabled ``torch_autocast`` section decide the run's precision (bf16), but a file that
  also writes ``"bf16": {"enabled": false}`` (the autocast form over fp32 weights, exactly what dstrain's own plan
  writes into ds_config.json for such a run) was then refused by ``check-config`` and ``plan`` alike: "bf16.enabled:
  file says false, run precision is bf16". ``check-config`` accepted it before the round.
"""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_config import DSConfigError

from tests.unit.ds_rounds import RECIPE
from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401 (the fixture is autouse here too)

AUTOCAST_FORM = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "bf16": {"enabled": False}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
                 "zero_optimization": {"stage": 0}}


def _file(tmp_path, cfg: dict):
    path = tmp_path / "autocast_form.json"
    path.write_text(json.dumps(cfg))
    return path


def test_the_autocast_form_with_bf16_off_is_checked_valid(tmp_path):
    from dstrain.engine.ds_check import check_ds_file
    assert "valid DeepSpeed config for cpu" in check_ds_file(_file(tmp_path, AUTOCAST_FORM), device_type="cpu",
                                                             world_size=2)


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_the_autocast_form_with_bf16_off_plans_a_bf16_run_over_fp32_weights(tmp_path, fast_bf16):
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    cfg = load_run_config(RECIPE, ["--train.steps=3", "--data.seq_len=64", f"--output.dir={tmp_path / 'run'}",
                                   f"--deepspeed.profile={_file(tmp_path, AUTOCAST_FORM)}"])
    hw = Hardware("cpu", 16 * 10**9, 32 * 10**9, 2, fast_bf16, False, "a cpu")
    plan = plan_engine(cfg, 2, hw=hw, device_type="cpu")
    assert plan.precision == "bf16"
    assert plan.ds_config["bf16"] == {"enabled": False}
    assert plan.ds_config["torch_autocast"]["enabled"] is True
    assert "bf16 as torch.autocast over fp32 weights (the file's torch_autocast section)" in plan.explanation


def test_an_explicit_fp32_run_beside_the_autocast_form_is_still_refused(tmp_path):
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    cfg = load_run_config(RECIPE, ["--train.steps=3", "--data.seq_len=64", f"--output.dir={tmp_path / 'run'}",
                                   "--deepspeed.precision=fp32",
                                   f"--deepspeed.profile={_file(tmp_path, AUTOCAST_FORM)}"])
    hw = Hardware("cpu", 16 * 10**9, 32 * 10**9, 2, True, False, "a cpu")
    with pytest.raises(DSConfigError, match="torch_autocast.enabled: file says true"):
        plan_engine(cfg, 2, hw=hw, device_type="cpu")


# --------------------------------------------------------------------------- a zero_optimization that is no object
# Newcomer audit 6 read ``zero_optimization.stage`` in ``check_run`` (for its pp x ZeRO check) before the file's own
# problems were named: a profile with ``"zero_optimization": 2`` made ``dstrain check-config`` / ``launch`` of a run
# config stop on an AttributeError traceback instead of "zero_optimization: must be an object" (as before the round).


def _zero_profile(tmp_path, value):
    profile = tmp_path / "zero.json"
    profile.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                   "zero_optimization": value}))
    return profile


def test_a_run_with_a_number_for_its_zero_section_is_refused_in_one_line(tmp_path):
    from dstrain.config import load_run_config
    from dstrain.engine.ds_preflight import check_run
    profile = _zero_profile(tmp_path, 2)
    for extra in ([], ["--parallel.pp=2"]):
        cfg = load_run_config(RECIPE, ["--train.steps=3", f"--output.dir={tmp_path / 'run'}",
                                       f"--deepspeed.profile={profile}", *extra])
        with pytest.raises(DSConfigError, match="zero_optimization: must be an object"):
            check_run(cfg, 2, "cpu")
