"""Round 5 of the independent references: numbers a user compares with a paper's formula, recomputed
here from the formula itself (exact fractions, plain loops, float64), never through dstrain's helpers.

* DAPO's binomial tail and round sizing (exact rational arithmetic; large n included), the soft
  overlong punishment (the paper's piecewise formula at every integer length);
* unbiased pass@k (Chen et al., 2021) by enumerating every k-subset, and by the product form;
* Wilson's score interval (closed form) and Newcombe's (1998) method 10 for paired proportions,
  written in the paper's orientation (theta = p1 - p2) and turned round;
* the chunked LM-head cross-entropy against a float64 log-sum-exp with its gradient written out
  (``softmax - onehot``), at odd shapes, with large logits, bf16 inputs and every target ignored;
* HRM's ACT segment: the halting decision, the Q-learning target from the extra segment and the
  loss, recomputed from the logits the heads produced; its FLOP count against torch's counter;
* the benchmark's step-time summary (median and linearly interpolated p90) against numpy, and the
  paired percentile bootstrap of ``benchmarks/grpo_mbpp_heldout.py`` against numpy's percentiles;
* the warm-up + cosine schedule (no scheduler block) and the planner's model-state bytes (DESIGN's table);
* dilated attention at shapes the other tests leave out (rates and segments not powers of two, more
  heads than offsets, one token) in fp64, fp32, bf16 and fp16;
* GRPO's clip-fraction and KL statistics (TRL's definitions) and advantages of fp16 / bf16 rewards.
"""
from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction
from statistics import NormalDist

import numpy as np
import pytest
import torch

from dstrain.bench import summarize
from dstrain.ops.lm_head import linear_cross_entropy
from dstrain.rl import dapo, grpo_math as gm
from dstrain.rl import score_math as sm


# ---------------------------------------------------------------- binomial tail, round sizing

def exact_tail(n: int, p: float, k: int) -> Fraction:
    """P(Binomial(n, p) >= k) as an exact fraction of the float p."""
    q = Fraction(p)
    a, d = q.numerator, q.denominator  # whole numbers throughout, one division at the end
    return Fraction(sum(math.comb(n, i) * a ** i * (d - a) ** (n - i) for i in range(max(k, 0), n + 1)), d ** n)


def test_binomial_tail_equals_the_exact_sum():
    rng = random.Random(0)
    cases = [(rng.randint(1, 40), rng.random(), None) for _ in range(40)]
    cases = [(n, p, rng.randint(0, n + 1)) for n, p, _ in cases]
    cases += [(10, 0.0, 1), (10, 1.0, 10), (10, 1.0, 11), (10, 0.5, 0), (1, 0.3, 1), (60, 1e-9, 2), (60, 0.999999, 60)]
    worst = 0.0
    for n, p, k in cases:
        want = float(exact_tail(n, p, k))
        got = dapo.binomial_at_least(n, p, k)
        assert got == pytest.approx(want, rel=1e-11, abs=1e-300), (n, p, k)
        worst = max(worst, abs(got - want) / max(want, 1e-300))
    assert worst < 1e-11


@pytest.mark.parametrize("n,p,k", [(1100, 0.5, 500), (2000, 0.9, 1900), (3000, 0.375, 1100), (1500, 0.0625, 100)])
def test_binomial_tail_of_a_large_share_is_finite_and_exact(n, p, k):
    """C(n, i) exceeds a float beyond n of about 1030: the product form raised OverflowError there."""
    want = float(exact_tail(n, p, k))
    assert dapo.binomial_at_least(n, p, k) == pytest.approx(want, rel=1e-9)


