"""A user's DeepSpeed JSON against the run config before launch: sections, adoption, strict parsing, reporting."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dstrain import cli
from dstrain.config import ConfigError, load_run_config
from dstrain.engine.ds_check import check_ds_file, deepspeed_problems, values_from_file
from dstrain.engine.ds_config import DSConfigError, fill_ds_config
from dstrain.engine.ds_preflight import adopt_file_values, adopted_overrides, check_run
from dstrain.engine.ds_sections import section_problems

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "models" / "gpt" / "recipes" / "tiny.json"


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    """DeepSpeed's config parsing sees a CPU accelerator here; set per test (a module-level setting
    would stay in the environment of every run launched later in the same pytest session)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def run_cfg(tmp_path, ds: dict | str, *overrides: str):
    if isinstance(ds, dict):
        path = tmp_path / "user.json"
        path.write_text(json.dumps(ds))
        ds = str(path)
    return load_run_config(RECIPE, [f"--deepspeed.profile={ds}", *overrides])


# --------------------------------------------------------------------------- sections


@pytest.mark.parametrize("cfg, key", [
    ({"fp16": {"enabled": True}}, "fp16.enabled: fp16 does not run on the CPU accelerator"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "optimizer.type: 'OneBitAdam'"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "zero_optimization.offload_optimizer: optimizer offload needs ZeRO stage 1, 2 or 3"),
    ({"communication_data_type": "fp16"}, "communication_data_type: fp16 does not run on the CPU"),
    ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype: must be one of fp32, fp16, bf16"),
    ({"sequence_parallel_size": 2}, "sequence_parallel_size: dstrain splits sequences itself"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel: DeepSpeed's AutoTP is not used"),
    ({"autotuning": {"enabled": True}}, "autotuning.enabled:"),
    ({"compile": {"deepcompile": True}}, "compile: dstrain compiles the model itself"),
    ({"flops_profiler": {"enabled": True, "profile_stp": 3}},
     "flops_profiler.profile_stp: unknown key (did you mean 'profile_step'?)"),
    ({"activation_checkpointing": {"number_checkpoints": 4}}, "activation_checkpointing.number_checkpoints:"),
])
def test_sections_refused_by_name(cfg, key):
    problems, _ = section_problems(cfg, "cpu")
    assert len(problems) == 1 and problems[0].startswith(key), problems


def test_sections_honoured_with_notes_and_gpu_rules():
    cfg = {"zero_optimization": {"stage": 0, "overlap_comm": True}, "fp16": {"enabled": True},
           "tensorboard": {"enabled": True}, "comms_logger": {"enabled": True},
           "aio": {"block_size": 1048576}, "communication_data_type": "bf16",
           "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    problems, notes = section_problems(cfg, "cuda")  # fp16 and Lamb run on GPUs
    assert problems == []
    assert "zero_optimization: stage 0 does not use overlap_comm" in notes
    assert "tensorboard: on, as DeepSpeed runs it" in notes and "comms_logger: on, as DeepSpeed runs it" in notes
    assert any(n.startswith("aio: kept, but only NVMe offload uses it") for n in notes)
    stage3 = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9}}
    assert section_problems(stage3, "cpu")[0] == []
    # keys DeepSpeed parses and then does not read are named, not passed on in silence (templates such as
    # DeepSpeed-Chat's and OpenRLHF's write stage-3 keys at every stage), and "auto" where DeepSpeed's parser
    # drops it is DeepSpeed's default
    assert section_problems({"zero_optimization": {"stage": 1, "stage3_max_reuse_distance": 10,
                                                   "sub_group_size": "auto"}}, "cpu") == ([], [
        "zero_optimization: stage 1 does not use stage3_max_reuse_distance, sub_group_size (stage-3 keys)",
        "zero_optimization: \"auto\" is DeepSpeed's default there (its parser drops \"auto\"): sub_group_size 1e+09"])
    stage3["zero_optimization"].update(round_robin_gradients=True, allgather_bucket_size=5e8)
    stage3["disable_allgather"] = True
    assert section_problems(stage3, "cpu") == ([], [
        "zero_optimization: stage 3 does not use allgather_bucket_size, round_robin_gradients (stage 1/2 keys)",
        "disable_allgather: unused: DeepSpeed parses it and nothing reads it"])


