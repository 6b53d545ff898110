"""Round 23 of real-world DeepSpeed JSONs: the files of the earlier rounds with the trainers other than the GPT LM's.
Hugging Face Trainer / Accelerate / axolotl / FastChat / DeepSpeedExamples / ESM files (ZeRO 0-3, optimizer and
parameter offload, fp16 / bf16 "auto" and fp32, DeepSpeed optimizer and scheduler blocks or none, values_from_file
true and false) resolved for the GRPO, SFT and SCoRe policy trainers, HRM, the dilated LM with parallel.sp=2 and
the GPT with parallel.pp=2, and the JSON each plans read back by DeepSpeed's DeepSpeedConfig.

Fixed in the round:

* HRM runs task.global_batch / ranks per rank (32 for sudoku_debug.json on 2 ranks), but ``dstrain plan`` and the
  launch's last check planned train.micro_batch (8): the plan said batch 16 and micro-batch 8 (the memory plan too)
  while the ranks ran 64 and 32. With a file whose batch keys are numbers and values_from_file on (ESM's
  ``"train_batch_size": 4``), task.global_batch was adopted and then the plan refused the file with "run gives 8;
  use --train.micro_batch=2, ... or pass --deepspeed.values_from_file=true" (already on; a key HRM does not read).
  ``plan_engine`` now plans the batch the trainer runs.
* GRPO's task.num_iterations optimizer updates a step: the trainer stretched a DeepSpeed scheduler's
  ``total_num_steps`` in the ds_config.json it wrote, but ``dstrain plan --show-json`` (and the launch's check)
  showed train.steps. ``plan_engine`` stretches it, so the plan and the run's ds_config.json say the same.
* A user's ZeRO-2/3 file with parallel.pp=2 was refused with no key and "use profile zero0, zero1 or auto"
  (switching profile drops the user's file); it is now refused by zero_optimization.stage with the fix in the file
  or --parallel.pp=1. A shipped profile is still named as a profile.
* HRM's sparse puzzle-embedding optimizer takes the engine's rate as a fraction of train.lr. A file's OneCycle whose
  range is not train.lr (ESM's cycle 1e-4..1e-6 over an optimizer lr of 1e-7, adopted as train.lr) gave the table
  1000x its task.puzzle_emb_lr. The fraction is now of the schedule's own full rate (schedule_reference_lr).

Checked and correct as they were: every other file x trainer resolves to a plan DeepSpeed reads as the plan says,
"auto" batch / lr / clipping / schedule filled from that trainer's run config (HRM's task.global_batch, GRPO's and
SCoRe's own lr); ZeRO-3 with offload_param beside HRM's puzzle embedding (the table is not a DeepSpeed parameter);
SCoRe's two stages with a DeepSpeed scheduler block (one schedule over both; only the loss changes); fp16 "auto"
with GRPO planned for a GPU (DeepSpeed's loss scaler skips an overflowing pass's update, not the step). Trained by
hand 2 steps on 2 CPU ranks: HRM with axolotl's ZeRO-3 parameter offload and with ESM's OneCycle, GRPO with
Accelerate's ZeRO-2 WarmupDecayLR and num_iterations 2, the dilated LM (sp=2) with axolotl's ZeRO-3 offload.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import deepspeed.runtime.config  # noqa: F401 (imported at collection, as the other DeepSpeed tests do)
import pytest
import torch

from dstrain import cli
from dstrain.config import ConfigError, load_run_config
from dstrain.engine.ds_preflight import adopt_file_values, check_run
from dstrain.engine.factory import plan_engine
from tests.unit.ds_rounds import CONFIGS, ROOT
from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401 (the fixture is autouse here too)

HRM = ROOT / "models" / "hrm" / "recipes" / "sudoku_debug.json"  # task.global_batch 64
GRPO = ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"
GPT = ROOT / "models" / "gpt" / "recipes" / "tiny.json"
ESM = CONFIGS / "esm_finetune_onecycle_fp32_offload_none.json"  # train_batch_size 4, lr 1e-7, OneCycle 1e-4..1e-6
ZERO2_SCHED = CONFIGS / "accelerate_docs_zero2_torch_adam_warmupdecay.json"  # WarmupDecayLR, "auto" everywhere
ZERO3_OFFLOAD = CONFIGS / "axolotl_zero3_bf16_cpuoffload_all.json"


@pytest.fixture(scope="module", autouse=True)
def _no_activation_trace():
    """A fixed activation size in place of each model's traced one (what is checked here is the batch, the schedule
    and the refusals, not the memory plan; the trace of HRM alone took seconds): zero0 fits, as it does traced."""
    from dstrain.engine import hardware
    from dstrain.engine.profiles import Activations
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hardware, "cpu_bf16_is_fast", lambda *a, **k: (False, "bf16 not measured (test)"))
        mp.setattr(hardware, "trace_activations", lambda *a, **k: Activations(2**20, 2**18))
        yield


def _deepspeed_reads(ds_config: dict, dp: int):
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "get_rank", lambda *a, **k: 0)
        mp.setattr(dist, "get_world_size", lambda *a, **k: dp)
        return DeepSpeedConfig(json.loads(json.dumps(ds_config)))


def _plan_json(capsys, recipe, *overrides) -> tuple[int, dict | None, str]:
    code = cli.main(["plan", str(recipe), "--device", "cpu", "--world-size", "2", "--show-json", *overrides])
    out, err = capsys.readouterr()
    return code, (json.loads(out[out.index("\n{") + 1:]) if code == 0 else None), err


def test_hrm_plan_is_the_batch_the_trainer_runs(capsys):
    code, ds, _ = _plan_json(capsys, HRM)
    assert code == 0
    read = _deepspeed_reads(ds, 2)
    assert (read.train_batch_size, read.train_micro_batch_size_per_gpu) == (64, 32)  # task.global_batch / 2 ranks


def test_hrm_plans_a_files_batch_taken_by_values_from_file(capsys):
    code, ds, err = _plan_json(capsys, HRM, f"--deepspeed.profile={ESM}", "--deepspeed.values_from_file=true")
    assert code == 0, err
    assert "task.global_batch=4 adopted from train_micro_batch_size_per_gpu" in err
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (4, 2)


def test_grpo_plan_shows_the_schedule_horizon_the_run_writes(capsys, tmp_path):
    """3 steps x 2 updates: the run's ds_config.json said 6, ``dstrain plan --show-json`` said 3."""
    from dstrain.trainers.common import plan_and_record
    args = ["--train.steps=3", "--task.num_iterations=2", f"--deepspeed.profile={ZERO2_SCHED}"]
    code, ds, err = _plan_json(capsys, GRPO, *args)
    assert code == 0, err
    assert _deepspeed_reads(ds, 2).scheduler_params["total_num_steps"] == 6
    cfg = load_run_config(GRPO, [*args, f"--output.dir={tmp_path}"])
    world = SimpleNamespace(is_main=True, world_size=2, local_world_size=2, device=torch.device("cpu"))
    plan_and_record(cfg, world, tmp_path)
    capsys.readouterr()
    written = json.loads((tmp_path / "ds_config.json").read_text())
    assert written["scheduler"] == ds["scheduler"]  # stretched once, not twice


