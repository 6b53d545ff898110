"""Round 10 of real-world DeepSpeed JSONs: keys DeepSpeed 0.19.8 reads somewhere other than where the file puts them,
values its parser keeps as written and its engine reads only when it starts or steps, and files its loader or parser
stops on. Each passed dstrain's checks before this round (or was refused without the key or the fix):
an optimizer's settings beside ``"type"`` instead of inside ``"params"`` (``{"type": "AdamW", "lr": 1e-4, ...}``:
DeepSpeed reads only ``params``; by hand its AdamW trained at its default lr 1e-3, and dstrain filled an empty
``params`` with the run's numbers), a scheduler's the same way (DeepSpeed alone raised TypeError 'argument after **
must be a mapping, not NoneType' in initialize; dstrain filled ``params`` with the run's warm-up, not the file's 100
steps), ``"param"`` for ``"params"``, a random-LTD or curriculum block switched on inside a ``data_efficiency``
section whose ``enabled`` is false (DeepSpeed reads each inner switch by itself: it built random-LTD's scheduler for
a model with none of its layers and trained 3 steps without it, exit 0), typos DeepSpeed silently ignores in the
dict-read ``data_types``, ``checkpoint`` and ``torch_autocast`` sections (``gradient_accumulation_dtype``,
``node_local_storage``, ``lower_precision_safe_module``), optimizer and scheduler flags quoted as false
(``"adam_w_mode": "false"``, ``"nesterov": "false"``: DeepSpeed passes the text on, its ``if adam_w_mode`` built AdamW
instead of Adam with L2 and torch's SGD took Nesterov steps), upper-case ``data_types`` dtypes (``"FP32"``, ``"BF16"``) and
a ``buffer_dtype`` that is no dtype (``"float64"``): the parser keeps them and initialize raised ValueError "'FP32' is
not a valid DtypeEnum" on every rank; a ``gradient_predivide_factor`` in quotes or 0 (TypeError / ZeroDivisionError at
the first step's all-reduce, on every rank at ZeRO stage 0), monitor paths starting with ``~`` (DeepSpeed joins them as
written: a folder named ``~``), sections left null by a YAML-to-JSON dump (``"optimizer": null``: DeepSpeed's parser
stops with "'NoneType' object has no attribute 'keys'"), a printed Python dict (single quotes, True / False), a config
nested under ``"deepspeed_config"``, and a typo in a disabled ``hybrid_engine`` block (pydantic's text before).
Each is now refused before launch naming the key and the fix (dstrain.engine.ds_unread, ds_sections' dict-read
sections, ds_check's strict sections, ds_files' nesting keys, null sections and loader hint).
Refused before and now trained (3 steps on 2 CPU ranks, checkpoint at step 2, by hand; ``-m slow`` here): ``"enabled":
1`` / ``0`` in bf16 / fp16 and 1 / 0 for DeepSpeed's plain flags and ZeRO booleans (pydantic and DeepSpeed's
truthiness read them as booleans; dstrain now reads them so too), and ``"grad_accum_dtype": "torch.float32"`` (a
DtypeEnum name).
Also in the round, pinned by tests/configs and trained the same way: ZeRO-2 with bucket sizes as quoted integers
(``"200000000"``, which DeepSpeed's lax parser reads as numbers, unlike ``"2e8"``), ``checkpoint_serialization``
false (saved in torch's legacy, non-zip format and resumed from it), ``data_types.buffer_dtype`` fp32 with
``keep_in_fp32_modules`` ``[]`` under bf16, and ``"params": null`` in optimizer and WarmupLR blocks (DeepSpeed alone
stops on the scheduler's; dstrain fills both from the run).
"""
from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_files import canonical_forms, validate_top_level
from dstrain.engine.ds_sections import section_problems

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


def _refusals(name: str) -> list[str]:
    with pytest.raises(DSConfigError) as err:
        check_ds_file(CONFIGS / name, device_type="cpu", world_size=2)
    return err.value.problems


def _parsed(cfg: dict):
    from deepspeed.runtime.config import DeepSpeedConfig
    return DeepSpeedConfig({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, **cfg})


# --------------------------------------------------------------------------- settings beside "type"


