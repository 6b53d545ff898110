"""Pure builders of launch commands for deepspeed and torchrun (SLURM: :mod:`dstrain.slurm`).

Every builder returns ``(argv, env)``: the command to run and the complete
environment to run it with (``base_env`` plus what dstrain adds; ``base_env`` is
never modified). Nothing here starts a process and DeepSpeed is never imported;
the only impure bits are small functions (accelerator detection, local host
names, CPU count, free port) that the builders take as injectable arguments.
Hostfiles are read and checked by :mod:`dstrain.hostfile`; the spec and helpers
every builder shares live in :mod:`dstrain.launch_common` (which ``slurm`` imports
too, so neither of launcher and slurm needs the other's internals). The names of
both are re-exported here: ``from dstrain.launcher import env_from_slurm,
parse_hostfile, LaunchSpec`` keeps working.

Each rank ends up running ``python -m dstrain.cli train RECIPE [overrides...]``
and reads RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment (set by the deepspeed launcher or torchrun, or mapped from SLURM's
variables by :func:`dstrain.slurm.env_from_slurm`).

``python -m dstrain.launcher --print RECIPE.json`` prints the command it would run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Collection, Mapping, Sequence

from dstrain.hostfile import parse_hostfile, select_hosts
from dstrain.launch_common import (  # noqa: F401  (re-exported)
    ACCELERATORS,
    DEFAULT_MASTER_PORT,
    LOCAL_HOST_NAMES,
    TRAIN_MODULE,
    Detect,
    Env,
    LaunchSpec,
    _apply_cpu_env,
    _is_int,
    _resolve_accelerator,
    _start_env,
    _train_args,
    available_cpus,
    detect_accelerator,
    find_free_port,
    local_hostnames,
)
from dstrain.slurm import build_srun_command, env_from_slurm, expand_nodelist  # noqa: F401  (re-exported)

# Prefixes of variables DeepSpeed's runner (0.19.x, runner.EXPORT_ENVS plus the
# accelerator's export_envs()) forwards by itself to ranks on other hosts.
DEEPSPEED_EXPORTED_PREFIXES = ("MLFLOW", "PYTHON", "MV2", "UCX")
DEEPSPEED_CUDA_EXPORTED_PREFIXES = ("NCCL",)

def _hostfile_hosts(spec: LaunchSpec) -> list[tuple[str, int]]:
    return select_hosts(parse_hostfile(spec.hostfile), spec.hostfile, spec.num_nodes, spec.nproc,
                        spec.include, spec.exclude)


def launch_world_size(spec: LaunchSpec, torchrun: bool = False,
                      local_hosts: Collection[str] | None = None) -> tuple[int, int] | None:
    """``(ranks in all, ranks per node)`` the launch will start, or None where include/exclude decide it."""
    if spec.include or spec.exclude:
        return None
    if spec.hostfile is None:
        nodes = spec.num_nodes or 1 if torchrun else 1
        return spec.nproc * nodes, spec.nproc
    hosts = _hostfile_hosts(spec)
    local_names = _local_names(spec, local_hosts)
    per = [spec.per_host() or slots for _, slots in hosts]
    if len(hosts) == 1 and hosts[0][0] in local_names:
        return per[0], per[0]
    return sum(per), max(per)


def _local_names(spec: LaunchSpec, local_hosts: Collection[str] | None) -> frozenset[str]:
    """The names of this machine a launch compares its hostfile's hosts with: none without a hostfile, where
    :func:`local_hostnames` (which asks the resolver for this host's name: seconds where DNS does not answer, as
    in a container without a network) is not needed."""
    if local_hosts is not None:
        return frozenset(local_hosts)
    return local_hostnames() if spec.hostfile is not None else frozenset()


def _rename_filter_host(filter_str: str, old: str, new: str) -> str:
    """Rename a host inside a DeepSpeed include/exclude string."""
    parts = []
    for node_spec in filter_str.split("@"):
        name, sep, slots = node_spec.partition(":")
        parts.append((new if name == old else name) + sep + slots)
    return "@".join(parts)


# --------------------------------------------------------------------------- environment


def env_delta(env: Mapping[str, str], base_env: Mapping[str, str] | None = None) -> Env:
    """Variables of ``env`` that are new or changed relative to ``base_env`` (default os.environ)."""
    base = os.environ if base_env is None else base_env
    return {k: v for k, v in env.items() if base.get(k) != v}


# Variables the ranks need from the launching shell that DeepSpeed does not forward to
# other hosts by itself: threads, the accelerator, which interface gloo binds (a host
# with several interfaces), compiled-extension folder, dstrain's own switches, and the
# environment's PATH: DeepSpeed JIT-compiles its ops with the first ``ninja`` on PATH,
# and an ssh login's default PATH finds another ninja than the venv's, whose build log
# does not match, so every launch rebuilt the ops (a minute or two each) and the next
# local run rebuilt them back. DeepSpeed's pdsh runner already requires the same python
# path on every host; PATH follows the same rule.
RANK_ENV_NAMES = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_SIZE", "PATH", "VIRTUAL_ENV",
                  "CONDA_PREFIX", "LD_LIBRARY_PATH")
RANK_ENV_PREFIXES = ("GLOO_", "TP_SOCKET_", "TORCH_", "DSTRAIN_", "HF_")


def rank_env(env: Mapping[str, str]) -> Env:
    """The variables of ``env`` that ranks on other hosts should see (see RANK_ENV_NAMES / _PREFIXES)."""
    return {k: v for k, v in env.items() if k in RANK_ENV_NAMES or k.startswith(RANK_ENV_PREFIXES)}


def deepspeed_env_file(env: Mapping[str, str], accelerator: str = "cpu") -> str:
    """Text of a ``.deepspeed_env`` file carrying the ``env`` variables DeepSpeed would drop.

    DeepSpeed's multi-host runner forwards only variables whose names start with
    MLFLOW, PYTHON, MV2, UCX (plus NCCL with the CUDA accelerator) and the lines of
    ``.deepspeed_env`` files. Pass :func:`rank_env` plus the *delta*
    (:func:`env_delta`) so only what ranks need (DS_ACCELERATOR, OMP_NUM_THREADS,
    GLOO_SOCKET_IFNAME, ...) is listed. The format is strict: ``KEY=VALUE`` per line,
    no comments, no blank lines (so values with a newline are left out).
    """
    prefixes = DEEPSPEED_EXPORTED_PREFIXES + (DEEPSPEED_CUDA_EXPORTED_PREFIXES if accelerator == "cuda" else ())
    lines = [f"{k}={v}" for k, v in env.items()
             if not k.startswith(prefixes) and not k.startswith("PDSH_") and "\n" not in v]  # (pdsh: this machine's)
    return "".join(line + "\n" for line in lines)


def user_env_lines(old: str, lines: str) -> list[str]:
    """The lines a user added to a ``.deepspeed_env`` that dstrain wrote before (``MY_FLAG=1``, ``NCCL_IB_HCA=...``),
    kept when dstrain rewrites the file with ``lines``: DeepSpeed documents the file as the place for such variables,
    and every launch dropped them. A line is dstrain's own when its name is one :func:`rank_env` forwards (those
    come from the launching shell each time: a stale one goes) or the marker; a name ``lines`` sets wins."""
    ours = {line.split("=", 1)[0] for line in lines.splitlines()} | {"DSTRAIN_WROTE_DEEPSPEED_ENV"}
    return [line for line in old.splitlines() if "=" in line and (key := line.split("=", 1)[0]).strip() == key
            and key and key not in ours and not rank_env({key: ""})]


def deepspeed_forwarded(env: Mapping[str, str], accelerator: str = "cpu") -> list[str]:
    """Names in ``env`` that DeepSpeed's runner forwards to other hosts by itself."""
    prefixes = DEEPSPEED_EXPORTED_PREFIXES + (DEEPSPEED_CUDA_EXPORTED_PREFIXES if accelerator == "cuda" else ())
    return sorted(k for k in env if k.startswith(prefixes))


