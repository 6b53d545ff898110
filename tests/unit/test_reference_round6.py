"""Round 6 of the independent references: each quantity recomputed from its definition (plain loops, float64,
the paper's or DESIGN's formula), never through dstrain's helpers, on adversarial inputs.

Compared here:

* ``merge_attention`` (log-sum-exp merge of attention over disjoint key sets) against one float64 softmax over
  the union of the keys, outputs and gradients, with pieces that leave queries uncovered;
* the scaling model's all-reduce (``perf_model.allreduce_s``) against the textbook ring and hierarchical costs
  (Thakur et al.), node counts that fill their nodes and ones that do not;
* AdamATan2 against its update rule (Everett et al. 2024, as the HRM reference's kernel orders it) stepped
  element by element in float64: several groups, parameters without a gradient on some steps (their own step
  count), a transposed gradient, gradients from 1e-15 to 1e15, a ``found_inf`` step taken back;
* the weights' EMA (``d = min(decay, (1 + n) / (10 + n))``) against its recursion in float64, over bf16 and fp32
  weights, skipped steps (``ok`` 0) and a resume from its state;
* the sparse sign-SGD of HRM's puzzle embeddings against ``w <- w (1 - lr wd) - lr sign(sum of the id's
  gradients)`` per distinct id (repeats, gradients that cancel exactly, no ids at all, a skipped step);
* the Polyak (target-network) update against ``(1 - tau) target + tau source`` in float64, across dtypes and
  chunk sizes that do not divide the tensors;
* the unigram entropy baseline against Shannon's formula over the token counts;
* the factory's plan (``choose_plan``) against DESIGN's rule walked by hand: the ZeRO table, activations halved
  in 16-bit, a CPU's offloaded share counted in its RAM, the four passes of ``auto`` checkpointing;
* sequence parallelism's exchange mode (LongNet's distributed algorithm) over 4 ranks simulated in one process
  (a stand-in for torch.distributed, the all-gather done through autograd) against the float64 brute force of
  dilated attention on the whole sequence, outputs and gradients (segments spanning 2 and 4 ranks, causal or
  not, head offsets, one dilated position per chunk, a segment longer than the sequence).

Found and fixed:

* ``merge_attention`` promised that a piece's output is ignored where its lse is -inf, but multiplied it by a
  zero weight: a NaN or Inf there (what a kernel returns for a query with every key masked) made the merged
  output and the lse gradients NaN. Now those outputs are replaced by zeros before the weighted sum.
* ``allreduce_s`` counted ``ranks // per_node`` nodes: 12 ranks at 8 per node cost the same as 8 (the four
  ranks of the second node and the whole inter-node ring were dropped), 9 ranks as well. A partly filled node
  now counts, and its GPUs, carrying the largest share between nodes, set the inter-node time.
* AdamATan2's update on a step that honours ``found_inf`` (the engine's deferred non-finite check) formed
  ``1 - lr * wd`` and ``1 - beta`` from an fp32 flag: with fp64 parameters it drifted from the rule by up to
  8e-7 relative after a few steps (the unmasked update agrees to 1e-12). The flag is now taken in fp64 there.

Deliberate deviations, pinned:

* AdamATan2 keeps the second moment of the gradient in the parameters' dtype (as the reference kernel does),
  so in fp32 the update is scale-free only while ``g * g`` is a normal fp32 number: for |g| of about 1e-23 and
  below it is atan2(m, 0) = +-pi/2 (the fp64 rule gives atan(0.1) / 0.1 on a first step) and for |g| above
  about 1.8e19 ``v`` is Inf and the update 0. Within 1e-18..1e18 it is the same to 1e-6.
* The EMA's update count moves on at a skipped step (the host cannot read the device flag without a sync), so
  the decay after a skipped step is the one of the next update: the reference does the same.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from dstrain.engine.profiles import Activations, Hardware, ModelStats, PlanError, choose_plan
from dstrain.ops.attention import merge_attention
from dstrain.optim.adam_atan2 import AdamATan2
from dstrain.optim.ema import EMA
from dstrain.optim.sparse_sign_sgd import SparseEmbedding, SparseSignSGD
from dstrain.perf_model import Links, allreduce_s
from dstrain.rl.polyak import polyak_update_
from dstrain.data.stats import unigram_entropy


# ---------------------------------------------------------------- log-sum-exp merge of attention pieces

def _piece(q, k, v, covered):
    """Softmax attention of ``q`` over ``k, v`` in float64 -> (out, lse); rows not ``covered`` get lse -inf and
    out NaN (what a kernel gives a query whose every key is masked)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    lse = torch.where(covered, lse, torch.full_like(lse, float("-inf")))
    out = torch.where(covered.unsqueeze(-1), out, torch.full_like(out, float("nan")))
    return out, lse


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), 0.0])
def test_merge_equals_one_softmax_over_the_covering_keys_and_ignores_uncovered_outputs(junk):
    g = torch.Generator().manual_seed(3)
    B, H, M, D, splits = 2, 3, 7, 5, (4, 1, 6)
    q = torch.randn(B, H, M, D, generator=g, dtype=torch.float64, requires_grad=True)
    ks = [torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True) for n in splits]
    vs = [torch.randn(B, H, n, D, generator=g, dtype=torch.float64, requires_grad=True) for n in splits]
    cover = torch.rand(len(splits), M, generator=g) > 0.4
    cover[:, 0] = False  # query 0: no piece covers it
    cover[0, 1:], cover[1, 2] = True, False  # every other query has a piece
    pieces = []
    for i in range(len(splits)):
        out, lse = _piece(q, ks[i], vs[i], cover[i])
        pieces.append((torch.where(cover[i].unsqueeze(-1), out, torch.full_like(out, junk)), lse))
    out, lse = merge_attention(pieces)
    # reference: one softmax over the keys of the pieces that cover each query, written out per query
    rows_out, rows_lse = [], []
    for t in range(M):
        use = [i for i in range(len(splits)) if cover[i, t]]
        if not use:
            rows_out.append(torch.zeros(B, H, D, dtype=torch.float64))
            rows_lse.append(torch.full((B, H), float("-inf"), dtype=torch.float64))
            continue
        kk = torch.cat([ks[i] for i in use], 2)
        vv = torch.cat([vs[i] for i in use], 2)
        s = (q[:, :, t:t + 1] @ kk.transpose(-1, -2))[:, :, 0] / math.sqrt(D)
        top = s.max(-1, keepdim=True).values
        e = torch.exp(s - top)
        rows_out.append((e / e.sum(-1, keepdim=True)).unsqueeze(-2).matmul(vv)[:, :, 0])
        rows_lse.append(top[..., 0] + torch.log(e.sum(-1)))
    ref_out, ref_lse = torch.stack(rows_out, 2), torch.stack(rows_lse, 2)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse[:, :, 1:], ref_lse[:, :, 1:], rtol=1e-12, atol=1e-12)
    w_out, w_lse = torch.randn_like(out), torch.randn_like(lse)
    leaves = [q, *ks, *vs]
    got = torch.autograd.grad((out * w_out).sum() + (lse[:, :, 1:] * w_lse[:, :, 1:]).sum(), leaves)
    want = torch.autograd.grad((ref_out * w_out).sum() + (ref_lse[:, :, 1:] * w_lse[:, :, 1:]).sum(), leaves)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- all-reduce cost (ring, hierarchical)

