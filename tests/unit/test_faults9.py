"""Fault-injection round 9: the run folder's lock after a rank's exit, a failed fresh run's folder, a SLURM job
requeued onto another node, and a deterministic error under ``--max-restarts``. Every test runs in this process
(no rank is launched).

* **A run that ends (finished, stopped, failed) and the next job on another host.** A rank started by
  ``dstrain launch`` (``python -m dstrain.cli train``) ends through ``runtime.exit_rank``, whose ``os._exit``
  runs no ``atexit`` handler, so the lock's release (emptying ``.dstrain.lock``) never ran: every run left its
  ``PID HOST TIME`` record. Before: the next job of a SLURM chain (``--dependency=afterany``, ``--resume``) or a
  retry that landed on another node within ``run_lock.STALE_S`` (120 s) of the last heartbeat was refused "in
  use by another run (process N on node-a, heartbeat 30 s ago ...)"; one that came later watched the file for
  ``CONFIRM_S`` and took over "from a host that stopped or died". After: ``exit_rank`` releases the lock first
  (``run_lock.release``): the file is empty, nothing to refuse or take over.
* **A fresh run that fails after taking its folder's lock** (the run records refused by a full disk, an error
  in the model's set-up, a bad data file), in a folder it created. ``cli._remove_if_only_cache`` removed a
  folder holding nothing but ``.cache``. Before: the folder held ``.dstrain.lock`` too, so it stayed, with the
  dead rank's lock record (above): the user's retry found a folder that looked like a run's, refused from another
  host. After: the lock is released and the folder removed when it holds nothing else (a lock another run wrote
  meanwhile keeps it; a folder with run records, metrics or checkpoints stays, as before).
* **A SLURM job requeued onto another node** (``--requeue`` after a node failure, ``scontrol requeue``): the
  dead node's record stays in the lock file, its heartbeat fresh. Before: the requeued job (same
  ``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT`` one more) was refused until the heartbeat was ``STALE_S`` old, then
  waited ``CONFIRM_S`` (about 140 s in all, longer than SLURM's requeue delay): the requeue failed with exit 2.
  After: the lock record names the SLURM job and its restart count (``slurm:JOBID.N``); a record of an earlier
  instance of this very job (SLURM ended it before requeuing) is taken over at once, after the ``CONFIRM_S``
  watch, which refuses it, in one line, when its heartbeat is still renewed (a node SLURM lost but the file
  system did not). Another job's record, or this instance's own count, is refused as before.
* **``--max-restarts K`` on a deterministic error** (a bug at step 150, a corrupt sample, a shape mismatch at
  start-up). Before: all K restarts ran, each resumed from the same checkpoint and met the same traceback at
  the same step, each costing a start-up (minutes on a cluster), the error buried under K copies of it. After:
  the first failing rank leaves its error and where it came (``RuntimeError: ... (in forward of step 150)``) in
  the job's failure folder; when two attempts in a row leave the same one, the launch stops with one line
  naming it ("fix it, then --resume"). Decided so because the second attempt already resumed from the
  checkpoint the first one did: a transient fault (a lost node, a killed rank, a flaky file system, a
  collective timing out) leaves no error (a signal) or another one or another step, and is still restarted.
* **``dstrain export`` of a policy run into a folder, killed halfway** (Ctrl-C, the scheduler's kill, a full
  disk). Before: transformers' ``save_pretrained`` wrote straight into the folder: ``config.json`` first, then the
  weights, then the tokenizer, so a kill left a folder that looked like a Hugging Face checkpoint (weights cut
  short, or no tokenizer), and a re-export killed halfway left the earlier export's files mixed with the new
  ones. After: the export is written beside it (``.NAME.partial``) and renamed into place; into a folder that
  holds an earlier export its files are moved over it, ``config.json`` removed first and moved last, so a folder
  with a ``config.json`` is always one whole export. (A ``.safetensors`` export was already written beside
  and renamed.)
* **A resume with another ``data.seq_len``** (README: "another recipe": the new value applies, on the
  checkpoint's data position). The position was kept in samples: the checkpoint's 900 samples of 128 tokens
  became 900 samples of 256 (or 64), twice (or half) as far into the data: doubling the length 90% through epoch
  0 went on 80% through epoch 1 (most of the data never trained on), halving it went back to 45% of epoch 0
  (the same text trained on again). After: the LM trainer goes on as many tokens in (sample 450 of 256, 1800
  of 64), with a note that says so and that the rest of the epoch comes in another window order. (A changed
  ``train.micro_batch`` or world size was already mapped by ``samples``: README, "another global batch".)
* **TensorBoard events or ``metrics.jsonl`` that cannot be opened when a run starts** (``tensorboard`` a link
  to a mount that is gone, a folder not writable, something in the way). Round 3 made a sink that fails mid-run
  one warning; before, one that failed at the start was rank 0's traceback before the first step (exit 1, and
  ``--max-restarts`` met it again at every restart). After: one warning naming the path, that sink off, the
  run goes on.

Checked and left as they were: a rank's ``.pt`` shard cut short or empty (refused in one line naming the
checkpoint before it, round 2); a clock that jumps (the watchdog, the asynchronous save's wait and the lock's
takeover watch use ``time.monotonic``; there is no time-based checkpointing; the lock's wall-clock heartbeat
across hosts is confirmed by watching it for ``run_lock.CONFIRM_S``); a read-only ``output.dir`` at start
(``dstrain launch`` probes it; a rank's lock is one line); ``stopped.json`` unreadable or from a newer version
(read as no stop record: the restarted ranks train on, as without torchrun's restarts).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dstrain import cli, run_lock, runtime, supervise
from dstrain.resilience import Watchdog

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")


class _Exited(Exception):
    pass


def test_a_rank_ending_through_exit_rank_leaves_its_folder_free_for_another_host(tmp_path, no_lock, monkeypatch):
    out = tmp_path / "run"
    assert run_lock.take(out) is None
    assert (out / run_lock.NAME).read_text().strip()  # the holder's record while it runs

    def exit_(code):
        raise _Exited(code)
    monkeypatch.setattr(runtime.os, "_exit", exit_)
    with pytest.raises(_Exited):
        runtime.exit_rank(0)
    assert (out / run_lock.NAME).read_text() == "" and run_lock._HELD == []
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")  # the next job of the chain, on another node
    assert run_lock.probe(out) is None
    assert run_lock.take(out) is None


class _FailingAfterLock:
    """Takes the folder's lock and fills the data cache, as a trainer does, then fails."""

    def __init__(self, out: Path):
        self.out = out

    def train(self, cfg):
        assert run_lock.take(self.out) is None
        (self.out / ".cache" / "datasets").mkdir(parents=True)
        raise RuntimeError("boom after the lock was taken")