def format_command(argv: Sequence[str], env_delta: Mapping[str, str] | None = None) -> str:
    """A copy-pasteable shell line ``VAR=value ... cmd args`` with every word quoted."""
    words = [f"{k}={shlex.quote(v)}" for k, v in (env_delta or {}).items()]
    return " ".join(words + [shlex.quote(a) for a in argv])


# --------------------------------------------------------------------------- deepspeed


def deepspeed_executable(python: str) -> str:
    """The ``deepspeed`` script next to ``python`` if there is one, else "deepspeed" (from PATH)."""
    candidate = Path(python).parent / "deepspeed"
    return str(candidate) if candidate.is_file() else "deepspeed"


SSH_ALIVE = ("-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4")


def ssh_keepalive(append: str) -> str:
    """pdsh's extra ssh options (``PDSH_SSH_ARGS_APPEND``) with a keep-alive, unless they set one. pdsh waits for
    every host's ssh session; a host that vanishes (power, network, a kernel panic) sends nothing more, and without
    one ssh waits for TCP to give up (hours), so the job never ended even after the other hosts' ranks did (their
    watchdog, a collective's timeout). With it, that session ends 60 s after the host's last answer."""
    if "serveraliveinterval" in append.lower():
        return append
    return " ".join([*append.split(), *SSH_ALIVE])


