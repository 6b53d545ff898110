"""Round 9 of the independent references: each quantity recomputed from its definition (exact fractions,
plain loops, exhaustive enumeration, float64), never through dstrain's helpers.

Compared here:

* the maths verifier's number normalisation (``dstrain.rewards.maths``) against exact rational arithmetic:
  the canonical form read back as a fraction is the number the text wrote (currency, thousands separators,
  unicode minus, decimals of any length, fractions), and two answers get reward 1 exactly when they are the
  same rational number, and SCoRe's leak check flags a hint exactly when a number in it is the answer;
* the Sudoku solver, uniqueness count and validity check against all 288 4x4 grids enumerated by brute
  force (and a naive row-major backtracking count on 6x6 and 9x9 puzzles), the minimum of 4 clues of a
  uniquely solvable 4x4 puzzle (``MIN_CLUES``) by enumerating every 3- and 4-clue pattern, the generator's
  blanks and uniqueness, the augmentation as a permutation of the set of valid grids, the token encoding's
  inverse, and ``propagation_rounds`` against its docstring's rule written as plain loops;
* the dense GPT's logits against a float64 forward pass written from the architecture (pre-LayerNorm
  blocks, exact-erf GELU, causal softmax attention per head, learned positions, untied head), biases and
  non-trivial LayerNorm gains included, and its loss (whole and chunked head) against the float64 mean of
  ``-log softmax``;
* DeepSpeed's OneCycle block (cycle and decay phases) as the engine applies it per optimizer update under
  gradient accumulation and across a checkpoint resume, against the triangle-then-inverse-decay formula;
* the policy's supervised warm-start batch (``supervised_batch`` + the model's ``-100``-ignoring loss): the
  loss and gradient equal the token-level mean of ``-log p(target token | prefix)`` with each row run alone,
  unpadded, computed in float64 from the logits.

Found and fixed:

* ``normalize_number`` wrote a terminating decimal through ``Decimal`` division at the default 28-digit
  context, so an answer with more significant digits was rounded: ``123456789012345678901234567890.5`` and
  ``...890.4`` both became ``123456789012345678901234567900`` (reward 1 for a wrong answer), and ``1/2^50``
  became a 28-digit decimal that is not 2^-50. The decimal is now formed exactly with integer arithmetic.
* SCoRe's leak check (``score_warm.leaks_answer``, which sets a leaking hint's guidance reward to -1) read the
  hint's numbers with ``-?\d+(?:\.\d+)?``, not as the verifier reads them: a hint saying ``$1,000`` (answer
  1000), ``.5`` or ``1/2`` (answer 0.5), ``6/9`` (answer 2/3) or ``\u22125`` (answer -5) stated an answer the
  verifier accepts and was not flagged, so the guidance model kept its reward for giving the answer away. It
  now reads them with the verifier's own pattern (``maths.numbers_in``).
"""
from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

# ---------------------------------------------------------------- maths answers: exact rationals


