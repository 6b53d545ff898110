"""Newcomer audit, round 3: what a first user reads on the console after following the README."""
import json
from pathlib import Path

import pytest

from dstrain.config import load_run_config
from dstrain.engine.factory import plan_engine
from dstrain.engine.profiles import Hardware
from dstrain.trainers.common import pin_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


def cpu():
    return Hardware(device_type="cpu", device_memory=16 * 10**9, host_memory=32 * 10**9, ranks_per_node=2,
                    bf16_supported_fast=False, fp16_supported=False, name="cpu")


def checkpoint(tmp_path, profile="zero2"):
    tag = tmp_path / "step_00000005"
    tag.mkdir()
    (tag / "trainer_state.json").write_text(json.dumps(
        {"step": 5, "profile": profile, "precision": "fp32", "activation_checkpointing": False}))
    return tmp_path, tag.name


def test_resumed_auto_run_says_the_profile_is_the_checkpoints_not_named_in_the_config(tmp_path):
    # `dstrain launch ... --resume` of a run that left deepspeed.profile at auto: the plan used to say
    # "profile zero2: named in the run config", which the user never did.
    cfg = load_run_config(TINY)
    assert cfg.deepspeed.profile == "auto"
    root, tag = checkpoint(tmp_path)
    pin_plan(cfg, root, tag)
    assert cfg.deepspeed.profile == "zero2"
    text = plan_engine(cfg, world_size=2, hw=cpu()).explanation
    assert "named in the run config" not in text and "the run names a profile" not in text
    assert f"profile zero2: kept from the checkpoint resumed, {root / tag}" in text
    assert "the checkpoint resumed sets a profile" in text
    assert "pinned_from" not in json.dumps(cfg.to_dict())  # never saved into run_config.json


def test_profile_named_by_the_user_is_still_reported_as_named(tmp_path):
    cfg = load_run_config(TINY, ["--deepspeed.profile=zero2"])
    root, tag = checkpoint(tmp_path)
    pin_plan(cfg, root, tag)
    text = plan_engine(cfg, world_size=2, hw=cpu()).explanation
    assert "profile zero2: named in the run config" in text and "kept from the checkpoint" not in text


