"""Round 10 of the independent references: each quantity recomputed from its definition (plain loops,
float64, the paper's rule), never through dstrain's helpers for the expected value.

Compared here:

* the gradient norm with tensor parallelism (``engine.grad_norm.total_grad_norm`` and the clipping of
  ``NormKeeper``) over 2 and 3 simulated tensor-parallel ranks (threads whose ``all_reduce`` meets at a
  barrier): column- and row-parallel shards summed over the ranks, replicated parameters (the row-parallel
  bias, norm gains) counted once, against the float64 norm of the dense model's gradient;
* HRM's one-step gradient approximation and deep supervision: the gradient of a segment's loss with respect
  to every weight and the puzzle embedding equals autograd through the segment unrolled by hand in float64,
  every update run with a graph and the inputs of the last L update (and the carry from the previous
  segment) explicitly detached, for several ``H_cycles x L_cycles``, with activation checkpointing too;
* the window sampler (``data.sampler``): every epoch visits each window exactly once in the order of the
  seeded permutation, step ``s`` takes samples ``s B .. (s + 1) B - 1`` across epoch boundaries, the ranks'
  micro-batches of any split ``micro x accum x world`` tile the same global batch, and ``get_batch`` is the
  stream sliced at ``i * seq_len``;
* the trainers' throughput meter (``metrics.Throughput``): tokens/s, FLOP/s and MFU of a window against
  tokens over wall time on a controlled clock, excluded seconds left out;
* ZeRO-1/2's replacement norm (``fast_zero_norm``) on 2 data- x 2 tensor-parallel simulated ranks: each element
  of the model's gradient counted once (shards on every tp rank, replicas on tp rank 0, ZeRO padding and
  pipeline-replicated copies skipped), a NaN giving DeepSpeed's -1 on every rank;
* the communication summary (``comms.summarize``): per-step bytes (size x count), calls and ms per family,
  unknown ops as ``other``, a timer without records counted in time only, and the share of wall time;
* the scaling model's step time (``perf_model.step_time``) as the sum of its documented textbook parts.

Found: no discrepancy. Pinned (deliberate): the HRM loss is returned in fp32 even for an fp64 model (the
per-token loss is cast to fp32); the one-step gradient keeps the injected input ``x`` on the graph of the
last L update (the states entering it are detached), as the HRM reference does.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch


# --------------------------------------------------------------------------- tensor-parallel norm
class _TPGroup:
    """``tp`` ranks as threads; ``all_reduce`` (sum) meets at a barrier."""

    def __init__(self, tp):
        self.tp, self.local = tp, threading.local()
        self.barrier = threading.Barrier(tp, timeout=30)
        self.slots = [None] * tp

    def all_reduce(self, t, op=None, group=None):
        me = self.local.rank
        self.slots[me] = t.clone()
        self.barrier.wait()
        total = sum(self.slots[r] for r in range(self.tp))
        self.barrier.wait()
        t.copy_(total)

    def run(self, fn):
        results, errors = [None] * self.tp, [None] * self.tp

        def body(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors[rank] = err
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for e in errors:
            if e is not None:
                raise e
        return results


def _dense_grads(seed):
    """Gradients of a dense MLP block: up [F, H] (+ bias [F]), down [H, F] (+ bias [H]), a norm gain [H]."""
    g = torch.Generator().manual_seed(seed)
    return {"up.w": torch.randn(12, 5, generator=g, dtype=torch.float64),
            "up.b": torch.randn(12, generator=g, dtype=torch.float64),
            "down.w": torch.randn(5, 12, generator=g, dtype=torch.float64) * 3,
            "down.b": torch.randn(5, generator=g, dtype=torch.float64),
            "norm.g": torch.randn(5, generator=g, dtype=torch.float64) * 0.1}


def _rank_params(dense, rank, tp):
    """What rank ``rank`` of ``tp`` holds (fp32, as training does): column-parallel up (rows, its bias
    sharded), row-parallel down (columns; the bias replicated and untagged), the norm gain replicated."""
    def param(t, tagged):
        p = torch.nn.Parameter(torch.zeros_like(t, dtype=torch.float32))
        p.grad = t.float().clone()
        if tagged:
            p.model_parallel = True
        return p
    return [param(dense["up.w"].chunk(tp, 0)[rank], True), param(dense["up.b"].chunk(tp, 0)[rank], True),
            param(dense["down.w"].chunk(tp, 1)[rank], True), param(dense["down.b"], False),
            param(dense["norm.g"], False)]


@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_norm_counts_shards_on_every_rank_and_replicas_once(tp, monkeypatch):
    from dstrain.engine import grad_norm

    dense = _dense_grads(tp)
    expected = math.sqrt(sum(float(v) ** 2 for t in dense.values() for v in t.flatten().tolist()))
    group = _TPGroup(tp)
    monkeypatch.setattr(torch.distributed, "all_reduce", group.all_reduce)
    norms = group.run(lambda r: float(grad_norm.total_grad_norm(_rank_params(dense, r, tp), tp_group=object())))
    for n in norms:
        assert n == pytest.approx(expected, rel=1e-6)

    # clipping at max_norm = expected / 4: every element of every shard scaled by max / (norm + 1e-6)
    max_norm = expected / 4

    class _DS:
        def __init__(self, params):
            self.module = torch.nn.Module()
            self.module.ps = torch.nn.ParameterList(params)

        def gradient_clipping(self):
            return max_norm

    def clip(rank):
        params = _rank_params(dense, rank, tp)
        keeper = grad_norm.NormKeeper(_DS(params), tp_group=object())
        keeper.clip()
        return keeper.read(), [p.grad.double() for p in params]

    coef = max_norm / (expected + 1e-6)
    for rank, (read, grads) in enumerate(group.run(clip)):
        assert read == pytest.approx(expected, rel=1e-6)
        want = [t * coef for t in (dense["up.w"].chunk(tp, 0)[rank], dense["up.b"].chunk(tp, 0)[rank],
                                   dense["down.w"].chunk(tp, 1)[rank], dense["down.b"], dense["norm.g"])]
        for got, ref in zip(grads, want):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_norm_without_tensor_parallelism_is_the_plain_float64_norm():
    from dstrain.engine import grad_norm

    dense = _dense_grads(7)
    params = []
    for t in dense.values():
        p = torch.nn.Parameter(torch.zeros_like(t, dtype=torch.bfloat16))
        p.grad = t.to(torch.bfloat16)
        params.append(p)
    # the bf16 gradients' own values, squared and summed in float64
    expected = math.sqrt(sum(float(v) ** 2 for p in params for v in p.grad.double().flatten().tolist()))
    assert float(grad_norm.total_grad_norm(params)) == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------------------- HRM one-step gradient
def _hrm64(H_cycles, L_cycles, **kw):
    from models.hrm.model import HRM, HRMConfig
    base = dict(hidden_size=8, num_heads=2, H_layers=1, L_layers=1, H_cycles=H_cycles, L_cycles=L_cycles,
                halt_max_steps=3, mlp_multiple_of=8, seq_len=5, vocab_size=6, puzzle_emb_len=2, act=False,
                loss="softmax")
    base.update(kw)
    torch.manual_seed(3)
    model = HRM(HRMConfig(**base)).double().train()
    return model


def _hand_segment(model, z_H, z_L, x, one_step):
    """The segment with every update on the graph; ``one_step``: the last L update's inputs (the states; not
    the injected input x) and the H state entering the last H update are detached (Wang et al., 2025, eq. 3)."""
    c = model.config
    rot = (model.rotary.cos.double(), model.rotary.sin.double())
    for h in range(c.H_cycles):
        for l in range(c.L_cycles):
            if h < c.H_cycles - 1 or l < c.L_cycles - 1:
                z_L = model.L_level(z_L, z_H + x, rot)
        if h < c.H_cycles - 1:
            z_H = model.H_level(z_H, z_L, rot)
    if one_step:
        z_L, z_H = z_L.detach(), z_H.detach()
    z_L = model.L_level(z_L, z_H + x, rot)
    z_H = model.H_level(z_H, z_L, rot)
    return z_H, z_L


def _hand_lm_loss(model, z_H, labels):
    """sum over rows of the mean softmax cross-entropy of the labelled tokens, over the rows."""
    c = model.config
    logits = z_H[:, c.puzzle_emb_len:] @ model.lm_head.weight.T
    keep = labels != -100
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    per_row = (nll * keep).sum(-1) / keep.sum(-1).clamp_min(1)  # a row with nothing labelled: 0
    return per_row.sum() / labels.shape[0]


def _grads(model, loss, extra):
    params = [p for p in model.parameters()] + [extra]
    gs = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, gs)]


@pytest.fixture
def one_thread():
    """Tiny float64 tensors: one intra-op thread (several fight over a shared CPU for no gain)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# activation checkpointing imports torch._dynamo on first use (seconds): the one slow case