def _written(value: Fraction, rng: random.Random) -> list[str]:
    """Ways a person writes ``value`` (exact by construction): integer, decimal, fraction, currency."""
    out = []
    sign = "-" if value < 0 else ""
    mag = abs(value)
    if mag.denominator == 1:
        n = mag.numerator
        out += [f"{sign}{n}", f"{sign}{n}.000", f"{sign}${n:,}", f"\u2212{n}" if sign else f"+{n}",
                f"{sign}{n * 3}/3"]
    den = mag.denominator
    twos = fives = 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den == 1:  # terminating: the decimal expansion with every digit, by integer arithmetic
        k = max(twos, fives)
        digits = str(mag.numerator * 10 ** k // mag.denominator).rjust(k + 1, "0")
        whole, frac = digits[:len(digits) - k], digits[len(digits) - k:]
        pad = "0" * rng.randint(0, 3)
        out.append(f"{sign}{whole}.{frac}{pad}" if k else f"{sign}{whole}")
        if whole == "0" and k:
            out.append(f"{sign}.{frac}")
    scale = rng.randint(1, 7)
    out.append(f"{sign}{mag.numerator * scale} / {mag.denominator * scale}")
    return out


def _values(rng: random.Random) -> list[Fraction]:
    vals = [Fraction(0), Fraction(1, 2), Fraction(-3, 4), Fraction(2, 3), Fraction(-1, 3), Fraction(7, 1),
            Fraction(1, 2 ** 50), Fraction(3, 5 ** 31), Fraction(10 ** 30 * 2 + 1, 2),
            Fraction(123456789012345678901234567890 * 10 + 5, 10), Fraction(-(10 ** 40) - 1, 10 ** 12),
            Fraction(1, 7 ** 9), Fraction(10 ** 29 + 1, 3)]
    for _ in range(40):
        num = rng.randint(-10 ** rng.randint(1, 45), 10 ** rng.randint(1, 45))
        den = rng.choice([1, 2 ** rng.randint(0, 70), 5 ** rng.randint(0, 40), 10 ** rng.randint(0, 35),
                          rng.randint(1, 10 ** 6)])
        vals.append(Fraction(num, den))
    return vals


def test_normalised_answer_is_the_exact_number_written():
    from dstrain.rewards.maths import normalize_number
    rng = random.Random(9)
    for value in _values(rng):
        forms = _written(value, rng)
        canon = {normalize_number(text) for text in forms}
        assert len(canon) == 1, (value, forms, canon)
        (c,) = canon
        assert Fraction(c) == value, (forms, c)  # read back: the very number, not a rounding of it
        if "/" in c:  # a fraction only where no finite decimal exists, in lowest terms
            p, q = (int(x) for x in c.split("/"))
            assert math.gcd(p, q) == 1 and q > 1
            rest = q
            for d in (2, 5):
                while rest % d == 0:
                    rest //= d
            assert rest != 1
        elif "." in c:
            assert not c.endswith("0") and not c.endswith(".")


def test_reward_is_one_exactly_when_the_numbers_are_equal():
    from dstrain.rewards.maths import maths_reward
    rng = random.Random(3)
    vals = _values(rng)
    pairs = [(v, v) for v in vals] + [(v, v + Fraction(1, 10 ** rng.randint(1, 40))) for v in vals]
    pairs += [(Fraction(123456789012345678901234567890 * 10 + 5, 10),
               Fraction(123456789012345678901234567890 * 10 + 4, 10))]
    for a, b in pairs:
        got = rng.choice(_written(a, rng))
        want = rng.choice(_written(b, rng))
        assert maths_reward(f"so\n#### {got}", want) == float(a == b), (got, want)


def test_a_hint_leaks_exactly_when_a_number_in_it_is_the_answer():
    """SCoRe's guidance reward is -1 for a hint that states the answer (``score_warm.leaks_answer``): a number
    in the hint that the maths verifier would accept as the answer, however it is written."""
    from types import SimpleNamespace

    from dstrain.rewards.maths import maths_reward
    from dstrain.trainers.score_warm import leaks_answer
    rng = random.Random(11)
    vals = [Fraction(1000), Fraction(-1234567), Fraction(1, 2), Fraction(-3, 4), Fraction(2, 3), Fraction(25, 2),
            Fraction(7), Fraction(10 ** 9 + 7), Fraction(-5, 8)] + _values(rng)[13:25]
    for a in vals:
        answer = rng.choice(_written(a, rng))
        task = SimpleNamespace(kind="maths", answer=answer)
        other = a + Fraction(rng.choice([1, -1]), rng.choice([1, 3, 10, 1000]))
        for form in _written(a, rng):
            assert maths_reward(f"#### {form}", answer) == 1.0  # the verifier accepts it as the answer ...
            assert leaks_answer(task, f"Hint: it is {form}."), (answer, form)  # ... so the hint states it
            for wrong in _written(other, rng):
                assert leaks_answer(task, f"Hint: not {wrong}, but {form}."), (answer, wrong, form)
        for wrong in _written(other, rng):
            assert not leaks_answer(task, f"Hint: it is {wrong}."), (answer, wrong)
    assert not leaks_answer(SimpleNamespace(kind="code", answer="5"), "it is 5")


# ---------------------------------------------------------------- Sudoku: exhaustive and naive references

_BOX = {4: (2, 2), 6: (2, 3), 9: (3, 3)}


def _units(n: int) -> list[list[int]]:
    br, bc = _BOX[n]
    rows = [[r * n + c for c in range(n)] for r in range(n)]
    cols = [[r * n + c for r in range(n)] for c in range(n)]
    boxes = [[(R * br + r) * n + C * bc + c for r in range(br) for c in range(bc)]
             for R in range(n // br) for C in range(n // bc)]
    return rows + cols + boxes


def _valid(grid, n: int) -> bool:
    return all(sorted(int(grid[i]) for i in unit) == list(range(1, n + 1)) for unit in _units(n))


def _naive_count(puzzle, n: int, limit: int) -> int:
    """Solutions of ``puzzle`` by row-major backtracking, each digit checked against its row, column, box."""
    grid = [int(x) for x in puzzle]
    units = _units(n)
    peers = [set() for _ in range(n * n)]
    for unit in units:
        for i in unit:
            peers[i].update(j for j in unit if j != i)
    for i, d in enumerate(grid):
        if d and any(grid[j] == d for j in peers[i]):
            return 0
    blanks = [i for i, d in enumerate(grid) if d == 0]
    count = 0

    def go(k):
        nonlocal count
        if count >= limit:
            return
        if k == len(blanks):
            count += 1
            return
        i = blanks[k]
        for d in range(1, n + 1):
            if all(grid[j] != d for j in peers[i]):
                grid[i] = d
                go(k + 1)
                grid[i] = 0

    go(0)
    return count


def _all_4x4() -> np.ndarray:
    """Every valid 4x4 grid, rows chosen among the 24 permutations, columns and boxes checked."""
    perms = list(itertools.permutations(range(1, 5)))
    out = []
    for rows in itertools.product(perms, repeat=4):
        if all(len({rows[r][c] for r in range(4)}) == 4 for c in range(4)):
            g = np.array(rows).reshape(16)
            if _valid(g, 4):
                out.append(g)
    return np.array(out)


@pytest.fixture(scope="module")
def grids4():
    return _all_4x4()


def test_four_by_four_solver_and_count_equal_the_enumeration(grids4):
    from dstrain.data import sudoku
    assert len(grids4) == 288  # the known number of 4x4 Sudoku grids
    assert all(sudoku.is_solution(g) for g in grids4)
    rng = np.random.default_rng(0)
    for _ in range(300):
        g = grids4[rng.integers(len(grids4))].copy()
        kind = rng.integers(3)
        if kind == 0:  # a sub-puzzle of a valid grid
            p = np.where(rng.random(16) < rng.random(), 0, g)
        elif kind == 1:  # arbitrary givens, often clashing
            p = np.where(rng.random(16) < 0.75, 0, rng.integers(1, 5, 16))
        else:  # a valid grid with two cells of a row swapped: no longer a solution
            r = rng.integers(4)
            a, b = rng.choice(4, 2, replace=False)
            g[[r * 4 + a, r * 4 + b]] = g[[r * 4 + b, r * 4 + a]]
            assert not _valid(g, 4) and not sudoku.is_solution(g)
            p = np.where(rng.random(16) < 0.3, 0, g)
        agreeing = grids4[((p == 0) | (grids4 == p)).all(1)]
        assert sudoku.count_solutions(p, limit=1000) == len(agreeing)
        assert sudoku.count_solutions(p) == min(2, len(agreeing))
        s = sudoku.solve(p)
        assert (s is None) == (len(agreeing) == 0)
        if s is not None:
            assert (agreeing == s).all(1).any()
            assert sudoku.agrees(p, s)


def test_fewest_clues_of_a_unique_four_by_four_is_four(grids4):
    """No choice of 3 cells pins a grid (every 3-clue pattern read off a grid fits another grid too); some
    choice of 4 does: ``MIN_CLUES[4]`` and ``max_blanks(4)`` are those counts."""
    from dstrain.data import sudoku

    def some_unique(k):
        for cells in itertools.combinations(range(16), k):
            _, counts = np.unique(grids4[:, list(cells)], axis=0, return_counts=True)
            if (counts == 1).any():
                return True
        return False

    assert not some_unique(3) and some_unique(4)
    assert sudoku.MIN_CLUES[4] == 4 and sudoku.max_blanks(4) == 12


@pytest.mark.parametrize("size,blanks", [(4, 0), (4, 7), (4, 12), (6, 14), (9, 30)])
def test_generated_puzzles_have_the_blanks_and_one_solution(size, blanks, grids4):
    from dstrain.data import sudoku
    puzzles, solutions = sudoku.generate_many(3, blanks, seed=size * 100 + blanks, size=size)
    for p, s in zip(puzzles, solutions):
        assert (p == 0).sum() == blanks and _valid(s, size)
        assert ((p == 0) | (p == s)).all()
        if size == 4:
            assert ((p == 0) | (grids4 == p)).all(1).sum() == 1
        else:
            assert _naive_count(p, size, 3) == 1
        more = p.copy()
        more[np.flatnonzero(more)[: size + 3]] = 0  # blank some givens: the count moves, both agree
        assert sudoku.count_solutions(more, limit=3) == _naive_count(more, size, 3)


def test_augmentation_permutes_the_valid_grids_and_keeps_puzzles(grids4):
    from dstrain.data import sudoku
    rng = np.random.default_rng(5)
    as_set = {tuple(g) for g in grids4}
    for _ in range(12):
        cell_map, digit_map = sudoku.random_transform(rng, 4)
        assert sorted(cell_map) == list(range(16)) and sorted(digit_map[1:]) == [1, 2, 3, 4] and digit_map[0] == 0
        images = {tuple(sudoku.apply_transform(g, cell_map, digit_map)) for g in grids4}
        assert images == as_set  # a bijection of the valid grids onto themselves
    for size, blanks in ((6, 16), (9, 35)):
        p, s = sudoku.generate(blanks, rng, size=size)
        for _ in range(4):
            p2, s2 = sudoku.augment(p, s, rng)
            assert _valid(s2, size) and (p2 == 0).sum() == blanks
            assert ((p2 == 0) | (p2 == s2)).all()
            assert _naive_count(p2, size, 2) == 1
    for size in (4, 6, 9):
        p, s = sudoku.generate(size, rng, size=size)
        inputs, labels = sudoku.encode(p[None], s[None])
        assert (sudoku.decode(inputs)[0] == p).all() and (labels[0] == s + 1).all()
        assert ((inputs[0] == 1) == (p == 0)).all()


def _rounds(puzzle, n: int) -> int:
    """The docstring's rule as loops: each round, from the same grid, fill every blank with one candidate left
    and every digit with one place left in a unit; -1 when a round fills nothing."""
    grid = [int(x) for x in puzzle]
    units = _units(n)
    rounds = 0
    while 0 in grid:
        cand = {}
        for i in range(n * n):
            if grid[i] == 0:
                seen = {grid[j] for u in units if i in u for j in u}
                cand[i] = [d for d in range(1, n + 1) if d not in seen]
        fill = {}
        for i, ds in cand.items():
            if len(ds) == 1:
                fill[i] = ds[0]
        for u in units:
            for d in range(1, n + 1):
                places = [i for i in u if i in cand and d in cand[i]]
                if len(places) == 1:
                    fill[places[0]] = d
        if not fill:
            return -1
        for i, d in fill.items():
            grid[i] = d
        rounds += 1
    return rounds


def test_propagation_rounds_follow_the_documented_rule():
    from dstrain.data import sudoku
    seen = set()
    for size, blanks, seed in ((4, 10, 1), (6, 20, 2), (9, 45, 3), (9, 52, 4)):
        puzzles, _ = sudoku.generate_many(4, blanks, seed=seed, size=size)
        for p in puzzles:
            want = _rounds(p, size)
            assert sudoku.propagation_rounds(p) == want
            seen.add(want)
    assert len(seen) > 2  # several depths (and possibly stalls), not one trivial case


# ---------------------------------------------------------------- dense GPT: float64 forward by hand


def _layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + (0.0 if b is None else b)


_erf = np.vectorize(math.erf)


def _gpt_by_hand(sd: dict, ids: np.ndarray, n_layer: int, n_head: int) -> np.ndarray:
    W = {k: v.detach().double().numpy() for k, v in sd.items()}
    get = W.get
    b, t = ids.shape
    c = W["tok_emb.weight"].shape[1]
    dh = c // n_head
    x = W["tok_emb.weight"][ids] + W["pos_emb.weight"][:t][None]
    for layer in range(n_layer):
        p = f"blocks.{layer}."
        h = _layer_norm(x, W[p + "ln_1.weight"], get(p + "ln_1.bias"))
        qkv = h @ W[p + "attn.qkv.weight"].T + get(p + "attn.qkv.bias", 0.0)
        q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
        y = np.zeros_like(q)
        for bi in range(b):
            for hd in range(n_head):
                sl = slice(hd * dh, (hd + 1) * dh)
                for i in range(t):
                    s = np.array([q[bi, i, sl] @ k[bi, j, sl] / math.sqrt(dh) for j in range(i + 1)])
                    w = np.exp(s - s.max())
                    w /= w.sum()
                    y[bi, i, sl] = sum(w[j] * v[bi, j, sl] for j in range(i + 1))
        x = x + y @ W[p + "attn.out_proj.weight"].T + get(p + "attn.out_proj.bias", 0.0)
        h = _layer_norm(x, W[p + "ln_2.weight"], get(p + "ln_2.bias"))
        u = h @ W[p + "mlp.up_proj.weight"].T + get(p + "mlp.up_proj.bias", 0.0)
        u = 0.5 * u * (1.0 + _erf(u / math.sqrt(2.0)))
        x = x + u @ W[p + "mlp.down_proj.weight"].T + get(p + "mlp.down_proj.bias", 0.0)
    x = _layer_norm(x, W["ln_f.weight"], get("ln_f.bias"))
    return x @ W["lm_head.weight"].T


@pytest.mark.parametrize("bias", [False, True])
def test_gpt_logits_and_loss_equal_a_float64_forward_by_hand(bias):
    from models.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=12, n_layer=2, n_head=3, n_embd=24, vocab_size=37, bias=bias)
    model = GPT(cfg).eval()
    with torch.no_grad():  # gains, biases and weights away from their initial values
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if ("ln" in name or name.endswith("bias")) else 0.05))
    ids = torch.randint(0, 37, (2, 11))
    targets = torch.randint(0, 37, (2, 11))
    want = _gpt_by_hand(model.state_dict(), ids.numpy(), 2, 3)
    with torch.no_grad():
        got = model.double()(ids).numpy()
    assert np.abs(got - want).max() < 1e-10 * max(1.0, np.abs(want).max())
    z = want - want.max(-1, keepdims=True)
    nll = -(z - np.log(np.exp(z).sum(-1, keepdims=True)))
    loss = float(np.take_along_axis(nll, targets.numpy()[..., None], -1).mean())
    model = model.float()
    with torch.no_grad():
        assert float(model(ids, targets)) == pytest.approx(loss, rel=2e-6)
        model.config.loss_chunk = 5  # the chunked head (``linear_cross_entropy``): 22 tokens in chunks of 5
        assert float(model(ids, targets)) == pytest.approx(loss, rel=2e-6)