# --------------------------------------------------------------------------- values_from_file


MEGATRON = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
            "bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.999]}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 7,
                                                              "warmup_max_lr": 3e-4}}}


def test_values_from_file_adopts_and_reports_each_value(tmp_path):
    cfg = run_cfg(tmp_path, MEGATRON, "--deepspeed.values_from_file=true", "--train.steps=3")
    adopted = adopt_file_values(cfg, world_size=2)
    got = {key: value for key, value, _ in adopted}
    assert got == {"train.micro_batch": 4, "train.grad_accum": 2, "train.lr": 3e-4, "train.betas": (0.9, 0.999),
                   "train.grad_clip": 0.5, "train.warmup_steps": 7, "deepspeed.precision": "bf16",
                   "train.weight_decay": 0.0}  # the block leaves it out: DeepSpeed's Adam has none
    assert all("user.json" in where and "(was " in where for _, _, where in adopted)
    assert (cfg.train.micro_batch, cfg.train.grad_accum, cfg.train.steps) == (4, 2, 3)  # steps stay the run's
    assert "--train.betas=[0.9,0.999]" in adopted_overrides(adopted)
    assert check_run(cfg, 2, "cpu") == []  # the adopted run now agrees with the file (no notes: no monitors)
    assert adopt_file_values(cfg, world_size=2) == []  # idempotent: the ranks adopt nothing more


@pytest.mark.parametrize("params, expected", [
    # what DeepSpeed's Adam (FusedAdam, its CPU Adam) defaults to where the block says nothing
    ({"lr": 1e-4}, {"train.lr": 1e-4, "train.betas": (0.9, 0.999), "train.weight_decay": 0.0}),
    # torch_adam builds torch.optim.AdamW, whose weight decay defaults to 0.01
    ({"lr": 1e-4, "torch_adam": True}, {"train.lr": 1e-4, "train.betas": (0.9, 0.999), "train.weight_decay": 0.01}),
    # "auto" is the run's, as without the switch; an explicit number is the file's
    ({"lr": "auto", "betas": "auto", "weight_decay": 0.05}, {"train.weight_decay": 0.05}),
    # no lr at all: DeepSpeed's 1e-3
    ({}, {"train.lr": 1e-3, "train.betas": (0.9, 0.999), "train.weight_decay": 0.0}),
])
def test_values_the_file_leaves_out_are_deepspeeds_defaults(tmp_path, params, expected):
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    ds = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": params}}
    cfg = run_cfg(tmp_path, ds, "--deepspeed.values_from_file=true", "--train.grad_clip=0.25")
    adopted = adopt_file_values(cfg, world_size=2)
    got = {key: value for key, value, _ in adopted}
    assert got == {**expected, "train.grad_clip": float(GRADIENT_CLIPPING_DEFAULT)}
    where = dict((key, text) for key, _, text in adopted)["train.grad_clip"]
    assert where == "gradient_clipping in " + str(tmp_path / "user.json") + \
        ": DeepSpeed's default, the file leaves it out (was 0.25)"
    assert check_run(cfg, 2, "cpu") == []


def test_without_the_switch_the_refusal_lists_the_overrides(tmp_path):
    cfg = run_cfg(tmp_path, MEGATRON, "--train.steps=3", "--deepspeed.precision=bf16")
    assert adopt_file_values(cfg, 2) == []
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cpu")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.endswith("use --train.micro_batch=4 --train.grad_accum=2 --train.grad_clip=0.5 --train.lr=0.0003 "
                        "--train.betas=[0.9,0.999] --train.warmup_steps=7, or set them to \"auto\" in the file, "
                        "or pass --deepspeed.values_from_file=true to take them from the file")