def test_a_failed_fresh_run_leaves_no_folder_holding_only_its_lock_and_cache(tmp_path, no_lock, monkeypatch, capsys):
    from dstrain import trainers
    out = tmp_path / "run"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for var in ("RANK", "WORLD_SIZE", "DSTRAIN_FAILURE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(trainers, "get_trainer", lambda name: _FailingAfterLock(out))
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    assert cli.main(["train", RECIPE, f"--output.dir={out}", "--deepspeed.profile=zero1"]) == 1
    assert "boom after the lock was taken" in capsys.readouterr().err
    assert not out.exists() and run_lock._HELD == []
    # a lock that another run wrote there meanwhile: its folder now, left as it is
    (out / ".cache").mkdir(parents=True)
    (out / run_lock.NAME).write_text("4242 node-b 001795818635.4\n")
    cli._remove_if_only_cache(out)
    assert (out / run_lock.NAME).read_text().startswith("4242")


def _requeue(monkeypatch, tmp_path, holder_job: str, restarts: str = "1", beat_age: float = 5.0) -> Path:
    """A lock file left by ``holder_job`` on node-a (dead), seen from this job (SLURM job 4711) on node-b."""
    out = tmp_path / "run"
    out.mkdir()
    (out / run_lock.NAME).write_text(f"999 node-a {time.time() - beat_age:014.1f} slurm:{holder_job}\n")
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURM_RESTART_COUNT", restarts)
    monkeypatch.setattr(run_lock, "CONFIRM_S", 0.3)
    return out


def test_a_slurm_job_requeued_onto_another_node_takes_its_folder_over(tmp_path, no_lock, monkeypatch, capsys):
    out = _requeue(monkeypatch, tmp_path, "4711.0")
    assert run_lock.probe(out) is None  # dstrain launch's check before any rank starts
    assert run_lock.take(out) is None
    err = capsys.readouterr().err
    assert "SLURM job 4711 was requeued (restart 1; the holder was its restart 0, which SLURM ended)" in err
    record = (out / run_lock.NAME).read_text().split()
    assert record[1] == "node-b" and record[3] == "slurm:4711.1"


@pytest.mark.parametrize("holder", ["4712.0", "4711.1", None])
def test_another_jobs_or_this_instances_fresh_lock_is_still_refused(tmp_path, no_lock, monkeypatch, holder):
    out = _requeue(monkeypatch, tmp_path, holder or "x")
    if holder is None:  # a record without the SLURM field (an older dstrain, or a run outside SLURM)
        (out / run_lock.NAME).write_text(f"999 node-a {time.time() - 5:014.1f}\n")
    problem = run_lock.take(out)
    assert problem and problem.startswith(f"output.dir {out} is in use by another run (process 999 on node-a, "
                                          "heartbeat 5 s ago;")


def test_a_requeued_job_whose_earlier_instance_still_beats_is_refused(tmp_path, no_lock, monkeypatch, capsys):
    out = _requeue(monkeypatch, tmp_path, "4711.0")
    path = out / run_lock.NAME

    def beat():  # the old node: lost by SLURM, still writing the shared file system
        time.sleep(0.1)
        path.write_text(f"999 node-a {time.time():014.1f} slurm:4711.0\n")
    thread = threading.Thread(target=beat)
    thread.start()
    problem = run_lock.take(out)
    thread.join()
    assert problem == (f"output.dir {out} is in use by another run (process 999 on node-a): the earlier instance of "
                       "SLURM job 4711 still renews its heartbeat (its node lost from SLURM, not from the file "
                       "system); wait for it to end or choose another output.dir")
    assert run_lock._HELD == []


def _attempts(errors: list[str | None], code: int = 1):
    calls, logs = [], []

    def attempt(resume):
        calls.append(resume)
        return code
    return calls, logs, attempt, (lambda: errors[len(calls) - 1])


def test_the_same_error_at_the_same_step_twice_stops_the_restarts(monkeypatch):
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    same = "RuntimeError: shape mismatch (in forward of step 150)"
    calls, logs, attempt, error = _attempts([same, same, same, same])
    assert supervise.run_with_restarts(attempt, 3, logs.append, error=error) == 1
    assert calls == [False, True]
    assert logs[-1] == (f"dstrain: job failed again with the same error at the same point: {same}; not restarting "
                        "it (2 restart(s) left unused: a deterministic error, which every restart would meet again): "
                        "fix it, then --resume")


@pytest.mark.parametrize("errors", [
    [None, None, None, None],  # a rank killed (a signal, a lost node): no error left
    ["E: x (in forward of step 150)", "E: x (in forward of step 170)", "E: x (in forward of step 150)", None],
    ["OSError: stale file handle (in save of step 100)", None, "OSError: stale file handle (in save of step 100)",
     None]])
def test_failures_that_differ_from_one_attempt_to_the_next_are_restarted(monkeypatch, errors):
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    calls, logs, attempt, error = _attempts(errors)
    assert supervise.run_with_restarts(attempt, 3, logs.append, error=error) == 1
    assert calls == [False, True, True, True] and logs[-1].endswith("after 3 restart(s); giving up")


def test_the_first_failing_rank_leaves_its_error_and_where_for_the_launch(tmp_path, monkeypatch, capsys):
    from dstrain import rank_exit, trainers

    class Failing:
        def train(self, cfg):
            Watchdog.last = ("forward", 150)
            raise RuntimeError("shape mismatch\nsecond line")
    folder = tmp_path / "job"
    folder.mkdir()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(folder))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainers, "get_trainer", lambda name: Failing())
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    monkeypatch.setattr(Watchdog, "last", (None, 0))
    assert cli.main(["train", RECIPE, f"--output.dir={tmp_path / 'run'}", "--deepspeed.profile=zero1"]) == 1
    assert "Traceback" in capsys.readouterr().err
    assert rank_exit.error_of(folder) == "RuntimeError: shape mismatch (in forward of step 150)"


