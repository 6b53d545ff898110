"""Round 6 of real-world DeepSpeed JSONs: ZeRO booleans written as strings (``"pin_memory": "True"``,
``"zero_quantized_weights": "true"``, as generated configs write them), DeepSpeedExamples' SuperOffload block
(``offload_optimizer.super_offload``, CUDA only), ZeRO-3 bucket sizes quoted (``"reduce_bucket_size": "5e8"``),
quoted ``enabled`` of the monitors and of DeepSpeed's plain flags (``"wall_clock_breakdown": "false"``, which
DeepSpeed reads as true or fails on), a ``stage3_module_granularity_threshold`` or ``leaf_module`` class that
makes the whole model one ZeRO-3 leaf (DeepSpeed's backward fails), and HF-style ``"dataloader_drop_last": true``
(accepted by DeepSpeed, and what dstrain's batches already are).
Also in the round, handled before it and pinned by tests/configs: a disabled ``amp`` block, progressive layer
drop, Nebula, AutoTP training, Ulysses' ``sequence_parallel_size``, DeepCompile, ZeRO-3 ``leaf_module`` and
``stage3_module_granularity_threshold``, ``zero_force_ds_cpu_optimizer`` false with ``torch_adam``,
``gradient_predivide_factor`` at stage 1, ``data_types.grad_accum_dtype`` bf16."""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_check import check_ds_file, deepspeed_problems
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_files import canonical_forms, load_ds_json
from dstrain.engine.ds_sections import section_problems


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def _write(tmp_path, cfg: dict, name: str = "ds.json"):
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


# --------------------------------------------------------------------------- booleans written as strings


STRINGY = {"stage": 3, "zero_quantized_weights": "true", "zero_quantized_gradients": "True", "overlap_comm": "false",
           "cpu_offload": "no", "reduce_bucket_size": "auto", "stage3_max_live_parameters": "1e9",
           "offload_optimizer": {"device": "cpu", "pin_memory": "True", "super_offload": "yes", "ratio": "0.5"},
           "offload_param": {"device": "cpu", "pin_memory": "1", "buffer_count": "5"}}


def test_zero_string_booleans_read_as_deepspeeds_parser_reads_them():
    zo = canonical_forms({"zero_optimization": STRINGY})["zero_optimization"]
    assert zo["zero_quantized_weights"] is True and zo["zero_quantized_gradients"] is True
    assert zo["overlap_comm"] is False and zo["cpu_offload"] is False  # Optional[bool] keys too
    assert zo["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "super_offload": True, "ratio": "0.5"}
    assert zo["offload_param"] == {"device": "cpu", "pin_memory": True, "buffer_count": "5"}
    # not booleans: left to the filling and DeepSpeed's own check ("auto", numbers, the device)
    assert zo["reduce_bucket_size"] == "auto" and zo["stage3_max_live_parameters"] == "1e9"
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    parsed = DeepSpeedZeroConfig(**{k: v for k, v in STRINGY.items()  # cpu_offload: a deprecated alias
                                    if k not in ("reduce_bucket_size", "stage3_max_live_parameters", "cpu_offload")})
    assert (parsed.zero_quantized_weights, parsed.overlap_comm, parsed.offload_optimizer.pin_memory,
            parsed.offload_optimizer.super_offload) == (True, False, True, True)  # what DeepSpeed itself reads


def test_a_word_that_is_not_a_boolean_is_left_for_deepspeeds_check():
    zo = canonical_forms({"zero_optimization": {"stage": 2, "overlap_comm": "sometimes"}})["zero_optimization"]
    assert zo["overlap_comm"] == "sometimes"
    assert any(p.startswith("zero_optimization.overlap_comm:") for p in deepspeed_problems(
        {"zero_optimization": zo, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}))


def test_quoted_zeropp_switches_are_refused_on_the_cpu(tmp_path):
    """Before: "true" passed the ``is True`` check, and DeepSpeed's parser then switched the CUDA quantizer on."""
    path = _write(tmp_path, {"bf16": {"enabled": "true"}, "train_micro_batch_size_per_gpu": 1,
                             "zero_optimization": {"stage": 3, "zero_quantized_weights": "true"}})
    assert load_ds_json(path)["zero_optimization"]["zero_quantized_weights"] is True
    with pytest.raises(DSConfigError, match="zero_optimization.zero_quantized_weights: ZeRO\\+\\+ quantized"):
        check_ds_file(path, device_type="cpu", world_size=2)


def test_quoted_pin_memory_trains_as_a_boolean(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 2, "reduce_scatter": "false",
                                                   "offload_optimizer": {"device": "cpu", "pin_memory": "True"}}})
    said = check_ds_file(path, device_type="cpu", world_size=2)
    assert "ZeRO stage 2, offload optimizer" in said
    assert load_ds_json(path)["zero_optimization"]["reduce_scatter"] is False


