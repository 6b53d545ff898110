"""Multi-node launches as a user on a small cluster runs them, round 2 (found with the pretend hosts of
tests/multinode by hand; here with fakes): ``--nproc 1`` / DeepSpeed's ``--num_gpus 1`` on hosts with more slots,
variables a user adds to dstrain's ``.deepspeed_env``, a Ctrl-C that returned before the other hosts' ranks had
saved, and which hosts a rank killed by a signal ran on."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from dstrain import launch_check, launcher, run_lock
from tests.unit import test_cli_launch as cli_launch
from tests.unit.test_cli_launch import MARKER, RECIPE, FakeChild, launch, words

# test_cli_launch's fixtures: a clean environment and cwd, two hosts that resolve and answer ssh (no ssh run)
_clean_env, reachable, two_hosts = cli_launch._clean_env, cli_launch.reachable, cli_launch.two_hosts


# --------------------------------------------------------------------------- --nproc 1 on hosts of 2 slots


@pytest.mark.parametrize("flag", ["--nproc", "--num_gpus", "--num-gpus"])
def test_one_rank_per_host_written_out_is_kept(capsys, two_hosts, flag, monkeypatch):
    """Before: --nproc 1 was the default's value, read as "every slot" (2 ranks on each 2-slot host), and
    DeepSpeed's --num_gpus was an unknown flag that swallowed the recipe."""
    monkeypatch.setattr("subprocess.Popen", FakeChild)
    code, out, _ = launch(capsys, "--dry-run", "--hostfile", two_hosts, flag, "1", "--accelerator", "cpu", RECIPE)
    assert code == 0
    argv = words(out)
    assert argv[argv.index("--num_gpus") + 1] == "1" and argv[argv.index("--hostfile") + 1] == two_hosts
    code, out, _ = launch(capsys, "--dry-run", "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 0 and "--num_gpus" not in words(out)  # unset: every slot, as before


def test_world_size_of_one_rank_per_host(two_hosts):
    given = launcher.LaunchSpec(RECIPE, hostfile=two_hosts, nproc=1, nproc_given=True)
    every_slot = launcher.LaunchSpec(RECIPE, hostfile=two_hosts)
    assert launcher.launch_world_size(given, local_hosts=()) == (2, 1)
    assert launcher.launch_world_size(every_slot, local_hosts=()) == (4, 2)
    # torchrun: one agent per host, --nproc-per-node as written
    argv, _ = launcher.build_torchrun_command(given, base_env={}, detect=lambda: "cpu", local_hosts=())
    assert argv[argv.index("--nproc-per-node") + 1] == "1"


# --------------------------------------------------------------------------- .deepspeed_env: the user's lines


def test_user_lines_survive_the_rewrite():
    old = f"{MARKER}\nDSTRAIN_OLD=1\nMY_FLAG=1\nNCCL_IB_HCA=mlx5_0\nOMP_NUM_THREADS=7\nnot a line\n"
    new = "DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\n"
    # dstrain's own names come from the shell each launch (a stale DSTRAIN_OLD goes); the new value wins
    assert launcher.user_env_lines(old, new) == ["MY_FLAG=1", "NCCL_IB_HCA=mlx5_0"]


def test_launch_keeps_a_variable_added_to_its_deepspeed_env(capsys, monkeypatch, two_hosts):
    """Before: every launch rewrote the file from the shell alone, so MY_FLAG never reached the other hosts."""
    monkeypatch.setattr("subprocess.Popen", FakeChild)
    Path(".deepspeed_env").write_text(f"{MARKER}\nDS_ACCELERATOR=cuda\nMY_FLAG=1\n")
    code, _, err = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 3  # the child's status
    lines = Path(".deepspeed_env").read_text().splitlines()
    assert lines[0] == MARKER and "MY_FLAG=1" in lines and "DS_ACCELERATOR=cpu" in lines
    assert "DS_ACCELERATOR=cuda" not in lines and "MY_FLAG=1" in err


# --------------------------------------------------------------------------- a stop of a multi-host job


def test_wait_for_remote_save_returns_once_rank_0_lets_go(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert run_lock.take(out) is None  # as rank 0 holds it while it saves
    timer = threading.Timer(0.6, run_lock.release)
    timer.start()
    try:
        assert launch_check.wait_for_remote_save(out, 10.0) is None
    finally:
        timer.cancel()
        run_lock.release()
    assert run_lock.probe(out) is None


def test_wait_for_remote_save_gives_up_after_the_limit(tmp_path):
    now = [0.0]
    held = launch_check.wait_for_remote_save(tmp_path, 2.0, probe=lambda out: "in use by process 7 on h1",
                                             sleep=lambda s: now.__setitem__(0, now[0] + s), clock=lambda: now[0])
    assert held == "in use by process 7 on h1" and now[0] == 2.0


class StoppedChild(FakeChild):
    """A job whose launcher got the user's Ctrl-C (pdsh runner: it leaves, the other hosts' ranks still save)."""

    def wait(self):
        os.kill(os.getpid(), signal.SIGINT)
        return 1


def test_ctrl_c_of_a_multi_host_job_waits_for_the_save_and_names_the_checkpoint(capsys, monkeypatch, two_hosts,
                                                                                  tmp_path):
    """Before: 130 at once, with no word of a checkpoint (pdsh, which carried rank 0's stop line, was gone)."""
    monkeypatch.setattr("subprocess.Popen", StoppedChild)
    waited = []
    monkeypatch.setattr(launch_check, "wait_for_remote_save", lambda out, limit: waited.append((out, limit)))
    monkeypatch.setattr("dstrain.runtime.release_job_comm_buffers", lambda port: None)
    out = tmp_path / "run"
    code, _, err = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE, f"--output.dir={out}")
    assert code == 128 + signal.SIGINT
    assert waited and waited[0][0] == out
    assert err.splitlines()[-1] == (f"dstrain: stopped by SIGINT; the ranks on every host have left; latest complete "
                                    f"checkpoint: none yet in {out / 'checkpoints'} (--resume continues from it)")


class KilledChild(FakeChild):
    def wait(self):
        return 256 - 9  # DeepSpeed's runner: pdsh -S, the largest of the hosts' statuses


def test_a_rank_killed_on_another_host_names_the_hosts(capsys, monkeypatch, two_hosts):
    monkeypatch.setattr("subprocess.Popen", KilledChild)
    monkeypatch.setattr("dstrain.runtime.release_job_comm_buffers", lambda port: None)
    code, _, err = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 137
    assert err.splitlines()[-1].startswith("dstrain: a rank on one of worker-0, worker-1 (the 'pdsh@... HOST: ssh "
                                           "exited with exit code 247' line above names it) was killed by signal 9")

