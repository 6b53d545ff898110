"""What the launch builders share: the launch spec, accelerator and environment helpers.

:mod:`dstrain.launcher` (deepspeed, torchrun) and :mod:`dstrain.slurm` (srun) both
import this module and neither imports the other's internals, so there is no
import circle between them. Nothing here starts a process.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping

DEFAULT_MASTER_PORT = 29500
ACCELERATORS = ("auto", "cpu", "cuda")
TRAIN_MODULE = "dstrain.cli"
LOCAL_HOST_NAMES = frozenset({"localhost", "127.0.0.1", "127.0.1.1", "::1"})
Env = dict[str, str]
Detect = Callable[[], str]


@dataclass(frozen=True)
class LaunchSpec:
    """What to launch and where.

    ``nproc`` is processes per node. With a hostfile, the default ``nproc=1``
    means "one process per slot"; ``nproc > 1``, or any ``nproc`` with
    ``nproc_given`` (``--nproc 1`` / ``--num_gpus 1`` written out, as DeepSpeed's
    ``--num_gpus``), uses slots ``[0, nproc)`` on each host and must not exceed any
    host's slots. ``include``/``exclude`` use
    DeepSpeed's syntax (``host[:slot,slot][@host...]``) and replace ``nproc`` and
    ``num_nodes`` (DeepSpeed rejects the combination). ``master_addr`` is only
    used for multi-node runs: DeepSpeed's local launch always uses 127.0.0.1.
    ``local_addr`` (torchrun only) is this node's address as the other nodes
    reach it; without it torchrun advertises the address its hostname resolves to.
    """

    recipe: str
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    nproc_given: bool = False
    hostfile: str | None = None
    num_nodes: int | None = None
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    include: str | None = None
    exclude: str | None = None
    accelerator: str = "auto"
    local_addr: str | None = None  # torchrun --local-addr: the address other nodes reach this one at

    def __post_init__(self) -> None:
        if isinstance(self.overrides, list):
            object.__setattr__(self, "overrides", tuple(self.overrides))

    def per_host(self) -> int | None:
        """Ranks on each host of a hostfile as asked (``nproc``), or None for every slot of each host."""
        if self.include or self.exclude or not (self.nproc > 1 or self.nproc_given):
            return None
        return self.nproc

    def validate(self) -> None:
        """Raise ValueError listing every problem with this spec."""
        errors = []
        if not isinstance(self.recipe, str) or not self.recipe:
            errors.append(f"recipe must be a non-empty path, got {self.recipe!r}")
        if not isinstance(self.overrides, tuple) or not all(isinstance(o, str) for o in self.overrides):
            errors.append(f"overrides must be a tuple of strings, got {self.overrides!r}")
        if not _is_int(self.nproc) or self.nproc < 1:
            errors.append(f"nproc (processes per node) must be an integer >= 1, got {self.nproc!r}")
        if not _is_int(self.master_port) or not 1 <= self.master_port <= 65535:
            errors.append(f"master_port must be an integer in 1..65535, got {self.master_port!r}")
        if self.num_nodes is not None and (not _is_int(self.num_nodes) or self.num_nodes < 1):
            errors.append(f"num_nodes must be an integer >= 1, got {self.num_nodes!r}")
        if self.include and self.exclude:
            errors.append("include and exclude are mutually exclusive; give one of them")
        if (self.include or self.exclude) and (self.num_nodes is not None or self.nproc != 1):
            errors.append("include/exclude choose the slots themselves; leave nproc=1 and num_nodes unset "
                          "(DeepSpeed rejects --num_gpus/--num_nodes with them)")
        if self.hostfile is not None and not os.path.isfile(self.hostfile):
            errors.append(f"hostfile {self.hostfile!r} does not exist or is not a file")
        if self.accelerator not in ACCELERATORS:
            errors.append(f"accelerator must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}")
        if errors:
            raise ValueError("invalid launch spec: " + "; ".join(errors))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- impure helpers


def detect_accelerator() -> str:
    """Return "cuda" if torch sees a CUDA device, else "cpu" (imports torch lazily)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def local_hostnames() -> frozenset[str]:
    """Names under which a hostfile may refer to this machine: ``localhost``, the loopback addresses Linux
    distributions name it by (127.0.0.1, Debian's 127.0.1.1, ::1), its host name, short and fully qualified,
    with the aliases and addresses the hosts file or DNS give that name, and the addresses of its network
    interfaces. Before, only localhost, 127.0.0.1, ::1 and the host name were: a hostfile naming this machine
    by its FQDN or its own IP was taken for a remote host, reached by ssh to itself through pdsh."""
    return LOCAL_HOST_NAMES | _this_machine()


@functools.lru_cache(maxsize=1)
def _this_machine() -> frozenset[str]:
    name = socket.gethostname()
    names = {name, name.split(".")[0]}
    try:  # forward lookups only (no reverse DNS, which may wait on an unreachable server)
        canonical, aliases, addresses = socket.gethostbyname_ex(name)
        names |= {canonical, *aliases, *addresses}
    except (OSError, UnicodeError):
        pass
    try:
        canonical = socket.getaddrinfo(name, None, flags=socket.AI_CANONNAME)[0][3]
        names.add(canonical)
    except (OSError, UnicodeError, IndexError):
        pass
    names |= set(_interface_addresses())
    return frozenset(n for n in names if n)


def _interface_addresses() -> list[str]:
    """The IPv4 address of each network interface (Linux ``SIOCGIFADDR``) and every IPv6 address
    (``/proc/net/if_inet6``); empty where neither is available."""
    import ipaddress
    import struct
    found = []
    try:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, iface in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", iface.encode()[:15]))  # SIOCGIFADDR
                except OSError:
                    continue  # no IPv4 address on it
                found.append(socket.inet_ntoa(packed[20:24]))
    except (ImportError, OSError, AttributeError):
        pass
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if fields and len(fields[0]) == 32:
                    found.append(str(ipaddress.IPv6Address(int(fields[0], 16))))
    except (OSError, ValueError):
        pass
    return found


def available_cpus() -> int:
    """CPUs this process may run on (affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def find_free_port() -> int:
    """Return a TCP port that was free on 127.0.0.1 a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resolve_accelerator(spec: LaunchSpec, env: Mapping[str, str], detect: Detect) -> str:
    if spec.accelerator != "auto":
        return spec.accelerator
    preset = env.get("DS_ACCELERATOR")
    if preset:  # "cpu", "cuda", or another DeepSpeed accelerator whose env we leave alone
        return preset
    found = detect()
    if found not in ("cpu", "cuda"):
        raise ValueError(f"accelerator detection returned {found!r}; expected 'cpu' or 'cuda'")
    return found


def _start_env(base_env: Mapping[str, str] | None) -> Env:
    return dict(os.environ if base_env is None else base_env)


def _apply_cpu_env(env: Env, procs_per_node: int, cpu_count: int | None) -> None:
    env["DS_ACCELERATOR"] = "cpu"
    if "OMP_NUM_THREADS" not in env:
        cpus = available_cpus() if cpu_count is None else cpu_count
        env["OMP_NUM_THREADS"] = str(max(1, cpus // max(1, procs_per_node)))


def _train_args(spec: LaunchSpec) -> list[str]:
    return ["-m", TRAIN_MODULE, "train", spec.recipe, *spec.overrides]
