"""Round 16 of real-world DeepSpeed JSONs: a cross-check of every accepted file against DeepSpeed's own parser
(tests/configs/test_deepspeed_reads_the_plan.py), and LLaMA-Factory's current examples (ZeRO-3 offload with
``comms_config`` / ``monitor_config``, ALST sequence parallelism, FP8, AutoTP with a ``"_comment"``, partial offload,
Gaudi's throughput timer, its hyper-parameter sweep), axolotl's ZeRO-3 CPU-offload pair, Stanford Alpaca's and
FastChat's (Vicuna's) configs.

Fixed in the round. An enabled ``torch_autocast`` section (bfloat16, or no dtype: torch's CPU default) with the bf16 /
fp16 sections neither on nor "auto": DeepSpeed runs it as written whatever the run picks, but the factory chose the
precision itself: on a CPU without fast bf16 the plan, plan.txt, the metrics and the checkpoint said fp32 while
DeepSpeed autocast every forward in bfloat16, and on a GPU without bf16 it chose fp16 weights under the bfloat16
autocast (found by the cross-check). Now the section decides: the run is bf16 (autocast over fp32 weights, the note
says so), ``values_from_file`` adopts ``deepspeed.precision=bf16`` from it, and an explicit other precision is refused
as a disagreement with the fix (``--deepspeed.precision=bf16``), instead of running autocast under a plan that says
otherwise. LLaMA-Factory's ds_z3_offload_config writes ``"comms_config": {"verbose": false}`` and a
``monitor_config`` with its CSV monitor off: DeepSpeedConfig's attribute names, which DeepSpeed silently ignores as
keys (it reads the top-level comms_logger and monitor sections); both were refused as unknown keys ("did you mean
'comms_logger'?"), so the file most LLaMA-Factory users copy did not start. Now each is a note when it turns nothing
on, and refused with the move to the top level when it does (a monitor or the comms logger the user expects and
DeepSpeed would never start). A ``"_comment"`` text key was refused with "did you mean 'comet'?": now a note.
LLaMA-Factory's ALST ``sequence_parallel`` section was refused with "did you mean 'sequence_parallel_size'?" (a
DeepSpeed key dstrain refuses too) and an ``fp8`` section as a bare unknown key: each is now named for what it is
(its trainer's Ulysses set-up: ``--parallel.sp=4``; FP8 through Transformer Engine / torchao, which DeepSpeed 0.19
has no section for: the run would silently train in the bf16 / fp16 sections' precision). New code in
dstrain.engine.ds_foreign (ignored_key) and ds_autocast (autocast_precision). Refused as before, correctly: the ALST
file's bf16 loss-scale keys (DeepSpeed's bf16 section rejects them), AutoTP. Pinned by tests/configs and trained 3 steps
on 2 CPU ranks with a checkpoint at step 2 by hand: LLaMA-Factory's ZeRO-3 offload with its attribute keys, FastChat's
LoRA ZeRO-2 torch_adam offload, LLaMA-Factory's ZeRO-3 bf16 with a bf16 gradient-accumulation dtype and a module
granularity threshold of 16. The cross-check found nothing else: every other accepted file trains with the batch,
stage, offload, precision, clipping, optimizer and scheduler DeepSpeed reads from it.
"""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_foreign import ignored_key, ignored_key_notes

from tests.unit.ds_rounds import CONFIGS, RECIPE, ROOT  # noqa: E402,F401
from tests.unit.ds_rounds import deepspeed_config as _deepspeed_config  # noqa: E402,F401
from tests.unit.ds_rounds import refusals as _refusals  # noqa: E402,F401
from tests.unit.ds_rounds import dry_run as _dry_run  # noqa: E402,F401

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)

AUTOCAST = CONFIGS / "torch_autocast_bf16_section.json"


# --------------------------------------------------------------------------- torch_autocast decides the precision


