"""Fault-injection round 6. (The real 2-rank torchrun restart of a stopped job: ``tests/dist/test_faults6.py``.)

* **A plain ``srun dstrain train`` (or ``srun python -m dstrain.cli train``) without ``launch/slurm.sbatch``.**
  Before: MASTER_PORT, when not set, was 29500 for every job, so two jobs sharing a node collided (the second
  one's rank 0 could not listen; ranks of one job could join the other's store). After: the port is derived
  from SLURM_JOB_ID as ``slurm.sbatch`` derives it (``20000 + SLURM_JOB_ID % 20000``); a MASTER_PORT that is
  set still wins, and a port in use anyway is the one-line refusal of round 4.
* **Two runs on one ``output.dir`` from two hosts of a shared file system whose flocks are per client** (NFS
  mounted ``nolock`` or without ``lockd``, Lustre ``localflock``, FUSE). Before: the second host's flock
  succeeded, so both runs wrote one folder (interleaved metrics, each overwriting the other's checkpoints); a
  file system refusing flock (ENOLCK, ENOSYS) ended rank 0 with an ``OSError`` traceback. After: the holder
  rewrites ``PID HOST TIME`` in the lock file every 15 s (a heartbeat in its text: ``cp -r`` renews mtimes)
  and empties it when it ends normally; a lock file naming another host with a heartbeat younger than 2
  minutes refuses the folder, in ``dstrain launch``'s checks and in rank 0, naming the host, the
  heartbeat's age and what to do if that host is down (delete the lock file, or wait until it is stale); an
  older one (that host died) is taken over with a note naming the run it replaces. Without flock, the
  heartbeat and, on one host, the holder's process id decide.
* **``torchrun --max-restarts N`` whose ranks were stopped by a signal** (a scheduler's SIGTERM reaching the
  ranks, ``kill`` of a rank). The ranks saved and exited 128 + N, which torchrun's agent takes for a failure.
  Before: its restart continued this job's checkpoint (round 5) and trained on to the end, exit 0: the stop was
  silently undone, and a preempted job kept training until the scheduler's SIGKILL. After: rank 0 of a stopped
  torchrun job records the stop (``output.dir/stopped.json``, with the job's agents); the restarted ranks leave
  at once with the stop's status and one line naming the signal, the step, the saved checkpoint and
  ``--resume``. A run that takes the folder later (``--resume``, another job) removes the record.
* **``--resume`` from another working directory with a relative ``output.dir``** (the recipes' ``runs/...``; a
  job script that changed directory, a copy of the folder elsewhere). Before: "no complete checkpoint in
  runs/x/checkpoints: starting from step 0", a fresh run that looked like the intended folder. After: the line
  names the absolute folder it looked in and that a relative output.dir is read from the working directory.
* **``--resume`` on a folder holding two runs' checkpoints** (another run's copied in, newer). Before: refused
  for "another model", telling the user to resume with that model's section. After: the refusal also names the
  older checkpoint that holds this run's model and says to move the other run's checkpoints out.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dstrain import checkpoint as ckpt
from dstrain import elastic, run_lock
from dstrain.cli import _output_problem
from dstrain.config import RunFolderError, load_run_config
from dstrain.slurm import env_from_slurm
from dstrain.trainers import common

from tests.unit.conftest import RECIPE, REPO, tiny_checkpoint as _checkpoint
SLURM = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node07"}


# ---------------------------------------------------------------- (a) srun without slurm.sbatch

def test_srun_without_sbatch_gives_each_job_its_own_master_port():
    one = env_from_slurm({**SLURM, "SLURM_JOB_ID": "4711"})["MASTER_PORT"]
    two = env_from_slurm({**SLURM, "SLURM_JOB_ID": "4712"})["MASTER_PORT"]
    assert (one, two) == ("24711", "24712")  # as launch/slurm.sbatch exports it
    assert env_from_slurm({**SLURM, "SLURM_JOB_ID": "123456"})["MASTER_PORT"] == str(20000 + 123456 % 20000)
    assert env_from_slurm({**SLURM, "SLURM_JOB_ID": "4711", "MASTER_PORT": "31000"})["MASTER_PORT"] == "31000"
    sbatch = (REPO / "launch" / "slurm.sbatch").read_text()
    assert 'MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"' in sbatch  # one rule for both


# ---------------------------------------------------------------- (b) the run folder's lock on a shared file system

@pytest.fixture
def no_lock(monkeypatch):
    monkeypatch.setattr(run_lock, "_HELD", [])
    monkeypatch.setattr(run_lock, "CONFIRM_S", 0.2)  # (a stale lock is watched that long for a heartbeat)


def _lock_file(out: Path, pid_host: str, age_s: float) -> Path:
    """A lock file as a holder writes it, its last heartbeat ``age_s`` ago (the file's mtime: now, as after cp -r)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / run_lock.NAME
    path.write_text(f"{pid_host} {time.time() - age_s:014.1f}\n" if pid_host else "")
    return path


def test_a_live_run_on_another_host_is_refused_although_flock_is_granted(tmp_path, no_lock):
    out = tmp_path / "run"
    path = _lock_file(out, "4242 gpu-node-17", age_s=5)  # its flock lives on gpu-node-17's NFS client only
    before = path.read_text()
    problem = common._lock_run_folder(out)
    assert problem is not None and problem.startswith(
        f"output.dir {out} is in use by another run (process 4242 on gpu-node-17, heartbeat 5 s ago;")
    assert f"if gpu-node-17 is down: delete {path}, or start again once its heartbeat is 120 s old" in problem
    assert path.read_text() == before  # the holder's record is left alone
    cfg = SimpleNamespace(output=SimpleNamespace(dir=str(out)))
    assert _output_problem(cfg) == problem  # dstrain launch says it before any rank starts


def test_a_dead_hosts_stale_lock_is_taken_over_with_a_note(tmp_path, no_lock, capsys):
    out = tmp_path / "run"
    path = _lock_file(out, "4242 gpu-node-17", age_s=run_lock.STALE_S + 60)  # copied with cp -r: a new mtime
    assert common._lock_run_folder(out) is None
    assert path.read_text().startswith(f"{os.getpid()} {socket.gethostname()} ")
    err = capsys.readouterr().err
    assert f"dstrain: note: taking over output.dir {out} from process 4242 on gpu-node-17: no heartbeat" in err


def test_the_holder_keeps_its_heartbeat_and_clears_it_when_it_ends(tmp_path, no_lock, monkeypatch, capsys):
    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    out = tmp_path / "run"
    assert common._lock_run_folder(out) is None
    path = out / run_lock.NAME
    first = float(path.read_text().split()[2])
    time.sleep(0.3)
    assert float(path.read_text().split()[2]) > first
    handles = [handle for _, handle in run_lock._HELD]
    run_lock.release()  # (at exit) a run that ended normally: a copy of its folder is free at once
    assert path.read_text() == ""
    for handle in handles:
        handle.close()  # (the process ends: the kernel drops its flock)
    assert common._lock_run_folder(out) is None and "taking over" not in capsys.readouterr().err


def test_a_file_system_without_flock_is_not_a_traceback(tmp_path, no_lock, monkeypatch):
    def no_flock(_fd, _op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.05)  # (the read-back of a take without flock: test_faults8)
    out = tmp_path / "run"
    assert common._lock_run_folder(out) is None  # nobody holds it: taken
    monkeypatch.setattr(run_lock, "_HELD", [])
    # the same host, the holder alive (this process's parent stands in for it): the process id decides
    _lock_file(out, f"{os.getppid()} {socket.gethostname()}", age_s=0)
    assert f"in use by another run (process {os.getppid()} on {socket.gethostname()})" in common._lock_run_folder(out)
    _lock_file(out, f"{2 ** 22 + 12345} {socket.gethostname()}", age_s=0)  # no such process: free
    assert common._lock_run_folder(out) is None


# ---------------------------------------------------------------- (c) torchrun restarting ranks a signal stopped

def _stopped_first_attempt(out: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    elastic.gather_agents()
    tag = _checkpoint(out, 2, torchrun_agents=elastic.agents()).name
    elastic.note_stopped_job(out, 143, 2, tag)  # what rank 0 of the stopped attempt leaves (cli.cmd_train)


def test_a_torchrun_restart_of_a_stopped_job_leaves_with_the_stop(monkeypatch, tmp_path, one_rank):
    out = tmp_path / "run"
    _stopped_first_attempt(out, monkeypatch)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    cfg = load_run_config(RECIPE, [f"--output.dir={out}"])
    with pytest.raises(elastic.StoppedJobRestarted) as caught:
        common.decide_resume(cfg, one_rank, out, out / "checkpoints")
    assert caught.value.exit_code == 143
    assert str(caught.value) == (
        "torchrun restart 1: not training on: this job was stopped by SIGTERM at step 2 (checkpoint step_00000002 "
        "is saved), and torchrun --max-restarts restarts ranks that exit non-zero; each restart ends here "
        "(exit 143); to continue, start the job again with --resume")
    assert (out / elastic.STOPPED_NAME).exists()  # every further restart says the same


def test_a_resume_or_another_job_is_not_held_by_an_old_stop(monkeypatch, tmp_path, one_rank):
    out = tmp_path / "run"
    _stopped_first_attempt(out, monkeypatch)
    monkeypatch.setattr(elastic, "_AGENTS", [])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")  # the user's own --resume (dstrain launch, srun)
    cfg = load_run_config(RECIPE, [f"--output.dir={out}", "--checkpoint.resume=true"])
    assert common.decide_resume(cfg, one_rank, out, out / "checkpoints") == ckpt.tag_for(2)
    assert not (out / elastic.STOPPED_NAME).exists()
    assert elastic.stopped_job_problem(out, ["otherhost:1"]) is None


def test_only_a_torchrun_job_records_its_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "_AGENTS", [])
    elastic.note_stopped_job(tmp_path, 143, 2, "step_00000002")  # dstrain launch, srun: nothing restarts it
    assert not (tmp_path / elastic.STOPPED_NAME).exists()


# ---------------------------------------------------------------- a resume from another working directory

def test_a_resume_that_finds_nothing_names_where_it_looked(monkeypatch, tmp_path, one_rank, capsys):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    _checkpoint(tmp_path / "runs" / "a", 2)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the recipe's relative output.dir, the job started from another directory
    out = Path("runs/a")
    cfg = load_run_config(RECIPE, ["--output.dir=runs/a", "--checkpoint.resume=true"])
    assert common.decide_resume(cfg, one_rank, out, out / "checkpoints") is None
    assert (f"no complete checkpoint in runs/a/checkpoints ({elsewhere / 'runs/a/checkpoints'}: a relative "
            "output.dir is read from the working directory): starting from step 0") in capsys.readouterr().out


# ---------------------------------------------------------------- --resume on a folder holding two runs' checkpoints

def test_a_folder_mixing_two_runs_checkpoints_names_the_one_of_this_run(monkeypatch, tmp_path, one_rank):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    out = tmp_path / "run"
    _checkpoint(out, 4)  # this run's model
    other = _checkpoint(out, 9)  # another run's, copied in (a larger model): the newest
    config = json.loads((other / "run_config.json").read_text())
    config["model"]["overrides"] = {"n_layer": 3}
    (other / "run_config.json").write_text(json.dumps(config))
    cfg = load_run_config(RECIPE, [f"--output.dir={out}", "--checkpoint.resume=true"])
    with pytest.raises(RunFolderError) as caught:
        common.decide_resume(cfg, one_rank, out, out / "checkpoints")
    assert str(caught.value).startswith(f"checkpoint {other} holds model ")
    assert str(caught.value).endswith("(the folder mixes two runs' checkpoints: step_00000004 holds this run's model; "
                                      "move the other run's checkpoints out to resume from it)")
