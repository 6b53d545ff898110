"""Tests for dstrain.engine.ds_config: shipped profiles, "auto" filling and rejection messages."""
import copy
import json
import re
from pathlib import Path

import pytest

from dstrain.engine.ds_config import (DEEPSPEED_NATIVE_AUTO, KNOWN_TOP_LEVEL_KEYS, REMOVED_TOP_LEVEL_KEYS,
                                      DSConfigError, RunValues, describe_zero, ds_configs_dir, fill_ds_config,
                                      implied_batch, list_profiles, load_ds_json, resolve_profile_path,
                                      validate_top_level)

# name -> (stage, offload_optimizer, offload_param)
SHIPPED = {
    "zero0": (0, False, False),
    "zero1": (1, False, False),
    "zero2": (2, False, False),
    "zero2_offload": (2, True, False),
    "zero3": (3, False, False),
    "zero3_offload_optimizer": (3, True, False),
    "zero3_offload": (3, True, True),
}


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    """DeepSpeed's config parsing sees a CPU accelerator here; set per test (a module-level setting
    would stay in the environment of every run launched later in the same pytest session)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def values(**over) -> RunValues:
    base = dict(micro_batch=2, grad_accum=3, dp_world_size=1, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                weight_decay=0.1, grad_clip=1.0, precision="bf16", hidden_size=64, total_steps=100,
                warmup_steps=10, min_lr_ratio=0.1)
    base.update(over)
    return RunValues(**base)


def autos(node, path=""):
    """Dotted paths of every "auto" string left in a config."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in autos(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in autos(v, f"{path}[{i}]")]
    return [path] if node == "auto" else []


def template(name="zero2"):
    return load_ds_json(resolve_profile_path(name))


@pytest.fixture(scope="module")
def ds():
    """deepspeed's own config classes (imported once)."""
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    return dict(torch=torch, lr_schedules=lr_schedules, DeepSpeedConfig=DeepSpeedConfig, bf16=DeepSpeedBF16Config,
                fp16=DeepSpeedFP16Config, zero=DeepSpeedZeroConfig, off_opt=DeepSpeedZeroOffloadOptimizerConfig,
                off_param=DeepSpeedZeroOffloadParamConfig)


def test_all_profiles_shipped():
    assert set(SHIPPED) <= set(list_profiles())


@pytest.mark.parametrize("name", sorted(SHIPPED))
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_shipped_profile_fills_and_deepspeed_accepts_it(name, precision, ds):
    raw = template(name)
    validate_top_level(raw, name)
    cfg = fill_ds_config(raw, values(precision=precision), name)
    assert autos(cfg) == []
    assert describe_zero(cfg) == dict(zip(("stage", "offload_optimizer", "offload_param"), SHIPPED[name]))
    # strict=True: DeepSpeed's pydantic sections reject unknown keys and do not drop "auto"
    zo = cfg["zero_optimization"]
    zero = ds["zero"](strict=True, **zo)
    assert int(zero.stage) == SHIPPED[name][0]
    if "offload_optimizer" in zo:
        assert ds["off_opt"](strict=True, **zo["offload_optimizer"]).device == "cpu"
    if "offload_param" in zo:
        assert ds["off_param"](strict=True, **zo["offload_param"]).device == "cpu"
    assert ds["bf16"](strict=True, **cfg["bf16"]).enabled is (precision == "bf16")
    assert ds["fp16"](strict=True, **cfg["fp16"]).enabled is (precision == "fp16")
    # the whole config through DeepSpeed's parser (world size 1 without torch.distributed)
    parsed = ds["DeepSpeedConfig"](copy.deepcopy(cfg))
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) \
        == (6, 2, 3)
    assert parsed.zero_optimization_stage == SHIPPED[name][0]
    assert parsed.gradient_clipping == 1.0
    # optimizer params are accepted by the class that receives them; the profiles leave the
    # schedule to dstrain (no "scheduler" section: DeepSpeed's WarmupCosineLR idles 2 steps)
    torch = ds["torch"]
    p = torch.nn.Parameter(torch.zeros(2))
    torch.optim.AdamW([p], **cfg["optimizer"]["params"])
    assert "scheduler" not in cfg