def test_deepspeed_runs_an_autocast_section_whatever_the_bf16_section_says():
    off = _deepspeed_config({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert off.torch_autocast_enabled and not off.bfloat16_config.enabled  # autocast over fp32 weights


def test_the_plan_of_an_autocast_file_is_bf16_on_a_cpu_without_fast_bf16(monkeypatch, tmp_path):
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware
    cfg = load_run_config(RECIPE, ["--train.steps=3", "--data.seq_len=64", f"--deepspeed.profile={AUTOCAST}",
                                   f"--output.dir={tmp_path}"])
    slow = Hardware("cpu", 16 * 10**9, 32 * 10**9, 2, False, False, "cpu without fast bf16")
    plan = plan_engine(cfg, 2, hw=slow, device_type="cpu")
    assert plan.precision == "bf16"  # was fp32: the factory's pick, while DeepSpeed autocast in bfloat16
    assert plan.ds_config["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert plan.ds_config.get("bf16", {}).get("enabled") is not True  # fp32 weights, as the file runs them
    assert "bf16 as torch.autocast over fp32 weights (the file's torch_autocast section)" in plan.explanation
    assert "precision bf16," in plan.explanation
    from dstrain.engine.factory import _file_precision
    from dstrain.engine.profiles import choose_precision
    v100 = Hardware("cuda", 32 * 10**9, 64 * 10**9, 8, False, True, "GPU without bf16")
    template = json.loads(AUTOCAST.read_text())
    assert choose_precision(v100, _file_precision(template) or "auto")[0] == "bf16"  # was fp16 weights under it


def test_an_explicit_other_precision_is_refused_with_the_fix(capsys, monkeypatch, tmp_path):
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, AUTOCAST, "--deepspeed.precision=fp32",
                           values_from_file=False)
    assert code == 2 and len(lines) == 1
    assert "torch_autocast.enabled: file says true with dtype 'bfloat16', a bf16 run as DeepSpeed runs it, run " \
           "precision is fp32" in lines[0]
    assert "use --deepspeed.precision=bf16" in lines[0]
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, AUTOCAST)  # the switch: taken from the file
    assert code == 0
    assert any(line.startswith("dstrain: deepspeed.precision=bf16 adopted from torch_autocast.enabled") for line in lines)


def test_autocast_fp32_and_open_sections_still_leave_the_precision_as_before():
    from dstrain.engine.ds_autocast import autocast_precision
    assert autocast_precision({"torch_autocast": {"enabled": True, "dtype": "fp32"}}) == "fp32"
    assert autocast_precision({"torch_autocast": {"enabled": True}}) == "bf16"  # torch's CPU default
    assert autocast_precision({"torch_autocast": {"enabled": True}, "bf16": {"enabled": "auto"}}) is None
    assert autocast_precision({"torch_autocast": {"enabled": True}, "bf16": {"enabled": True}}) is None  # bf16's
    assert autocast_precision({"torch_autocast": {"enabled": True, "dtype": "bfloat16"},
                               "data_types": {"param_dtype": "fp32"}}) is None  # the weights pinned: as before
    assert autocast_precision({"torch_autocast": {"enabled": False, "dtype": "bfloat16"}}) is None


# --------------------------------------------------------------------------- keys DeepSpeed ignores


def test_deepspeed_ignores_the_attribute_names_and_fp8():
    cfg = _deepspeed_config({"monitor_config": {"enabled": True, "csv_monitor": {"enabled": True}},
                             "comms_config": {"enabled": True, "verbose": True},
                             "fp8": {"enabled": True}, "_comment": "text"})
    assert not cfg.monitor_config.enabled and not cfg.monitor_config.csv_monitor.enabled
    assert not cfg.comms_config.comms_logger_enabled
    assert not cfg.bfloat16_config.enabled and not cfg.float16_config.enabled  # fp32, silently


def test_llamafactory_zero3_offload_with_its_attribute_keys_is_noted_not_refused():
    summary = check_ds_file(CONFIGS / "llamafactory_ds_z3_offload_monitor_config.json", "cpu", 2)
    assert "valid DeepSpeed config for cpu: ZeRO stage 3, offload optimizer and param" in summary
    template = json.loads((CONFIGS / "llamafactory_ds_z3_offload_monitor_config.json").read_text())
    assert ignored_key_notes(template) == [
        "comms_config: not a DeepSpeed key (DeepSpeedConfig's attribute name, as LLaMA-Factory's examples write it), "
        "which DeepSpeed silently ignores: it reads the top-level comms_logger section; it enables nothing here, so "
        "nothing is lost",
        "monitor_config: not a DeepSpeed key (DeepSpeedConfig's attribute name, as LLaMA-Factory's examples write it), "
        "which DeepSpeed silently ignores: it reads the top-level tensorboard / csv_monitor / wandb / comet sections; "
        "it enables nothing here, so nothing is lost"]


def test_an_attribute_key_that_turns_something_on_is_refused_with_the_move(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                                "monitor_config": {"enabled": True, "csv_monitor": {"enabled": True,
                                                                                    "output_path": "csv"}},
                                "comms_config": {"enabled": True, "verbose": False}}))
    lines = _refusals(path)
    assert lines[0].startswith("monitor_config: not a DeepSpeed key") and lines[0].endswith(
        "so monitor_config.csv_monitor would never be enabled; move it to the top level as csv_monitor")
    assert lines[1].startswith("comms_config: not a DeepSpeed key") and lines[1].endswith(
        "so comms_config would never be enabled; move it to the top level as comms_logger")


