"""Hostfiles: read, write, and check them before a multi-host launch starts anything.

A DeepSpeed hostfile has one ``hostname slots=N`` line per machine (``#`` comments).
Every refusal here is a :class:`HostfileError` (a ValueError) with one line naming
the file and the host: a malformed line, zero or non-integer slots, a duplicate
host, more ranks asked (``--num-nodes``, ``--nproc``, include/exclude) than the
file has, a host that does not resolve (neither DNS nor an ssh config alias) and,
for real launches, a host that ``ssh -o BatchMode=yes`` cannot reach.

Reading and writing are pure. :func:`resolve_host` and :func:`check_reachable`
run ``ssh -G`` / ``ssh ... true`` and take their runners as arguments, so the
launch command builders stay pure and the checks are testable without a network.
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from dstrain.slurm import expand_nodelist, tasks_per_node_counts

Hosts = list[tuple[str, int]]
SSH_CONNECT_TIMEOUT = 5


class HostfileError(ValueError):
    """A hostfile (or host list) that must not be launched; the message is one line."""


# --------------------------------------------------------------------------- read and write

# "host slots=N", optionally followed by key=value fields (e.g. OpenMPI's max_slots=N), ignored.
_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\S*)(?:\s+\S+=\S*)*\s*$")


def _slots(text: str, where: str, host: str) -> int:
    if not re.fullmatch(r"\d+", text or ""):
        raise HostfileError(f"{where}: host {host!r} has slots={text!r}; need an integer >= 1")
    if int(text) < 1:
        raise HostfileError(f"{where}: host {host!r} has slots={text}; need at least 1")
    return int(text)


def _check_default_slots(slots: int) -> None:
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise HostfileError(f"--slots must be an integer >= 1, got {slots!r}")


def parse_hostfile(path: str | os.PathLike) -> Hosts:
    """``[(host, slots), ...]`` in file order; HostfileError naming file, line and host otherwise."""
    hosts: Hosts = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            match = _HOSTFILE_LINE.match(line)
            if match is None:
                raise HostfileError(f"{path}:{lineno}: expected 'hostname slots=N', got {raw.strip()!r}")
            host = match.group(1)
            slots = _slots(match.group(2), f"{path}:{lineno}", host)
            if host in seen:
                raise HostfileError(f"{path}:{lineno}: host {host!r} already listed on line {seen[host]}")
            seen[host] = lineno
            hosts.append((host, slots))
    if not hosts:
        raise HostfileError(f"{path}: no hosts found (expected lines like 'worker-0 slots=8')")
    return hosts


def parse_host_list(items: Sequence[str], slots: int = 1) -> Hosts:
    """``["node1", "node2:4"]`` -> ``[("node1", slots), ("node2", 4)]``; duplicates and bad slots refused."""
    _check_default_slots(slots)
    hosts: Hosts = []
    for item in items:
        host, sep, count = item.partition(":")
        if not host or any(c.isspace() for c in host) or "#" in host:
            raise HostfileError(f"host list: bad host name {item!r}")
        hosts.append((host, _slots(count, "host list", host) if sep else slots))
    return _no_duplicates(hosts, "host list")


def hosts_from_slurm(environ: Mapping[str, str], slots: int | None = None) -> Hosts:
    """Hosts of a SLURM allocation: SLURM_JOB_NODELIST, with SLURM_TASKS_PER_NODE (or ``slots``) each."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise HostfileError("--from-slurm: SLURM_JOB_NODELIST is not set (run inside a SLURM allocation)")
    names = expand_nodelist(nodelist)
    if slots is not None:
        _check_default_slots(slots)
        return _no_duplicates([(n, slots) for n in names], "SLURM_JOB_NODELIST")
    per_node = environ.get("SLURM_TASKS_PER_NODE")
    if not per_node:
        raise HostfileError("--from-slurm: SLURM_TASKS_PER_NODE is not set; give --slots N")
    counts = tasks_per_node_counts(per_node)
    if counts is None or len(counts) != len(names):
        raise HostfileError(f"--from-slurm: SLURM_TASKS_PER_NODE={per_node!r} does not give one count for each "
                            f"of the {len(names)} nodes of {nodelist!r}")
    for name, count in zip(names, counts):
        _slots(str(count), "SLURM_TASKS_PER_NODE", name)
    return _no_duplicates(list(zip(names, counts)), "SLURM_JOB_NODELIST")