# ---------------------------------------------------------------- DeepSpeed's OneCycle per update


def _one_cycle(params: dict, k: int) -> float:
    """The lr of optimizer update k (0-based: k updates already taken). Over ``first`` updates it rises
    linearly from ``cycle_min_lr`` to ``cycle_max_lr``, over the next ``second`` it falls back to the minimum,
    reached at update ``first + second``; from there it decays as ``min / (1 + rate * (k - first - second) /
    decay_step_size)`` (no decay rate or step size: it stays at the minimum)."""
    lo, hi = params["cycle_min_lr"], params["cycle_max_lr"]
    first = params["cycle_first_step_size"]
    second = params.get("cycle_second_step_size") or first
    if k <= first:
        return lo + (hi - lo) * k / first
    if k < first + second:
        return lo + (hi - lo) * (first + second - k) / second
    size, rate = params.get("decay_step_size", 0), params.get("decay_lr_rate", 0.0)
    if not size or not rate:
        return lo
    return lo / (1 + rate * (k - first - second) / size)


@pytest.mark.parametrize("params,resume_at", [
    ({"cycle_min_lr": 1e-5, "cycle_max_lr": 4e-4, "cycle_first_step_size": 3, "decay_lr_rate": 0.5,
      "decay_step_size": 2, "cycle_momentum": False}, 4),
    ({"cycle_min_lr": 2e-5, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2, "cycle_second_step_size": 5,
      "decay_lr_rate": 0.1, "decay_step_size": 1, "cycle_momentum": False}, 8),
    ({"cycle_min_lr": 1e-4, "cycle_max_lr": 3e-4, "cycle_first_step_size": 4, "cycle_momentum": False}, 1),
])
@pytest.mark.parametrize("gas", [1, 3])
def test_deepspeed_one_cycle_per_update_under_accumulation_and_resume(params, resume_at, gas):
    from deepspeed.runtime.lr_schedules import OneCycle

    from tests.unit.test_reference_round7 import _applied_and_logged
    updates = 14
    applied, logged = _applied_and_logged(lambda opt: OneCycle(opt, **params), gas, updates, resume_at)
    expected = [_one_cycle(params, k) for k in range(updates)]
    assert applied == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert logged == pytest.approx(expected, rel=1e-12, abs=1e-18)


