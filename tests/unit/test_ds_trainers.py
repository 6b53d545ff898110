"""A user's DeepSpeed JSON with the trainers other than the dense GPT's: HRM's batch, SCoRe's engines.

Fast: the checks a launch runs, ``dstrain plan`` and the role plans, no ranks started.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain import cli
from dstrain.config import ConfigError, load_run_config
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_preflight import adopt_file_values, check_run
from dstrain.trainers import score_models as sc

ROOT = Path(__file__).resolve().parents[2]
HRM = ROOT / "models" / "hrm" / "recipes" / "sudoku_debug.json"  # task.global_batch 64
SCORE = ROOT / "models" / "policy" / "recipes" / "score_debug.json"
CONFIGS = ROOT / "tests" / "configs"


@pytest.fixture
def quick_hardware(monkeypatch):
    from dstrain.engine import hardware
    monkeypatch.setattr(hardware, "cpu_bf16_is_fast", lambda *a, **k: (False, "bf16 not measured (test)"))


def _file(tmp_path, body: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(body))
    return str(path)


# ---------------------------------------------------------------- HRM: task.global_batch, no accumulation

def test_hrm_file_micro_batch_is_checked_against_the_global_batch(tmp_path):
    """HRM runs task.global_batch / ranks per rank (32 here), not train.micro_batch (8): a file that
    says 8 passed the launch's checks and failed in the ranks; the fix names task.global_batch."""
    ds = _file(tmp_path, {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}})
    cfg = load_run_config(HRM, [f"--deepspeed.profile={ds}"])
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert "--task.global_batch=16" in str(err.value) and "--train.micro_batch" not in str(err.value)
    cfg = load_run_config(HRM, [f"--deepspeed.profile={ds}", "--task.global_batch=16"])
    check_run(cfg, 2, "cpu")  # what the message asks for is accepted


def test_hrm_values_from_file_sets_the_global_batch(tmp_path):
    ds = _file(tmp_path, {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1}})
    cfg = load_run_config(HRM, [f"--deepspeed.profile={ds}", "--deepspeed.values_from_file=true"])
    adopted = adopt_file_values(cfg, 2)
    assert [(k, v) for k, v, _ in adopted] == [("task.global_batch", 16)]
    assert cfg.task["global_batch"] == 16
    check_run(cfg, 2, "cpu")


@pytest.mark.parametrize("name", ["ga_only.json", "tb_and_ga_only.json"])
def test_hrm_refuses_gradient_accumulation_in_the_file(name):
    """HRM steps once per ACT segment: the file's accumulation is refused by its key, not answered
    with --train.grad_accum=2 (which the HRM trainer then refuses in the ranks)."""
    cfg = load_run_config(HRM, [f"--deepspeed.profile={CONFIGS / name}"])
    with pytest.raises(ConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert err.value.key == "gradient_accumulation_steps" and "task.global_batch" in str(err.value)
    cfg = load_run_config(HRM, [f"--deepspeed.profile={CONFIGS / name}", "--deepspeed.values_from_file=true"])
    with pytest.raises(ConfigError, match="steps once per ACT segment"):
        adopt_file_values(cfg, 2)


# ---------------------------------------------------------------- SCoRe: the placement table, the roles' lr

def test_score_plan_with_a_user_file(capsys, quick_hardware):
    """The placement table counted the policy's profile by name and raised ValueError (in every
    rank, after the launch's checks passed) when the profile was a user's file."""
    code = cli.main(["plan", str(SCORE), "--device", "cpu", "--world-size", "2",
                     f"--deepspeed.profile={CONFIGS / 'examples_gpt_adam_warmup.json'}",
                     "--deepspeed.values_from_file=true"])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()
            and line.split()[0] in sc.pl.ROLES}
    assert rows["critic"][2:5] == ["engine", "zero1", "(trained)"]
    assert "built-in equivalent zero1" in out


@pytest.mark.parametrize("zero, name", [
    ({"stage": 0}, "zero0"), ({"stage": 2}, "zero2"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero2_offload"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zero3_offload_optimizer"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, "zero3_offload"),
    ({"stage": 3, "offload_param": {"device": "none"}}, "zero3"),
])
def test_builtin_equivalent_of_a_file(zero, name):
    assert sc.builtin_equivalent({"zero_optimization": zero}) == name