def test_optimizer_settings_beside_type_are_never_read_by_deepspeed_and_are_refused():
    flat = {"optimizer": {"type": "AdamW", "lr": 1e-4, "weight_decay": 0.1}}
    assert _parsed(flat).optimizer_params is None  # before: DeepSpeed's AdamW at its default lr 1e-3
    problems, _ = section_problems(flat, "cpu")
    assert problems == ["optimizer.lr, weight_decay: written beside \"type\", where DeepSpeed never reads them (it "
                        "reads only optimizer.params, and would build 'AdamW' with its own defaults instead); move "
                        "them into \"params\""]
    assert _refusals("optimizer_params_beside_type.json") == [
        "optimizer.lr, betas, eps, weight_decay: written beside \"type\", where DeepSpeed never reads them (it reads "
        "only optimizer.params, and would build 'AdamW' with its own defaults instead); move them into \"params\""]
    misplaced = {"optimizer": {"type": "SGD", "params": {"lr": 1e-3}, "zero_allow_untested_optimizer": True}}
    assert section_problems(misplaced, "cpu")[0] == ["optimizer.zero_allow_untested_optimizer: a top-level key, which "
                                                     "DeepSpeed never reads inside optimizer; move it to the top level"]
    legacy = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}, "legacy_fusion": False}}
    assert section_problems(legacy, "cpu")[0] == []  # a key DeepSpeed reads there


def test_scheduler_settings_beside_type_are_refused_once_each():
    flat = {"scheduler": {"type": "WarmupLR", "warmup_num_steps": 100}}
    assert _parsed(flat).scheduler_params is None  # DeepSpeed alone: TypeError '** must be a mapping' in initialize
    problems = _refusals("scheduler_params_beside_type.json")  # its "auto"s are not named again as unfillable
    assert problems == ["scheduler.warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps: written beside "
                        "\"type\", where DeepSpeed never reads them (it reads only scheduler.params, and would build "
                        "'WarmupDecayLR' with its own defaults instead); move them into \"params\""]


def test_a_whole_optimizer_or_scheduler_block_written_as_auto_is_refused_in_one_message(tmp_path):
    """The leftover-"auto" filter that keeps keys beside "type" from being named twice must not trip on a block that
    is "auto" itself (it raised IndexError before)."""
    path = tmp_path / "blocks_auto.json"
    path.write_text('{"train_micro_batch_size_per_gpu": "auto", "optimizer": "auto", "scheduler": "auto"}')
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=2)
    for block in ("optimizer", "scheduler"):
        assert f'{block}: "auto" is not a value dstrain can fill' in str(err.value)
        assert f'{block}: must be an object, file says "auto"' in str(err.value)


def test_a_misspelt_params_key_is_named_with_the_spelling():
    assert _parsed({"optimizer": {"type": "AdamW", "param": {"lr": 3e-4}}}).optimizer_params is None
    assert _refusals("optimizer_param_key_typo.json") == [
        "optimizer.param: unknown key (did you mean 'params'?); DeepSpeed would silently ignore it"]


@pytest.mark.parametrize("name, key", [("adam_l2_mode_quoted_false.json", "adam_w_mode"),
                                       ("torch_sgd_nesterov_quoted_false.json", "nesterov")])
def test_an_optimizer_flag_quoted_as_false_is_true_to_the_class_and_refused(name, key):
    import torch
    from deepspeed.runtime import engine
    assert "effective_adam_w_mode = self.optimizer_name() == ADAMW_OPTIMIZER or adam_w_mode" in inspect.getsource(
        engine)  # "false" is true there: AdamW, not Adam with L2
    weight = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([weight], lr=0.1, momentum=0.9, nesterov="false")
    weight.grad = torch.ones(1)
    sgd.step()
    assert weight.item() == pytest.approx(-0.19)  # Nesterov's first step (plain momentum: -0.1)
    assert _refusals(name) == [f"optimizer.params.{key}: file says 'false' in quotes, which DeepSpeed passes on as text "
                               "and the optimizer reads as true (any text is, \"false\" too); write false without quotes"]
    cycle = {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                          "cycle_first_step_size": 2, "cycle_momentum": "False"}}}
    assert section_problems(cycle, "cpu")[0][0].startswith("scheduler.params.cycle_momentum: file says 'False'")


# --------------------------------------------------------------------------- data_efficiency's inner switches


