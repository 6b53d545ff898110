"""``dstrain launch``: the printed command, config checks before any rank starts, .deepspeed_env, signals."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dstrain import cli, launcher

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "models" / "gpt" / "recipes" / "tiny.json")
OVERRIDES = ["--train.lr=1e-3", "--data.seq_len=64", "--train.steps=5"]
MARKER = "DSTRAIN_WROTE_DEEPSPEED_ENV=1"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for var in ("DS_ACCELERATOR", "DS_ENV_FILE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)  # .deepspeed_env lands here, never in the repository


@pytest.fixture
def no_child(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--dry-run must not start anything")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def launch(capsys, *args):
    code = cli.main(["launch", *args])
    out, err = capsys.readouterr()
    return code, out, err


def words(out: str) -> list[str]:
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return shlex.split(lines[0])


def test_dry_run_prints_deepspeed_command(capsys, no_child):
    code, out, err = launch(capsys, "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE, *OVERRIDES)
    assert code == 0 and err == ""
    argv = words(out)
    assert "--num_gpus 2" in out and "DS_ACCELERATOR=cpu" in out
    assert argv[-(4 + len(OVERRIDES)):] == ["--module", "dstrain.cli", "train", RECIPE, *OVERRIDES]
    assert f"--module dstrain.cli train {shlex.quote(RECIPE)} {' '.join(OVERRIDES)}" in out


def test_resume_follows_the_overrides_and_options_may_follow_the_recipe(capsys, no_child):
    code, out, _ = launch(capsys, RECIPE, OVERRIDES[0], "--resume", "--nproc", "2", OVERRIDES[1], "--dry-run")
    assert code == 0
    assert words(out)[-4:] == [RECIPE, OVERRIDES[0], OVERRIDES[1], "--resume"]


def test_launcher_options_are_those_of_python_m_dstrain_launcher(capsys, no_child):
    code, out, _ = launch(capsys, RECIPE, "--dry-run", "--include", "localhost:0,1", "--accelerator", "cpu",
                          "--master-port", "6123")
    assert code == 0
    argv = words(out)
    assert argv[argv.index("--include") + 1] == "localhost:0,1" and "--num_gpus" not in argv
    assert argv[argv.index("--master_port") + 1] == "6123"
    parsed = cli.build_parser().parse_args(["launch", RECIPE, "--exclude", "h:1", "--master-addr", "h0",
                                            "--num-nodes", "2"])
    assert (parsed.exclude, parsed.master_addr, parsed.num_nodes, parsed.master_port) == ("h:1", "h0", 2, None)


def test_torchrun(capsys, no_child):
    code, out, _ = launch(capsys, "--launcher", "torchrun", "--nproc", "2", "--accelerator", "cpu", "--dry-run",
                          RECIPE, "--resume")
    assert code == 0
    argv = words(out)
    assert argv[argv.index("-m") + 1] == "torch.distributed.run" and "--nproc-per-node" in argv
    assert argv[-5:] == ["-m", "dstrain.cli", "train", RECIPE, "--resume"]


def test_bad_override_exits_2_with_one_line(capsys, no_child):
    code, out, err = launch(capsys, "--dry-run", "--nproc", "2", RECIPE, "--train.lr=abc")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "train.lr" in err


def test_missing_recipe_exits_2(capsys, no_child, tmp_path):
    code, out, err = launch(capsys, "--dry-run", str(tmp_path / "nope.json"))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "nope.json" in err


def test_bad_launch_options_exit_2(capsys, no_child, tmp_path):
    code, out, err = launch(capsys, "--dry-run", "--nproc", "2", "--include", "localhost:0", RECIPE)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "include" in err
    code, _, err = launch(capsys, "--dry-run", "--hostfile", str(tmp_path / "missing"), RECIPE)
    assert code == 2 and "hostfile" in err


# --------------------------------------------------------------------------- several hosts: .deepspeed_env


class FakeChild:
    pid = 999_999_999

    def __init__(self, argv, env, **kwargs):
        FakeChild.started = (argv, env, kwargs)

    def wait(self):
        return 3


@pytest.fixture
def two_hosts(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    return str(path)


def test_multi_host_dry_run_writes_nothing(capsys, no_child, two_hosts):
    code, out, err = launch(capsys, "--dry-run", "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 0 and "--hostfile" in words(out) and "--force_multi" in words(out)
    assert "would write .deepspeed_env" in err and "DS_ACCELERATOR=cpu" in err
    assert not Path(".deepspeed_env").exists()


def test_multi_host_writes_deepspeed_env(capsys, monkeypatch, two_hosts):
    monkeypatch.setattr(subprocess, "Popen", FakeChild)
    Path(".deepspeed_env").write_text(f"{MARKER}\nDS_ACCELERATOR=cuda\n")  # ours, stale: rewritten
    code, _, err = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 3  # the child's exit status
    lines = Path(".deepspeed_env").read_text().splitlines()
    # 2 slots per host share this machine's cores (1 thread each on 2 cores, 8 on 16)
    threads = max(1, launcher.available_cpus() // 2) if "OMP_NUM_THREADS" not in os.environ \
        else int(os.environ["OMP_NUM_THREADS"])
    assert lines[0] == MARKER and "DS_ACCELERATOR=cpu" in lines and f"OMP_NUM_THREADS={threads}" in lines
    assert all("=" in line for line in lines) and "wrote .deepspeed_env" in err
    assert FakeChild.started[2]["start_new_session"]


def test_foreign_deepspeed_env_left_alone(capsys, monkeypatch, two_hosts):
    monkeypatch.setattr(subprocess, "Popen", FakeChild)
    Path(".deepspeed_env").write_text("HF_HOME=/data/hf\n")
    code, _, err = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 3 and Path(".deepspeed_env").read_text() == "HF_HOME=/data/hf\n"
    assert "not written by dstrain" in err and "DS_ACCELERATOR=cpu" in err


def test_one_local_host_needs_no_deepspeed_env(capsys, no_child, tmp_path):
    hf = tmp_path / "local"
    hf.write_text("localhost slots=2\n")
    code, out, err = launch(capsys, "--dry-run", "--hostfile", str(hf), "--accelerator", "cpu", RECIPE)
    assert code == 0 and "--hostfile" not in words(out) and err == ""


# --------------------------------------------------------------------------- running: exit status, signals


def fake_build(script):
    def build(spec, **kwargs):
        return [sys.executable, "-c", script], dict(os.environ)

    return build


def test_exit_status_of_the_child(capsys, monkeypatch):
    monkeypatch.setattr(launcher, "build_deepspeed_command", fake_build("import sys; sys.exit(7)"))
    assert launch(capsys, RECIPE)[0] == 7


def test_sigterm_is_forwarded_to_the_child_group(capsys, monkeypatch, tmp_path):
    ready = tmp_path / "ready"
    script = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    monkeypatch.setattr(launcher, "build_deepspeed_command", fake_build(script))

    def kill_when_ready():
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=kill_when_ready, daemon=True).start()
    started = time.monotonic()
    code, _, _ = launch(capsys, RECIPE)
    assert code == 128 + signal.SIGTERM and time.monotonic() - started < 30
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


# --------------------------------------------------------------------------- refusals and failures


def test_refused_launch_starts_and_writes_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a refused launch started something"))
    user = tmp_path / "user.json"
    user.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}')
    out = tmp_path / "run"
    code, stdout, err = launch(capsys, "--nproc", "2", "--accelerator", "cpu", RECIPE, f"--deepspeed.profile={user}",
                               f"--output.dir={out}")
    assert code == 2 and stdout == ""
    assert err.strip().splitlines() == [
        f"dstrain: error: {user}: the file disagrees with the run config: train_micro_batch_size_per_gpu: file says "
        "4, run gives 8; use --train.micro_batch=4, or set them to \"auto\" in the file, or pass "
        "--deepspeed.values_from_file=true to take them from the file"]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["user.json"]


class FailingTrainer:
    """Creates the data cache in the run folder, as the LM trainer does first, then fails."""

    def __init__(self, out: Path):
        self.out = out

    def train(self, cfg):
        (self.out / ".cache" / "datasets").mkdir(parents=True)
        raise RuntimeError("boom after the cache was written")


@pytest.mark.parametrize("existed", [False, True])
def test_failed_rank_reports_once_and_leaves_no_cache_only_folder(capsys, monkeypatch, tmp_path, existed):
    from dstrain import trainers
    out = tmp_path / "run"
    if existed:
        out.mkdir()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    for var in ("RANK", "WORLD_SIZE", "DSTRAIN_FAILURE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(trainers, "get_trainer", lambda name: FailingTrainer(out))
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    assert cli.main(["train", RECIPE, f"--output.dir={out}", "--deepspeed.profile=zero1"]) == 1
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "boom after the cache was written" in err
    assert out.exists() == existed  # a folder this run created for nothing but the cache is removed
    if existed:
        assert (out / ".cache").exists()  # someone else's folder: left as it is


def test_train_refuses_before_the_trainer_starts(capsys, monkeypatch, tmp_path):
    from dstrain import trainers
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(trainers, "get_trainer", lambda name: pytest.fail("the trainer must not start"))
    monkeypatch.setattr(cli, "_TRAIN_STARTED", False)
    for rank, printed in (("0", True), ("1", False)):  # every rank refuses; rank 0 says why
        monkeypatch.setenv("RANK", rank)
        code = cli.main(["train", RECIPE, "--deepspeed.profile=zero1", "--deepspeed.precision=fp16",
                         f"--output.dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err
        assert code == 2 and ("deepspeed.precision: fp16 does not run on the CPU accelerator" in err) == printed
        assert printed or err == ""
    assert not (tmp_path / "run").exists()
