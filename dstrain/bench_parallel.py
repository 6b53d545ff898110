"""The throughput benchmark under model parallelism: which degrees a job runs, what it counts, what it refuses.

A step's tokens are the global batch of the recipe's training: ``micro_batch x grad_accum x seq_len`` per
data-parallel replica, counted once per replica (``dp`` of :class:`~dstrain.parallel.dims.ParallelDims`), not
once per rank: the ``tp`` ranks of a tensor-parallel group work on the same tokens, the ``sp`` ranks of a
sequence-parallel group each on a ``seq_len / sp`` chunk of the same sequences, and a pipeline's ``pp`` stages on
the same micro-batches, as ``dstrain train`` (``trainers/lm.py``) splits them. Counted per rank, tokens/s,
FLOP/s and MFU came out ``tp x sp x pp`` times too high.

MFU is the model's FLOPs per step (``flops_per_token`` of the whole model at ``seq_len`` x those tokens) over
the step time and the peak of every device in the job (one rank per device): ``tp x sp x pp`` devices per
replica share one replica's FLOPs.
"""
from __future__ import annotations

from dstrain.parallel.dims import ParallelDims, sequence_chunk


def bench_dims(cfg, world_size: int) -> ParallelDims:
    """The degrees a benchmark job of ``world_size`` ranks runs (``parallel.pp`` auto: 1, since every job names
    its profile, and the factory pipelines only a run whose profile it picks). ValueError naming the numbers when
    the world size does not divide."""
    par = cfg.parallel
    pp = 1 if par.pp == "auto" else par.pp
    return ParallelDims.from_world(world_size, par.tp, par.sp, pp)


def tokens_per_step(cfg, dims: ParallelDims) -> int:
    """Tokens one optimizer step trains on the whole job: the recipe's batch on each data-parallel replica."""
    return cfg.tokens_per_step * dims.dp


def refusal(cfg, world_sizes: list[int]) -> str | None:
    """Why the benchmark cannot run this recipe at these world sizes, in one line; None when it can.

    Pipeline stages (``parallel.pp`` > 1) are refused: the benchmark's plain PyTorch loop, the comparison it
    exists for, has no pipeline schedule (``benchmarks/pipeline.py`` times DeepSpeed's 1F1B and its bubble).
    A world size the degrees do not divide (``--nproc``, ``--scaling``) is named with the numbers."""
    par = cfg.parallel
    if par.pp != "auto" and par.pp > 1:
        return (f"parallel.pp = {par.pp}: the throughput benchmark compares dstrain with a plain PyTorch loop, which "
                f"has no pipeline stages; use --parallel.pp=1 here, or benchmarks/pipeline.py for the pipeline's "
                f"step time and bubble")
    for n in world_sizes:
        try:
            bench_dims(cfg, n)
        except ValueError as err:
            return f"{n} rank(s) for parallel.tp = {par.tp}, sp = {par.sp}: {err}"
    return None


def local_batches(tokens, cfg, dims: ParallelDims, rank: int, steps: int) -> list[list[tuple]]:
    """``rank``'s micro-batches ``(x, y)`` of steps ``0 .. steps - 1``, as ``dstrain train`` gives them: the samples of
    its data-parallel replica (``WindowSampler`` over dp ranks, not over every rank), its ``seq_len / sp`` chunk of
    them, the same tokens on every tensor-parallel rank."""
    from dstrain.data.sampler import WindowSampler, get_batch
    t, seq = cfg.train, cfg.data.seq_len
    dp_rank, sp_rank, _ = dims.coords(rank)
    sampler = WindowSampler(len(tokens), seq, cfg.data.seed)
    return [[sequence_chunk(*get_batch(tokens, row, seq), dims.sp, sp_rank)
             for row in sampler.local_batch_indices(s, t.micro_batch, t.grad_accum, dp_rank, dims.dp)]
            for s in range(steps)]