def _ring(nbytes, n, bw, lat):
    """Thakur et al.: reduce-scatter + all-gather, each n - 1 steps of nbytes / n."""
    return 0.0 if n == 1 else 2 * (n - 1) * (nbytes / n / bw + lat)


@pytest.mark.parametrize("ranks,per_node", [(1, 8), (2, 8), (8, 8), (16, 8), (64, 8), (12, 8), (9, 8), (20, 8),
                                            (6, 4), (3, 2)])
def test_allreduce_time_is_the_ring_or_hierarchical_textbook_cost(ranks, per_node):
    links = Links(gpus_per_node=per_node, intra_bw=300e9, inter_bw=40e9, intra_latency=2e-6, inter_latency=9e-6)
    D = 3.7e9
    nodes = -(-ranks // per_node)
    if nodes == 1:
        want = _ring(D, ranks, links.intra_bw, links.intra_latency)
    else:
        # inside each node a reduce-scatter and, at the end, an all-gather over its GPUs; between nodes each GPU's
        # share is all-reduced by a ring over the nodes. A GPU of the last, partly filled node holds
        # D / (GPUs there): the largest share, which sets the inter-node time.
        last = ranks - (nodes - 1) * per_node
        intra = (per_node - 1) * (D / per_node / links.intra_bw + links.intra_latency)
        want = 2 * intra + _ring(D / last, nodes, links.inter_bw, links.inter_latency)
    assert allreduce_s(D, ranks, links) == pytest.approx(want, rel=1e-12)
    if ranks > per_node:  # more ranks never cost less than a full node alone
        assert allreduce_s(D, ranks, links) > allreduce_s(D, per_node, links)


# ---------------------------------------------------------------- AdamATan2

def _adam_atan2_reference(p0, grads, lr, betas, wd):
    """Element-wise float64 steps of the rule; ``grads[t]`` is None where the parameter has no gradient."""
    b1, b2 = betas
    p = [float(x) for x in p0]
    m, v = [0.0] * len(p), [0.0] * len(p)
    t = 0
    for g in grads:
        if g is None:
            continue
        t += 1
        for i, gi in enumerate(g):
            p[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            p[i] -= lr / (1 - b1 ** t) * math.atan2(m[i], math.sqrt(v[i]) / math.sqrt(1 - b2 ** t))
    return p


@pytest.mark.parametrize("dtype,rel", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_adam_atan2_equals_its_rule_in_float64(dtype, rel):
    rng = np.random.default_rng(6)
    steps = 7
    shapes = [(3, 4), (5,), (2, 3), (1,)]
    groups = [dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.5), dict(lr=0.2, betas=(0.5, 0.999), weight_decay=0.0)]
    init = [rng.standard_normal(s) for s in shapes]
    # scales 1e-15..1e15 per element (atan2 is scale-free), exact zeros, a sign flip of a single element
    grads = [[rng.standard_normal(s) * 10.0 ** rng.integers(-15, 16, s) for s in shapes] for _ in range(steps)]
    for t in range(steps):
        grads[t][0][0, 0] = 0.0
        grads[t][1][2] = (-1) ** t * 1e-3
    absent = {(1, 2), (1, 3), (3, 0), (3, 5)}  # (parameter, step) without a gradient
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in init]
    opt = AdamATan2([dict(params=params[:2], **groups[0]), dict(params=params[2:], **groups[1])])
    for t in range(steps):
        for j, p in enumerate(params):
            if (j, t) in absent:
                p.grad = None
            elif j == 0:  # a transposed (non-contiguous) gradient
                p.grad = torch.tensor(grads[t][j].T.copy(), dtype=dtype).t()
            else:
                p.grad = torch.tensor(grads[t][j], dtype=dtype)
        opt.step()
    for j, p in enumerate(params):
        hp = groups[0] if j < 2 else groups[1]
        seq = [None if (j, t) in absent else grads[t][j].reshape(-1).tolist() for t in range(steps)]
        want = _adam_atan2_reference(init[j].reshape(-1), seq, hp["lr"], hp["betas"], hp["weight_decay"])
        np.testing.assert_allclose(p.detach().double().reshape(-1).numpy(), want, rtol=rel, atol=rel * 1e-2)


def test_adam_atan2_step_skipped_through_found_inf_is_no_step_at_all():
    rng = np.random.default_rng(7)
    p0, gs = rng.standard_normal(6), [rng.standard_normal(6) for _ in range(4)]
    p = torch.nn.Parameter(torch.tensor(p0))
    opt = AdamATan2([p], lr=0.1, betas=(0.8, 0.9), weight_decay=0.3)
    for t, g in enumerate(gs):
        skip = t == 1
        p.grad = torch.tensor(g) if not skip else torch.full((6,), float("nan"), dtype=torch.float64)
        opt.found_inf = torch.tensor(1.0 if skip else 0.0)
        opt.step()
        if skip:
            opt.uncount_last_step()
    want = _adam_atan2_reference(p0, [gs[0], None, gs[2], gs[3]], 0.1, (0.8, 0.9), 0.3)
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12)


