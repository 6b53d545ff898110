"""Round 26 of real-world DeepSpeed JSONs: what round 25 left, each compared with DeepSpeed 0.19.8's own reading.

Fixed in the round:

* ``"steps_per_print": -1`` was refused as "must be a positive number". DeepSpeed's engine logs its progress line on
  rank 0 when ``(step + 1) % steps_per_print == 0``, which for -1 is every step: it runs, so it is accepted with a
  note (trained by hand: 2 steps on 1 CPU rank). 0 is still refused, now saying what DeepSpeed does: rank 0 stops at
  its first step with ZeroDivisionError (run by hand with a plain ``deepspeed.initialize``).
* ``"overlap_comm": "auto"`` was refused as "not a value dstrain can fill (DeepSpeed itself keeps the text)":
  DeepSpeed's parser drops "auto" and its validator sets the key to ``stage == 3``. It is now filled so, with the
  note the other ZeRO "auto" keys get (trained by hand at stage 3: 2 steps on 1 CPU rank).
* ``gradient_clipping`` among ``optimizer.params`` was named as a param FusedAdam does not take, and
  ``max_grad_norm`` twice (that line and "DeepSpeed refuses it"): one line each now, moving it to the top level with
  its value.
* A bf16 / fp16 key other than ``enabled`` set to "auto" (a notebook's ZeRO-3 dict: fp16 off with ``"auto_cast":
  "auto"``) was refused as "DeepSpeed itself keeps the text": both sections are DeepSpeed config models, whose parser
  drops "auto", so the key gets its default; it is filled so, with a note (the notebook's shape trained by hand: 2
  steps on 1 CPU rank, its ds_config.json has ``"auto_cast": false``).
* SCoRe's placement table with an empty scheduler block said "names no type: every engine keeps its lr"; it now
  gives each engine's constant rate and says why, as the run's own schedule line does.
"""
from __future__ import annotations

import json

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import RunValues, fill_ds_config
from dstrain.engine.ds_files import load_ds_json
from dstrain.engine.ds_sections import section_problems
from tests.unit.ds_rounds import CONFIGS, ROOT, deepspeed_config, refusals

MINUS_ONE = CONFIGS / "hf_zero2_steps_per_print_minus_one.json"
OVERLAP_AUTO = CONFIGS / "openrlhf_style_zero3_overlap_comm_auto.json"
AUTO_CAST = CONFIGS / "notebook_zero3_fp16_off_auto_cast_auto.json"
CLIP_IN_PARAMS = CONFIGS / "hf_notes_gradient_clipping_in_optimizer_params.json"
EMPTY_SCHEDULER = CONFIGS / "yaml_dump_empty_scheduler_block.json"
VALUES = RunValues(micro_batch=1, grad_accum=1, dp_world_size=2, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                   weight_decay=0.0, grad_clip=1.0, precision="fp32", hidden_size=64, total_steps=3, warmup_steps=1,
                   min_lr_ratio=0.1)


def _file(tmp_path, cfg: dict):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, **cfg}))
    return path


def test_a_negative_steps_per_print_runs_as_deepspeed_runs_it():
    assert check_ds_file(MINUS_ONE, device_type="cpu", world_size=2).endswith(
        "steps_per_print: -1: DeepSpeed logs its progress line when the step count modulo -1 is 0, which is every "
        "1 step, as 1 would (null, the default, turns the line off)")
    assert deepspeed_config({"steps_per_print": -1}).steps_per_print == -1  # DeepSpeed's parser keeps it
    assert all(step % -1 == 0 for step in range(1, 5)) and [s for s in range(1, 21) if s % -10 == 0] == [10, 20]
    problems, notes = section_problems({"steps_per_print": -10}, "cpu")
    assert problems == [] and any("which is every 10 steps, as 10 would" in n for n in notes)


