"""Fault-injection round 8: a run folder deleted or renamed under a running run, a full disk at a GRPO / SCoRe
warm start, a save killed halfway, two launches at once, a terminal that hangs up and a run folder copied elsewhere.
Every test runs in this process (no rank is launched).

* **``output.dir`` deleted (``rm -rf`` of a run thought finished) or renamed (``mv``) while a run goes.** The
  run's flock stays on a lock file that is no longer at ``output.dir/.dstrain.lock``. Before: nothing noticed;
  DeepSpeed recreated the folder at the next save and went on writing it, while a second run started on that
  ``output.dir`` found no lock file, took the folder and wrote it too (interleaved metrics, each overwriting the
  other's checkpoints). After: every heartbeat and rank 0 before each save check that the lock file at the path
  is the one held; when it is gone the lock is taken again there (the folder made anew) with one warning naming
  the folder and where the earlier checkpoints went, so a second run is refused as for any held folder; when
  another run took it first, one warning names that run and says both write it.
* **The disk full (or over quota) when GRPO or SCoRe writes its warm start** (``task.warm_start_steps``: rank 0
  trains the policy on the references, then saves it under ``output.dir/warm_start``, before any plan or
  checkpoint; round 7 covered the LM trainer's data cache, and the run records that every trainer writes; HRM
  fills no cache: its puzzles are generated or read). Before: rank 0's ``OSError`` traceback from
  ``save_pretrained`` while its peers waited in a barrier, and the half-written weights stayed to fill the disk.
  After: one line on every rank naming the folder, the free space, the supervised steps lost and the fix
  (``RunFolderError``, exit 2); the partial folder is removed (no marker: the next run redoes it). A plan note
  (``plan.txt``, appended after the plan) that the disk cannot take is one warning, not rank 0's traceback.
* **An asynchronous save (``checkpoint.async_write=true``) killed halfway** (SIGKILL, the OOM killer, a node
  lost; a stop's save killed by the scheduler's follow-up SIGKILL): the tag folder holds ``.partial`` files and
  some ranks' ``written/`` markers, no ``COMPLETE``. Before and after, it is never taken as the latest, even
  when ``latest`` names it. Before: the resumed run removed it only when it saved that very step again; with
  its save points moved (another ``checkpoint.every``, a stop's save at an odd step) the folder, a full set of
  shards that ``checkpoint.keep`` never counted, stayed for good and filled the disk run after run. After:
  each save removes the incomplete folders older than the oldest checkpoint it keeps (what ``keep`` would have
  removed had they been complete); newer ones stay (a checkpoint whose ``COMPLETE`` the user removed).
* **Two ``dstrain launch`` on one ``output.dir`` within a second.** Where flock works, exactly one run takes the
  folder and the other's rank 0 is refused in one line, as before; but a refusal that read the lock file
  between the winner's flock and its first write named "process ?". On a file system without flock (round 6:
  NFS ``nolock``, Lustre ``localflock``, FUSE), both runs read a free lock file, both wrote it, and both ran on
  one folder. After: a run taking the folder without flock reads the file back after ``SETTLE_S`` (0.5 s);
  the run whose record is not there is refused in one line naming the other; the refusal of a flock race waits
  up to half a second for the winner's record ("a run starting or ending now" when none comes).
* **SIGHUP when the ssh session of a run started without ``nohup`` ends.** ``dstrain launch`` already took it
  as a stop (SIGTERM to the ranks, which save and leave, 128 + 1), but the session's terminal is hung up: every
  write to it fails with EIO, and the ranks write to it too (the launchers pass their stdout on). Before: a
  rank's next ``print`` (its step line, its stop line) raised ``OSError: [Errno 5]``, so it ended as a failure
  before its stop's checkpoint was written (the work since the last save lost), and the launcher's own lines
  were a traceback. After: ``dstrain train`` and ``dstrain launch`` guard their stdout and stderr
  (``dstrain.lost_terminal``): the first write that fails for a lost terminal or pipe (EIO, ENXIO, EPIPE: also
  ``| tee`` whose reader died) sends that descriptor to ``/dev/null`` and the run goes on; other errors raise.
  (Seen with a 1-rank ``dstrain launch`` on a pseudo-terminal closed, then SIGHUP: before, exit 129 and neither a
  checkpoint nor ``summary.json``; after, exit 129 with the stop's checkpoint and summary.)
* **A policy run's folder copied from another machine (or moved to another ``output.dir``), then exported.**
  Its run config records the warm start's weights as an absolute path (``model.args.path``, for ``--resume``
  and export from any directory), which is gone at the new place. ``--resume`` was fine (the warm start is
  found under the new ``output.dir``; the path is not compared). Before: ``dstrain export`` failed with "path
  '/old/place/run/warm_start' is not a Hugging Face checkpoint directory". After: a recorded path that is gone
  is looked for in the run's folder (``warm_start``, ``guidance/warm_start``) and used there, with a note.
"""
from __future__ import annotations

