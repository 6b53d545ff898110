"""Fault-injection round 10: multi-host launches (``dstrain launch --hostfile``, DeepSpeed's pdsh runner, torchrun
agents) on a machine or a network not set up for them. Each case was run by hand on two pretend hosts
(tests/multinode/hosts.py: an sshd per loopback address, pdsh over ssh); every test here runs in this process
(no rank, no ssh, no network).

* **pdsh missing on the launching machine** (a fresh node, a container with ssh but not pdsh). DeepSpeed's
  multi-host runner starts every host's ranks through ``pdsh``. Before: dstrain's checks passed, it printed the
  command, wrote ``.deepspeed_env`` and started DeepSpeed, which stopped with a traceback (``RuntimeError:
  launcher 'pdsh' not installed.``) and exit 1, a failure ``--max-restarts`` restarted. After: refused before
  anything starts, exit 2, in one line naming pdsh, how to install it, and ``--launcher torchrun`` (which needs
  no pdsh). ``--dry-run`` still shows the plan.
* **ssh that wants a person** (a host whose key is not in ``known_hosts``, a host that accepts none of our keys
  and would ask for a password). Already one line, exit 2, no hang (the check runs ssh with ``BatchMode``), but
  the line ended "--no-ssh-check skips this check", the wrong fix: without the check pdsh's ssh meets the same
  refusal, DeepSpeed's own check then fails with its traceback. After: the line names the fix, ``ssh HOST true``
  once (or ``ssh-keyscan``) for a host key, ``ssh-keygen -R`` for a changed one, ``ssh-copy-id HOST`` for a
  refused key; other failures (connection refused, a timeout) keep the skip hint.
* **torchrun on a machine whose hostfile name resolves to loopback** (Debian and Ubuntu put
  ``127.0.1.1 HOSTNAME`` in /etc/hosts) while the other hosts are elsewhere. dstrain passes this machine's
  resolved entry as ``--local-addr``, and the agent that becomes rendezvous rank 0 hands its local address to
  every rank as MASTER_ADDR (torch's ``RendezvousStoreInfo``). Before: ``--local-addr 127.0.1.1``: the ranks of
  the other hosts connected to their own loopback and waited, the classic multi-node hang. After: the address
  this machine leaves by towards the other hosts (a UDP socket's connect, which sends nothing), or, without a
  route, no ``--local-addr`` (torchrun's own guess, the host's name, which the others resolve). Hosts that are
  all loopback (one machine, the pretend hosts) keep their addresses.

* **A host that vanishes mid-run** (powered off, its network down, a kernel panic), tried by freezing every
  process of a pretend host, its sshd included. pdsh waits for every host's ssh session, and ssh, with no
  keep-alive, waits for TCP to give up (hours): the other host's ranks ended (rank 0's watchdog, "hang: rank 0
  waited 20s in allreduce of step 18"), the job did not, its launcher still running 130 s later. When ssh did
  give up, ``pdsh -S`` returned its status 255, which dstrain read as a rank killed by signal 1: "a rank was
  killed by signal 1 (SIGHUP)", exit 129, a stop that ``--max-restarts`` never restarts. After: pdsh's ssh gets
  ``ServerAliveInterval=15 ServerAliveCountMax=4`` (``PDSH_SSH_ARGS_APPEND``, unless it sets its own), so the job
  ends about 60 s after the host's last answer (87 s after the freeze by hand); exit 255 of a multi-host launch is
  one line naming the hosts that no longer answer ssh (asked again, in parallel), and a failure that
  ``--max-restarts`` restarts; a restart first asks every host again and, one gone, stops in one line naming it and
  the fix (take it out of the hostfile, keep the global batch, ``--resume``), exit 2, instead of failing pdsh's
  connect at every restart. The checkpoints written before the loss stay complete.
* **An ``output.dir`` the hosts do not share** (``/scratch/run`` on a local disk of each machine), tried with the
  second pretend host's sshd in a mount namespace of its own, a tmpfs over the folder. Before: the job trained to
  the end, exit 0; every checkpoint on the first host was marked ``COMPLETE`` without rank 1's ZeRO shard, which lay
  on the second host's disk: nothing to resume from, found only by the ``--resume`` that needed it. After: rank 0
  writes a file of a new name there (synced, closed) when a run of several ranks takes the folder, every rank looks
  for it (10 s at most, for file systems whose clients see a new file late), and every rank refuses, before the
  first step, in one line naming the hosts and ranks that did not see it, exit 2 (the fresh folder removed, as
  round 9 does); a shared folder passes, with no file left behind.

Checked and left as they were: a host listed twice, ``slots=0``, comments and blank lines, two names for one
machine (refused in one line, earlier rounds); IPv6 addresses (torch parses ``::1:29500`` as a rendezvous
endpoint); the DeepSpeed runner's master when the first host resolves to loopback here and the others do not
(left to DeepSpeed's ``ssh HOST hostname -I``, said by ``--dry-run``); a busy master port here (refused in one
line); an unreachable host (refused, tests/multinode).
"""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest
import torch