@pytest.mark.parametrize("cycles,ckpt", [((1, 1), False), ((2, 3), False),
                                         pytest.param((2, 1), True, marks=pytest.mark.slow)])
def test_hrm_one_step_gradient_and_deep_supervision_equal_the_hand_unrolled_segments(cycles, ckpt, one_thread):
    model = _hrm64(*cycles)
    model.set_activation_checkpointing(ckpt)
    c = model.config
    g = torch.Generator().manual_seed(11)
    inputs = torch.randint(0, c.vocab_size, (3, c.seq_len), generator=g)
    labels = torch.randint(0, c.vocab_size, (3, c.seq_len), generator=g)
    labels[1, :2] = -100
    labels[2, :] = -100  # a row with nothing labelled contributes 0
    puzzle = torch.randn(3, c.puzzle_emb_len * c.hidden_size, generator=g, dtype=torch.float64,
                         requires_grad=True)

    # dstrain: two ACT segments, the second from the carry of the first
    loss1, out1 = model(inputs, labels, puzzle)
    got1 = _grads(model, loss1, puzzle)
    loss2, out2 = model(inputs, labels, puzzle, out1["z_H"], out1["z_L"], out1["steps"])
    got2 = _grads(model, loss2, puzzle)

    # by hand: x = sqrt(hidden) [puzzle prefix; token embeddings]; the carry detached between segments
    x = math.sqrt(c.hidden_size) * torch.cat(
        [puzzle.view(3, c.puzzle_emb_len, c.hidden_size), model.embed_tokens.weight[inputs]], dim=1)
    shape = (3, c.total_len, c.hidden_size)
    z_H, z_L = model.H_init.double().expand(shape), model.L_init.double().expand(shape)
    h1, l1 = _hand_segment(model, z_H, z_L, x, one_step=True)
    ref1 = _hand_lm_loss(model, h1, labels)
    h2, _ = _hand_segment(model, h1.detach(), l1.detach(), x, one_step=True)
    ref2 = _hand_lm_loss(model, h2, labels)
    # the per-token loss is returned in fp32 whatever the model's dtype (pinned): hence 1e-6, not 1e-12
    assert float(loss1.detach()) == pytest.approx(float(ref1.detach()), rel=1e-6)
    assert float(loss2.detach()) == pytest.approx(float(ref2.detach()), rel=1e-6)
    assert loss1.dtype == torch.float32
    for got, ref in ((got1, _grads(model, ref1, puzzle)), (got2, _grads(model, ref2, puzzle))):
        for a, b in zip(got, ref):  # to 1e-5 of each tensor's largest element (fp32 logits and loss)
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()) + 1e-12
    # the carry handed on is the hand segment's state
    torch.testing.assert_close(out1["z_H"], h1.detach(), rtol=1e-12, atol=1e-12)
    assert not out1["z_H"].requires_grad and not out1["z_L"].requires_grad

    if cycles != (1, 1):  # the approximation is not the full gradient: the test tells them apart
        full = _grads(model, _hand_lm_loss(model, _hand_segment(model, z_H, z_L, x, one_step=False)[0], labels),
                      puzzle)
        gap = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in zip(got1, full))
        assert gap > 1e-2, gap


