"""HRM run configs: the task section is typed and checked; shipped recipes validate; eval helper."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dstrain import trainers
from dstrain.config import ConfigError, load_run_config, run_config_from_dict
from dstrain.data import sudoku
from dstrain.trainers.hrm_config import HRMTaskConfig
from models import registry

ROOT = Path(__file__).resolve().parents[2]
DEBUG = ROOT / "models" / "hrm" / "recipes" / "sudoku_debug.json"


def test_trainer_registered_with_its_task_config():
    assert "hrm" in trainers.available()
    assert trainers.task_config_class("hrm") is HRMTaskConfig


@pytest.mark.parametrize("recipe", sorted((ROOT / "models" / "hrm" / "recipes").glob("*.json")))
def test_shipped_recipes_validate(recipe):
    cfg = load_run_config(recipe)
    task = trainers.task_config(cfg)
    assert cfg.trainer == "hrm" and isinstance(task, HRMTaskConfig)
    assert task.global_batch % 2 == 0


@pytest.mark.parametrize("override, key, message", [
    ("--task.source=web", "task.source", "source must be generate or file"),
    ("--task.blanks=70", "task.blanks", "blanks must be within"),
    ("--task.puzzle_ids=each", "task.puzzle_ids", "puzzle_ids must be shared or group"),
    ("--task.train_puzzle=3", "task.train_puzzle", "did you mean 'train_puzzles'"),
    ("--task.mask_givens=1", "task.mask_givens", "expected true or false"),
    ("--task.global_batch=-4", "task.global_batch", "global_batch must not be negative"),
    ("--task.grid=5", "task.grid", "grid must be 4, 6 or 9"),
    ("--task.data_workers=4", "task.data_workers", "data_workers must be -1"),
])
def test_bad_task_settings_name_the_key(override, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config(DEBUG, [override])
    assert err.value.key == key


def test_file_source_needs_a_file():
    data = json.loads(DEBUG.read_text())
    data["task"]["source"] = "file"
    with pytest.raises(ConfigError, match="train_file must name a puzzle file"):
        run_config_from_dict(data, "recipe")


@pytest.mark.parametrize("text, key, message", [
    (None, "task.train_file", "no such puzzle file"),
    ("", "task.train_file", "no puzzles read"),
    ("0001 12345 7.1\n", "task.train_file", r":1: no 81-character puzzle field"),
])
def test_a_bad_puzzle_file_is_a_config_error_naming_the_file(tmp_path, text, key, message):
    """What `dstrain train` prints as one line (not a traceback): the key, the file and the line."""
    from dstrain.trainers.hrm import load_sudoku
    path = tmp_path / "puzzles.txt"
    if text is not None:
        path.write_text(text)
    task = HRMTaskConfig(source="file", train_file=str(path))
    with pytest.raises(ConfigError, match=message) as err:
        load_sudoku(task, seed=0)
    assert err.value.key == key and str(path) in str(err.value)


def test_evaluate_rows_runs_every_puzzle_to_the_step_limit():
    from dstrain.trainers.hrm import evaluate_rows, summarise
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": 3})
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(cfg)
    inputs, labels = sudoku.encode(*sudoku.generate_many(5, 4, seed=0), mask_givens=True)
    stats = evaluate_rows(model, 3, inputs, labels, batch=2)
    assert stats["steps"] == 3.0 and 0.0 <= stats["exact_accuracy"] <= 1.0 and stats["loss"] > 0
    assert summarise({"rows": 4, "count": 2, "exact_accuracy": 1, "lm_loss": 8}) == \
        {"exact_accuracy": 0.5, "lm_loss": 2.0, "halted_fraction": 0.5}
    assert not model.training and np.isfinite(stats["accuracy"])


def test_grid_size_bounds_blanks_and_needs_generated_puzzles():
    with pytest.raises(ConfigError, match=r"blanks must be within \[0, 12\] \(a unique 4x4"):
        load_run_config(DEBUG, ["--task.grid=4", "--task.blanks=13"])
    assert load_run_config(DEBUG, ["--task.grid=6", "--task.blanks=28"]) is not None
    data = json.loads(DEBUG.read_text())
    data["task"].update(source="file", train_file="puzzles.txt", grid=6)
    with pytest.raises(ConfigError, match="grid must be 9 when task.source is file"):
        run_config_from_dict(data, "recipe")


def test_evaluate_rows_runs_as_many_batches_on_every_rank():
    """7 puzzles on 3 ranks, batch 2: rank 0 holds 3 rows (2 batches), ranks 1 and 2 hold 2 (1 batch). Under
    ZeRO-3 every forward is a collective, so each rank runs 2 batches; the extra one's metrics are dropped."""
    from dstrain.trainers.hrm import evaluate_rows
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": 2})
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(cfg)
    inputs, labels = sudoku.encode(*sudoku.generate_many(7, 4, seed=0), mask_givens=True)
    calls = []
    forward = model.forward

    def counted(*args, **kwargs):
        calls.append(len(args[0]))
        return forward(*args, **kwargs)

    model.forward = counted
    per_rank = []
    for rank in range(3):
        calls.clear()
        stats = evaluate_rows(model, 2, inputs, labels, batch=2, rank=rank, world_size=3)
        per_rank.append(list(calls))
        assert stats["steps"] == 2.0
    assert per_rank == [[2, 2, 1, 1]] * 3  # 2 batches x 2 segments on every rank (rows per forward)
    alone = evaluate_rows(model, 2, inputs[1::3], labels[1::3], batch=2)
    again = evaluate_rows(model, 2, inputs, labels, batch=2, rank=1, world_size=3)
    assert alone == again  # the extra batch changes nothing that is reported
