"""Newcomer audit, round 4: mistakes a first user makes with the README's commands, each ended in one line."""
import json
from pathlib import Path

import pytest

from dstrain import launch_check, launcher
from dstrain.config import ConfigError, load_run_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"
RECIPES = ROOT / "models"


@pytest.mark.parametrize("recipe, trainer, words", [
    # `dstrain train tiny.json --trainer=hrm` ended in AttributeError: 'GPTConfig' object has no attribute 'seq_len'
    ("gpt/recipes/tiny.json", "hrm", "trainer 'hrm' trains a model with ACT halting (such as 'hrm'), not 'gpt', "
                                     "which trains with trainer 'lm'"),
    ("gpt/recipes/tiny.json", "grpo", "trainer 'grpo' trains a policy model with an RL toolkit"),
    ("gpt/recipes/tiny.json", "score", "not 'gpt', which trains with trainer 'lm'"),
    ("hrm/recipes/sudoku_debug.json", "grpo", "not 'hrm', which trains with trainer 'hrm'"),
    ("policy/recipes/grpo_debug.json", "hrm", "not 'policy', which trains with trainer 'grpo' or 'lm' or 'score'"),
])
def test_a_trainer_of_another_model_family_is_refused_when_the_config_loads(recipe, trainer, words):
    with pytest.raises(ConfigError) as err:
        load_run_config(RECIPES / recipe, [f"--trainer={trainer}"])
    assert str(err.value).startswith("command line: trainer: ") and words in str(err.value)


def test_an_hrm_model_under_the_lm_trainer_is_refused_naming_the_file(tmp_path):
    data = json.loads((RECIPES / "hrm" / "recipes" / "sudoku_debug.json").read_text())
    data.pop("task")
    data["trainer"] = "lm"
    path = tmp_path / "hrm_lm.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert str(err.value) == (f"{path}: trainer: trainer 'lm' trains a language model (no ACT halting), not 'hrm', "
                              f"which trains with trainer 'hrm'")


@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(RECIPES)) for p in RECIPES.glob("*/recipes/*.json")))
def test_every_shipped_recipe_keeps_its_own_trainer(recipe):
    load_run_config(RECIPES / recipe)  # no shipped pairing of trainer and model is refused


def test_more_cpu_ranks_than_the_ram_holds_are_refused_before_any_rank_starts(capsys, monkeypatch):
    # `dstrain launch --nproc 64 tiny.json` on a 2-core, 23 GiB machine started 64 ranks: the plan's budget
    # (RAM / ranks) fitted the tiny model, and the kernel killed ranks for memory at the first step.
    from dstrain import cli
    monkeypatch.setattr(launcher, "detect_accelerator", lambda: "cpu")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    gib = 2**30
    real = launch_check.cpu_shortfall
    monkeypatch.setattr(launch_check, "cpu_shortfall",
                        lambda spec, remote, acc, torchrun=False: real(spec, remote, acc, torchrun, host_memory=16 * gib))
    code = cli.main(["launch", "--nproc", "64", str(TINY), "--dry-run"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_CONFIG and out == "" and err.count("\n") == 1
    assert err == ("dstrain: error: 64 CPU ranks on this machine need about 31.2 GiB of RAM before any model (about "
                   "0.5 GiB a rank: Python, torch, DeepSpeed) and it has 16.0 GiB: launch with --nproc 32 or fewer\n")


def test_cpu_ranks_are_judged_only_where_they_run_here():
    spec = launcher.LaunchSpec(recipe=str(TINY), nproc=4)  # more ranks than a 2-core machine's cores: allowed
    small = 4 * launch_check.CPU_RANK_BYTES
    assert launch_check.cpu_shortfall(spec, False, "cpu", host_memory=small) is None
    assert "launch with --nproc 3 or fewer" in launch_check.cpu_shortfall(spec, False, "cpu", host_memory=small - 1)
    assert launch_check.cpu_shortfall(spec, False, "cuda", host_memory=small - 1) is None  # GPUs: gpu_shortfall's
    assert launch_check.cpu_shortfall(spec, True, "cpu", host_memory=small - 1) is None  # ranks on other hosts
    picked = launcher.LaunchSpec(recipe=str(TINY), include="localhost:0,1,2,3")
    assert launch_check.cpu_shortfall(picked, False, "cpu", host_memory=1) is None  # the user picked the slots


@pytest.mark.parametrize("argv, words", [
    (["plan", str(TINY), "--world-size", "0"], "world size must be positive, got 0"),
    (["check-config", str(TINY), "--deepspeed.profile=zero2", "--world-size", "0"],
     "data-parallel world size must be a positive integer, got 0"),
])
def test_a_world_size_of_zero_is_refused_as_a_negative_one_is(argv, words, capsys):
    # `dstrain plan tiny.json --world-size 0` planned for 1 rank and `check-config` said "on 1 rank(s)":
    # 0 read as "not given", while -3 was refused.
    from dstrain import cli
    assert cli.main(argv) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert words in err and err.count("\n") == 1 and "rank(s)" not in out
