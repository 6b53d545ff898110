"""Fault-injection round 7: a resume in another precision, a disk that fills at a run's start or end, a clock
behind another host's. Every test runs in this process (no rank is launched).

* **``--resume`` with ``--deepspeed.precision`` other than the checkpoint's** (fp32 checkpoint, bf16 asked:
  a recipe edited, a flag copied from another job). ``pin_plan`` keeps the checkpoint's precision only when the
  run leaves it at auto. Before: the plan was made, the folder's ``run_config.json`` and ``plan.txt`` were
  rewritten, and DeepSpeed's load failed: at ZeRO-0 a ``KeyError: 'dynamic_loss_scale'`` traceback, at ZeRO-1/2
  "checkpoint ... could not be loaded (... bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt) ...; remove it (or
  its COMPLETE file) to resume from the one before": advice to throw away a good checkpoint. After: refused in
  one line naming both precisions and the fix (``--deepspeed.precision=fp32``, or auto; or export and start
  anew), by ``dstrain launch`` before any rank starts when the precision is named, else by rank 0 after the
  plan and before anything is written (ZeRO stage changes, round 2, are refused at the same point; SCoRe now
  checks both too).
* **The disk full (or over quota) when a run starts** (a disk that a crashed run or a neighbour filled). Before:
  rank 0's ``OSError`` traceback, its peers waiting in a broadcast: from ``datasets`` filling the corpus cache
  under ``output.dir`` ("Not enough disk space. Needed: Unknown size", seen on a full 20 MB tmpfs), from the
  run-folder lock's heartbeat write, or from the writes of ``run_config.json`` / ``ds_config.json`` /
  ``plan.txt``, a write that failed leaving that file cut short. (Where those rewrites happened to fit in the
  files' old blocks, the run trained up to its first save and stopped there, exit 4.) After: one line naming
  the cache or the file, the free space and the fix (exit 2), before any step; each record is written beside
  its file and renamed, so the earlier one stays whole.
* **The disk full when ``latest`` is written**, after the checkpoint's ``COMPLETE`` marker. Before: the
  ``OSError`` stopped the run with "checkpoint step_X could not be written ... checkpoint step_X is complete"
  (exit 4), left ``latest.tmpPID`` beside it and skipped the removal of checkpoints past ``checkpoint.keep``,
  the space that would have let the run go on. After: the checkpoint counts (only ``COMPLETE`` markers
  decide), the old ones are removed as usual, no stray file stays, and ``latest`` (read by DeepSpeed's
  ``zero_to_fp32.py`` only) is removed rather than left naming a removed checkpoint.
* **The disk full (or the folder gone) when a run writes ``summary.json``** after its last save. Before: an
  ``OSError`` traceback and exit 1 from a run that finished (or stopped by a signal: its 128 + N lost), which
  ``--max-restarts`` restarted, and a summary cut short. After: one warning holding the summary; the run's
  status is its own.
* **Another host's run whose clock is behind this host's** (a node without NTP, a clock stepped back), on a
  folder shared without cross-host flocks (round 6). Its heartbeats, written by its own clock, read more than
  ``STALE_S`` old here. Before: the live run's folder was taken over at once ("no heartbeat for 300 s"), and two
  runs wrote one folder. After: a lock that looks stale from another host is watched for ``CONFIRM_S`` (a
  heartbeat period and 5 s, on the monotonic clock); a new heartbeat refuses the folder naming both hosts and
  the clock difference; none (the host is down) is the takeover of round 6.
"""
from __future__ import annotations

import builtins
import errno
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from dstrain import checkpoint as ckpt
from dstrain import run_lock
from dstrain.cli import _output_problem
from dstrain.config import RunFolderError, load_run_config
from dstrain.trainers import common
from dstrain.trainers.run_files import write_summary
from tests.unit.conftest import RECIPE, tiny_checkpoint

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def _cfg(out: Path, *overrides: str):
    return load_run_config(RECIPE, [f"--output.dir={out}", "--deepspeed.profile=zero0", *overrides])


# ---------------------------------------------------------------- (a) a resume in another precision