def _no_duplicates(hosts: Hosts, where: str) -> Hosts:
    seen = set()
    for host, _ in hosts:
        if host in seen:
            raise HostfileError(f"{where}: host {host!r} listed twice")
        seen.add(host)
    return hosts


def format_hostfile(hosts: Hosts) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts)


# --------------------------------------------------------------------------- ranks asked vs slots


def select_hosts(hosts: Hosts, path: str, num_nodes: int | None = None, nproc: int = 1,
                 include: str | None = None, exclude: str | None = None) -> Hosts:
    """The hosts a launch uses (the first ``num_nodes``); refuses asking for more ranks than there are slots."""
    if num_nodes is not None:
        if num_nodes > len(hosts):
            raise HostfileError(f"num_nodes={num_nodes} but hostfile {path} lists only {len(hosts)} host(s)")
        hosts = hosts[:num_nodes]
    if nproc > 1:
        short = [f"{h} (slots={s})" for h, s in hosts if s < nproc]
        if short:
            raise HostfileError(f"nproc={nproc} exceeds the slots of {', '.join(short)} in {path}")
    slots = dict(hosts)
    for option, value in (("include", include), ("exclude", exclude)):
        for node in (value or "").split("@") if value else []:
            name, sep, picked = node.partition(":")
            if name in ("localhost", "127.0.0.1") and len(hosts) == 1:
                name = hosts[0][0]
            if name not in slots:
                raise HostfileError(f"--{option}: host {name!r} is not in hostfile {path}")
            for slot in picked.split(",") if sep else []:
                if not slot.isdigit() or int(slot) >= slots[name]:
                    raise HostfileError(f"--{option}: host {name!r} has no slot {slot!r} "
                                        f"(slots={slots[name]} in {path})")
    return hosts


# --------------------------------------------------------------------------- resolve and reach


@dataclass(frozen=True)
class Resolved:
    host: str
    address: str
    how: str  # "ssh config HostName X" or "DNS / hosts file"
    ssh_port: int | None = None


SshLookup = Callable[[str], "tuple[str, int] | None"]
AddrLookup = Callable[[str], "str | None"]
Probe = Callable[[str], "str | None"]


