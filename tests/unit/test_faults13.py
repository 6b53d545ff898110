"""Fault-injection round 13: deterministic failures under torchrun's own restarts, hangs that recur, hosts of one
job running different versions, and host aliases of this machine. Every test runs in this process (no rank is
launched).

* **The same hang in every attempt** (a deadlock in the code, a collective only some ranks reach). Before: the
  watchdog's exit 124 left no error for ``--max-restarts`` to compare, so each of K restarts resumed, trained up
  to the same step, waited ``train.collective_timeout_s`` there and was ended again. After: the first watchdog
  that fires leaves ``Hang: no progress (in PHASE of step S)``; two attempts in a row that leave the same one
  end the restarts with the one-line "same error at the same point". A hang at another step or phase is
  restarted as before.
* **torchrun's own ``--max-restarts``** (``torchrun --max-restarts N -m dstrain.cli train ...``). Before: the
  deterministic-stop rule lived in ``dstrain launch`` only; torchrun restarted every attempt N times into the
  same traceback, and also restarted a run stopped on a non-finite loss (exit 3) or a checkpoint the disk could
  not hold (exit 4), which ``dstrain launch`` never restarts. Decided: the user expects torchrun's restarts to
  follow the rules of ``dstrain launch``'s. After: the failing rank leaves its error, exit status and the job's
  torchrun agents in ``output.dir/.torchrun_error_<restart>.json``; a restart whose attempt before ended with
  exit 3 or 4, or whose two attempts before ended with the same (non-environment) error at the same point,
  leaves at once in one line (as a restart of a job stopped by a signal already did), before training.
* **Version skew across hosts.** Before: a host with another dstrain checkout, torch or DeepSpeed joined the
  job silently. After: every rank sends its host and versions (dstrain with a digest of its source) in one
  gather at start-up, and a job whose ranks differ is refused on every rank, exit 2, in one line naming the
  packages, versions and hosts.
* **Aliases of this machine in a hostfile** (its FQDN, its own non-loopback IP, Debian's 127.0.1.1, ::1).
  Before: only localhost, 127.0.0.1, ::1 and the bare host name were local; a one-host hostfile naming the
  machine otherwise went through pdsh and ssh to itself. After: they launch locally.

Checked and left as they were (pinned by earlier rounds): a hostfile with a duplicate host or slots=0 (refused
in one line, ``test_hostfile.py``), a save killed halfway or on a full disk (``test_faults7.py``,
``test_faults8.py``), a second SIGTERM or Ctrl-C (kills the job at once, ``cli.cmd_launch``), a resume whose
newest checkpoint has no ``COMPLETE`` marker (the complete one before it is taken, ``test_checkpoint.py``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dstrain import elastic, launch_check, launch_common, launcher, rank_exit, runtime, supervise, versions
from dstrain.config import LaunchError, load_run_config
from dstrain.resilience import EXIT_HANG, Watchdog
from dstrain.trainers import common

from .conftest import RECIPE, tiny_checkpoint


# ---------------------------------------------------------------- a hang that recurs

def _hang_attempt(tmp_path: Path, monkeypatch, phase: str, step: int) -> str | None:
    """One attempt whose rank hangs in ``phase`` of ``step``: its watchdog fires (exit faked) and leaves what
    it leaves in the job's failure folder, as under ``dstrain launch``; returns that folder's error."""
    folder = tmp_path / f"job{time.monotonic_ns()}"
    folder.mkdir()
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(folder))
    exits = []
    dog = Watchdog(rank=1, timeout_s=0.1, exit=exits.append, out=open(folder / "log", "w"))
    dog.phase(phase, step)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.close()
    assert exits == [EXIT_HANG]
    assert rank_exit.failed_code(folder) == EXIT_HANG
    return rank_exit.error_of(folder)


def test_a_hang_leaves_its_phase_and_step_not_an_environment_error(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "_AGENTS", [])
    error = _hang_attempt(tmp_path, monkeypatch, "allreduce", 7)
    assert error == "Hang: no progress (in allreduce of step 7)" == rank_exit.hang_signature("allreduce", 7)
    assert not supervise.TRANSIENT.search(error)  # else never judged deterministic


def test_the_same_hang_twice_in_a_row_ends_the_restarts(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "_AGENTS", [])

    def launch(*where):
        """dstrain launch --max-restarts 3 of a job whose attempts hang at ``where`` in turn: attempts, last line."""
        errors, lines, runs = [], [], []

        def attempt(resume):
            runs.append(resume)
            phase, step = where[(len(runs) - 1) % len(where)]
            errors.append(_hang_attempt(tmp_path, monkeypatch, phase, step))
            return EXIT_HANG

        assert supervise.run_with_restarts(attempt, 3, lines.append, pause=0, error=lambda: errors[-1]) == EXIT_HANG
        return len(runs), lines[-1]

    runs, line = launch(("forward", 3))  # the same hang: one restart met it again, the 2 others are not run
    assert runs == 2 and "same error at the same point: Hang: no progress (in forward of step 3)" in line
    assert "2 restart(s) left unused" in line
    assert launch(("forward", 3), ("forward", 4)) == (4, "dstrain: job failed (exit 124) after 3 restart(s); "
                                                       "giving up")  # another step each time: restarted
    assert launch(("forward", 3), ("backward", 3))[0] == 4  # another phase


# ---------------------------------------------------------------- torchrun's own restarts

@pytest.fixture
def torchrun_job(tmp_path, monkeypatch, one_rank, no_lock):
    """A run folder holding a checkpoint, and a torchrun job (one agent) whose restart count the test sets."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.delenv("DSTRAIN_FAILURE_DIR", raising=False)
    out = tmp_path / "run"
    tiny_checkpoint(out, 5, torchrun_agents=[elastic.agent_id()])
    cfg = load_run_config(RECIPE, [f"--output.dir={out}"])
    cfg.checkpoint.resume = True  # (torchrun ... train RECIPE --resume: every attempt continues the checkpoint)

    def attempt(n: int, error: BaseException | None = None, code: int = 1):
        """Attempt ``n`` of the job: it decides whether to train; ``error``: then fails with it."""
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(n))
        tag = common.decide_resume(cfg, one_rank, out, out / "checkpoints")
        if error is not None:
            signature = rank_exit.error_signature(error, ("forward", 7))
            if code == 1:
                rank_exit.note_error(signature)  # what cli._rank_failed leaves
            else:
                elastic.note_attempt_error(signature, code)  # what cli.main leaves for exits 3 and 4
        return tag
    attempt.out = out
    return attempt