def build_deepspeed_command(
    spec: LaunchSpec,
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    cpu_count: int | None = None,
    *,
    detect: Detect = detect_accelerator,
    local_hosts: Collection[str] | None = None,
) -> tuple[list[str], Env]:
    """Build ``deepspeed ... --module dstrain.cli train RECIPE [overrides]`` (DeepSpeed 0.19.x).

    Always passes ``--no_local_rank`` (ranks read LOCAL_RANK from the
    environment) and ``--module``. How hosts are chosen:

    * no hostfile: ``--num_gpus nproc`` on this machine. With CUDA and
      CUDA_VISIBLE_DEVICES set, ``--include localhost:<first nproc ids>`` instead,
      because ``--num_gpus`` makes DeepSpeed drop that variable and use GPUs
      0..nproc-1.
    * a hostfile whose only host (after ``num_nodes``) is this machine
      (localhost, 127.0.0.1 or its hostname): launched locally the same way with
      ``--num_gpus slots``, since ``--hostfile`` makes DeepSpeed ssh to the host
      even when it is this one. Beware: without ``--hostfile`` DeepSpeed reads
      ``/job/hostfile`` if that file exists.
    * any other hostfile: ``--hostfile F --force_multi`` (without
      ``--force_multi`` DeepSpeed runs a lone remaining host, e.g. after
      ``--num_nodes 1`` or ``--include``, on this machine). DeepSpeed
      then needs passwordless ssh to every host (it checks the first one),
      ``pdsh`` on this machine, the same python path and working directory on
      every host, and, without ``master_addr``, it asks the first host for its
      address with ``ssh HOST hostname -I``. Remote ranks receive only variables
      named MLFLOW*, PYTHON*, MV2*, UCX* (and NCCL* with CUDA) plus the lines of
      ``.deepspeed_env`` in the home directory or the current directory (or the
      file named by DS_ENV_FILE). DS_ACCELERATOR and OMP_NUM_THREADS are not
      among them: write them there (see :func:`deepspeed_env_file`).

    On CPU the env gets DS_ACCELERATOR=cpu (DeepSpeed then uses gloo) and, unless
    already set, OMP_NUM_THREADS = cpu_count // processes per node (cpu_count of
    this machine). On CUDA the env is left alone (NCCL is DeepSpeed's default).
    """
    spec.validate()
    if spec.local_addr:
        raise ValueError("local_addr (--local-addr) is a torchrun option; deepspeed's hosts come from the hostfile")
    env = _start_env(base_env)
    accel = _resolve_accelerator(spec, env, detect)
    local_names = _local_names(spec, local_hosts)

    argv = [deepspeed_executable(python)]
    remote, procs, local_pool, include, exclude = _deepspeed_placement(spec, local_names)
    if remote:
        argv += ["--hostfile", spec.hostfile]
        if spec.num_nodes is not None:
            argv += ["--num_nodes", str(spec.num_nodes)]
        if spec.per_host():  # --nproc 1 written out: one rank per host, whatever its slots (DeepSpeed's --num_gpus)
            argv += ["--num_gpus", str(spec.per_host())]
        argv.append("--force_multi")  # else DeepSpeed runs a single remaining host on this machine
        env["PDSH_SSH_ARGS_APPEND"] = ssh_keepalive(env.get("PDSH_SSH_ARGS_APPEND", ""))
    elif not (include or exclude):
        visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
        if accel == "cuda" and visible:
            include = f"localhost:{_first_visible_ids(visible, procs)}"
        else:
            argv += ["--num_gpus", str(procs)]
    elif accel == "cpu":
        # DeepSpeed's CPU accelerator counts NUMA nodes as devices unless LOCAL_SIZE is set.
        env["LOCAL_SIZE"] = str(local_pool)
        procs = _count_filtered_slots(include, exclude, local_pool)

    argv += ["--master_port", str(spec.master_port)]
    if remote and spec.master_addr:
        argv += ["--master_addr", spec.master_addr]
    if include:
        argv += ["--include", include]
    if exclude:
        argv += ["--exclude", exclude]
    argv += ["--no_local_rank", "--module", TRAIN_MODULE, "train", spec.recipe, *spec.overrides]

    if accel == "cpu":
        _apply_cpu_env(env, procs, cpu_count)
    return argv, env


