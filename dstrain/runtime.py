"""Process-group start-up shared by every trainer: env discovery, backend, seeding."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _fill_env() -> None:
    """Make a plain ``python -m dstrain.cli train`` (or srun) look like a launcher's child."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        from dstrain.launcher import env_from_slurm
        os.environ.update(env_from_slurm(os.environ))
    if "RANK" not in os.environ:
        from dstrain.launcher import find_free_port
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", str(find_free_port()))})
    os.environ.setdefault("LOCAL_RANK", "0")


def use_cpu_accelerator_if_no_gpu() -> None:
    """DeepSpeed must be told before import that a GPU-less machine uses its CPU accelerator."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


_TIMEOUT = None
"""The collective timeout the process group was started with (None: torch's default)."""


def ranks_use_cuda() -> bool:
    """Whether this process's ranks run on CUDA: a GPU is visible and ``DS_ACCELERATOR`` is not "cpu"
    (CPU ranks on a machine with a GPU, as the 2-rank tests run on a GPU test machine, leave the GPU alone:
    no CUDA context, no GPU datasheet for MFU, no CUDA generator in checkpoints)."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def group_timeout():
    """Timeout for process groups made after the default one (``dist.new_group``): the run's
    ``train.collective_timeout_s`` rather than torch's default (10 minutes under NCCL)."""
    return _TIMEOUT


def quiet_renamed_collectives() -> None:
    """torch 2.13 warns on every rank that ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are deprecated
    (four lines a rank in a ZeRO-3 run, about calls inside DeepSpeed 0.19, and in sequence.py's backward), names
    that still work and that the user can do nothing about: left out."""
    import warnings
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                                              r"is deprecated", category=FutureWarning)


def init_distributed(timeout_s: float | None = None) -> World:
    """Start the process group (NCCL on GPUs, gloo on CPU) and return this rank's place.

    ``timeout_s``: how long a collective may wait before it fails (torch's default if None).
    """
    quiet_renamed_collectives()
    use_cpu_accelerator_if_no_gpu()
    _fill_env()
    import deepspeed
    import torch.distributed as dist

    global _TIMEOUT
    cuda = ranks_use_cuda()
    given = os.environ.get("LOCAL_RANK", "0").strip()
    local_rank = int(given) if given.isdigit() else 0  # (not a number: check_rank_env says so below)
    if cuda:  # before the group starts: NCCL (and DeepSpeed's device_id) take this rank's device
        from deepspeed.accelerator import get_accelerator

        from dstrain.gpu_binding import bind_accelerator, device_index
        index = device_index(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        bind_accelerator(get_accelerator(), local_rank, index)
    if not dist.is_initialized():
        kwargs = {}
        if timeout_s is not None:
            from datetime import timedelta
            kwargs["timeout"] = _TIMEOUT = timedelta(seconds=timeout_s)
        from dstrain.rank_exit import stop_ends_joining
        try:
            with stop_ends_joining():  # a wait for peers that never come ends on SIGTERM / Ctrl-C
                check_rank_env()  # (inside: its wait for rank 0's name to resolve ends on a stop signal too)
                store = _restart_store(kwargs.get("timeout"))
                if store is not None:  # DeepSpeed's init then takes the group as it is
                    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=int(os.environ["RANK"]),
                                            world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
                deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False,
                                           **kwargs)
        except RuntimeError as err:  # (torch's DistNetworkError; NCCL's DistBackendError)
            from dstrain.gpu_binding import shared_gpu_error
            raise port_in_use_error(err) or shared_gpu_error(err) or err
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", world)))
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world)
    if cuda:  # cuda:LOCAL_RANK, or cuda:0 for a rank that sees one GPU (its own): dstrain.gpu_binding
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")
        threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // local_world)
        torch.set_num_threads(threads)
    return World(rank, world, local_rank, local_world, device)


_COUNTS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT")


