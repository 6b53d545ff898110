"""``dstrain launch --launcher torchrun`` across two pretend hosts: one torchrun agent per host, started
over ssh with the same hostfile, c10d rendezvous at the first host's address; losses equal a plain
single-process run on the same global batch."""
import shlex
import subprocess
import sys

import pytest

from dstrain.launcher import find_free_port
from tests.dist import harness
from tests.reference import plain_training

STEPS = 3
PASSED = ("PATH", "PYTHONPATH", "TORCH_EXTENSIONS_DIR")  # what a login on each host would already have


def test_two_torchrun_agents_match_single_process(hosts, tmp_path):
    out = tmp_path / "run"
    hostfile = hosts.hostfile(1, tmp_path / "hostfile")
    port = find_free_port()
    env = hosts.env()
    agents = []
    for node, addr in zip(hosts.names, hosts.addrs):
        variables = {k: env[k] for k in PASSED if k in env}
        variables.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
        cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--launcher", "torchrun", "--hostfile", str(hostfile),
               "--master-port", str(port), "--local-addr", addr, str(harness.RECIPE),
               *harness.overrides(out, STEPS, "--deepspeed.profile=zero2", "--checkpoint.every=0")]
        remote = (f"cd {shlex.quote(str(harness.ROOT))} && env "
                  + " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items()) + " "
                  + " ".join(shlex.quote(c) for c in cmd))
        log = open(tmp_path / f"{node}.log", "w")
        agents.append((subprocess.Popen(["ssh", node, remote], env=env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        codes = [proc.wait(timeout=600) for proc, _ in agents]
    finally:
        for proc, log in agents:
            if proc.poll() is None:
                proc.kill()
            log.close()
    logs = {node: (tmp_path / f"{node}.log").read_text() for node in hosts.names}
    assert codes == [0, 0], "\n".join(f"--- {n}\n{text[-4000:]}" for n, text in logs.items())
    for node, addr in zip(hosts.names, hosts.addrs):
        argv = shlex.split(next(line for line in logs[node].splitlines() if "torch.distributed.run" in line))
        assert argv[argv.index("--rdzv-endpoint") + 1] == f"127.0.0.2:{port}"  # the first host, as resolved
        assert argv[argv.index("--local-addr") + 1] == addr and argv[argv.index("--nnodes") + 1] == "2"

    ref, _ = plain_training(harness.run_config(tmp_path / "ref", STEPS), world_size=2)
    losses = harness.metrics(out)
    got = [losses[s] for s in range(1, STEPS + 1)]
    assert got == pytest.approx(ref, rel=2e-5, abs=2e-5), (got, ref)