# ---------------------------------------------------------------- the policy's supervised warm-start batch


def test_supervised_batch_loss_is_the_token_mean_of_each_row_alone():
    from dstrain.trainers.policy_rl import supervised_batch
    from models import registry
    from models.policy import PolicyConfig, build_policy, byte_tokenizer
    from models.policy.tokenizer import encode_prompt
    tok = byte_tokenizer()
    torch.manual_seed(1)
    model = build_policy(PolicyConfig(**registry.get_spec("policy").sizes["tiny"])).double().eval()
    prompts = ["Add 2 and 3.", "Q: the capital of France?\nA:", "x"]
    targets = [" 5", " Paris, of course.", " yes, a much longer answer than the others\n"]
    x, y = supervised_batch(tok, prompts, targets)
    loss = model(x, y)
    loss.backward()
    got_grad = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    terms = []  # -log p(target token | everything before it), each row alone and unpadded
    for p, t in zip(prompts, targets):
        pi = encode_prompt(tok, p)
        ti = tok(t, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([pi + ti])
        logits = model(ids)[0]
        for j, token in enumerate(ti):
            pos = len(pi) + j - 1  # the logits that predict position len(pi) + j
            row = logits[pos]
            terms.append(torch.logsumexp(row, 0) - row[token])
    assert len(terms) == sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in targets)
    want = torch.stack(terms).mean()
    want.backward()
    # the model's loss is taken in fp32 (its docstring): float64 weights and logits, fp32 cross-entropy
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got_grad[n], p.grad, rtol=1e-5, atol=1e-7), n


