"""Round 17 of real-world DeepSpeed JSONs: DeepSpeedExamples' QANet (OneCycle with stair counts, WarmupLR without an
optimizer block), GAN and pipeline-parallelism configs, its Megatron-LM ZeRO-3 / ZeRO-Infinity / ZeRO-Offload 150B
configs, DeepSpeed's autotuner template and autotuner test config, Accelerate's test configs, InternVL's ZeRO-1 without
an optimizer block and its ZeRO-3 100B offload, DeepSpeed-Chat's MixZ++ config, a ChatGLM LoRA recipe's ZeRO-2,
ms-swift's ZeRO-2 with an activation-checkpointing block, DeepSpeedExamples' annotated ZeRO-3 offload config and its
AutoSP benchmark config (sources in tests/configs/expectations_late.py).

Fixed in the round (refusals that named the key but not the fix, a file DeepSpeed accepts refused with a wrong
reason, a batch line that hid the real refusals, an unused setting nobody was told about):

* DeepSpeedExamples' ZeRO-Offload 150B config writes ``"comm_overlap": true``: refused as an unknown key with no hint,
  since difflib does not match the same words in another order. Now "(did you mean 'overlap_comm'?)".
* DeepSpeed's autotuner test config lists the values to try (``"overlap_comm": [false]``, ``"reduce_bucket_size":
  [5e8]``): refused with pydantic's "Input should be a valid boolean, file says [False]", Python's spelling of the
  file's value and no fix. Now the JSON value, that a list is the autotuner's tuning space (which dstrain does not
  run), and "write one value".
* ``fp16.min_loss_scale: 1e-10`` (ChatGLM / Chinese-LLaMA-Alpaca LoRA recipes): DeepSpeed 0.19's fp16 section takes a
  whole number and rejects it, even with fp16 "auto"; refused with pydantic's "got a number with a fractional part"
  alone. Now "a fraction where DeepSpeed's parser takes a whole number; write a whole number, such as 1 (DeepSpeed's
  default)".
* Accelerate's ZeRO-3 test config (``"train_batch_size": 1``) on 2 ranks: "not a multiple of the 2 data-parallel ranks"
  alone; now with why (DeepSpeed splits it evenly and stops) and the fix.
* DeepSpeed's OneCycle and LRRangeTest set the optimizer's lr when DeepSpeed builds them (cycle_min_lr,
  lr_range_test_min_lr), so an explicit ``optimizer.params.lr`` never trains: QANet's lr 0.001 under cycle_min_lr 0.004
  was adopted and planned without a word; now a note says so, as it does for WarmupLR / WarmupDecayLR.
* DeepSpeedExamples' annotated ZeRO-3 offload config (``//`` comments) writes ``"buffer_size": "auto"`` in its
  offload_param block: DeepSpeed drops "auto" there too and uses its default (1e8), but dstrain refused it, saying
  "DeepSpeed itself keeps the text". Now the offload blocks' "auto"s get DeepSpeed's defaults with a note, as the
  section's own keys do, and an offload ``"device": "auto"`` (DeepSpeed: "none", no offload, without a word) is
  refused saying so. (Its train_batch_size 1 trains on one rank; on two it is refused as before.)
* DeepSpeedExamples' AutoSP benchmark config (DeepCompile's autosp pass, ``sequence_parallel_size`` 2, batch 1 x 1 x 1)
  on 2 ranks: DeepSpeed divides the batch keys by world / sequence_parallel_size = 1 rank, where they agree, but
  dstrain said "batch keys disagree among themselves ... 2 data-parallel ranks", and with values_from_file that line
  alone: the refusals that matter (sequence_parallel_size: --parallel.sp=2; compile) went unsaid. Now the batch keys
  are read with the file's own sequence parallelism (``ds_config.file_data_parallel``) and both refusals are named.

Checked and correct as they were: the ZeRO-Infinity config's misspelt ``stage3_param_persitance_threshold`` (named,
with the spelling DeepSpeed reads) beside fp16 and NVMe on the CPU, DeepSpeed 0.3's ``cpu_offload_params``, MixZ++'s
``zero_quantized_nontrainable_weights`` on the CPU, ms-swift's activation-checkpointing block; the trainable files pass
the cross-check against DeepSpeed's own parser (tests/configs/test_deepspeed_reads_the_plan.py).
"""
from __future__ import annotations

import json

import pytest

from dstrain.engine.ds_check import _close_key
from dstrain.engine.ds_config import implied_batch
from dstrain.engine.ds_sections import section_problems

from tests.unit.ds_rounds import CONFIGS, RECIPE, ROOT  # noqa: E402,F401
from tests.unit.ds_rounds import deepspeed_config as _deepspeed_config  # noqa: E402,F401
from tests.unit.ds_rounds import refusals as _refusals  # noqa: E402,F401
from tests.unit.ds_rounds import dry_run as _dry_run  # noqa: E402,F401

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