def test_round_sizes_are_the_brute_force_optima():
    rng = random.Random(1)
    for _ in range(25):
        needed, cap = rng.randint(1, 6), rng.randint(1, 16)
        p, target, cost = rng.uniform(0.05, 1.0), rng.uniform(0.3, 0.99), rng.uniform(0.0, 20.0)
        top = max(cap, needed)
        tails = {n: exact_tail(n, p, needed) for n in range(needed, top + 1)}
        reach = [n for n in range(needed, top + 1) if tails[n] >= Fraction(target)]
        assert dapo.groups_for_target(needed, p, target, cap) == (reach[0] if reach else top)
        refill = cost + math.ceil(needed / p)
        costs = {n: n + float(1 - tails[n]) * refill for n in range(needed, top + 1)}
        best = min(costs.values())
        got = dapo.groups_for_cost(needed, p, cost, cap)
        assert costs[got] <= best + 1e-9 and got == min(n for n, c in costs.items() if c <= best + 1e-9)
    n = dapo.groups_for_target(600, 0.9, 0.9, 1200)  # a share past the float range of C(n, i)
    assert exact_tail(n, 0.9, 600) >= Fraction(0.9) > exact_tail(n - 1, 0.9, 600)


# ---------------------------------------------------------------- DAPO's overlong punishment

@pytest.mark.parametrize("max_len,buffer,factor", [(20, 5, 1.0), (16, 16, 1.0), (9, 1, 0.5), (64, 10, 2.0)])
def test_overlong_penalty_is_dapos_piecewise_formula(max_len, buffer, factor):
    lengths = list(range(0, max_len + 4))

    def r(n):  # DAPO eq. 13, scaled by the factor
        if n <= max_len - buffer:
            return 0.0
        if n <= max_len:
            return ((max_len - buffer) - n) / buffer * factor
        return -factor

    got = dapo.overlong_penalty(torch.tensor(lengths), max_len, buffer, factor).tolist()
    assert got == pytest.approx([r(n) for n in lengths], abs=1e-6)
    assert got[max_len] == pytest.approx(-factor) and got[max_len - buffer] == 0.0


# ---------------------------------------------------------------- pass@k

@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_success(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            want = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert gm.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15), (n, c, k)


def test_pass_at_k_matches_the_numerically_stable_product_for_large_n():
    for n, c, k in [(200, 3, 10), (1000, 1, 100), (2000, 1000, 1000), (500, 0, 50), (64, 63, 2)]:
        want = 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
        assert gm.pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------- Wilson and Newcombe

Z95 = NormalDist().inv_cdf(0.975)


def wilson(k: float, n: float, z: float = Z95):
    """Wilson (1927): (2k + z^2 +- z sqrt(z^2 + 4 k (n - k) / n)) / (2 (n + z^2))."""
    root = z * math.sqrt(z * z + 4 * k * (n - k) / n)
    return (2 * k + z * z - root) / (2 * (n + z * z)), (2 * k + z * z + root) / (2 * (n + z * z))