# ---------------------------------------------------------------- the dilated LM: float64 forward by hand


def _dilated_lm_by_hand(sd: dict, ids: np.ndarray, n_layer: int, n_head: int, branches, causal=True):
    """GPT blocks with LongNet's attention: query i of head h takes part in branch (w, r) when
    ``(i mod w) mod r == h mod r``, and attends there to the selected keys j of its segment (``j // w == i // w``,
    ``j <= i`` when causal); every (branch, key) pair of a query enters one softmax."""
    W = {k: v.detach().double().numpy() for k, v in sd.items()}
    get = W.get
    b, t = ids.shape
    c = W["tok_emb.weight"].shape[1]
    dh = c // n_head
    x = W["tok_emb.weight"][ids] + W["pos_emb.weight"][:t][None]
    for layer in range(n_layer):
        p = f"blocks.{layer}."
        h = _layer_norm(x, W[p + "ln_1.weight"], get(p + "ln_1.bias"))
        q, k, v = (h @ W[p + f"attn.{n}_proj.weight"].T + get(p + f"attn.{n}_proj.bias", 0.0) for n in "qkv")
        y = np.zeros_like(q)
        for bi in range(b):
            for hd in range(n_head):
                sl = slice(hd * dh, (hd + 1) * dh)
                for i in range(t):
                    pairs = [j for w, r in branches if (i % w) % r == hd % r
                             for j in range(t) if j // w == i // w and (j % w) % r == hd % r
                             and (j <= i or not causal)]
                    if not pairs:
                        continue
                    s = np.array([q[bi, i, sl] @ k[bi, j, sl] / math.sqrt(dh) for j in pairs])
                    wts = np.exp(s - s.max())
                    wts /= wts.sum()
                    y[bi, i, sl] = sum(wt * v[bi, j, sl] for wt, j in zip(wts, pairs))
        x = x + y @ W[p + "attn.out_proj.weight"].T + get(p + "attn.out_proj.bias", 0.0)
        h = _layer_norm(x, W[p + "ln_2.weight"], get(p + "ln_2.bias"))
        u = h @ W[p + "mlp.up_proj.weight"].T + get(p + "mlp.up_proj.bias", 0.0)
        u = 0.5 * u * (1.0 + _erf(u / math.sqrt(2.0)))
        x = x + u @ W[p + "mlp.down_proj.weight"].T + get(p + "mlp.down_proj.bias", 0.0)
    x = _layer_norm(x, W["ln_f.weight"], get("ln_f.bias"))
    return x @ W["lm_head.weight"].T