def _deepspeed_placement(spec: LaunchSpec, local_names: Collection[str]):
    """``(remote, processes per node, local slot pool, include, exclude)`` of a deepspeed launch.

    A hostfile whose only host is this machine becomes a local launch, its host
    renamed to "localhost" inside include/exclude (DeepSpeed's name for it then).
    """
    include, exclude = spec.include, spec.exclude
    if spec.hostfile is None:
        if spec.num_nodes is not None and spec.num_nodes > 1:
            raise ValueError(f"num_nodes={spec.num_nodes} needs a hostfile listing the nodes")
        return False, spec.nproc, spec.nproc, include, exclude
    hosts = _hostfile_hosts(spec)
    if len(hosts) == 1 and hosts[0][0] in local_names:
        host, slots = hosts[0]
        include = include and _rename_filter_host(include, host, "localhost")
        exclude = exclude and _rename_filter_host(exclude, host, "localhost")
        return False, spec.per_host() or slots, slots, include, exclude
    return True, spec.per_host() or max(s for _, s in hosts), spec.nproc, include, exclude


def _count_filtered_slots(include: str | None, exclude: str | None, pool: int) -> int:
    """Processes a local include/exclude string leaves out of ``pool`` slots."""
    specs = [s.partition(":") for s in (include or exclude).split("@")]
    picked = sum(len(slots.split(",")) if sep else pool for _, sep, slots in specs)
    return max(1, picked if include else pool - picked)