@pytest.mark.parametrize("scheduler", [
    {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 2}},
    {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 6e-4, "warmup_num_steps": 2,
                                         "total_num_steps": 30}},
])
def test_role_learning_rate_survives_the_files_scheduler(tmp_path, quick_hardware, scheduler):
    """critic_lr / value_lr / guidance_lr went into the optimizer, but the file's WarmupLR then set
    every role's rate to the policy's warmup_max_lr."""
    from deepspeed.runtime import lr_schedules
    from dstrain.engine.factory import plan_engine
    ds = _file(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 6e-4}}, "scheduler": scheduler,
                          "zero_optimization": {"stage": 1}})
    cfg = load_run_config(SCORE, [f"--deepspeed.profile={ds}", "--train.lr=6e-4"])
    plan = plan_engine(cfg, 1, ranks_per_node=1, device_type="cpu")
    world = SimpleNamespace(is_main=True, world_size=1, local_world_size=1, device=torch.device("cpu"))
    role = sc.role_plan(plan, cfg, world, plan.profile, 1e-4)

    def rate_after_warmup(ds_config):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-4)
        block = ds_config["scheduler"]
        sched = getattr(lr_schedules, block["type"])(opt, **block["params"])
        for _ in range(2):
            opt.step()
            sched.step()
        return opt.param_groups[0]["lr"]
    assert rate_after_warmup(role.ds_config) == pytest.approx(1e-4)
    assert rate_after_warmup(plan.ds_config) == pytest.approx(6e-4)  # the policy keeps the file's


def test_rescale_schedule_leaves_ratio_schedules_alone():
    ds = {"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.0, "cos_min_ratio": 0.1,
                                                             "warmup_num_steps": 2, "total_num_steps": 9}}}
    assert sc.rescale_schedule(ds, 1e-4) is None
    assert ds["scheduler"]["params"]["cos_min_ratio"] == 0.1
    ds = {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}
    assert sc.rescale_schedule(ds, 1e-4) == pytest.approx(0.1)
    assert ds["scheduler"]["params"] == pytest.approx({"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-4})


# ---------------------------------------------------------------- GRPO: num_iterations updates per step

GRPO = ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"  # lr 0.0005


def test_grpo_onecycle_total_steps_counts_optimizer_updates(tmp_path):
    """GRPO steps the optimizer task.num_iterations times per step: torch's OneCycleLR with total_steps =
    train.steps passed the launch's checks and raised 'Tried to step 4 times' inside the ranks."""
    ds = _file(tmp_path, {"train_micro_batch_size_per_gpu": "auto",
                          "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
                          "scheduler": {"type": "OneCycleLR", "params": {"max_lr": 5e-4, "total_steps": 3}}})
    cfg = load_run_config(GRPO, [f"--deepspeed.profile={ds}", "--train.steps=3", "--task.num_iterations=2"])
    with pytest.raises(DSConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert "task.num_iterations" in str(err.value) and '"total_steps": 6' in str(err.value)
    assert "--train.steps=1" in str(err.value)
    cfg = load_run_config(GRPO, [f"--deepspeed.profile={ds}", "--train.steps=3"])
    check_run(cfg, 2, "cpu")  # one update per step: 3 updates fit


def test_guidance_schedule_horizon_is_its_own_updates():
    """The guidance model updates every task.guidance_every steps: a file's WarmupDecayLR filled with
    total_num_steps = train.steps left it decaying only part of the way."""
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-4, "warmup_num_steps": 2,
                                                            "total_num_steps": 30}}}
    sc.role_horizon(ds, 30, 15)
    assert ds["scheduler"]["params"]["total_num_steps"] == 15
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}  # not the run's: kept
    sc.role_horizon(ds, 30, 15)
    assert ds["scheduler"]["params"]["total_num_steps"] == 100


# ---------------------------------------------------------------- frozen models in plan.txt

