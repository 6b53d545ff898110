"""Fault-injection round 4: a checkpoint missing a whole kind of file, a resume on another model-parallel layout,
a master port another process holds.

* **Every optimizer-state file of the newest checkpoint gone** (deleted to save space, or a one-rank run's single
  ZeRO shard lost), **or its model-states file gone.** Before: the shard check compared the shard counts of the
  kinds still present, so a kind with no file left passed; ``dstrain launch --resume`` started the ranks, they
  rewrote ``run_config.json`` and ``plan.txt`` and failed in DeepSpeed's load ("could not be loaded", without
  naming the checkpoint to fall back to). After: refused before any rank starts, naming the missing files and
  the complete checkpoint before.
* **A resume with another pipeline (or tensor) parallel degree** (``--parallel.pp=1`` on a pp=2 checkpoint, same
  number of ranks). Before: not checked unless the world size also changed; DeepSpeed's load failed on a missing
  layer file or a shape, and the error told the user to remove the checkpoint. After: refused before any rank
  starts, naming the degree to resume with. ``parallel.pp = "auto"`` in a checkpoint's run config (which a
  resume on another world size compared with ``int()``: a ValueError traceback) is read from its files.
* **``--master-port`` that another process listens on.** Before: the ranks started and rank 0 died in torch's
  TCPStore with a 30-line traceback (exit 1); the other ranks connected to whatever listened there. After:
  ``dstrain launch`` refuses it in one line before starting anything (exit 2), and a rank started by other means
  (srun, torchrun, by hand) says the same in one line.
* **A run folder locked by a run on another machine** (a shared file system): the refusal named a process id
  only; it now names the host too (``tests/unit/test_run_folder.py``).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch

from dstrain import checkpoint as ckpt
from dstrain import cli, launcher
from dstrain.config import load_run_config
from dstrain.trainers import common

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")


def _checkpoint(root: Path, step: int, model: dict, stage: int, parallel: dict | None = None,
                files: tuple[str, ...] = ()) -> Path:
    """A complete one-rank checkpoint holding DeepSpeed's files for ``stage`` (or ``files``)."""
    tag = ckpt.tag_for(step)
    where = root / tag
    (where / "rng").mkdir(parents=True)
    files = files or (("zero_pp_rank_0_mp_rank_00_model_states.pt",) if stage == 3 else
                      ("mp_rank_00_model_states.pt",)) + (("zero_pp_rank_0_mp_rank_00_optim_states.pt",)
                                                          if stage else ())
    for name in files:
        torch.save({"w": torch.ones(4)}, where / name)
    torch.save({"torch": torch.get_rng_state()}, where / "rng" / "rank_0.pt")
    ckpt.mark_complete(root, tag, {"model": model, "parallel": parallel or {}},
                       {"zero_optimization": {"stage": stage}}, {"step": step, "world_size": 1}, keep=5)
    return where


@pytest.mark.parametrize("stage, gone, named", [
    (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt",
     "zero_pp_rank_*_mp_rank_00_optim_states.pt (the ZeRO-2 optimizer state) missing"),
    (1, "mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt (the model's weights) missing"),
    (3, "zero_pp_rank_0_mp_rank_00_model_states.pt",
     "zero_pp_rank_*_mp_rank_00_model_states.pt (the model's weights) missing"),
    (3, "zero_pp_rank_0_mp_rank_00_optim_states.pt",
     "zero_pp_rank_*_mp_rank_00_optim_states.pt (the ZeRO-3 optimizer state) missing"),
])
def test_a_kind_of_file_gone_entirely_is_refused_naming_the_checkpoint_before(tmp_path, stage, gone, named):
    cfg = load_run_config(RECIPE)
    model = cfg.to_dict()["model"]
    _checkpoint(tmp_path, 4, model, stage)
    where = _checkpoint(tmp_path, 8, model, stage)
    assert common._resume_problem(cfg, tmp_path, "step_00000008") is None
    (where / gone).unlink()
    assert common._resume_problem(cfg, tmp_path, "step_00000008") == (
        f"checkpoint {where} is damaged ({named}); remove it (or its COMPLETE file) to resume from the one before "
        "(step_00000004), or choose another output.dir")


def test_a_checkpoint_without_any_deepspeed_file_is_left_to_the_loader(tmp_path):
    """Only JSON (the metadata other tests build): nothing here says which files the stage wrote."""
    (tmp_path / "ds_config.json").write_text('{"zero_optimization": {"stage": 2}}')
    assert ckpt.files_problem(tmp_path) is None
    torch.save({}, tmp_path / "mp_rank_00_model_states.pt")  # ZeRO-0 (no ds_config.json): one file is all
    (tmp_path / "ds_config.json").unlink()
    assert ckpt.files_problem(tmp_path) is None


