"""Round 18 of real-world DeepSpeed JSONs: configs generated in code or embedded in other formats, as users paste
them: OpenRLHF's get_train_ds_config / get_eval_ds_config (ZeRO-3 universal checkpoints, CPU offload with fp32
gradient accumulation, precision "fp32" with both sections off, AutoTP, the eval configs without an optimizer),
DeepSpeed-Chat's get_train_ds_config / get_eval_ds_config (the legacy "bfloat16" section, --offload at stage 2, the
hybrid engine, TensorBoard), GPT-NeoX's YAML DeepSpeed parts (NeoX's ``precision`` and ``fp32_allreduce`` beside them,
``"fp16": {"type": "bfloat16"}``), IDEA-Research's hana dict and LLM-Self-Control's (a sparse_attention section).
Each file's source project, path and the function arguments used are in tests/configs/expectations_late.py.

Fixed in the round:

* GPT-NeoX's ``"precision": "bfloat16"`` (configs/bf16_125M.yml's DeepSpeed parts pasted into JSON): refused as
  "unknown top-level key 'precision'; DeepSpeed would silently ignore it", no fix. It is NeoX's setting (NeoX writes
  DeepSpeed's bf16 section from it): now named, with what the run would silently do (fp32) and the section to write
  (``"bf16": {"enabled": true}``); a note where the file's own sections already train in that precision.
* NeoX's ``"fp32_allreduce": true`` beside bf16: the same bare "unknown key"; DeepSpeed reduces bf16 gradients in bf16
  by default, so the fp32 reduction the user asked for would silently not happen. Now named with DeepSpeed's own key
  (``"communication_data_type": "fp32"``); a note where nothing is lost (false, fp32 training, or the key is there).
* NeoX's test configs' ``"fp16": {"enabled": true, "type": "bfloat16"}`` (its DeeperSpeed fork trains bf16 that way):
  "fp16.type: unknown key; DeepSpeed rejects it"; now the value, whose convention it is, and the fix.
* DeepSpeed-Chat's get_train_ds_config(dtype="bf16") writes the legacy ``"bfloat16"`` section, which DeepSpeed reads
  as bf16; dstrain adopted it saying "deepspeed.precision=bf16 adopted from bf16.enabled", a key the file does not
  have. Now "adopted from bfloat16.enabled".

Checked and correct as they were: OpenRLHF's load_universal (refused: dstrain saves ordinary checkpoints), AutoTP
size 2 (refused with --parallel.tp), its stage-3 "auto"s at stage 0 (noted unused); DeepSpeed-Chat's offload_param at
stage 2 (refused: DeepSpeed keeps the parameters on the device) and hybrid engine (refused); hana's fp16 on the CPU;
the sparse_attention section (removed from DeepSpeed). OpenRLHF's ZeRO-3 offload with fp32 accumulation, its ZeRO-3
offload eval config and DeepSpeed-Chat's "bfloat16" ZeRO-3 config each trained 3 steps on 2 CPU ranks (-m slow).
"""
from __future__ import annotations

import pytest

from dstrain.engine.ds_foreign import ignored_key, ignored_key_notes

from tests.unit.ds_rounds import CONFIGS, RECIPE, ROOT  # noqa: E402,F401
from tests.unit.ds_rounds import refusals as _refusals  # noqa: E402
from tests.unit.ds_rounds import dry_run as _dry_run  # noqa: E402

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


# --------------------------------------------------------------------------- GPT-NeoX's own keys


def test_neox_precision_and_fp32_allreduce_named_with_the_deepspeed_keys():
    lines = _refusals(CONFIGS / "gpt_neox_bf16_125m_precision_fp32_allreduce.json")
    assert len(lines) == 2
    precision, allreduce = lines
    assert precision.startswith("unknown top-level key 'precision': file says 'bfloat16', GPT-NeoX's precision "
                                "setting")
    assert "the run would silently train in fp32; write \"bf16\": {\"enabled\": true} and remove it" in precision
    assert allreduce.startswith("unknown top-level key 'fp32_allreduce': GPT-NeoX's switch")
    assert allreduce.endswith("write \"communication_data_type\": \"fp32\" and remove it")


