"""How a rank ends early (``dstrain.rank_exit``): a stop by signal exits 128 + N (and ``dstrain launch`` and
``--max-restarts`` read it so), a checkpoint the disk cannot hold is one line naming the folder, its free
space and the checkpoint kept, and a lost peer is one line instead of gloo's traceback."""
from __future__ import annotations

import errno
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dstrain import checkpoint as ckpt
from dstrain import cli, launcher, rank_exit, resilience
from dstrain.config import load_run_config
from dstrain.supervise import NO_RESTART

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")
GLOO = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:54672: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")


@pytest.fixture(autouse=True)
def _no_stop_left(monkeypatch):
    monkeypatch.setattr(resilience, "STOP_REQUESTED", [False])
    for var in ("RANK", "WORLD_SIZE", "DSTRAIN_FAILURE_DIR", "DS_ENV_FILE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------- stopped by a signal

@pytest.mark.parametrize("summary, got, code", [
    ({"step": 5, "stopped": False}, 0, 0),                       # finished
    ({"step": 10, "stopped": True}, signal.SIGTERM, 0),           # the stop came at the last step: finished
    ({"step": 5, "stopped": True}, signal.SIGTERM, 143),
    ({"step": 5, "stopped": True}, signal.SIGUSR1, 138),
    ({"step": 5, "stopped": True}, signal.SIGINT, 130),
    ({"step": 5, "stopped": True}, 0, 143),                       # a peer's signal, none here: SIGTERM's status
])
def test_stop_exit_code(summary, got, code):
    resilience.STOP_REQUESTED[0] = got
    assert rank_exit.stop_exit_code(summary, steps=10) == code


def test_stop_flag_keeps_the_first_signal():
    from dstrain.trainers.common import StopFlag
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    try:
        flag = StopFlag()
        flag._handle(signal.SIGUSR1, None)
        flag._handle(signal.SIGTERM, None)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert flag.set and resilience.STOP_REQUESTED[0] == signal.SIGUSR1


def test_a_stop_while_the_rank_starts_is_kept_for_the_trainer(monkeypatch):
    """SIGTERM before the trainer's StopFlag exists (DeepSpeed's set-up, data): kept, not fatal, and the StopFlag
    starts set, so the ranks agree on the stop at their first step instead of losing this one."""
    import os
    import time

    from dstrain.trainers.common import StopFlag
    monkeypatch.setattr(rank_exit, "PENDING_STOP", [0])
    before = {sig: signal.getsignal(sig) for sig in rank_exit.STOP_SIGNALS}
    try:
        rank_exit.hold_stop_signals()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not rank_exit.PENDING_STOP[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rank_exit.PENDING_STOP[0] == signal.SIGTERM
        flag = StopFlag()
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert flag.set and resilience.STOP_REQUESTED[0] == signal.SIGTERM and rank_exit.PENDING_STOP[0] == 0


def test_stopped_marker_round_trip(tmp_path, monkeypatch):
    assert rank_exit.stopped_code(tmp_path) is None
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    rank_exit.note_stopped(143)
    assert rank_exit.stopped_code(tmp_path) == 143
    (tmp_path / rank_exit.STOPPED_FILE).write_text("1\n")  # not a stop status
    assert rank_exit.stopped_code(tmp_path) is None


class StoppedTrainer:
    def __init__(self, out: Path, steps_done: int):
        self.out, self.steps_done = out, steps_done

    def train(self, cfg):
        root = self.out / "checkpoints"
        (root / ckpt.tag_for(self.steps_done)).mkdir(parents=True)
        ckpt.mark_complete(root, ckpt.tag_for(self.steps_done), {}, {}, {"step": self.steps_done}, keep=2)
        resilience.STOP_REQUESTED[0] = signal.SIGUSR1
        return {"step": self.steps_done, "stopped": True}


def test_a_rank_stopped_by_its_signal_exits_128_plus_n(capsys, monkeypatch, tmp_path):
    from dstrain import trainers
    out = tmp_path / "run"
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    monkeypatch.setattr(trainers, "get_trainer", lambda name: StoppedTrainer(out, 3))
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    code = cli.main(["train", RECIPE, f"--output.dir={out}", "--train.steps=10", "--deepspeed.profile=zero1"])
    assert code == 128 + signal.SIGUSR1
    err = capsys.readouterr().err
    assert (f"dstrain: stopped at step 3 of 10 by SIGUSR1 (exit 138, not a finished run): checkpoint "
            f"{out / 'checkpoints' / 'step_00000003'} is saved; --resume continues from it") in err
    assert rank_exit.stopped_code(tmp_path) == 138


def fake_build(script, calls):
    def build(spec, **kwargs):
        import os
        calls.append(spec)
        return [sys.executable, "-c", script], dict(os.environ)
    return build


def test_launch_returns_the_ranks_stop_status_through_torchrun(capsys, monkeypatch, tmp_path):
    """torchrun reports a rank's 143 as its own exit 1; the ranks' note says it was a stop by SIGTERM."""
    monkeypatch.chdir(tmp_path)
    script = ("import os, pathlib, sys; pathlib.Path(os.environ['DSTRAIN_FAILURE_DIR'], 'stopped').write_text('143');"
              " sys.exit(1)")
    attempts = []
    monkeypatch.setattr(launcher, "build_torchrun_command", fake_build(script, attempts))
    code = cli.main(["launch", "--launcher", "torchrun", "--max-restarts", "2", RECIPE,
                     f"--output.dir={tmp_path / 'run'}"])
    assert code == 143 and "restart" not in capsys.readouterr().err  # a stop is never restarted
    assert len(attempts) == 1


def test_stop_statuses_are_not_restarted():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        assert 128 + sig in NO_RESTART
    assert 137 not in NO_RESTART and 1 not in NO_RESTART  # SIGKILL, a crash: restarted


# ---------------------------------------------------------------- a checkpoint the disk cannot hold

@pytest.mark.parametrize("err, why", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (OSError(errno.EROFS, "Read-only file system"), "Read-only file system"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4874944 vs 4874832"), "a file write failed"),
    (RuntimeError("something else"), None),
    (RuntimeError(GLOO), None),
    (ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"), None),
    (TimeoutError("step_00000004: ranks did not finish writing within 60s"), None),
])
def test_write_failure(err, why):
    assert rank_exit.write_failure(err) == why


def test_write_failure_under_torchs_own_error():
    """torch's zip writer raises "unexpected pos" while handling its "iostream error" (the errno is gone)."""
    try:
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as err:
        assert rank_exit.write_failure(err) == "a file write failed"


def _plan():
    return SimpleNamespace(ds_config={"train_batch_size": 16}, profile="zero0", precision="fp32",
                           activation_checkpointing=False)


class DiskFullEngine:
    """Writes part of its file, then fails as a full disk does."""

    param_group_names = None

    def __init__(self, err):
        self.err = err

    def save(self, save_dir, tag, client_state=None):
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000)
        raise self.err


@pytest.mark.parametrize("err", [OSError(errno.ENOSPC, "No space left on device"),
                                 RuntimeError("basic_ios::clear: iostream error")])
def test_disk_full_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, err):
    from dstrain import runtime
    from dstrain.trainers.common import save_checkpoint
    root = tmp_path / "checkpoints"
    cfg = load_run_config(RECIPE, [f"--output.dir={tmp_path}"])
    world = runtime.World(0, 1, 0, 1, None)
    (root / "step_00000002").mkdir(parents=True)
    ckpt.mark_complete(root, "step_00000002", {}, {}, {"step": 2}, keep=3)
    monkeypatch.setattr(rank_exit.shutil, "disk_usage", lambda path: SimpleNamespace(free=12_345))
    with pytest.raises(rank_exit.CheckpointWriteError) as info:
        save_checkpoint(DiskFullEngine(err), root, 4, world, cfg, _plan())
    assert str(info.value) == (
        f"checkpoint step_00000004 could not be written to {root}: no space left on device (12.3 KB free there; the "
        "incomplete step_00000004 was removed); checkpoint step_00000002 is intact and stays the latest: free "
        "space, then --resume continues from it")
    assert info.value.__cause__ is err
    assert not (root / "step_00000004").exists()  # nothing half-written is left, nor its space taken
    assert ckpt.find_latest(root) == "step_00000002" and (root / "latest").read_text().strip() == "step_00000002"


def test_disk_full_while_marking_complete_leaves_no_complete_marker(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    (root / "step_00000004").mkdir(parents=True)
    real = Path.write_text

    def full(self, text, *args, **kwargs):
        if self.name == "trainer_state.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", full)
    from dstrain.trainers.common import writing
    with pytest.raises(rank_exit.CheckpointWriteError, match="there is no earlier checkpoint"):
        with writing(root, "step_00000004"):
            ckpt.mark_complete(root, "step_00000004", {}, {}, {"step": 4}, keep=2)
    assert ckpt.find_latest(root) is None and not (root / "step_00000004").exists()


def test_async_write_failure_is_the_same_line(tmp_path):
    """``checkpoint.async_write``: the background writer's ENOSPC comes back from the finisher as the same error."""
    from dstrain.trainers.common import CheckpointSaver

    class Writer:
        def wait(self):
            raise OSError(errno.ENOSPC, "No space left on device")
    saver = object.__new__(CheckpointSaver)
    saver.ckpt_root, saver.writer = tmp_path / "checkpoints", Writer()
    (saver.ckpt_root / "step_00000006").mkdir(parents=True)
    with pytest.raises(rank_exit.CheckpointWriteError, match="step_00000006 could not be written .* no space left"):
        saver._finish("step_00000006", 6, None)
    assert not (saver.ckpt_root / "step_00000006").exists()


def test_a_peer_lost_error_is_not_a_write_failure(tmp_path):
    from dstrain.trainers.common import writing
    (tmp_path / "step_00000004").mkdir()
    with pytest.raises(RuntimeError, match="Connection reset by peer") as info:
        with writing(tmp_path, "step_00000004"):
            raise RuntimeError(GLOO)
    assert not isinstance(info.value, rank_exit.CheckpointWriteError)
    assert (tmp_path / "step_00000004").exists()


class FailingTrainer:
    def __init__(self, err):
        self.err = err

    def train(self, cfg):
        raise self.err


@pytest.mark.parametrize("err, line, code", [
    (rank_exit.CheckpointWriteError("checkpoint step_00000004 could not be written to X: no space left on device"),
     "dstrain: error: checkpoint step_00000004 could not be written to X: no space left on device", 4),
    (RuntimeError(GLOO), "dstrain: rank 0 lost contact with the job in allreduce of step 7 (a peer process died or "
                         "left): Read error [127.0.0.1]:54672: Connection reset by peer", 1),
])
def test_rank_failure_is_one_line(capsys, monkeypatch, tmp_path, err, line, code):
    """A failed checkpoint write exits 4 (``--max-restarts`` would only meet the full disk again); a lost peer 1."""
    from dstrain import trainers
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(trainers, "get_trainer", lambda name: FailingTrainer(err))
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    monkeypatch.setattr(resilience.Watchdog, "last", ("allreduce", 7))
    assert cli.main(["train", RECIPE, f"--output.dir={tmp_path / 'run'}", "--deepspeed.profile=zero1"]) == code
    assert capsys.readouterr().err.strip().splitlines() == [line]


@pytest.mark.parametrize("text, lost", [
    (GLOO, "Read error [127.0.0.1]:54672: Connection reset by peer"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv "
     "operation to complete", None),
    ("[..pair.cc:590] Connection closed by peer [127.0.0.1]:29501", "Connection closed by peer"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, NCCL version",
     "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error"),
])
def test_peer_lost(text, lost):
    assert rank_exit.peer_lost(RuntimeError(text)) == lost
    assert rank_exit.peer_lost(ValueError(text)) is None