def test_steps_per_print_zero_says_rank_zero_stops(tmp_path):
    assert refusals(_file(tmp_path, {"steps_per_print": 0})) == [
        "steps_per_print: 0 stops rank 0 at its first step (DeepSpeed takes the step count modulo it: "
        "ZeroDivisionError); write null (the default) for no progress line, or a positive number"]
    assert deepspeed_config({"steps_per_print": 0}).steps_per_print == 0  # the parser takes it; the step divides
    assert refusals(_file(tmp_path, {"steps_per_print": "10"}))[0].startswith(
        'steps_per_print: must be a number (or null), file says "10"')


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_comm_auto_is_deepspeeds_stage_default(stage):
    raw = {"zero_optimization": {"stage": stage, "overlap_comm": "auto"}}
    filled = fill_ds_config(json.loads(json.dumps(raw)), VALUES, "f.json")
    ours = filled["zero_optimization"]["overlap_comm"]
    assert ours is (stage == 3) and deepspeed_config(raw).zero_config.overlap_comm is ours
    _, notes = section_problems(raw, "cpu")
    assert f"zero_optimization: \"auto\" is DeepSpeed's default there (its parser drops \"auto\"): overlap_comm " \
           f"{ours} (at stage {stage})" in notes


def test_a_file_with_overlap_comm_auto_is_accepted():
    assert "ZeRO stage 3" in check_ds_file(OVERLAP_AUTO, device_type="cpu", world_size=2)
    assert fill_ds_config(load_ds_json(OVERLAP_AUTO), VALUES, "f.json")["zero_optimization"]["overlap_comm"] is True


@pytest.mark.parametrize("section, key", [("fp16", "auto_cast"), ("fp16", "loss_scale_window"),
                                          ("bf16", "check_grad_overflow"), ("bf16", "immediate_grad_update")])
def test_a_precision_key_set_to_auto_is_deepspeeds_default(section, key):
    raw = {section: {"enabled": False, key: "auto"}}
    ours = fill_ds_config(json.loads(json.dumps(raw)), VALUES, "f.json")[section][key]
    theirs = getattr(deepspeed_config(raw), {"fp16": "float16_config", "bf16": "bfloat16_config"}[section])
    assert ours == getattr(theirs, key) and not isinstance(ours, str)
    _, notes = section_problems(raw, "cpu")
    assert f"{section}: \"auto\" is DeepSpeed's default there (its parser drops \"auto\"): {key} " \
           f"{json.dumps(ours)}" in notes


def test_the_notebooks_fp16_off_with_auto_cast_auto_is_accepted():
    assert "ZeRO stage 3" in check_ds_file(AUTO_CAST, device_type="cpu", world_size=2)
    fp16 = {"fp16": load_ds_json(AUTO_CAST)["fp16"]}  # (its batch is the file's, not VALUES')
    assert fill_ds_config(fp16, VALUES, "f.json")["fp16"]["auto_cast"] is False


def test_gradient_clipping_in_the_optimizer_params_is_moved_to_the_top_level(tmp_path):
    assert refusals(CLIP_IN_PARAMS) == [
        "optimizer.params.gradient_clipping: gradient clipping is a top-level key, not an optimizer param "
        "(DeepSpeed passes every param to the optimizer's class, which does not take it, and stops at start-up); "
        "move it to the top level: \"gradient_clipping\": 1"]
    path = _file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 0.5}}})
    assert refusals(path) == [  # one line (was two: this and "FusedAdam ... does not take it")
        "optimizer.params.max_grad_norm: gradient clipping is a top-level key, not an optimizer param (DeepSpeed "
        "refuses it by name at start-up); move it to the top level: \"gradient_clipping\": 0.5"]
    sgd = _file(tmp_path, {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "gradient_clipping": 0.25}}})
    assert [line.split(":")[0] for line in refusals(sgd)] == ["optimizer.params.gradient_clipping"]


def test_score_table_gives_each_engines_constant_lr_under_an_empty_scheduler_block(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    score = ROOT / "models" / "policy" / "recipes" / "score_debug.json"
    assert cli.main(["plan", str(score), f"--deepspeed.profile={EMPTY_SCHEDULER}", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "learning rates: policy 0.0001, guidance 0.0001, critic 0.0001, value 0.0001, each constant (the " \
           "DeepSpeed JSON's scheduler block is empty, and DeepSpeed builds no scheduler from it)" in out
