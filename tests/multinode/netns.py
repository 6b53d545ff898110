"""Pretend hosts closer to real ones: Linux network namespaces on a private bridge.

``make_namespaces(count)`` creates ``count`` namespaces, each with its own loopback and an
``eth0`` (one end of a veth pair) on a bridge in this namespace, addresses 10.213.S.2,
10.213.S.3, ... (S from the process id; the bridge holds 10.213.S.1 so this namespace
reaches them). No forwarding or NAT is set up: nothing in the namespaces can reach
anything but each other and this machine's bridge address. Returns the addresses, the
namespace names and a function that removes it all (namespaces first, then the bridge).
Needs root and ``ip`` (iproute2); :class:`HostsUnavailable` otherwise.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Callable


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def make_namespaces(count: int, unavailable: type[Exception]) -> tuple[list[str], list[str], Callable[[], None]]:
    if os.getuid() != 0 or shutil.which("ip") is None:
        raise unavailable("network namespaces need root and iproute2's ip")
    tag = f"ds{os.getpid() % 100000}"
    subnet = f"10.213.{os.getpid() % 250}"
    bridge, names, addrs = f"{tag}br", [f"{tag}n{i}" for i in range(count)], []

    def teardown() -> None:
        for i, ns in enumerate(names):
            subprocess.run(["ip", "link", "delete", f"{tag}v{i}"], capture_output=True)  # and its peer
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        subprocess.run(["ip", "link", "delete", bridge], capture_output=True)

    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, ns in enumerate(names):
            addr = f"{subnet}.{i + 2}"
            _ip("netns", "add", ns)
            _ip("link", "add", f"{tag}v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", f"{tag}v{i}", "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            addrs.append(addr)
    except RuntimeError as err:
        teardown()
        raise unavailable(f"cannot build network namespaces: {err}") from None
    return addrs, names, teardown
