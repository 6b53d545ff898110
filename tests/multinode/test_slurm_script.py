"""launch/slurm.sbatch run for real through a fake ``srun`` (tests/multinode/fake_slurm/srun) that starts
one process per task with SLURM's variables: dstrain maps them to torch.distributed's and trains 2 ranks
whose losses equal a plain single-process run on the same global batch."""
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import harness
from tests.reference import plain_training

STEPS = 3
FAKE_SRUN = Path(__file__).parent / "fake_slurm" / "srun"


def free_job_id() -> int:
    """A job id whose port in the script (20000 + id % 20000) is free here now."""
    for _ in range(100):
        job = random.randrange(1, 10**6)
        with socket.socket() as sock:
            try:
                sock.bind(("", 20000 + job % 20000))
            except OSError:
                continue
            return job
    raise RuntimeError("no free port in 20000..39999")


def test_sbatch_script_trains_two_tasks(tmp_path, deepspeed_cpu_ops_built):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_SRUN} "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    out, job = tmp_path / "run", free_job_id()
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=sys.executable, DS_ACCELERATOR="cpu",
               GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", FAKE_SRUN_LOG=str(tmp_path / "srun.jsonl"),
               SLURM_JOB_ID=str(job), SLURM_JOB_NODELIST="127.0.0.[2-3]", SLURM_NNODES="2", SLURM_NTASKS="2",
               SLURM_TASKS_PER_NODE="1(x2)", SLURM_CPUS_PER_TASK="1")
    args = harness.overrides(out, STEPS, "--deepspeed.profile=zero2", "--checkpoint.every=0")
    proc = subprocess.run(["bash", str(harness.ROOT / "launch" / "slurm.sbatch"), str(harness.RECIPE), *args],
                          env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    (call,) = [json.loads(line) for line in (tmp_path / "srun.jsonl").read_text().splitlines()]
    assert call["argv"] == ["--kill-on-bad-exit=1", sys.executable, "-m", "dstrain.cli", "train",
                            str(harness.RECIPE), *args]
    assert call["env"] == {"MASTER_PORT": str(20000 + job % 20000)}  # MASTER_ADDR: the first node, per task
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 2 * 2 * 2

    ref, _ = plain_training(harness.run_config(tmp_path / "ref", STEPS), world_size=2)
    losses = harness.metrics(out)
    got = [losses[s] for s in range(1, STEPS + 1)]
    assert got == pytest.approx(ref, rel=2e-5, abs=2e-5), (got, ref)


def test_srun_command_of_the_builder_gives_each_task_its_rank(tmp_path):
    """dstrain's own srun argv (2 nodes x 2 tasks) through the fake srun: what every task maps itself to."""
    from dstrain.launcher import LaunchSpec
    from dstrain.slurm import build_srun_command

    argv, env = build_srun_command(LaunchSpec("r.json", nproc=2, master_port=7001), 2, sys.executable,
                                   {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_CPUS_PER_TASK": "3",
                                    "PATH": os.environ["PATH"], "PYTHONPATH": str(harness.ROOT)}, detect=lambda: "cpu")
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks-per-node=2", "--ntasks=4", "--kill-on-bad-exit=1",
                        sys.executable]
    probe = ("import json, os; from dstrain.slurm import env_from_slurm; "
             "print(json.dumps({**env_from_slurm(os.environ), 'DS_ACCELERATOR': os.environ['DS_ACCELERATOR']}))")
    proc = subprocess.run([sys.executable, str(FAKE_SRUN), *argv[1:6], "-c", probe], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tasks = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda t: int(t["RANK"]))
    assert [(t["RANK"], t["LOCAL_RANK"], t["NODE_RANK"]) for t in tasks] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    for task in tasks:
        assert task["WORLD_SIZE"] == "4" and task["LOCAL_WORLD_SIZE"] == "2"
        assert (task["MASTER_ADDR"], task["MASTER_PORT"]) == ("gpu07", "7001")
        assert task["OMP_NUM_THREADS"] == "3" and task["DS_ACCELERATOR"] == "cpu"
