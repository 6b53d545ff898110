"""Data x tensor x sequence parallel degrees, their rank layout and process groups.

Layout (tensor parallelism innermost, as fairscale lays out its model-parallel
groups)::

    rank = (dp_index * sp + sp_index) * tp + tp_index

* tensor-parallel group: ``tp`` consecutive ranks (fairscale's model-parallel group);
* sequence-parallel group: the ``sp`` ranks of one replica that share a tp index;
* data-parallel group: the ``dp`` ranks with the same (sp, tp) index;
* replica group: the ``dp * sp`` ranks with the same tp index. Parameters are the
  same on all of them, so gradients are averaged over it (each sequence-parallel
  rank's loss is the mean over its chunk; the chunks are equal) - fairscale calls
  it the data-parallel group and DeepSpeed gets it through :class:`DeepSpeedMPU`.

:class:`ParallelDims` is pure and validates itself; :func:`init_parallel` builds the
groups once per process (collectively) and :func:`current` returns them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (dp), tensor (tp) and sequence (sp) parallelism; ``dp * tp * sp = world``."""

    dp: int
    tp: int = 1
    sp: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "sp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {name} must be a positive integer, got {value!r}")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, sp: int = 1) -> "ParallelDims":
        """Derive dp from the world size; ValueError naming the numbers if they do not divide."""
        if world_size < 1:
            raise ValueError(f"world size must be positive, got {world_size}")
        for name, value in (("tp", tp), ("sp", sp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel degree {name} must be a positive integer, got {value!r}")
        if world_size % (tp * sp):
            raise ValueError(f"world size {world_size} is not divisible by tp x sp = {tp} x {sp} = {tp * sp}; "
                             f"use a world size that is a multiple of {tp * sp}")
        return cls(dp=world_size // (tp * sp), tp=tp, sp=sp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.sp

    @property
    def replica_size(self) -> int:
        """Ranks over which gradients are averaged (same tensor-parallel shard): dp x sp."""
        return self.dp * self.sp

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"dp x tp x sp = {self.dp} x {self.tp} x {self.sp} = {self.world_size} "
                             f"does not match the world size {world_size}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_index, sp_index, tp_index)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return rank // (self.sp * self.tp), (rank // self.tp) % self.sp, rank % self.tp

    def rank_of(self, dp_index: int, sp_index: int, tp_index: int) -> int:
        return (dp_index * self.sp + sp_index) * self.tp + tp_index

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, s, t) for t in range(self.tp)] for d in range(self.dp) for s in range(self.sp)]

    def sp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, s, t) for s in range(self.sp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, s, t) for d in range(self.dp)] for s in range(self.sp) for t in range(self.tp)]

    def replica_groups(self) -> list[list[int]]:
        return [[self.rank_of(d, s, t) for d in range(self.dp) for s in range(self.sp)] for t in range(self.tp)]


@dataclass
class ParallelState:
    """This process's place in the layout and its groups (None where the degree is 1)."""

    dims: ParallelDims
    rank: int
    tp_group: Any = None
    sp_group: Any = None
    dp_group: Any = None
    replica_group: Any = None

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def sp_rank(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    @property
    def replica_rank(self) -> int:
        return self.dp_rank * self.dims.sp + self.sp_rank


_STATE: ParallelState | None = None


def _new_groups(all_ranks: list[list[int]], rank: int, backend=None):
    """Create every group (collective: all ranks call this in the same order); return ours."""
    import torch.distributed as dist
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = group
    return mine


def init_parallel(tp: int = 1, sp: int = 1) -> ParallelState:
    """Build the groups of dp x tp x sp over the started default process group (once per process).

    tp > 1 also initialises fairscale's model-parallel state (its model-parallel group
    is our tensor-parallel group, its data-parallel group our replica group).
    """
    global _STATE
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed to be initialised first")
    dims = ParallelDims.from_world(dist.get_world_size(), tp, sp)
    rank = dist.get_rank()
    if _STATE is not None:
        if _STATE.dims != dims:
            raise RuntimeError(f"parallel groups already built for {_STATE.dims}, asked for {dims}")
        return _STATE
    state = ParallelState(dims=dims, rank=rank)
    if tp > 1:
        from fairscale.nn.model_parallel import initialize as fs
        fs.initialize_model_parallel(tp)
        state.tp_group = fs.get_model_parallel_group()
        state.replica_group = fs.get_data_parallel_group()
    elif dims.replica_size > 1:
        state.replica_group = dist.group.WORLD
        # Real one-rank groups: a None group would make DeepSpeed reduce norms over the world.
        state.tp_group = _new_groups(dims.tp_groups(), rank)
    if sp > 1:
        state.sp_group = _new_groups(dims.sp_groups(), rank)
    if dims.dp > 1 and (tp > 1 or sp > 1):
        state.dp_group = _new_groups(dims.dp_groups(), rank)
    elif dims.dp > 1:
        state.dp_group = dist.group.WORLD
    _STATE = state
    return state


def current() -> ParallelState | None:
    """The state built by :func:`init_parallel`, or None (single device / plain data parallelism)."""
    return _STATE


def reset() -> None:
    """Forget the built state (tests that start a new process group in the same process)."""
    global _STATE
    _STATE = None
    try:
        from fairscale.nn.model_parallel import initialize as fs
        if fs.model_parallel_is_initialized():
            fs.destroy_model_parallel()
    except ImportError:  # pragma: no cover
        pass


class DeepSpeedMPU:
    """What ``deepspeed.initialize(mpu=...)`` asks of a model-parallel unit.

    DeepSpeed averages gradients over (and partitions ZeRO states across) its
    "data-parallel group": here the replica group (dp x sp, same tensor shard), so
    sequence-parallel ranks' gradients are averaged too. Its batch identity uses
    ``get_data_parallel_world_size``: the true dp degree (one sample is spread over
    sp ranks). Its gradient norm all-reduces over the model-parallel group and counts
    a parameter on every tp rank only if it is tagged ``model_parallel = True``.
    """

    def __init__(self, state: ParallelState):
        self.state = state

    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.dims.tp

    def get_model_parallel_group(self):
        return self.state.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.state.replica_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dims.dp

    def get_data_parallel_group(self):
        return self.state.replica_group
