"""Fault-injection round 3: a run folder resumed after its recipe was edited, a metrics sink that fails
mid-run, a stop whose save outlasts the launcher's patience, what an earlier run leaves in the folder, and a
Ctrl-C before the job starts. (The 2-rank check of the first item through DeepSpeed's ZeRO-2 loader:
``tests/dist/test_resume_settings.py``, marked slow.)

* **Resume with ``train.lr`` (or ``weight_decay``, ``betas``) changed.** Before: DeepSpeed's
  ``load_checkpoint`` put the checkpoint's parameter groups and the scheduler's base rates back, so the
  run went on with the old values and said nothing (a resume meant to lower the rate after a loss spike
  did not lower it; HRM's puzzle-embedding rate, scaled by the engine's rate over ``train.lr``, was off
  by their ratio). After: the run config's settings are kept (``dstrain.engine.resume_settings``), the
  schedule's position and the moments are the checkpoint's.
* **Resume with any setting changed** (``train.lr``, ``train.steps``, ``data.seq_len`` ...). Before:
  silent (only a changed global batch was named). After: rank 0 prints one ``dstrain: note:`` line
  naming each change, old -> new.
* **TensorBoard events (or metrics.jsonl) that cannot be written mid-run** (disk full under
  ``tensorboard/``, a folder on another mount gone). Before: rank 0 died with the writer's traceback
  (exit 1, which ``--max-restarts`` restarted into the same failure), losing the steps since the last
  checkpoint. After: one warning, that sink closed, training and the other sink go on.
* **``metrics.jsonl`` after a kill and a resume.** Before: the steps logged between the last checkpoint and
  the kill appeared twice (the dead attempt's values first), and a line cut short by the kill (or a full
  disk) had the resumed run's first record glued to it, so the file no longer parsed. After: a run drops the
  records past the step it starts from, and any line cut short, as TensorBoard's ``purge_step`` does.
* **A stop (Ctrl-C, SIGTERM to ``dstrain launch``, or to its job guard when ``dstrain launch`` was killed) whose
  checkpoint takes more than 30 s to save.** Before: the signal went to the job's whole process group, so
  DeepSpeed's ``launch.py`` and torchrun's agent got it too; each passes it on to its ranks and SIGKILLs those
  still running 30 s later, cutting off the save (no checkpoint at the stop's step, a "lost contact" line).
  After: the ranks on this host get the signal (``job_guard.stop_job``), the launchers in between none; they end
  when their ranks have saved and left.
* **An earlier run's ``summary.json`` (finished, or garbled) in ``output.dir``.** Before: a resumed run
  that crashed left it, describing the earlier run as the folder's outcome. After: a run that takes the
  folder removes it; it writes its own when it ends.
* **Ctrl-C during ``dstrain launch``'s checks, before any rank starts.** Before: a 30-line
  ``KeyboardInterrupt`` traceback. After: one line, exit 130.
"""
from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain import checkpoint as ckpt
from dstrain import cli, job_guard
from dstrain.config import load_run_config
from dstrain.engine.engine import Engine
from dstrain.metrics import RunLogger
from dstrain.trainers import common

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")


def _schedule(k: int) -> float:
    return 0.5 ** k