def test_launch_stops_restarting_a_job_that_fails_the_same_way_twice(tmp_path, monkeypatch, capsys):
    from dstrain import cli_checks, job_guard, rank_exit
    started = []

    def start_job(argv, env, port=None):  # an attempt whose rank 0 fails at step 150, every time
        started.append(argv)
        Path(env["DSTRAIN_FAILURE_DIR"], rank_exit.ERROR_FILE).write_text("ValueError: bad sample (in forward of "
                                                                          "step 150)")
        return SimpleNamespace(pid=os.getpid(), wait=lambda: 1)
    monkeypatch.setattr(job_guard, "start_job", start_job)
    monkeypatch.setattr(cli_checks, "check_before_launch", lambda *args: None)
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    code = cli.main(["launch", "--nproc", "1", "--accelerator", "cpu", "--max-restarts", "5", RECIPE,
                     f"--output.dir={tmp_path / 'run'}"])
    assert code == 1 and len(started) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "dstrain: job failed again with the same error at the same point: ValueError: bad sample (in forward of step "
        "150); not restarting it (4 restart(s) left unused: a deterministic error, which every restart would meet "
        "again): fix it, then --resume")


def _policy_run(tmp_path, monkeypatch, export):
    import json

    from dstrain import checkpoint as ckpt
    from models import registry
    run = tmp_path / "grpo"
    tag_dir = run / "checkpoints" / ckpt.tag_for(4)
    tag_dir.mkdir(parents=True, exist_ok=True)
    (tag_dir / ckpt.COMPLETE).write_text("{}")
    (tag_dir / "run_config.json").write_text(json.dumps({"model": {"name": "policy", "size": "tiny"}}))
    monkeypatch.setattr(registry, "get_spec", lambda name: SimpleNamespace(rl=SimpleNamespace(
        export_pretrained=export)))
    monkeypatch.setattr(registry, "make_model_config", lambda name, size, args: args)
    monkeypatch.setattr(ckpt, "consolidated_state_dict", lambda path: ({}, {}))
    return run