def newcombe10(a, b, c, d, z=Z95):
    """Newcombe (1998) method 10 for theta = p1 - p2, p1 = (a + b) / n, p2 = (a + c) / n (his notation:
    l2, u2 the Wilson limits of p1; l3, u3 of p2; phi of the 2x2 table, 0 when a margin is empty)."""
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l2, u2 = wilson(a + b, n, z)
    l3, u3 = wilson(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    phi = (a * d - b * c) / math.sqrt(margins) if margins else 0.0
    delta = math.sqrt((p1 - l2) ** 2 - 2 * phi * (p1 - l2) * (u3 - p2) + (u3 - p2) ** 2)
    eps = math.sqrt((u2 - p1) ** 2 - 2 * phi * (u2 - p1) * (p2 - l3) + (p2 - l3) ** 2)
    return p1 - p2, p1 - p2 - delta, p1 - p2 + eps


def test_wilson_interval_is_the_closed_form():
    rng = random.Random(2)
    cases = [(0, 1), (1, 1), (0, 50), (50, 50), (1, 2), (3, 7)] + [(k, n) for n in (rng.randint(1, 500) for _ in range(30))
                                                                  for k in (rng.randint(0, n),)]
    for k, n in cases:
        lo, hi = sm.wilson_interval(k, n)
        wl, wh = wilson(k, n)
        assert lo == pytest.approx(max(0.0, wl), abs=1e-7) and hi == pytest.approx(min(1.0, wh), abs=1e-7), (k, n)
        z = 2.5758
        assert sm.wilson_interval(k, n, z) == pytest.approx(wilson(k, n, z), abs=1e-12)


def test_paired_interval_is_newcombes_method_10_turned_round():
    rng = random.Random(3)
    tables = [(30, 5, 25, 40), (10, 0, 0, 10), (0, 3, 4, 0), (5, 0, 7, 0), (0, 0, 0, 9), (12, 0, 0, 0),
              (1, 1, 1, 1), (0, 1, 0, 0)]
    tables += [tuple(rng.randint(0, 30) for _ in range(4)) for _ in range(40)]
    for a, b, c, d in tables:
        if a + b + c + d == 0:
            continue
        theta, lo, hi = newcombe10(a, b, c, d)  # p1 - p2; dstrain reports p2 - p1 = -theta
        diff, got_lo, got_hi = sm.paired_difference_interval(a, b, c, d, z=Z95)
        assert diff == pytest.approx(-theta, abs=1e-12)
        assert got_lo == pytest.approx(max(-1.0, -hi), abs=1e-10), (a, b, c, d)
        assert got_hi == pytest.approx(min(1.0, -lo), abs=1e-10), (a, b, c, d)


# ---------------------------------------------------------------- chunked LM-head cross-entropy

def ref_ce(x: np.ndarray, w: np.ndarray, t: np.ndarray, ignore: int):
    """(mean CE over kept targets, d/dx, d/dw) in float64; no kept target: (0, 0, 0) (dstrain's choice)."""
    z = x @ w.T
    top = z.max(axis=1, keepdims=True)
    lse = (top + np.log(np.exp(z - top).sum(axis=1, keepdims=True)))[:, 0]
    keep = t != ignore
    count = max(int(keep.sum()), 1)
    safe = np.where(keep, t, 0)
    loss = float(((lse - z[np.arange(len(t)), safe]) * keep).sum() / count)
    dz = np.exp(z - lse[:, None])
    dz[np.arange(len(t)), safe] -= 1.0
    dz *= (keep / count)[:, None]
    return loss, dz @ w, dz.T @ x


@pytest.mark.parametrize("n,v,d,chunk,ignore,scale", [
    (1, 3, 4, 1, -100, 1.0),        # one token
    (13, 7, 5, 4, -100, 1.0),       # the last chunk is short
    (13, 7, 5, 100, 0, 1.0),        # chunk past the tokens; ignore_index a real class id
    (20, 11, 6, 3, -1, 300.0),      # logits in the thousands: only a shifted log-sum-exp survives
    (9, 5, 3, 2, -100, 1e-4),       # near-uniform softmax
])
def test_linear_cross_entropy_equals_float64_log_sum_exp(n, v, d, chunk, ignore, scale):
    g = np.random.default_rng(n * v + chunk)
    x = g.standard_normal((n, d)) * math.sqrt(scale)
    w = g.standard_normal((v, d)) * math.sqrt(scale)
    t = g.integers(0, v, n)
    t[g.random(n) < 0.3] = ignore
    loss, dx, dw = ref_ce(x, w, t, ignore)
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True)
    got = linear_cross_entropy(xt, wt, torch.tensor(t), chunk=chunk, ignore_index=ignore)
    got.backward()
    assert got.item() == pytest.approx(loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(xt.grad.numpy(), dx, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(wt.grad.numpy(), dw, rtol=1e-10, atol=1e-13)


def test_linear_cross_entropy_in_bf16_stays_near_the_float64_value():
    g = np.random.default_rng(7)
    x, w = g.standard_normal((64, 16)), g.standard_normal((40, 16)) * 0.5
    t = g.integers(0, 40, 64)
    xb, wb = torch.tensor(x).bfloat16(), torch.tensor(w).bfloat16()
    loss, dx, dw = ref_ce(xb.double().numpy(), wb.double().numpy(), t, -100)  # the rounded inputs, exactly
    xb.requires_grad_()
    got = linear_cross_entropy(xb, wb, torch.tensor(t), chunk=24)
    got.backward()
    assert got.dtype == torch.float32 and xb.grad.dtype == torch.bfloat16
    assert got.item() == pytest.approx(loss, rel=2e-2)  # logits are formed in bf16 (3 significant digits)
    np.testing.assert_allclose(xb.grad.double().numpy(), dx, rtol=0.1, atol=2e-3)


def test_every_target_ignored_gives_zero_loss_and_zero_gradient():
    """torch's mean cross-entropy is 0/0 = nan here; dstrain's is 0 (documented in ``dstrain.ops.lm_head``):
    a micro-batch of padding must not poison the data-parallel average."""
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    t = torch.full((5,), -100)
    assert torch.isnan(torch.nn.functional.cross_entropy(x @ w.t(), t))
    got = linear_cross_entropy(x, w, t, chunk=2)
    got.backward()
    assert got.item() == 0.0 and not x.grad.any() and not w.grad.any()


# ---------------------------------------------------------------- HRM's ACT segment

def _hrm(**kw):
    from models.hrm.model import HRM, HRMConfig
    base = dict(hidden_size=16, num_heads=2, H_layers=1, L_layers=1, H_cycles=2, L_cycles=2, halt_max_steps=3,
                mlp_multiple_of=16, seq_len=6, vocab_size=5, halt_exploration_prob=0.0, loss="softmax")
    base.update(kw)
    torch.manual_seed(0)
    model = HRM(HRMConfig(**base))
    with torch.no_grad():  # a Q-head that disagrees from row to row (its init makes every q -5)
        model.q_head.weight.normal_(0.0, 2.0)
        model.q_head.bias.normal_(0.0, 1.0)
    return model


def _ref_token_loss(logits: torch.Tensor, label: int, kind: str) -> float:
    z = logits.double().tolist()
    if kind == "stablemax":  # the HRM reference: s(x) = x + 1 (x >= 0), 1 / (1 - x) below
        s = [v + 1 if v >= 0 else 1 / (1 - v) for v in z]
        return -math.log(s[label] / sum(s))
    top = max(z)
    return -(z[label] - top - math.log(sum(math.exp(v - top) for v in z)))


def _bce(logit: float, y: float) -> float:
    """-(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))), written stably."""
    return max(logit, 0.0) - logit * y + math.log1p(math.exp(-abs(logit)))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("kw", [dict(), dict(loss="stablemax"), dict(halt_rule="solved", halt_threshold=0.3),
                                dict(halt_max_steps=2, halt_exploration_prob=1.0), dict(act=False), "eval"])
def test_act_segment_loss_halting_and_q_target_equal_the_definition(kw):
    evaluating = kw == "eval"
    model = _hrm(**({} if evaluating else kw))
    c = model.config
    model.train(not evaluating)
    g = torch.Generator().manual_seed(4)
    B = 6
    inputs = torch.randint(0, c.vocab_size, (B, c.seq_len), generator=g)
    labels = torch.randint(0, c.vocab_size, (B, c.seq_len), generator=g)
    labels[1, :2] = -100
    labels[3] = -100  # a row with no labelled cell: "exactly right" by the reference's count
    steps = torch.tensor([0, 1, 2, 0, 1, 2]) % c.halt_max_steps
    z_H, z_L = model.initial_state(B)
    seen = {"logits": [], "q": []}
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: seen["logits"].append(o.detach())),
             model.q_head.register_forward_hook(lambda m, i, o: seen["q"].append(o.detach().double()))]
    loss, out = model(inputs, labels, None, z_H, z_L, steps, torch.zeros(B, dtype=torch.bool))
    for h in hooks:
        h.remove()
    logits, q = seen["logits"][0], seen["q"][0]
    new_steps = (steps + 1).tolist()
    compare = c.act and c.halt_max_steps > 1 and not evaluating and c.halt_rule == "compare"
    assert len(seen["q"]) == (2 if compare else 1)  # the target's extra no-grad segment, only when it is used
    total = 0.0
    for i in range(B):
        kept = [t for t in range(c.seq_len) if labels[i, t] != -100]
        lm = sum(_ref_token_loss(logits[i, t], int(labels[i, t]), c.loss) for t in kept) / max(len(kept), 1)
        right = all(int(logits[i, t].argmax()) == int(labels[i, t]) for t in kept)
        q_halt, q_cont = q[i].tolist()
        last = new_steps[i] >= c.halt_max_steps
        if evaluating or not c.act or c.halt_max_steps == 1:
            halt = last
        else:
            wants = q_halt > (c.halt_threshold if c.halt_rule == "solved" else q_cont)
            minimum = 2 if c.halt_exploration_prob == 1.0 else 0  # randint(2, 3) when every row explores
            halt = (last or wants) and new_steps[i] >= minimum
        assert bool(out["halted"][i]) == halt, i
        row = lm + (0.5 * _bce(q_halt, float(right)) if c.act else 0.0)
        if compare:
            nq_halt, nq_cont = seen["q"][1][i].tolist()
            target = _sigmoid(nq_halt if last else max(nq_halt, nq_cont))
            row += 0.5 * _bce(q_cont, target)
        total += row
    assert loss.item() == pytest.approx(total / B, rel=1e-5)
    assert out["steps"].tolist() == new_steps
    assert out["metrics"]["count"].item() == sum(
        bool(out["halted"][i]) and any(labels[i] != -100) for i in range(B))


