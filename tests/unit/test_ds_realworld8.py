"""Round 8 of real-world DeepSpeed JSONs: keys DeepSpeed 0.19.8's config parser stores as written and its engine
trips over later. Each passed dstrain's checks before this round:
``"log_level": "warn"`` (the engine raises 'warn is not one of the valid logging levels' on every rank as it
starts; an integer fails too), a ``datastates_ckpt`` block (DeepSpeed's test is ``is not False``, so even
``{"enabled": false}`` turns DataStates checkpointing on, and without the package every rank stops in
initialize), ``"managed_gradient_accumulation": false`` (the training loop then owns the accumulation boundary:
``is_gradient_accumulation_boundary()`` is false outside ``step()``, so dstrain took every update for a skipped
one and a 3-step run logged no step at all, exit 0), ``zero_optimization.compute_grad_norm: false`` beside
clipping (DeepSpeed's default 1.0 too), optimizer offload, ZenFlow or ZeRO-1 bf16 with fp32 accumulation (the
ZeRO optimizer raises at start-up), torch's ``LBFGS`` (refuses parameter groups; needs a closure) and
``SparseAdam`` (dense gradients), ``"capturable": true`` for torch's AdamW on the CPU (asserts at the first
step), torch's ``ReduceLROnPlateau`` (DeepSpeed's step passes no metric, then retries with the batch size: the
lr fell by ``factor`` every patience + 1 steps whatever the loss), and a ``warmup_type`` other than "log" /
"linear" ("Linear", "cosine": DeepSpeed only warns and warms up on the log curve). Each is now refused before
launch naming the key and the fix (dstrain.engine.ds_engine_keys), and so is ``checkpoint.load_universal: true``
(it trained and saved, then every ``--resume`` stopped on every rank: dstrain saves ordinary checkpoints and converts
them itself) and ``zero_optimization.legacy_stage1: true`` (DeepSpeed >= 0.5.9 raises on every rank);
``managed_gradient_accumulation`` and ``disable_python_gc`` join the plain flags whose quoted "false" DeepSpeed
reads as true.
Also in the round, handled before it and pinned by tests/configs: ``gradient_allreduce_op`` "avg" and "sum" at
ZeRO-3, ``reduce_bucket_size`` 0, OneCycle's "auto" lrs (refused), and, trained 3 steps with a checkpoint,
lower-case ``tag_validation``, ``disable_python_gc``, ``log_level`` "INFO", an unaligned ``vocabulary_size``,
ZeRO-3 with fp32 accumulation of bf16 weights, a flops profiler under ZeRO-3, monitors without ``output_path``,
torch's fused AdamW on the CPU, ``compute_grad_norm`` false without clipping, offload ``ratio`` 0 at ZeRO-3 and
torch's SGD under ZeRO-2 offload, ``parameter_alignment`` at ZeRO-2 and ``zero_hpz_partition_size`` 0."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_files import canonical_forms
from dstrain.engine.ds_sections import section_problems

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPE = str(Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json")

from tests.unit.test_ds_realworld6 import _cpu_accelerator, _write  # noqa: F401,E402 (the fixture is autouse here too)


def _refusals(path, world_size: int = 2) -> list[str]:
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type="cpu", world_size=world_size)
    return err.value.problems


# --------------------------------------------------------------------------- log_level


@pytest.mark.parametrize("level, fix", [("warn", "warning"), (20, "info"), ("verbose", "info"), ("ERR", "error")])
def test_a_log_level_deepspeed_cannot_name_is_refused_with_the_word_it_takes(level, fix):
    from deepspeed.utils.logging import get_log_level_from_string
    if isinstance(level, str):  # before: the engine raised this on every rank as it started
        with pytest.raises(ValueError, match="is not one of the valid logging levels"):
            get_log_level_from_string(level)
    problems, _ = section_problems({"log_level": level}, "cpu")
    assert problems == [f"log_level: DeepSpeed takes one of debug, info, warning, error, critical (as text), file says "
                        f"{level!r} (its engine raises on any other value when it starts, on every rank); write "
                        f"\"{fix}\""]


def test_log_levels_deepspeed_names_pass_in_any_case():
    for level in ("INFO", "warning", "Debug", None):
        assert section_problems({"log_level": level}, "cpu")[0] == []
    assert "ZeRO stage 2" in check_ds_file(CONFIGS / "log_level_info.json", device_type="cpu", world_size=2)


# --------------------------------------------------------------------------- datastates_ckpt


def test_a_datastates_block_is_on_to_deepspeed_even_when_it_says_disabled():
    from deepspeed.runtime.checkpoint_engine.datastates_checkpoint_engine import DataStatesCheckpointEngine
    from deepspeed.datastates.config import DeepSpeedDataStatesConfig
    assert DeepSpeedDataStatesConfig({"datastates_ckpt": {"enabled": False}}).enabled is True
    assert DeepSpeedDataStatesConfig({"datastates_ckpt": False}).enabled is False
    with pytest.raises(RuntimeError, match="Please install DataStates"):  # what every rank hit in initialize
        DataStatesCheckpointEngine(deepspeed_config=None, rank=0)
    problems = _refusals(CONFIGS / "datastates_ckpt_enabled_false.json")
    assert problems == ["datastates_ckpt: DeepSpeed turns DataStates asynchronous checkpointing on for any value but "
                        "false (an \"enabled\": false inside the block does not turn it off), and the datastates "
                        "package is not installed here (every rank would stop when the engine starts); remove the key "
                        "or set \"datastates_ckpt\": false"]
    assert section_problems({"datastates_ckpt": False}, "cpu")[0] == []
    assert section_problems({"datastates_ckpt": {}}, "cpu")[0][0].startswith("datastates_ckpt: DeepSpeed turns")


# --------------------------------------------------------------------------- managed_gradient_accumulation


def test_unmanaged_gradient_accumulation_is_refused():
    """Before: the run exited 0 with no train/loss line (dstrain read every update as skipped)."""
    problems = _refusals(CONFIGS / "managed_gradient_accumulation_false.json")
    assert len(problems) == 1 and problems[0].startswith(
        "managed_gradient_accumulation: false hands the accumulation boundary to the training loop")
    assert problems[0].endswith("remove the key (or set it true) and set the accumulation with --train.grad_accum=N")
    assert section_problems({"managed_gradient_accumulation": 0}, "cpu")[0][0].startswith(
        "managed_gradient_accumulation: false")
    assert section_problems({"managed_gradient_accumulation": True}, "cpu")[0] == []


@pytest.mark.parametrize("key", ["managed_gradient_accumulation", "disable_python_gc"])
def test_quoted_false_of_the_new_plain_flags_is_refused_and_quoted_true_read(key):
    """DeepSpeed reads these with ``get_scalar_param``: the text "false" is true to it."""
    assert canonical_forms({key: "true"})[key] is True
    problems, _ = section_problems(canonical_forms({key: "false"}), "cpu")
    assert problems == [f"{key}: file says 'false' in quotes, which DeepSpeed does not read as a boolean (any text "
                        "counts as true to it, \"false\" too); write false without quotes"]


# --------------------------------------------------------------------------- checkpoint.load_universal


def test_load_universal_is_refused_since_dstrain_saves_ordinary_checkpoints():
    """Before: the run trained and saved; ``--resume`` then stopped on every rank in DeepSpeed's universal loader
    ('zero/optimizer_state.pt containing optimizer global state is missing')."""
    problems = _refusals(CONFIGS / "checkpoint_load_universal_true.json")
    assert problems == ["checkpoint.load_universal: DeepSpeed would load every checkpoint as a universal one, and "
                        "dstrain saves ordinary ones (a resume stops on every rank: 'optimizer_state.pt containing "
                        "optimizer global state is missing'); dstrain converts a checkpoint itself when the number of "
                        "ranks changes; remove it or set it false"]
    assert section_problems({"checkpoint": {"load_universal": False}}, "cpu")[0] == []


# --------------------------------------------------------------------------- legacy_stage1


def test_legacy_stage1_is_refused_at_the_stages_that_read_it():
    """Before: 'The deprecated version of ZeRO Stage 1 is not supported in deepspeed >= 0.5.9' on every rank."""
    problems = _refusals(CONFIGS / "zero1_legacy_stage1_true.json")
    assert problems == ["zero_optimization.legacy_stage1: true asks for the ZeRO stage 1 of DeepSpeed < 0.5.9, which "
                        "DeepSpeed 0.19 no longer has (it raises when the engine starts, on every rank); remove it or "
                        "set it false (the current stage 1 partitions the optimizer states the same way)"]
    quoted = canonical_forms({"zero_optimization": {"stage": 2, "legacy_stage1": "true"}})
    assert len(section_problems(quoted, "cpu")[0]) == 1
    for zo in ({"stage": 0, "legacy_stage1": True}, {"stage": 1, "legacy_stage1": False}):
        assert section_problems({"zero_optimization": zo}, "cpu")[0] == []


# --------------------------------------------------------------------------- compute_grad_norm


def test_compute_grad_norm_false_with_clipping_is_refused_with_the_fix():
    problems = _refusals(CONFIGS / "zero2_compute_grad_norm_false_clipping.json")
    assert problems == ["zero_optimization.compute_grad_norm: false needs \"gradient_clipping\": 0 (clipping at 1 "
                        "needs the norm it turns off; DeepSpeed's ZeRO optimizer raises when the engine starts); set "
                        "\"gradient_clipping\": 0 in the file (with --train.grad_clip=0), or remove compute_grad_norm"]
    # the key left out is DeepSpeed's default clipping, 1.0: refused too
    zo = {"stage": 1, "compute_grad_norm": False}
    assert len(section_problems({"zero_optimization": zo}, "cpu")[0]) == 1
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "zero2_compute_grad_norm_false_no_clipping.json",
                                                     device_type="cpu", world_size=2)


@pytest.mark.parametrize("extra, said", [
    ({"offload_optimizer": {"device": "cpu"}}, "does not work with optimizer offload"),
    ({"zenflow": {"topk_ratio": 0.1}}, "does not work with ZenFlow")])
def test_compute_grad_norm_false_with_offload_or_zenflow_is_refused(extra, said):
    cfg = {"gradient_clipping": 0, "zero_optimization": {"stage": 2, "compute_grad_norm": False, **extra}}
    problems, _ = section_problems(cfg, "cpu")
    assert len(problems) == 1 and said in problems[0], problems


def test_compute_grad_norm_false_at_stage_one_with_bf16_and_fp32_accumulation_is_refused():
    cfg = {"gradient_clipping": 0, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
           "zero_optimization": {"stage": 1, "compute_grad_norm": "false"}}
    problems, _ = section_problems(canonical_forms(cfg), "cpu")  # the quoted boolean, as DeepSpeed's parser reads it
    assert len(problems) == 1 and "ZeRO stage 1 with bf16 weights and fp32 gradient accumulation" in problems[0]


def test_the_launch_check_sees_the_runs_clipping_where_the_file_leaves_it_out(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                             "zero_optimization": {"stage": 2, "compute_grad_norm": False}})
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("nothing may start"))
    args = ["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE, f"--deepspeed.profile={path}",
            f"--output.dir={tmp_path / 'run'}"]
    assert cli.main(args) == 2
    assert "compute_grad_norm: false needs \"gradient_clipping\": 0 (clipping at 1 " in capsys.readouterr().err
    assert cli.main(args + ["--train.grad_clip=0"]) == 0  # the run's clipping is what DeepSpeed gets
    assert "--module dstrain.cli train" in capsys.readouterr().out


# --------------------------------------------------------------------------- torch optimizers and schedulers


def test_lbfgs_and_sparse_adam_are_refused():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="LBFGS doesn't support per-parameter options"):  # the rank's failure
        torch.optim.LBFGS([{"params": [a]}, {"params": [b], "weight_decay": 0.0}])
    assert _refusals(CONFIGS / "torch_lbfgs_zero0.json")[0].startswith(
        "optimizer.type: torch.optim.LBFGS re-evaluates the loss through a closure")
    problems, _ = section_problems({"optimizer": {"type": "SparseAdam", "params": {"lr": 1e-3}}}, "cuda")
    assert problems[0].startswith("optimizer.type: torch.optim.SparseAdam takes only sparse gradients")


def test_capturable_torch_adamw_is_refused_on_the_cpu_only():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(AssertionError, match="capturable=True"):  # what the first step raised on every rank
        torch.optim.AdamW([p], capturable=True, foreach=True).step()
    problems = _refusals(CONFIGS / "torch_adamw_capturable_foreach.json")
    assert problems == ["optimizer.params.capturable: true keeps torch's optimizer step on a GPU (CUDA graphs); on the "
                        "CPU torch asserts at the first step ('params and state_steps must be on supported devices'); "
                        "remove it"]
    cfg = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True, "capturable": True}}}
    assert section_problems(cfg, "cuda")[0] == []
    # DeepSpeed's own FusedAdam does not take it: named once, by the params check of earlier rounds
    fused, _ = section_problems({"optimizer": {"type": "AdamW", "params": {"capturable": True}}}, "cpu")
    assert len(fused) == 1 and "FusedAdam" in fused[0]


def test_reduce_lr_on_plateau_is_refused():
    """DeepSpeed's step calls ``step()``, gets a TypeError, then calls ``step(train_batch_size)``: the batch size is
    the 'metric', it never improves, and the lr falls whatever the loss does."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=2)
    with pytest.raises(TypeError):
        sched.step()
    for _ in range(4):
        sched.step(16)
    assert opt.param_groups[0]["lr"] == 0.5
    problems = _refusals(CONFIGS / "torch_reduce_lr_on_plateau_zero0.json")
    assert len(problems) == 1 and problems[0].startswith("scheduler.type: torch's ReduceLROnPlateau steps on a metric")
    # under ZeRO the earlier check (DeepSpeed's wrapper is not a torch optimizer) names it alone
    zero, _ = section_problems({"zero_optimization": {"stage": 1},
                                "scheduler": {"type": "ReduceLROnPlateau", "params": {}}}, "cpu")
    assert len([p for p in zero if p.startswith("scheduler.type:")]) == 1


@pytest.mark.parametrize("kind, fix", [("Linear", "write \"linear\" (the names are lower case)"),
                                       ("cosine", "write \"linear\" or \"log\""),
                                       ("LOG", "write \"log\" (the names are lower case)")])
def test_a_warmup_type_deepspeed_does_not_know_is_refused(kind, fix):
    from deepspeed.runtime.lr_schedules import WarmupLR
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert WarmupLR(opt, warmup_num_steps=10, warmup_type=kind).warmup_type == "log"  # before: silently log
    cfg = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_type": kind}}}
    problems, _ = section_problems(cfg, "cpu")
    assert problems == [f"scheduler.params.warmup_type: WarmupDecayLR knows only \"log\" and \"linear\", file says "
                        f"{kind!r} (DeepSpeed would warn and warm up on the log curve instead); {fix}"]


def test_the_warmup_types_deepspeed_knows_pass():
    for kind in ("log", "linear"):
        cfg = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_type": kind}}}
        assert section_problems(cfg, "cpu")[0] == []
    assert "scheduler.params.warmup_type" in _refusals(CONFIGS / "warmup_cosine_type_cosine_typo.json")[0]
