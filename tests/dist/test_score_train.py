"""BiLevel SCoRe through `dstrain launch` on 2 CPU ranks: episodes run, metrics are logged, every
trained model is checkpointed, and a resumed run continues from the checkpoint."""
import json
import os
import subprocess
import sys

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dstrain import checkpoint as ckpt
from tests.dist import harness

RECIPE = harness.ROOT / "models" / "policy" / "recipes" / "score_debug.json"
QUICK = ["--task.warm_start_steps=10", "--task.n_train=64", "--task.n_eval=8", "--task.stage_one_steps=2",
         "--task.guidance_every=2", "--train.log_every=1", "--train.eval_every=0", "--output.progress=false"]
KEYS = {"accuracy@t1", "accuracy@t2", "delta(t1,t2)", "incorrect_to_correct", "correct_to_incorrect",
        "kl_turn1", "kl_turn2", "critic_loss", "value_loss", "guidance_reward", "loss", "stage",
        "time/policy", "time/critic", "time/value", "time/critic_target", "time/reference",
        "time/generate_policy", "time/generate_guidance"}


def launch(out, steps, *extra):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(RECIPE), *QUICK,
           f"--train.steps={steps}", f"--output.dir={out}", *extra]
    proc = subprocess.run(cmd, env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def test_two_rank_score_run_logs_checkpoints_and_resumes(tmp_path):
    out = tmp_path / "run"
    log = launch(out, 4, "--checkpoint.every=2")
    assert "placement memory" in log and "critic_target" in log  # the placement table is printed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "train/loss" in r}
    assert sorted(train) == [1, 2, 3, 4]
    # time/* parts are a section of their own (a record beside the train record of the same step)
    expected = {k if k.startswith("time/") else f"train/{k}" for k in KEYS}
    for step, record in train.items():
        logged = set().union(*(r for r in records if r["step"] == step))
        missing = expected - logged
        assert not missing, (step, missing)
        assert record["train/stage"] == (1 if step <= 2 else 2)
        assert record["train/delta(t1,t2)"] == record["train/accuracy@t2"] - record["train/accuracy@t1"]
    assert ("train/guidance_loss" in train[1]) and ("train/guidance_loss" not in train[2])  # every 2nd step
    assert train[1]["train/kl_coef_turn1"] == 0.1 and train[3]["train/kl_coef_turn1"] == 0.01
    assert any("val/accuracy@t2" in r for r in records)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert expected <= set(events.Tags()["scalars"])

    root = out / "checkpoints"
    assert ckpt.complete_tags(root) == ["step_00000002", "step_00000004"]
    for tag in ckpt.complete_tags(root):
        names = {p.name for p in (root / tag).iterdir()}
        assert {"mp_rank_00_model_states.pt", "guidance", "critic", "value", "critic_target.pt"} <= names
        assert (root / tag / "critic" / "mp_rank_00_model_states.pt").is_file()
    target = torch.load(root / "step_00000004" / "critic_target.pt", weights_only=True)
    assert target["head.weight"].shape[0] == 1 and any(k.startswith("backbone.") for k in target)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["devices"].values()) == {"cpu"} and len(summary["devices"]) == 6
    assert summary["world_size"] == 2 and summary["samples_per_step"] == 16

    log = launch(out, 5, "--checkpoint.every=0", "--resume")
    assert "resumed from" in log
    assert json.loads((out / "summary.json").read_text())["step"] == 5
    assert ckpt.complete_tags(root)[-1] == "step_00000005"