# --------------------------------------------------------------------------- the same words in another order


def test_comm_overlap_gets_the_key_deepspeed_reads():
    lines = _refusals(CONFIGS / "megatron_zero_offload_150b_comm_overlap.json")
    assert "zero_optimization.comm_overlap: unknown key (did you mean 'overlap_comm'?); DeepSpeed rejects it" in lines
    assert any(line.startswith("fp16.enabled: fp16 does not run on the CPU") for line in lines)  # every problem


def test_close_spellings_still_win_and_unrelated_words_get_no_hint():
    known = ["overlap_comm", "stage3_param_persistence_threshold", "reduce_scatter", "contiguous_gradients"]
    assert _close_key("stage3_param_persitance_threshold", known) == "stage3_param_persistence_threshold"
    assert _close_key("comm_overlap", known) == "overlap_comm"
    assert _close_key("scatter_reduce", known) == "reduce_scatter"
    assert _close_key("gradient_hooks", known) is None


# --------------------------------------------------------------------------- the autotuner's lists


def test_a_tuning_space_list_is_named_as_written_with_the_fix():
    lines = _refusals(CONFIGS / "autotuning_tests_tuning_space_lists.json")
    assert lines[0].startswith("autotuning.enabled: dstrain does not run DeepSpeed's autotuner")
    listed = {line.split(": ", 1)[0]: line for line in lines[1:]}
    assert set(listed) == {"zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size"}
    assert listed["zero_optimization.overlap_comm"].startswith(
        "zero_optimization.overlap_comm: file says [false], a list where DeepSpeed's parser takes one value")
    assert "file says [500000000], a list" in listed["zero_optimization.reduce_bucket_size"]
    assert all(line.endswith("; write one value") and "[False]" not in line for line in listed.values())


def test_deepspeed_rejects_the_lists_without_its_autotuner():
    from pydantic import ValidationError
    with pytest.raises(ValidationError):
        _deepspeed_config({"zero_optimization": {"stage": 1, "overlap_comm": [False]}})


# --------------------------------------------------------------------------- a fractional loss-scale floor


def test_a_fractional_min_loss_scale_is_refused_with_a_whole_number():
    lines = _refusals(CONFIGS / "chatglm_lora_zero2_min_loss_scale_fraction.json")
    assert lines == ["fp16.min_loss_scale: file says 1e-10, a fraction where DeepSpeed's parser takes a whole number "
                     "(it rejects it); write a whole number, such as 1 (DeepSpeed's default)"]


def test_deepspeed_rejects_the_fraction_with_fp16_off_and_takes_one():
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="fractional part"):
        _deepspeed_config({"fp16": {"enabled": False, "min_loss_scale": 1e-10}})
    assert _deepspeed_config({"fp16": {"enabled": False, "min_loss_scale": 1}}).float16_config.min_loss_scale == 1


def test_a_fraction_under_a_nested_key_has_no_default_to_offer(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 2.5}}}))
    lines = _refusals(path)
    assert any(line.startswith("zero_optimization.offload_optimizer.buffer_count: file says 2.5, a fraction where "
                               "DeepSpeed's parser takes a whole number (it rejects it); write a whole number")
               and "default" not in line for line in lines), lines


# --------------------------------------------------------------------------- a global batch the ranks cannot split


def test_a_batch_of_one_on_two_ranks_says_why_and_the_fix():
    lines = _refusals(CONFIGS / "accelerate_tests_zero3_model_only_batch_one.json")
    assert lines == ["train_batch_size 1 is not a multiple of the 2 data-parallel ranks (DeepSpeed splits it evenly "
                     "over them and stops at start-up); set it to a multiple of 2 or \"auto\", or run on a number of "
                     "data-parallel ranks that divides 1"]
    assert implied_batch({"train_batch_size": 1}, 1, 8, 1) == (1, 1, [])  # one rank: the file trains


# --------------------------------------------------------------------------- OneCycle / LRRangeTest set the lr


def test_onecycle_overwrites_the_optimizer_lr_in_deepspeed():
    import torch
    from deepspeed.runtime.lr_schedules import LRRangeTest, OneCycle
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.001, betas=(0.8, 0.999))
    OneCycle(opt, cycle_min_lr=0.004, cycle_max_lr=0.015, cycle_first_step_size=1000, cycle_momentum=False)
    assert opt.param_groups[0]["lr"] == 0.004
    LRRangeTest(opt)  # its default lr_range_test_min_lr
    assert opt.param_groups[0]["lr"] == 1e-3