def test_known_keys_are_real_deepspeed_keys():
    deepspeed = pytest.importorskip("deepspeed")
    root = Path(deepspeed.__file__).parent
    source = "\n".join(p.read_text(errors="ignore") for p in root.rglob("*.py"))
    literals = set(re.findall(r"""["']([A-Za-z0-9_]+)["']""", source))
    assert sorted(KNOWN_TOP_LEVEL_KEYS - literals) == []
    assert sorted(set(REMOVED_TOP_LEVEL_KEYS) - literals) == []
    assert not KNOWN_TOP_LEVEL_KEYS & set(REMOVED_TOP_LEVEL_KEYS)
    assert {p.split(".")[0] for p in DEEPSPEED_NATIVE_AUTO} <= KNOWN_TOP_LEVEL_KEYS


def test_known_keys_cover_what_deepspeed_config_reads():
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime import config as ds_config_module
    text = Path(ds_config_module.__file__).read_text()
    names = re.findall(r"get_scalar_param\(param_dict,\s*([A-Z_]+)|param_dict\.get\(([A-Z_]+)"
                       r"|([A-Z_]+) in param_dict(?!\[)", text)
    keys = {getattr(ds_config_module, n) for group in names for n in group if n}
    assert keys and sorted(keys - KNOWN_TOP_LEVEL_KEYS) == []
    removed = getattr(ds_config_module, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    assert sorted(set(removed) - set(REMOVED_TOP_LEVEL_KEYS)) == []
    assert deepspeed.__version__.startswith("0.19")


# Real-world DeepSpeed JSONs often carry a scheduler; the shipped profiles leave it to dstrain.
COSINE = {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                               "warmup_min_ratio": 0.0, "cos_min_ratio": "auto",
                                               "warmup_type": "linear"}}


def test_auto_values_filled():
    raw = template("zero3")
    raw["scheduler"] = copy.deepcopy(COSINE)
    before = copy.deepcopy(raw)
    cfg = fill_ds_config(raw, values(micro_batch=4, grad_accum=2, dp_world_size=8, precision="fp16"), "zero3")
    assert raw == before  # template untouched
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (64, 4, 2)
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert cfg["scheduler"]["params"] == {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.0,
                                          "cos_min_ratio": 0.1, "warmup_type": "linear"}
    assert cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is True
    zo = cfg["zero_optimization"]
    assert zo["reduce_bucket_size"] == 64 * 64
    assert zo["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64) == 3686
    assert zo["stage3_param_persistence_threshold"] == 640
    assert fill_ds_config(template("zero1"), values(), "zero1")["zero_optimization"]["allgather_bucket_size"] == 4096


def test_missing_keys_filled_and_sections_added():
    cfg = fill_ds_config({"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupCosineLR"}},
                         values(warmup_steps=0), "tiny.json")
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (6, 2, 3)
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["optimizer"]["params"]["lr"] == 3e-4 and cfg["gradient_clipping"] == 1.0
    # DeepSpeed refuses warmup_num_steps=0, so no warm-up is filled as 1
    assert cfg["scheduler"]["params"] == {"total_num_steps": 100, "warmup_num_steps": 1, "cos_min_ratio": 0.1}


def test_mismatches_listed_together():
    raw = template("zero2")
    raw["optimizer"]["params"]["lr"] = 1e-3
    raw["gradient_clipping"] = 0.5
    raw["fp16"]["enabled"] = True
    raw["train_micro_batch_size_per_gpu"] = 4
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(raw, values(precision="fp32"), "my.json")
    msg = str(err.value)
    assert msg.startswith("my.json")
    assert "optimizer.params.lr: file says 0.001, run gives 0.0003" in msg
    assert "gradient_clipping: file says 0.5, run gives 1.0" in msg
    assert "fp16.enabled: file says true, run precision is fp32" in msg
    assert "train_micro_batch_size_per_gpu: file says 4, run gives 2" in msg
    assert len(err.value.problems) == 4
    # every problem is a disagreement: one line, ending with the overrides that make them agree
    assert "\n" not in msg
    assert msg.endswith('use --train.micro_batch=4 --train.grad_clip=0.5 --train.lr=0.001 --deepspeed.precision=fp16, '
                        'or set them to "auto" in the file, or pass --deepspeed.values_from_file=true to take them '
                        'from the file')