def test_random_ltd_inside_a_disabled_data_efficiency_section_is_on_to_deepspeed_and_refused():
    cfg = json.loads((CONFIGS / "megatron_data_efficiency_off_random_ltd_on.json").read_text())
    parsed = _parsed({k: v for k, v in cfg.items() if not k.startswith("train_")})
    assert parsed.data_efficiency_enabled is False  # the section says off ...
    assert parsed.data_efficiency_config["data_routing"]["random_ltd"]["enabled"] is True  # ... the engine reads on
    assert _refusals("megatron_data_efficiency_off_random_ltd_on.json")[0].startswith(
        "data_efficiency.data_routing.random_ltd.enabled: DeepSpeed reads it whatever data_efficiency.enabled and "
        "data_routing.enabled say")
    off = {"data_efficiency": {"enabled": False, "data_routing": {"random_ltd": {"enabled": False}}}}
    assert section_problems(off, "cpu")[0] == []
    assert check_ds_file(CONFIGS / "data_efficiency_disabled_block.json", device_type="cpu", world_size=2)


def test_curriculum_inside_a_disabled_data_efficiency_section_is_refused():
    cfg = json.loads((CONFIGS / "data_efficiency_off_curriculum_on.json").read_text())
    parsed = _parsed({k: v for k, v in cfg.items() if not k.startswith("train_")})
    assert parsed.data_efficiency_enabled is False
    assert parsed.data_efficiency_config["data_sampling"]["curriculum_learning"]["enabled"] is True
    problems = _refusals("data_efficiency_off_curriculum_on.json")
    assert problems == ["data_efficiency.data_sampling.curriculum_learning.enabled: DeepSpeed reads it whatever "
                        "data_efficiency.enabled says, and only its own dataloader applies a curriculum (dstrain's "
                        "samplers feed the data: no curriculum, not as the file says); set it to false or remove the "
                        "data_efficiency section"]


# --------------------------------------------------------------------------- data_types and checkpoint


@pytest.mark.parametrize("name, key, hint", [
    ("data_types_grad_accum_dtype_typo.json", "data_types.gradient_accumulation_dtype", "grad_accum_dtype"),
    ("checkpoint_node_local_storage_typo.json", "checkpoint.node_local_storage", "use_node_local_storage")])
def test_typos_in_the_dict_read_sections_deepspeed_ignores_are_refused(name, key, hint):
    parsed = _parsed({"data_types": {"gradient_accumulation_dtype": "fp32"},
                      "checkpoint": {"node_local_storage": True}})
    assert parsed.grad_accum_dtype is None and parsed.use_node_local_storage is False  # before: silently ignored
    assert _refusals(name) == [f"{key}: unknown key (did you mean {hint!r}?); DeepSpeed would silently ignore it"]


def test_a_torch_autocast_typo_is_refused_and_deepspeed_would_use_its_default_modules():
    from deepspeed.runtime.config import get_lower_precision_safe_modules
    assert get_lower_precision_safe_modules({"torch_autocast": {"enabled": True, "lower_precision_safe_module": [
        "torch.nn.Linear"]}}) is None  # None: DeepSpeed's default list of modules, not the file's
    assert _refusals("torch_autocast_safe_module_typo.json") == [
        "torch_autocast.lower_precision_safe_module: unknown key (did you mean 'lower_precision_safe_modules'?); "
        "DeepSpeed would silently ignore it"]


def test_a_typo_in_a_disabled_hybrid_engine_block_is_named_by_dotted_key():
    from deepspeed.runtime.config import HybridEngineConfig
    with pytest.raises(Exception, match="max_out_token"):  # DeepSpeed's parser rejects it even with enabled false
        HybridEngineConfig(enabled=False, max_out_token=512)
    assert _refusals("deepspeed_chat_hybrid_engine_off_typo.json") == [  # before: pydantic's multi-line text
        "hybrid_engine.max_out_token: unknown key (did you mean 'max_out_tokens'?); DeepSpeed rejects it"]


@pytest.mark.parametrize("name, key, value", [("megatron_grad_accum_dtype_upper_fp32.json", "grad_accum_dtype", "FP32"),
                                              ("data_types_param_dtype_upper_bf16.json", "param_dtype", "BF16")])
def test_upper_case_dtypes_deepspeed_keeps_and_its_engine_raises_on_are_refused(name, key, value):
    from deepspeed.runtime.config import DtypeEnum
    _parsed({"bf16": {"enabled": True}, "data_types": {key: value}})  # the parser keeps the text ...
    with pytest.raises(ValueError, match=f"'{value}' is not a valid DtypeEnum"):  # ... initialize raised, every rank
        DtypeEnum(value)
    assert _refusals(name) == [f"data_types.{key}: DeepSpeed's dtype names are lower case, file says {value!r} (its "
                               f"parser keeps it and the engine raises \"{value!r} is not a valid DtypeEnum\" when it "
                               f"starts, on every rank); write \"{value.lower()}\""]