def nvidia_smi_uuids() -> dict[str, int]:
    """``{GPU UUID: index}`` as ``nvidia-smi`` numbers the devices ({} without nvidia-smi)."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in out.splitlines() if line.count(",") == 1]
    return {uuid.strip(): int(index) for index, uuid in rows if index.strip().isdigit()}


def _numeric_ids(ids: list[str]) -> list[str] | None:
    """GPU UUIDs (or unique UUID prefixes, as CUDA accepts them) as device indices; None if any has none."""
    table = nvidia_smi_uuids() if any(not d.isdigit() for d in ids) else {}
    out = []
    for d in ids:
        if d.isdigit():
            out.append(d)
            continue
        hits = {i for uuid, i in table.items() if uuid.startswith(d)}
        if len(hits) != 1:
            return None
        out.append(str(hits.pop()))
    return out


def _first_visible_ids(visible: str, count: int) -> str:
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    numeric = _numeric_ids(ids)
    if numeric is None:
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={visible!r}: DeepSpeed's launcher takes numeric device ids only and "
            "nvidia-smi does not list these as GPU UUIDs (MIG devices cannot be named by index); "
            "use numeric ids, unset it, or use torchrun (dstrain launch --launcher torchrun), which keeps it as set"
        )
    ids = numeric
    if count > len(ids):
        raise ValueError(f"nproc={count} but CUDA_VISIBLE_DEVICES={visible!r} exposes only {len(ids)} device(s)")
    return ",".join(ids[:count])


# --------------------------------------------------------------------------- torchrun


def build_torchrun_command(
    spec: LaunchSpec,
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    cpu_count: int | None = None,
    *,
    detect: Detect = detect_accelerator,
    local_hosts: Collection[str] | None = None,
) -> tuple[list[str], Env]:
    """Build ``python -m torch.distributed.run ... -m dstrain.cli train RECIPE [overrides]``.

    One node: ``--nnodes 1`` with ``--master-addr`` (default 127.0.0.1) and
    ``--master-port``. Several nodes (``num_nodes > 1``, or a hostfile with several
    hosts, which also supplies slots and the first host as master): c10d
    rendezvous at ``master_addr:master_port``; run the same command on every node.
    With a hostfile every host used must have the same slots. include/exclude are
    DeepSpeed-only and rejected. CPU env handling is as in
    :func:`build_deepspeed_command`.
    """
    spec.validate()
    if spec.include or spec.exclude:
        raise ValueError("include/exclude are deepspeed launcher options; torchrun does not support them")
    env = _start_env(base_env)
    accel = _resolve_accelerator(spec, env, detect)
    local_names = _local_names(spec, local_hosts)

    nnodes, procs, master = spec.num_nodes or 1, spec.nproc, spec.master_addr
    if spec.hostfile is not None:
        hosts = _hostfile_hosts(spec)
        slot_counts = {s for _, s in hosts}
        if not spec.per_host() and len(slot_counts) > 1:
            raise ValueError(f"torchrun needs the same slots on every host; {spec.hostfile!r} has {sorted(slot_counts)}")
        nnodes = len(hosts)
        procs = spec.per_host() or hosts[0][1]
        first = hosts[0][0]
        master = master or ("127.0.0.1" if nnodes == 1 and first in local_names else first)

    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(procs)]
    if spec.local_addr:
        argv += ["--local-addr", spec.local_addr]
    if nnodes == 1:
        argv += ["--master-addr", master or "127.0.0.1", "--master-port", str(spec.master_port)]
    else:
        if not master:
            raise ValueError(f"num_nodes={nnodes} needs master_addr (an address of the first node) or a hostfile")
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{spec.master_port}", "--rdzv-id", "dstrain"]
    argv += _train_args(spec)

    if accel == "cpu":
        _apply_cpu_env(env, procs, cpu_count)
    return argv, env


# --------------------------------------------------------------------------- command line


def add_launch_options(parser: argparse.ArgumentParser) -> None:
    """Add the LaunchSpec options (no positionals) to ``parser``."""
    parser.add_argument("--nproc", "--num_gpus", "--num-gpus", dest="nproc", type=int, default=None,
                        help="processes per node (default 1; with a hostfile, every slot of each host)")
    parser.add_argument("--hostfile", default=None, help="DeepSpeed hostfile: 'hostname slots=N' per line")
    parser.add_argument("--num-nodes", type=int, default=None, help="use the first N hosts")
    parser.add_argument("--master-addr", default=None, help="address of the first node (multi-node)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                        help="rendezvous port on the first node")
    parser.add_argument("--include", default=None, help="deepspeed --include, e.g. 'worker-0@worker-1:0,2'")
    parser.add_argument("--exclude", default=None, help="deepspeed --exclude, e.g. 'worker-1:0'")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="auto",
                        help="auto: $DS_ACCELERATOR if set, else cuda where a GPU is found, else cpu (gloo)")
    parser.add_argument("--local-addr", default=None,
                        help="torchrun, several nodes: this node's address as the others reach it "
                             "(default: this host's entry in the hostfile, else what its hostname resolves to)")


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the LaunchSpec options and the RECIPE/overrides positionals to ``parser``.

    Everything after RECIPE is an override, options included; a parser that must
    accept options after RECIPE adds :func:`add_launch_options` and its own RECIPE.
    """
    add_launch_options(parser)
    parser.add_argument("recipe", help="recipe JSON")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--dotted.key=value overrides, passed verbatim")


