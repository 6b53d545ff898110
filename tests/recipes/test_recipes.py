"""Every shipped JSON validates, and runs two real training steps."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.config import load_run_config
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import list_profiles
from tests.ahead import runs_ahead

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("models/*/recipes/*.json"))
PROFILES = list_profiles()
POLICY_RL = ("grpo", "score")
QUICK = ["--train.steps=2", "--train.log_every=1", "--train.eval_batches=1", "--data.max_bytes=1000000",
         "--output.progress=false", "--output.tensorboard=false", "--checkpoint.every=0"]


def test_something_is_shipped():
    assert len(PROFILES) >= 6 and RECIPES


def _command(recipe: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dstrain.cli", "train", recipe, *QUICK, f"--output.dir={out}", *extra]


def _summary(proc: subprocess.CompletedProcess, out: Path) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def run_two_steps(recipe: str, out: Path, *extra: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(_command(recipe, out, *extra), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    return _summary(proc, out)


def profile_extra(profile: str) -> list[str]:
    return [f"--deepspeed.profile={profile}", "--data.seq_len=64", "--train.micro_batch=2", "--train.warmup_steps=1"]


def needs_missing_data(recipe: str) -> bool:
    """Recipes that read the team's shared public data, when that folder is absent here."""
    text = (ROOT / recipe).read_text()
    return "shared/data" in text and not (ROOT.parent / "shared" / "data").is_dir()


def recipe_extra(recipe: str) -> list[str]:
    cfg = load_run_config(ROOT / recipe)
    # Shrink the model only where the recipe names a large size; the recipe's own data and
    # schedule settings are what is checked (gradient accumulation at most 2 micro-batches a step).
    extra = [] if cfg.model.size in ("tiny", "debug") else ["--model.size=tiny"]
    if cfg.data.seq_len > 8192:  # long-context recipes (32k, 1M tokens) are a GPU's work: here the same recipe at 8k
        extra += ["--data.seq_len=8192"]
    if cfg.train.grad_accum > 2:  # the 8k-token ones: 2 micro-batches a step accumulate as their 8 do, in 1/4 the time
        extra += ["--train.grad_accum=2"]
    if cfg.parallel.tp * cfg.parallel.sp > 1:  # one process here: no tensor/sequence split
        extra += ["--parallel.tp=1", "--parallel.sp=1"]
    if cfg.trainer in POLICY_RL:  # small rollouts: two prompts of two samples, a short warm start
        extra += ["--task.warm_start_steps=2", "--task.num_generations=2", "--train.micro_batch=4",
                  "--task.n_eval=2", "--task.eval_samples=2", "--task.eval_k=2"]
    return extra


@pytest.fixture(scope="module")
def ahead(request):
    """``nodeid -> (future of the completed process, run folder)``: this module's two-step runs, two at a time
    ahead of their tests (tests/ahead.py), one thread each (``OMP_NUM_THREADS=1``, not two runs of 2 threads
    on 2 cores)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    factory = request.getfixturevalue("tmp_path_factory")

    def plan(item):
        params = getattr(item, "callspec", None) and item.callspec.params
        if not params:
            return None
        if "profile" in params:
            recipe, extra = "models/gpt/recipes/tiny.json", profile_extra(params["profile"])
        elif needs_missing_data(params["recipe"]):
            return None
        else:
            recipe, extra = params["recipe"], recipe_extra(params["recipe"])
        out = factory.mktemp("two_steps")
        return _command(recipe, out, *extra), {"cwd": ROOT, "env": env, "timeout": 900}, out

    with runs_ahead(request, plan) as runs:
        yield runs


def _run_of(ahead, request, recipe: str, extra: list[str], tmp_path: Path) -> dict:
    if request.node.nodeid not in ahead:  # (not started ahead: run here)
        return run_two_steps(recipe, tmp_path, *extra)
    future, out = ahead[request.node.nodeid]
    return _summary(future.result(), out)


@pytest.mark.parametrize("profile", PROFILES)
def test_ds_profile_validates_and_trains_two_steps(profile, ahead, request, tmp_path):
    assert "valid DeepSpeed config" in check_ds_file(ROOT / "ds_configs" / f"{profile}.json")
    summary = _run_of(ahead, request, "models/gpt/recipes/tiny.json", profile_extra(profile), tmp_path)
    assert summary["step"] == 2 and summary["profile"] == profile


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_validates_and_trains_two_steps(recipe, ahead, request, tmp_path):
    if needs_missing_data(recipe):
        pytest.skip(f"{recipe} reads ../shared/data, which this machine does not have")
    cfg = load_run_config(ROOT / recipe)
    summary = _run_of(ahead, request, recipe, recipe_extra(recipe), tmp_path)
    assert summary["step"] == 2
    if cfg.trainer in POLICY_RL:
        assert 0.0 <= summary["eval_after"]["pass@1"] <= 1.0 and summary["eval_after"]["tasks"] == 2
    else:
        assert summary["val_loss"] is not None and summary["val_loss"] > 0