import builtins
import errno
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dstrain import checkpoint as ckpt
from dstrain import run_lock
from dstrain.config import RunFolderError
from dstrain.runtime import World
from dstrain.trainers import common
from dstrain.trainers import policy_rl as prl


# ---------------------------------------------------------------- (a) output.dir deleted or renamed under a run

@pytest.mark.parametrize("how", ["deleted", "renamed"])
def test_a_run_folder_deleted_or_renamed_under_a_run_is_locked_again(tmp_path, no_lock, monkeypatch, capsys, how):
    out = tmp_path / "run"
    assert common._lock_run_folder(out) is None
    assert run_lock.probe(out) is not None  # held
    if how == "deleted":
        shutil.rmtree(out)
    else:
        os.rename(out, tmp_path / "run.old")
    # the next save (rank 0) sees it before DeepSpeed recreates the folder
    warning = run_lock.recheck()
    assert warning is not None and f"output.dir {out} was deleted or renamed while this run goes" in warning
    assert "its lock is taken again there" in warning and warning in capsys.readouterr().err
    assert (out / run_lock.NAME).read_text().startswith(f"{os.getpid()} ")
    problem = run_lock.probe(out)  # a second `dstrain launch` on that output.dir is refused
    assert problem is not None and f"output.dir {out} is in use by another run (process {os.getpid()}" in problem
    assert run_lock.recheck() is None  # held again: nothing more to say
    if how == "renamed":  # the old folder's copy is free for whoever resumes it
        assert run_lock.probe(tmp_path / "run.old") is None


def test_a_run_folder_taken_by_another_run_meanwhile_is_said(tmp_path, no_lock, capsys):
    out = tmp_path / "run"
    assert common._lock_run_folder(out) is None
    shutil.rmtree(out)
    out.mkdir()
    other = open(out / run_lock.NAME, "w")  # another run took the new folder first (its own flock)
    try:
        import fcntl
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        other.write("4242 other-host 0\n")
        other.flush()
        warning = run_lock.recheck()
    finally:
        other.close()
    assert warning is not None and "another run (process 4242 on other-host) took it since: both write it" in warning
    assert warning in capsys.readouterr().err


def test_the_heartbeat_notices_a_deleted_folder(tmp_path, no_lock, monkeypatch, capsys):
    monkeypatch.setattr(run_lock, "BEAT_S", 0.05)
    out = tmp_path / "run"
    assert common._lock_run_folder(out) is None
    shutil.rmtree(out)
    for _ in range(60):
        time.sleep(0.05)
        if run_lock._WARNED:
            break
    assert run_lock.probe(out) is not None  # taken again without any save
    assert f"output.dir {out} was deleted or renamed while this run goes" in capsys.readouterr().err


# ---------------------------------------------------------------- (b) a full disk at GRPO's / SCoRe's warm start

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


class _FullDiskPolicy:
    """A policy toolkit whose model trains (a stand-in step) and whose save fills the disk halfway."""

    def build(self, _mcfg):
        import torch
        return torch.nn.Linear(2, 2)

    def save_pretrained(self, _model, folder, _tokenizer):
        (Path(folder) / "model.safetensors").write_bytes(b"\0" * 1024)  # cut short by the full disk
        raise ENOSPC