# --------------------------------------------------------------------------- window sampler
def _permutation(seed, epoch, n):
    """The documented order of epoch ``e``: ``randperm(n)`` seeded with ``seed * 1_000_003 + e``."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def test_window_sampler_follows_its_definition_across_epochs_and_splits():
    from dstrain.data.sampler import WindowSampler, get_batch

    num_tokens, seq_len, seed = 7 * 4 + 3, 4, 5  # (31 - 1) // 4 = 7 windows, the last 2 tokens unused
    n = 7
    sampler = WindowSampler(num_tokens, seq_len, seed)
    assert sampler.num_windows == n
    gb = 6  # steps straddle the epoch boundaries (7 windows, 6 samples a step)
    for step in range(9):
        want = [_permutation(seed, g // n, n)[g % n] for g in range(step * gb, (step + 1) * gb)]
        assert sampler.global_indices(step, gb).tolist() == want
    # each epoch's windows, read off consecutive steps, are every window exactly once
    flat = torch.cat([sampler.global_indices(s, gb) for s in range(7)]).tolist()  # 42 samples = 6 epochs
    for e in range(6):
        assert sorted(flat[e * n:(e + 1) * n]) == list(range(n))
    # a resume at ``first_sample`` continues the same sequence
    assert sampler.global_indices(0, 5, first_sample=11).tolist() == flat[11:16]
    # every split micro x accum x world of a global batch of 12: rank r, accumulation k takes samples
    # k * (world * micro) + r * micro .. + micro - 1 of the step
    for micro, accum, world in ((1, 1, 12), (2, 3, 2), (3, 2, 2), (12, 1, 1), (1, 6, 2)):
        step_samples = [_permutation(seed, g // n, n)[g % n] for g in range(3 * 12, 4 * 12)]
        for rank in range(world):
            local = sampler.local_batch_indices(3, micro, accum, rank, world).tolist()
            assert local == [[step_samples[k * world * micro + rank * micro + m] for m in range(micro)]
                             for k in range(accum)]
    # windows: inputs tokens[i*seq : i*seq + seq], targets shifted by one
    tokens = torch.arange(100, 100 + num_tokens, dtype=torch.int32)
    idx = torch.tensor([[6, 0], [3, 3]])
    inputs, targets = get_batch(tokens, idx, seq_len)
    assert inputs.dtype == torch.int64 and inputs.shape == (2, 2, seq_len)
    for a in range(2):
        for b in range(2):
            i = int(idx[a, b])
            assert inputs[a, b].tolist() == [100 + i * seq_len + t for t in range(seq_len)]
            assert targets[a, b].tolist() == [100 + i * seq_len + t + 1 for t in range(seq_len)]
    with pytest.raises(IndexError):
        get_batch(tokens, torch.tensor([7]), seq_len)


# --------------------------------------------------------------------------- throughput meter
def test_throughput_meter_is_tokens_over_wall_time_less_the_excluded_seconds(monkeypatch):
    from dstrain import metrics

    clock = [1000.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    meter = metrics.Throughput(flops_per_token=6e9, peak_flops=1e15)
    meter.add(4096)
    meter.add(4096)
    clock[0] += 2.5
    meter.exclude(0.5)  # an evaluation between the log steps
    out = meter.read()
    assert out["tokens_per_s"] == pytest.approx(8192 / 2.0, rel=1e-12)
    assert out["flops_per_s"] == pytest.approx(8192 / 2.0 * 6e9, rel=1e-12)
    assert out["mfu"] == pytest.approx(8192 / 2.0 * 6e9 / 1e15, rel=1e-12)
    # the next window starts at the read
    meter.add(1000)
    clock[0] += 4.0
    out = meter.read()
    assert out["tokens_per_s"] == pytest.approx(250.0, rel=1e-12)
    assert "mfu" not in metrics.Throughput(1.0).read()


# --------------------------------------------------------------------------- ZeRO-1/2 norm with tp
def test_zero_norm_over_data_and_tensor_parallel_ranks_counts_each_element_once(monkeypatch):
    """``fast_zero_norm`` on 2 data- x 2 tensor-parallel ranks (threads): each data-parallel rank holds its
    partition's gradients; tagged shards count on every tp rank, replicated ones on tp rank 0 only, ZeRO's
    padding and pipeline-replicated copies not at all; a NaN anywhere gives DeepSpeed's -1."""
    pytest.importorskip("deepspeed")
    from deepspeed import comm
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from dstrain.engine import grad_norm

    g = torch.Generator().manual_seed(4)
    full = [torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64),
            torch.randn(4, 6, generator=g, dtype=torch.float64) * 2, torch.randn(5, generator=g, dtype=torch.float64),
            torch.randn(3, 3, generator=g, dtype=torch.float64)]
    sharded = [True, True, True, False, False]
    dp, tp = 2, 2
    slots, barrier, local = {}, threading.Barrier(dp * tp, timeout=30), threading.local()

    def all_reduce(t, op=None, group=None, **kw):  # group: the ranks (d, m) taking part
        slots[local.rank] = t.clone()
        barrier.wait()
        total = sum(slots[r] for r in group)
        barrier.wait()
        t.copy_(total)

    monkeypatch.setattr(comm, "all_reduce", all_reduce)

    def rank_norm(d, m, nan=False):
        local.rank = (d, m)
        opt = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)
        opt.cpu_offload, opt.device, opt.model_parallel_rank = False, "cpu", m
        opt.dp_process_group = [(e, m) for e in range(dp)]
        opt._model_parallel_all_reduce = lambda tensor, op: all_reduce(tensor, op, [(d, k) for k in range(tp)])
        opt.get_grad_norm_direct = lambda *a, **k: pytest.fail("DeepSpeed's own norm was called")
        engine = type("E", (), {"optimizer": opt})()
        assert grad_norm.fast_zero_norm(engine)
        grads, params = [], []
        for i, (t, tagged) in enumerate(zip(full, sharded)):
            if i % dp != d:  # ZeRO: this data-parallel rank's partition
                continue
            piece = t.chunk(tp, 0)[m] if tagged else t
            p = torch.nn.Parameter(torch.zeros_like(piece, dtype=torch.float32))
            p.model_parallel = tagged
            grads.append(piece.float().clone())
            params.append(p)
        twin = torch.nn.Parameter(torch.zeros(2))  # a pipeline-replicated copy (tied weights): skipped
        twin.ds_pipe_replicated = True
        grads.append(torch.full((2,), 1e3))
        params.append(twin)
        if nan and (d, m) == (1, 1):
            grads[0][0] = float("nan")
        pad = torch.full((7,), 1e3)
        pad._zero_padding = True
        grads.append(pad)  # padding: no parameter of its own
        return float(opt.get_grad_norm_direct(grads, params))

    def run(nan):
        results, errors = {}, []

        def body(d, m):
            try:
                results[(d, m)] = rank_norm(d, m, nan)
            except BaseException as err:  # noqa: BLE001
                errors.append(err)
                barrier.abort()
        threads = [threading.Thread(target=body, args=(d, m)) for d in range(dp) for m in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]
        return results

    expected = math.sqrt(sum(float(v) ** 2 for t in full for v in t.flatten().tolist()))
    for value in run(False).values():
        assert value == pytest.approx(expected, rel=1e-6)
    barrier.reset()
    assert set(run(True).values()) == {-1.0}