def test_equal_explicit_values_pass_with_float_tolerance():
    raw = template("zero2")
    raw.update(train_batch_size=6, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3,
               gradient_clipping=1)
    raw["optimizer"]["params"].update(lr=0.00030000000001, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1)
    raw["bf16"]["enabled"] = True
    cfg = fill_ds_config(raw, values(), "explicit.json")
    assert cfg["optimizer"]["params"]["lr"] == 0.00030000000001


def test_betas_and_scheduler_mismatch():
    raw = template("zero1")
    raw["scheduler"] = copy.deepcopy(COSINE)
    raw["optimizer"]["params"]["betas"] = [0.9, 0.999]
    raw["scheduler"]["params"]["total_num_steps"] = 5000
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(raw, values(), "b.json")
    assert "optimizer.params.betas: file says [0.9, 0.999], run gives [0.9, 0.95]" in str(err.value)
    assert "scheduler.params.total_num_steps: file says 5000, run gives 100" in str(err.value)


def test_leftover_auto_named_by_dotted_path():
    raw = template("zero3")
    raw["zero_optimization"]["stage3_max_live_parameters"] = "auto"  # DeepSpeed's parser: its default
    assert fill_ds_config(raw, values(), "z3.json")["zero_optimization"]["stage3_max_live_parameters"] == 10 ** 9
    raw["zero_optimization"]["offload_param"] = "auto"  # no plain default to stand for it
    raw["tensorboard"] = {"enabled": "auto"}
    raw["data_types"] = {"keep_in_fp32_modules": "auto"}  # DeepSpeed's own "auto": allowed
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(raw, values(), "z3.json")
    assert sorted(p.split(":")[0] for p in err.value.problems) == [
        "tensorboard.enabled", "zero_optimization.offload_param"]


def test_unknown_top_level_keys_with_suggestions():
    cfg = {"train_batch_size": 8, "zero_optimisation": {"stage": 2}, "gradient_clippin": 1.0, "amp": {}}
    with pytest.raises(DSConfigError) as err:
        validate_top_level(cfg, "typo.json")
    msg = str(err.value)
    assert "'zero_optimisation' (did you mean 'zero_optimization'?)" in msg
    assert "'gradient_clippin' (did you mean 'gradient_clipping'?)" in msg
    assert "'amp' is no longer supported" in msg
    with pytest.raises(DSConfigError, match="zero_optimisation"):
        fill_ds_config(cfg, values(), "typo.json")


def test_batch_keys_inconsistent_among_themselves():
    raw = template("zero0")
    raw.update(train_batch_size=64, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=4)
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(raw, values(micro_batch=4, grad_accum=4, dp_world_size=2), "batch.json")
    msg = str(err.value)
    assert "train_batch_size 64 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 4 x 2 " \
           "data-parallel ranks = 32" in msg
    assert len(err.value.problems) == 1 and not err.value.fixes  # no run config makes them agree


@pytest.mark.parametrize("keys, world, micro, accum", [
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=4), 1, 4, 4),  # Megatron style: accum derived
    (dict(train_batch_size=16, train_micro_batch_size_per_gpu=4), 2, 4, 2),
    (dict(train_batch_size=16, gradient_accumulation_steps=2), 2, 4, 2),     # micro derived
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 2, 4, 2),
    (dict(train_batch_size=16), 2, 8, 1),                                      # the run's accum kept when it fits
    (dict(train_batch_size="auto", train_micro_batch_size_per_gpu=4), 2, 4, None),  # "auto" counts as absent
])
def test_batch_keys_follow_deepspeed_derivation(keys, world, micro, accum):
    raw = {**template("zero0"), **keys}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key not in keys:
            raw.pop(key)
    assert implied_batch(raw, world, 8, 1 if accum is None else 3)[2] == []
    got = implied_batch(raw, world, 8, 1)
    assert got[:2] == (micro, accum if accum is not None else None) or accum is None and got[0] == micro
    run_accum = accum or 3
    cfg = fill_ds_config(raw, values(micro_batch=micro, grad_accum=run_accum, dp_world_size=world), "m.json")
    assert cfg["train_batch_size"] == micro * run_accum * world
    assert cfg["gradient_accumulation_steps"] == run_accum
    assert cfg["train_micro_batch_size_per_gpu"] == micro