# --------------------------------------------------------------------------- SuperOffload


SUPER = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.9, "super_offload": True,
                                           "cpuadam_cores_perc": 0.9}}


def test_superoffload_is_refused_on_the_cpu_by_key_with_the_fix():
    """Before: it passed the checks, and every rank died in DeepSpeed's assert ('SuperOffload only supports NVIDIA
    CUDA GPUs') after the launch."""
    problems, _ = section_problems({"zero_optimization": SUPER}, "cpu")
    assert problems == ["zero_optimization.offload_optimizer.super_offload: SuperOffload runs only on NVIDIA CUDA "
                        "GPUs (DeepSpeed asserts it when it builds the ZeRO-3 optimizer); set it to false (plain "
                        "ZeRO-Offload) or run on GPUs"]
    assert section_problems({"zero_optimization": SUPER}, "cuda")[0] == []
    off = {**SUPER, "offload_optimizer": {**SUPER["offload_optimizer"], "super_offload": False}}
    assert section_problems({"zero_optimization": off}, "cpu")[0] == []


def test_superoffload_below_stage_3_is_a_note():
    problems, notes = section_problems({"zero_optimization": {**SUPER, "stage": 2}}, "cpu")
    assert problems == []
    assert "zero_optimization.offload_optimizer: stage 2 does not use super_offload (a stage-3 key)" in notes


def test_quoted_superoffload_is_refused_too(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "super_offload": "true"}}})
    with pytest.raises(DSConfigError, match="offload_optimizer.super_offload: SuperOffload runs only on NVIDIA"):
        check_ds_file(path, device_type="cpu", world_size=2)


# --------------------------------------------------------------------------- numbers in quotes


def test_quoted_bucket_sizes_name_the_key_and_the_fix(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": "5e8", "stage3_max_live_parameters": "1e9"}})
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=2)
    assert err.value.problems == [
        "zero_optimization.reduce_bucket_size: file says '5e8', a number in quotes, which DeepSpeed's parser does "
        "not read as a number (it rejects it); write it without the quotes: 5e8",
        "zero_optimization.stage3_max_live_parameters: file says '1e9', a number in quotes, which DeepSpeed's parser "
        "does not read as a number (it rejects it); write it without the quotes: 1e9"]


def test_a_quoted_word_keeps_pydantics_message(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1,
                             "zero_optimization": {"stage": 3, "reduce_bucket_size": "big"}})
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=2)
    assert err.value.problems[0].startswith("zero_optimization.reduce_bucket_size: Input should be a valid integer")
    assert "without the quotes" not in err.value.problems[0]


def test_a_quoted_plain_integer_is_read_by_deepspeed_and_passes(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                             "zero_optimization": {"stage": 3, "reduce_bucket_size": "500000000"}})
    assert "ZeRO stage 3" in check_ds_file(path, device_type="cpu", world_size=2)


# --------------------------------------------------------------------------- dataloader_drop_last


def test_dataloader_drop_last_true_is_a_note_not_a_refusal():
    """Before: refused, though DeepSpeed accepts it and dstrain's step-indexed sampler never yields a partial
    batch (the setting asks for nothing dstrain does not already do)."""
    problems, notes = section_problems({"dataloader_drop_last": True, "zero_optimization": {"stage": 1}}, "cpu")
    assert problems == []
    assert any(n.startswith("dataloader_drop_last: only DeepSpeed's own dataloader reads it") for n in notes)
    assert section_problems({"dataloader_drop_last": False}, "cpu") == ([], [])


# --------------------------------------------------------------------------- ZeRO-3 leaf modules


def _gpt():
    from models import registry
    spec = registry.get_spec("gpt")
    mcfg = registry.make_model_config("gpt", "tiny", None)
    return lambda: spec.build(mcfg)