@pytest.mark.parametrize("t,causal", [(16, True), (12, True), (5, True), (16, False)])
def test_dilated_lm_logits_equal_longnets_definition_by_hand(t, causal):
    """Heads split by ``view(b, t, H, D)`` (head h: features h D .. (h + 1) D - 1), each head's offsets, the
    padding of a sequence the segments do not tile (12 and 5 tokens), bias and gains away from their init."""
    from models.dilated_lm.model import DilatedLM, DilatedLMConfig
    torch.manual_seed(2)
    segs, rates = [4, 8, 16], [1, 2, 4]
    cfg = DilatedLMConfig(n_layer=2, n_embd=24, n_head=3, block_size=16, segment_lengths=segs,
                          dilation_rates=rates, vocab_size=40, bias=True, causal=causal)
    model = DilatedLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if ("ln" in name or name.endswith("bias")) else 0.05))
    ids = torch.randint(0, 40, (2, t))
    want = _dilated_lm_by_hand(model.state_dict(), ids.numpy(), 2, 3, list(zip(segs, rates)), causal)
    with torch.no_grad():
        got = model.double()(ids).numpy()
    assert got.shape == (2, t, 64)  # the vocabulary padded to a multiple of 64
    assert np.abs(got - want).max() < 1e-10 * max(1.0, np.abs(want).max())