# --------------------------------------------------------------------------- communication summary
def test_comms_summary_is_per_step_bytes_calls_and_time_by_family():
    from dstrain.comms import summarize

    raw = {"all_reduce | [Caller Func: reduce_grads]": {4096: [3, [1.0] * 3, 0, 0], 128: [2, [0.1] * 2, 0, 0]},
           "reduce_scatter_tensor": {1 << 20: [4, [2.0] * 4, 0, 0]},
           "all_gather_into_tensor": {1 << 18: [4, [1.0] * 4, 0, 0]},
           "allgather_fn": {64: [1, [0.5], 0, 0]},
           "my_custom_op": {10: [5, [0.0] * 5, 0, 0]},
           "barrier": {0: [2, [0.2, 0.3], 0, 0]}}
    seconds = {"all_reduce | [Caller Func: reduce_grads]": 0.006, "reduce_scatter_tensor": 0.010,
               "all_gather_into_tensor": 0.004, "allgather_fn": 0.001, "my_custom_op": 0.0005, "barrier": 0.002,
               "send": 0.003}  # a timer without records: time, no bytes
    steps, wall = 4, 0.5
    got = summarize(raw, seconds, steps, wall)
    by_family = {"all_reduce": (3 * 4096 + 2 * 128, 5, 6.0), "reduce_scatter": (4 * (1 << 20), 4, 10.0),
                 "all_gather": (4 * (1 << 18) + 64, 5, 5.0), "other": (50, 5, 0.5), "barrier": (0, 2, 2.0),
                 "p2p": (0, 0, 3.0)}
    want = {}
    for fam, (nbytes, calls, ms) in by_family.items():
        want[f"{fam}_bytes"], want[f"{fam}_calls"], want[f"{fam}_ms"] = nbytes / steps, calls / steps, ms / steps
    want["total_bytes"] = sum(v[0] for v in by_family.values()) / steps
    want["calls"] = sum(v[1] for v in by_family.values()) / steps
    want["total_ms"] = sum(v[2] for v in by_family.values()) / steps
    want["share"] = sum(v[2] for v in by_family.values()) / 1e3 / wall
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    with pytest.raises(ValueError):
        summarize(raw, seconds, 0)


