"""Round 3 of real-world DeepSpeed JSONs: what each probe found DeepSpeed 0.19.8 would stop on after the
ranks started (or that dstrain crashed on), now named before launch; and what it accepts, still accepted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain import cli
from dstrain.config import load_run_config
from dstrain.engine.ds_check import check_ds_file, deepspeed_problems
from dstrain.engine.ds_config import DSConfigError, RunValues, fill_ds_config
from dstrain.engine.ds_preflight import adopt_file_values, check_run
from dstrain.engine.ds_sections import section_problems

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "models" / "gpt" / "recipes" / "tiny.json"


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def run_cfg(tmp_path, ds: dict, *overrides: str):
    path = tmp_path / "user.json"
    path.write_text(json.dumps(ds))
    return load_run_config(RECIPE, [f"--deepspeed.profile={path}", *overrides])


def values(precision: str = "fp32") -> RunValues:
    return RunValues(micro_batch=8, grad_accum=1, dp_world_size=2, lr=2e-3, betas=(0.9, 0.95), eps=1e-8,
                     weight_decay=0.1, grad_clip=1.0, precision=precision, hidden_size=64, total_steps=6,
                     warmup_steps=2, min_lr_ratio=0.1)


# --------------------------------------------------------------------------- numbers written as strings


def test_numbers_in_quotes_are_named_not_compared_and_not_adopted(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": "1.0",
          "optimizer": {"type": "AdamW", "params": {"lr": "1e-5", "betas": ["0.9", 0.999]}}}
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(ds, values(), "f.json")
    text = str(err.value)
    assert 'gradient_clipping: must be a number or "auto", file says "1.0" (a string: write the number without ' \
           "quotes" in text  # not "file says "1.0", run gives 1.0"
    assert 'optimizer.params.lr: must be a number or "auto", file says "1e-5"' in text
    assert 'optimizer.params.betas: must be two numbers or "auto", file says ["0.9", 0.999]' in text
    assert err.value.fixes == {}  # no override makes text a number
    # values_from_file: a refusal naming each, not a TypeError from comparing text with 0
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true")
    with pytest.raises(DSConfigError) as err:
        adopt_file_values(cfg, 2)
    assert len(err.value.problems) == 3 and cfg.train.lr == 0.002


# --------------------------------------------------------------------------- optimizers and schedulers


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_one_bit_optimizers_are_gone_from_deepspeed_on_every_device(kind, device):
    problems, _ = section_problems({"optimizer": {"type": kind, "params": {"lr": 1e-4, "freeze_step": 100}}}, device)
    assert len(problems) == 1
    assert problems[0].startswith(f"optimizer.type: {kind!r}: DeepSpeed 0.19 no longer has its ")
    assert f"torch.optim.{kind}" in problems[0]


@pytest.mark.parametrize("sched, expected", [
    ({"type": "warmuplr", "params": {"warmup_num_steps": 10}},
     "scheduler.type: 'warmuplr' is neither one of DeepSpeed's schedulers (LRRangeTest, OneCycle, WarmupLR, "
     "WarmupDecayLR, WarmupCosineLR) nor a torch.optim.lr_scheduler class (did you mean 'WarmupLR'? the names are "
     "case-sensitive)"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 10, "total_num_steps": 100}},
     "scheduler.params.total_num_steps: WarmupLR does not take it (it takes last_batch_iteration, warmup_max_lr, "
     "warmup_min_lr, warmup_num_steps, warmup_type)"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_max_lr": 1e-3}},
     "scheduler.params.warmup_max_lr: WarmupCosineLR does not take it"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-5}},
     "scheduler.params: OneCycle needs cycle_max_lr, which the file does not give"),
    ({"type": "StepLR", "params": {"gamma": 0.5}}, "scheduler.params: StepLR needs step_size"),
    ({"type": "CosineAnnealingLR", "params": {"T_max": 10}},
     "scheduler.type: torch.optim.lr_scheduler.CosineAnnealingLR takes only a torch optimizer, and with ZeRO stage 1 "
     "DeepSpeed hands it its optimizer wrapper"),
])
def test_scheduler_blocks_deepspeed_would_stop_on(sched, expected):
    problems, _ = section_problems({"zero_optimization": {"stage": 1}, "scheduler": sched}, "cpu")
    assert any(p.startswith(expected) for p in problems), problems


def test_schedulers_deepspeed_builds():
    for sched in ({"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                                                  "warmup_type": "linear"}},
                  {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}},  # total_num_steps: dstrain's
                  {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.01, "cos_min_ratio": 0.1}},
                  {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4}}):
        assert section_problems({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                 "scheduler": sched}, "cpu")[0] == []
    # torch's schedulers get the client optimizer itself at ZeRO stage 0 in fp32 (or with the file's autocast)
    step = {"type": "StepLR", "params": {"step_size": 2}}
    assert section_problems({"zero_optimization": {"stage": 0}, "scheduler": step}, "cpu")[0] == []
    assert section_problems({"torch_autocast": {"enabled": True}, "bf16": {"enabled": "auto"}, "scheduler": step},
                            "cpu")[0] == []
    assert section_problems({"bf16": {"enabled": "auto"}, "scheduler": step}, "cpu")[0][0].startswith(
        "scheduler.type: torch.optim.lr_scheduler.StepLR takes only a torch optimizer, and with bf16 ")


# --------------------------------------------------------------------------- precision


def test_bf16_and_fp16_both_true_is_one_problem_without_overrides(tmp_path):
    ds = {"bf16": {"enabled": True}, "fp16": {"enabled": True}}
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(ds, values("bf16"), "f.json")
    assert err.value.problems == ["bf16.enabled, fp16.enabled: both true; DeepSpeed allows only one (it asserts at "
                                  "start-up): set one of them to false"]
    assert err.value.fixes == {}  # neither --deepspeed.precision removes it
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true")
    adopt_file_values(cfg, 2)
    assert cfg.deepspeed.precision == "auto"  # neither taken (the last one won before)
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cuda")
    assert err.value.problems[-1].startswith("bf16.enabled, fp16.enabled: both true") and "use --" not in str(err.value)


def test_param_dtype_must_be_the_weights_dtype(tmp_path):
    # bf16 left to the run: the run's precision must match, and --deepspeed.precision is the fix
    open_ = {"bf16": {"enabled": "auto"}, "data_types": {"param_dtype": "bf16"}}
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(open_, values("fp32"), "f.json")
    assert err.value.fixes == {"deepspeed.precision": "bf16"}
    assert fill_ds_config(open_, values("bf16"), "f.json")["bf16"]["enabled"] is True
    # the file's own sections decide: its own contradiction, no override offered
    with pytest.raises(DSConfigError) as err:
        fill_ds_config({"bf16": {"enabled": False}, "data_types": {"param_dtype": "bf16"}}, values("fp32"), "f.json")
    assert err.value.problems == ['data_types.param_dtype: file says "bf16", its bf16 / fp16 sections make the '
                                  'weights fp32 (DeepSpeed asserts they match at start-up)'] and err.value.fixes == {}
    with pytest.raises(DSConfigError, match="param_dtype: must be one of fp32, bf16, fp16"):
        fill_ds_config({"data_types": {"param_dtype": "bf17"}}, values(), "f.json")
    # where bf16 / fp16 leave it open, the launch's stand-in and the factory take the weights' dtype from it
    from dstrain.engine.factory import _file_precision
    assert _file_precision(open_) == "bf16"
    check_run(run_cfg(tmp_path, open_), 2, "cpu")
    cfg = run_cfg(tmp_path, open_, "--deepspeed.values_from_file=true")
    assert [(k, v) for k, v, _ in adopt_file_values(cfg, 2)] == [("deepspeed.precision", "bf16")]
    assert "ZeRO stage 0" in check_ds_file(_write(tmp_path, {"data_types": {"param_dtype": "torch.bfloat16"}}),
                                           device_type="cpu", world_size=2)


def _write(tmp_path, ds: dict) -> Path:
    path = tmp_path / "check.json"
    path.write_text(json.dumps(ds))
    return path


# --------------------------------------------------------------------------- gradient scaling


@pytest.mark.parametrize("ds, refused", [
    ({"zero_optimization": {"stage": 2}, "prescale_gradients": True, "gradient_predivide_factor": 2.0}, True),
    ({"zero_optimization": {"stage": 3}, "gradient_predivide_factor": 2.0}, True),
    ({"zero_optimization": {"stage": 1}, "prescale_gradients": True, "gradient_predivide_factor": 2.0}, False),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}, "gradient_predivide_factor": 2.0}, False),
    ({"zero_optimization": {"stage": 2}, "gradient_allreduce_op": "sum", "prescale_gradients": True}, False),
    ({"zero_optimization": {"stage": 2}, "prescale_gradients": False, "gradient_predivide_factor": 1.0}, False),
])
def test_prescale_and_predivide_where_zero_asserts_them_away(ds, refused):
    problems, _ = section_problems(ds, "cpu")
    assert bool(problems) == refused, problems
    if refused:
        assert "with reduce_scatter does not support" in problems[0] and "set zero_optimization.reduce_scatter to " \
                                                                         "false" in problems[0]


# --------------------------------------------------------------------------- reporting


def test_a_whole_section_check_is_reported_without_the_parsed_section():
    problems = deepspeed_problems({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                          "ratio": 0.3}}})
    assert problems == ["zero_optimization: Partial offloading only supported for ZeRO Stage 3; DeepSpeed rejects it"]


def test_check_config_reads_an_empty_object_as_a_deepspeed_json(tmp_path, capsys):
    path = _write(tmp_path, {})
    assert cli.main(["check-config", str(path), "--world-size", "2", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith(f"{path}: valid DeepSpeed config for cpu: ZeRO stage 0; batch 8 x 1 x 2")


@pytest.mark.parametrize("spp, refused", [(0, True), (-1, False), ("10", True), (True, True), (1, False), (2000, False),
                                          (1e10, False), (None, False)])
def test_steps_per_print_deepspeed_divides_by(spp, refused):
    problems, _ = section_problems({"steps_per_print": spp}, "cpu")
    assert bool(problems) == refused, problems
    if refused:  # (a negative number runs: round 26)
        assert problems[0].startswith("steps_per_print: ") and "rank 0" in problems[0]
