"""SLURM: map a task's variables to torch.distributed's, expand node lists, build srun commands.

:func:`env_from_slurm` is what each rank calls (through ``dstrain.runtime``) when
started by ``srun`` rather than by a launcher; :func:`build_srun_command` is the
SLURM counterpart of the builders in :mod:`dstrain.launcher`. Both import what
they share from :mod:`dstrain.launch_common`; ``launcher`` re-exports the names
here (``from dstrain.launcher import env_from_slurm`` works), this module never
imports ``launcher``.
"""

from __future__ import annotations

import re
import sys
from typing import Mapping

from dstrain.launch_common import (
    DEFAULT_MASTER_PORT,
    Detect,
    Env,
    LaunchSpec,
    _is_int,
    _resolve_accelerator,
    _start_env,
    _train_args,
    detect_accelerator,
)

__all__ = ["build_srun_command", "env_from_slurm", "expand_nodelist", "tasks_per_node_counts"]


def build_srun_command(
    spec: LaunchSpec,
    nodes: int,
    python: str = sys.executable,
    base_env: Mapping[str, str] | None = None,
    *,
    detect: Detect = detect_accelerator,
) -> tuple[list[str], Env]:
    """Build ``srun --nodes N --ntasks-per-node P ... python -m dstrain.cli train ...``.

    Each task maps SLURM's variables to torch's with :func:`env_from_slurm` (the
    ``train`` subcommand does this). MASTER_PORT is put in the env (srun passes the
    environment through), MASTER_ADDR too when given (else the first node of the
    step). With CUDA, ``--gpus-per-node nproc`` is requested. On CPU, OMP_NUM_THREADS
    comes from SLURM_CPUS_PER_TASK in each task. Hosts are SLURM's to choose:
    hostfile/include/exclude are rejected.
    """
    spec.validate()
    if not _is_int(nodes) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if spec.hostfile or spec.include or spec.exclude:
        raise ValueError("srun picks hosts itself; use sbatch/srun --nodelist/--exclude instead of hostfile/include/exclude")
    if spec.num_nodes is not None and spec.num_nodes != nodes:
        raise ValueError(f"num_nodes={spec.num_nodes} disagrees with nodes={nodes}")
    env = _start_env(base_env)
    accel = _resolve_accelerator(spec, env, detect)

    argv = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={spec.nproc}", f"--ntasks={nodes * spec.nproc}"]
    if accel == "cuda":
        argv.append(f"--gpus-per-node={spec.nproc}")
    argv += ["--kill-on-bad-exit=1", python, *_train_args(spec)]

    env["MASTER_PORT"] = str(spec.master_port)
    if spec.master_addr:
        env["MASTER_ADDR"] = spec.master_addr
    if accel == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return argv, env


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list: ``"node[01-03,07],gpu-a"`` -> node01, node02, node03, node07, gpu-a."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        hosts.extend(_expand_item(item, nodelist))
    if not hosts:
        raise ValueError(f"empty SLURM node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"malformed SLURM node list {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced brackets in SLURM node list {text!r}")
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_item(item: str, whole: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    names = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in SLURM node list {whole!r}")
        width = len(lo)
        for n in range(int(lo), int(hi if sep else lo) + 1):
            names.append(f"{prefix}{n:0{width}d}")
    return [name + tail for name in names for tail in _expand_item(rest, whole)]


def tasks_per_node_counts(tasks_per_node: str) -> list[int] | None:
    """Expand SLURM's ``"2(x3),1"`` format to ``[2, 2, 2, 1]``; None when malformed."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """Pick node ``node_id``'s count from SLURM's ``"2(x3),1"`` format."""
    counts = tasks_per_node_counts(tasks_per_node) or []
    return counts[node_id] if 0 <= node_id < len(counts) else None


def _slurm_int(environ: Mapping[str, str], *names: str) -> int:
    for name in names:
        if name in environ:
            try:
                return int(environ[name])
            except ValueError:
                raise ValueError(f"{name}={environ[name]!r} is not an integer") from None
    raise ValueError(f"running under SLURM (SLURM_PROCID set) but {' / '.join(names)} is missing")


def slurm_job_port(environ: Mapping[str, str]) -> int:
    """The master port of a SLURM job that set none: ``20000 + SLURM_JOB_ID % 20000``, as ``launch/slurm.sbatch``
    exports, so two jobs sharing a node (a plain ``srun dstrain train`` each) do not both take 29500 (the second's
    rank 0 could not listen; its other ranks joined the first job's store). 29500 outside a job (no job id)."""
    job = environ.get("SLURM_JOB_ID", "")
    return 20000 + int(job) % 20000 if job.isdigit() else DEFAULT_MASTER_PORT


def env_from_slurm(environ: Mapping[str, str]) -> Env:
    """Map a SLURM task's variables to torch.distributed's.

    Returns RANK (SLURM_PROCID), LOCAL_RANK (SLURM_LOCALID), WORLD_SIZE
    (SLURM_STEP_NUM_TASKS or SLURM_NTASKS), MASTER_ADDR (environ's, else the first
    host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST), MASTER_PORT
    (environ's, else one per job: :func:`slurm_job_port`), plus NODE_RANK and LOCAL_WORLD_SIZE when SLURM gives
    them and OMP_NUM_THREADS from SLURM_CPUS_PER_TASK when not already set.
    Returns {} when not under SLURM (no SLURM_PROCID) or when an outer launcher
    already set RANK, LOCAL_RANK and WORLD_SIZE (e.g. deepspeed inside an sbatch
    script, where every rank inherits SLURM_PROCID=0). Raises ValueError naming
    a missing or malformed variable.
    """
    if "SLURM_PROCID" not in environ:
        return {}
    if all(k in environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return {}
    rank = _slurm_int(environ, "SLURM_PROCID")
    local_rank = _slurm_int(environ, "SLURM_LOCALID")
    world = _slurm_int(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if not 0 <= rank < world:
        raise ValueError(f"SLURM_PROCID={rank} is outside the world of {world} tasks")
    out = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world)}

    master = environ.get("MASTER_ADDR")
    if not master:
        nodelist = next((environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if environ.get(k)), None)
        if nodelist is None:
            raise ValueError("running under SLURM but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
        master = expand_nodelist(nodelist)[0]
    out["MASTER_ADDR"] = master
    out["MASTER_PORT"] = environ.get("MASTER_PORT") or str(slurm_job_port(environ))

    if environ.get("SLURM_NODEID", "").isdigit():
        node_id = int(environ["SLURM_NODEID"])
        out["NODE_RANK"] = str(node_id)
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
        local_world = _tasks_on_node(per_node, node_id) if per_node else None
        if local_world is not None:
            out["LOCAL_WORLD_SIZE"] = str(local_world)
    if "OMP_NUM_THREADS" not in environ and environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        out["OMP_NUM_THREADS"] = environ["SLURM_CPUS_PER_TASK"]
    return out
