"""Round 4 of real-world DeepSpeed JSONs: file-format accidents (non-UTF-8 bytes, an empty file, NaN / Infinity,
numbers as DeepSpeed's hjson loader reads them), values no run can take, Adam params DeepSpeed's FusedAdam refuses,
the optimizer lr WarmupLR never uses, and stage 0's accumulation dtype deciding an open precision."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError, fill_ds_config, load_ds_json, range_problem
from dstrain.engine.ds_preflight import adopt_file_values, check_run
from dstrain.engine.ds_sections import section_problems
from tests.unit.test_ds_realworld3 import run_cfg, values  # the same run config and run values


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def _write(tmp_path, text: str | bytes, name: str = "ds.json") -> Path:
    path = tmp_path / name
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
    return path


# --------------------------------------------------------------------------- reading the file


def test_non_utf8_bytes_are_named_with_line_and_column_not_a_traceback(tmp_path, capsys):
    path = _write(tmp_path, b'{\n  // R\xe9glages\n  "zero_optimization": {"stage": 1}\n}\n')
    with pytest.raises(DSConfigError) as err:
        load_ds_json(path)
    assert str(err.value) == f"{path}: not UTF-8 text: byte 0xe9 at line 2, column 7 (DeepSpeed reads its JSON as " \
                             "UTF-8); save the file as UTF-8"
    assert cli.main(["check-config", str(path), "--world-size", "2", "--device", "cpu"]) == 2  # not a crash
    assert capsys.readouterr().err.strip() == f"dstrain: error: {err.value}"


@pytest.mark.parametrize("text", ["", "\n  \n", "\ufeff"])
def test_an_empty_file_is_refused_but_an_empty_object_is_not(tmp_path, text):
    with pytest.raises(DSConfigError, match="the file is empty .* write {} to leave every value to the run"):
        load_ds_json(_write(tmp_path, text))
    assert load_ds_json(_write(tmp_path, "{}")) == {}


def test_nan_and_infinity_are_named_by_key(tmp_path):
    path = _write(tmp_path, '{"gradient_clipping": NaN, "optimizer": {"type": "AdamW", "params": '
                            '{"lr": Infinity, "betas": [0.9, -Infinity]}}}')
    with pytest.raises(DSConfigError) as err:
        load_ds_json(path)
    assert [p.split(":")[0] for p in err.value.problems] == ["gradient_clipping", "optimizer.params.lr",
                                                             "optimizer.params.betas[1]"]
    assert err.value.problems[0] == "gradient_clipping: NaN is not a JSON number (DeepSpeed's hjson loader reads it " \
                                    "as text); write a finite number or \"auto\""
    assert "-Infinity is not a JSON number" in err.value.problems[2]


def test_numbers_are_read_as_deepspeeds_hjson_loader_reads_them(tmp_path):
    cfg = load_ds_json(_write(tmp_path, '{"train_micro_batch_size_per_gpu": 4.0, "gradient_clipping": 1.5, '
                                        '"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, '
                                        '"allgather_bucket_size": 1e20}}'))
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and isinstance(cfg["train_micro_batch_size_per_gpu"], int)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 500000000
    assert isinstance(cfg["zero_optimization"]["reduce_bucket_size"], int)
    assert cfg["gradient_clipping"] == 1.5 and isinstance(cfg["zero_optimization"]["allgather_bucket_size"], float)
    # 4.0 as the micro-batch: taken as 4 (it was refused as "must be a positive integer")
    ds = {"train_micro_batch_size_per_gpu": 4.0, "gradient_accumulation_steps": 2}
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true")
    assert {k: v for k, v, _ in adopt_file_values(cfg, 2)} == {"train.micro_batch": 4, "train.grad_accum": 2}
    check_run(cfg, 2, "cpu")


def test_a_too_large_integer_names_the_limit(tmp_path):
    path = _write(tmp_path, '{"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e20}}')
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=2)
    assert err.value.problems == ["zero_optimization.reduce_bucket_size: file says 1e+20, more than DeepSpeed's "
                                  "integer holds (it rejects it); write a number below 2**63, such as 5e8"]


@pytest.mark.parametrize("stage, expected", [("2", 2), (" 3 ", 3), ("0", 0)])
def test_a_stage_in_quotes_is_the_stage_deepspeeds_parser_reads(tmp_path, stage, expected):
    cfg = load_ds_json(_write(tmp_path, json.dumps({"zero_optimization": {"stage": stage}})))
    assert cfg["zero_optimization"]["stage"] == expected
    assert f"ZeRO stage {expected}" in check_ds_file(_write(tmp_path, json.dumps(
        {"zero_optimization": {"stage": stage}})), device_type="cpu", world_size=2)
    for bad in ("two", "4"):
        with pytest.raises(DSConfigError, match="zero_optimization.stage: must be 0, 1, 2 or 3"):
            check_ds_file(_write(tmp_path, json.dumps({"zero_optimization": {"stage": bad}})), device_type="cpu")


# --------------------------------------------------------------------------- values no run can take


@pytest.mark.parametrize("path, value, refused", [
    ("optimizer.params.weight_decay", -0.01, True), ("optimizer.params.weight_decay", 0, False),
    ("optimizer.params.eps", 0.0, True), ("optimizer.params.lr", float("inf"), True),
    ("optimizer.params.betas", [0.9, 1.0], True), ("optimizer.params.betas", [0.9, 0.999], False),
    ("scheduler.params.warmup_num_steps", -10, True), ("scheduler.params.warmup_num_steps", 0, True),
    ("scheduler.params.total_num_steps", 0, True), ("scheduler.params.cos_min_ratio", 1.5, True),
    ("gradient_clipping", 0.0, False), ("gradient_clipping", -1.0, True), ("train_batch_size", -4, False),
])
def test_range_of_each_file_number(path, value, refused):
    problem = range_problem(path, value)
    assert (problem is not None) == refused, problem
    if refused:
        assert problem.startswith(f"{path}: must be ") and problem.endswith(f"file says {json.dumps(value)}".replace(
            "Infinity", "inf"))


def test_out_of_range_values_are_the_files_problem_with_and_without_the_switch(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 8,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": -0.01}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2e-3, "warmup_num_steps": -10}}}
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(ds, values(), "f.json")
    assert [p.split(":")[0] for p in err.value.problems] == ["optimizer.params.weight_decay",
                                                             "scheduler.params.warmup_num_steps"]
    assert err.value.fixes == {}  # no --train.weight_decay=-0.01 offered: the run refuses it too
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true")
    with pytest.raises(DSConfigError) as err:  # both named by the file's keys, not the first as train.*
        adopt_file_values(cfg, 2)
    assert [p.split(":")[0] for p in err.value.problems] == ["optimizer.params.weight_decay",
                                                             "scheduler.params.warmup_num_steps"]
    assert "train.warmup_steps" not in str(err.value)
    # 0 turns DeepSpeed's clipping off: taken
    cfg = run_cfg(tmp_path, {"gradient_clipping": 0.0}, "--deepspeed.values_from_file=true")
    assert [(k, v) for k, v, _ in adopt_file_values(cfg, 2)] == [("train.grad_clip", 0.0)]
    check_run(cfg, 2, "cpu")


def test_auto_inside_a_list_is_one_problem_and_check_config_does_not_crash(tmp_path):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": ["auto", "auto"]}}}
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(ds, values(), "f.json")
    assert err.value.problems == ['optimizer.params.betas: "auto" stands for the whole value ("betas": "auto"), not '
                                  'for one of its numbers, file says ["auto", "auto"]; write "betas": "auto" or the '
                                  'numbers']  # not "(a string: write the number without quotes", nor betas[0], [1]
    with pytest.raises(DSConfigError) as err:
        check_ds_file(_write(tmp_path, json.dumps(ds)), device_type="cpu", world_size=2)
    assert len(err.value.problems) == 1


def test_an_auto_type_is_named_once(tmp_path):
    cfg = run_cfg(tmp_path, {"optimizer": {"type": "auto", "params": {"lr": "auto"}},
                             "scheduler": {"type": "auto"}})
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert err.value.problems == [
        "optimizer.type: \"auto\" is not a type dstrain chooses; name one, or remove the optimizer block (the run's "
        "own is used then)",
        "scheduler.type: \"auto\" is not a type dstrain chooses; name one, or remove the scheduler block (the run's "
        "own is used then)"]


def test_the_switch_is_not_offered_when_it_is_on():
    err = DSConfigError("f.json", ["gradient_clipping: file says 0.5, run gives 1.0"], {"train.grad_clip": "0.5"}, 1,
                        switch_on=True)
    assert str(err).endswith('use --train.grad_clip=0.5, or set them to "auto" in the file')
    assert "values_from_file" in str(DSConfigError("f.json", ["x"], {"train.grad_clip": "0.5"}, 1))


# --------------------------------------------------------------------------- optimizer and scheduler


@pytest.mark.parametrize("params, offload, expected", [
    ({"lr": 1e-3, "fused": True, "foreach": False}, False,
     "optimizer.params.foreach, fused: DeepSpeed's FusedAdam, which DeepSpeed builds from this block, does not take "
     "them"),
    ({"lr": 1e-3, "capturable": True}, True, "optimizer.params.capturable: DeepSpeed's DeepSpeedCPUAdam"),
    ({"lr": 1e-3, "fused": True, "torch_adam": True}, False, None),  # torch.optim.AdamW takes it
    ({"lr": 1e-3, "amsgrad": True, "bias_correction": True}, False, None),  # FusedAdam (or dstrain's AdamW) takes them
    ({"lr": 1e-3, "betas": [0.9, 0.99], "adam_w_mode": False}, True, None),
])
def test_adam_params_the_built_class_does_not_take(params, offload, expected):
    ds = {"zero_optimization": {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})},
          "optimizer": {"type": "AdamW", "params": params}}
    problems, _ = section_problems(ds, "cpu")
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(expected), problems
        assert "DeepSpeed would stop at start-up; remove" in problems[0]


def test_warmup_schedulers_set_the_lr_so_the_optimizer_lr_is_unused(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 8,
          "optimizer": {"type": "Adam", "params": {"lr": 1.5e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4,
                                                       "warmup_num_steps": 2}}}
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(ds, values(), "f.json")
    assert [p.split(":")[0] for p in err.value.problems] == ["scheduler.params.warmup_max_lr"]  # not the unused lr
    assert err.value.fixes == {"train.lr": "0.0006"}
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true", "--train.warmup_steps=2")
    assert ("train.lr", 6e-4) in [(k, v) for k, v, _ in adopt_file_values(cfg, 2)]
    notes = check_run(cfg, 2, "cpu")
    assert "optimizer.params.lr: unused (0.00015): WarmupLR sets the learning rate from the first step, warming up " \
           "to warmup_max_lr 0.0006, the run's lr" in notes
    assert "warmup_max_lr 0.0006" in check_ds_file(_write(tmp_path, json.dumps(ds)), device_type="cpu", world_size=2)
    # WarmupCosineLR takes its peak from the optimizer's lr: still compared
    cosine = {**ds, "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 2}}}
    with pytest.raises(DSConfigError, match="optimizer.params.lr: file says 0.00015, run gives 0.002"):
        fill_ds_config(cosine, values(), "f.json")


# --------------------------------------------------------------------------- precision


def test_stage0_accumulation_dtype_decides_an_open_precision(tmp_path):
    from dstrain.engine.factory import _file_precision
    ds = {"bf16": {"enabled": "auto"}, "data_types": {"grad_accum_dtype": "fp32"}, "zero_optimization": {"stage": 0}}
    assert _file_precision(ds) == "fp32"  # was None: the factory chose bf16 and DeepSpeed stopped at start-up
    check_run(run_cfg(tmp_path, ds), 2, "cpu")
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true")
    assert [(k, v, w.split(" in ")[0]) for k, v, w in adopt_file_values(cfg, 2)] == \
        [("deepspeed.precision", "fp32", "data_types.grad_accum_dtype")]
    # the run asking for bf16 disagrees, with the override that removes it
    with pytest.raises(DSConfigError) as err:
        check_run(run_cfg(tmp_path, ds, "--deepspeed.precision=bf16"), 2, "cpu")
    assert err.value.problems[0].startswith("data_types.grad_accum_dtype: file says \"fp32\", run precision is bf16")
    assert err.value.fixes == {"deepspeed.precision": "fp32"}
    # at stage 1 it does not pin anything; where the file fixes bf16 at stage 0 it is the file's own contradiction
    assert _file_precision({**ds, "zero_optimization": {"stage": 1}}) is None
    problems, _ = section_problems({**ds, "bf16": {"enabled": True}}, "cpu")
    assert problems and problems[0].startswith("data_types.grad_accum_dtype: fp32 with bf16 weights needs ZeRO stage")