def test_adam_atan2_fp32_is_scale_free_only_inside_the_fp32_range_of_g_squared():
    """Pinned deviation (module docstring): one first step of lr 1 at gradient scale s."""
    def first_step(scale):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = AdamATan2([p], lr=1.0, betas=(0.9, 0.95), weight_decay=0.0)
        p.grad = torch.tensor([1.0, -0.5]) * scale
        opt.step()
        return p.detach().tolist()

    exact = math.atan(0.1) / 0.1  # atan2(0.1 g, |g|) / (1 - 0.9), any g
    for scale in (1e-18, 1e-9, 1.0, 1e9, 1e18):
        assert first_step(scale) == pytest.approx([-exact, exact], rel=1e-6), scale
    assert first_step(1e-25) == pytest.approx([-math.pi / 2 / 0.1, math.pi / 2 / 0.1], rel=1e-6)  # v = 0
    assert first_step(1e20) == [0.0, 0.0]  # v = Inf


# ---------------------------------------------------------------- EMA of the weights

def test_ema_equals_its_recursion_over_skipped_steps_and_a_resume():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2).to(torch.bfloat16))
    decay = 0.6
    ema = EMA(model, decay)
    shadow = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    oks = [1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1]
    for n, ok in enumerate(oks):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 3.0)
        if n == 6:  # resume: a fresh EMA loaded from the state continues as the old one would
            state = ema.state_dict()
            ema = EMA(model, decay)
            ema.load_state_dict(state)
        ema.update(model, ok=torch.tensor(float(ok)) if n % 2 else (None if ok else torch.tensor(0.0)))
        d = min(decay, (1 + n) / (10 + n))
        if ok:
            for name, p in model.named_parameters():
                shadow[name] = d * shadow[name] + (1 - d) * p.detach().double()
    assert ema.updates == len(oks)
    for name, value in shadow.items():
        assert ema.shadow[name].dtype == torch.float32
        torch.testing.assert_close(ema.shadow[name].double(), value, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- sparse sign-SGD of the puzzle embeddings

@pytest.mark.parametrize("ok", [None, 1.0, 0.0])
def test_sparse_sign_sgd_equals_the_per_id_definition(ok):
    g = torch.Generator().manual_seed(9)
    num, dim, lr, wd = 11, 5, 0.03, 0.2
    emb = SparseEmbedding(num, dim, init_std=1.0, generator=g)
    before = emb.weight.double().clone()
    ids = torch.tensor([4, 0, 4, 9, 4, 10, 0, 7])
    grads = torch.randn(len(ids), dim, generator=g)
    grads[2] = -grads[0] + 0.0  # id 4: rows 0 and 2 cancel, so its sum is row 4 alone...
    grads[4, :2] = 0.0          # ...whose first two entries are 0: sign 0, decay only
    grads[1] = -grads[6]        # id 0: cancels exactly, decay only
    opt = SparseSignSGD(emb, lr=lr, weight_decay=wd)
    touched = opt.update(ids, grads, ok=None if ok is None else torch.tensor(ok))
    assert touched.tolist() == sorted(ids.tolist())
    want = before.clone()
    if ok != 0.0:
        for i in set(ids.tolist()):
            total = [math.fsum(float(grads[j, c]) for j in range(len(ids)) if ids[j] == i) for c in range(dim)]
            for c in range(dim):
                sign = (total[c] > 0) - (total[c] < 0)
                want[i, c] = before[i, c] * (1 - lr * wd) - lr * sign
    torch.testing.assert_close(emb.weight.double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(emb.weight[[1, 2, 3, 5, 6, 8]], before[[1, 2, 3, 5, 6, 8]].float())  # untouched rows
    assert opt.update(torch.zeros(0, dtype=torch.long), torch.zeros(0, dim)).numel() == 0  # no ids: no change
    torch.testing.assert_close(emb.weight.double(), want, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- Polyak update of a target network

@pytest.mark.parametrize("tdtype,sdtype,tau,chunk", [
    (torch.float64, torch.float64, 0.37, 5),
    (torch.float32, torch.float64, 1e-7, 3),   # tiny tau: the target barely moves, in its own precision
    (torch.float16, torch.float32, 0.5, 7),    # the source rounded to the target's dtype, then averaged
    (torch.bfloat16, torch.float32, 0.01, 1 << 20),
    (torch.float32, torch.float32, 1.0, 4),    # tau 1 copies the source exactly
])
def test_polyak_update_equals_the_convex_combination(tdtype, sdtype, tau, chunk):
    """Within two roundings to the target's dtype (the source's, then the result's) of the float64 value,
    relative to the operands."""
    tol = 0.0 if tau == 1.0 else 2 * torch.finfo(tdtype).eps
    torch.manual_seed(1)

    def net(dtype):
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3)).to(dtype)
        with torch.no_grad():
            m[1].running_mean.normal_()
            m[1].num_batches_tracked.fill_(random.randint(0, 99))
        return m

    target, source = net(tdtype), net(sdtype)
    before = {n: t.detach().double().clone() for n, t in target.state_dict().items()}
    polyak_update_(target, source, tau, chunk_numel=chunk, buffers=True)
    src = source.state_dict()
    for name, t in target.state_dict().items():
        if t.is_floating_point():
            want = (1 - tau) * before[name] + tau * src[name].double()
            # roundings relative to the operands (their combination may cancel to near 0)
            bound = tol * (before[name].abs() + src[name].double().abs())
            assert ((t.double() - want).abs() <= bound).all(), name
        else:  # an integer buffer is copied
            assert torch.equal(t, src[name])


# ---------------------------------------------------------------- unigram entropy

def test_unigram_entropy_is_shannons_entropy_of_the_counts():
    rng = random.Random(4)
    streams = [[7], [3, 3, 3], [0, 1], [5, 100_000, 5, 2, 2, 2, 9, 100_000],
               [rng.choice([1, 1, 1, 2, 3, 50]) for _ in range(1000)]]
    for s in streams:
        n = len(s)
        want = -math.fsum(c / n * math.log(c / n) for c in (s.count(x) for x in set(s)))
        got = unigram_entropy(torch.tensor(s))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), s[:8]
    grid = torch.tensor([[0, 1, 2], [1, 1, 1], [2, 2, 0]]).t()  # 2-D and non-contiguous: counts 2, 4, 3
    assert unigram_entropy(grid) == pytest.approx(-math.fsum(c / 9 * math.log(c / 9) for c in (2, 4, 3)), rel=1e-12)
    with pytest.raises(ValueError):
        unigram_entropy(torch.zeros(0, dtype=torch.long))