# --------------------------------------------------------------------------- scaling model
def test_step_time_is_the_textbook_sum_of_its_parts():
    """1F1B pipeline (bubble (p-1)/(m+p-1) of the step), Megatron's 4 activation all-reduces per layer and
    micro-batch, one send each way per micro-batch, a ring gradient all-reduce exposed beyond
    ``overlap x`` the backward (2/3 of compute), ZeRO-2 states ``(2 + 14/dp) P / (tp pp)``."""
    from dstrain.perf_model import Layout, Links, Workload, step_time

    links = Links()
    w = Workload(params=2_000_000_000, compute_s=3.0, tokens_per_gpu=16384, n_layer=24, hidden=2048, seq_len=2048,
                 micro_batch=2, grad_bytes=2.0, act_bytes=2.0)

    def ring(nbytes, n, bw, lat):
        return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat

    for gpus, tp, pp in ((64, 2, 4), (32, 1, 1), (64, 4, 4), (16, 1, 2)):
        out = step_time(w, gpus, Layout(tp=tp, pp=pp, overlap=0.5), links)
        dp = gpus // (tp * pp)
        compute = 3.0 / (tp * pp)
        m = 16384 // 2048 // 2  # 8 sequences in micro-batches of 2
        step_pipeline = compute / m * (m + pp - 1)  # 1F1B: (m + p - 1) micro-batch slots
        act = 2 * 2048 * 2048 * 2.0
        tp_s = 4 * (24 / pp) * m * ring(act, tp, links.intra_bw, links.intra_latency)
        cross = tp * pp > 8
        bw, lat = (links.inter_bw, links.inter_latency) if cross else (links.intra_bw, links.intra_latency)
        pp_s = 2 * m * (act / tp / bw + lat) if pp > 1 else 0.0
        grad = 2e9 / (tp * pp) * 2.0
        per_node = 8 // (tp * pp) if tp * pp <= 8 else 1  # data-parallel ranks of a node
        nodes = -(-dp // per_node)
        if nodes == 1:
            dp_s = ring(grad, dp, links.intra_bw, links.intra_latency)
        else:  # reduce-scatter + all-gather in the node, all-reduce of each GPU's share between nodes
            half = 0.0 if per_node == 1 else (per_node - 1) / per_node * grad / links.intra_bw \
                + (per_node - 1) * links.intra_latency
            dp_s = 2 * half + ring(grad / per_node, nodes, links.inter_bw, links.inter_latency)
        exposed = max(0.0, dp_s - 0.5 * 2 / 3 * compute)
        step = step_pipeline + tp_s + pp_s + exposed
        assert out["bubble_s"] / (out["compute_s"] + out["bubble_s"]) == pytest.approx((pp - 1) / (m + pp - 1))
        assert out["dp_comm_s"] == pytest.approx(dp_s, rel=1e-12)
        assert out["step_s"] == pytest.approx(step, rel=1e-12)
        assert out["efficiency"] == pytest.approx(compute / step, rel=1e-12)
        assert out["tokens_per_s"] == pytest.approx(16384 * dp / step, rel=1e-12)
        assert out["model_states_bytes"] == pytest.approx(2e9 / (tp * pp) * (2 + 14 / dp), rel=1e-12)