def test_launch_refuses_a_checkpoint_without_its_optimizer_state_before_any_rank_starts(capsys, monkeypatch,
                                                                                        tmp_path):
    model = load_run_config(RECIPE).to_dict()["model"]
    root = tmp_path / "run" / "checkpoints"
    _checkpoint(root, 4, model, 2)
    where = _checkpoint(root, 8, model, 2)
    (where / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    started = []
    monkeypatch.setattr(launcher, "build_torchrun_command", lambda spec, **kw: started.append(spec) or (
        [sys.executable, "-c", "open('ranks_started', 'w')"], dict(os.environ)))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["launch", "--launcher", "torchrun", RECIPE, f"--output.dir={tmp_path / 'run'}", "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "ranks_started").exists(), err
    assert "optimizer state) missing); remove it (or its COMPLETE file) to resume from the one before " \
           "(step_00000004)" in err
    assert not (tmp_path / "run" / "plan.txt").exists()


def _pipeline_checkpoint(root: Path, model: dict, pp_in_config) -> Path:
    files = ("layer_00-model_states.pt", "layer_01-model_states.pt", "mp_rank_00_model_states.pt",
             "mp_rank_01_model_states.pt")
    return _checkpoint(root, 8, model, 0, parallel={"tp": 1, "sp": 1, "pp": pp_in_config}, files=files)


@pytest.mark.parametrize("pp_in_config", [2, "auto"])
def test_a_resume_on_another_pipeline_degree_is_refused_naming_the_checkpoints(tmp_path, pp_in_config):
    cfg = load_run_config(RECIPE, ["--parallel.pp=1"])
    where = _pipeline_checkpoint(tmp_path, cfg.to_dict()["model"], pp_in_config)
    assert common._resume_problem(cfg, tmp_path, where.name) == (
        f"checkpoint {where} was written with parallel.pp=2, this run has parallel.tp=1, parallel.pp=1: only the "
        "data-parallel size may change on resume; resume with --parallel.pp=2, or export its weights (dstrain "
        "export) to start a new run with another layout")
    for same in ("--parallel.pp=2", "--parallel.pp=auto"):  # auto: the checkpoint's stages (dstrain.trainers.lm)
        assert common._resume_problem(load_run_config(RECIPE, [same]), tmp_path, where.name) is None


def test_a_resume_on_another_tensor_parallel_degree_is_refused(tmp_path):
    cfg = load_run_config(RECIPE)
    cfg.parallel.tp = 1  # (a model with tensor-parallel layers: dilated_lm)
    where = _checkpoint(tmp_path, 8, cfg.to_dict()["model"], 0, parallel={"tp": 2, "sp": 1, "pp": 1},
                        files=("mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"))
    assert "written with parallel.tp=2, this run has parallel.tp=1, parallel.pp=1: only the data-parallel size " \
           "may change on resume; resume with --parallel.tp=2," in common._resume_problem(cfg, tmp_path, where.name)
    cfg.parallel.tp = 2
    assert common._resume_problem(cfg, tmp_path, where.name) is None


def test_a_world_size_change_reads_an_auto_pipeline_degree_from_the_files(tmp_path):
    """``reshard.check_layout`` (a resume on another number of ranks) did ``int("auto")``: a traceback."""
    from dstrain import reshard
    where = _pipeline_checkpoint(tmp_path, {}, "auto")
    saved = json.loads((where / "run_config.json").read_text())
    reshard.check_layout(saved, {"tp": 1, "sp": 1, "pp": 2}, where.name, where)
    with pytest.raises(reshard.ReshardError, match="written with tp=1 sp=1 pp=2, this run has tp=1 sp=1 pp=1"):
        reshard.check_layout(saved, {"tp": 1, "sp": 1, "pp": 1}, where.name, where)


# ---------------------------------------------------------------- a master port another process holds

@pytest.fixture
def held_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_master_port_in_use_here_is_named_and_a_free_or_remote_one_passes(held_port):
    from dstrain.launch_check import master_port_problem
    assert master_port_problem(None, held_port) == (
        f"master port {held_port} is in use on this machine (127.0.0.1): another process listens there (a job "
        "still running, or another server); pass --master-port with a free port (on one node, leave it unset to "
        "get one)")
    assert master_port_problem("127.0.0.1", launcher.find_free_port()) is None
    assert master_port_problem("192.0.2.7", held_port) is None  # (TEST-NET-1) another host's port is its own


def test_launch_refuses_a_master_port_in_use_before_any_rank_starts(capsys, monkeypatch, tmp_path, held_port):
    monkeypatch.setattr(launcher, "build_deepspeed_command", lambda spec, **kw: (
        [sys.executable, "-c", "open('ranks_started', 'w')"], dict(os.environ)))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["launch", "--nproc", "2", "--master-port", str(held_port), RECIPE,
                     f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "ranks_started").exists()
    assert err.strip() == f"dstrain: error: master port {held_port} is in use on this machine (127.0.0.1): " \
                          "another process listens there (a job still running, or another server); pass " \
                          "--master-port with a free port (on one node, leave it unset to get one)"


def test_a_rank_whose_store_cannot_listen_says_so_in_one_line(capsys, monkeypatch, tmp_path):
    """Ranks started by srun, torchrun or by hand skip ``dstrain launch``'s check: rank 0 meets the port in
    torch's TCPStore."""
    import deepspeed
    import torch.distributed as dist

    from dstrain import runtime
    from dstrain.config import LaunchError

    def taken(**kwargs):
        raise dist.DistNetworkError("The server socket has failed to listen on any local network address. port: "
                                    "29611, useIpv6: false, code: -98, name: EADDRINUSE, message: address already "
                                    "in use")
    monkeypatch.setattr(deepspeed, "init_distributed", taken)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for var, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29611"}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(LaunchError, match=r"^MASTER_PORT 29611 is in use on 127.0.0.1 \(another job's store"):
        runtime.init_distributed()
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False, raising=False)
    code = cli.main(["train", RECIPE, f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("dstrain: error: MASTER_PORT 29611 is in use"), err


# ---------------------------------------------------------------- the launcher between dstrain launch and the ranks dies

FAKE_RANK = """
import os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["FAKE_OUT"])
def stop(signum, frame):
    time.sleep(0.5)  # saving its checkpoint
    (out / "saved").write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
(out / "rank_pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""

KILLED_LAUNCHER = """
import os, pathlib, signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-m", "dstrain.cli", "train", "recipe.json"],
                 env={{**os.environ, "PYTHONPATH": {fake!r}}}, cwd={fake!r})  # (-m looks in cwd first)
while not (pathlib.Path(os.environ["FAKE_OUT"]) / "rank_pid").exists():
    time.sleep(0.05)
os.kill(os.getpid(), signal.SIGKILL)  # DeepSpeed's launch.py (or torchrun's agent) killed outright
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_ranks_whose_launcher_was_killed_are_stopped_not_orphaned(capfd, tmp_path):
    """Before: the guard passed the launcher's status on at once (DeepSpeed's runner exits 0 when its launch.py is
    killed) and ``dstrain launch`` returned while the ranks, reparented to init, trained on unattended."""
    from dstrain import job_guard, rank_exit
    fake = tmp_path / "fake"
    (fake / "dstrain").mkdir(parents=True)
    (fake / "dstrain" / "__init__.py").write_text("")
    (fake / "dstrain" / "cli.py").write_text(FAKE_RANK)  # argv: python -m dstrain.cli train recipe.json
    failures = tmp_path / "failures"
    failures.mkdir()
    (failures / rank_exit.STOPPED_FILE).write_text("143\n")  # as the rank's stop would leave it
    env = {**os.environ, "FAKE_OUT": str(tmp_path), "PYTHONPATH": str(REPO), "DSTRAIN_FAILURE_DIR": str(failures)}
    proc = job_guard.start_job([sys.executable, "-c", KILLED_LAUNCHER.format(fake=str(fake))], env)
    rank = None
    try:
        code = proc.wait(timeout=20)
        rank = int((tmp_path / "rank_pid").read_text())
        assert code == 128 + signal.SIGKILL  # a failure, which --max-restarts restarts; not a user's stop
        assert (tmp_path / "saved").read_text() == str(int(signal.SIGTERM))  # it saved and left
        assert not _alive(rank)
        assert not (failures / rank_exit.STOPPED_FILE).exists()
        assert f"dstrain: the launcher (python) ended (status -9) while 1 rank(s) on this host still ran (pids {rank})" \
            in capfd.readouterr().err
    finally:
        if rank is not None and _alive(rank):
            os.kill(rank, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