# ---------------------------------------------------------------- the factory's plan, DESIGN's rule by hand

ORDER = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_optimizer", "zero3_offload"]


def _hand_plan(P, L, N, rpn, precision, dev_mem, host_mem, per_sample, per_sample_ckpt, mb, cpu, margin=0.85):
    b = 4 if precision == "fp32" else 2
    share = min(1.0, rpn / N)
    table = {"zero0": ((2 * b + 12) * P, 0), "zero1": (2 * b * P + 12 * P / N, 0),
             "zero2": (b * P + (b + 12) * P / N, 0), "zero3": ((2 * b + 12) * P / N + 2 * b * L, 0),
             "zero2_offload": (2 * b * P, 12 * P * share),
             "zero3_offload_optimizer": (b * P / N + 2 * b * L, (12 + b) * P * share),  # grads on the host
             "zero3_offload": (2 * b * L, (12 + 2 * b) * P * share)}
    plain, off = ORDER[:4], ORDER[4:]
    for names, ckpt in ((plain, False), (plain, True), (off, False), (off, True)):
        for name in names:
            device, host = (round(x) for x in table[name])
            act = round((per_sample_ckpt if ckpt else per_sample) * mb * (1.0 if b == 4 else 0.5))
            total = device + act + (round(host / min(rpn, N)) if cpu and host else 0)
            if total <= margin * dev_mem and host <= margin * host_mem:
                return name, ckpt
    return None