@pytest.mark.parametrize("kw", [dict(), dict(act=False), dict(halt_rule="solved"), dict(halt_max_steps=1)])
def test_hrm_flops_per_segment_token_equal_torchs_count_of_its_block_matmuls(kw):
    """The count covers the H and L blocks' matmuls (no attention scores, heads or embeddings), per position
    of the prefixed sequence; torch's FLOP counter sees every matmul a training segment dispatches."""
    from torch.utils.flop_counter import FlopCounterMode
    model = _hrm(H_layers=2, L_layers=3, H_cycles=2, L_cycles=3, seq_len=7, **kw).train()
    B = 3
    ids = torch.randint(0, 5, (B, 7))
    with FlopCounterMode(display=False) as counter:
        loss, _ = model(ids, ids)
        loss.backward()
    counts = counter.get_flop_counts()
    blocks = sum(v for name in ("HRM.H_level", "HRM.L_level") for op, v in counts.get(name, {}).items()
                 if str(op) in ("aten.mm", "aten.addmm"))
    assert blocks > 0
    assert model.flops_per_segment_token() * B * model.config.total_len == blocks


# ---------------------------------------------------------------- benchmark step-time summary

def test_step_time_summary_equals_numpys_percentiles():
    rng = np.random.default_rng(5)
    for n in (1, 2, 3, 10, 11, 37):
        xs = rng.exponential(0.2, n).tolist()
        s = summarize(xs)
        assert s["median"] == pytest.approx(float(np.median(xs)), rel=1e-15)
        assert s["p90"] == pytest.approx(float(np.percentile(xs, 90)), rel=1e-12)  # numpy's default: linear
        assert s["mean"] == pytest.approx(float(np.mean(xs)), rel=1e-12)
        assert (s["min"], s["max"]) == (min(xs), max(xs))


