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

from dstrain import cli, hostfile, launcher

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
    assert code == 0
    port = words(out)[words(out).index("--master_port") + 1]
    assert err.splitlines() == [
        "dstrain: master address: 127.0.0.1 (one node: this machine)",
        f"dstrain: ports: {port} for the torch.distributed store of rank 0 (MASTER_PORT); gloo/NCCL connections "
        "between ranks use ports the system picks",
        "dstrain: environment: the ranks run here and inherit this one (plus the variables printed above)"]
    argv = words(out)
    assert "--num_gpus 2" in out and "DS_ACCELERATOR=cpu" in out
    assert argv[-(4 + len(OVERRIDES)):] == ["--module", "dstrain.cli", "train", RECIPE, *OVERRIDES]
    assert f"--module dstrain.cli train {shlex.quote(RECIPE)} {' '.join(OVERRIDES)}" in out


def test_resume_follows_the_overrides_and_options_may_follow_the_recipe(capsys, no_child):
    code, out, _ = launch(capsys, RECIPE, OVERRIDES[0], "--resume", "--nproc", "2", OVERRIDES[1], "--dry-run",
                          "--accelerator", "cpu")
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


ADDRESSES = {"worker-0": "10.0.0.10", "worker-1": "10.0.0.11"}


@pytest.fixture
def reachable(monkeypatch):
    """worker-0 and worker-1 resolve (no DNS asked) and answer ssh (no ssh run); the hosts probed are kept."""
    probed = []
    monkeypatch.setattr(hostfile, "resolve_host", lambda h: hostfile.Resolved(h, ADDRESSES[h], "DNS / hosts file")
                        if h in ADDRESSES else None)
    monkeypatch.setattr(hostfile, "check_reachable", lambda h: probed.append(h))
    monkeypatch.setattr(hostfile, "pdsh_problem", lambda: None)  # whether or not this machine has pdsh
    return probed


@pytest.fixture
def two_hosts(tmp_path, reachable):
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
    assert code == 0 and "--hostfile" not in words(out) and ".deepspeed_env" not in err
    assert f"master address: 127.0.0.1 (the only host of {hf} is this machine)" in err


# --------------------------------------------------------------------------- several hosts: checks and dry-run text