def test_a_comment_key_is_a_note_and_autotp_is_still_refused():
    assert _refusals(CONFIGS / "llamafactory_ds_z2_autotp_comment_key.json") == [
        "tensor_parallel: DeepSpeed's AutoTP is not used by dstrain; remove the section and use --parallel.tp=N"]
    assert ignored_key("_comment", {"_comment": "see the tutorial"}) == \
        ("_comment: a comment (DeepSpeed ignores the key)", False)
    assert ignored_key("_comment", {"_comment": {"stage": 2}}) is None  # not text: an unknown key as before
    assert ignored_key("trian_batch_size", {"trian_batch_size": 8}) is None  # a typo keeps its hint


def test_alst_sequence_parallel_and_fp8_are_named_with_the_fix():
    lines = _refusals(CONFIGS / "llamafactory_ds_z3_alst_sequence_parallel.json")
    assert lines[0].startswith("unknown top-level key 'sequence_parallel': LLaMA-Factory's sequence-parallel (ALST / "
                               "Ulysses) section") and lines[0].endswith("--parallel.sp=4")
    assert any(line.startswith("bf16.loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale: "
                               "keys of fp16's dynamic loss scaling") for line in lines)  # bf16's section has none
    assert not any("did you mean" in line for line in lines)
    assert _refusals(CONFIGS / "llamafactory_ds_z3_fp8_section.json") == [
        "unknown top-level key 'fp8': DeepSpeed 0.19 has no fp8 training section (FP8 runs through Transformer Engine "
        "or torchao, set up by the trainer, as LLaMA-Factory's and Accelerate's fp8 options do) and would silently "
        "train without it, in the precision of the bf16 / fp16 sections; remove it (dstrain trains in bf16 or fp32: "
        "--deepspeed.precision)"]
    off = {"fp8": {"enabled": False}, "sequence_parallel": {"enabled": False}}
    assert [refused for _, refused in (ignored_key(k, off) for k in off)] == [False, False]


@pytest.mark.parametrize("name", ["fastchat_lora_s2_torch_adam_offload.json",
                                  "llamafactory_z3_fp16_auto_cast_wall_clock.json"])
def test_adam_numbers_left_out_are_deepspeeds_defaults(name, capsys, monkeypatch, tmp_path):
    """Already right before the round, pinned: FastChat's LoRA block leaves betas / eps out (torch's AdamW defaults
    under torch_adam), LLaMA-Factory's writes them; the run takes (0.9, 0.999), not tiny.json's (0.9, 0.95)."""
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / name)
    assert code == 0
    assert any(line.startswith("dstrain: train.betas=[0.9,0.999] adopted from optimizer.params.betas")
               for line in lines), lines
