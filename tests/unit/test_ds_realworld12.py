"""Round 12 of real-world DeepSpeed JSONs: the files people copy today, in the shapes their sources write them.

Fixed in the round (each passed dstrain's checks, or was refused with a misleading fix, before it):
Megatron-DeepSpeed's ``ds_config_gpt_TEMPLATE.json`` used as it stands (bare words ``CONFIG_BATCH_SIZE``,
``ZERO_STAGE``, ``PRESCALE_GRAD``, ``CONFIG_BF16_ENABLED`` where its run script writes values in with sed) and a run
script's heredoc copied out with its shell variables (``$GLOBAL_BATCH``, ``${ZERO_STAGE}``): DeepSpeed's hjson loader
reads each as text running to the end of its line, comma included (``"CONFIG_BATCH_SIZE,"``). dstrain refused two of
the seven placeholders, the batch sizes, with "a string: write the number without quotes" (the file has no quotes),
and named the rest only after those were fixed; now one line names every placeholder and says the file is a template.
axolotl's ``zero1_torch_compile.json`` (``"compile": {"disable": false, "backend": "inductor"}``, the torch.compile
switches of DeepSpeed before DeepCompile): refused as two unknown keys with no fix; now named with the fix (remove
them; ``--train.compile=true`` where the block asked for compilation). ``gradient_predivide_factor`` beside
``"prescale_gradients": true`` at ZeRO stage 0 / 1 (Megatron-DeepSpeed's flags): DeepSpeed then divides by the
data-parallel size before the all-reduce and never reads the factor; it passed in silence, now a note says so
(dstrain.engine.ds_copied).

Pinned by tests/configs and trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand, as written (each
passed before, and trains as DeepSpeed would run it): Accelerate's docs ZeRO-2 file with ``torch_adam`` /
``adam_w_mode`` and an all-"auto" WarmupDecayLR, its ZeRO-3 offload file with
``"stage3_gather_16bit_weights_on_model_save": "auto"`` (DeepSpeed's default, noted), a DeepSpeedPlugin dump with
``"nvme_path": null`` under "cpu" / "none" offload, LLaMA-Factory's ``ds_z0_config`` and ``ds_z3_config``, axolotl's
``zero3_bf16`` (sub-group size, live parameters and reuse distance 0) and a ZeRO-2 offload file with
``"immediate_grad_update": false``, OpenRLHF's reference-model ZeRO-3 config with parameter offload, TRL's
reference-model file with a micro batch alone, DeepSpeed-Chat's eval config at stage 0 (stage-3 keys and
``memory_efficient_linear`` noted), HF Trainer's ZeRO-3 offload file with the old ``stage3_gather_fp16_weights_on_model_save``
spelling alone, a Megatron-DeepSpeed MoE file with ``elastic_checkpoint`` at stage 0, fp16 off with ``auto_cast``
beside bf16, and ``seq_parallel_communication_data_type`` with ``sequence_parallel_size`` 1 (noted).
Refused before and still (pinned): Accelerate's resolved dump with ``"steps_per_print": Infinity`` (text to DeepSpeed's
hjson loader) and a DeepSpeed tutorial's ``amp`` / ``sparse_gradients`` leftovers (DeepSpeed 0.19 raises on both).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_sections import section_problems

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROOT = CONFIGS.parents[1]
RECIPE = str(ROOT / "models" / "gpt" / "recipes" / "tiny.json")

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


def _refusals(path) -> list[str]:
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=2)
    return err.value.problems


# --------------------------------------------------------------------------- template placeholders


def test_deepspeeds_loader_reads_a_placeholder_as_text_with_its_comma():
    import hjson
    data = hjson.loads((CONFIGS / "megatron_ds_template_placeholders.json").read_text())
    assert data["train_batch_size"] == "CONFIG_BATCH_SIZE," and data["zero_optimization"]["stage"] == "ZERO_STAGE"


def test_every_template_placeholder_is_named_in_one_line():
    assert _refusals(CONFIGS / "megatron_ds_template_placeholders.json") == [
        "train_batch_size (CONFIG_BATCH_SIZE), train_micro_batch_size_per_gpu (CONFIG_MBSIZE), steps_per_print "
        "(LOG_INTERVAL), zero_optimization.stage (ZERO_STAGE), prescale_gradients (PRESCALE_GRAD), fp16.enabled "
        "(CONFIG_FP16_ENABLED), bf16.enabled (CONFIG_BF16_ENABLED): unfilled template placeholders, which DeepSpeed's "
        "hjson loader reads as text (the file is a template: Megatron-DeepSpeed's example scripts write the values in "
        "with sed or a shell heredoc before launch); replace each with its value, or with \"auto\" where the run may "
        "fill it"]


def test_shell_variables_of_a_copied_heredoc_are_placeholders_too(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    profile = CONFIGS / "megatron_ds_heredoc_shell_vars.json"
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE,
                     f"--deepspeed.profile={profile}", "--train.steps=3", f"--output.dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"dstrain: error: {profile}: train_batch_size ($GLOBAL_BATCH), "
                               "train_micro_batch_size_per_gpu ($MICRO_BATCH), zero_optimization.stage "
                               "(${ZERO_STAGE}): unfilled template placeholders")
    assert "without quotes" not in lines[0]  # the old fix: the file has no quotes to remove
    assert not (tmp_path / "run").exists()


def test_filled_templates_and_other_quoteless_values_are_not_placeholders(tmp_path):
    filled = (CONFIGS / "megatron_ds_template_placeholders.json").read_text()
    for word, value in (("CONFIG_BATCH_SIZE", "16"), ("CONFIG_MBSIZE", "4"), ("LOG_INTERVAL", "10"),
                        ("ZERO_STAGE", "1"), ("PRESCALE_GRAD", "false"), ("CONFIG_FP16_ENABLED", "false"),
                        ("CONFIG_BF16_ENABLED", "true")):
        filled = filled.replace(word, value)
    (tmp_path / "filled.json").write_text(filled)
    assert "ZeRO stage 1; batch 4 x 2 x 2 ranks" in check_ds_file(tmp_path / "filled.json", "cpu", 2)
    # a dtype in capitals stays round 10's refusal, and quoteless lower-case text is hjson's ordinary reading
    (tmp_path / "dtype.json").write_text('{\n  "data_types": {\n    "grad_accum_dtype": FP32\n  }\n}\n')
    assert _refusals(tmp_path / "dtype.json")[0].startswith("data_types.grad_accum_dtype: DeepSpeed's dtype names are lower case")
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "hjson_quoteless_values.json", "cpu", 2)


# --------------------------------------------------------------------------- compile keys of older DeepSpeed


def test_older_compile_switches_are_refused_with_the_fix():
    from deepspeed.compile.config import CompileConfig
    with pytest.raises(Exception, match="disable"):  # what DeepSpeed 0.19's parser does with them
        CompileConfig(**{"disable": False, "backend": "inductor"})
    assert _refusals(CONFIGS / "axolotl_zero1_torch_compile.json") == [
        "compile.disable, backend: torch.compile settings of DeepSpeed before DeepCompile; DeepSpeed 0.19's compile "
        "section configures DeepCompile only and rejects them as unknown keys; remove them and pass "
        "--train.compile=true (dstrain compiles the model inside the engine with torch.compile)"]


def test_a_disabled_older_compile_block_names_the_key_and_deepcompile_keeps_its_refusal():
    off = section_problems({"compile": {"enabled": False}}, "cpu")[0]
    assert off == ["compile.enabled: torch.compile settings of DeepSpeed before DeepCompile; DeepSpeed 0.19's compile "
                   "section configures DeepCompile only and rejects it as unknown keys; remove it (dstrain's "
                   "train.compile decides whether torch.compile runs)"]
    for block in ({"deepcompile": True}, {"deepcompile": True, "backend": "inductor"}):  # one line, the section's
        assert section_problems({"compile": block}, "cpu")[0] == [
            "compile: dstrain compiles the model itself; remove the section and use --train.compile=true"]
    assert section_problems({"compile": {"deepcompile": False}}, "cpu")[0] == []  # OpenRLHF's: DeepSpeed's own key


# --------------------------------------------------------------------------- predivide factor under prescale


def test_a_predivide_factor_beside_prescale_is_noted_as_unused():
    summary = check_ds_file(CONFIGS / "megatron_ds_prescale_predivide_comm_dtype_fp32.json", "cpu", 2)
    assert summary.endswith("; gradient_predivide_factor: 2 is unused: with \"prescale_gradients\": true DeepSpeed "
                            "divides each gradient by the data-parallel size before the all-reduce and never reads "
                            "the factor (the average is the same); remove it, or set prescale_gradients to false to "
                            "divide by it instead")


@pytest.mark.parametrize("cfg, noted", [
    ({"prescale_gradients": True, "gradient_predivide_factor": 4.0}, True),  # stage 0
    ({"prescale_gradients": True, "gradient_predivide_factor": 4.0,
      "zero_optimization": {"stage": 2, "reduce_scatter": False}}, True),
    ({"prescale_gradients": False, "gradient_predivide_factor": 4.0}, False),  # the factor is used
    ({"prescale_gradients": True, "gradient_predivide_factor": 1.0}, False),
    ({"prescale_gradients": True}, False),
])
def test_the_note_only_where_deepspeed_accepts_both_and_skips_the_factor(cfg, noted):
    problems, notes = section_problems(cfg, "cpu")
    assert problems == []
    assert any(n.startswith("gradient_predivide_factor: ") for n in notes) is noted


def test_prescale_with_reduce_scatter_at_stage_2_stays_a_refusal_not_a_note():
    cfg = {"prescale_gradients": True, "gradient_predivide_factor": 4.0, "zero_optimization": {"stage": 2}}
    problems, notes = section_problems(cfg, "cpu")
    assert problems[0].startswith("prescale_gradients, gradient_predivide_factor: ZeRO stage 2 with reduce_scatter")
    assert not any(n.startswith("gradient_predivide_factor") for n in notes)