def test_a_buffer_dtype_that_is_no_dtype_is_refused():
    from deepspeed.runtime import engine
    assert "DtypeEnum(self._config.buffer_dtype)" in inspect.getsource(engine)  # read only when the engine casts
    _parsed({"bf16": {"enabled": True}, "data_types": {"buffer_dtype": "float64"}})
    assert _refusals("data_types_buffer_dtype_float64.json")[0].startswith(
        "data_types.buffer_dtype: must be one of DeepSpeed's dtype names (fp32, bf16, fp16, ...), file says 'float64'")
    assert "ZeRO stage 2" in check_ds_file(CONFIGS / "data_types_buffer_dtype_keep_fp32_bf16.json", device_type="cpu",
                                           world_size=2)


def test_torch_dtype_names_deepspeed_takes_for_grad_accum_dtype_pass():
    from deepspeed.runtime.config import DtypeEnum
    import torch
    assert DtypeEnum("torch.float32").value is torch.float32
    assert "ZeRO stage 1" in check_ds_file(CONFIGS / "megatron_bf16_zero1_grad_accum_torch_float32.json",
                                           device_type="cpu", world_size=2)  # before: 'must be one of fp32, ...'
    no_norm = {"bf16": {"enabled": True}, "gradient_clipping": 0, "data_types": {"grad_accum_dtype": "torch.float32"},
               "zero_optimization": {"stage": 1, "compute_grad_norm": False}}  # read as fp32 by the other checks too
    assert section_problems(no_norm, "cpu")[0][0].startswith("zero_optimization.compute_grad_norm: false does not work "
                                                             "at ZeRO stage 1 with bf16 weights and fp32")


# --------------------------------------------------------------------------- monitor paths, nesting


def test_monitor_paths_under_a_tilde_are_refused_with_the_full_path():
    from deepspeed.monitor import csv_monitor, tensorboard
    for module in (csv_monitor, tensorboard):  # the file's path is joined as written: a folder named "~"
        source = inspect.getsource(module)
        assert "os.path.join(self.output_path, self.job_name)" in source and "expanduser(self.output_path" not in source
    problems = _refusals("tensorboard_csv_home_tilde_paths.json")
    assert problems == [f"{section}.output_path: '~/ds_logs/{leaf}' starts with '~', which DeepSpeed does not expand "
                        "(it would write under a folder named '~'); write the full path "
                        f"({os.path.expanduser('~/ds_logs/' + leaf)}) or a relative one (kept inside the run's folder)"
                        for section, leaf in (("tensorboard", "tensorboard"), ("csv_monitor", "csv"))]
    off = {"tensorboard": {"enabled": False, "output_path": "~/tb"}}
    assert section_problems(off, "cpu")[0] == []