# ---------------------------------------------------------------- warm-up + cosine (no scheduler block)

@pytest.mark.parametrize("warmup,total,ratio", [(5, 20, 0.1), (0, 10, 0.0), (1, 1, 0.5), (8, 8, 0.1), (3, 50, 1.0)])
def test_warmup_cosine_is_the_standard_schedule_shifted_by_one_warmup_update(warmup, total, ratio):
    """Hugging Face's cosine-with-warm-up and min ratio, except that warm-up update k runs at (k + 1) / W
    (theirs: k / W, a first update at lr 0): dstrain's documented choice (README, ``WarmupCosine``).
    Driven as the engine drives it: LambdaLR, update k at the factor of iteration k."""
    from dstrain.config import TrainConfig
    from dstrain.engine.factory import scheduler_factory
    lr = 3e-4
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = scheduler_factory(TrainConfig(lr=lr, warmup_steps=warmup, steps=total, min_lr_ratio=ratio))(opt)
    for k in range(total + 3):
        if k < warmup:
            want = lr * (k + 1) / warmup
        else:
            progress = min(1.0, (k - warmup) / max(1, total - warmup))
            want = lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-18), k
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * ratio, rel=1e-12, abs=1e-18)  # held past the horizon


# ---------------------------------------------------------------- the planner's model-state bytes