def test_every_problem_in_one_refusal(tmp_path):
    """Sections, disagreements and DeepSpeed's parser at once (a fix for one must not reveal the next), each key
    once, the overrides last."""
    ds = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True, "loss_scale": 0},
          "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}, "autotuning": {"enabled": True}}
    cfg = run_cfg(tmp_path, ds, "--deepspeed.precision=bf16")
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cpu")
    lines = str(err.value).splitlines()
    assert lines[0].endswith("user.json: 4 problems:")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  - autotuning.enabled", "  - train_micro_batch_size_per_gpu", "  - zero_optimization.offload_param",
        "  - bf16.loss_scale", "  - use --train.micro_batch=4, or set them to \"auto\" in the file, or pass --deepspeed.values_from_file=true to take them from the file"]


def test_adoption_names_the_file_when_its_values_are_invalid(tmp_path):
    cfg = run_cfg(tmp_path, {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
                  "--deepspeed.values_from_file=true")
    with pytest.raises(DSConfigError, match=r"user.json: train_batch_size 10 is not a multiple of "
                                            r"train_micro_batch_size_per_gpu 4 x 2 data-parallel ranks"):
        adopt_file_values(cfg, 2)


# --------------------------------------------------------------------------- the run path's checks


def test_run_checks_use_the_launch_world_size(tmp_path):
    """A shipped profile on 2 ranks passes DeepSpeed's own parser (which sees one rank outside a job)."""
    cfg = load_run_config(RECIPE, ["--deepspeed.profile=zero2"])
    assert check_run(cfg, 2, "cpu") == []
    dilated = REPO / "models" / "dilated_lm" / "recipes" / "debug.json"  # (GPT has no tensor parallelism)
    cfg = load_run_config(dilated, ["--deepspeed.profile=zero3", "--parallel.tp=2", "--parallel.sp=1"])
    with pytest.raises(ConfigError, match="tp 2 x sp 1 = 2 does not divide the 3 ranks"):
        check_run(cfg, 3, "cpu")


def test_fp16_run_on_cpu_refused_naming_the_alternatives(tmp_path):
    cfg = load_run_config(RECIPE, ["--deepspeed.profile=zero1", "--deepspeed.precision=fp16"])
    with pytest.raises(ConfigError, match=r"deepspeed.precision: fp16 does not run on the CPU accelerator.*"
                                          r"--deepspeed.precision=bf16 or --deepspeed.precision=fp32"):
        check_run(cfg, 2, "cpu")


def test_strict_parse_names_the_key(tmp_path):
    cfg = run_cfg(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                      "pin_memorie": True}},
                             "csv_monitor": {"enabled": True, "ouput_path": "x"}})
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cpu")
    problems = err.value.problems
    assert "zero_optimization.offload_optimizer.pin_memorie: unknown key; DeepSpeed rejects it" in problems
    assert "csv_monitor.ouput_path: unknown key (did you mean 'output_path'?); DeepSpeed rejects it" in problems


def test_deepspeed_problems_keeps_the_accelerator_setting(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    filled = fill_ds_config({"zero_optimization": {"stage": 1}}, values_from_file({}, world_size=4), "x")
    assert filled["train_batch_size"] == 32 and deepspeed_problems(filled) == []
    assert "DS_ACCELERATOR" not in os.environ


# --------------------------------------------------------------------------- check-config


def test_check_config_accepts_megatron_batch_keys(tmp_path):
    path = tmp_path / "megatron.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                "zero_optimization": {"stage": 1}}))
    assert "batch 4 x 4 x 1 rank" in check_ds_file(path, device_type="cpu")
    assert "batch 4 x 2 x 2 ranks" in check_ds_file(path, device_type="cpu", world_size=2)
    with pytest.raises(DSConfigError, match="not a multiple"):
        check_ds_file(path, device_type="cpu", world_size=3)


def test_check_config_takes_the_warmup_peak_as_the_auto_lr(tmp_path):
    """HF-style: the optimizer's lr "auto", the scheduler's peak explicit (the run would adopt it as lr)."""
    path = tmp_path / "hf.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "true"},
                                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                                "scheduler": {"type": "WarmupDecayLR",
                                              "params": {"warmup_max_lr": 2e-5, "total_num_steps": "auto"}}}))
    assert "valid DeepSpeed config for cpu" in check_ds_file(path, device_type="cpu")
    assert values_from_file(json.loads(path.read_text())).lr == 2e-5