def _whole_number(environ, name: str, who_sets: str) -> int:
    """The launcher variable ``name`` of ``environ`` as an int, else a ``LaunchError`` naming it (``who_sets``: what
    sets it, for the fix)."""
    value = environ.get(name, "")
    if not value.strip().isdigit():
        from dstrain.config import LaunchError
        raise LaunchError(f"{name}={value!r} in this rank's environment is not a whole number; unset it ({who_sets}) "
                          "or set it to one")
    return int(value)


def check_given_rank_env(environ=None, gpus: int | None = None) -> None:
    """A ``LaunchError`` naming the variable when the launcher variables that ARE set (by hand, a script, a shell left
    from another job) cannot describe this rank, before ``dstrain train`` reads them: a count that is not a whole
    number (``WORLD_SIZE=abc`` was a ValueError traceback), ``WORLD_SIZE=0`` or WORLD_SIZE without RANK (both
    replaced by one rank in silence), a LOCAL_RANK at or past the ranks of its node, or past the GPUs this rank sees
    (``gpus``: on CUDA, torch's count; "invalid device ordinal" before) unless it sees exactly one, its own
    (:func:`dstrain.gpu_binding.device_index`)."""
    from dstrain.config import LaunchError
    environ = os.environ if environ is None else environ
    fix = "unset it (dstrain launch and the launchers set it) or set it to"
    got = {name: _whole_number(environ, name, "dstrain launch and the launchers set it") for name in _COUNTS
           if name in environ}
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if got.get(name) == 0:
            raise LaunchError(f"{name}=0 in this rank's environment: a job has at least one rank; {fix} the number "
                              "of ranks")
    if got.get("WORLD_SIZE", 1) > 1 and "RANK" not in got and "SLURM_PROCID" not in environ:
        raise LaunchError(f"WORLD_SIZE={got['WORLD_SIZE']} but RANK is not set: this process cannot tell which rank "
                          "it is; start the ranks with dstrain launch (or set RANK), or unset WORLD_SIZE for one")
    local = got.get("LOCAL_WORLD_SIZE")  # (torchrun's, exact; DeepSpeed's LOCAL_SIZE is a pool that may be larger)
    if "LOCAL_RANK" in got and local is not None and got["LOCAL_RANK"] >= local:
        raise LaunchError(f"LOCAL_RANK={got['LOCAL_RANK']} with {local} rank(s) on this node (LOCAL_WORLD_SIZE): a "
                          f"local rank must be below it; {fix} one below {local}")
    if "LOCAL_RANK" in got and gpus:  # (one GPU seen: the rank's own, whatever its LOCAL_RANK)
        from dstrain.gpu_binding import device_index
        device_index(got["LOCAL_RANK"], gpus, environ)


def check_rank_env(environ=None, resolve_wait_s: float = 60.0) -> None:
    """A ``LaunchError`` naming the variable when this rank's RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT cannot start a job (set by hand, by a script, or left in the shell from another job): torch
    raised a bare ``ValueError`` traceback for a port that is not a number or out of range, and a MASTER_ADDR
    no resolver knows kept the ranks other than 0 retrying until the collective timeout (30 minutes). A name that
    does not resolve is looked up again for ``resolve_wait_s`` first: rank 0's name may not be in DNS yet when the
    other ranks start (Kubernetes' headless services publish a pod's record only once it runs)."""
    from dstrain.config import LaunchError
    environ = os.environ if environ is None else environ  # (read now: _fill_env wrote to os.environ as it is now)
    rank, world, _, port = (_whole_number(environ, name, "a launcher sets it")
                            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))
    if world < 1 or rank >= world:
        raise LaunchError(f"RANK={rank} with WORLD_SIZE={world}: a rank must be below the number of ranks; "
                          "check the launcher's variables (or unset them to run one process)")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1-65535); unset it (dstrain launch picks a free "
                          "one) or choose another")
    addr = environ.get("MASTER_ADDR", "").strip()
    if not addr:
        raise LaunchError("MASTER_ADDR is empty in this rank's environment; set it to rank 0's host or unset it")
    if rank != 0 and world > 1:  # rank 0 listens; the others must find it
        import socket
        import time
        until = time.monotonic() + resolve_wait_s
        while True:
            try:
                socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
                break
            except socket.gaierror as err:
                if err.errno != socket.EAI_NONAME:  # a temporary DNS failure is left to torch's retries
                    break
                if time.monotonic() < until:  # (not in DNS yet: a record published when rank 0's pod runs)
                    time.sleep(1.0)
                    continue
                raise LaunchError(f"MASTER_ADDR={addr!r} does not resolve here (not in DNS or the hosts file): rank "
                                  f"{rank} cannot reach rank 0's store; set it to rank 0's host name or address") \
                    from None
            except UnicodeError:
                raise LaunchError(f"MASTER_ADDR={addr!r} is not a host name") from None