class FakeDeepSpeed:
    """What ``Engine.load`` touches of DeepSpeed's engine: ``optimizer``, ``lr_scheduler`` and a
    ``load_checkpoint`` that restores them whole, as DeepSpeed's does (``optimizer.load_state_dict``,
    ``lr_scheduler.load_state_dict``)."""

    def __init__(self, lr, weight_decay, betas):
        torch.manual_seed(0)
        self.decay, self.plain = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))
        self.optimizer = torch.optim.AdamW([{"params": [self.decay], "weight_decay": weight_decay},
                                            {"params": [self.plain], "weight_decay": 0.0}], lr=lr, betas=betas)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule)
        self.saved = None

    def train_steps(self, n):
        for _ in range(n):
            (self.decay.sum() + self.plain.sum()).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.lr_scheduler.step()

    def save_checkpoint(self):
        self.saved = {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_checkpoint(self, _dir, tag):
        self.optimizer.load_state_dict(self.saved["optimizer"])
        self.lr_scheduler.load_state_dict(self.saved["lr_scheduler"])
        return f"{_dir}/{tag}", {}


def _engine(ds):
    return Engine(ds, SimpleNamespace(compile=False, compile_mode="default", attention_backend="auto"))


def test_a_resume_trains_with_this_runs_learning_rate_weight_decay_and_betas():
    old = FakeDeepSpeed(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    old.train_steps(3)
    old.save_checkpoint()
    new = FakeDeepSpeed(lr=0.001, weight_decay=0.05, betas=(0.8, 0.9))
    new.saved = old.saved
    engine = _engine(new)
    engine.load("ckpts", "step_00000003")

    decay, plain = new.optimizer.param_groups
    assert new.lr_scheduler.last_epoch == 3                                   # the schedule's position: the checkpoint's
    assert decay["lr"] == pytest.approx(0.001 * _schedule(3)) and plain["lr"] == pytest.approx(0.001 * _schedule(3))
    assert decay["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.9) and plain["betas"] == (0.8, 0.9)
    moments = old.optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(new.optimizer.state_dict()["state"][0]["exp_avg"], moments)  # the moments: the checkpoint's
    new.train_steps(1)
    assert decay["lr"] == pytest.approx(0.001 * _schedule(4))                  # and the schedule goes on from there
    assert set(engine.settings_changed) == {"lr 0.01 -> 0.001", "weight_decay 0.1 -> 0.05",
                                            "betas (0.9, 0.95) -> (0.8, 0.9)"}


def test_a_resume_with_the_same_settings_changes_nothing():
    old = FakeDeepSpeed(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    old.train_steps(2)
    old.save_checkpoint()
    new = FakeDeepSpeed(lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    new.saved = old.saved
    engine = _engine(new)
    engine.load("ckpts", "step_00000002")
    assert engine.settings_changed == []
    assert [g["lr"] for g in new.optimizer.param_groups] == [g["lr"] for g in old.optimizer.param_groups]


def _complete_checkpoint(out: Path, step: int, run_config: dict) -> Path:
    tag_dir = out / "checkpoints" / ckpt.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "run_config.json").write_text(json.dumps(run_config))
    (tag_dir / "trainer_state.json").write_text(json.dumps({"step": step}))
    (tag_dir / ckpt.COMPLETE).write_text("{}\n")
    return tag_dir


def test_a_resume_names_the_settings_changed_since_the_checkpoint(capsys, tmp_path, one_rank):
    out = tmp_path / "run"
    saved = load_run_config(RECIPE, [f"--output.dir={out}", "--deepspeed.profile=zero0"]).to_dict()
    tag_dir = _complete_checkpoint(out, 3, saved)
    cfg = load_run_config(RECIPE, [f"--output.dir={out}", "--train.lr=0.0005", "--data.seq_len=64",
                                   "--train.steps=400", "--checkpoint.every=50", "--checkpoint.resume=true"])
    assert common.decide_resume(cfg, one_rank, out, out / "checkpoints") == tag_dir.name
    note = [line for line in capsys.readouterr().out.splitlines() if line.startswith("dstrain: note:")]
    assert len(note) == 1, note
    assert f"resuming {tag_dir} with settings changed" in note[0]
    assert "data.seq_len 128 -> 64, train.steps 300 -> 400, train.lr 0.002 -> 0.0005;" in note[0]
    assert "deepspeed." not in note[0] and "checkpoint.every" not in note[0] and "output.dir" not in note[0]


def test_a_resume_with_the_checkpoints_settings_says_nothing_more(capsys, tmp_path, one_rank):
    out = tmp_path / "run"
    _complete_checkpoint(out, 3, load_run_config(RECIPE, [f"--output.dir={out}"]).to_dict())
    cfg = load_run_config(RECIPE, [f"--output.dir={out}", "--checkpoint.resume=true"])
    common.decide_resume(cfg, one_rank, out, out / "checkpoints")
    assert "note" not in capsys.readouterr().out


@pytest.mark.parametrize("earlier", ['{"step": 300, "stopped": false}\n', '{"step": 3'])
def test_an_earlier_runs_summary_does_not_outlive_the_run_that_takes_the_folder(tmp_path, one_rank, earlier):
    out = tmp_path / "run"
    _complete_checkpoint(out, 3, load_run_config(RECIPE, [f"--output.dir={out}"]).to_dict())
    (out / "summary.json").write_text(earlier)
    cfg = load_run_config(RECIPE, [f"--output.dir={out}", "--checkpoint.resume=true"])
    common.decide_resume(cfg, one_rank, out, out / "checkpoints")
    assert not (out / "summary.json").exists()


def test_a_refused_run_leaves_the_folders_summary_alone(tmp_path, one_rank):
    out = tmp_path / "run"
    _complete_checkpoint(out, 3, load_run_config(RECIPE, [f"--output.dir={out}"]).to_dict())
    (out / "summary.json").write_text('{"step": 3, "stopped": false}\n')
    with pytest.raises(common.RunFolderError):  # no --resume on a folder holding a checkpoint
        common.decide_resume(load_run_config(RECIPE, [f"--output.dir={out}"]), one_rank, out, out / "checkpoints")
    assert (out / "summary.json").is_file()


class BrokenWriter:
    """torch's SummaryWriter once its event file's disk is full: every call raises the writer thread's error."""
    calls = 0

    def __init__(self, *_args, **_kwargs):
        pass

    def add_scalar(self, *_args):
        BrokenWriter.calls += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    close = flush


def test_tensorboard_events_that_cannot_be_written_do_not_end_the_run(capsys, monkeypatch, tmp_path):
    import torch.utils.tensorboard
    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", BrokenWriter)
    BrokenWriter.calls = 0
    log = RunLogger(tmp_path, rank=0, total_steps=3, tensorboard=True, progress=False)
    for step in (1, 2, 3):
        log.log(step, {"loss": 1.0 / step})
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]                 # metrics.jsonl goes on
    assert BrokenWriter.calls == 1                                    # the writer is tried once, then left alone
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["dstrain: warning: TensorBoard events could not be written (No space left on device); "
                        "no more TensorBoard events for the rest of this run, which goes on"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (every write: no space left)")
def test_a_metrics_file_that_cannot_be_written_does_not_end_the_run(capsys, tmp_path):
    log = RunLogger(tmp_path, rank=0, total_steps=2, tensorboard=False, progress=False)
    log.jsonl.close()
    log.jsonl = open("/dev/full", "w")  # every write: ENOSPC
    log.log(1, {"loss": 1.0})
    log.log(2, {"loss": 0.5})
    log.close()
    err = capsys.readouterr().err
    assert err.count("dstrain: warning: metrics.jsonl could not be written (No space left on device)") == 1


def test_ctrl_c_during_the_launch_checks_is_one_line_and_exit_130(capsys, monkeypatch, tmp_path):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt
    from dstrain import cli_checks
    monkeypatch.setattr(cli_checks, "check_before_launch", interrupted)
    try:
        code = cli.main(["launch", "--nproc", "1", RECIPE, f"--output.dir={tmp_path / 'run'}"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left dstrain launch as a KeyboardInterrupt (a traceback)")
    assert code == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "dstrain: launch interrupted (Ctrl-C) before any rank started"
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_resumed_run_logs_each_step_once_and_no_line_cut_short_survives(tmp_path):
    lines = [json.dumps({"step": 0, "val/loss": 9.0}), *(json.dumps({"step": s, "train/loss": 1.0 / s})
                                                        for s in (1, 2, 3, 4, 5)), '{"step": 6, "train/lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))  # killed mid-write: no newline after the last
    log = RunLogger(tmp_path, rank=0, total_steps=8, start_step=3, tensorboard=False, progress=False)
    for step in (4, 5, 6):
        log.log(step, {"loss": 2.0 / step})
    log.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert [r.get("train/loss") for r in records[4:]] == [0.5, 0.4, 2.0 / 6]  # the resumed run's values


def test_a_fresh_run_in_a_folder_without_a_checkpoint_starts_its_own_records(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 7.0}) + "\n")  # crashed earlier
    log = RunLogger(tmp_path, rank=0, total_steps=2, tensorboard=False, progress=False)
    log.log(1, {"loss": 3.0})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1, "train/loss": 3.0}) + "\n"


FAKE_RANK = """
import os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["FAKE_OUT"])
def stop(signum, frame):
    time.sleep(1.0)  # saving its checkpoint
    (out / "saved").write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
(out / "started").write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""

FAKE_LAUNCHER = """
import os, signal, subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-m", "dstrain.cli", "train", "recipe.json"],
                        env={{**os.environ, "PYTHONPATH": {fake!r}}}, cwd={fake!r})  # (-m looks in cwd first)
def cut(signum, frame):  # DeepSpeed's launch.py and torchrun's agent: the signal on, SIGKILL 30 s later (0.3 s here)
    rank.terminate()
    time.sleep(0.3)
    rank.kill()
    sys.exit(1)
signal.signal(signal.SIGTERM, cut)
sys.exit(rank.wait())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_a_stop_reaches_the_ranks_not_the_launcher_that_would_cut_their_save_short(tmp_path):
    fake = tmp_path / "fake"
    (fake / "dstrain").mkdir(parents=True)
    (fake / "dstrain" / "__init__.py").write_text("")
    (fake / "dstrain" / "cli.py").write_text(FAKE_RANK)  # argv: python -m dstrain.cli train recipe.json
    env = {**os.environ, "FAKE_OUT": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = job_guard.start_job([sys.executable, "-c", FAKE_LAUNCHER.format(fake=str(fake))], env)
    try:
        end = time.monotonic() + 15
        while not (tmp_path / "started").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert (tmp_path / "started").exists(), "the fake rank never started"
        job_guard.stop_job(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=15) == 128 + signal.SIGTERM   # the rank's status, passed through the launcher
        assert (tmp_path / "saved").read_text() == str(int(signal.SIGTERM))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("argv, rank", [
    (["python", "-u", "-m", "dstrain.cli", "train", "r.json"], True),                # DeepSpeed's launch.py starts these
    (["python", "-W", "ignore", "-m", "dstrain.cli", "train", "r.json"], True),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dstrain.cli", "train", "r.json"],
     False),                                                                          # torchrun's agent
    (["python", "/venv/bin/deepspeed", "--num_gpus", "2", "--module", "dstrain.cli", "train", "r.json"], False),
    (["python", "-u", "-m", "deepspeed.launcher.launch", "--module", "--", "dstrain.cli", "train"], False),
    (["python", "-m", "dstrain.cli", "launch", "r.json"], False),
    (["python", "-c", "from dstrain.data.prefetch import _serve; _serve()"], False),  # HRM's prefetch worker
])
def test_which_processes_of_a_job_are_its_ranks(argv, rank):
    assert job_guard.is_rank_argv(argv) is rank


def test_a_second_ctrl_c_kills_the_job_and_says_so(capsys, monkeypatch, tmp_path):
    """The first Ctrl-C asks the job to save and stop; a job that does not (here: it ignores SIGTERM) is killed by
    the second, which before did so without a word (the user saw the launch end, no reason given)."""
    import threading

    from dstrain import launcher as launcher_mod
    monkeypatch.chdir(tmp_path)
    ready = tmp_path / "ready"
    script = (f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"pathlib.Path({str(ready)!r}).write_text('1'); time.sleep(60)")

    def build(spec, **kwargs):
        return [sys.executable, "-c", script], dict(os.environ)

    monkeypatch.setattr(launcher_mod, "build_deepspeed_command", build)

    def press_ctrl_c_twice():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(2):
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_ctrl_c_twice, daemon=True)
    presser.start()
    started = time.monotonic()
    code = cli.main(["launch", "--nproc", "1", RECIPE, f"--output.dir={tmp_path / 'run'}"])
    presser.join(5)
    assert code == 128 + signal.SIGINT and time.monotonic() - started < 30
    assert "dstrain: a second stop signal: killing the job now" in capsys.readouterr().err
