"""What a run checks about its output folder before it plans or writes anything: another run using it,
a damaged or foreign checkpoint, a ZeRO stage the checkpoint cannot be loaded under, a folder that is a file."""
import json
import socket
import subprocess
import sys
from types import SimpleNamespace

from dstrain.config import load_run_config
from dstrain.trainers import common

RECIPE = "models/gpt/recipes/tiny.json"


def test_a_folder_in_use_by_another_process_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from dstrain.trainers import common\n"
        f"assert common._lock_run_folder(Path({str(tmp_path)!r})) is None\n"
        "print('locked', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        problem = common._lock_run_folder(tmp_path)
        assert problem == (f"output.dir {tmp_path} is in use by another run (process {holder.pid} on "
                           f"{socket.gethostname()}); wait for it or choose another output.dir")
    finally:
        holder.kill()
        holder.wait()
    assert common._lock_run_folder(tmp_path) is None  # the kernel released the dead holder's lock
    assert common._lock_run_folder(tmp_path) is None  # and this process may take it again


def _checkpoint(root, tag, model: dict, stage: int, state: str | None = None):
    where = root / tag
    where.mkdir(parents=True)
    (where / "run_config.json").write_text(json.dumps({"model": model}))
    (where / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    (where / "trainer_state.json").write_text(state if state is not None else json.dumps({"step": 10}))


def test_resume_refuses_a_damaged_or_foreign_checkpoint(tmp_path):
    cfg = load_run_config(RECIPE)
    mine = cfg.to_dict()["model"]
    _checkpoint(tmp_path, "good", mine, 0)
    assert common._resume_problem(cfg, tmp_path, "good") is None
    _checkpoint(tmp_path, "garbled", mine, 0, state="garbage{{{")
    problem = common._resume_problem(cfg, tmp_path, "garbled")
    assert problem.startswith(f"checkpoint {tmp_path / 'garbled'} is damaged (JSONDecodeError")
    assert "remove it (or its COMPLETE file) to resume from the one before" in problem
    other = {**mine, "args": {**mine.get("args", {}), "n_layer": 2}}
    _checkpoint(tmp_path, "other", other, 0)
    assert "this run builds" in common._resume_problem(cfg, tmp_path, "other")


def test_resume_under_a_stage_that_cannot_load_the_checkpoint_is_refused(tmp_path):
    _checkpoint(tmp_path, "z2", {}, 2)
    zero = lambda stage: {"zero_optimization": {"stage": stage}}  # noqa: E731
    assert common.stage_problem(tmp_path, "z2", zero(2)) is None
    assert common.stage_problem(tmp_path, "z2", zero(1)) is None  # stages 1 and 2 save the same state
    assert "written at ZeRO stage 2, this run plans stage 3" in common.stage_problem(tmp_path, "z2", zero(3))
    assert common.stage_problem(tmp_path, "z2", {}) is not None  # stage 0


def test_output_dir_that_is_a_file_is_refused_before_launch(tmp_path):
    from dstrain.cli import _output_problem
    path = tmp_path / "afile"
    path.write_text("")
    assert _output_problem(SimpleNamespace(output=SimpleNamespace(dir=str(path)))) == \
        f"output.dir {path}: is a file, not a folder"
    assert _output_problem(SimpleNamespace(output=SimpleNamespace(dir=str(tmp_path / "new" / "run")))) is None


def test_a_folder_holding_a_checkpoint_is_refused_before_launch_unless_resumed(tmp_path):
    from dstrain.cli import _output_problem
    tag = tmp_path / "checkpoints" / "step_00000300"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text("{}")
    cfg = SimpleNamespace(output=SimpleNamespace(dir=str(tmp_path)), to_dict=lambda: {"model": {"name": "gpt"}})
    assert _output_problem(cfg) == (f"{tmp_path} already holds checkpoint step_00000300; pass --resume to "
                                    "continue it or choose another output.dir")
    assert "is damaged" in _output_problem(cfg, resume=True)  # no trainer_state.json: rank 0 would refuse it
    (tag / "trainer_state.json").write_text('{"step": 300}')
    (tag / "run_config.json").write_text('{"model": {"name": "gpt"}}')
    assert _output_problem(cfg, resume=True) is None


def test_a_warm_start_path_is_not_another_model(tmp_path):
    """GRPO and SCoRe record the warm start they loaded as model.args.path; a resumed run has not set it yet."""
    cfg = load_run_config(RECIPE)
    mine = cfg.to_dict()["model"]
    _checkpoint(tmp_path, "warm", {**mine, "args": {**mine.get("args", {}), "path": str(tmp_path / "warm_start")}}, 0)
    assert common._resume_problem(cfg, tmp_path, "warm") is None


def test_a_folder_in_use_is_refused_before_launch(tmp_path):
    from dstrain.cli import _output_problem
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time; from pathlib import Path; from dstrain.trainers import common\n"
        f"assert common._lock_run_folder(Path({str(tmp_path)!r})) is None\n"
        "print('locked', flush=True); time.sleep(60)")], stdout=subprocess.PIPE, text=True)
    cfg = SimpleNamespace(output=SimpleNamespace(dir=str(tmp_path)))
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _output_problem(cfg, resume=True) == (f"output.dir {tmp_path} is in use by another run (process "
                                                     f"{holder.pid} on {socket.gethostname()}); wait for it or "
                                                     "choose another output.dir")
    finally:
        holder.kill()
        holder.wait()
    assert _output_problem(cfg, resume=True) is None