def test_missing_hrm_puzzle_file_is_named_before_any_rank_starts(capsys):
    # sudoku_extreme.json reads ../shared/data/...: without it the launch used to start the ranks,
    # whose failure DeepSpeed's launcher reported again with its own [ERROR] line.
    from dstrain.cli import main
    recipe = str(ROOT / "models" / "hrm" / "recipes" / "sudoku_extreme.json")
    assert main(["launch", "--nproc", "1", recipe, "--task.train_file=nope/puzzles.txt", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "task.train_file: task file not found: nope/puzzles.txt (relative paths are read from" in err
    assert "--task.train_file=FILE" in err and err.count("\n") == 1


def test_check_config_notes_a_missing_task_file_and_still_validates(capsys, monkeypatch):
    monkeypatch.delenv("DSTRAIN_DATA_DIR", raising=False)  # (where it holds mbpp.jsonl, the line names that file)
    from dstrain.cli import main
    recipe = str(ROOT / "models" / "policy" / "recipes" / "grpo_mbpp_cpu.json")
    assert main(["check-config", recipe, "--task.path=nope/mbpp.jsonl"]) == 0
    out, err = capsys.readouterr()
    assert "valid run config" in out
    assert "dstrain: note: run config: task.path: task file not found: nope/mbpp.jsonl" in err
    assert "--task.path=FILE" in err


def test_missing_task_file_message_says_where_and_how(monkeypatch):
    monkeypatch.delenv("DSTRAIN_DATA_DIR", raising=False)  # (where it holds mbpp.jsonl, the line names that file)
    from dstrain.data.tasks import missing_task_file
    assert missing_task_file("/abs/mbpp.jsonl") == "task file not found: /abs/mbpp.jsonl; name the file with --task.path=FILE"
    assert f"relative paths are read from {Path.cwd()}" in missing_task_file("../x.jsonl", "eval_path")
    assert missing_task_file("../x.jsonl", "eval_path").endswith("--task.eval_path=FILE")


def test_slurm_script_run_by_hand_says_to_submit_it():
    import os
    import subprocess
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "models/gpt/recipes/tiny.json"],
                          env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "SLURM_JOB_ID is not set: submit it with sbatch" in done.stderr and "unbound variable" not in done.stderr


def test_resume_of_another_models_checkpoint_is_refused_before_any_rank_starts(tmp_path, capsys):
    # `--resume --model.size=small` on a tiny run's folder: rank 0 refused it, but only after DeepSpeed
    # had started the ranks (and then added its own [ERROR] line).
    from dstrain.cli import main
    from dstrain.config import load_run_config
    tag = tmp_path / "checkpoints" / "step_00000005"
    tag.mkdir(parents=True)
    (tag / "trainer_state.json").write_text(json.dumps({"step": 5}))
    (tag / "run_config.json").write_text(json.dumps(load_run_config(TINY).to_dict()))
    (tag / "COMPLETE").write_text("")
    # CPU ranks: on a machine with fewer than 2 GPUs, --nproc 2 would be refused before the resume check
    argv = ["launch", "--nproc", "2", "--accelerator", "cpu", str(TINY), f"--output.dir={tmp_path}", "--dry-run",
            "--resume"]
    assert main([*argv, "--model.size=small"]) == 2
    err = capsys.readouterr().err
    assert "holds model" in err and '"size": "small"' in err and err.count("\n") == 1
    assert main(argv) == 0  # the checkpoint's own model: the dry run goes on


def test_grpo_learning_benchmark_ends_with_one_line_when_a_run_fails(tmp_path, monkeypatch, capsys):
    # A missing MBPP file: the launch said so in one line, then the benchmark's CalledProcessError
    # traceback buried it.
    import importlib.util
    import subprocess
    spec = importlib.util.spec_from_file_location("grpo_learning_bench", ROOT / "benchmarks" / "grpo_learning.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2))
    with pytest.raises(SystemExit) as stop:
        bench.run("models/policy/recipes/grpo_mbpp_cpu.json", tmp_path / "grpo", None, 2, 2, [])
    assert stop.value.code == 2
    assert "grpo_learning: the grpo run failed (dstrain launch exit status 2)" in capsys.readouterr().err


def _run_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text(json.dumps({"task": {}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 2.0}) + "\n")
    return run


def test_hrm_report_names_a_run_folder_without_metrics(tmp_path, capsys):
    from models.hrm import report
    run = _run_folder(tmp_path)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(SystemExit) as stop:
        report.main([str(run), "--out", str(tmp_path / "r")])
    assert stop.value.code == 2 and "no metrics.jsonl there" in capsys.readouterr().err


def test_hrm_report_names_a_missing_puzzle_file_in_one_line(tmp_path, capsys):
    # models/hrm/README.md's `--puzzles ../shared/data/...` from another folder ended in a traceback.
    from models.hrm import report
    with pytest.raises(SystemExit) as stop:
        report.main([str(_run_folder(tmp_path)), "--out", str(tmp_path / "r"), "--puzzles", "nope/puzzles.txt"])
    assert stop.value.code == 2
    assert "--puzzles nope/puzzles.txt: no such puzzle file (relative paths are read from" in capsys.readouterr().err


def test_hrm_report_refuses_puzzles_of_another_grid_size(tmp_path, monkeypatch, capsys):
    # 9x9 puzzles against a 6x6 run: the model's forward raised "inputs must be [B, 36]" with a traceback.
    from types import SimpleNamespace

    from models.hrm import report
    puzzles = tmp_path / "nine.txt"
    puzzles.write_text("0001d2888928 200050006010000090600801003007090600000703000900080002100000005060902010003060200  7.1\n")
    mcfg = SimpleNamespace(seq_len=36, halt_max_steps=2)
    monkeypatch.setattr(report, "load_checkpoint_model", lambda run, weights: (None, mcfg, {"task": {}}, None, "t", "ema"))
    with pytest.raises(SystemExit) as stop:
        report.main([str(_run_folder(tmp_path)), "--out", str(tmp_path / "r"), "--puzzles", str(puzzles)])
    assert stop.value.code == 2
    assert "puzzles of 81 cells, but the run's model reads 36 (a 6x6 grid)" in capsys.readouterr().err


@pytest.mark.parametrize("override, words", [
    ("--model.args.n_layerz=3", "unknown config key 'n_layerz'"),
    ("--model.args.n_layer=abc", "expected int"),
    ("--model.args.n_layer=0", "n_layer must be positive"),
])
def test_a_bad_model_args_override_names_the_command_line_not_the_recipe(override, words):
    # It used to say "models/gpt/recipes/tiny.json: model.args: ...", blaming a file that has no such key.
    from dstrain.config import ConfigError
    with pytest.raises(ConfigError) as err:
        load_run_config(TINY, [override])
    assert str(err.value).startswith(f"command line: {override[2:].split('=')[0]}: ") and words in str(err.value)