def _restart_store(timeout=None):
    """The process group's store for ranks of torchrun's agent, keyed by the agent's restart count; None elsewhere.

    torchrun's ranks share the store its agent holds (``TORCHELASTIC_USE_AGENT_STORE``); under its static
    rendezvous (one node, ``--master-addr``/``--master-port``) the agent keeps that one store across
    ``--max-restarts``, and torch's env:// start reads it without a prefix per attempt: a restarted rank 0
    read the addresses its killed peers had published there and failed to connect (gloo: ``Connection
    refused``), so every restart failed. Each attempt gets keys of its own here."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restart is None:
        return None
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":  # several agents: each counts its own restarts (a node
        return None  # restarted for another's failure or a new member does not count one), so the keys would differ
    from datetime import timedelta

    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=timeout or timedelta(minutes=30))
    return dist.PrefixStore(f"dstrain/attempt_{restart}", store)


def port_in_use_error(err: BaseException):
    """A ``LaunchError`` naming MASTER_PORT when rank 0's store could not listen on it (EADDRINUSE), else None."""
    text = str(err)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return None
    from dstrain.config import LaunchError
    port, addr = os.environ.get("MASTER_PORT", "?"), os.environ.get("MASTER_ADDR", "?")
    return LaunchError(f"MASTER_PORT {port} is in use on {addr} (another job's store, or another server, "
                       "listens there): rank 0 cannot start the job's store on it; choose a free port "
                       "(dstrain launch --master-port, or MASTER_PORT; on one node, dstrain launch picks one "
                       "when --master-port is unset)")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s object on every rank (decisions taken once, shared by all)."""
    import torch.distributed as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def comm_device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL
    (which refuses host tensors), else the CPU."""
    import torch.distributed as dist
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` without a process group of several ranks."""
    if not _distributed():
        return [obj]
    import torch.distributed as dist
    box: list = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj)
    return box


def all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``values`` reduced over every rank (``op``: sum, max or min), on ``values``' device; ``values``
    itself without a process group. Host tensors (counts, flags, rewards) work under NCCL too: they
    go to this rank's GPU for the collective and come back."""
    import torch.distributed as dist
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op must be one of {sorted(ops)}, got {op!r}")
    if not _distributed():
        return values
    buf = values.to(comm_device()).contiguous()
    if buf is values:
        buf = buf.clone()
    dist.all_reduce(buf, op=ops[op])
    return buf.to(values.device)


def all_gather_1d(values: torch.Tensor) -> torch.Tensor:
    """Every rank's equal-length 1-D tensor, concatenated in rank order, on ``values``' device
    (host tensors work under NCCL, as in :func:`all_reduce`)."""
    import torch.distributed as dist
    if not _distributed():
        return values
    buf = values.to(comm_device()).contiguous()
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, buf)
    return torch.cat(parts).to(values.device)


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def shutdown_distributed() -> None:
    """Leave the process group cleanly at the end of a run.

    Exiting with a live gloo group lets the interpreter tear down its worker threads
    in arbitrary order, which now and then aborts the process ("terminate called
    without an active exception", exit -6) after the run has finished. A barrier
    first makes sure no peer is still talking to us.
    """
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    barrier()
    dist.destroy_process_group()


def exit_rank(code: int) -> None:
    """End a rank process now, once its work is done and its files are closed.

    Even after :func:`shutdown_distributed`, a finished rank sometimes aborts while the
    interpreter tears down native threads of torch and DeepSpeed in arbitrary order
    ("terminate called without an active exception", exit -6), and the launcher then
    reports the whole job failed. ``os._exit`` skips that teardown: call it only from a
    rank's entry point, after everything it writes is flushed and closed.
    """
    import sys

    from dstrain import run_lock
    _end_helper_processes()
    sys.stdout.flush()
    sys.stderr.flush()
    # Last, once nothing of this rank runs but the threads os._exit ends with it (a failed rank's asynchronous
    # checkpoint writer among them): the folder is not free while a helper process, waited for up to 5 s, still
    # goes. (os._exit runs no atexit handler: without this the lock record would stay, as a run still going.)
    run_lock.release()
    os._exit(code)


def _end_helper_processes(wait_s: float = 5.0) -> None:
    """Terminate the multiprocessing children this rank started (DeepSpeed's ZenFlow runs its overlapped
    optimizer step in one), which ``os._exit`` would leave running with the job's pipes open."""
    import multiprocessing
    import time
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    end = time.monotonic() + wait_s
    for child in children:
        child.join(max(0.0, end - time.monotonic()))
        if child.is_alive():
            child.kill()


def prebuild_cpu_ops() -> list[str]:
    """Compile DeepSpeed's CPU kernels (shared-memory comm, fused and CPU Adam) once, up front.

    DeepSpeed builds them just in time on first use, which takes a minute or two per
    kernel on a small CPU and happens inside whichever rank first needs one; doing it
    here (tests, CI) keeps that out of timed runs. Returns the names built or loaded.

    On a machine with a GPU (``DS_ACCELERATOR`` unset) they are built too, for the CPU ranks
    (``DS_ACCELERATOR=cpu``) the tests start there, without fixing this process's accelerator:
    the variable, DeepSpeed's choice of accelerator and its cache of loaded ops are put back
    afterwards. Nothing is built where another accelerator is named (``DS_ACCELERATOR=cuda``).
    """
    use_cpu_accelerator_if_no_gpu()
    if os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return []
    if "DS_ACCELERATOR" in os.environ:
        return _build_cpu_ops()
    import deepspeed  # noqa: F401 - imported (and its accelerator chosen) as this process would anyway
    from deepspeed.accelerator import real_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder
    chosen, loaded = real_accelerator.ds_accelerator, dict(OpBuilder._loaded_ops)
    os.environ["DS_ACCELERATOR"] = "cpu"
    real_accelerator.ds_accelerator = None  # chosen again, as a CPU rank chooses it, for the builds
    try:
        return _build_cpu_ops()
    finally:
        os.environ.pop("DS_ACCELERATOR", None)
        real_accelerator.ds_accelerator = chosen
        OpBuilder._loaded_ops.clear()  # (the CPU "fused_adam" must not stand in for the GPU's here)
        OpBuilder._loaded_ops.update(loaded)


def _build_cpu_ops() -> list[str]:
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder
    built = []
    for builder in (ShareMemCommBuilder(), FusedAdamBuilder(), CPUAdamBuilder()):
        builder.load(verbose=False)
        built.append(builder.name)
    return built


def release_job_comm_buffers(master_port: int) -> int:
    """Remove every rank's CPU allreduce buffer of the local job on ``master_port``; returns how many.

    The launcher calls this when the job has ended, however it ended: a rank killed
    with SIGKILL, or one that died before reaching its own clean-up, leaves its file.
    """
    import contextlib
    import glob
    removed = 0
    for path in glob.glob(os.path.join("/dev/shm", f"deepspeed_allreduce_buffer_{os.getuid()}_*_{master_port}_*")):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed += 1
    return removed


def release_cpu_comm_buffer(rank: int) -> None:
    """Remove this rank's /dev/shm buffer of DeepSpeed's CPU shared-memory allreduce.

    DeepSpeed 0.19 creates ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    (about 69 MB) in every CPU job and never unlinks it; /dev/shm is RAM, so every
    run would leave it behind. Existing mappings stay valid until the process exits.
    """
    import contextlib
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    with contextlib.suppress(OSError):
        os.unlink(os.path.join("/dev/shm", name))