def test_batch_disagreement_names_the_overrides_that_fix_it():
    raw = {**template("zero0"), "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}
    raw.pop("gradient_accumulation_steps")
    with pytest.raises(DSConfigError) as err:
        fill_ds_config(raw, values(micro_batch=4, grad_accum=1, dp_world_size=2), "megatron.json")
    msg = str(err.value)
    assert "gradient_accumulation_steps: file implies 2 (train_batch_size 16, train_micro_batch_size_per_gpu 4 on " \
           "2 data-parallel ranks), run gives 1" in msg
    assert err.value.fixes == {"train.grad_accum": "2"} and "use --train.grad_accum=2, or set them" in msg
    assert implied_batch({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, 1, 8, 1)[2]  # no accum fits
    assert implied_batch({"train_batch_size": 10}, 4, 8, 1)[2]  # not a multiple of the ranks


def test_run_values_errors_name_run_config_keys():
    with pytest.raises(ValueError, match=r"^train.micro_batch must be a positive integer, got -1$"):
        values(micro_batch=-1)


def test_offload_param_below_stage3_rejected():
    raw = template("zero2")
    raw["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    with pytest.raises(DSConfigError, match=r"offload_param: parameter offload is only valid with ZeRO stage 3, "
                                            r"file has stage 2"):
        fill_ds_config(raw, values(), "z2.json")


def test_zenflow_needs_gradient_accumulation_1():
    """ZenFlow updates at every micro-batch and overwrites DeepSpeed's accumulation with its update_interval."""
    raw = template("zero2")
    raw["zero_optimization"].update(offload_optimizer={"device": "cpu"}, zenflow={"topk_ratio": 0.1,
                                                                                  "update_interval": 4})
    assert fill_ds_config(raw, values(grad_accum=1), "zf.json")["zero_optimization"]["zenflow"]["update_interval"] == 4
    with pytest.raises(DSConfigError, match=r"zero_optimization.zenflow: ZenFlow updates the selected parameters at "
                                            r"every micro-batch .* the run's gradient accumulation 2 would not"):
        fill_ds_config(raw, values(grad_accum=2), "zf.json")


def test_fp16_and_bf16_both_enabled_rejected():
    raw = template("zero1")
    raw["fp16"]["enabled"] = True
    raw["bf16"]["enabled"] = True
    with pytest.raises(DSConfigError, match="both true"):
        fill_ds_config(raw, values(), "both.json")


def test_bad_json_reports_line_and_column(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled" true}\n}\n')
    with pytest.raises(DSConfigError) as err:
        load_ds_json(bad)
    assert "broken.json" in str(err.value) and "line 3" in str(err.value) and "column" in str(err.value)
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(DSConfigError, match="duplicate key 'train_batch_size'"):
        load_ds_json(dup)
    # what DeepSpeed's own loader (hjson) reads: comments and a trailing comma
    commented = tmp_path / "commented.json"
    commented.write_text('{\n  "train_batch_size": 8,  # the global batch\n  // bf16\n  "bf16": {"enabled": true,},\n}\n')
    assert load_ds_json(commented) == {"train_batch_size": 8, "bf16": {"enabled": True}}
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(DSConfigError, match="must be a JSON object"):
        load_ds_json(arr)


def test_resolve_profile_path(tmp_path, monkeypatch):
    assert resolve_profile_path("zero2") == ds_configs_dir() / "zero2.json"
    assert resolve_profile_path(str(ds_configs_dir() / "zero3.json")).name == "zero3.json"
    with pytest.raises(DSConfigError) as err:
        resolve_profile_path("zer2")
    assert "zero2_offload" in str(err.value) and "did you mean 'zero2'" in str(err.value)
    with pytest.raises(DSConfigError, match="no such"):
        resolve_profile_path(str(tmp_path / "missing.json"))
    (tmp_path / "mine.json").write_text(json.dumps({"train_batch_size": 4}))
    monkeypatch.setenv("DSTRAIN_DS_CONFIGS", str(tmp_path))
    assert list_profiles() == ["mine"]
    assert resolve_profile_path("mine") == tmp_path / "mine.json"


def test_describe_zero_and_run_values_checks():
    assert describe_zero({}) == {"stage": 0, "offload_optimizer": False, "offload_param": False}
    assert describe_zero({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}}) == \
        {"stage": 2, "offload_optimizer": False, "offload_param": False}
    with pytest.raises(ValueError, match="warmup_steps"):
        values(warmup_steps=-1)
    with pytest.raises(ValueError, match="precision"):
        values(precision="fp8")