def test_model_state_bytes_are_the_zero_papers_counts():
    """DESIGN's table (ZeRO paper, Adam, K = 12 optimizer bytes per parameter), bf16 and fp32 (2-byte terms
    doubled), host bytes of the offload profiles shared by the node's ranks."""
    from dstrain.engine.profiles import ModelStats, model_state_bytes
    P, L = 7_000_003, 250_001
    for N, rpn in [(1, 1), (4, 4), (16, 8), (3, 2)]:
        share = min(1.0, rpn / N)
        for precision, b in (("bf16", 2), ("fp32", 4)):
            table = {"zero0": ((2 * b + 12) * P, 0), "zero1": (2 * b * P + 12 * P / N, 0),
                     "zero2": (b * P + (b + 12) * P / N, 0), "zero3": ((2 * b + 12) * P / N + 2 * b * L, 0),
                     "zero2_offload": (2 * b * P, 12 * P * share),
                     "zero3_offload_optimizer": (b * P / N + 2 * b * L, (12 + b) * P * share),  # grads on the host
                     "zero3_offload": (2 * b * L, (12 + 2 * b) * P * share)}
            stats = ModelStats(params=P, largest_module_params=L, hidden_size=64, num_layers=4)
            for profile, (device, host) in table.items():
                got = model_state_bytes(profile, stats, N, precision, rpn)
                assert got == (round(device), round(host)), (profile, precision, N)


# ---------------------------------------------------------------- dilated attention at odd shapes

@pytest.mark.parametrize("n,segs,rates,causal,heads,offset", [
    (36, [6, 12, 36], [1, 3, 6], False, 5, 0),   # segments and rates not powers of two; 5 heads over 6 offsets
    (36, [6, 12, 36], [1, 3, 6], True, 7, 2),    # more heads than the largest rate, a rank's head offset
    (17, [6, 9], [2, 3], True, 3, 1),            # 17 tokens: no segment tiles it (padded, causal)
    (23, [10, 30], [5, 3], True, 4, 0),          # a segment longer than the sequence
    (1, [4], [2], True, 2, 1),                   # one token
])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6), (torch.bfloat16, 3e-2),
                                       (torch.float16, 4e-3)])
def test_dilated_attention_at_odd_shapes_and_precisions(n, segs, rates, causal, heads, offset, dtype, tol):
    """Against the N x N-mask brute force (tests/dilated_reference.py) evaluated in float64 on the rounded
    inputs; the low-precision outputs are rounded once at the end, so their error is a few ulps of the output."""
    from dstrain.ops.dilated import dilated_attention, make_branches
    from tests.dilated_reference import reference_dilated
    g = torch.Generator().manual_seed(n * heads)
    q, k, v = (torch.randn(2, heads, n, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    out, lse = dilated_attention(q, k, v, make_branches(segs, rates), causal, offset, return_lse=True)
    ref, ref_lse = reference_dilated(q.double(), k.double(), v.double(), segs, rates, causal, offset, return_lse=True)
    assert out.dtype == dtype
    covered = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), covered)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double()[covered], ref_lse[covered], rtol=max(tol, 1e-6), atol=max(tol, 1e-6))


