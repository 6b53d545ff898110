"""``dstrain launch --hostfile``: DeepSpeed's pdsh runner starts ranks on two pretend hosts (sshd on
127.0.0.2 and 127.0.0.3); the losses equal a plain single-process run on the same global batch."""
import json
import os
import subprocess
import sys

import pytest

from dstrain.launcher import find_free_port
from tests.dist import harness
from tests.multinode.hosts import DOWN
from tests.reference import plain_training

STEPS = 3


def job_env(hosts, tmp_path):
    """What a user's shell would hold: CPU ranks, one thread each, gloo on the hosts' interface."""
    return hosts.env({**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                      "GLOO_SOCKET_IFNAME": hosts.iface, "DS_ENV_FILE": str(tmp_path / "deepspeed_env")})


@pytest.mark.parametrize("slots", [pytest.param(1, marks=pytest.mark.slow), 2])  # 2: two ranks on each host
def test_two_hosts_zero2_matches_single_process(hosts, tmp_path, slots):
    check_zero2_job(hosts, tmp_path, slots)


@pytest.mark.slow
def test_two_namespaced_hosts_zero2_matches_single_process(netns_hosts, tmp_path):
    """The same job with each host in its own network namespace: ranks talk over eth0 through a bridge."""
    check_zero2_job(netns_hosts, tmp_path, 1)


def check_zero2_job(hosts, tmp_path, slots):
    out, world = tmp_path / "run", 2 * slots
    hostfile = hosts.hostfile(slots, tmp_path / "hostfile")
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--hostfile", str(hostfile),
           "--master-port", str(find_free_port()), str(harness.RECIPE),
           *harness.overrides(out, STEPS, "--deepspeed.profile=zero2", "--checkpoint.every=0")]
    proc = subprocess.run(cmd, env=job_env(hosts, tmp_path), cwd=harness.ROOT, capture_output=True, text=True,
                          timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]

    # pdsh ran DeepSpeed's per-node launcher on both hosts, with the master address dstrain resolved
    assert "pdsh -S -f 1024 -w node1,node2" in log and f"--master_addr={hosts.addrs[0]}" in log, log[-6000:]
    for rank, node in enumerate(hosts.names):
        assert f"{node}: " in log and f"nnodes=2, num_local_procs={slots}, node_rank={rank}" in log
    env_lines = (tmp_path / "deepspeed_env").read_text().splitlines()
    assert {"DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1", f"GLOO_SOCKET_IFNAME={hosts.iface}"} <= set(env_lines)

    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 2 * 2 * world
    ref, _ = plain_training(harness.run_config(tmp_path / "ref", STEPS), world_size=world)
    losses = harness.metrics(out)
    got = [losses[s] for s in range(1, STEPS + 1)]
    assert got == pytest.approx(ref, rel=2e-5, abs=2e-5), (got, ref)
    assert ref[-1] < ref[0] - 0.1  # it learns, so equal losses mean something


def test_unreachable_host_is_refused_before_anything_starts(hosts, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"node1 slots=1\n{DOWN} slots=1\n")  # resolves through the ssh config; no sshd there
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--hostfile", str(hostfile), str(harness.RECIPE),
           *harness.overrides(tmp_path / "run", STEPS)]
    proc = subprocess.run(cmd, env=job_env(hosts, tmp_path), cwd=harness.ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"dstrain: error: hostfile {hostfile}: host '{DOWN}' is unreachable by "
                                  "passwordless ssh (")
    assert len(proc.stderr.splitlines()) == 1 and not (tmp_path / "run").exists()
    assert not (tmp_path / "deepspeed_env").exists()


@pytest.mark.slow
def test_ctrl_c_returns_once_the_other_hosts_ranks_saved(hosts, tmp_path):
    """Ctrl-C to ``dstrain launch`` of a 2-host job: DeepSpeed's runner leaves about a second later, while the
    ranks (every one on a pretend host, behind pdsh) still save; dstrain returns 130 only after rank 0 let go of
    the run folder, names the stop's checkpoint (complete by then), and leaves no rank behind on either host."""
    import signal
    import time

    from dstrain import checkpoint as ckpt
    from dstrain.job_guard import is_rank_argv
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--hostfile", str(hosts.hostfile(1, tmp_path / "hostfile")),
           "--master-port", str(find_free_port()), str(harness.RECIPE),
           *harness.overrides(out, 500, "--checkpoint.every=1000")]
    job = harness.Background(cmd, job_env(hosts, tmp_path))
    try:
        deadline = time.monotonic() + 240
        while len(trained_steps(out)) < 2:  # training, not starting: the stop's checkpoint is one of a run
            assert job.popen.poll() is None and time.monotonic() < deadline, job.result(check=False)
            time.sleep(0.5)
        job.popen.send_signal(signal.SIGINT)
        proc = job.result(timeout=180, check=False)
    finally:
        job.stop()
    latest = ckpt.find_latest(out / "checkpoints")  # read as the launch returned: complete already
    assert proc.returncode == 130 and latest is not None, proc.stderr[-4000:]
    assert proc.stderr.splitlines()[-1] == (f"dstrain: stopped by SIGINT; the ranks on every host have left; latest "
                                            f"complete checkpoint: {latest} in {out / 'checkpoints'} (--resume "
                                            "continues from it)")
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if is_rank_argv(argv) and f"--output.dir={out}" in argv:
            left.append(pid)
    assert not left, left  # no rank on either pretend host outlived the launch


def trained_steps(out):
    try:
        return harness.metrics(out)
    except (OSError, ValueError):  # not written yet, or a line half written
        return {}