def test_neox_fp16_type_names_the_section_deepspeed_reads():
    lines = _refusals(CONFIGS / "gpt_neox_test_fp16_type_bfloat16.json")
    assert ("fp16.type: file says 'bfloat16', GPT-NeoX's way of choosing the precision in the fp16 section (its "
            "DeepSpeed fork, DeeperSpeed, reads it); DeepSpeed rejects the key; write \"bf16\": {\"enabled\": true} in "
            "place of the fp16 section") in lines
    assert any(line.startswith("unknown top-level key 'fp32_allreduce'") for line in lines)  # bf16 meant: refused
    assert not any("unknown key; DeepSpeed rejects it" in line for line in lines)


@pytest.mark.parametrize("cfg, refused", [
    ({"precision": "bfloat16", "bf16": {"enabled": True}}, False),  # the file's section does it: nothing lost
    ({"precision": "bfloat16", "bfloat16": {"enabled": True}}, False),  # DeepSpeed-Chat's legacy name counts
    ({"precision": "fp32"}, False),
    ({"precision": "fp32", "bf16": {"enabled": True}}, True),  # the file trains in bf16, NeoX's setting says fp32
    ({"precision": "fp16", "bf16": {"enabled": True}}, True),
    ({"fp32_allreduce": True, "bf16": {"enabled": True}}, True),
    ({"fp32_allreduce": True, "bf16": {"enabled": True}, "communication_data_type": "fp32"}, False),
    ({"fp32_allreduce": True}, False),  # fp32 training: its gradients are reduced in fp32 anyway
    ({"fp32_allreduce": False, "bf16": {"enabled": True}}, False),
])
def test_neox_keys_refused_only_where_the_run_would_differ(cfg, refused):
    key = next(iter(cfg))
    text, was_refused = ignored_key(key, cfg)
    assert was_refused is refused, text
    if refused:
        assert text.startswith(f"unknown top-level key {key!r}") and "silently" in text
    else:
        assert text in ignored_key_notes(cfg) and "nothing is lost" in text


def test_neox_precision_with_the_wrong_section_says_what_the_run_would_do():
    text, refused = ignored_key("precision", {"precision": "float32", "bf16": {"enabled": True}})
    assert refused and "the run would silently train in bf16; enable neither bf16 nor fp16 and remove it" in text


def test_a_matching_neox_file_trains_with_notes(capsys, monkeypatch, tmp_path):
    path = tmp_path / "neox.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": true}, "precision": "bfloat16", '
                    '"fp32_allreduce": true, "communication_data_type": "fp32", "zero_optimization": {"stage": 1}}')
    (tmp_path / "out").mkdir()
    code, lines = _dry_run(capsys, monkeypatch, tmp_path / "out", path)
    assert code == 0, lines
    notes = [line for line in lines if line.startswith("dstrain: note: ")]
    assert any("precision: GPT-NeoX's precision setting" in line and "nothing is lost" in line for line in notes)
    assert any("fp32_allreduce: GPT-NeoX's switch" in line for line in notes)


# --------------------------------------------------------------------------- DeepSpeed-Chat's "bfloat16" section


def test_bfloat16_section_named_as_the_file_writes_it(capsys, monkeypatch, tmp_path):
    path = CONFIGS / "dschat_train_bfloat16_z3_memory_efficient_linear.json"
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, path)
    assert code == 0, lines
    precision = [line for line in lines if line.startswith("dstrain: deepspeed.precision=bf16 adopted from ")]
    assert len(precision) == 1 and "adopted from bfloat16.enabled in " in precision[0], lines
    # batch 32 / micro 4 on 2 ranks: DeepSpeed's own derivation
    accum = "dstrain: train.grad_accum=4 adopted from gradient_accumulation_steps"
    assert any(line.startswith(accum) for line in lines)


def test_bf16_section_keeps_its_name(capsys, monkeypatch, tmp_path):
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "openrlhf_eval_z3_offload_stage3_autos.json")
    assert code == 0, lines
    assert any(line.startswith("dstrain: deepspeed.precision=bf16 adopted from bf16.enabled in ") for line in lines)
