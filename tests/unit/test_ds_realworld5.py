"""Round 5 of real-world DeepSpeed JSONs: a config nested under a top-level "deepspeed" key (a trainer's
YAML-to-JSON dump), Adam betas that are not a pair, dotted ``torch.optim.AdamW`` / ``torch.optim.lr_scheduler``
type names, an optimizer or scheduler written as a bare string, "auto" where DeepSpeed keeps the text, and
amsgrad honoured by the AdamW dstrain builds."""
from __future__ import annotations

import json

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError, fill_ds_config, range_problem
from dstrain.engine.ds_files import load_ds_json, nests_ds_config, validate_top_level
from dstrain.engine.ds_preflight import adopt_file_values
from dstrain.engine.ds_sections import section_problems
from dstrain.engine.optim import choose_optimizer
from tests.unit.test_ds_realworld3 import run_cfg, values  # the same run config and run values


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


NESTED = {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}}
NESTED_SAYS = "top-level key 'deepspeed' holds a DeepSpeed config one level down"


# --------------------------------------------------------------------------- a config one level down


def test_a_nested_config_is_one_problem_with_the_fix(tmp_path):
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(NESTED, values(), source="dump.json")
    assert len(err.value.problems) == 1  # not also the "auto" inside it, which DeepSpeed would never read
    assert err.value.problems[0].startswith(NESTED_SAYS)
    assert err.value.problems[0].endswith("would silently ignore it: move its keys to the top level")
    with pytest.raises(DSConfigError, match=NESTED_SAYS):
        validate_top_level(NESTED, "dump.json")


def test_check_config_reads_a_nested_file_as_deepspeed_json_not_as_a_run_config(tmp_path, capsys):
    path = tmp_path / "dump.json"
    path.write_text(json.dumps(NESTED))
    assert cli.main(["check-config", str(path), "--world-size", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert NESTED_SAYS in err and "unknown key (valid: profile" not in err


def test_dstrains_own_deepspeed_section_is_still_a_run_config(tmp_path, capsys):
    assert not nests_ds_config({"deepspeed": {"profile": "auto", "activation_checkpointing": "none"}})
    assert nests_ds_config({"deepspeed": {"profile": "auto", "bf16": {"enabled": True}}})
    assert not nests_ds_config({"deepspeed": "zero2"}) and not nests_ds_config([])
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"deepspeed": {"precision": "fp32"}}))
    assert cli.main(["check-config", str(path)]) == 0
    assert capsys.readouterr().out.strip() == f"{path}: valid run config"


def test_other_unknown_top_level_keys_do_not_also_report_their_autos():
    with pytest.raises(DSConfigError) as err:
        fill_ds_config({"Zero_Optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, values(), source="x.json")
    assert err.value.problems == ["unknown top-level key 'Zero_Optimization' (did you mean 'zero_optimization'?); "
                                  "DeepSpeed would silently ignore it"]


# --------------------------------------------------------------------------- betas that are not a pair


@pytest.mark.parametrize("betas", [[0.9, 0.95, 0.999], [0.9]])
def test_betas_not_a_pair_are_a_range_problem_not_a_disagreement(tmp_path, betas):
    want = f"optimizer.params.betas: must be two numbers in [0, 1) or \"auto\", file says {json.dumps(betas)}"
    assert range_problem("optimizer.params.betas", betas) == want
    assert range_problem("optimizer.params.betas", [0.9, 0.95]) is None
    cfg = run_cfg(tmp_path, {"optimizer": {"type": "AdamW", "params": {"betas": betas}}},
                  "--deepspeed.values_from_file=true")
    with pytest.raises(DSConfigError) as err:
        adopt_file_values(cfg, 2)
    assert err.value.problems == [want]  # the file's key, not train.betas


# --------------------------------------------------------------------------- type names and bare strings


def test_dotted_type_names_say_the_bare_name_to_write():
    found, _ = section_problems({"optimizer": {"type": "torch.optim.AdamW", "params": {"lr": 1e-3}},
                              "scheduler": {"type": "torch.optim.lr_scheduler.StepLR", "params": {"step_size": 2}}},
                                "cpu")
    opt = next(p for p in found if p.startswith("optimizer.type"))
    sched = next(p for p in found if p.startswith("scheduler.type"))
    assert "(write 'AdamW': DeepSpeed looks the bare class name up itself)" in opt
    assert "(write 'StepLR': DeepSpeed looks the bare class name up itself)" in sched
    # an unknown dotted tail keeps the close-match hint
    assert "write" not in " ".join(section_problems({"optimizer": {"type": "torch.optim.Adamm"}}, "cpu")[0])


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_a_bare_string_section_says_how_to_write_it(section):
    with pytest.raises(DSConfigError) as err:
        fill_ds_config({section: "WarmupLR"}, values(), source="x.json")
    assert f"{section}: must be an object, file says \"WarmupLR\"; write {{\"type\": \"WarmupLR\"}}" \
        in err.value.problems
    with pytest.raises(DSConfigError) as err:
        fill_ds_config({section: 3}, values(), source="x.json")
    assert f"{section}: must be an object, file says 3" in err.value.problems


def test_auto_deepspeed_keeps_as_text_is_said_so(tmp_path):
    with pytest.raises(DSConfigError) as err:
        fill_ds_config({"steps_per_print": "auto", "gradient_clipping": "auto"}, values(), source="x.json")
    assert err.value.problems == ["steps_per_print: \"auto\" is not a value dstrain can fill (DeepSpeed itself "
                                  "keeps the text \"auto\"); set it explicitly"]


# --------------------------------------------------------------------------- accepted: as the file says


def test_amsgrad_reaches_the_adamw_dstrain_builds():
    import torch
    cfg = fill_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.9, 0.95],
                                                                    "amsgrad": True}}}, values(), source="x.json")
    choice, out = choose_optimizer(cfg, "auto", "cpu", values())
    assert choice.implementation == "torch_foreach"
    opt = choice.factory()([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["amsgrad"] is True


def test_param_offload_none_and_explicit_train_batch_are_valid(tmp_path):
    path = tmp_path / "z3.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto",
                                "gradient_accumulation_steps": "auto",
                                "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                                                      "stage3_gather_16bit_weights_on_model_save": True}}))
    said = check_ds_file(path, device_type="cpu", world_size=2).split(": ", 1)[1]
    assert said.startswith("valid DeepSpeed config for cpu: ZeRO stage 3; batch 8 x 1 x 2 ranks")
    assert "offload" not in said  # "none" is no offload
    assert load_ds_json(path)["zero_optimization"]["offload_param"] == {"device": "none"}