def test_qanet_onecycle_says_its_lr_is_unused(capsys, monkeypatch, tmp_path):
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "qanet_onecycle_stair_counts_adam.json")
    assert code == 0
    assert "dstrain: note: optimizer.params.lr: unused (0.001): OneCycle sets the learning rate from the first step, " \
           "starting at cycle_min_lr 0.004" in lines


def test_lr_range_test_note_uses_its_default_start_and_equal_lrs_say_nothing():
    base = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    _, notes = section_problems({**base, "scheduler": {"type": "LRRangeTest", "params": {}}}, "cpu")
    assert "optimizer.params.lr: unused (0.01): LRRangeTest sets the learning rate from the first step, starting at " \
           "lr_range_test_min_lr 0.001" in notes
    _, notes = section_problems({**base, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}}, "cpu")
    assert not [note for note in notes if note.startswith("optimizer.params.lr")]


# --------------------------------------------------------------------------- "auto" inside an offload block


ANNOTATED = CONFIGS / "dsexamples_annotated_zero3_cpu_offload_comments_auto.json"


def test_deepspeed_reads_an_offload_auto_as_its_default():
    cfg = _deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu",
                                                                                 "buffer_size": "auto"}}})
    assert cfg.zero_config.offload_param.buffer_size == 10**8
    assert _deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "auto"}}}).zero_config.offload_param.device == "none"  # no offload, without a word


def test_the_annotated_offload_file_trains_on_one_rank_with_deepspeeds_buffer(tmp_path):
    from dstrain.engine.ds_check import check_ds_file
    from dstrain.engine.ds_config import RunValues, fill_ds_config
    from dstrain.engine.ds_files import load_ds_json
    assert check_ds_file(ANNOTATED, "cpu", 1).endswith("ZeRO stage 3, offload param; batch 1 x 1 x 1 rank")
    values = RunValues(micro_batch=1, grad_accum=1, dp_world_size=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                       weight_decay=0.0, grad_clip=1.0, precision="fp32", hidden_size=64, total_steps=3,
                       warmup_steps=1, min_lr_ratio=0.1)
    filled = fill_ds_config(load_ds_json(ANNOTATED), values, "f.json")
    assert filled["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True,
                                                            "buffer_size": 10**8}
    _, notes = section_problems(load_ds_json(ANNOTATED), "cpu")
    assert "zero_optimization.offload_param: \"auto\" is DeepSpeed's default there (its parser drops \"auto\"): " \
           "buffer_size 1e+08" in notes
    assert _refusals(ANNOTATED)[0].startswith("train_batch_size 1 is not a multiple of the 2 data-parallel ranks")


def test_an_offload_device_auto_is_refused_with_what_deepspeed_would_do(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "auto", "buffer_count": "auto"}}}))
    assert _refusals(path) == ["zero_optimization.offload_optimizer.device: \"auto\" is read by DeepSpeed as its "
                               "default, \"none\" (no offload), without a word; write \"cpu\" or \"none\""]


# --------------------------------------------------------------------------- a file's own sequence parallelism


AUTOSP = CONFIGS / "dsexamples_autosp_deepcompile_sequence_parallel.json"


def test_deepspeed_reads_the_autosp_batch_on_two_gpus_as_one_data_parallel_rank(monkeypatch):
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from dstrain.engine.ds_check import accelerator_untouched
    from dstrain.engine.ds_files import load_ds_json
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    batch = {k: v for k, v in load_ds_json(AUTOSP).items() if "batch" in k or "accumulation" in k or "parallel" in k}
    with accelerator_untouched():
        cfg = DeepSpeedConfig(batch)
    assert (cfg.world_size, cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (1, 1, 1)


def test_the_autosp_file_is_refused_for_what_it_asks_not_for_its_batch(capsys, monkeypatch, tmp_path):
    expected = ["sequence_parallel_size: dstrain splits sequences itself; remove the key and use --parallel.sp=2",
                "compile: dstrain compiles the model itself; remove the section and use --train.compile=true"]
    assert _refusals(AUTOSP) == expected  # check-config on 2 ranks
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, AUTOSP)  # values_from_file: was the batch line alone
    assert code == 2 and lines[1:] == [f"  - {line}" for line in expected]
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, AUTOSP, values_from_file=False)  # + the run's micro-batch
    assert code == 2 and lines[1:3] == [f"  - {line}" for line in expected]
    assert "  - train_micro_batch_size_per_gpu: file says 1, run gives 8" in lines
    assert not any("disagree among themselves" in line for line in lines)
    from dstrain.engine.ds_config import file_data_parallel
    assert [file_data_parallel({"sequence_parallel_size": sp}, 4) for sp in (None, 1, 2, 3, True)] == [4, 4, 2, 4, 4]