def _loading(tmp_path, error):
    """``common.load_checkpoint`` of a checkpoint whose ``engine.load`` raises ``error``."""
    import torch

    from dstrain.runtime import World
    _checkpoint(tmp_path, "step_00000010", {}, 0, state=json.dumps({"step": 10, "world_size": 1}))

    class Engine:
        def load(self, root, tag):
            raise error
    return lambda: common.load_checkpoint(Engine(), tmp_path, "step_00000010", World(0, 1, 0, 1, torch.device("cpu")))


def test_a_checkpoint_cut_short_is_refused_as_damaged(tmp_path):
    import pytest
    from dstrain.config import RunFolderError
    with pytest.raises(RunFolderError, match="could not be loaded .*remove it"):
        _loading(tmp_path, RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central "
                                        "directory"))()


def test_a_gpu_or_nccl_failure_while_loading_is_not_blamed_on_the_checkpoint(tmp_path):
    """torch's CUDA out-of-memory, accelerator and NCCL errors are RuntimeErrors: resuming on a GPU that runs
    short of memory must show that error, not tell the user to remove a good checkpoint."""
    import pytest
    import torch
    import torch.distributed as dist
    for error in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                  dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp, unhandled cuda error")):
        with pytest.raises(type(error), match="CUDA|NCCL"):
            _loading(tmp_path / type(error).__name__, error)()


def test_resume_with_another_global_batch_names_what_changes(tmp_path, capsys):
    """The data order is step x global batch: resuming step 10 of 16 samples per step with 8 (or 32) moves the
    data position, and the steps of the LR schedule no longer mean the same number of samples."""
    where = tmp_path / "step_00000010"
    assert common.batch_change_message(where, 10, 300, 16, 16) is None
    fewer = common.batch_change_message(where, 10, 300, 16, 8)
    assert fewer == (
        f"resuming {where} with a global batch of 8 samples per step where it was trained with 16 (micro_batch x "
        "grad_accum x data-parallel ranks): the data order is indexed by step x global batch, so step 11 starts "
        "at sample 80, not 160 (samples 80..159 are trained on again); the learning-rate schedule counts steps "
        "(warm-up, decay to train.steps=300), so its remaining 290 steps now take 0.5x the samples each, and "
        "train.lr is not rescaled. To continue the same run, keep micro_batch x grad_accum x data-parallel "
        "ranks = 16")
    more = common.batch_change_message(where, 10, 300, 16, 32)
    assert "step 11 starts at sample 320, not 160 (samples 160..319 of the order are skipped)" in more
    assert "take 2x the samples each" in more
    for rank in (1, 0):  # rank 0 says it, once
        common.warn_batch_change(SimpleNamespace(is_main=rank == 0), where, 10, 300, 16, 8)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"dstrain: warning: {fewer}"]
    common.warn_batch_change(SimpleNamespace(is_main=True), where, 10, 300, None, 8)  # an old checkpoint: no figure
    assert capsys.readouterr().err == ""


def test_hrm_resume_refuses_another_carry_layout(tmp_path):
    """HRM's checkpoint holds each rank's ACT carry (puzzles mid-way): another global batch or number of ranks
    cannot take it over, and is refused before anything is loaded."""
    import pytest

    from dstrain.config import RunFolderError
    from dstrain.trainers.hrm import HRMTrainer
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / "trainer_state.json").write_text(
        json.dumps({"step": 10, "global_batch": 8, "world_size": 2}))
    same = SimpleNamespace(ckpt_root=tmp_path, global_batch=8, world=SimpleNamespace(world_size=2))
    HRMTrainer._check_carry_layout(same, "step_00000010")
    other = SimpleNamespace(ckpt_root=tmp_path, global_batch=16, world=SimpleNamespace(world_size=4))
    with pytest.raises(RunFolderError, match=r"holds the ACT carry of 8 puzzles over 2 rank\(s\) .* this run has 16 "
                                             r"over 4: resume with task.global_batch=8 on 2 rank\(s\)"):
        HRMTrainer._check_carry_layout(other, "step_00000010")