@pytest.mark.parametrize("saved, asked", [("fp32", "bf16"), ("bf16", "fp32")])
def test_a_resume_in_another_precision_is_refused_before_anything_is_written(tmp_path, one_rank, saved, asked):
    out = tmp_path / "run"
    tiny_checkpoint(out, 2, precision=saved, profile="zero0")
    (out / "plan.txt").write_text("the checkpoint's run\n")
    cfg = _cfg(out, f"--deepspeed.precision={asked}", "--checkpoint.resume=true")
    fix = f"resume with --deepspeed.precision={saved} (or leave it at auto), or export the weights"
    problem = _output_problem(cfg, resume=True)  # dstrain launch, before any rank starts
    assert problem is not None and f"step_00000002 was written in {saved}, this run plans {asked}" in problem
    assert fix in problem
    with pytest.raises(RunFolderError, match=f"was written in {saved}, this run plans {asked}") as caught:
        common.plan_and_record(cfg, one_rank, out, resume=(out / "checkpoints", ckpt.tag_for(2)))
    assert fix in str(caught.value)
    assert (out / "plan.txt").read_text() == "the checkpoint's run\n"  # the folder's records are the checkpoint's run's
    assert not (out / "run_config.json").exists()


def test_a_resume_in_the_checkpoints_precision_goes_on(tmp_path, one_rank):
    out = tmp_path / "run"
    tiny_checkpoint(out, 2, precision="fp32", profile="zero0")
    for named in ([], ["--deepspeed.precision=fp32"]):  # auto takes the checkpoint's (pin_plan)
        cfg = _cfg(out, *named, "--checkpoint.resume=true")
        assert _output_problem(cfg, resume=True) is None
        common.pin_plan(cfg, out / "checkpoints", ckpt.tag_for(2))
        plan = common.plan_and_record(cfg, one_rank, out, resume=(out / "checkpoints", ckpt.tag_for(2)))
        assert plan.precision == "fp32" and json.loads((out / "run_config.json").read_text())["deepspeed"]


# ---------------------------------------------------------------- (b) the disk full when a run starts

