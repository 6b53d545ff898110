"""Run config: JSON -> dataclasses, dotted overrides, one-line errors naming file and key."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.config import ConfigError, load_run_config, run_config_from_dict

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


def write(tmp_path, data, name="r.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_recipe_loads_with_typed_sections():
    cfg = load_run_config(TINY)
    assert cfg.model.name == "gpt" and cfg.model.size == "tiny"
    assert isinstance(cfg.train.lr, float) and cfg.train.steps == 300
    assert cfg.deepspeed.profile == "auto"


def test_overrides_win_over_file_and_are_typed(tmp_path):
    path = write(tmp_path, {"train": {"lr": 0.1, "steps": 10}})
    cfg = load_run_config(path, ["--train.lr=3e-4", "--model.size=small", "--train.betas=[0.8,0.9]",
                                 "--model.args.n_layer=2", "--output.tensorboard=false"])
    assert cfg.train.lr == 3e-4 and cfg.train.steps == 10
    assert cfg.model.size == "small" and cfg.model.args == {"n_layer": 2}
    assert cfg.train.betas == (0.8, 0.9) and cfg.output.tensorboard is False
    # an int is accepted where a float is expected, and kept as float
    assert isinstance(load_run_config(path, ["--train.lr=1"]).train.lr, float)


@pytest.mark.parametrize("data, overrides, source, key, words", [
    ({"trian": {}}, [], "file", "trian", "did you mean 'train'"),
    ({"train": {"lrr": 1}}, [], "file", "train.lrr", "did you mean 'lr'"),
    ({"train": {"steps": "ten"}}, [], "file", "train.steps", "expected an integer"),
    ({"train": {"steps": True}}, [], "file", "train.steps", "expected an integer"),
    ({"train": {"lr": "fast"}}, [], "file", "train.lr", "expected a number"),
    ({"train": {"steps": 0}}, [], "file", "train.steps", "at least 1"),
    ({"train": {"lr": -1}}, [], "file", "train.lr", "must not be negative"),
    ({"train": {"betas": [0.9, 1.5]}}, [], "file", "train.betas", "[0, 1)"),
    ({"deepspeed": {"profile": "zero9"}}, [], "file", "deepspeed.profile", "zero2"),
    ({"deepspeed": {"precision": "fp8"}}, [], "file", "deepspeed.precision", "auto, fp32"),
    ({"deepspeed": {"device_memory": "lots"}}, [], "file", "deepspeed.device_memory", "lots"),
    ({"model": {"name": "gpt5"}}, [], "file", "model.name", "available: dilated_lm, gpt"),
    ({"model": {"size": "huge"}}, [], "file", "model.size", "tiny"),
    ({"model": {"args": {"n_head": 3}}}, [], "file", "model.args", "divisible"),
    ({"data": {"seq_len": 4096}}, [], "file", "data.seq_len", "block_size"),
    ({"deepspeed": {"zero_init": True}, "parallel": {"sp": 2}}, [], "file", "deepspeed.zero_init",
     "tensor and sequence parallelism"),
    ({}, ["--train.lr=abc"], "command line", "train.lr", "expected a number"),
    ({}, ["--train.nope=1"], "command line", "train.nope", "unknown key"),
    ({}, ["--nosection=1"], "command line", "nosection", "section"),
    ({}, ["--train.steps=-5"], "command line", "train.steps", "at least 1"),
])
def test_errors_name_source_and_key(tmp_path, data, overrides, source, key, words):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_run_config(path, overrides)
    msg = str(err.value)
    assert "\n" not in msg
    assert err.value.key == key
    assert msg.startswith(str(path) if source == "file" else "command line")
    assert words in msg


def test_bad_json_names_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"train": {"lr": 1e-3,}}')
    with pytest.raises(ConfigError, match=r"bad.json: invalid JSON at line 1"):
        load_run_config(path)


def test_resolved_config_round_trips():
    cfg = load_run_config(TINY, ["--train.lr=5e-4"])
    again = run_config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize("command", ["train", "plan", "launch"])
def test_cli_exits_2_with_one_line_and_writes_nothing(tmp_path, command):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dstrain.cli", command, str(TINY), "--train.lr=abc",
                           f"--output.dir={out}"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines == ["dstrain: error: command line: train.lr: expected a number, got \"abc\""]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_check_config_on_run_config_and_ds_json(tmp_path, capsys):
    from dstrain.cli import main
    assert main(["check-config", str(TINY)]) == 0
    assert "valid run config" in capsys.readouterr().out
    assert main(["check-config", str(ROOT / "ds_configs" / "zero3_offload.json")]) == 0
    assert "ZeRO stage 3, offload optimizer and param" in capsys.readouterr().out
    bad = write(tmp_path, {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
                           "zero_optimisation": {}})
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "zero_optimisation" in err and "offload_param" in err


def test_override_without_equals_sign_is_named(capsys):
    """`--train.steps 5` (a space for the "=") said only "unrecognized arguments: 5"."""
    from dstrain.cli import main
    assert main(["plan", str(TINY), "--train.steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "--train.steps 5: overrides look like --section.key=value (--train.steps=5)" in err
    assert err.count("\n") == 1
    assert main(["check-config", str(ROOT / "ds_configs" / "zero3.json"), "--train.lr=1e-3"]) == 2
    assert "overrides apply to a run config" in capsys.readouterr().err



def test_launch_names_a_missing_task_file_before_any_rank_starts(capsys):
    """A mistyped task.path was found only on the ranks, after DeepSpeed had started them."""
    from dstrain.cli import main
    recipe = str(ROOT / "models" / "policy" / "recipes" / "grpo_debug.json")
    assert main(["launch", "--nproc", "2", recipe, "--task.source=mbpp", "--task.path=data/nope.jsonl",
                 "--dry-run"]) == 2
    assert "task.path: task file not found: data/nope.jsonl" in capsys.readouterr().err


def test_fault_policies_and_background_saves_reach_every_trainer():
    from dstrain.config import ConfigError, load_run_config
    for recipe in ("models/gpt/recipes/tiny.json", "models/hrm/recipes/sudoku_debug.json",
                   "models/policy/recipes/grpo_debug.json", "models/policy/recipes/score_debug.json"):
        cfg = load_run_config(recipe, ["--train.nonfinite=skip", "--checkpoint.async_write=true"])
        assert cfg.train.nonfinite == "skip" and cfg.checkpoint.async_write
    assert load_run_config("models/gpt/recipes/tiny.json", ["--train.nonfinite=off"]).train.nonfinite == "off"
    with pytest.raises(ConfigError, match="train.nonfinite: must be stop, skip or off, got 'ignore'"):
        load_run_config("models/gpt/recipes/tiny.json", ["--train.nonfinite=ignore"])
    assert load_run_config("models/gpt/recipes/tiny.json",
                           ["--parallel.pp=2", "--checkpoint.async_write=true"]).checkpoint.async_write