def test_torchrun_restarts_stop_on_the_same_error_twice_in_a_row(torchrun_job):
    torchrun_job(0, RuntimeError("bad sample 17"))
    torchrun_job(1, RuntimeError("bad sample 18"))  # another error each time: restarted
    torchrun_job(2, OSError("[Errno 28] No space left on device"))
    torchrun_job(3, OSError("[Errno 28] No space left on device"))  # the environment: the user may free space
    torchrun_job(4, RuntimeError("shape mismatch [4, 8] vs [4, 9]"))
    assert torchrun_job(5, RuntimeError("shape mismatch [4, 8] vs [4, 9]")) == "step_00000005"  # restart 5 runs
    with pytest.raises(elastic.StoppedJobRestarted) as got:  # restart 6: both attempts before met it
        torchrun_job(6)
    assert got.value.exit_code == 1
    assert str(got.value) == (
        "torchrun restart 6: not training on: this job failed twice in a row with the same error at the same "
        "point: RuntimeError: shape mismatch [4, 8] vs [4, 9] (in forward of step 7) "
        "(a deterministic error, which every restart would meet again; torchrun --max-restarts restarts ranks "
        "that exit non-zero, and each restart ends here): fix it, then start the job again with --resume")
    with pytest.raises(elastic.StoppedJobRestarted):  # and every later restart
        torchrun_job(7)


def test_torchrun_does_not_restart_a_non_finite_stop_or_a_full_disk_at_a_save(torchrun_job):
    torchrun_job(0, RuntimeError("non-finite loss at step 7 on rank 0: stopped (train.nonfinite=stop)"), code=3)
    with pytest.raises(elastic.StoppedJobRestarted) as got:
        torchrun_job(1)
    assert got.value.exit_code == 3 and "ended with exit 3" in str(got.value)
    with pytest.raises(elastic.StoppedJobRestarted):  # and every later restart
        torchrun_job(2)