def test_a_config_nested_under_deepspeed_config_is_named_as_nested():
    assert _refusals("megatron_deepspeed_config_wrapper.json") == [
        "top-level key 'deepspeed_config' holds a DeepSpeed config one level down (as a trainer's YAML-to-JSON dump "
        "nests it); DeepSpeed reads only top-level keys and would silently ignore it: move its keys to the top level"]
    with pytest.raises(DSConfigError, match="unknown top-level key 'deepspeed_config'"):  # Accelerate's keys inside
        validate_top_level({"deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "none"}}, "f")


# --------------------------------------------------------------------------- gradient_predivide_factor


@pytest.mark.parametrize("value, said", [(0, "must be a positive number, file says 0"),
                                         ("16", "file says '16', a number in quotes"),
                                         (0.0, "must be a positive number, file says 0.0")])
def test_a_predivide_factor_deepspeeds_all_reduce_cannot_divide_by_is_refused(value, said):
    from deepspeed.runtime import engine
    assert "tensor_to_allreduce.mul_(1.0 / self.gradient_predivide_factor())" in inspect.getsource(engine)
    assert _parsed({"gradient_predivide_factor": value}).gradient_predivide_factor == value  # kept as written
    problems, _ = section_problems({"gradient_predivide_factor": value}, "cpu")
    assert len(problems) == 1 and problems[0].startswith(f"gradient_predivide_factor: {said}")
    assert section_problems({"gradient_predivide_factor": 2.0}, "cpu")[0] == []
    assert _refusals("gradient_predivide_factor_quoted_zero0.json")[0].endswith(
        "write it without the quotes: 16")  # by hand: TypeError at the first step, ZeroDivisionError for 0


# --------------------------------------------------------------------------- null sections


@pytest.mark.parametrize("key", ["optimizer", "scheduler", "zero_optimization", "fp16", "data_types", "checkpoint",
                                 "tensorboard", "flops_profiler", "wall_clock_breakdown"])
def test_a_null_section_deepspeeds_parser_stops_on_is_named_with_the_fix(key):
    with pytest.raises(Exception):  # before: refused as "'NoneType' object has no attribute ...", no key, no fix
        _parsed({key: None})
    fix = "a value" if key == "wall_clock_breakdown" else "{} (an empty section)"
    with pytest.raises(DSConfigError) as err:
        validate_top_level({key: None}, "f")
    assert err.value.problems == [f"{key}: null (an empty entry, as a YAML-to-JSON dump writes one), which DeepSpeed's "
                                  f"config parser stops on at start-up; remove the key, or write {fix}"]


def test_nulls_deepspeed_reads_as_its_default_pass_and_the_dump_is_refused_in_full():
    _parsed({"bf16": None, "steps_per_print": None})
    validate_top_level({"bf16": None, "steps_per_print": None}, "f")
    assert [p.split(":")[0] for p in _refusals("yaml_dump_null_optimizer_scheduler.json")] == ["optimizer", "scheduler"]


def test_a_printed_python_dict_is_named_as_one_with_the_fix():
    import hjson
    text = (CONFIGS / "python_dict_printed_config.json").read_text()
    with pytest.raises(hjson.HjsonDecodeError):  # DeepSpeed's loader stops on it too
        hjson.loads(text)
    assert _refusals("python_dict_printed_config.json") == [
        "invalid JSON at line 1, column 2: Expecting property name enclosed in double quotes (the file is a Python "
        "dict: single-quoted keys, True / False / None, which DeepSpeed's JSON / hjson loader cannot read either); "
        "write it with json.dump(config, file)"]


# --------------------------------------------------------------------------- 1 / 0 for booleans


def test_one_and_zero_for_booleans_are_read_as_deepspeed_reads_them():
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    assert DeepSpeedBF16Config(enabled=1).enabled is True and DeepSpeedFP16Config(enabled=0).enabled is False
    read = canonical_forms({"bf16": {"enabled": 1}, "fp16": {"enabled": 0}, "wall_clock_breakdown": 0,
                            "zero_allow_untested_optimizer": 1, "zero_optimization": {"stage": 1, "overlap_comm": 1,
                                                                                      "reduce_scatter": 0}})
    assert read["bf16"] == {"enabled": True} and read["fp16"] == {"enabled": False}
    assert read["wall_clock_breakdown"] is False and read["zero_allow_untested_optimizer"] is True
    assert read["zero_optimization"] == {"stage": 1, "overlap_comm": True, "reduce_scatter": False}
    assert "ZeRO stage 1" in check_ds_file(CONFIGS / "bf16_enabled_one_fp16_zero.json", device_type="cpu",
                                           world_size=2)  # before: 'bf16.enabled: must be true, false or "auto"'
    problems, _ = section_problems(canonical_forms({"fp16": {"enabled": 1}}), "cpu")
    assert problems[0].startswith("fp16.enabled: fp16 does not run on the CPU accelerator")  # 1 is fp16 on, too
    assert canonical_forms({"bf16": {"enabled": 2}})["bf16"] == {"enabled": 2}  # pydantic refuses 2: left to name


# --------------------------------------------------------------------------- real runs of the fixes


@pytest.mark.dist
@pytest.mark.slow  # about 40 s on 2 CPU ranks: kept with the slow launches
@pytest.mark.parametrize("name, dotted, value", [("bf16_enabled_one_fp16_zero.json", "bf16.enabled", True),
                                                 ("megatron_bf16_zero1_grad_accum_torch_float32.json",
                                                  "data_types.grad_accum_dtype", "torch.float32")])
def test_the_files_refused_before_train_three_steps_on_two_cpu_ranks(tmp_path, name, dotted, value):
    from tests.configs.test_compat import _at, _trained_three_steps
    out = tmp_path / "run"
    _, resolved = _trained_three_steps(name, out)
    assert _at(resolved, dotted) == value
    assert (out / "checkpoints" / "step_00000003").is_dir()