def test_check_config_names_the_key_not_a_class(tmp_path, capsys):
    path = tmp_path / "neg.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": -1}))
    assert cli.main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "train_micro_batch_size_per_gpu: must be a positive integer or \"auto\", file says -1" in err
    assert "RunValues" not in err


def test_check_config_refuses_fp16_for_cpu_only(tmp_path):
    path = tmp_path / "fp16.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True}}))
    with pytest.raises(DSConfigError, match="fp16.enabled: fp16 does not run on the CPU accelerator"):
        check_ds_file(path, device_type="cpu")
    assert "valid DeepSpeed config for cuda" in check_ds_file(path, device_type="cuda")


# --------------------------------------------------------------------------- one report per job


def test_first_failing_rank_reports_the_others_stay_quiet(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    monkeypatch.setenv("RANK", "1")
    assert not cli._reports_failure()  # checks before start: rank 0 speaks for all
    monkeypatch.setenv("RANK", "0")
    assert cli._reports_failure()
    monkeypatch.setattr(cli, "_TRAIN_STARTED", True)
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert cli._reports_failure()       # rank 1 failed first
    monkeypatch.setenv("RANK", "0")
    assert not cli._reports_failure()   # rank 0's failure is collateral
    assert (tmp_path / "first_failure").read_text() == "1"
    monkeypatch.delenv("DSTRAIN_FAILURE_DIR")
    assert cli._reports_failure()       # ranks started by hand: each reports


def test_plan_applies_the_launch_checks(tmp_path, capsys):
    bogus = tmp_path / "bogus.json"
    bogus.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto",
                                 "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}))
    code = cli.main(["plan", str(RECIPE), f"--deepspeed.profile={bogus}", "--world-size", "2", "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.strip() == (f"dstrain: error: {bogus}: zero_optimization.offload_param.device: Input should "
                                    "be 'none', 'cpu' or 'nvme', file says 'gpu'")


_ACCELERATOR_PROBE = """
import json, os, sys, torch
os.environ.pop("DS_ACCELERATOR", None)
torch.cuda.is_available = lambda: True  # the training process of a GPU machine, as DeepSpeed sees it
from dstrain.engine.ds_check import deepspeed_problems
cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
       "bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "overlap_comm": True}}
problems = deepspeed_problems(cfg)
from deepspeed.accelerator import real_accelerator
print(json.dumps({"problems": problems, "env": os.environ.get("DS_ACCELERATOR"),
                  "chosen": real_accelerator.ds_accelerator and real_accelerator.ds_accelerator._name}))
"""


def test_config_check_leaves_deepspeeds_accelerator_unchosen():
    """Parsing a ZeRO-3 section calls DeepSpeed's get_accelerator(), which fixes the accelerator for the
    process. The check runs inside each training rank: on an H200 it fixed the CPU accelerator, the engine
    left the model on the CPU and NCCL failed ("No backend type associated with device type cpu")."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", _ACCELERATOR_PROBE], capture_output=True, text=True, env=env,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"problems": [], "env": None, "chosen": None}


def test_config_check_keeps_an_accelerator_already_chosen():
    from deepspeed.accelerator import get_accelerator, real_accelerator
    chosen = get_accelerator()
    assert deepspeed_problems({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
                               "zero_optimization": {"stage": 3}}) == []
    assert real_accelerator.ds_accelerator is chosen


def test_check_config_of_a_run_config_checks_the_deepspeed_json_it_names(tmp_path, capsys):
    """As ``launch`` would: a pass from check-config means the launch accepts the pair."""
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}))
    args = ["check-config", str(RECIPE), f"--deepspeed.profile={path}", "--world-size", "2", "--device", "cpu"]
    assert cli.main(args) == 2
    assert "the file disagrees with the run config: train_micro_batch_size_per_gpu: file says 4" in \
        capsys.readouterr().err
    assert cli.main([*args, "--deepspeed.values_from_file=true"]) == 0
    assert "valid run config with" in capsys.readouterr().out