def _save_pretrained(version: str, killed: bool = False):
    def export(state, mcfg, out):  # as transformers writes a folder: config, weights, then the tokenizer
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(version)
        (out / "model.safetensors").write_text(version[: 3 if killed else None])
        if killed:
            raise KeyboardInterrupt  # (Ctrl-C, or the scheduler's kill, halfway through the weights)
        (out / "tokenizer.json").write_text(version)
    return export


def test_an_export_killed_halfway_never_looks_like_a_whole_checkpoint(tmp_path, monkeypatch):
    from dstrain.trainers import policy_rl as prl
    hf = tmp_path / "hf"
    run = _policy_run(tmp_path, monkeypatch, _save_pretrained("first export", killed=True))
    with pytest.raises(KeyboardInterrupt):
        prl.export_policy_checkpoint(run, hf)
    assert not hf.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["grpo"]  # no partial folder left
    _policy_run(tmp_path, monkeypatch, _save_pretrained("first export"))
    assert prl.export_policy_checkpoint(run, hf) == hf
    (hf / "README.md").write_text("the user's notes")
    _policy_run(tmp_path, monkeypatch, _save_pretrained("second export", killed=True))
    with pytest.raises(KeyboardInterrupt):
        prl.export_policy_checkpoint(run, hf)  # a re-export killed halfway: the first one stays whole
    assert {p.name: p.read_text() for p in hf.iterdir()} == {
        "config.json": "first export", "model.safetensors": "first export", "tokenizer.json": "first export",
        "README.md": "the user's notes"}
    _policy_run(tmp_path, monkeypatch, _save_pretrained("second export"))
    prl.export_policy_checkpoint(run, hf)
    assert {p.name: p.read_text() for p in hf.iterdir()} == {
        "config.json": "second export", "model.safetensors": "second export", "tokenizer.json": "second export",
        "README.md": "the user's notes"}


