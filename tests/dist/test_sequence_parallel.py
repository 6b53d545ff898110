"""Sequence-parallel dilated attention on 2 gloo ranks equals the single-process kernel (1e-5, fp32).

Each case: full q, k, v (same seed on both ranks) through the single-device kernel,
and each rank's chunk through the sequence-parallel layer; outputs and the
gradients of q, k, v (for the same upstream gradient) are compared chunk by chunk.
"""

from tests.dist import spawn

TOL = 1e-5
# (segments, rates, causal, mode, head_offset[, sparse_block, sparse_keep]) on N = 32 tokens, T = 16 per rank.
CASES = [
    ([8, 16, 32], [1, 2, 4], True, "exchange", 0),    # segment 32 spans both ranks
    ([8, 16, 32], [1, 2, 4], False, "exchange", 0),
    ([8, 16, 32], [1, 2, 4], True, "ulysses", 0),
    ([8, 16, 32], [1, 2, 4], False, "ulysses", 0),
    ([64, 4], [2, 1], True, "exchange", 1),           # w > N: one segment; global head offset 1
    ([64, 4], [2, 1], True, "ulysses", 1),
    ([4, 8], [1, 2], True, "exchange", 0),            # every segment local: no communication
    ([8, 32], [1, 4], True, "auto", 0),
    ([8, 16], [1, 2], True, "exchange", 1, 2, 0.5),   # block-sparse, every segment local
    ([8, 16, 32], [1, 2, 4], True, "ulysses", 0, 2, 0.5),
    ([12, 24], [1, 2], True, "ulysses", 0),           # segments that do not tile N: padded at the end to 48
    ([12, 24], [1, 2], True, "auto", 1),              # exchange cannot split them: auto picks ulysses
]


def _check(rank, world, cases):
    import torch
    from dstrain.ops.dilated import dilated_attention, make_branches
    from dstrain.parallel import dims
    from dstrain.parallel.sequence import SequenceParallelDilatedCore

    state = dims.init_parallel(sp=world)
    results = []
    for segs, rates, causal, mode, offset, *sparse in cases:
        block, keep = sparse or (0, 1.0)
        g = torch.Generator().manual_seed(7)
        b, n, h, d = 2, 32, 4, 8
        q, k, v, up = (torch.randn(b, n, h, d, generator=g) for _ in range(4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        branches = make_branches(segs, rates)
        ref = dilated_attention(*(t.transpose(1, 2) for t in full), branches, causal, offset, block,
                                keep).transpose(1, 2)
        (ref * up).sum().backward()
        t = n // world
        part = slice(rank * t, (rank + 1) * t)
        local = [x[:, part].clone().requires_grad_() for x in (q, k, v)]
        core = SequenceParallelDilatedCore(branches, causal, state.sp_group, state.dims.sp_groups(), mode=mode,
                                           head_offset=offset, sparse_block=block, sparse_keep=keep)
        out = core(*local)
        (out * up[:, part]).sum().backward()
        errs = [float((out - ref[:, part]).detach().abs().max())]
        errs += [float((a.grad - f.grad[:, part]).abs().max()) for a, f in zip(local, full)]
        all_errs = torch.tensor(errs)
        torch.distributed.all_reduce(all_errs, op=torch.distributed.ReduceOp.MAX)
        results.append((core.last_mode, all_errs.tolist()))
    return results


def test_sequence_parallel_matches_single_process():
    results = spawn.run(_check, 2, CASES)
    bad = [(case, mode, errs) for case, (mode, errs) in zip(CASES, results) if max(errs) >= TOL]
    assert not bad, bad
    for case, (mode, errs) in zip(CASES, results):
        if case[3] != "auto":
            assert mode == case[3]
    auto = [mode for case, (mode, _) in zip(CASES, results) if case[3] == "auto"]
    assert auto == ["exchange", "ulysses"]  # 2 (2-1)/4 = 0.5 units of traffic < Ulysses' 2; untiled: ulysses


def _segment_groups_built(rank, world):
    import torch
    import torch.distributed as dist
    from dstrain.parallel import dims
    from models import registry
    from models.dilated_lm.model import DilatedLM
    from models.dilated_lm.parallelize import apply_sequence_parallel

    state = dims.init_parallel(sp=world)
    cfg = registry.make_model_config("dilated_lm", "debug", {"n_layer": 3})
    torch.manual_seed(0)
    model = DilatedLM(cfg)
    apply_sequence_parallel(model, state, mode="exchange")
    made = []
    real = dist.new_group

    def counting(*args, **kwargs):
        made.append(args[0] if args else kwargs.get("ranks"))
        return real(*args, **kwargs)

    dist.new_group = counting
    try:
        ids = torch.zeros(1, 128 // world, dtype=torch.long)
        model(ids, ids).backward()
    finally:
        dist.new_group = real
    return {"layers": len(model.blocks), "new_groups": made, "segments": list(cfg.segment_lengths)}


def test_exchange_segment_groups_are_built_once_per_model():
    """4 sequence-parallel ranks, 32 tokens each: the 64-token segments span 2 ranks, so the exchange
    mode needs groups {0,1} and {2,3}; the model's three layers share them (under NCCL each group is a
    communicator with its own buffers: one set per layer cost memory the planner does not count)."""
    got = spawn.run(_segment_groups_built, 4)
    assert got["layers"] == 3 and 64 in got["segments"]
    assert got["new_groups"] == [[0, 1], [2, 3]]