def test_a_full_disk_at_the_warm_start_is_one_line_and_leaves_no_partial_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(prl, "policy_toolkit", lambda cfg: (None, None, _FullDiskPolicy()))
    monkeypatch.setattr(prl, "task_tokenizer", lambda rl, mcfg, task: None)
    steps = []
    monkeypatch.setattr(prl, "supervised_step", lambda model, opt, tok, batch: steps.append(len(batch)) or 1.0)
    cfg = SimpleNamespace(train=SimpleNamespace(seed=1), data=SimpleNamespace(seed=2))
    task = SimpleNamespace(warm_start_steps=3, warm_start_lr=1e-3, warm_start_batch=2)
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=None)
    out = tmp_path / "run"
    with pytest.raises(RunFolderError) as caught:
        prl.warm_start(cfg, task, ["t1", "t2"], world, out, log=lambda m: None)
    line = str(caught.value)
    folder = out / prl.WARM_START_DIR
    assert line.startswith(f"the warm start {folder} could not be written (no space left on device, ")
    assert "free there); its 3 supervised steps are lost" in line and line.endswith("free space, then start again")
    assert "\n" not in line and steps == [2, 2, 2]
    assert not folder.exists()  # its space given back; no WARM_START_COMPLETE: the next run redoes it


def test_a_plan_note_the_disk_cannot_take_is_a_warning(tmp_path, monkeypatch, capsys):
    real_open = builtins.open

    def full(path, *args, **kwargs):
        if str(path).endswith("plan.txt"):
            raise ENOSPC
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", full)
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=None)
    prl.append_plan_note(tmp_path, world, "dstrain: note: the sampler runs on rank 0")
    captured = capsys.readouterr()
    assert "dstrain: note: the sampler runs on rank 0" in captured.out
    assert captured.err.strip() == (f"dstrain: warning: {tmp_path / 'plan.txt'} could not be appended to (No space left "
                                    "on device); the note above is not in it")


# ---------------------------------------------------------------- (c) an asynchronous save killed halfway

def _cut_short(root: Path, step: int) -> Path:
    """What a SIGKILL leaves of an asynchronous save: renamed files, one in flight, rank 0's marker only."""
    tag_dir = root / ckpt.tag_for(step)
    (tag_dir / "written").mkdir(parents=True)
    (tag_dir / "written" / "rank_00000").touch()
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"PK" + b"\0" * 64)
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt.partial").write_bytes(b"\0" * 64)
    return tag_dir


def _complete(root: Path, step: int, keep: int) -> None:
    (root / ckpt.tag_for(step)).mkdir(parents=True, exist_ok=True)
    ckpt.mark_complete(root, ckpt.tag_for(step), {}, {}, {"step": step}, keep=keep)