@pytest.mark.parametrize("name", [ZERO3_OFFLOAD.name, ZERO2_SCHED.name])
def test_a_users_zero3_file_with_pipeline_is_refused_by_its_key(name):
    cfg = load_run_config(GPT, [f"--deepspeed.profile={CONFIGS / name}", "--parallel.pp=2"])
    with pytest.raises(ConfigError) as err:
        check_run(cfg, 2, "cpu")
    assert err.value.key == "zero_optimization.stage"
    assert "set the file's zero_optimization.stage to 1" in str(err.value) and "--parallel.pp=1" in str(err.value)
    assert "use profile" not in str(err.value)


def test_a_shipped_zero3_profile_with_pipeline_names_the_profiles():
    cfg = load_run_config(GPT, ["--deepspeed.profile=zero3", "--parallel.pp=2"])
    with pytest.raises(ConfigError, match="use profile zero0, zero1 or auto"):
        check_run(cfg, 2, "cpu")


def _lrs_of(block: dict, steps: int) -> list[float]:
    from deepspeed.runtime import lr_schedules
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-7)
    sched = getattr(lr_schedules, block["type"])(opt, **block["params"])
    seen = []
    for _ in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def test_hrm_puzzle_embedding_rate_is_a_fraction_of_the_files_schedule():
    """The embedding's lr is task.puzzle_emb_lr x (engine lr / the schedule's full rate): measured against train.lr
    (1e-7, the ESM file's optimizer lr) OneCycle's 1e-4 made it 1000x; now it never passes task.puzzle_emb_lr."""
    from dstrain.engine.ds_trainers import schedule_reference_lr
    cfg = load_run_config(HRM, [f"--deepspeed.profile={ESM}", "--deepspeed.values_from_file=true", "--train.steps=3"])
    adopt_file_values(cfg, 2)
    plan = plan_engine(cfg, 2, device_type="cpu")
    full = schedule_reference_lr(plan.ds_config, cfg.train.lr)
    rates = _lrs_of(plan.ds_config["scheduler"], 250)
    assert cfg.train.lr == pytest.approx(1e-7) and full == pytest.approx(1e-4)
    assert max(rates) / full == pytest.approx(1.0) and min(rates) / full == pytest.approx(0.01)
    warm = {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 3e-4, "total_num_steps": 9}}}
    assert schedule_reference_lr(warm, 1e-3) == 3e-4
    assert schedule_reference_lr({"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 0.1}}},
                                 1e-3) == 1e-3  # ratios of the optimizer's lr: train.lr
    assert schedule_reference_lr({}, 1e-3) == 1e-3  # dstrain's own schedule
