"""Fault-injection round 5. (The real 2-rank torchrun restart: ``tests/dist/test_faults5.py``.)

* **``torchrun --max-restarts N`` (its own agent restarting the ranks), a rank dead mid-run.** Before: every
  restart failed twice over. torchrun's one-node (static) rendezvous keeps its agent's store across restarts
  and torch's env:// start reads it with no prefix per attempt, so the restarted rank 0 read the addresses
  its dead peers had published and could not connect (gloo ``Connection refused``, a traceback); and, with
  that fixed, the restarted ranks, started with the first attempt's command line (no ``--resume``), refused
  the folder for holding the checkpoint the first attempt wrote (exit 2). After: each attempt's process
  group has keys of its own (``runtime._restart_store``), and a restart continues the latest checkpoint
  when this torchrun job wrote it (``dstrain.elastic``); another job's checkpoint is refused as before.
* **A hostfile naming one machine twice under two names** (``node1`` and its IP, or ``node1.cluster``, or
  two ssh aliases of one HostName). Before: accepted (only identical names were refused): the launch started
  each entry's ranks on that machine, both with local ranks 0..slots-1, two ranks on every GPU. After:
  refused before anything starts, naming both entries, the address and the ssh port (entries on one
  address with different ssh ports, such as containers behind port forwarding, are distinct machines).
* **The machine crashes (power, kernel panic, a node rebooted) just after a save.** Before: only the
  ``COMPLETE`` marker was fsynced; DeepSpeed's shards, the random states and the metadata were still in the
  page cache, so the marker could reach the disk before them: after the reboot a checkpoint marked complete
  (taken as the latest) held empty or cut-short files. A write error the file system reports only at flush
  time (NFS, a quota: ENOSPC or EIO from fsync) went unseen and the checkpoint was marked complete. After:
  every file and folder of the checkpoint is synced before the marker, the marker's and ``latest``'s folders
  after them; an error at that point leaves no marker and is the usual one-line checkpoint write error,
  with the previous checkpoint kept as the latest.
* **A language-model run resumed with another global batch** (another number of ranks, micro_batch or
  grad_accum). Before: the data order was indexed by step x global batch, so step s + 1 started at sample
  s x new instead of s x old: halving the batch trained samples again, doubling it skipped some (a warning
  said so). After: checkpoints record the samples taken (``samples`` in ``trainer_state.json``; older ones
  count step x their batch) and the run continues there: no sample skipped or repeated; the warning names
  that position and keeps what still changes (the schedule's samples per step).
* **SIGTERM or Ctrl-C to a rank still waiting for its peers to join** (a peer that never started, a wrong
  MASTER_ADDR, more ranks asked than started: srun, torchrun or ranks started by hand). Before: the rank kept
  the signal for its trainer (``hold_stop_signals``), whose handler never runs while the wait is in native
  code: it ignored ``kill``, ``timeout`` and Ctrl-C and waited out the collective timeout (30 minutes). After:
  while it joins, a stop signal ends it at once (no peer trains without it, so nothing is lost); one that
  came earlier ends it before it joins, in one line, exit 128 + N.
* **RANK / WORLD_SIZE / MASTER_PORT / MASTER_ADDR that cannot start a job** (a port that is not a number or
  out of range, left in the shell or set by a script; RANK >= WORLD_SIZE; a master name no resolver knows).
  Before: torch's ``ValueError`` traceback, or (an unknown master name) ranks retrying for 30 minutes. After:
  one line naming the variable and the fix, exit 2, before the process group starts.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain import checkpoint as ckpt
from dstrain import elastic, runtime
from dstrain import hostfile as hf
from dstrain.launch_check import check_hosts_for_launch
from dstrain.launcher import LaunchSpec
from dstrain.rank_exit import CheckpointWriteError
from dstrain.config import LaunchError, RunFolderError, load_run_config
from dstrain.trainers import common

from tests.unit.conftest import RECIPE, REPO, tiny_checkpoint as _checkpoint


# ---------------------------------------------------------------- torchrun's own restarts

def test_a_torchrun_restart_continues_the_checkpoint_its_job_wrote(capsys, monkeypatch, tmp_path, one_rank):
    out = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    tag_dir = _checkpoint(out, 2, torchrun_agents=[elastic.agent_id()])
    cfg = load_run_config(RECIPE, [f"--output.dir={out}"])  # the first attempt's command line: no --resume
    assert common.decide_resume(cfg, one_rank, out, out / "checkpoints") == tag_dir.name
    assert f"torchrun restart 1: continuing this job's checkpoint {tag_dir.name}" in capsys.readouterr().out


@pytest.mark.parametrize("restart, written_by", [
    ("1", ["otherhost:1234"]),   # a restart of a first attempt refused for another job's checkpoint
    ("1", None),                 # a checkpoint from before, no torchrun agent recorded
    ("0", "this job"),           # the first attempt: a fresh run does not take a folder holding a checkpoint
])
def test_a_checkpoint_another_job_wrote_is_still_refused(monkeypatch, tmp_path, one_rank, restart, written_by):
    out = tmp_path / "run"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    agents = [elastic.agent_id()] if written_by == "this job" else written_by
    _checkpoint(out, 2, **({"torchrun_agents": agents} if agents else {}))
    with pytest.raises(RunFolderError, match="already holds checkpoint step_00000002; pass --resume"):
        common.decide_resume(load_run_config(RECIPE, [f"--output.dir={out}"]), one_rank, out, out / "checkpoints")


def test_checkpoints_of_a_torchrun_job_name_its_agent_and_others_name_none(monkeypatch, tmp_path, one_rank):
    plan = type("Plan", (), {"profile": "zero0", "precision": "fp32", "activation_checkpointing": False})()
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    elastic.gather_agents()
    assert "torchrun_agents" not in common._trainer_state(3, one_rank, plan, None)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    elastic.gather_agents()
    state = common._trainer_state(3, one_rank, plan, None)
    assert state["torchrun_agents"] == [elastic.agent_id()] and elastic.agent_id().split(":")[1] == str(os.getppid())


def test_each_torchrun_attempt_reads_only_its_own_keys_from_the_agents_store(monkeypatch):
    """The agent's store outlives the ranks; what attempt 0's ranks published must not reach attempt 1's."""
    from torch.distributed import TCPStore
    server = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    runtime._restart_store().set("rank_1", "127.0.0.1:32130")  # the dead attempt's peer address
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = runtime._restart_store()
    assert again.num_keys() >= 1 and not again.check(["rank_1"])
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE")
    assert runtime._restart_store() is None  # ranks of other launchers start as torch does


