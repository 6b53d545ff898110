"""Fault-injection round 2: what ``dstrain launch`` returns and leaves when the job ends badly.

* The first rank to fail with a reason of its own (a checkpoint the disk cannot hold: 4, a non-finite
  stop: 3, a refusal: 2, a hang: 124) leaves its status for ``dstrain launch``: DeepSpeed's launcher
  reports whichever rank it polls first, often the peer that merely lost contact (exit 1), which
  ``--max-restarts`` restarted (a full disk, three more times).
* A ``dstrain launch`` killed outright (SIGKILL) stops its job instead of leaving it training unattended.
"""
from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dstrain import cli, launcher, rank_exit, resilience
from dstrain.rank_exit import CheckpointWriteError

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.setattr(resilience, "STOP_REQUESTED", [False])
    for var in ("RANK", "WORLD_SIZE", "DSTRAIN_FAILURE_DIR", "DS_ENV_FILE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)


def fake_build(script: str, calls: list):
    def build(spec, **kwargs):
        calls.append(spec)
        return [sys.executable, "-c", script], dict(os.environ)
    return build


@pytest.mark.parametrize("launcher_name", ["deepspeed", "torchrun"])
def test_launch_returns_the_first_failing_ranks_status_and_does_not_restart_it(capsys, monkeypatch, tmp_path,
                                                                               launcher_name):
    """Rank 0 could not write its checkpoint (4); its peer, left waiting in a barrier, exited 1 and the launcher
    in between reported that. Before: exit 1, restarted twice (each retry fails at the same save)."""
    monkeypatch.chdir(tmp_path)
    script = ("import os, pathlib, sys; pathlib.Path(os.environ['DSTRAIN_FAILURE_DIR'], 'failed').write_text('4');"
              " sys.exit(1)")
    attempts = []
    name = "build_torchrun_command" if launcher_name == "torchrun" else "build_deepspeed_command"
    monkeypatch.setattr(launcher, name, fake_build(script, attempts))
    # CPU ranks, as the real builders' environment says (on a one-GPU machine 2 CUDA ranks are refused before the
    # job starts); the fake builder hands this environment on
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    code = cli.main(["launch", "--launcher", launcher_name, "--nproc", "2", "--max-restarts", "2", RECIPE,
                     f"--output.dir={tmp_path / 'run'}"])
    assert code == rank_exit.EXIT_CHECKPOINT_WRITE
    assert len(attempts) == 1 and "restart" not in capsys.readouterr().err


def test_a_job_without_a_rank_reason_keeps_the_launchers_status(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    attempts = []
    monkeypatch.setattr(launcher, "build_torchrun_command", fake_build("import sys; sys.exit(1)", attempts))
    code = cli.main(["launch", "--launcher", "torchrun", "--max-restarts", "1", RECIPE,
                     f"--output.dir={tmp_path / 'run'}"])
    assert code == 1 and len(attempts) == 2  # a crash: restarted


class FullDiskTrainer:
    def train(self, cfg):
        raise CheckpointWriteError("checkpoint step_00000004 could not be written to x: no space left on device")


def test_the_rank_that_reports_a_full_disk_leaves_its_status_and_a_peer_cannot_overwrite_it(capsys, monkeypatch,
                                                                                           tmp_path):
    from dstrain import trainers
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(trainers, "get_trainer", lambda name: FullDiskTrainer())
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    code = cli.main(["train", RECIPE, f"--output.dir={tmp_path / 'run'}", "--train.steps=10",
                     "--deepspeed.profile=zero1"])
    assert code == 4 and "no space left on device" in capsys.readouterr().err
    assert rank_exit.failed_code(tmp_path) == 4
    rank_exit.note_failed(124)  # a later failure does not replace the first one's reason
    assert rank_exit.failed_code(tmp_path) == 4


def test_the_watchdog_leaves_the_hang_status_for_the_launch(monkeypatch, tmp_path):
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    codes = []
    dog = resilience.Watchdog(rank=1, timeout_s=0.2, exit=codes.append, out=io.StringIO())
    dog.phase("backward", 7)
    deadline = time.monotonic() + 5
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.close()
    assert codes == [resilience.EXIT_HANG] and rank_exit.failed_code(tmp_path) == resilience.EXIT_HANG


# ---------------------------------------------------------------- dstrain launch killed outright

JOB = """
import os, pathlib, signal, sys, time
out = pathlib.Path({out!r})
def stop(signum, frame):
    time.sleep(0.5)  # (saving)
    (out / "stopped").write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
(out / "job_pid").write_text(str(os.getpid()))
while True:
    time.sleep(0.1)
"""

LAUNCH = """
import sys
from dstrain import cli, launcher
def build(spec, **kwargs):
    import os
    return [sys.executable, "-c", {job!r}], dict(os.environ)
launcher.build_torchrun_command = build
sys.exit(cli.main(["launch", "--launcher", "torchrun", {recipe!r}, "--output.dir=" + {run!r}]))
"""


def _wait_for(path: Path, limit_s: float) -> bool:
    end = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.1)
    return path.exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_launch_killed_outright_stops_its_job_instead_of_orphaning_it(tmp_path):
    """Before: the job (its own session) trained on after ``kill -9`` of ``dstrain launch``, unattended."""
    script = LAUNCH.format(job=textwrap.dedent(JOB.format(out=str(tmp_path))), recipe=RECIPE,
                           run=str(tmp_path / "run"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    launch = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    job_pid = None
    try:
        assert _wait_for(tmp_path / "job_pid", 60), launch.stderr.read().decode() if launch.poll() else "no job"
        job_pid = int((tmp_path / "job_pid").read_text())
        launch.kill()
        launch.wait()
        assert _wait_for(tmp_path / "stopped", 20), "the job was left running after its launch was killed"
        assert (tmp_path / "stopped").read_text() == str(int(signal.SIGTERM))  # a stop: the ranks save and leave
        end = time.monotonic() + 10
        while _alive(job_pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _alive(job_pid)
    finally:
        if job_pid is not None and _alive(job_pid):
            os.kill(job_pid, signal.SIGKILL)
        if launch.poll() is None:
            launch.kill()
        launch.stderr.close()


# ---------------------------------------------------------------- a damaged checkpoint, seen before anything starts

def _zero2_checkpoint(root: Path, step: int, model: dict, world_size: int = 2) -> Path:
    import torch

    from dstrain import checkpoint as ckpt
    tag = ckpt.tag_for(step)
    where = root / tag
    (where / "rng").mkdir(parents=True)
    torch.save({"module": torch.ones(4)}, where / "mp_rank_00_model_states.pt")
    for rank in range(world_size):
        torch.save({"state": torch.zeros(64)}, where / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        torch.save({"torch": torch.get_rng_state()}, where / "rng" / f"rank_{rank}.pt")
    ckpt.mark_complete(root, tag, {"model": model}, {"zero_optimization": {"stage": 2}},
                       {"step": step, "world_size": world_size}, keep=5)
    return where


@pytest.mark.parametrize("damage, named", [
    (lambda where: (where / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
     "zero_pp_rank_1_mp_rank_00_optim_states.pt missing"),
    (lambda where: os.truncate(where / "zero_pp_rank_0_mp_rank_00_optim_states.pt", 100),
     "zero_pp_rank_0_mp_rank_00_optim_states.pt is unreadable or cut short"),
    (lambda where: os.truncate(where / "mp_rank_00_model_states.pt", 0),
     "mp_rank_00_model_states.pt is unreadable or cut short"),
    (lambda where: (where / "rng" / "rank_1.pt").unlink(), "rng/rank_1.pt missing"),  # was reseeded: not exact
])
def test_a_shard_missing_or_cut_short_is_refused_naming_it_and_the_checkpoint_to_fall_back_to(tmp_path, damage,
                                                                                            named):
    """Before, only the JSON files were checked: the ranks started, rewrote run_config.json and plan.txt, and
    failed in DeepSpeed's load (or, without a rank's random state, resumed silently reseeded)."""
    from dstrain.config import load_run_config
    from dstrain.trainers import common
    cfg = load_run_config(RECIPE)
    model = cfg.to_dict()["model"]
    _zero2_checkpoint(tmp_path, 4, model)
    where = _zero2_checkpoint(tmp_path, 8, model)
    assert common._resume_problem(cfg, tmp_path, "step_00000008") is None
    damage(where)
    problem = common._resume_problem(cfg, tmp_path, "step_00000008")
    assert problem == (f"checkpoint {where} is damaged ({named}" + problem.split(named, 1)[1])
    assert problem.endswith("); remove it (or its COMPLETE file) to resume from the one before (step_00000004), "
                            "or choose another output.dir")


def test_a_damaged_latest_checkpoint_is_refused_by_launch_before_any_rank_starts(capsys, monkeypatch, tmp_path):
    from dstrain.config import load_run_config
    model = load_run_config(RECIPE).to_dict()["model"]
    where = _zero2_checkpoint(tmp_path / "run" / "checkpoints", 8, model)
    os.truncate(where / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 10)
    monkeypatch.setattr(launcher, "build_torchrun_command", fake_build("open('ranks_started', 'w')", []))
    monkeypatch.chdir(tmp_path)
    code = cli.main(["launch", "--launcher", "torchrun", RECIPE, f"--output.dir={tmp_path / 'run'}", "--resume"])
    assert code == 2 and not (tmp_path / "ranks_started").exists()
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt is unreadable or cut short" in capsys.readouterr().err


# ---------------------------------------------------------------- a rank frozen (SIGSTOP): its peer names it

def test_the_hang_line_names_the_peer_that_went_silent(monkeypatch, tmp_path):
    """A rank stopped with SIGSTOP cannot run its own watchdog: its peer's fires, and the line named only the
    peer (`rank 0 waited 15s in backward`), not the rank that was stuck."""
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    beats = tmp_path / "heartbeat"
    beats.mkdir()
    then = time.time() - 40
    (beats / "rank_1").write_text(f"forward 131 {then - 1:.3f}\n")
    os.utime(beats / "rank_1", (then, then))
    (beats / "rank_2").write_text(f"allreduce 131 {time.time():.3f}\n")  # fresh, entered after: not named
    codes, out = [], io.StringIO()
    dog = resilience.Watchdog(rank=0, timeout_s=0.3, exit=codes.append, out=out)
    dog.phase("backward", 131)
    deadline = time.monotonic() + 5
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.close()
    line = out.getvalue().strip()
    assert codes == [resilience.EXIT_HANG] and "\n" not in line
    assert re.search(r"hang: rank 0 waited \d+s in backward of step 131", line), line  # (\d+: a loaded machine)
    assert re.search(r"; rank 1 silent for 4\ds \(last in forward of step 131: stopped or dead\); ending this rank",
                     line), line
    assert "rank 2" not in line
    assert (beats / "rank_0").read_text().startswith("backward 131 ")  # its own heartbeat, for the others


def test_a_peer_still_busy_in_its_phase_is_named_with_how_long(tmp_path):
    now = time.time()
    (tmp_path / "rank_3").write_text(f"forward 7 {now - 50:.3f}\n")
    assert resilience.stuck_peers(str(tmp_path), 0, now - 20, 5.0, now=now) == "; rank 3 in forward of step 7 for 50s"
    assert resilience.stuck_peers(str(tmp_path), 3, now - 20, 5.0, now=now) == ""  # itself
    assert resilience.stuck_peers(str(tmp_path / "absent"), 0, now, 5.0) == ""


def test_a_checkpoint_in_torchs_legacy_format_is_not_called_damaged(tmp_path):
    """``checkpoint_serialization: false`` (tests/configs) saves plain pickles, which have no zip directory to check."""
    import torch

    from dstrain.checkpoint import files_problem
    torch.save({"w": torch.ones(2)}, tmp_path / "mp_rank_00_model_states.pt", _use_new_zipfile_serialization=False)
    assert files_problem(tmp_path) is None
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert "mp_rank_00_model_states.pt is unreadable or cut short" in files_problem(tmp_path)
