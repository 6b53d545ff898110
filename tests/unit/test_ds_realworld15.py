"""Round 15 of real-world DeepSpeed JSONs: other tools' configs given where a training DeepSpeed JSON goes
(DeepSpeed-inference / MII keys, verl's per-model nesting, Determined's hyperparameters, Ray Train's dict dumped to
JSON) and the numeric spellings DeepSpeed's hjson / pydantic reading accepts.

Fixed in the round (each was refused with the wrong fix or with DeepSpeed's bare exception text, or refused where
DeepSpeed trains, before it): DeepSpeed-inference's top-level keys (``dtype``, ``replace_with_kernel_inject``,
``enable_cuda_graph``, ``max_out_tokens``, ``mp_size``, ...: DeepSpeed's training engine ignores them silently, so an
MII file's ``"dtype": "fp16"`` trains in fp32) were refused as unknown keys with "did you mean 'data_types'?" for
dtype (which does not set the precision): now each is named as an inference key, with the bf16 / fp16 section that
does; ``"tensor_parallel": {"tp_size": 1}`` (training's TPTrainingConfig forbids tp_size) and a ``checkpoint`` given
as a path (inference's checkpoint JSON; training's is an object and DeepSpeed's parser stops on "'str' object has no
attribute 'get'") showed the parser's bare line, and only once every other problem was fixed: now named with the
fix beside the others; verl-style ``{"actor": {"deepspeed_config": {...}}, "critic": ...}`` (unknown key 'actor':
now the nested config is named with its path), and Determined's hyperparameters (``"deepspeed_config":
"ds_config.json"`` naming the file, ``overwrite_deepspeed_args``: now both named for what they are).
``"gradient_clipping": true`` (Ray Train examples): DeepSpeed's get_scalar_param keeps True and clips at max_norm
True, i.e. 1.0 (false: no clipping), where dstrain refused it as not a number; now read as 1.0 / 0.0. SageMaker
model parallelism's (smp) parameters beside a DeepSpeed config (``partitions``, ``microbatches``, ``ddp``, ...: now
named as smp's), its ``"pipeline": "interleaved"`` (DeepSpeed's parser stops on "'str' object has no attribute
'items'": shown bare before, now named with the fix). A negative ``warmup_min_lr`` (WarmupLR / WarmupDecayLR) or
``warmup_min_ratio`` (WarmupCosineLR): DeepSpeed checks neither and sets a negative learning rate for the first
steps (training uphill); passed before, now refused as a negative optimizer lr already was. New module
dstrain.engine.ds_foreign (called by ds_files and ds_sections); the warm-up start in ds_config.
Pinned by tests/configs and trained 3 steps on 2 CPU ranks by hand, as written: the Ray Train file, DeepSpeed's
autotuner output ``ds_config_optimal.json`` (its autotuning section popped by the autotuner), and a file after a
UTF-8 BOM with ``1e0`` / ``2e0`` batch keys, ``5e9`` bucket sizes and ``1`` / ``0`` for booleans (hjson turns an
integral float into an int; pydantic reads 1 / 0 as booleans). Already covered by earlier rounds and not repeated:
duplicate keys (DeepSpeed's loader raises on any, at every depth: refused), NaN / Infinity, negative or zero
batch sizes, bucket sizes, steps_per_print, and a ``gradient_predivide_factor`` beside ZeRO-2's reduce-scatter.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_files import load_ds_json

from tests.unit.ds_rounds import CONFIGS, RECIPE, ROOT  # noqa: E402,F401
from tests.unit.ds_rounds import deepspeed_config as _deepspeed_config  # noqa: E402,F401
from tests.unit.ds_rounds import refusals as _refusals  # noqa: E402,F401
from tests.unit.ds_rounds import dry_run as _dry_run  # noqa: E402,F401

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


# --------------------------------------------------------------------------- DeepSpeed-inference / MII keys


def test_deepspeed_reads_the_inference_keys_only_in_its_inference_config():
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    fields = DeepSpeedInferenceConfig.model_fields
    assert {"dtype", "replace_with_kernel_inject", "enable_cuda_graph", "max_out_tokens", "checkpoint"} <= set(fields)
    trained = _deepspeed_config({"dtype": "fp16", "replace_with_kernel_inject": True, "enable_cuda_graph": False})
    assert not trained.float16_config.enabled and not trained.bfloat16_config.enabled  # fp32, silently
    with pytest.raises(Exception, match="tp_size"):
        TPTrainingConfig(tp_size=1)
    with pytest.raises(AttributeError, match="'str' object has no attribute 'get'"):
        _deepspeed_config({"checkpoint": "checkpoints/llama/ds_inference_config.json"})


def test_inference_keys_are_named_as_such_with_the_training_fix():
    lines = _refusals(CONFIGS / "mii_inference_config_dtype_fp16.json")
    assert lines[0] == ("unknown top-level key 'dtype': a DeepSpeed-inference key (deepspeed.init_inference / MII), "
                        "which training never reads and DeepSpeed would silently ignore; remove it (to train in fp16, "
                        "write \"fp16\": {\"enabled\": true})")
    assert [line.split(":")[0] for line in lines] == [
        "unknown top-level key 'dtype'", "unknown top-level key 'replace_with_kernel_inject'",
        "unknown top-level key 'enable_cuda_graph'", "unknown top-level key 'max_out_tokens'"]
    assert not any("data_types" in line for line in lines)  # the old hint: data_types does not set the precision
    from dstrain.engine.ds_foreign import foreign_key_problem
    assert "write \"bf16\": {\"enabled\": true}" in foreign_key_problem("dtype", {"dtype": "torch.bfloat16"})
    assert "trains in fp32" in foreign_key_problem("dtype", {"dtype": "float32"})
    assert "--parallel.tp=N" in foreign_key_problem("mp_size", {"mp_size": 2})
    assert foreign_key_problem("mixed_precision", {"mixed_precision": "bf16"}) is None  # a typo keeps its hint


def test_inference_tensor_parallel_and_checkpoint_path_are_named_before_the_parser():
    assert _refusals(CONFIGS / "inference_tensor_parallel_tp_size_one.json") == [
        "tensor_parallel.tp_size: DeepSpeed-inference's tensor-parallel keys (deepspeed.init_inference / MII); "
        "DeepSpeed's training section reads only autotp_size and its parser rejects these; remove the section "
        "(dstrain's tensor parallelism is --parallel.tp=N)"]
    assert _refusals(CONFIGS / "inference_checkpoint_json_path.json") == [
        "checkpoint: file says 'checkpoints/llama/ds_inference_config.json', DeepSpeed-inference's checkpoint path "
        "(init_inference); training's \"checkpoint\" is an object of saving options, and DeepSpeed's parser stops on "
        "a string ('str' object has no attribute 'get'); remove it (dstrain resumes with --resume)"]


def test_inference_sections_are_named_beside_other_problems(tmp_path):
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
                                "tensor_parallel": {"tp_size": 2}, "checkpoint": "ckpt"}))
    lines = _refusals(both)
    assert [line.split(":")[0] for line in lines] == ["tensor_parallel.tp_size", "checkpoint", "steps_per_print"]
    autotp = tmp_path / "autotp.json"  # training's own spelling keeps its refusal
    autotp.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}}))
    assert _refusals(autotp) == ["tensor_parallel: DeepSpeed's AutoTP is not used by dstrain; remove the section and "
                                 "use --parallel.tp=N"]


# --------------------------------------------------------------------------- nested / merged by another tool


def test_verl_per_model_nesting_is_named_with_its_path():
    lines = _refusals(CONFIGS / "verl_actor_critic_nested_deepspeed_config.json")
    assert lines == [
        "top-level key 'actor' holds a DeepSpeed config two levels down, at actor.deepspeed_config (as verl's and "
        "other RL trainers' dumps nest one per model); DeepSpeed reads only top-level keys and would silently ignore "
        "it: give the object at actor.deepspeed_config alone as the file",
        "top-level key 'critic' holds a DeepSpeed config two levels down, at critic.deepspeed_config (as verl's and "
        "other RL trainers' dumps nest one per model); DeepSpeed reads only top-level keys and would silently ignore "
        "it: give the object at critic.deepspeed_config alone as the file"]


def test_determined_hyperparameters_are_named_for_what_they_are(capsys, monkeypatch, tmp_path):
    assert _refusals(CONFIGS / "determined_hyperparameters_overwrite_args.json") == [
        "top-level key 'deepspeed_config' names another file ('ds_config.json', as Determined's hyperparameters do); "
        "DeepSpeed would silently ignore it: give that file itself as --deepspeed.profile",
        "unknown top-level key 'overwrite_deepspeed_args': Determined's overrides, which Determined merges into the "
        "DeepSpeed config itself and DeepSpeed would silently ignore here; write their values into the file's own "
        "keys and remove it"]
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "determined_hyperparameters_overwrite_args.json")
    assert code == 2 and len(lines) == 3 and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- numbers and flags as DeepSpeed reads them


def test_gradient_clipping_true_is_deepspeeds_max_norm_one(capsys, monkeypatch, tmp_path):
    assert _deepspeed_config({"gradient_clipping": True}).gradient_clipping is True  # get_scalar_param keeps it
    assert True > 0.0 and 2.0 / True == 2.0  # the engine's "> 0.0" test and its clip coefficient: max_norm 1.0
    assert load_ds_json(CONFIGS / "ray_train_gradient_clipping_true.json")["gradient_clipping"] == 1.0
    off = tmp_path / "off.json"
    off.write_text('{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": false}')
    assert load_ds_json(off)["gradient_clipping"] == 0.0  # False > 0.0 is false: DeepSpeed does not clip
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "ray_train_gradient_clipping_true.json", "cpu", 2)
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "ray_train_gradient_clipping_true.json")
    assert code == 0 and not any("error" in line for line in lines), lines


def test_floats_for_integers_and_integers_for_flags_read_as_deepspeeds_loader_reads_them():
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    path = CONFIGS / "floats_for_ints_and_int_flags_bom.json"
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    with open(path) as fh:  # DeepSpeed's own call
        theirs = hjson.load(fh, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    ours = load_ds_json(path)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "steps_per_print"):
        assert type(ours[key]) is int and ours[key] == theirs[key]
    assert ours["zero_optimization"]["reduce_bucket_size"] == theirs["zero_optimization"]["reduce_bucket_size"] \
        == 5_000_000_000
    parsed = _deepspeed_config({k: theirs[k] for k in ("bf16", "zero_optimization")})
    assert parsed.bfloat16_config.enabled is True and ours["bf16"]["enabled"] is True
    zo = parsed.zero_config
    assert (zo.overlap_comm, zo.contiguous_gradients) == (ours["zero_optimization"]["overlap_comm"],
                                                          ours["zero_optimization"]["contiguous_gradients"]) \
        == (True, False)
    assert check_ds_file(path, "cpu", 2).startswith(f"{path}: valid DeepSpeed config for cpu: ZeRO stage 2; "
                                                    "batch 1 x 2 x 2 ranks")


def test_the_autotuners_optimal_config_trains_as_written():
    from deepspeed.autotuning import autotuner
    assert 'ds_config.pop(AUTOTUNING)' in Path(autotuner.__file__).read_text()  # the section is gone from the file
    cfg = load_ds_json(CONFIGS / "autotuning_ds_config_optimal.json")
    assert "autotuning" not in cfg
    assert check_ds_file(CONFIGS / "autotuning_ds_config_optimal.json", "cpu", 2).startswith(
        f"{CONFIGS / 'autotuning_ds_config_optimal.json'}: valid DeepSpeed config for cpu: ZeRO stage 2; "
        "batch 2 x 1 x 2 ranks")


# --------------------------------------------------------------------------- SageMaker smp, a negative warm-up start


def test_sagemaker_smp_parameters_and_its_pipeline_mode_are_named():
    with pytest.raises(AttributeError, match="'str' object has no attribute 'items'"):
        _deepspeed_config({"pipeline": "interleaved"})
    lines = _refusals(CONFIGS / "sagemaker_smp_pipeline_interleaved.json")
    assert [line.split(":")[0] for line in lines] == [
        "unknown top-level key 'partitions'", "unknown top-level key 'microbatches'", "unknown top-level key 'optimize'",
        "unknown top-level key 'placement_strategy'", "unknown top-level key 'ddp'", "pipeline"]
    assert lines[-1] == ("pipeline: file says \"interleaved\", as SageMaker model parallelism (smp) writes its pipeline "
                         "mode; DeepSpeed reads \"pipeline\" as an object of its pipeline engine's options and its "
                         "parser stops on anything else ('str' object has no attribute 'items'); remove it (dstrain "
                         "parallelises with parallel.tp / parallel.sp)")
    assert "valid DeepSpeed config" in check_ds_file(_write({"pipeline": {}}), "cpu", 2)  # empty: nothing to run


def _write(cfg: dict) -> Path:
    import tempfile
    path = Path(tempfile.mkdtemp()) / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **cfg}))
    return path


def test_a_negative_warmup_start_is_refused():
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupLR
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    WarmupLR(opt, warmup_min_lr=-1e-5, warmup_max_lr=1e-4, warmup_num_steps=10, warmup_type="linear")
    assert opt.param_groups[0]["lr"] < 0  # DeepSpeed accepts it and starts uphill
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    WarmupCosineLR(opt, total_num_steps=10, warmup_min_ratio=-0.5, warmup_num_steps=5, warmup_type="linear").step()
    assert opt.param_groups[0]["lr"] == pytest.approx(-5e-5)  # its first step: lr x warmup_min_ratio
    assert _refusals(CONFIGS / "warmup_lr_negative_min_lr.json") == [
        "scheduler.params.warmup_min_lr: must be a number >= 0 or \"auto\", file says -1e-05 (the warm-up starts from "
        "it: DeepSpeed would set a negative learning rate, training uphill, for the first steps)"]
    cosine = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": -0.5, "warmup_num_steps": 1,
                                                                 "total_num_steps": "auto"}}}
    assert _refusals(_write(cosine))[0].startswith("scheduler.params.warmup_min_ratio: must be a number >= 0")
    zero = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_num_steps": 1}}}
    assert "valid DeepSpeed config" in check_ds_file(_write(zero), "cpu", 2)