# ---------------------------------------------------------------- one machine under two names

def _resolver(table):
    return lambda host: hf.Resolved(host, *table[host]) if host in table else None


def test_a_hostfile_naming_one_machine_twice_is_refused_naming_both(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\n10.0.0.7 slots=2\n")
    table = {"node1": ("10.0.0.7", "DNS / hosts file", 22), "10.0.0.7": ("10.0.0.7", "DNS / hosts file", None)}
    spec = LaunchSpec("r.json", hostfile=str(path), nproc=2)
    with pytest.raises(hf.HostfileError) as info:
        check_hosts_for_launch(spec, reach=False, resolve=_resolver(table), local_hosts=["here"])
    assert str(info.value) == (f"hostfile {path}: hosts 'node1' and '10.0.0.7' are one machine (10.0.0.7, ssh port "
                               "22): each would start its ranks there, on the same GPUs; list it once, with the "
                               "slots it has")


def test_hosts_sharing_an_address_behind_other_ssh_ports_are_distinct_machines(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("box-a slots=1\nbox-b slots=1\n")
    table = {"box-a": ("10.0.0.7", "ssh config HostName 10.0.0.7", 2201),
             "box-b": ("10.0.0.7", "ssh config HostName 10.0.0.7", 2202)}
    check = check_hosts_for_launch(LaunchSpec("r.json", hostfile=str(path)), reach=False,
                                   resolve=_resolver(table), local_hosts=["here"])
    assert [h for h, _ in check.hosts] == ["box-a", "box-b"] and check.master_addr == "10.0.0.7"


# ---------------------------------------------------------------- durable before COMPLETE

def _written_checkpoint(root: Path, step: int) -> Path:
    tag_dir = root / ckpt.tag_for(step)
    (tag_dir / "rng").mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng/rank_0.pt"):
        (tag_dir / name).write_bytes(b"x" * 64)
    return tag_dir


def _mark(root: Path, step: int) -> None:
    ckpt.mark_complete(root, ckpt.tag_for(step), {"model": {}}, {"zero_optimization": {"stage": 1}},
                       {"step": step}, keep=2)


def test_every_file_of_a_checkpoint_is_on_disk_before_its_complete_marker(monkeypatch, tmp_path):
    root = tmp_path / "checkpoints"
    tag_dir = _written_checkpoint(root, 4)
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    _mark(root, 4)
    marker = next(i for i, p in enumerate(synced) if Path(p).name.startswith(ckpt.COMPLETE + ".tmp"))
    before = {Path(p) for p in synced[:marker]}
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng/rank_0.pt",
                 "trainer_state.json", "run_config.json", "ds_config.json", "rng"):
        assert (tag_dir / name).resolve() in before, name
    after = [Path(p) for p in synced[marker + 1:]]
    assert tag_dir.resolve() in after and root.resolve() in after  # the marker's and latest's names


def test_a_write_error_reported_at_flush_leaves_no_marker_and_keeps_the_previous_checkpoint(monkeypatch, tmp_path):
    root = tmp_path / "checkpoints"
    _written_checkpoint(root, 2)
    _mark(root, 2)
    tag_dir = _written_checkpoint(root, 4)
    real = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("optim_states.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointWriteError) as info:
        with common.writing(root, ckpt.tag_for(4)):
            _mark(root, 4)
    assert "checkpoint step_00000004 could not be written" in str(info.value)
    assert "no space left on device" in str(info.value) and "step_00000002 is intact" in str(info.value)
    assert not tag_dir.exists() and ckpt.find_latest(root) == ckpt.tag_for(2)
    assert (root / ckpt.LATEST).read_text() == "step_00000002\n"


def test_a_file_system_without_fsync_still_saves(monkeypatch, tmp_path):
    """A mount whose files refuse fsync (EINVAL, as some FUSE file systems answer) is not a failed write: the
    checkpoint is marked complete (the second review's finding: only the folders' fsync tolerated it)."""
    root = tmp_path / "checkpoints"
    _written_checkpoint(root, 4)

    def fsync(fd):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(os, "fsync", fsync)
    with common.writing(root, ckpt.tag_for(4)):
        _mark(root, 4)
    assert ckpt.find_latest(root) == ckpt.tag_for(4)


# ---------------------------------------------------------------- another global batch on resume

@pytest.mark.parametrize("saved_state", [{"step": 3, "samples": 24}, {"step": 3}])  # with, before, the record
def test_a_resume_with_another_global_batch_continues_at_the_sample_the_checkpoint_reached(
        capsys, monkeypatch, tmp_path, one_rank, saved_state):
    from dstrain.data.sampler import WindowSampler
    from dstrain.trainers import lm
    tag_dir = tmp_path / ckpt.tag_for(3)
    tag_dir.mkdir()
    (tag_dir / "ds_config.json").write_text(json.dumps({"train_batch_size": 8}))  # 2 ranks x micro 4 x accum 1
    trainer = lm.LMTrainer.__new__(lm.LMTrainer)
    trainer.cfg = load_run_config(RECIPE, ["--train.micro_batch=2", "--train.grad_accum=1"])
    trainer.world, trainer.dp_world, trainer.ckpt_root, trainer.engine = one_rank, 2, tmp_path, None
    trainer.plan = SimpleNamespace(ds_config={"train_batch_size": 4})  # now 2 ranks x micro 2: half the batch
    trainer.guards = SimpleNamespace(skipped=0, phase=lambda *args: None)
    trainer.data_start = (0, 0)
    monkeypatch.setattr(lm, "load_checkpoint", lambda *args: dict(saved_state))
    trainer._resume(tag_dir.name)

    order = WindowSampler(10_000, 8, 0)
    taken = [order.local_batch_indices(s, 4, 1, r, 2) for s in range(3) for r in range(2)]  # the first run
    taken += [order.local_batch_indices(s, 2, 1, r, 2, trainer.first_sample(s)) for s in range(3, 6) for r in range(2)]
    taken = torch.cat([t.flatten() for t in taken]).tolist()
    assert taken == order.global_indices(0, 36).tolist()  # samples 0..35 of the order, each once, in order
    assert "the data continues at sample 24, where the checkpoint's run stopped" in capsys.readouterr().err

    saved = []
    trainer.saver = SimpleNamespace(save=lambda step, state: saved.append(state))
    trainer.save(6)
    assert saved[0]["samples"] == 36 and len(saved) == 1  # what the next resume continues from


# ---------------------------------------------------------------- a stop while joining; the rank's variables

def test_a_stop_that_came_before_the_rank_joined_ends_it_in_one_line():
    code = ("import os, signal\nfrom dstrain import rank_exit\nrank_exit.hold_stop_signals()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\nwith rank_exit.stop_ends_joining():\n    print('joined')\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RANK": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "joined" not in proc.stdout
    assert proc.stderr == "dstrain: rank 1 stopped by SIGTERM before it joined the job (exit 143)\n"


def test_while_joining_a_stop_signal_has_its_default_action_and_the_trainers_hold_after(monkeypatch):
    from dstrain import rank_exit
    monkeypatch.setattr(rank_exit, "PENDING_STOP", [0])
    before = {sig: signal.getsignal(sig) for sig in rank_exit.STOP_SIGNALS}
    try:
        rank_exit.hold_stop_signals()
        held = signal.getsignal(signal.SIGTERM)
        with rank_exit.stop_ends_joining():
            assert all(signal.getsignal(sig) == signal.SIG_DFL for sig in rank_exit.STOP_SIGNALS)
        assert all(signal.getsignal(sig) is held for sig in rank_exit.STOP_SIGNALS)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_a_rank_waiting_for_a_master_that_never_comes_ends_on_sigterm(tmp_path):
    """The real wait: rank 1 of 2 in ``runtime.init_distributed``, nothing listening on MASTER_PORT."""
    from dstrain.launcher import find_free_port
    code = ("import sys\nfrom dstrain import rank_exit, runtime\nrank_exit.hold_stop_signals()\n"
            "print('joining', flush=True)\nruntime.init_distributed(timeout_s=90)\nprint('joined', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "RANK": "1", "LOCAL_RANK": "1",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        assert proc.stdout.readline() == "joining\n"
        time.sleep(3)  # inside torch's wait for the store
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        code = proc.wait(timeout=60)
        assert code in (-signal.SIGTERM, 128 + signal.SIGTERM) and time.monotonic() - start < 15  # (143: still starting)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("changes, says", [
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' in this rank's environment is not a whole number"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port (1-65535)"),
    ({"RANK": "2"}, "RANK=2 with WORLD_SIZE=2: a rank must be below the number of ranks"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='' in this rank's environment is not a whole number"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
    ({"MASTER_ADDR": "node-0.invalid"}, "MASTER_ADDR='node-0.invalid' does not resolve here"),
])
def test_rank_variables_that_cannot_start_a_job_are_named(changes, says):
    good = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    runtime.check_rank_env(good)
    runtime.check_rank_env({**good, "RANK": "0", "MASTER_ADDR": "node-0.invalid"})  # rank 0 listens: not looked up
    with pytest.raises(LaunchError) as info:
        runtime.check_rank_env({**good, **changes}, resolve_wait_s=0)  # (not waited for: the second review's DNS wait)
    assert says in str(info.value)


def test_a_bad_master_port_in_a_ranks_shell_is_one_line_and_exit_2(capfd, monkeypatch, tmp_path):
    from dstrain import cli
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "abc"}.items():  # MASTER_PORT: left over from another job's script
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    code = cli.main(["train", RECIPE, f"--output.dir={tmp_path / 'run'}", "--train.steps=1"])
    err = capfd.readouterr().err
    assert code == 2 and "dstrain: error: MASTER_PORT='abc' in this rank's environment is not a whole number" in err
    assert "Traceback" not in err