def test_a_granularity_threshold_that_makes_the_model_a_leaf_is_refused_with_the_blocks_to_name():
    """Before: it passed the checks and every rank failed in DeepSpeed's ZeRO-3 backward ("output with shape [1]
    doesn't match the broadcast shape [257, 128]"): the tiny GPT's own granularity (21613) is its smallest."""
    from dstrain.engine.zero_leaves import leaf_problems
    zo = {"stage": 3, "stage3_module_granularity_threshold": 100000}
    assert leaf_problems({"zero_optimization": zo}, _gpt()) == [
        "zero_optimization.stage3_module_granularity_threshold: 100000 makes the whole model (GPT, 21613 parameters "
        "per layer) one leaf module, and DeepSpeed's ZeRO-3 backward fails then; remove it and name the blocks in "
        "zero_optimization.leaf_module (e.g. \"classes\": [\"Block\"])"]
    # below the model's granularity DeepSpeed sets no leaf (it only warns); at stage 2 it reads no threshold
    assert leaf_problems({"zero_optimization": {**zo, "stage3_module_granularity_threshold": 21612}}, _gpt()) == []
    assert leaf_problems({"zero_optimization": {**zo, "stage": 2}}, _gpt()) == []


def test_the_model_class_as_a_leaf_is_refused_and_its_blocks_are_not():
    from dstrain.engine.zero_leaves import leaf_problems
    root = leaf_problems({"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["models.gpt.model.GPT"]}}},
                         _gpt())
    assert len(root) == 1 and root[0].startswith("zero_optimization.leaf_module.classes: 'GPT' is the model itself")
    for classes in (["Block"], ["MixtralSparseMoeBlock"]):  # a class the model lacks: DeepSpeed marks none
        assert leaf_problems({"zero_optimization": {"stage": 3, "leaf_module": {"classes": classes}}}, _gpt()) == []


def test_the_leaf_check_runs_before_launch(tmp_path, capsys, monkeypatch):
    import subprocess

    from dstrain import cli
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no start")))
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {
        "stage": 3, "leaf_module": {"classes": ["GPT"]}}})
    from pathlib import Path
    recipe = Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json"
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", str(recipe),
                     f"--deepspeed.profile={path}", "--train.steps=3", "--deepspeed.values_from_file=true",
                     f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "zero_optimization.leaf_module.classes: 'GPT' is the model itself" in err


# --------------------------------------------------------------------------- quoted flags outside ZeRO


def test_quoted_monitor_switches_are_on_and_write_inside_the_run_folder(tmp_path):
    """Before: "enabled": "true" was on to DeepSpeed (pydantic) but off to dstrain, so the monitors wrote to
    the working directory and a missing wandb package was not named before launch."""
    from dstrain.engine.factory import user_sections
    cfg = canonical_forms({"tensorboard": {"enabled": "true", "output_path": "tb"},
                           "csv_monitor": {"enabled": "True", "output_path": "csv"},
                           "flops_profiler": {"enabled": "true", "detailed": "yes"}, "wandb": {"enabled": "1"}})
    assert [cfg[k]["enabled"] for k in ("tensorboard", "csv_monitor", "flops_profiler", "wandb")] == [True] * 4
    assert cfg["flops_profiler"]["detailed"] is True
    out, _ = user_sections(cfg, str(tmp_path / "run"), "ds.json")
    assert out["tensorboard"]["output_path"] == str(tmp_path / "run" / "tb")
    assert out["flops_profiler"]["output_file"] == str(tmp_path / "run" / "ds_flops_profiler.txt")
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        assert any(p.startswith("wandb.enabled: the wandb package is not installed")
                   for p in section_problems(cfg, "cpu")[0])


@pytest.mark.parametrize("key", ["wall_clock_breakdown", "prescale_gradients", "zero_allow_untested_optimizer"])
def test_a_plain_flag_quoted_true_is_true_and_quoted_false_is_refused(key):
    assert canonical_forms({key: "true"})[key] is True  # what DeepSpeed makes of it (any text is true)
    problems, _ = section_problems(canonical_forms({key: "false"}), "cpu")
    assert problems == [f"{key}: file says 'false' in quotes, which DeepSpeed does not read as a boolean (any text "
                        "counts as true to it, \"false\" too); write false without quotes"]
    assert section_problems(canonical_forms({key: "maybe"}), "cpu")[0][0].endswith("write true or false without quotes")


def test_a_quoted_false_in_a_plain_section_is_refused_by_its_dotted_key():
    cfg = canonical_forms({"activation_checkpointing": {"partition_activations": "false"},
                           "flops_profiler": {"enabled": "off"}})
    problems, _ = section_problems(cfg, "cpu")
    assert [p.split(":")[0] for p in problems] == ["flops_profiler.enabled",
                                                   "activation_checkpointing.partition_activations"]
