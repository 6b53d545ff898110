"""What ``dstrain launch`` checks about the hosts before it starts anything, and what it shows.

:func:`check_hosts_for_launch` reads the hostfile of a multi-host launch, refuses a
bad one (:class:`dstrain.hostfile.HostfileError`, one line naming the file and the
host), resolves every host, optionally checks passwordless ssh to each, and picks the
master address (the first host's address as this machine resolves it, so DeepSpeed
does not ask that host for ``hostname -I``, which may name another interface).
:func:`launch_summary` is the text ``dstrain launch --dry-run`` adds: where the master
is and why, the ports, and the environment ranks on other hosts receive.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from dstrain import hostfile as hf
from dstrain import launcher


@dataclass
class HostCheck:
    """The outcome of the checks: hosts used, where they resolve, the master address and why."""

    hosts: list[tuple[str, int]] = field(default_factory=list)
    found: dict[str, hf.Resolved] = field(default_factory=dict)
    master_addr: str | None = None
    master_why: str = ""
    remote: bool = False
    local_addr: str | None = None  # this machine's entry of the hostfile, resolved (torchrun --local-addr)


def check_hosts_for_launch(spec: launcher.LaunchSpec, reach: bool, torchrun: bool = False,
                           resolve: Callable[[str], hf.Resolved | None] | None = None,
                           probe: hf.Probe | None = None,
                           local_hosts: Sequence[str] | None = None,
                           route: Callable[[str], str | None] | None = None) -> HostCheck:
    """Check the hostfile of ``spec``; raise HostfileError before anything starts.

    Nothing is checked without a hostfile, or when the file is missing (the launch
    spec's own validation names that). A hostfile whose only host is this machine
    runs locally: it is parsed and its slots checked, nothing more. ``resolve`` and
    ``probe`` default to :func:`dstrain.hostfile.resolve_host` / ``check_reachable``
    (looked up at call time). Reachability is not checked for torchrun, which does
    not ssh (its agents are started on every host by the user).
    """
    check = HostCheck(master_addr=spec.master_addr,
                      master_why="given with --master-addr" if spec.master_addr else "")
    if spec.hostfile is None or not os.path.isfile(spec.hostfile):
        if not spec.master_addr:
            check.master_addr, check.master_why = "127.0.0.1", "one node: this machine"
        return check
    hosts = hf.select_hosts(hf.parse_hostfile(spec.hostfile), spec.hostfile, spec.num_nodes, spec.nproc,
                            spec.include, spec.exclude)
    check.hosts = hosts
    local = launcher.local_hostnames() if local_hosts is None else frozenset(local_hosts)
    if len(hosts) == 1 and hosts[0][0] in local:
        if not spec.master_addr:
            check.master_addr, check.master_why = "127.0.0.1", f"the only host of {spec.hostfile} is this machine"
        return check
    check.remote = True
    check.found = hf.check_hosts(hosts, spec.hostfile, reach and not torchrun, resolve or hf.resolve_host,
                                 probe or hf.check_reachable)
    check.master_addr, check.master_why = hf.choose_master(hosts, spec.hostfile, check.found, spec.master_addr)
    here = [h for h, _ in hosts if h in local]
    if here:
        check.local_addr = _routable_local_addr(here[0], hosts, check.found, route or hf.source_address_towards)
    return check


def _routable_local_addr(name: str, hosts: Sequence[tuple[str, int]], found: Mapping[str, hf.Resolved],
                         route: Callable[[str], str | None]) -> str | None:
    """This machine's address for torchrun's ``--local-addr``, which the agent that becomes rendezvous rank 0
    hands every rank as MASTER_ADDR. Its hostfile name resolving to loopback (Debian's ``127.0.1.1 HOSTNAME`` in
    /etc/hosts) while other hosts do not: the address this machine leaves by towards them, else None (torchrun's
    own guess, the host's name), never the loopback address every rank on the other hosts would wait on."""
    addr = found[name].address
    if not hf._is_loopback(addr):
        return addr
    peers = [found[h].address for h, _ in hosts if not hf._is_loopback(found[h].address)]
    return route(peers[0]) if peers else addr


def gpu_shortfall(spec: launcher.LaunchSpec, remote: bool, accelerator: str, torchrun: bool = False,
                  gpu_count: Callable[[], int] | None = None) -> str | None:
    """A local CUDA launch that asks for more ranks than this machine shows GPUs: the problem, or None.

    DeepSpeed's launcher hands ranks 0..nproc-1 their device ids without counting the devices
    (rank 1 of ``--nproc 2`` on a one-GPU machine dies with "invalid device ordinal"), and
    torchrun does the same. Not judged with include/exclude filters (the user picked the
    devices), for ranks on other hosts, or where no GPU is visible here (the accelerator was
    named by hand: the ranks report what they find). ``gpu_count`` defaults to
    ``torch.cuda.device_count()``, which honours CUDA_VISIBLE_DEVICES.
    """
    if accelerator != "cuda" or remote or spec.include or spec.exclude:
        return None
    sizes = launcher.launch_world_size(spec, torchrun=torchrun)
    count = None if sizes is None else gpus_short_of(sizes[1], gpu_count)
    if count is None:
        return None
    return (f"{sizes[1]} ranks on this machine but it shows {count} GPU(s) (CUDA_VISIBLE_DEVICES included): "
            f"launch with --nproc {count} or fewer, or --accelerator cpu for CPU ranks")


#: RAM a CPU rank holds before its model: Python, torch, DeepSpeed and gloo (a rank of models/gpt/recipes/tiny.json,
#: whose model states and activations are 32 MB, held 0.55 GB; the imports alone are about 0.26 GB).
CPU_RANK_BYTES = 500 * 2**20


def rank_shortfall(spec: launcher.LaunchSpec, remote: bool, accelerator: str, torchrun: bool = False) -> str | None:
    """More local ranks than this machine's GPUs (:func:`gpu_shortfall`) or its RAM (:func:`cpu_shortfall`) hold."""
    return gpu_shortfall(spec, remote, accelerator, torchrun) or cpu_shortfall(spec, remote, accelerator, torchrun)


def cpu_shortfall(spec: launcher.LaunchSpec, remote: bool, accelerator: str, torchrun: bool = False,
                  host_memory: int | None = None) -> str | None:
    """A local CPU launch whose ranks cannot all start in this machine's RAM: the problem, or None.

    Each rank holds about ``CPU_RANK_BYTES`` before any model, which the plan's per-rank budget
    (RAM / ranks) does not count: ``--nproc 64`` on a small machine passed the plan of a tiny
    model and the kernel then killed ranks for memory at their first step. More ranks than
    cores is allowed (they share the cores). ``host_memory`` defaults to the machine's RAM.
    """
    if accelerator != "cpu" or remote or spec.include or spec.exclude:
        return None
    sizes = launcher.launch_world_size(spec, torchrun=torchrun)
    if sizes is None:
        return None
    if host_memory is None:
        import psutil
        host_memory = psutil.virtual_memory().total
    most = max(1, host_memory // CPU_RANK_BYTES)
    if sizes[1] <= most:
        return None
    return (f"{sizes[1]} CPU ranks on this machine need about {sizes[1] * CPU_RANK_BYTES / 2**30:.1f} GiB of RAM "
            f"before any model (about {CPU_RANK_BYTES / 2**30:.1f} GiB a rank: Python, torch, DeepSpeed) and it has "
            f"{host_memory / 2**30:.1f} GiB: launch with --nproc {most} or fewer")


def cpu_cores_note(spec: launcher.LaunchSpec, remote: bool, accelerator: str, torchrun: bool = False,
                   cpus: int | None = None) -> str | None:
    """More local CPU ranks than cores (``--nproc 3`` on 2 cores): allowed, since they share the cores, but said in
    one line, since each step then waits for ranks that take turns on a core; None otherwise."""
    if accelerator != "cpu" or remote or spec.include or spec.exclude:
        return None
    sizes = launcher.launch_world_size(spec, torchrun=torchrun)
    if sizes is None:
        return None
    cores = launcher.available_cpus() if cpus is None else cpus
    if sizes[1] <= cores:
        return None
    return (f"{sizes[1]} CPU ranks on this machine's {cores} core(s): ranks take turns on a core, so every step "
            f"waits for them (slower than --nproc {cores}, which gives each rank a core); the run goes on")


def gpus_short_of(ranks: int, gpu_count: Callable[[], int] | None = None) -> int | None:
    """The GPUs this machine shows (``gpu_count``, default ``torch.cuda.device_count``) when they are
    fewer than ``ranks``; None when there are enough, or none at all (nothing to judge by)."""
    if gpu_count is None:
        import torch
        gpu_count = torch.cuda.device_count
    count = gpu_count()
    return count if 0 < count < ranks else None


def launch_summary(check: HostCheck, argv: Sequence[str], env: Mapping[str, str], master_port: int,
                   env_file: str | None, env_lines: str, torchrun: bool = False) -> list[str]:
    """Lines for ``--dry-run``: hosts, master address and why, ports, environment on other hosts."""
    lines = []
    if check.remote:
        shown = []
        for host, slots in check.hosts:
            r = check.found[host]
            port = f", ssh port {r.ssh_port}" if r.ssh_port else ""
            shown.append(f"{host} slots={slots} -> {r.address} ({r.how}{port})")
        lines.append("hosts: " + "; ".join(shown))
    if check.master_addr:
        lines.append(f"master address: {check.master_addr} ({check.master_why})")
    else:
        lines.append(f"master address: left to DeepSpeed ({check.master_why})")
    what = "c10d rendezvous store" if torchrun else "torch.distributed store of rank 0 (MASTER_PORT)"
    lines.append(f"ports: {master_port} for the {what}; gloo/NCCL connections between ranks use "
                 "ports the system picks")
    if check.remote and not torchrun:
        accel = env.get("DS_ACCELERATOR", "cuda")
        forwarded = launcher.deepspeed_forwarded(env, accel)
        lines.append(f"environment on other hosts: from {env_file}: "
                     + (" ".join(env_lines.splitlines()) or "(nothing)"))
        lines.append("environment on other hosts: forwarded by DeepSpeed itself: "
                     + (" ".join(f"{k}={env[k]}" for k in forwarded) or "(nothing)"))
    elif check.remote:
        if "--local-addr" in argv:
            lines.append(f"this node's address: {argv[list(argv).index('--local-addr') + 1]} (torchrun --local-addr)")
        else:
            lines.append("this node's address: torchrun's guess from its hostname (no hostfile entry is this "
                         "machine; --local-addr sets it)")
        lines.append("environment: torchrun runs on this node only; start the same command on every host "
                     "(each host's own environment is used)")
    else:
        lines.append("environment: the ranks run here and inherit this one (plus the variables printed above)")
    return lines


def master_port_problem(master_addr: str | None, port: int) -> str | None:
    """Why rank 0 could not open its store on ``port`` here: another process listens on it (a job still
    running, an earlier one's agent, any server); None when it is free or the master is another machine.

    Without this the ranks start, rank 0 dies in torch's TCPStore with EADDRINUSE, and the other ranks of a
    launch connect to whatever listens there, another job's store included. A port left in TIME_WAIT by a job
    that ended is free (the store reuses it, as this probe does)."""
    import errno
    import socket
    addr = master_addr or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((addr, 0))  # one of this machine's addresses? (else: EADDRNOTAVAIL, or not resolvable)
    except OSError:
        return None  # the master is another host: its port is its own
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("", port))  # where torch's store listens: every address
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            return None
        return (f"master port {port} is in use on this machine ({addr}): another process listens there (a job "
                "still running, or another server); pass --master-port with a free port (on one node, leave it "
                "unset to get one)")
    return None


def nvidia_gpus_here() -> int:
    """GPUs the NVIDIA driver reports on this machine (Linux ``/proc/driver/nvidia/gpus``), whatever torch sees."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def cpu_fallback_note(accelerator: str, environ: Mapping[str, str] | None = None, gpus_here: int | None = None,
                      cuda_available: bool | None = None, torch_cuda: str | None = "?",
                      then: str = "the ranks run on CPU with gloo (--accelerator cpu to mean it)") -> str | None:
    """Why ``--accelerator auto`` found no GPU on a machine that looks meant for one, or None.

    Without this, ``CUDA_VISIBLE_DEVICES=1`` on a one-GPU machine (a device it lacks), ``CUDA_VISIBLE_DEVICES=``, or
    a CPU build of torch beside an NVIDIA driver trained on CPU ranks with gloo, said only by ``DS_ACCELERATOR=cpu``
    in the printed command. Said only when the device was left to detection (no ``--accelerator``, no
    ``DS_ACCELERATOR``) and either CUDA_VISIBLE_DEVICES is set or the driver reports GPUs."""
    env = os.environ if environ is None else environ
    if accelerator != "auto" or env.get("DS_ACCELERATOR"):
        return None
    import torch
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if cuda_available:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = nvidia_gpus_here() if gpus_here is None else gpus_here
    if visible is None and not gpus:
        return None
    build = torch.version.cuda if torch_cuda == "?" else torch_cuda
    driver = f"; the driver reports {gpus} GPU(s) here" if gpus else ""
    if visible is not None and visible.strip() in ("", "-1"):
        why = f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    elif build is None:
        why = f"torch {torch.__version__} is a CPU build{driver} (install torch's CUDA build for GPU ranks)"
    elif visible is not None:
        why = f"CUDA_VISIBLE_DEVICES={visible!r} names no device torch can open{driver}"
    else:
        why = f"torch (CUDA {build}) cannot open the GPU(s) the driver reports (a driver older than that CUDA?)"
    return f"no GPU visible to torch: {why}; {then}"


def no_gpu_problem(accelerator: str, remote: bool, gpu_count: Callable[[], int] | None = None,
                   environ: Mapping[str, str] | None = None) -> str | None:
    """GPU ranks asked for by name (``--accelerator cuda``, ``DS_ACCELERATOR=cuda``) on this machine where torch sees
    no GPU (``CUDA_VISIBLE_DEVICES=""``, a CPU build of torch): the problem, else None. Before, the ranks found no
    GPU and trained on the CPU without a word (detection, ``--accelerator auto``, says so in a note instead)."""
    if accelerator != "cuda" or remote:
        return None
    if gpu_count is None:
        import torch
        gpu_count = torch.cuda.device_count
    if gpu_count() > 0:
        return None
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no CUDA device found"
    return (f"GPU ranks were asked for (--accelerator cuda or DS_ACCELERATOR=cuda) but torch sees no GPU here ({why}); "
            "make one visible (unset or fix CUDA_VISIBLE_DEVICES), or --accelerator cpu for CPU ranks")


def nccl_problem(accelerator: str, remote: bool, nccl_available: bool | None = None) -> str | None:
    """GPU ranks here with a torch built without NCCL (they would all stop in ``init_process_group``), or None."""
    if accelerator != "cuda" or remote:
        return None
    import torch
    if nccl_available is None:
        nccl_available = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    if nccl_available:
        return None
    return (f"torch {torch.__version__} has no NCCL, which GPU ranks talk through: install a CUDA build of torch "
            "with NCCL (Linux wheels have it), or --accelerator cpu for CPU ranks with gloo")


def ssh_ended_line(hosts: Sequence[tuple[str, int]], probe: hf.Probe | None = None) -> str:
    """What a multi-host DeepSpeed launch that ended with status 255 says. ``pdsh -S`` returns the largest of the
    hosts' statuses, and 255 is ssh's own failure: a host that vanished mid-run (power, network, a panic: its
    session ended by ssh's keep-alive, :func:`dstrain.launcher.ssh_keepalive`). Read as a signal (256 - 255: SIGHUP)
    it was "a rank was killed by signal 1", exit 129, a stop that ``--max-restarts`` never restarts. The hosts are
    asked again (passwordless ssh, in parallel) to name the ones gone."""
    gone = hf.unreachable([h for h, _ in hosts], probe or hf.check_reachable)
    if gone:
        return ("the ranks of " + ", ".join(f"host {h!r} ({why})" for h, why in gone) + " were lost: "
                f"{'it no longer answers' if len(gone) == 1 else 'they no longer answer'} ssh (powered off, "
                "rebooted, or its network went down); the other hosts' ranks ended")
    return ("an ssh session to a host ended with status 255 (its network dropped, or a rank there was killed by "
            "SIGHUP); the pdsh@ line above names the host")


def gone_hosts_problem(hosts: Sequence[tuple[str, int]], path: str, probe: hf.Probe | None = None) -> str | None:
    """Before a restart of a multi-host job: a host that passwordless ssh no longer reaches would only fail the
    restart (pdsh's connect timeout, exit 255 again, restart after restart); None when every host answers."""
    gone = hf.unreachable([h for h, _ in hosts], probe or hf.check_reachable)
    if not gone:
        return None
    return ("not restarting: " + ", ".join(f"host {h!r} of {path} is unreachable by passwordless ssh ({why})"
                                           for h, why in gone)
            + f"; take it out of {path} (keeping the global batch: train.grad_accum or train.micro_batch) and "
            "launch again with --resume")


def wait_for_remote_save(out, limit_s: float, probe: Callable | None = None, sleep: Callable | None = None,
                         clock: Callable | None = None) -> str | None:
    """After a stop (Ctrl-C, SIGTERM) passed on to ranks on other hosts: wait until rank 0 lets go of the run
    folder's lock (``dstrain.run_lock``: it saved the stop's checkpoint and left), at most ``limit_s``. DeepSpeed's
    pdsh runner leaves about a second after the stop (it ends pdsh, whose ssh sessions carried the ranks' output,
    their stop line included) while those ranks still save: ``dstrain launch`` returned 130 before the checkpoint
    was complete, and a ``--resume`` (or a batch job ending with it) came too early. Returns the lock's holder
    line where it was still held after ``limit_s``, else None."""
    import time
    from dstrain import run_lock
    probe, sleep, clock = probe or run_lock.probe, sleep or time.sleep, clock or time.monotonic
    end = clock() + limit_s
    while (held := probe(out)) is not None:
        if clock() >= end:
            return held
        sleep(0.5)
    return None


def remote_stop_line(out, signum: int) -> str:
    """A multi-host job stopped by a signal: wait for its ranks on other hosts to save and leave (their own stop
    line never comes back: pdsh is gone, :func:`wait_for_remote_save`), then the one line saying where it stands."""
    import signal
    from pathlib import Path

    from dstrain import checkpoint as ckpt
    from dstrain.job_guard import GRACE_S
    out = Path(out)
    held = wait_for_remote_save(out, GRACE_S)
    latest = ckpt.find_latest(out / "checkpoints") or "none yet"
    name = signal.Signals(signum).name
    if held:
        return (f"dstrain: stopped by {name}, but after {GRACE_S:.0f}s {held.split('; wait')[0]}: its stop's "
                f"checkpoint may be incomplete; --resume takes the latest complete one ({latest})")
    return (f"dstrain: stopped by {name}; the ranks on every host have left; latest complete checkpoint: {latest} "
            f"in {out / 'checkpoints'} (--resume continues from it)")
