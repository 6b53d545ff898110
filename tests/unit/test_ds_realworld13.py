"""Round 13 of real-world DeepSpeed JSONs: values DeepSpeed 0.19.8 reads as written (``dict.get`` /
``get_scalar_param``, no pydantic model between the file and the code that uses them), the keys it has renamed or
stopped reading while older generators still write them, and ``dstrain check-config`` seeing what the launch sees.

Fixed in the round (each passed dstrain's checks, or was refused with DeepSpeed's bare exception text, before it):
``checkpoint.use_node_local_storage`` / ``checkpoint.checkpoint_serialization`` quoted as ``"false"`` (DeepSpeed keeps
the text, which is true to it: node-local saving on, torch's zip format kept; now refused as quoted flags, and a
quoted "true" is read as true); ``checkpoint.tag_validation`` written as a boolean or null (DeepSpeed's parser stops
on ``'bool' object has no attribute 'upper'``, and dstrain showed that line only once every other problem was fixed);
a quoted ``vocabulary_size`` (the parser takes it modulo 8 and stops on 'not all arguments converted during string
formatting'); ``aio.thread_count`` as Lightning's DeepSpeedStrategy writes it (DeepSpeed renamed it
``intra_op_parallelism`` and no longer reads it: under NVMe offload a value other than the one used is refused with
the rename, otherwise noted), aio counts and switches in quotes under NVMe offload (handed to the async-io handle as
written); an fp16 ``hysteresis`` of 0 with dynamic loss scaling (DeepSpeed's scaler lowers the scale only when the
hysteresis count is 1: from 0 it counts down forever and every overflowing step is skipped); HF Transformers' 2021
ZeRO-3 ``cpu_offload_use_pin_memory`` (DeepSpeed 0.19 keeps it as a deprecated key that sets nothing: dstrain's note
said DeepSpeed read it as ``pin_memory``; now a note that it is unread, and ``false`` is refused where the offload pins
anyway); an enabled ``torch_autocast`` whose ``lower_precision_safe_modules`` do not import as ``package.Class``
(``"Linear"``, or one string where a list belongs, which DeepSpeed walks letter by letter: ValueError on every rank
when the engine starts; now each name is imported before launch) or that sits beside ZeRO++
``zero_quantized_weights`` on GPUs (DeepSpeed asserts); DeepSpeed's ``activation_checkpointing`` features (refused
by ``dstrain launch`` in the factory, but ``dstrain check-config`` called the file valid); and an unfillable
``"auto"`` dtype named twice, once as "file says 1" (its placeholder). New checks in dstrain.engine.ds_scalars.
Pinned by tests/configs and trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand, as written:
Lightning's DeepSpeedStrategy ZeRO-3 offload dump (``zero_allow_untested_optimizer``, an all-off activation block,
NVMe paths and an ``aio`` block under "cpu" offload), OpenRLHF's ZeRO-2 file with ``"compile": {"deepcompile":
false}`` and ``tensor_parallel.autotp_size`` 1, and HF Transformers' 2021 ZeRO-3 file with ``cpu_offload`` /
``cpu_offload_param`` / ``cpu_offload_use_pin_memory`` and the old gather spelling.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_scalars import scalar_checks

from tests.unit.ds_rounds import CONFIGS, RECIPE, ROOT  # noqa: E402,F401
from tests.unit.ds_rounds import deepspeed_config as _deepspeed_config  # noqa: E402,F401
from tests.unit.ds_rounds import refusals as _refusals  # noqa: E402,F401
from tests.unit.ds_rounds import dry_run  # noqa: E402

_dry_run = functools.partial(dry_run, values_from_file=False)  # (this round's files give their own values)

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


def _with_nvme_path(tmp_path, name: str) -> Path:
    """The file with its NVMe folder pointed at one that exists (the CUDA checks want it)."""
    cfg = json.loads((CONFIGS / name).read_text())
    for block in ("offload_optimizer", "offload_param"):
        if block in cfg["zero_optimization"]:
            cfg["zero_optimization"][block]["nvme_path"] = str(tmp_path)
    out = tmp_path / name
    out.write_text(json.dumps(cfg))
    return out


# --------------------------------------------------------------------------- checkpoint keys read with dict.get


def test_quoted_false_checkpoint_flags_are_true_to_deepspeed_and_refused():
    ds = _deepspeed_config({"checkpoint": {"use_node_local_storage": "false", "checkpoint_serialization": "false"}})
    assert ds.use_node_local_storage == "false" and bool(ds.use_node_local_storage)  # kept as text: true
    assert ds.checkpoint_config["checkpoint_serialization"] == "false"  # torch.save gets it: the zip format stays
    problems = _refusals(CONFIGS / "checkpoint_flags_quoted_false.json")
    assert problems == [
        f"checkpoint.{key}: file says 'false' in quotes, which DeepSpeed does not read as a boolean (any text counts "
        "as true to it, \"false\" too); write false without quotes" for key in ("use_node_local_storage",
                                                                               "checkpoint_serialization")]


def test_quoted_true_checkpoint_flags_are_read_as_true(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "checkpoint": {
        "use_node_local_storage": "true", "checkpoint_serialization": "True"}}))
    assert "valid DeepSpeed config" in check_ds_file(tmp_path / "t.json", "cpu", 2)
    from dstrain.engine.ds_files import load_ds_json
    assert load_ds_json(tmp_path / "t.json")["checkpoint"] == {"use_node_local_storage": True,
                                                                "checkpoint_serialization": True}


def test_tag_validation_that_is_not_text_is_named_with_the_modes(capsys, monkeypatch, tmp_path):
    with pytest.raises(AttributeError, match="'bool' object has no attribute 'upper'"):
        _deepspeed_config({"checkpoint": {"tag_validation": False}})
    assert _refusals(CONFIGS / "checkpoint_tag_validation_boolean.json") == [
        "checkpoint.tag_validation: false, not a mode; DeepSpeed's parser upper-cases the text and stops on anything "
        "else ('bool' object has no attribute 'upper'); write one of \"Ignore\", \"Warn\", \"Fail\" (\"Ignore\" turns "
        "the check off)"]
    assert scalar_checks({"checkpoint": {"tag_validation": None}}, "cpu")[0][0].startswith(
        "checkpoint.tag_validation: null, not a mode")
    assert scalar_checks({"checkpoint": {"tag_validation": "fail"}}, "cpu") == ([], [])  # upper-cased by DeepSpeed
    # named with the batch disagreement, not after it is fixed (the parser is not run while the batch disagrees)
    (tmp_path / "t.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 3,
                                                 "checkpoint": {"tag_validation": False}}))
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, tmp_path / "t.json")
    assert code == 2 and any(line.startswith("  - checkpoint.tag_validation: false, not a mode") for line in lines)
    assert any("train_micro_batch_size_per_gpu: file says 3" in line for line in lines), lines


def test_a_quoted_vocabulary_size_is_named_with_every_other_problem(capsys, monkeypatch, tmp_path):
    with pytest.raises(TypeError, match="not all arguments converted"):
        _deepspeed_config({"vocabulary_size": "50257"})
    assert _refusals(CONFIGS / "vocabulary_size_quoted.json") == [
        "vocabulary_size: file says '50257', not a number: DeepSpeed's parser takes it modulo 8 (to warn when it is "
        "not a multiple of 8, its only use) and stops on text ('not all arguments converted during string "
        "formatting'); write 50257 without quotes"]
    cfg = {"train_micro_batch_size_per_gpu": 3, "vocabulary_size": "50257"}  # the run gives another micro batch
    (tmp_path / "v.json").write_text(json.dumps(cfg))
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, tmp_path / "v.json")
    assert code == 2 and any(line.startswith("  - vocabulary_size: file says '50257'") for line in lines), lines
    assert scalar_checks({"vocabulary_size": 50257}, "cpu") == ([], [])  # DeepSpeed only warns (round 8's file)


# --------------------------------------------------------------------------- aio as Lightning writes it


def test_deepspeed_reads_intra_op_parallelism_not_thread_count():
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
    aio = get_aio_config({"aio": {"thread_count": 8, "block_size": "1048576"}})
    assert aio["intra_op_parallelism"] == 1 and "thread_count" not in aio
    assert aio["block_size"] == "1048576"  # handed on as written


def test_lightnings_dump_is_valid_and_its_aio_block_noted(tmp_path):
    summary = check_ds_file(CONFIGS / "lightning_strategy_zero3_offload_dump.json", "cpu", 2)
    assert "ZeRO stage 3, offload optimizer and param; batch 1 x 1 x 2 ranks" in summary
    assert "aio: kept, but only NVMe offload uses it" in summary and "aio.thread_count" not in summary
    # under NVMe offload Lightning's default (1) is what DeepSpeed uses anyway: a note
    cfg = json.loads((CONFIGS / "lightning_strategy_nvme_aio_thread_count.json").read_text())
    cfg["aio"]["thread_count"] = 1
    assert scalar_checks(cfg, "cuda") == ([], ["aio.thread_count: unused: DeepSpeed 0.19 reads intra_op_parallelism "
                                               "instead (1)"])


def test_a_thread_count_deepspeed_would_not_use_is_refused_with_the_rename(tmp_path):
    path = _with_nvme_path(tmp_path, "lightning_strategy_nvme_aio_thread_count.json")
    assert _refusals(path, "cuda") == [
        "aio.thread_count: 8, which DeepSpeed 0.19 no longer reads (the key is intra_op_parallelism now): its NVMe "
        "swapper would use 1 thread(s); rename it to intra_op_parallelism"]
    cfg = json.loads(path.read_text())
    cfg["aio"]["intra_op_parallelism"] = 8  # both spellings: the new one decides, the old one is noted
    assert scalar_checks(cfg, "cuda") == ([], ["aio.thread_count: unused: DeepSpeed 0.19 reads intra_op_parallelism "
                                               "instead (8)"])


def test_aio_values_in_quotes_are_refused_under_nvme_offload(tmp_path):
    problems = _refusals(_with_nvme_path(tmp_path, "zero3_nvme_aio_quoted_values.json"), "cuda")
    assert [p.split(":")[0] for p in problems] == ["aio.block_size", "aio.queue_depth", "aio.single_submit",
                                                   "aio.overlap_events"]
    assert problems[0].endswith("write the number without quotes") and problems[2].endswith(
        "write true or false without quotes")
    cfg = json.loads((CONFIGS / "zero3_nvme_aio_quoted_values.json").read_text())
    cfg["zero_optimization"]["offload_param"]["device"] = "cpu"  # no NVMe: the section is unused (a note elsewhere)
    assert scalar_checks(cfg, "cuda") == ([], [])


# --------------------------------------------------------------------------- fp16 hysteresis


def test_deepspeeds_loss_scaler_never_lowers_the_scale_from_hysteresis_zero(monkeypatch):
    from deepspeed.runtime.fp16 import loss_scaler
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 1)
    for hysteresis, after in ((0, 2.0 ** 16), (1, 2.0 ** 13), (2, 2.0 ** 14)):
        scaler = loss_scaler.DynamicLossScaler(2.0 ** 16, 1000, 1, hysteresis, False)
        for _ in range(3):
            scaler.update_scale(True)  # three overflowing steps
        assert scaler.cur_scale == after, hysteresis


def test_fp16_hysteresis_zero_is_refused_where_fp16_runs(tmp_path):
    problems = _refusals(CONFIGS / "lightning_fp16_hysteresis_zero.json", "cuda")
    assert problems == [
        "fp16.hysteresis: 0, and DeepSpeed's dynamic loss scaler lowers the scale only when its hysteresis count is 1: "
        "from 0 it counts down at every overflow and never lowers it, so every overflowing step would be skipped for "
        "the rest of the run; set it to 1 (lower the scale at the first overflow) or more, or remove it (default 2)"]
    fp16 = {"enabled": True, "loss_scale": 0, "hysteresis": 1}
    assert scalar_checks({"fp16": fp16}, "cuda") == ([], [])
    assert scalar_checks({"fp16": {**fp16, "hysteresis": 0, "loss_scale": 128}}, "cuda") == ([], [])  # static scale
    assert scalar_checks({"fp16": {**fp16, "hysteresis": 0, "enabled": "auto"}}, "cpu") == ([], [])  # bf16/fp32 here
    assert scalar_checks({"fp16": {**fp16, "hysteresis": -1, "enabled": "auto"}}, "cuda")[0][0].startswith(
        "fp16.hysteresis: -1, and DeepSpeed's dynamic loss scaler")


# --------------------------------------------------------------------------- torch_autocast's module names


class _Engine:  # what DeepSpeed's autocast set-up reads from its engine
    def __init__(self, quantized: bool = False):
        import torch
        self.module = torch.nn.Linear(2, 2)
        self._quantized = quantized

    def zero_quantized_weights(self):
        return self._quantized


def test_deepspeed_stops_on_a_safe_module_name_it_cannot_import():
    import torch
    from deepspeed.runtime.torch_autocast import init_autocast_params
    for names, first in ((["Linear"], "Linear"), ("torch.nn.Linear", "t")):  # a bare string: walked letter by letter
        with pytest.raises(ValueError, match=f"Failed to import lower precision safe module {first}:"):
            init_autocast_params(_Engine(), torch.bfloat16, names)
    with pytest.raises(AssertionError, match="Cannot enable both torch autocast and zero quantized weights"):
        init_autocast_params(_Engine(quantized=True), torch.bfloat16, None)


def test_autocast_module_names_are_imported_before_launch():
    assert _refusals(CONFIGS / "torch_autocast_safe_modules_short_names.json") == [
        "torch_autocast.lower_precision_safe_modules: 'Linear' not importable as package.Class (DeepSpeed imports each "
        "name when the engine starts and stops every rank: 'Failed to import lower precision safe module'); write full "
        "class names such as \"torch.nn.Linear\", or remove the key (DeepSpeed's default list)"]
    one = {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"}}
    assert scalar_checks(one, "cpu")[0] == [
        "torch_autocast.lower_precision_safe_modules: one string, \"torch.nn.Linear\", where DeepSpeed wants a list "
        "(it would import each letter as a module and stop every rank in initialize); write [\"torch.nn.Linear\"]"]
    off = {"torch_autocast": {"enabled": False, "lower_precision_safe_modules": ["Linear"]}}
    assert scalar_checks(off, "cpu") == ([], [])  # DeepSpeed reads the names only when autocast is on
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "torch_autocast_lower_precision_modules.json", "cpu", 2)


def test_zero_quantized_weights_beside_autocast_is_refused_on_gpus():
    assert _refusals(CONFIGS / "zeropp_quantized_weights_torch_autocast.json", "cuda") == [
        "zero_optimization.zero_quantized_weights: true beside torch_autocast, which DeepSpeed refuses when the engine "
        "starts ('Cannot enable both torch autocast and zero quantized weights'); set it to false or turn "
        "torch_autocast off"]
    cpu = _refusals(CONFIGS / "zeropp_quantized_weights_torch_autocast.json")  # ZeRO++ itself, named once
    assert len(cpu) == 1 and cpu[0].startswith("zero_optimization.zero_quantized_weights: ZeRO++ quantized")


# --------------------------------------------------------------------------- the 2021 offload flags


def test_cpu_offload_use_pin_memory_sets_nothing_in_deepspeed():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = DeepSpeedZeroConfig(stage=2, cpu_offload=True, cpu_offload_use_pin_memory=False)
    assert zero.offload_optimizer.pin_memory is True  # the offload block's default, not the flag


def test_hf_2021_offload_flags_are_noted_as_unread_and_false_refused():
    summary = check_ds_file(CONFIGS / "hf_2021_zero3_cpu_offload_flags.json", "cpu", 2)
    assert ("zero_optimization.cpu_offload_use_pin_memory: unused: DeepSpeed 0.19 no longer reads it; each offload "
            "block's pin_memory decides (default true)") in summary
    assert "reads it as offload_*.pin_memory" not in summary and "stage-3 keys" not in summary
    assert _refusals(CONFIGS / "zero2_cpu_offload_use_pin_memory_false.json") == [
        "zero_optimization.cpu_offload_use_pin_memory: false, which DeepSpeed 0.19 no longer reads (a deprecated key "
        "that sets nothing): its offload would pin host memory anyway (offload_optimizer.pin_memory defaults to true); "
        "set offload_optimizer.pin_memory to false instead (an offload block {\"device\": \"cpu\", \"pin_memory\": "
        "false} in place of cpu_offload)"]
    unpinned = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                      "cpu_offload_use_pin_memory": False}}
    assert scalar_checks(unpinned, "cpu")[0] == []  # what the flag asked for is what the block does
    unpinned["zero_optimization"]["offload_optimizer"].pop("pin_memory")  # a block, not the 2021 flag: no "in place of"
    assert scalar_checks(unpinned, "cpu")[0] == [
        "zero_optimization.cpu_offload_use_pin_memory: false, which DeepSpeed 0.19 no longer reads (a deprecated key "
        "that sets nothing): its offload would pin host memory anyway (offload_optimizer.pin_memory defaults to true); "
        "set offload_optimizer.pin_memory to false instead"]


# --------------------------------------------------------------------------- check-config sees what launch sees


def test_check_config_refuses_deepspeeds_activation_checkpointing_features(capsys):
    code = cli.main(["check-config", str(CONFIGS / "activation_checkpointing_cpu.json"), "--world-size", "2",
                     "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and ("activation_checkpointing.cpu_checkpointing: DeepSpeed's activation-checkpointing block "
                          "only acts on models that call deepspeed.checkpointing") in err
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "megatron_activation_block_off.json", "cpu", 2)


def test_an_unfillable_auto_dtype_is_named_once(capsys, monkeypatch, tmp_path):
    expected = ("communication_data_type: \"auto\" is not a value dstrain can fill (DeepSpeed itself keeps the text "
                "\"auto\"); set it explicitly")
    assert _refusals(CONFIGS / "communication_data_type_auto.json") == [expected]
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "communication_data_type_auto.json")
    assert code == 2 and lines == [f"dstrain: error: {CONFIGS / 'communication_data_type_auto.json'}: {expected}"]


# --------------------------------------------------------------------------- files that train as written


def test_openrlhfs_deepcompile_off_and_autotp_one_are_valid():
    from deepspeed.compile.config import CompileConfig
    assert CompileConfig(deepcompile=False).deepcompile is False
    summary = check_ds_file(CONFIGS / "openrlhf_zero2_compile_deepcompile_false.json", "cpu", 2)
    summary = summary.split(": valid DeepSpeed config for cpu: ")[1]
    assert summary.startswith("ZeRO stage 2; batch 2 x 2 x 2 ranks") and "compile" not in summary