def ssh_config_target(host: str) -> tuple[str, int] | None:
    """``(HostName, Port)`` that ssh would use for ``host`` (``ssh -G``), or None without ssh."""
    if shutil.which("ssh") is None:
        return None
    try:
        done = subprocess.run(["ssh", "-G", host], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    fields = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    port = fields.get("port", "22")
    return fields.get("hostname", host), int(port) if port.isdigit() else 22


def address_of(name: str) -> str | None:
    """First IPv4 address of ``name`` (else the first address), or None when it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    return (v4 or [i[4][0] for i in infos] or [None])[0]


def resolve_host(host: str, ssh_lookup: SshLookup = ssh_config_target,
                 addr_lookup: AddrLookup = address_of) -> Resolved | None:
    """Where ``host`` is: through an ssh config alias (HostName) if it has one, else DNS/hosts file."""
    target = ssh_lookup(host)
    name, port = target if target else (host, None)
    address = addr_lookup(name)
    if address is None:
        return None
    how = f"ssh config HostName {name}" if name != host else "DNS / hosts file"
    return Resolved(host, address, how, port)


def check_reachable(host: str, timeout: int = SSH_CONNECT_TIMEOUT) -> str | None:
    """None when ``ssh HOST true`` works without a password; else why not (ssh's last line)."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", host, "true"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 10, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "ssh is not installed on this machine"
    except subprocess.TimeoutExpired:
        return f"ssh did not finish within {timeout + 10}s"
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    if any("IDENTIFICATION HAS CHANGED" in line for line in lines):  # a banner of @ lines before the last one
        remove = [line.strip() for line in lines if line.strip().startswith("ssh-keygen ")]
        return ("REMOTE HOST IDENTIFICATION HAS CHANGED" + (f", remove the old key with: {remove[0]}" if remove else "")
                + f"; {lines[-1]}")
    return lines[-1] if lines else f"ssh exited with status {done.returncode}"


def check_hosts(hosts: Hosts, path: str, reach: bool, resolve: Callable[[str], Resolved | None] = resolve_host,
                probe: Probe = check_reachable) -> dict[str, Resolved]:
    """Resolve every host (and, with ``reach``, ssh to each, in parallel); HostfileError for the first bad one."""
    names = [h for h, _ in hosts]
    with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
        found = dict(zip(names, pool.map(resolve, names)))
        for name in names:
            if found[name] is None:
                raise HostfileError(f"hostfile {path}: host {name!r} does not resolve "
                                    "(not in DNS or the hosts file, and no ssh config HostName for it)")
        _one_entry_per_machine(names, found, path)
    for name, why in unreachable(names, probe)[:1] if reach else ():
        raise HostfileError(f"hostfile {path}: host {name!r} is unreachable by passwordless ssh "
                            f"({why}); {ssh_fix(why, name)}")
    return found


def unreachable(names: Sequence[str], probe: Probe = check_reachable) -> list[tuple[str, str]]:
    """``(host, ssh's complaint)`` for each of ``names`` that passwordless ssh does not reach (asked in parallel),
    in their order."""
    with ThreadPoolExecutor(max_workers=min(32, len(names) or 1)) as pool:
        return [(name, why) for name, why in zip(names, pool.map(probe, names)) if why is not None]


def ssh_fix(why: str, host: str) -> str:
    """What to do about ssh's complaint ``why`` for ``host``. DeepSpeed's pdsh runner meets the same failure
    later (its ssh has no terminal to ask on), so skipping the check is the advice only where nothing is known."""
    low = why.lower()
    if "remote host identification has changed" in low:
        removal = "remove the old key as ssh says" if "ssh-keygen " in why else f"'ssh-keygen -R {host}'"
        return (f"its host key changed (a reinstalled machine? else someone in between): {removal}, then "
                f"'ssh {host} true' once")
    if "host key verification failed" in low or "authenticity of host" in low:
        return (f"its host key is not in known_hosts: run 'ssh {host} true' once here and accept it "
                f"(or 'ssh-keyscan {host} >> ~/.ssh/known_hosts')")
    if "permission denied" in low:
        return (f"it refuses every key ssh offers without a password: 'ssh-copy-id {host}' (or name the key with "
                "IdentityFile in ~/.ssh/config)")
    return "--no-ssh-check skips this check"


def pdsh_problem(which: Callable[[str], "str | None"] = shutil.which) -> str | None:
    """DeepSpeed's multi-host runner starts every host's ranks through ``pdsh`` on this machine; without it
    DeepSpeed stops with a traceback (``launcher 'pdsh' not installed``) after dstrain has started the launch."""
    if which("pdsh"):
        return None
    return ("pdsh is not installed on this machine, and DeepSpeed starts the ranks of other hosts through it: "
            "install it ('apt-get install pdsh', 'dnf install pdsh'), or start one agent per host with "
            "--launcher torchrun")


def _one_entry_per_machine(names: Sequence[str], found: Mapping[str, Resolved], path: str) -> None:
    """Two entries that reach one machine (the same address and ssh port: a name and its alias or IP, ``node1``
    and ``node1.cluster``) would each start ranks there with local ranks 0..slots-1, two on every GPU, and the
    names check (``host already listed``) cannot see it."""
    seen: dict[tuple[str, int], str] = {}
    for name in names:
        key = (found[name].address, found[name].ssh_port or 22)
        if key in seen:
            raise HostfileError(f"hostfile {path}: hosts {seen[key]!r} and {name!r} are one machine ({key[0]}, ssh "
                                f"port {key[1]}): each would start its ranks there, on the same GPUs; list it once, "
                                "with the slots it has")
        seen[key] = name


def choose_master(hosts: Hosts, path: str, found: Mapping[str, Resolved],
                  given: str | None = None) -> tuple[str | None, str]:
    """``(address, why)`` of the rank-0 host every rank connects to; address None leaves it to DeepSpeed."""
    if given:
        return given, "given with --master-addr"
    first = found[hosts[0][0]]
    loopback = [_is_loopback(found[h].address) for h, _ in hosts]
    if loopback[0] and not all(loopback):
        return None, (f"the first host {first.host!r} resolves to loopback {first.address} here but other hosts do "
                      "not: DeepSpeed asks it for its address ('ssh HOST hostname -I'); set --master-addr to choose")
    return first.address, f"the first host ({first.host}) of hostfile {path}, resolved via {first.how}"


def source_address_towards(address: str) -> str | None:
    """The address of this machine that packets to ``address`` leave from (a UDP socket's connect sends
    nothing); None without a route there."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))
            mine = sock.getsockname()[0]
    except OSError:
        return None
    return None if _is_loopback(mine) else mine


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