# ---------------------------------------------------------------- HRM: ACT exploration's halting law


def test_hrm_exploration_halts_with_the_reference_law():
    """The HRM reference draws, at every segment in training, a minimum of steps: 0 with probability ``1 - p``,
    else uniform on ``2 .. M``; a row halts when the Q-head says halt and its step count reaches the minimum,
    or at ``M``. With the Q-head always saying halt, segment s halts a row still running with probability
    ``h_1 = 1 - p`` and ``h_s = 1 - p + p (s - 1) / (M - 1)`` after, so the first halt falls on s with
    probability ``h_s prod_{u < s} (1 - h_u)``: compared over 1200 rows within 5 binomial standard deviations
    (and exactly: never before the Q-head allows, always by M)."""
    from models import registry
    from models.hrm.model import HRM
    M, p, B = 5, 0.4, 1200
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": M, "halt_exploration_prob": p, "seq_len": 3,
                                                     "hidden_size": 8, "num_heads": 1, "H_cycles": 1,
                                                     "L_cycles": 1, "mlp_multiple_of": 8})
    torch.manual_seed(0)
    model = HRM(cfg).train()
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(1, 11, (B, cfg.seq_len), generator=g)
    labels = torch.randint(2, 11, (B, cfg.seq_len), generator=g)
    emb = torch.zeros(B, cfg.puzzle_emb_len * cfg.hidden_size)
    for bias, expect_all_at_M in (([5.0, -5.0], False), ([-5.0, 5.0], True)):
        with torch.no_grad():
            model.q_head.weight.zero_()
            model.q_head.bias.copy_(torch.tensor(bias))
        first = torch.zeros(B, dtype=torch.int64)
        z = (None, None, None)
        with torch.no_grad():
            for s in range(1, M + 1):
                _, out = model(inputs, labels, emb, *z, None)
                z = (out["z_H"], out["z_L"], out["steps"])
                assert (out["steps"] == s).all()
                first = torch.where((first == 0) & out["halted"], torch.full_like(first, s), first)
        assert (first > 0).all()  # every row has halted by M
        counts = torch.bincount(first, minlength=M + 1)[1:].double()
        if expect_all_at_M:  # the Q-head never says halt: only the cap stops a row
            assert counts.tolist() == [0.0] * (M - 1) + [float(B)]
            continue
        running, probs = 1.0, []
        for s in range(1, M + 1):
            h = 1 - p if s == 1 else 1 - p + p * (s - 1) / (M - 1)
            probs.append(running * h)
            running *= 1 - h
        probs = torch.tensor(probs, dtype=torch.float64)
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-12)
        sigma = (B * probs * (1 - probs)).sqrt()
        assert ((counts - B * probs).abs() <= 5 * sigma + 1e-9).all(), (counts.tolist(), (B * probs).tolist())