# ---------------------------------------------------------------- GRPO statistics and low-precision rewards

def test_grpo_clip_fraction_and_kl_statistics_are_trls_definitions():
    """TRL counts a token clipped when ratio < 1 - eps_low with A < 0 (low) or ratio > 1 + eps_high with A > 0
    (high); the KL statistic is the k3 estimate's mean over completion tokens."""
    g = torch.Generator().manual_seed(8)
    B, T = 7, 11
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[2] = 0.0  # no advantage: never clipped
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    eps_low, eps_high = 0.2, 0.28
    cfg = gm.GRPOLossConfig(eps_low=eps_low, eps_high=eps_high, beta=0.05, loss_type="grpo")
    _, stats = gm.grpo_loss(logp, old, ref, adv, mask, cfg)
    clipped = kl = tokens = 0.0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            ratio = math.exp(logp[i, t] - old[i, t])
            a = float(adv[i])
            clipped += (ratio < 1 - eps_low and a < 0) or (ratio > 1 + eps_high and a > 0)
            d = float(ref[i, t] - logp[i, t])
            kl += math.exp(d) - d - 1
            tokens += 1
    assert 0 < clipped < tokens
    assert stats["clip_fraction"] == pytest.approx(clipped / tokens, rel=1e-6)
    assert stats["kl"] == pytest.approx(kl / tokens, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_group_advantages_of_low_precision_or_offset_rewards(dtype):
    """The advantages of the rewards as stored (rounded to ``dtype``), computed from the definition in float64:
    mean and unbiased std per group, std + 1e-4 below, 0 for a group without spread."""
    rows = [[0.1, 0.2, 0.3, 0.7], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0], [-3.5, 2.25, 2.25, 7.0]]
    if dtype == torch.float64:
        rows.append([1e6, 1e6 + 1e-3, 1e6 + 2e-3, 1e6])  # a large offset with a spread of 1e-3
    stored = torch.tensor(sum(rows, []), dtype=dtype)
    got = gm.group_advantages(stored, 4)
    values = stored.double().tolist()
    for gi in range(len(rows)):
        grp = values[4 * gi:4 * gi + 4]
        mean = math.fsum(grp) / 4
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in grp) / 3)
        for j, r in enumerate(grp):
            want = 0.0 if max(grp) == min(grp) else (r - mean) / (std + 1e-4)
            assert got[4 * gi + j].item() == pytest.approx(want, rel=1e-6, abs=1e-6), (gi, j)


# ---------------------------------------------------------------- the benchmark's paired bootstrap

@pytest.mark.parametrize("resamples,level", [(10000, 0.95), (200, 0.95), (999, 0.9), (1, 0.95)])
def test_paired_bootstrap_bounds_are_the_percentiles_of_the_resampled_means(resamples, level):
    """Percentile bootstrap (Efron): the resampled mean differences, drawn here the same way (problems with
    replacement from ``random.Random(seed)``), and numpy's percentiles of them at (1 -+ level) / 2."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_mbpp_heldout.py"
    spec = importlib.util.spec_from_file_location("grpo_mbpp_heldout_round5", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    g = random.Random(11)
    first = [g.choice([0.0, 0.25, 0.5, 1.0]) for _ in range(40)]
    second = [x + g.uniform(-0.1, 0.3) for x in first]  # continuous: no two resampled means tie
    diffs = np.array(second) - np.array(first)
    rng = random.Random(5)
    means = [float(np.mean([diffs[rng.randrange(len(diffs))] for _ in range(len(diffs))])) for _ in range(resamples)]
    want_low, want_high = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    mean, low, high = bench.paired_bootstrap(first, second, resamples=resamples, seed=5, level=level)
    assert mean == pytest.approx(float(diffs.mean()), abs=1e-12)
    assert low == pytest.approx(want_low, abs=1e-12) and high == pytest.approx(want_high, abs=1e-12)