def test_a_save_killed_halfway_is_never_the_latest_and_does_not_stay_for_good(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    _complete(root, 100, keep=2)
    cut = _cut_short(root, 137)  # the stop's save at step 137, killed
    (root / ckpt.LATEST).write_text(ckpt.tag_for(137) + "\n")  # (not trusted: only COMPLETE markers decide)
    assert ckpt.find_latest(root) == ckpt.tag_for(100)
    assert ckpt.resolve_checkpoint(tmp_path / "run") == (root, ckpt.tag_for(100))  # dstrain export, too
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.resolve_checkpoint(cut)
    # resumed from step 100, saving every 50 steps: step 137 is never saved again
    _complete(root, 150, keep=2)
    assert cut.is_dir()  # still newer than the oldest kept (step 100)
    later = _cut_short(root, 180)
    _complete(root, 200, keep=2)
    assert not cut.exists() and later.is_dir()  # older than step 150, the oldest kept; 180 is between the kept
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [ckpt.tag_for(s) for s in (150, 180, 200)]
    _complete(root, 250, keep=2)
    assert ckpt.complete_tags(root) == [ckpt.tag_for(200), ckpt.tag_for(250)] and not later.exists()


# ---------------------------------------------------------------- (d) two launches within a second

def test_two_runs_taking_a_folder_without_flock_at_once_leave_one(tmp_path, no_lock, monkeypatch):
    import fcntl

    def no_flock(_fd, _op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    out = tmp_path / "run"
    out.mkdir()
    rival = f"{os.getpid() + 1} gpu-node-2 {time.time():014.1f}\n"  # the other launch, on another host

    class Clock:  # the rival writes the lock file while this run waits to read it back
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def sleep(seconds):
            (out / run_lock.NAME).write_text(rival)
    monkeypatch.setattr(run_lock, "time", Clock())
    problem = common._lock_run_folder(out)
    assert problem == (f"output.dir {out} is in use by another run (process {os.getpid() + 1} on gpu-node-2), started "
                       "at the same moment on a file system without locks; wait for it or choose another output.dir")
    assert run_lock._HELD == [] and (out / run_lock.NAME).read_text() == rival  # the winner's record stays
    monkeypatch.setattr(run_lock, "time", time)
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.05)
    (out / run_lock.NAME).write_text("")
    assert common._lock_run_folder(out) is None  # alone: the file reads back as this run's


def test_a_flock_race_names_the_winner_once_it_has_written(tmp_path, no_lock, monkeypatch):
    import fcntl
    import threading
    out = tmp_path / "run"
    out.mkdir()
    winner = open(out / run_lock.NAME, "w")  # took the flock, its record not yet written
    fcntl.flock(winner, fcntl.LOCK_EX | fcntl.LOCK_NB)
    late = threading.Timer(0.1, lambda: (winner.write("4242 node-a 0\n"), winner.flush()))
    late.start()
    try:
        problem = common._lock_run_folder(out)
    finally:
        late.join()
        winner.close()
    assert problem == (f"output.dir {out} is in use by another run (process 4242 on node-a); wait for it or choose "
                       "another output.dir")


# ---------------------------------------------------------------- (e) the terminal hung up (ssh ended, no nohup)

def test_a_hung_up_terminal_does_not_end_the_run(tmp_path):
    from dstrain.lost_terminal import TolerantStream
    master, slave = os.openpty()
    raw = open(slave, "w", buffering=1)
    out = TolerantStream(raw)
    try:
        print("step 4: loss 2.31", file=out, flush=True)
        assert os.read(master, 100).replace(b"\r", b"") == b"step 4: loss 2.31\n"
        os.close(master)  # the ssh session ends: its terminal hangs up
        with pytest.raises(OSError) as unguarded:
            os.write(slave, b"x")
        assert unguarded.value.errno == errno.EIO  # what a rank's print met before
        print("dstrain: stopped by SIGHUP at step 5; saved checkpoint step_00000005", file=out, flush=True)
        print("step 6", file=out)
        out.flush()
        assert out.lost and os.write(raw.fileno(), b"native") == 6  # the descriptor now writes to /dev/null
    finally:
        raw.close()


def test_only_a_lost_terminal_is_swallowed(monkeypatch):
    import io
    import sys

    from dstrain import lost_terminal

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")  # stdout sent to a file on a full disk
    with pytest.raises(OSError, match="No space left"):
        lost_terminal.TolerantStream(Full()).write("x")
    real = io.StringIO()
    monkeypatch.setattr(sys, "stdout", real)
    monkeypatch.setattr(sys, "__stdout__", real)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # (a test's capture: left alone)
    lost_terminal.guard()
    assert isinstance(sys.stdout, lost_terminal.TolerantStream) and isinstance(sys.stderr, io.StringIO)


# ---------------------------------------------------------------- (f) a copied run folder, exported

def test_a_moved_policy_run_exports_with_its_warm_start_found_in_its_folder(tmp_path, monkeypatch, capsys):
    import json

    from models import registry
    old = "/old/machine/runs/grpo/warm_start"
    run = tmp_path / "copied" / "grpo"
    tag_dir = run / "checkpoints" / ckpt.tag_for(4)
    tag_dir.mkdir(parents=True)
    (tag_dir / ckpt.COMPLETE).write_text("{}")
    (tag_dir / "run_config.json").write_text(json.dumps({"model": {"name": "policy", "size": "tiny",
                                                                   "args": {"path": old}}}))
    (run / "warm_start").mkdir()
    (run / "warm_start" / "config.json").write_text("{}")
    seen = {}
    monkeypatch.setattr(registry, "get_spec", lambda name: SimpleNamespace(rl=SimpleNamespace(
        export_pretrained=lambda state, mcfg, out: seen.update(out=out))))
    monkeypatch.setattr(registry, "make_model_config", lambda name, size, args: seen.update(args=args) or args)
    monkeypatch.setattr(ckpt, "consolidated_state_dict", lambda path: ({}, {}))
    assert prl.export_policy_checkpoint(run, tmp_path / "hf") == tmp_path / "hf"
    assert seen["args"] == {"path": str(run / "warm_start")}
    assert f"dstrain: note: {old}, recorded by the run, is gone; using {run / 'warm_start'}" in capsys.readouterr().err
    assert prl.run_path_here(str(run / "warm_start"), run) == str(run / "warm_start")  # found: unchanged
    assert prl.run_path_here("/nowhere/else", run) == "/nowhere/else"  # (then the model's own error says it)
