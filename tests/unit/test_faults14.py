"""Faults, round 14.

* **A remote rank's error under ``dstrain launch --hostfile``.** Before: ``$DSTRAIN_FAILURE_DIR`` was a temporary
  folder on the launching host, and not in ``.deepspeed_env``, so the ranks pdsh started on other hosts wrote their
  first error nowhere the launcher read: a deterministic error there was restarted until ``--max-restarts`` ran out,
  and its line was missing. Now a multi-host launch puts the folder inside ``output.dir`` (shared by every host), as a
  hidden per-launch folder named in ``.deepspeed_env`` and removed after each attempt; one host keeps a temporary one.
* **HRM's ``hrm/ema.pt``** held the EMA shadow on the device it was trained on (a GPU); it now holds host copies,
  and resume copies them back onto the engine's device.
"""
from __future__ import annotations

import io
import os
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain import cli, hostfile, rank_exit, supervise

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")
ADDRESSES = {"worker-0": "10.0.0.10", "worker-1": "10.0.0.11"}


@pytest.fixture
def launch_env(monkeypatch, tmp_path):
    for var in ("DS_ACCELERATOR", "DS_ENV_FILE", "OMP_NUM_THREADS", "DSTRAIN_FAILURE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # .deepspeed_env lands here
    monkeypatch.setattr(hostfile, "resolve_host", lambda h: hostfile.Resolved(h, ADDRESSES[h], "DNS / hosts file")
                        if h in ADDRESSES else None)
    monkeypatch.setattr(hostfile, "check_reachable", lambda h: None)
    monkeypatch.setattr(hostfile, "pdsh_problem", lambda: None)
    from dstrain import cli_checks
    monkeypatch.setattr(cli_checks, "check_before_launch", lambda *args: None)
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no real job")))


def _remote_env() -> dict[str, str]:
    """What pdsh gives a rank on another host: the lines of ``.deepspeed_env`` (not the launcher's environment)."""
    lines = Path(".deepspeed_env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines)


def test_a_remote_ranks_error_stops_the_restarts_of_a_multi_host_launch(launch_env, tmp_path, monkeypatch, capsys):
    from dstrain import job_guard
    out = tmp_path / "run"
    seen = []

    def start_job(argv, env, port=None):  # worker-1's rank fails at step 150 every time, writing where it is told
        folder = _remote_env()["DSTRAIN_FAILURE_DIR"]
        seen.append(folder)
        assert Path(folder).is_dir()  # made by the launcher before the ranks start
        Path(folder, rank_exit.ERROR_FILE).write_text("ValueError: bad sample (in forward of step 150)")
        return SimpleNamespace(pid=os.getpid(), wait=lambda: 1)
    monkeypatch.setattr(job_guard, "start_job", start_job)
    hosts = tmp_path / "hostfile"
    hosts.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    code = cli.main(["launch", "--hostfile", str(hosts), "--accelerator", "cpu", "--max-restarts", "5", RECIPE,
                     f"--output.dir={out}"])
    err = capsys.readouterr().err
    assert code == 1 and len(seen) == 2 and seen[0] == seen[1]
    assert Path(seen[0]).parent == out.absolute() and rank_exit.is_launch_failure_dir(Path(seen[0]).name)
    assert "job failed again with the same error at the same point: ValueError: bad sample (in forward of step " \
           "150); not restarting it (4 restart(s) left unused" in err
    assert not Path(seen[0]).exists() and not out.exists()  # cleaned up, and the folder made for it too


def test_a_one_host_launch_keeps_its_failure_folder_out_of_the_run_folder(launch_env, tmp_path, monkeypatch):
    from dstrain import job_guard
    out = tmp_path / "run"
    seen = []

    def start_job(argv, env, port=None):
        seen.append(env["DSTRAIN_FAILURE_DIR"])
        return SimpleNamespace(pid=os.getpid(), wait=lambda: 0)
    monkeypatch.setattr(job_guard, "start_job", start_job)
    assert cli.main(["launch", "--nproc", "1", "--accelerator", "cpu", RECIPE, f"--output.dir={out}"]) == 0
    assert len(seen) == 1 and out.absolute() not in Path(seen[0]).parents and not out.exists()
    assert rank_exit.launch_failure_dir(out, multi_host=False) is None


def test_a_failed_rank_0_leaves_the_launchers_folder_and_its_error(tmp_path, monkeypatch):
    from dstrain import run_lock
    out = tmp_path / "run"
    failures = Path(rank_exit.launch_failure_dir(out, multi_host=True))
    failures.mkdir(parents=True)
    (failures / rank_exit.ERROR_FILE).write_text("ValueError: x (before the first step)")
    (out / ".cache").mkdir()
    (out / ".cache" / "tokens.bin").write_bytes(b"0")
    monkeypatch.setattr(run_lock, "_HELD", [])
    assert cli._only_launch_folders(out) is False
    cli._remove_if_only_cache(out)  # what rank 0 of a fresh run does when it fails
    assert sorted(p.name for p in out.iterdir()) == [failures.name]  # the cache goes, the launcher's folder stays
    assert rank_exit.error_of(failures) == "ValueError: x (before the first step)"
    assert cli._only_launch_folders(out) is True  # (so rank 0 counts the folder as fresh: see cmd_train)


def test_hrm_ema_is_saved_as_host_tensors_and_resumes_onto_the_engines_device(tmp_path, monkeypatch):
    from dstrain.optim.ema import EMA
    from dstrain.trainers.hrm import HRMTrainer
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    ema = EMA(model, 0.9)
    values = {name: t.clone() for name, t in ema.shadow.items()}
    ema.shadow = {name: t.to("meta") for name, t in ema.shadow.items()}  # stands for a shadow on a GPU
    by_shape = {tuple(t.shape): t for t in values.values()}  # (each shape once in this model)
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):  # the device-to-host copy a GPU tensor makes (a meta tensor has no data)
        if self.is_meta and (args[:1] == ("cpu",) or kwargs.get("device") == "cpu"):
            return by_shape[tuple(self.shape)].clone()
        return real_to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", to)
    trainer = HRMTrainer.__new__(HRMTrainer)
    trainer.carry, trainer.puzzle_emb, trainer.ema = {}, None, ema
    trainer.world = SimpleNamespace(rank=0, is_main=True)
    trainer.guards = SimpleNamespace(phase=lambda *a: None, skipped=0)
    trainer.log_sums, trainer.log_losses, trainer.global_batch = {}, [], 4
    trainer.saver = SimpleNamespace(save=lambda step, meta, write: write(tmp_path / "tag"))
    trainer.save(1)
    monkeypatch.setattr(torch.Tensor, "to", real_to)
    saved = torch.load(tmp_path / "tag" / "hrm" / "ema.pt", weights_only=True)  # no map_location needed
    assert {t.device.type for t in saved["shadow"].values()} == {"cpu"}
    again = EMA(model, 0.9)  # resume: the shadow stays on the engine's device, the values are copied in
    again.load_state_dict(saved)
    for name, t in again.shadow.items():
        assert torch.equal(t, values[name])


def _fire(dog, exits):
    dog.phase("save", 4)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.close()


def test_a_hang_in_a_multi_host_launch_leaves_its_error_in_the_shared_folder_and_no_heartbeats(tmp_path,
                                                                                                monkeypatch):
    from dstrain import elastic
    from dstrain.resilience import EXIT_HANG, Watchdog
    monkeypatch.setattr(elastic, "_AGENTS", [])
    folder = Path(rank_exit.launch_failure_dir(tmp_path / "run", multi_host=True))
    folder.mkdir(parents=True)
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(folder))
    exits = []
    _fire(Watchdog(rank=3, timeout_s=0.1, exit=exits.append, out=io.StringIO()), exits)
    assert exits == [EXIT_HANG] and rank_exit.error_of(folder) == rank_exit.hang_signature("save", 4)
    assert not (folder / "heartbeat").exists()  # (a beat every few seconds on output.dir's file system: none)


def test_a_watchdog_ends_its_rank_even_when_its_notes_cannot_be_written(tmp_path, monkeypatch):
    from dstrain import resilience
    from dstrain.resilience import EXIT_HANG, Watchdog
    stalled = threading.Event()  # a network file system that stopped answering: the write never returns
    monkeypatch.setattr(rank_exit, "note_failed", lambda code: stalled.wait(30))
    monkeypatch.setattr(resilience, "NOTES_WAIT_S", 0.2)
    exits = []
    started = time.monotonic()
    _fire(Watchdog(rank=0, timeout_s=0.1, exit=exits.append, out=io.StringIO()), exits)
    stalled.set()
    assert exits == [EXIT_HANG] and time.monotonic() - started < 5
    for thread in threading.enumerate():  # the released notes end here, not in a later test's failure folder
        if thread.name == "dstrain-watchdog-notes":
            thread.join(10)