def test_plan_is_the_first_profile_that_fits_by_designs_rule():
    rng = random.Random(12)
    seen = set()
    for _ in range(400):
        P = rng.randint(10 ** 6, 10 ** 9)
        L = rng.randint(1, P // 4)
        N = rng.choice([1, 2, 3, 4, 8, 16, 64])
        rpn = rng.choice([1, 2, 4, 8])
        cpu = rng.random() < 0.3
        precision = "fp32" if cpu or rng.random() < 0.3 else "bf16"
        dev_mem = int(rng.uniform(0.5, 40) * P)
        host_mem = int(rng.uniform(1, 200) * P)
        per_sample = rng.randint(10 ** 5, 10 ** 9)
        per_sample_ckpt = rng.randint(1, per_sample)
        mb = rng.randint(1, 16)
        hw = Hardware("cpu" if cpu else "cuda", dev_mem, host_mem, rpn, bf16_supported_fast=not cpu,
                      fp16_supported=not cpu)
        want = _hand_plan(P, L, N, rpn, precision, dev_mem, host_mem, per_sample, per_sample_ckpt, mb, cpu)
        stats = ModelStats(params=P, largest_module_params=L, hidden_size=64, num_layers=4)
        acts = Activations(per_sample, per_sample_ckpt)
        if want is None:
            with pytest.raises(PlanError):
                choose_plan(stats, hw, acts, N, mb, precision)
            seen.add(None)
            continue
        plan = choose_plan(stats, hw, acts, N, mb, precision)
        assert (plan.profile, plan.activation_checkpointing) == want
        seen.add(want)
    assert len(seen) >= 8  # the draws reach plain, checkpointed, offload profiles and "nothing fits"


# ---------------------------------------------------------------- sequence parallelism (exchange), simulated

class _FakeDist:
    """Just what ``SequenceParallelDilatedCore`` asks of torch.distributed, for ``sp`` simulated ranks; a group
    is ``"sp"`` (every rank) or the tuple of its ranks."""

    def __init__(self, sp):
        self.sp, self.rank = sp, 0

    def members(self, group):
        return list(range(self.sp)) if group == "sp" else list(group)

    def get_world_size(self, group=None):
        return len(self.members(group))

    def get_rank(self, group=None):
        return self.rank if group is None else self.members(group).index(self.rank)

    def new_group(self, ranks, timeout=None):
        return tuple(ranks)


@pytest.mark.parametrize("segs,rates,causal,heads,offset", [
    ([4, 16, 32], [1, 2, 4], True, 4, 0),    # 16 spans ranks {0, 1} and {2, 3}; 32 spans all four
    ([4, 16, 32], [1, 2, 4], False, 3, 1),   # the same without causality; heads not aligned with the rates
    ([8, 32], [2, 8], True, 5, 3),           # one dilated position per rank and segment
    ([64, 8], [4, 1], True, 2, 0),           # a segment longer than the sequence
])
def test_exchange_mode_over_four_simulated_ranks_equals_the_brute_force(monkeypatch, segs, rates, causal, heads,
                                                                         offset):
    """LongNet's distributed algorithm run rank by rank in one process (4 ranks of 8 tokens; the 2-rank tests in
    tests/dist never have more than one earlier chunk in a segment): the chunks' outputs, concatenated, and the
    gradients of the whole q, k, v (the all-gather's backward is autograd through the simulated gather) equal
    the float64 N x N-mask brute force."""
    from dstrain.ops.dilated import make_branches
    from dstrain.parallel import sequence as sq
    from tests.dilated_reference import reference_dilated

    sp, B, N, D = 4, 2, 32, 6
    t = N // sp
    fake = _FakeDist(sp)
    monkeypatch.setattr(sq, "dist", fake)
    g = torch.Generator().manual_seed(len(segs) * heads + offset)
    q, k, v = (torch.randn(B, N, heads, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    selected, calls = {}, [0]
    real_gather = sq.gather_dilated

    def recording_gather(x, w, r, head_offset=0):
        out = real_gather(x, w, r, head_offset)
        selected[id(out)] = (calls[0] % 3, r, head_offset)  # q, k, v in the core's order
        calls[0] += 1
        return out

    class FakeGather:
        @staticmethod
        def apply(x, group):
            which, r, ho = selected[id(x)]
            full = (q, k, v)[which].transpose(1, 2)
            return torch.stack([x if j == fake.rank else real_gather(full[:, :, j * t:(j + 1) * t], t, r, ho)
                                for j in fake.members(group)])

    monkeypatch.setattr(sq, "gather_dilated", recording_gather)
    monkeypatch.setattr(sq, "GatherFromGroup", FakeGather)
    branches = make_branches(segs, rates)
    outs = []
    for rank in range(sp):
        fake.rank = rank
        core = sq.SequenceParallelDilatedCore(branches, causal, "sp", [list(range(sp))], mode="exchange",
                                              head_offset=offset)  # each rank its own segment groups
        part = slice(rank * t, (rank + 1) * t)
        outs.append(core(q[:, part], k[:, part], v[:, part]))
        assert core.last_mode == "exchange"
    out = torch.cat(outs, 1)
    leaves = (q, k, v)
    ref = reference_dilated(*(x.transpose(1, 2) for x in leaves), segs, rates, causal, offset).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    up = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * up).sum(), leaves)
    want = torch.autograd.grad((ref * up).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
