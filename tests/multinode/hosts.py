"""Pretend hosts on this machine: one ``sshd`` per loopback address, reached by alias.

``start_hosts(folder, n)`` starts ``n`` sshd daemons, host ``i`` (``node1``, ``node2``,
...) listening only on ``127.0.0.(i+1)`` at a free port, each with its own host key, a
client key generated for the current user, and an ssh client config mapping the aliases
to those addresses. Nothing global changes (except creating sshd's privilege-separation
folder where the machine lacks it and we are root): the client config reaches ``ssh``
through a wrapper script put first on ``PATH`` (``ssh`` reads the user's config from the
password database's home, not from ``$HOME``), and ``pdsh`` reaches it through
``PDSH_SSH_ARGS``. The config also names ``node-down`` (:data:`DOWN`), an address and port where
nothing listens. Every address used is in 127.0.0.0/8.

With ``netns=True`` each host is instead a network namespace of its own (tests/multinode/netns.py:
``eth0`` on a private bridge, 10.213.x.y, sshd on port 22), closer to real machines: its ranks
reach the others only through that interface (``Hosts.iface`` names it for GLOO_SOCKET_IFNAME).

When the machine cannot do it (no sshd, ssh-keygen or pdsh; sshd refuses to start), a
:class:`HostsUnavailable` says why; the fixture turns it into a skip.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


DOWN = "node-down"  # in the ssh config, nothing listening behind it


class HostsUnavailable(RuntimeError):
    """This machine cannot run the pretend hosts; the message says why."""


@dataclass
class Hosts:
    folder: Path
    names: list[str]
    addrs: list[str]
    ports: list[int]
    ssh_config: Path
    bin_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    iface: str = "lo"  # the interface gloo should bind on every host (GLOO_SOCKET_IFNAME)
    teardown: list = field(default_factory=list)

    def env(self, base: dict | None = None) -> dict:
        """Environment in which ``ssh NAME`` and ``pdsh -w NAME`` reach the pretend hosts."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["PDSH_RCMD_TYPE"] = "ssh"
        env["PDSH_SSH_ARGS"] = f"-F {self.ssh_config} -x -l%u %h"
        return env

    def hostfile(self, slots: int, path: Path | None = None) -> Path:
        path = path or self.folder / f"hostfile_{slots}"
        path.write_text("".join(f"{name} slots={slots}\n" for name in self.names))
        return path

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for undo in self.teardown:
            undo()


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def _need(program: str, hint: str) -> str:
    path = shutil.which(program) or next((p for p in (f"/usr/sbin/{program}", f"/sbin/{program}")
                                          if os.access(p, os.X_OK)), None)
    if path is None:
        raise HostsUnavailable(f"{program} not found ({hint})")
    return path


def start_hosts(folder: Path, count: int = 2, timeout: float = 20.0, netns: bool = False) -> Hosts:
    """Hosts on loopback aliases, or with ``netns`` each in its own network namespace (see netns.py)."""
    sshd = _need("sshd", "apt-get install openssh-server")
    keygen = _need("ssh-keygen", "apt-get install openssh-client")
    ssh = _need("ssh", "apt-get install openssh-client")
    _need("pdsh", "apt-get install pdsh")
    folder.mkdir(parents=True, exist_ok=True)
    user = os.environ.get("USER") or __import__("pwd").getpwuid(os.getuid()).pw_name
    privsep = Path("/run/sshd")
    if not privsep.is_dir():
        if os.getuid() != 0:
            raise HostsUnavailable("sshd needs /run/sshd, which is missing, and we are not root to create it")
        privsep.mkdir(mode=0o755, parents=True, exist_ok=True)

    client_key = folder / "client_key"
    subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(client_key)], check=True)
    authorized = folder / "authorized_keys"
    shutil.copy(f"{client_key}.pub", authorized)
    authorized.chmod(0o600)

    names = [f"node{i + 1}" for i in range(count)]
    addrs = [f"127.0.0.{i + 2}" for i in range(count)]
    spaces, teardown = [None] * count, []
    if netns:
        from tests.multinode.netns import make_namespaces
        addrs, spaces, undo = make_namespaces(count, HostsUnavailable)
        teardown.append(undo)
    ports, procs, config_lines = [], [], []
    hosts = None
    try:
        for name, addr, space in zip(names, addrs, spaces):
            try:
                port = 22 if space else _free_port(addr)
            except OSError as err:
                raise HostsUnavailable(f"cannot bind {addr} ({err}): no loopback alias") from None
            host_key = folder / f"{name}_host_key"
            subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
            conf = folder / f"{name}_sshd_config"
            conf.write_text(
                f"ListenAddress {addr}:{port}\nHostKey {host_key}\nPidFile {folder / name}.pid\n"
                f"AuthorizedKeysFile {authorized}\nStrictModes no\nUsePAM no\nPermitRootLogin yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
                "AllowTcpForwarding no\nX11Forwarding no\nPrintMotd no\nMaxStartups 100\n"
                "MaxSessions 100\nLogLevel ERROR\n")
            log = open(folder / f"{name}_sshd.log", "w")
            prefix = ["ip", "netns", "exec", space] if space else []
            procs.append(subprocess.Popen([*prefix, sshd, "-D", "-e", "-f", str(conf)], stdout=log, stderr=log))
            ports.append(port)
            config_lines.append(
                f"Host {name}\n  HostName {addr}\n  Port {port}\n  User {user}\n  IdentityFile {client_key}\n"
                "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                "  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 5\n")
        # An alias that resolves (through the config) but where no sshd listens: an unreachable host.
        config_lines.append(f"Host {DOWN}\n  HostName 127.0.0.250\n  Port {_free_port('127.0.0.250')}\n"
                            "  BatchMode yes\n  LogLevel ERROR\n  ConnectTimeout 5\n")
        ssh_config = folder / "ssh_config"
        ssh_config.write_text("".join(config_lines))
        bin_dir = folder / "bin"
        bin_dir.mkdir(exist_ok=True)
        wrapper = bin_dir / "ssh"
        # Stands in for the user's ~/.ssh/config: every ssh call (DeepSpeed's, pdsh's, dstrain's) reads ours.
        wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -F ] && exec {ssh} "$@"; done\n'
                           f'exec {ssh} -F {ssh_config} "$@"\n')
        wrapper.chmod(0o755)
        hosts = Hosts(folder, names, addrs, ports, ssh_config, bin_dir, procs, "eth0" if netns else "lo", teardown)
        _wait_until_up(hosts, timeout)
        return hosts
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for undo in teardown:
            undo()
        raise


def _wait_until_up(hosts: Hosts, timeout: float) -> None:
    env = hosts.env()
    deadline = time.monotonic() + timeout
    for name, proc in zip(hosts.names, hosts.procs):
        while True:
            if proc.poll() is not None:
                log = (hosts.folder / f"{name}_sshd.log").read_text().strip()
                raise HostsUnavailable(f"sshd for {name} exited with {proc.returncode}: {log[-300:]}")
            done = subprocess.run(["ssh", name, "true"], env=env, capture_output=True, text=True)
            if done.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise HostsUnavailable(f"ssh {name} true failed after {timeout:.0f}s: {done.stderr.strip()[-300:]}")
            time.sleep(0.2)