from dstrain import cli, hostfile, launch_check, launcher, runtime, shared_folder
from dstrain.config import RunFolderError, load_run_config
from dstrain.trainers import common

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")
ADDRESSES = {"worker-0": "10.0.0.10", "worker-1": "10.0.0.11"}


@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    for var in ("DS_ACCELERATOR", "DS_ENV_FILE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hostfile, "resolve_host", lambda h: hostfile.Resolved(h, ADDRESSES[h], "DNS / hosts file"))
    monkeypatch.setattr(hostfile, "check_reachable", lambda h: None)
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    return str(path)


def fake_bin(folder: Path, programs: dict[str, str]) -> str:
    folder.mkdir(exist_ok=True)
    for name, script in programs.items():
        (folder / name).write_text(f"#!/bin/sh\n{script}\n")
        (folder / name).chmod(0o755)
    return str(folder)


def test_a_launch_without_pdsh_is_one_line_before_anything_starts(two_hosts, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", {}))  # no pdsh on it
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a refused launch started something"))
    code = cli.main(["launch", "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("dstrain: error: pdsh is not installed on this machine") and "apt-get install pdsh" in err
    assert "--launcher torchrun" in err and not Path(".deepspeed_env").exists()
    assert cli.main(["launch", "--hostfile", two_hosts, "--accelerator", "cpu", "--dry-run", RECIPE]) == 0


def test_with_pdsh_the_launch_goes_on(two_hosts, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", {"pdsh": "exit 0"}))
    started = []

    class Child:
        pid = 0

        def __init__(self, argv, env=None, **kwargs):
            started.append(argv)

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Child)
    assert cli.main(["launch", "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE]) == 0
    assert started and "--hostfile" in started[0]


@pytest.mark.parametrize("said, fix", [
    ("Host key verification failed.", "its host key is not in known_hosts: run 'ssh worker-1 true' once here"),
    ("@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
     "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n"
     "Host key for 10.0.0.11 has changed and you have requested strict checking.\n"
     "Host key verification failed.", "its host key changed (a reinstalled machine? else someone in between): "
     "'ssh-keygen -R worker-1'"),
    ("@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n  remove with:\n"
     '  ssh-keygen -f "/h/.ssh/known_hosts" -R "10.0.0.11"\nHost key verification failed.',
     'remove the old key with: ssh-keygen -f "/h/.ssh/known_hosts" -R "10.0.0.11"; Host key verification failed.); '
     "its host key changed (a reinstalled machine? else someone in between): remove the old key as ssh says"),
    ("me@10.0.0.11: Permission denied (publickey,password).", "'ssh-copy-id worker-1'"),
    ("ssh: connect to host 10.0.0.11 port 22: Connection refused", "--no-ssh-check skips this check"),
])
def test_ssh_that_wants_a_person_is_one_line_naming_the_fix(tmp_path, monkeypatch, said, fix):
    """Through the real check_reachable and a fake ssh that answers as ssh does under BatchMode."""
    monkeypatch.setenv("PATH", fake_bin(tmp_path / "bin", {"ssh": f"printf '%s\\n' '{said}' >&2; exit 255"}))
    hosts = [("worker-0", 1), ("worker-1", 1)]
    resolve = lambda h: hostfile.Resolved(h, ADDRESSES[h], "DNS / hosts file")  # noqa: E731
    probe = lambda h: None if h == "worker-0" else hostfile.check_reachable(h)  # noqa: E731
    with pytest.raises(hostfile.HostfileError) as err:
        hostfile.check_hosts(hosts, "hostfile", True, resolve, probe)
    line = str(err.value)
    assert line.startswith("hostfile hostfile: host 'worker-1' is unreachable by passwordless ssh (")
    assert fix in line and len(line.splitlines()) == 1
    assert ("--no-ssh-check" in line) == ("Connection refused" in said)


def torchrun_check(tmp_path, found: dict[str, str], route):
    path = tmp_path / "hostfile"
    path.write_text("".join(f"{h} slots=1\n" for h in found))
    spec = launcher.LaunchSpec(RECIPE, hostfile=str(path))
    return launch_check.check_hosts_for_launch(
        spec, reach=False, torchrun=True, local_hosts=["vm"], route=route,
        resolve=lambda h: hostfile.Resolved(h, found[h], "DNS / hosts file"))


def test_torchrun_never_advertises_a_loopback_address_to_other_hosts(tmp_path):
    routes = []

    def route(peer):
        routes.append(peer)
        return "10.0.0.10"

    check = torchrun_check(tmp_path, {"vm": "127.0.1.1", "worker-1": "10.0.0.11"}, route)
    assert check.local_addr == "10.0.0.10" and routes == ["10.0.0.11"]  # the way out towards worker-1
    assert torchrun_check(tmp_path, {"vm": "127.0.1.1", "worker-1": "10.0.0.11"}, lambda p: None).local_addr is None
    # one machine's loopback names (the pretend hosts): kept, no route asked
    assert torchrun_check(tmp_path, {"worker-1": "127.0.0.2", "vm": "127.0.0.3"},
                          lambda p: pytest.fail("asked")).local_addr == "127.0.0.3"
    assert torchrun_check(tmp_path, {"vm": "10.0.0.10", "worker-1": "10.0.0.11"},
                          lambda p: pytest.fail("asked")).local_addr == "10.0.0.10"
    argv, _ = launcher.build_torchrun_command(launcher.LaunchSpec(RECIPE, hostfile=str(tmp_path / "hostfile"),
                                                                  local_addr=check.local_addr), local_hosts=["vm"])
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.10"


def test_the_source_address_towards_a_host_is_never_loopback():
    assert hostfile.source_address_towards("127.0.0.2") is None
    mine = hostfile.source_address_towards("192.0.2.1")  # TEST-NET-1: nothing is sent
    assert mine is None or not hostfile._is_loopback(mine)


class TwoRanks:
    """Two ranks as two threads of this process, each with its host name, over a fake process group: rank 0's
    broadcast reaches rank 1, every rank's gathered object reaches both (what torch.distributed does)."""

    def __init__(self, monkeypatch, hosts=("node1", "node2")):
        self.me, self.hosts, self.sync = threading.local(), hosts, threading.Barrier(2, timeout=20)
        self.box: list = [None, None]
        monkeypatch.setattr(runtime, "broadcast_object", self.broadcast)
        monkeypatch.setattr(shared_folder, "_gather", self.gather)
        monkeypatch.setattr(shared_folder, "_host", lambda: self.hosts[self.me.rank])
        monkeypatch.setattr(shared_folder, "WAIT_S", 0.3)

    def broadcast(self, obj):
        self.sync.wait()
        if self.me.rank == 0:
            self.box[0] = obj
        self.sync.wait()
        return self.box[0]

    def gather(self, mine):
        self.sync.wait()
        self.box[self.me.rank] = mine
        self.sync.wait()
        return list(self.box)

    def run(self, folders: list[Path]) -> list:
        """decide_resume on both ranks, rank r's output.dir being ``folders[r]`` (one path, two disks)."""
        got: list = [None, None]

        def rank(r):
            self.me.rank = r
            world = runtime.World(r, 2, 0, 1, torch.device("cpu"))
            cfg = load_run_config(RECIPE, [f"--output.dir={folders[r]}"])
            try:
                got[r] = common.decide_resume(cfg, world, folders[r], folders[r] / "checkpoints")
            except Exception as err:  # noqa: BLE001  (the test reads it)
                got[r] = err
        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return got


def test_an_output_dir_the_hosts_do_not_share_is_refused_on_every_rank_before_training(tmp_path, monkeypatch,
                                                                                        no_lock):
    first, second = tmp_path / "node1" / "run", tmp_path / "node2" / "run"  # /scratch/run on each machine
    first.mkdir(parents=True)
    got = TwoRanks(monkeypatch).run([first, second])
    assert all(isinstance(g, RunFolderError) for g in got), got
    assert str(got[1]) == str(got[0]).replace(str(first), str(second))  # each names its own (one path on hosts)
    assert str(got[0]) == (
        f"output.dir {first} is not one folder for every rank: the ranks on node2 (rank 1) do not see the file "
        "rank 0 on node1 wrote there, and each rank writes its part of every checkpoint into it; put output.dir on a "
        "file system every host mounts at the same path (NFS, Lustre, ...)")
    assert not any(p.name.startswith(shared_folder.PREFIX) for p in first.iterdir())  # the marker removed


def test_a_shared_output_dir_passes_and_keeps_no_marker(tmp_path, monkeypatch, no_lock):
    out = tmp_path / "run"
    out.mkdir()
    assert TwoRanks(monkeypatch).run([out, out]) == [None, None]  # a fresh run on both ranks
    assert not any(p.name.startswith(shared_folder.PREFIX) for p in out.iterdir())
    one = runtime.World(0, 1, 0, 1, torch.device("cpu"))  # one rank: nothing written, nothing gathered
    monkeypatch.setattr(shared_folder, "write_marker", lambda out: pytest.fail("a marker for one rank"))
    monkeypatch.setattr(runtime, "broadcast_object", lambda obj: obj)
    alone = tmp_path / "alone"
    alone.mkdir()
    assert common.decide_resume(load_run_config(RECIPE, [f"--output.dir={alone}"]), one, alone, alone / "ckpt") is None


def test_pdsh_sessions_get_an_ssh_keep_alive_unless_they_set_one(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    spec = launcher.LaunchSpec(RECIPE, hostfile=str(path))
    _, env = launcher.build_deepspeed_command(spec, base_env={}, detect=lambda: "cpu", local_hosts=["vm"])
    assert env["PDSH_SSH_ARGS_APPEND"] == "-o ServerAliveInterval=15 -o ServerAliveCountMax=4"
    _, env = launcher.build_deepspeed_command(spec, base_env={"PDSH_SSH_ARGS_APPEND": "-p 2222"}, detect=lambda: "cpu",
                                              local_hosts=["vm"])
    assert env["PDSH_SSH_ARGS_APPEND"] == "-p 2222 -o ServerAliveInterval=15 -o ServerAliveCountMax=4"
    own = "-o ServerAliveInterval=5"
    _, env = launcher.build_deepspeed_command(spec, base_env={"PDSH_SSH_ARGS_APPEND": own}, detect=lambda: "cpu",
                                              local_hosts=["vm"])
    assert env["PDSH_SSH_ARGS_APPEND"] == own
    _, env = launcher.build_deepspeed_command(launcher.LaunchSpec(RECIPE, nproc=2), base_env={}, detect=lambda: "cpu")
    assert "PDSH_SSH_ARGS_APPEND" not in env  # one machine: no pdsh
    assert "PDSH" not in launcher.deepspeed_env_file({"PDSH_SSH_ARGS_APPEND": own, "DS_ACCELERATOR": "cpu"})


def vanishing(monkeypatch, after_launch: list[str]):
    """Both hosts answer ssh before the launch; once it has started, the hosts in ``after_launch`` no longer do.
    The job's launcher (DeepSpeed's runner over pdsh) ends with pdsh's status 255."""
    launched = []
    monkeypatch.setattr(hostfile, "check_reachable", lambda h: "Connection timed out during banner exchange"
                        if launched and h in after_launch else None)

    class Child:
        pid = 0

        def __init__(self, argv, env=None, **kwargs):
            launched.append(argv)

        def wait(self, timeout=None):
            return 255

    monkeypatch.setattr(subprocess, "Popen", Child)
    monkeypatch.setattr(hostfile, "pdsh_problem", lambda: None)
    monkeypatch.setattr("dstrain.supervise.time.sleep", lambda s: None)
    return launched


def test_a_host_lost_mid_run_is_named_and_its_job_is_not_restarted_onto_it(two_hosts, monkeypatch, capsys):
    launched = vanishing(monkeypatch, ["worker-1"])
    code = cli.main(["launch", "--hostfile", two_hosts, "--accelerator", "cpu", "--max-restarts", "2", RECIPE])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(launched) == 1, err
    assert "dstrain: the ranks of host 'worker-1' (Connection timed out during banner exchange) were lost: it no " \
           "longer answers ssh (powered off, rebooted, or its network went down); the other hosts' ranks ended" in err
    assert "dstrain: job failed (exit 255); restart 1/2 from the start (no complete checkpoint yet)" in err
    assert err[-1] == (f"dstrain: error: not restarting: host 'worker-1' of {two_hosts} is unreachable by passwordless "
                       "ssh (Connection timed out during banner exchange); take it out of " + two_hosts +
                       " (keeping the global batch: train.grad_accum or train.micro_batch) and launch again with "
                       "--resume")
    assert not any("signal 1" in line for line in err)


def test_an_ssh_failure_with_every_host_answering_is_restarted(two_hosts, monkeypatch, capsys):
    launched = vanishing(monkeypatch, [])
    code = cli.main(["launch", "--hostfile", two_hosts, "--accelerator", "cpu", "--max-restarts", "1", RECIPE])
    err = capsys.readouterr().err
    assert code == 255 and len(launched) == 2 and "killed by signal 1" not in err
    assert err.count("an ssh session to a host ended with status 255") == 2
    assert "--resume" in launched[1]