def test_multi_host_dry_run_shows_master_ports_and_environment(capsys, no_child, two_hosts, reachable, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")  # the launching shell's choice reaches the other hosts
    monkeypatch.setenv("PYTHONPATH", "/src")
    code, out, err = launch(capsys, "--dry-run", "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 0 and reachable == []  # a dry run does not ssh anywhere
    argv = words(out)
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.10"  # DeepSpeed does not ask the host for hostname -I
    assert argv[argv.index("--master_port") + 1] == "29500"
    lines = err.splitlines()
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, launcher.available_cpus() // 2))
    assert lines[-5:-2] == [
        "dstrain: hosts: worker-0 slots=2 -> 10.0.0.10 (DNS / hosts file); worker-1 slots=2 -> 10.0.0.11 "
        "(DNS / hosts file)",
        f"dstrain: master address: 10.0.0.10 (the first host (worker-0) of hostfile {two_hosts}, resolved via "
        "DNS / hosts file)",
        "dstrain: ports: 29500 for the torch.distributed store of rank 0 (MASTER_PORT); gloo/NCCL connections "
        "between ranks use ports the system picks"]
    head, _, listed = lines[-2].partition(": from .deepspeed_env: ")
    assert head == "dstrain: environment on other hosts"
    assert {"DS_ACCELERATOR=cpu", f"OMP_NUM_THREADS={threads}", "GLOO_SOCKET_IFNAME=eth1"} <= set(listed.split())
    assert not any(w.startswith("PYTHON") for w in listed.split())  # DeepSpeed forwards those itself:
    assert lines[-1].startswith("dstrain: environment on other hosts: forwarded by DeepSpeed itself: ")
    assert "PYTHONPATH=/src" in lines[-1].split()


def test_torchrun_dry_run_names_this_nodes_address(capsys, no_child, two_hosts, monkeypatch):
    monkeypatch.setattr(launcher, "local_hostnames", lambda: frozenset({"worker-1"}))
    code, out, err = launch(capsys, "--dry-run", "--launcher", "torchrun", "--hostfile", two_hosts,
                            "--accelerator", "cpu", RECIPE)
    argv = words(out)
    assert code == 0 and argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.10:29500"
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.11"  # this machine is worker-1
    assert "dstrain: this node's address: 10.0.0.11 (torchrun --local-addr)" in err.splitlines()
    assert "c10d rendezvous store" in err


def test_multi_host_launch_checks_ssh_to_every_host_first(capsys, monkeypatch, two_hosts, reachable):
    monkeypatch.setattr(subprocess, "Popen", FakeChild)
    code, _, _ = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 3 and sorted(reachable) == ["worker-0", "worker-1"]
    argv = FakeChild.started[0]
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.10"


def test_unreachable_host_refused_unless_the_check_is_skipped(capsys, monkeypatch, two_hosts):
    monkeypatch.setattr(hostfile, "check_reachable", lambda h: "Connection refused" if h == "worker-1" else None)
    monkeypatch.setattr(subprocess, "Popen", FakeChild)
    FakeChild.started = None
    code, out, err = launch(capsys, "--hostfile", two_hosts, "--accelerator", "cpu", RECIPE)
    assert code == 2 and out == "" and FakeChild.started is None and not Path(".deepspeed_env").exists()
    assert err == (f"dstrain: error: hostfile {two_hosts}: host 'worker-1' is unreachable by passwordless ssh "
                   "(Connection refused); --no-ssh-check skips this check\n")
    code, _, _ = launch(capsys, "--hostfile", two_hosts, "--no-ssh-check", "--accelerator", "cpu", RECIPE)
    assert code == 3 and FakeChild.started is not None


@pytest.mark.parametrize("text, options, message", [
    ("worker-0 slots=2\nworker-0 slots=2\n", [], ":2: host 'worker-0' already listed on line 1"),
    ("worker-0 slots=2\nworker-1 slots=0\n", [], ":2: host 'worker-1' has slots=0; need at least 1"),
    ("worker-0 slots=2\nworker-1 slots=many\n", [], ":2: host 'worker-1' has slots='many'; need an integer >= 1"),
    ("worker-0 slots=2\nworker-9 slots=2\n", [], ": host 'worker-9' does not resolve"),
    ("worker-0 slots=2\nworker-1 slots=2\n", ["--nproc", "4"], "nproc=4 exceeds the slots of worker-0 (slots=2)"),
    ("worker-0 slots=2\nworker-1 slots=2\n", ["--num-nodes", "3"], "num_nodes=3 but hostfile"),
    ("worker-0 slots=2\nworker-1 slots=2\n", ["--include", "worker-1:2"], "host 'worker-1' has no slot '2'"),
])
@pytest.mark.parametrize("dry_run", [True, False])
def test_bad_hostfile_refused_before_anything_starts(capsys, no_child, tmp_path, reachable, text, options, message,
                                                     dry_run):
    path = tmp_path / "hosts.txt"
    path.write_text(text)
    code, out, err = launch(capsys, *(["--dry-run"] if dry_run else []), "--hostfile", str(path), *options,
                            "--accelerator", "cpu", RECIPE)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("dstrain: error: ") and message in err and str(path) in err
    assert reachable == [] and not Path(".deepspeed_env").exists()


def test_hostfile_subcommand_writes_hosts(capsys, tmp_path):
    out = tmp_path / "hostfile"
    assert cli.main(["hostfile", "node1", "node2:4", "--slots", "2", "-o", str(out)]) == 0
    assert out.read_text() == "node1 slots=2\nnode2 slots=4\n"
    assert hostfile.parse_hostfile(out) == [("node1", 2), ("node2", 4)]
    assert "2 host(s), 6 slot(s)" in capsys.readouterr().err
    assert cli.main(["hostfile", "a", "b"]) == 0
    assert capsys.readouterr().out == "a slots=1\nb slots=1\n"


def test_hostfile_subcommand_from_slurm(capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "8(x2)")
    assert cli.main(["hostfile", "--from-slurm"]) == 0
    assert capsys.readouterr().out == "gpu01 slots=8\ngpu02 slots=8\n"
    assert cli.main(["hostfile", "--from-slurm", "--slots", "1"]) == 0
    assert capsys.readouterr().out == "gpu01 slots=1\ngpu02 slots=1\n"


@pytest.mark.parametrize("args, message", [
    (["a", "a:2"], "host 'a' listed twice"),
    (["a:0"], "host 'a' has slots=0"),
    (["a", "--slots", "0"], "--slots"),
    ([], "give host names or --from-slurm"),
    (["a", "--from-slurm"], "give host names or --from-slurm"),
])
def test_hostfile_subcommand_refusals(capsys, tmp_path, args, message):
    assert cli.main(["hostfile", *args, "-o", str(tmp_path / "hf")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and message in err and not (tmp_path / "hf").exists()


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


def test_more_local_ranks_than_gpus_is_refused_before_launch(capsys, no_child, monkeypatch):
    """DeepSpeed's launcher gives rank 1 of --nproc 2 device 1 on a one-GPU machine ("invalid device
    ordinal" inside the rank); dstrain names the problem before anything starts."""
    import torch

    from dstrain import launch_check
    monkeypatch.setattr(launcher, "detect_accelerator", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for extra in ([], ["--launcher", "torchrun"]):
        code, out, err = launch(capsys, "--dry-run", "--nproc", "2", "--accelerator", "cuda", *extra, RECIPE)
        assert code == cli.EXIT_CONFIG and out == ""
        assert err.strip() == ("dstrain: error: 2 ranks on this machine but it shows 1 GPU(s) (CUDA_VISIBLE_DEVICES "
                               "included): launch with --nproc 1 or fewer, or --accelerator cpu for CPU ranks")
    spec = launcher.LaunchSpec(recipe=RECIPE, nproc=2)
    assert launch_check.gpu_shortfall(spec, False, "cuda", gpu_count=lambda: 2) is None
    assert launch_check.gpu_shortfall(spec, False, "cpu", gpu_count=lambda: 1) is None
    assert launch_check.gpu_shortfall(spec, True, "cuda", gpu_count=lambda: 1) is None  # ranks elsewhere
    assert launch_check.gpu_shortfall(spec, False, "cuda", gpu_count=lambda: 0) is None  # named by hand
    picked = launcher.LaunchSpec(recipe=RECIPE, nproc=2, include="localhost:0")
    assert launch_check.gpu_shortfall(picked, False, "cuda", gpu_count=lambda: 1) is None