def test_a_new_torchrun_job_forgets_the_errors_of_an_earlier_one(torchrun_job, monkeypatch):
    torchrun_job(0, RuntimeError("boom"))
    torchrun_job(1, RuntimeError("boom"))
    assert any(p.name.startswith(elastic.ERROR_PREFIX) for p in torchrun_job.out.iterdir())
    torchrun_job(0)  # a new job (restart count 0) taking the folder: the records go
    assert not any(p.name.startswith(elastic.ERROR_PREFIX) for p in torchrun_job.out.iterdir())
    monkeypatch.setattr(elastic, "agent_id", lambda environ=None: "otherhost:1:2")  # another job's agents
    torchrun_job.out.joinpath(f"{elastic.ERROR_PREFIX}0.json").write_text(json.dumps(
        {"error": "x", "code": 3, "torchrun_agents": ["somewhere:9:9"]}))
    assert torchrun_job(1) == "step_00000005"  # not this job's record: ignored


# ---------------------------------------------------------------- versions across hosts

def _print(host, **changed):
    return {"host": host, "dstrain": "0.1.0 (source 0123456789)", "torch": "2.5.1", "deepspeed": "0.19.8",
            "python": "3.11", **changed}


def test_version_skew_is_named_in_one_line():
    same = [_print("node1"), _print("node1"), _print("node2"), _print("node2")]
    assert versions.skew_problem(same) is None
    skewed = [_print("node1"), _print("node1"), _print("node2", dstrain="0.1.0 (source 9999999999)", torch="2.4.0"),
              _print("node2", dstrain="0.1.0 (source 9999999999)", torch="2.4.0")]
    assert versions.skew_problem(skewed) == (
        "the hosts of this job run different versions: dstrain 0.1.0 (source 0123456789) on node1 (ranks 0-1), "
        "0.1.0 (source 9999999999) on node2 (ranks 2-3); torch 2.5.1 on node1 (ranks 0-1), 2.4.0 on node2 "
        "(ranks 2-3): install the same on every host (one checkout or environment for all), then launch again")