def test_frozen_model_note_says_what_the_model_got():
    from dstrain.trainers import policy_rl as prl
    module = torch.nn.Linear(2, 2).to(torch.bfloat16)
    line = prl.frozen_model_note("reference", SimpleNamespace(module=module, engine=None), "task.reference=cpu")
    assert line.startswith("reference: a plain frozen module (task.reference=cpu) on cpu in bfloat16")
    assert "trained engines only" in line
    engine = SimpleNamespace(zero_optimization_stage=lambda: 3, zero_offload_param=lambda: True,
                             bfloat16_enabled=lambda: True, fp16_enabled=lambda: False,
                             train_micro_batch_size_per_gpu=lambda: 4)
    line = prl.frozen_model_note("reference", SimpleNamespace(module=module, engine=engine), "task.reference=engine")
    assert "ZeRO stage 3 with its parameters offloaded to the CPU, bf16, micro-batch 4" in line


@pytest.mark.dist
@pytest.mark.slow  # about a minute on 2 CPU ranks
def test_score_trains_two_steps_with_a_user_file(tmp_path):
    """SCoRe with a user's file: every rank raised ValueError ('unknown profile') after the launch's
    checks passed. Now it trains, checkpoints every engine, and plan.txt says what each model got."""
    import os
    import subprocess
    import sys
    out = tmp_path / "run"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(SCORE),
           f"--deepspeed.profile={CONFIGS / 'examples_gpt_adam_warmup.json'}", "--deepspeed.values_from_file=true",
           "--train.steps=2", "--checkpoint.every=2", "--task.warm_start_steps=0", "--task.n_train=16",
           "--task.n_eval=4", "--task.stage_one_steps=1", f"--output.dir={out}"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = (out / "plan.txt").read_text()
    assert "built-in equivalent zero1" in plan
    assert "learning rates: policy 0.00015, guidance 0.0001, critic 0.0001, value 0.0001" in plan
    assert "reference: a plain frozen module (placement.reference: engine false, device cpu)" in plan
    tag = out / "checkpoints" / "step_00000002"
    assert all((tag / role).is_dir() for role in ("guidance", "critic", "value"))


def test_hrm_ema_with_a_zero3_file_is_refused_before_launch():
    """task.ema needs full parameters: the trainer refused a ZeRO-3 file inside every rank, after the
    launch's checks had passed."""
    cfg = load_run_config(HRM, [f"--deepspeed.profile={CONFIGS / 'hf_trainer_zero3_auto.json'}", "--task.ema=0.999"])
    with pytest.raises(ConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert err.value.key == "zero_optimization.stage" and "--task.ema=0" in str(err.value)
    cfg = load_run_config(HRM, [f"--deepspeed.profile={CONFIGS / 'hf_trainer_zero2_auto.json'}", "--task.ema=0.999"])
    check_run(cfg, 2, "cpu")


def test_grpo_file_batch_must_hold_whole_groups(tmp_path):
    """train_batch_size 12 on 2 ranks with 8 completions per prompt passed the launch's checks and was
    refused inside the ranks as 'train.micro_batch'; now before launch, by the file's key."""
    ds = _file(tmp_path, {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}})
    cfg = load_run_config(GRPO, [f"--deepspeed.profile={ds}", "--deepspeed.values_from_file=true"])
    adopt_file_values(cfg, 2)
    with pytest.raises(ConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert err.value.key == "train_batch_size" and "task.num_generations = 8" in str(err.value)
    cfg = load_run_config(GRPO, [f"--deepspeed.profile={ds}", "--deepspeed.values_from_file=true",
                                 "--task.num_generations=4"])
    adopt_file_values(cfg, 2)
    check_run(cfg, 2, "cpu")  # 12 samples = 3 groups of 4


def test_role_with_its_own_profile_keeps_the_files_precision(tmp_path, quick_hardware):
    """A critic placed on a named profile was planned with precision auto (fp32 where bf16 is slow)
    while the policy trained in the file's bf16."""
    from dstrain.engine.factory import plan_engine
    ds = _file(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}})
    cfg = load_run_config(SCORE, [f"--deepspeed.profile={ds}", "--deepspeed.precision=auto",
                                  "--placement.critic.profile=zero0"])
    plan = plan_engine(cfg, 1, ranks_per_node=1, device_type="cpu")
    assert plan.precision == "bf16"
    world = SimpleNamespace(is_main=True, world_size=1, local_world_size=1, device=torch.device("cpu"))
    role = sc.role_plan(plan, cfg, world, "zero0", 1e-4)
    assert role.profile == "zero0" and role.precision == "bf16"
    assert role.ds_config.get("bf16", {}).get("enabled") is True