def test_a_full_disk_at_the_start_is_one_line_and_leaves_the_folders_records_whole(tmp_path, one_rank, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run_config.json").write_text('{"the": "earlier run"}\n')
    real = Path.write_text

    def full(path, text, *args, **kwargs):  # half the bytes reach the file, then the disk is full
        if Path(path).parent == out:
            real(path, text[: len(text) // 2], *args, **kwargs)
            raise ENOSPC
        return real(path, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(RunFolderError) as caught:
        common.plan_and_record(_cfg(out), one_rank, out)
    line = str(caught.value)
    assert line.startswith(f"output.dir {out}: run_config.json could not be written (no space left on device, ")
    assert "free there); nothing was trained" in line and "free space or make the folder writable" in line
    assert (out / "run_config.json").read_text() == '{"the": "earlier run"}\n'
    assert sorted(p.name for p in out.iterdir()) == ["run_config.json"]  # nothing half-written beside it


@pytest.mark.parametrize("error", [OSError("Not enough disk space. Needed: Unknown size (download: Unknown size, "
                                           "generated: Unknown size, post-processed: Unknown size)"), ENOSPC])
def test_a_data_cache_the_full_disk_cannot_hold_is_one_line(tmp_path, one_rank, monkeypatch, error):
    from dstrain.trainers import lm

    def full(*_args, **_kwargs):  # datasets' own check of the free space, or the write itself
        raise error
    monkeypatch.setattr(lm, "load_documents", full)
    out = tmp_path / "run"
    with pytest.raises(RunFolderError) as caught:
        lm.load_token_streams(_cfg(out), one_rank)
    assert str(caught.value).startswith(f"the data cache {out / '.cache' / 'datasets'} could not be written (no "
                                        "space left on device, ")
    assert str(caught.value).endswith("free there); nothing was trained: free space, then start again")


def test_other_errors_of_the_data_cache_are_left_as_they_are(tmp_path, one_rank, monkeypatch):
    from dstrain.trainers import lm

    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr(lm, "load_documents", denied)
    with pytest.raises(PermissionError):
        lm.load_token_streams(_cfg(tmp_path / "run"), one_rank)


def test_a_lock_file_the_full_disk_cannot_take_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "_HELD", [])

    def full(*_args):
        raise ENOSPC
    monkeypatch.setattr(run_lock.os, "pwrite", full)
    out = tmp_path / "run"
    problem = common._lock_run_folder(out)
    assert problem.startswith(f"output.dir {out}: cannot be written (No space left on device: {out / run_lock.NAME}; ")
    assert problem.endswith(" free there); free space, then start again")
    assert run_lock._HELD == []


# ---------------------------------------------------------------- (c) the disk full when ``latest`` is written

def test_a_full_disk_at_the_latest_pointer_keeps_the_checkpoint_and_removes_the_old_ones(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        (root / ckpt.tag_for(step)).mkdir(parents=True)
        ckpt.mark_complete(root, ckpt.tag_for(step), {}, {}, {"step": step}, keep=2)
    (root / ckpt.tag_for(3)).mkdir()

    class Full:
        def __init__(self, path):
            builtins.open(path, "w").close()  # the file is made; its bytes do not fit

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, _text):
            raise ENOSPC

    def full_at_latest(path, *args, **kwargs):
        if Path(path).name.startswith(ckpt.LATEST + ".tmp"):
            return Full(path)
        return builtins.open(path, *args, **kwargs)
    monkeypatch.setattr(ckpt, "open", full_at_latest, raising=False)
    ckpt.mark_complete(root, ckpt.tag_for(3), {}, {}, {"step": 3}, keep=2)
    assert ckpt.find_latest(root) == ckpt.tag_for(3)
    assert sorted(p.name for p in root.iterdir()) == [ckpt.tag_for(2), ckpt.tag_for(3)]  # no latest.tmp*, step 1 gone


# ---------------------------------------------------------------- (d) the disk full when summary.json is written

def test_a_summary_that_cannot_be_written_is_a_warning_holding_it(tmp_path, capsys):
    gone = tmp_path / "run"  # the folder removed (or its disk full) when the run ends
    write_summary(gone, {"step": 7, "stopped": True})
    err = capsys.readouterr().err
    assert f"dstrain: warning: {gone / 'summary.json'} could not be written (No such file or directory)" in err
    assert 'its summary is this: {"step": 7, "stopped": true}' in err
    gone.mkdir()
    write_summary(gone, {"step": 7})
    assert json.loads((gone / "summary.json").read_text()) == {"step": 7} and len(list(gone.iterdir())) == 1


@pytest.mark.parametrize("trainer", ["lm", "hrm", "rl_loop"])
def test_every_trainer_writes_its_summary_through_the_guarded_writer(trainer):
    source = (Path(common.__file__).parent / f"{trainer}.py").read_text()
    assert "write_summary(self.out, summary)" in source and '"summary.json").write_text' not in source


# ---------------------------------------------------------------- (e) a live host whose clock is behind

def _beats(path: Path, behind_s: float, until: threading.Event) -> None:
    """Another host's holder, its clock ``behind_s`` behind this one's, renewing its heartbeat."""
    while not until.is_set():
        path.write_text(f"4242 gpu-node-17 {time.time() - behind_s:014.1f}\n")
        until.wait(0.05)


def test_a_live_run_whose_clock_is_behind_is_not_taken_over(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_lock, "_HELD", [])
    monkeypatch.setattr(run_lock, "CONFIRM_S", 1.0)
    out = tmp_path / "run"
    out.mkdir()
    path = out / run_lock.NAME
    stop = threading.Event()
    holder = threading.Thread(target=_beats, args=(path, run_lock.STALE_S + 180, stop))
    holder.start()
    try:
        time.sleep(0.1)
        problem = common._lock_run_folder(out)
    finally:
        stop.set()
        holder.join()
    assert problem is not None and problem.startswith(
        f"output.dir {out} is in use by another run (process 4242 on gpu-node-17): its heartbeat is still renewed "
        "although it reads 300 s old here (the clocks of gpu-node-17 and ")
    assert "check their NTP); wait for it or choose another output.dir" in problem
    assert path.read_text().startswith("4242 gpu-node-17 ") and run_lock._HELD == []
    assert "watching it for 1 s before taking over" in capsys.readouterr().err


def test_a_dead_hosts_lock_is_still_taken_over_after_the_watch(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_lock, "_HELD", [])
    monkeypatch.setattr(run_lock, "CONFIRM_S", 0.3)
    out = tmp_path / "run"
    out.mkdir()
    (out / run_lock.NAME).write_text(f"4242 gpu-node-17 {time.time() - run_lock.STALE_S - 180:014.1f}\n")
    started = time.monotonic()
    assert common._lock_run_folder(out) is None
    assert time.monotonic() - started >= 0.3
    assert (out / run_lock.NAME).read_text().startswith(f"{os.getpid()} {socket.gethostname()} ")
    assert "taking over output.dir" in capsys.readouterr().err