def test_a_job_whose_hosts_differ_is_refused_before_it_takes_the_folder(tmp_path, monkeypatch, no_lock):
    mine = versions.fingerprint()
    assert set(mine) == {"host", *versions.PACKAGES} and "source " in mine["dstrain"]
    other = {**mine, "host": "node2", "deepspeed": "0.14.0"}
    monkeypatch.setattr(runtime, "all_gather_object", lambda obj: [obj, other] if isinstance(obj, dict) else [obj])
    monkeypatch.setattr(elastic, "_AGENTS", [])
    out = tmp_path / "run"
    world = runtime.World(rank=0, world_size=2, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    with pytest.raises(LaunchError, match=r"deepspeed .* on .* \(rank 0\), 0\.14\.0 on node2 \(rank 1\)"):
        common.decide_resume(load_run_config(RECIPE, [f"--output.dir={out}"]), world, out, out / "checkpoints")
    assert not out.exists()
    monkeypatch.setenv("DSTRAIN_SKIP_VERSION_CHECK", "1")  # a deliberate mix
    versions.check_same(2)


# ---------------------------------------------------------------- this machine under other names

@pytest.fixture
def node7(monkeypatch):
    """This machine as node7.cluster.example (/etc/hosts: 127.0.1.1 node7.cluster.example node7), with an
    interface at 10.1.2.3."""
    monkeypatch.setattr(launch_common.socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(launch_common.socket, "gethostbyname_ex",
                        lambda name: ("node7.cluster.example", ["node7"], ["127.0.1.1"]))
    monkeypatch.setattr(launch_common, "_interface_addresses", lambda: ["127.0.0.1", "10.1.2.3", "fd00::7"])
    launch_common._this_machine.cache_clear()
    yield
    launch_common._this_machine.cache_clear()


@pytest.mark.parametrize("name", ["node7.cluster.example", "10.1.2.3", "fd00::7", "127.0.1.1"])
def test_a_hostfile_naming_this_machine_by_an_alias_launches_locally(tmp_path, node7, name):
    path = tmp_path / "hostfile"
    path.write_text(f"{name} slots=2\n")
    spec = launcher.LaunchSpec(RECIPE, hostfile=str(path))
    argv, _ = launcher.build_deepspeed_command(spec, base_env={}, detect=lambda: "cpu")
    assert "--hostfile" not in argv and argv[argv.index("--num_gpus") + 1] == "2"  # no pdsh, no ssh to itself
    check = launch_check.check_hosts_for_launch(spec, reach=True, probe=lambda host: pytest.fail("ssh to itself"))
    assert not check.remote and check.master_addr == "127.0.0.1"
    argv, _ = launcher.build_torchrun_command(spec, base_env={}, detect=lambda: "cpu")
    assert argv[argv.index("--master-addr") + 1] == "127.0.0.1"
    path.write_text("10.1.2.4 slots=2\n")  # another machine stays remote
    argv, _ = launcher.build_deepspeed_command(spec, base_env={}, detect=lambda: "cpu")
    assert "--hostfile" in argv


# ---------------------------------------------------------------- review: restarts that would have succeeded, false skew

def test_a_hang_in_a_save_twice_is_the_file_systems_and_restarted():
    """Saves fall on the same steps in every attempt: a file system that stalls (an NFS or Lustre server) hangs
    the save of step 200 in attempt 1, and attempt 2, resumed from step 100, in the save of step 200 again. Before:
    taken for a deterministic hang, the restarts ended though the server may be back; now restarted as before."""
    lines = []
    hang = rank_exit.hang_signature("save", 200)
    runs = []
    code = supervise.run_with_restarts(lambda resume: runs.append(resume) or EXIT_HANG, 3, lines.append, pause=0,
                                       error=lambda: hang)
    assert code == EXIT_HANG and len(runs) == 4 and "after 3 restart(s); giving up" in lines[-1]
    assert not supervise.repeated(hang, hang)  # torchrun's own restarts (elastic.repeated_error_problem) as well
    assert supervise.repeated(rank_exit.hang_signature("eval", 200), rank_exit.hang_signature("eval", 200))
    assert supervise.repeated(rank_exit.hang_signature("saves", 2), rank_exit.hang_signature("saves", 2))


def test_the_same_code_from_a_checkout_and_from_an_install_is_no_skew(monkeypatch):
    """One host runs dstrain from a checkout on PYTHONPATH (no installed metadata), another from ``pip install
    -e`` of the same commit. Before: "0.1.0 (source X)" against "? (source X)", every rank refused the job."""
    import importlib.metadata

    def fresh():
        versions._FINGERPRINT.clear()
        return versions.fingerprint()

    monkeypatch.setattr(versions, "_FINGERPRINT", [])
    installed = fresh()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: (_ for _ in ()).throw(
        importlib.metadata.PackageNotFoundError(name)) if name == "dstrain" else "2.5.1")
    checkout = {**fresh(), "host": "node2"}
    assert versions.skew_problem([installed, checkout]) is None
    monkeypatch.setattr(versions, "_source_digest", lambda: "0000000000")  # other code on node2: still refused
    changed = {**fresh(), "host": "node2"}
    assert "dstrain source " in versions.skew_problem([installed, changed])


def test_a_launch_without_a_hostfile_asks_no_resolver(monkeypatch):
    """``dstrain launch --nproc 2`` (no hostfile) has no host to compare with this machine's names. Before: each
    launch looked its own host name up (twice), seconds each where DNS does not answer (a container without a
    network); now only a hostfile asks."""
    asked = []
    monkeypatch.setattr(launch_common.socket, "gethostbyname_ex", lambda name: asked.append(name) or ("h", [], []))
    monkeypatch.setattr(launch_common.socket, "getaddrinfo", lambda *a, **k: asked.append(a) or [])
    launch_common._this_machine.cache_clear()
    try:
        spec = launcher.LaunchSpec(RECIPE, nproc=2)
        launcher.build_deepspeed_command(spec, base_env={}, detect=lambda: "cpu")
        launcher.build_torchrun_command(spec, base_env={}, detect=lambda: "cpu")
        assert launcher.launch_world_size(spec) == (2, 2)
        assert asked == []
    finally:
        launch_common._this_machine.cache_clear()