def spec_from_args(args: argparse.Namespace, overrides: Sequence[str] | None = None) -> LaunchSpec:
    """A LaunchSpec from arguments parsed with :func:`add_launch_arguments` (or the options
    of :func:`add_launch_options` plus ``args.recipe``; ``overrides`` replaces ``args.overrides``)."""
    return LaunchSpec(
        recipe=args.recipe, overrides=tuple(args.overrides if overrides is None else overrides),
        nproc=1 if args.nproc is None else args.nproc, nproc_given=args.nproc is not None, hostfile=args.hostfile,
        num_nodes=args.num_nodes, master_addr=args.master_addr, master_port=args.master_port,
        include=args.include, exclude=args.exclude, accelerator=args.accelerator,
        local_addr=getattr(args, "local_addr", None),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dstrain.launcher [--backend B] [--print] [options] RECIPE [overrides]``.

    Builds the command for the chosen backend and replaces this process with it
    (os.execvpe), or only prints it with ``--print``. A multi-host hostfile is checked
    first as ``dstrain launch`` checks it (:mod:`dstrain.launch_check`; ssh only when
    not printing), and its first host's address becomes the master address.
    """
    parser = argparse.ArgumentParser(prog="python -m dstrain.launcher", description=main.__doc__)
    parser.add_argument("--backend", choices=("deepspeed", "torchrun", "srun"), default="deepspeed")
    parser.add_argument("--nodes", type=int, default=1, help="nodes for --backend srun")
    parser.add_argument("--print", dest="dry_run", action="store_true", help="print the command, run nothing")
    add_launch_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (a typo of a launch flag: --nprocs 2)
        from dstrain.cli_flags import unknown_flags_problem
        parser.error(unknown_flags_problem(unknown, parser))
    try:
        spec = spec_from_args(args)
        if spec.hostfile and args.backend != "srun":
            from dataclasses import replace

            from dstrain.launch_check import check_hosts_for_launch
            hosts = check_hosts_for_launch(spec, reach=not args.dry_run, torchrun=args.backend == "torchrun")
            if hosts.remote:
                spec = replace(spec, master_addr=hosts.master_addr,
                               local_addr=spec.local_addr or (hosts.local_addr if args.backend == "torchrun" else None))
        if args.backend == "deepspeed":
            cmd, env = build_deepspeed_command(spec)
        elif args.backend == "torchrun":
            cmd, env = build_torchrun_command(spec)
        else:
            cmd, env = build_srun_command(spec, nodes=args.nodes)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    delta = env_delta(env)
    if args.dry_run:
        print(format_command(cmd, delta))
        return 0
    print(format_command(cmd, delta), file=sys.stderr, flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
