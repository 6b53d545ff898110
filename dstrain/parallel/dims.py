"""Data x tensor x sequence x pipeline parallel degrees, their rank layout and process groups.

Layout (tensor parallelism innermost, as fairscale lays out its model-parallel
groups; pipeline stages outermost, as DeepSpeed's pipeline topologies lay them out)::

    rank = ((pp_index * dp + dp_index) * sp + sp_index) * tp + tp_index

* pipeline group: the ``pp`` ranks with the same (dp, sp, tp) index, one per stage;

* tensor-parallel group: ``tp`` consecutive ranks (fairscale's model-parallel group);
* sequence-parallel group: the ``sp`` ranks of one replica that share a tp index;
* data-parallel group: the ``dp`` ranks with the same (sp, tp) index;
* replica group: the ``dp * sp`` ranks with the same tp index. Parameters are the
  same on all of them, so gradients are averaged over it (each sequence-parallel
  rank's loss is the mean over its chunk; the chunks are equal) - fairscale calls
  it the data-parallel group and DeepSpeed gets it through :class:`DeepSpeedMPU`.

:class:`ParallelDims` is pure and validates itself; :func:`init_parallel` builds the
groups once per process (collectively) and :func:`current` returns them.

Pipeline parallelism (``pp > 1``) is supported with data parallelism only for now:
pp with tp or sp is refused in one line (DeepSpeed's pipeline engine would need
fairscale's groups to follow its ``PipeModelDataParallelTopology``, and sequence
parallelism has no axis there). :meth:`ParallelDims.topology` gives the DeepSpeed
topology of the same layout; the pipeline engine builds its groups from it, so
its stages and data-parallel groups are the ones :meth:`pipe_groups` and
:meth:`dp_groups` list (tests/unit/test_dims.py checks that rank for rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _or_drop(**degrees: int) -> str:
    """``", or drop that parallelism (--parallel.sp=1)"``: the way to fewer ranks (one GPU: ``--nproc 1`` of a
    recipe with ``parallel.sp`` 2 said only "use a world size that is a multiple of 2")."""
    flags = " ".join(f"--parallel.{name}=1" for name, value in degrees.items() if value > 1)
    return f", or drop that parallelism ({flags})" if flags else ""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data (dp), tensor (tp), sequence (sp) and pipeline (pp) parallelism;
    ``dp * tp * sp * pp = world``."""

    dp: int
    tp: int = 1
    sp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "sp", "pp"):
            _check_degree(name, getattr(self, name))
        if self.pp > 1 and self.tp * self.sp > 1:
            raise ValueError(f"pipeline parallelism (pp = {self.pp}) is supported with data parallelism only; "
                             f"got tp = {self.tp}, sp = {self.sp} (set both to 1)")

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, sp: int = 1, pp: int = 1) -> "ParallelDims":
        """Derive dp from the world size; ValueError naming the numbers if they do not divide."""
        if world_size < 1:
            raise ValueError(f"world size must be positive, got {world_size}")
        for name, value in (("tp", tp), ("sp", sp), ("pp", pp)):
            _check_degree(name, value)
        if pp == 1 and world_size % (tp * sp):
            raise ValueError(f"world size {world_size} is not divisible by tp x sp = {tp} x {sp} = {tp * sp}; "
                             f"use a world size that is a multiple of {tp * sp}{_or_drop(tp=tp, sp=sp)}")
        if world_size % (tp * sp * pp):
            raise ValueError(f"world size {world_size} is not divisible by tp x sp x pp = {tp} x {sp} x {pp} = "
                             f"{tp * sp * pp}; use a world size that is a multiple of {tp * sp * pp}"
                             f"{_or_drop(tp=tp, sp=sp, pp=pp)}")
        return cls(dp=world_size // (tp * sp * pp), tp=tp, sp=sp, pp=pp)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.sp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: dp x sp x tp."""
        return self.dp * self.tp * self.sp

    @property
    def replica_size(self) -> int:
        """Ranks over which gradients are averaged (same tensor-parallel shard): dp x sp."""
        return self.dp * self.sp

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            pp = f" x {self.pp}" if self.pp > 1 else ""
            raise ValueError(f"dp x tp x sp{' x pp' if pp else ''} = {self.dp} x {self.tp} x {self.sp}{pp} = "
                             f"{self.world_size} does not match the world size {world_size}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_index, sp_index, tp_index)`` of a global rank (the same on every pipeline stage)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        rank %= self.stage_size
        return rank // (self.sp * self.tp), (rank // self.tp) % self.sp, rank % self.tp

    def stage_of(self, rank: int) -> int:
        """Pipeline stage (pp index) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size}")
        return rank // self.stage_size

    def rank_of(self, dp_index: int, sp_index: int, tp_index: int, pp_index: int = 0) -> int:
        return ((pp_index * self.dp + dp_index) * self.sp + sp_index) * self.tp + tp_index

    def _each(self, *axes):
        """Every combination of the named axes' indices (outermost first), as dicts."""
        sizes = {"pp": self.pp, "dp": self.dp, "sp": self.sp, "tp": self.tp}
        combos = [{}]
        for axis in axes:
            combos = [{**c, axis: i} for c in combos for i in range(sizes[axis])]
        return combos

    def _groups(self, inner: tuple[str, ...]) -> list[list[int]]:
        outer = tuple(a for a in ("pp", "dp", "sp", "tp") if a not in inner)
        at = lambda c: self.rank_of(c["dp"], c["sp"], c["tp"], c["pp"])  # noqa: E731
        return [[at({**o, **i}) for i in self._each(*inner)] for o in self._each(*outer)]

    def tp_groups(self) -> list[list[int]]:
        return self._groups(("tp",))

    def sp_groups(self) -> list[list[int]]:
        return self._groups(("sp",))

    def dp_groups(self) -> list[list[int]]:
        return self._groups(("dp",))

    def replica_groups(self) -> list[list[int]]:
        return self._groups(("dp", "sp"))

    def pipe_groups(self) -> list[list[int]]:
        """One group per (dp, sp, tp) index: its ranks on stage 0, 1, ..., pp - 1."""
        return self._groups(("pp",))

    def topology(self):
        """DeepSpeed's process topology of this layout (for ``PipelineModule(topology=...)``)."""
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
        if self.sp > 1:
            raise ValueError(f"DeepSpeed's pipeline topologies have no sequence-parallel axis (sp = {self.sp})")
        if self.tp > 1:
            return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)
        return PipeDataParallelTopology(num_pp=self.pp, num_dp=self.dp)


def sequence_chunk(x, y, sp: int, sp_rank: int):
    """This rank's part of a batch under sequence parallelism: columns ``[sp_rank * n / sp, (sp_rank + 1) * n / sp)``
    of inputs and targets (``sp`` 1: the batch itself). ``dstrain train`` and ``dstrain bench`` both slice so."""
    if sp == 1:
        return x, y
    chunk = x.shape[1] // sp
    start = sp_rank * chunk
    return x[:, start:start + chunk], y[:, start:start + chunk]


def _check_degree(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"parallel degree {name} must be a positive integer, got {value!r}")


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

    @property
    def pp_rank(self) -> int:
        """Pipeline stage of this rank."""
        return self.dims.stage_of(self.rank)


_STATE: ParallelState | None = None


def _new_groups(all_ranks: list[list[int]], rank: int, backend=None):
    """Create every group (collective: all ranks call this in the same order); return ours."""
    import torch.distributed as dist

    from dstrain.runtime import group_timeout
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, backend=backend, timeout=group_timeout())
        if rank in ranks:
            mine = group
    return mine


def init_parallel(tp: int = 1, sp: int = 1, pp: int = 1) -> ParallelState:
    """Build the groups of dp x tp x sp over the started default process group (once per process).

    tp > 1 also initialises fairscale's model-parallel state (its model-parallel group
    is our tensor-parallel group, its data-parallel group our replica group). With
    pp > 1 (data parallelism only) no group is built here: DeepSpeed's pipeline engine
    builds its stage and data-parallel groups from :meth:`ParallelDims.topology`.
    """
    global _STATE
    import torch.distributed as dist
    if not dist.is_initialized():
        raise RuntimeError("init_parallel needs torch.distributed to be initialised first")
    dims = ParallelDims.from_world(dist.get_world_size(), tp, sp, pp)
    rank = dist.get_rank()
    if _STATE is not None:
        if _STATE.dims != dims:
            raise RuntimeError(f"parallel groups already built for {_STATE.dims}, asked for {dims}")
        return _STATE
    state = ParallelState(dims=dims, rank=rank)
    if pp > 1:
        _STATE = state
        return state
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