@pytest.mark.parametrize("seq_len, at", [(128, 900), (256, 450), (64, 1800), (100, 1152)])
def test_a_resume_with_another_seq_len_continues_as_many_tokens_in(tmp_path, monkeypatch, capsys, seq_len, at):
    """The checkpoint took 900 samples of 128 tokens; the data order goes on 115200 tokens in."""
    import json

    from dstrain.trainers import lm
    tag = tmp_path / "step_00000010"
    tag.mkdir()
    (tag / "ds_config.json").write_text(json.dumps({"train_batch_size": 90}))
    (tag / "run_config.json").write_text(json.dumps({"data": {"seq_len": 128}}))
    monkeypatch.setattr(lm, "load_checkpoint", lambda *args: {"step": 10, "samples": 900})
    monkeypatch.setattr(lm, "warn_batch_change", lambda *args, **kwargs: None)
    trainer = lm.LMTrainer.__new__(lm.LMTrainer)
    trainer.engine, trainer.ckpt_root, trainer.world = None, tmp_path, SimpleNamespace(is_main=True)
    trainer.train_tokens = range(230_401)  # 1,800 windows of 128 tokens: every case within epoch 0
    trainer.cfg = SimpleNamespace(data=SimpleNamespace(seq_len=seq_len), train=SimpleNamespace(steps=100))
    trainer.plan, trainer.guards = SimpleNamespace(ds_config={"train_batch_size": 90}), SimpleNamespace()
    trainer._resume(tag.name)
    assert trainer.data_start == (10, at)
    out = capsys.readouterr().out
    assert ("data.seq_len 128 -> " in out) == (seq_len != 128)


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "mount-gone" / path.name)  # a link to a mount that is gone


@pytest.mark.parametrize("sink", ["tensorboard", "metrics.jsonl"])
def test_a_log_sink_that_cannot_be_opened_at_start_costs_a_warning_not_the_run(tmp_path, capsys, sink):
    from dstrain.metrics import RunLogger
    (tmp_path / sink).mkdir() if sink == "metrics.jsonl" else _dangling(tmp_path / sink)  # (a folder in the way)
    log = RunLogger(tmp_path, rank=0, total_steps=3, tensorboard=True, progress=False)
    log.log(1, {"loss": 2.5})
    log.close()
    err = capsys.readouterr().err
    what = "TensorBoard events" if sink == "tensorboard" else "metrics.jsonl"
    assert err.startswith(f"dstrain: warning: {what} cannot be written at {tmp_path / sink} (")
    assert err.rstrip().endswith(f"no {what} for this run, which goes on (make it writable, or remove what is in "
                                 "the way, for the next)") and err.count("\n") == 1
    if sink == "tensorboard":
        assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "train/loss": 2.5}\n'
    else:
        assert any((tmp_path / "tensorboard").iterdir())
