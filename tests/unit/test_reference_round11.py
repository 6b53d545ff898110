"""Round 11 of the independent references: each quantity recomputed from its definition (plain loops,
float64, a hand-timed clock), never through dstrain's helpers for the expected value.

Compared here:

* HRM's evaluation metrics (``trainers.hrm.evaluate_rows``, what ``val/`` logs and ``summary.json`` reports)
  against the HRM reference's definitions recomputed in float64 from the logits and Q logits of each
  puzzle's last segment: ``accuracy`` the mean over puzzles with a label of their labelled cells' accuracy,
  ``exact_accuracy`` all blanks right (dstrain's documented rule), ``q_halt_accuracy`` whether
  ``q_halt >= 0`` agrees with every labelled cell being right, ``steps``, and the losses per puzzle (a puzzle
  with no label counted in the losses, not in the ratios), puzzles not a multiple of the batch;
* GRPO's logged token entropy: the mean over the trained completion tokens (rows of weight 0 and padding
  left out) of the entropy of ``softmax(logits / T)`` at the position that predicts each token, on packed
  rows of ragged prompt and completion lengths (``generation.pack``);
* GRPO's throughput figures over a log window (``gen_tokens_per_s``, ``train_tokens_per_s``) against tokens
  over seconds on a hand-timed clock: the rows' tokens without their padding, ``num_iterations`` times,
  over the training phase; the window's total tokens over its total seconds;
* HRM's ``segments_per_s`` over a log window on a hand-timed clock: the puzzles' segments over the
  window's seconds less the evaluation and checkpoint time in it (as the LM trainer's meter leaves it out);
* DAPO's dynamic-sampling bookkeeping (``dapo.GroupFiller``, ``dapo.KeepRate``) against the documented
  rules walked by hand: which groups are kept, surplus, spare or dropped, the fillers, the next round's
  size and the logged fractions, and the moving average of the informative share with its floor;
* the code reward with partial credit (``rewards.code.score_tasks`` / ``summarize``) against each test
  run by hand: passed tests over all tests of a program whose tests fail in different ways (an assertion,
  an exception, a test that does not compile, a later test passing after a failed one).

Found and fixed:

* GRPO logged ``gen_tokens_per_s`` and ``train_tokens_per_s`` as the mean over the log window's steps of
  each step's rate: a step of 10 tokens in 0.5 s and one of 40 in 4 s logged 15 tokens/s for 50 tokens in
  4.5 s (11.1). The window's rates are now its total tokens over its total seconds
  (``rl_loop.window_stats``, which the policy-RL loop now logs; a one-step window is unchanged).
* HRM's ``segments_per_s`` counted the evaluation and the checkpoint save that follow a log step in the
  next window's seconds: with steps of 2 s, an evaluation of 7 s every 2 steps and a save of 3 s every 3,
  the windows after the first logged 0.86 and 1.09 segments/s for 3.0. That time is now left out, as the LM
  trainer leaves it out of tokens/s.

Pinned (deliberate): with ``num_iterations`` > 1 the training phase's seconds include the no-gradient
forward that takes the old log-probabilities, and its tokens are counted ``num_iterations`` times.
"""
from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
import torch


# --------------------------------------------------------------------------- HRM evaluation metrics
def _log_softmax(z: list[float]) -> list[float]:
    m = max(z)
    s = math.fsum(math.exp(x - m) for x in z)
    return [x - m - math.log(s) for x in z]


def _bce(x: float, y: float) -> float:
    return max(x, 0.0) - x * y + math.log1p(math.exp(-abs(x)))


def _eval_with_heads(model, inputs, labels, steps, batch):
    from dstrain.trainers.hrm import evaluate_rows
    seen = {"logits": [], "q": []}
    hooks = [model.lm_head.register_forward_hook(lambda m, i, o: seen["logits"].append(o.detach().double())),
             model.q_head.register_forward_hook(lambda m, i, o: seen["q"].append(o.detach().double()))]
    try:
        stats = evaluate_rows(model, steps, inputs, labels, batch=batch)
    finally:
        for h in hooks:
            h.remove()
    # one head call per segment (evaluation runs no target segment): each batch's last one
    return stats, torch.cat(seen["logits"][steps - 1::steps]), torch.cat(seen["q"][steps - 1::steps])


def test_hrm_evaluation_metrics_equal_the_reference_definitions():
    from tests.unit.test_reference_round5 import _hrm
    steps, n, L, V, blank = 3, 7, 8, 6, 1
    model = _hrm(seq_len=L, vocab_size=V, halt_max_steps=steps)
    g = torch.Generator().manual_seed(3)
    inputs = torch.randint(1, V, (n, L), generator=g).numpy()
    inputs[:, 0], inputs[:, 1] = blank, 3  # every puzzle: a blank cell and a given one
    _, logits, _ = _eval_with_heads(model, inputs, inputs.copy(), steps, 3)
    preds = logits.argmax(-1).numpy()  # labels do not change the predictions: craft them from these
    labels = torch.randint(2, V, (n, L), generator=g).numpy()
    labels[0] = preds[0]                                                      # all right
    labels[1] = preds[1]
    labels[1, 1] = preds[1, 1] % 4 + 2                                        # a given wrong, the blanks right
    labels[2] = preds[2]
    labels[2, 0] = preds[2, 0] % 4 + 2                                        # a blank wrong
    labels[3] = -100                                                          # nothing labelled
    labels[4] = np.where(inputs[4] == blank, preds[4], -100)                  # givens masked, blanks right
    labels[5, 2:] = -100
    stats, logits, q = _eval_with_heads(model, inputs, labels, steps, 3)

    rows = []
    for i in range(n):
        z = logits[i].tolist()
        kept = [t for t in range(L) if labels[i, t] != -100]
        pred = [max(range(V), key=lambda v: z[t][v]) for t in range(L)]
        lm = math.fsum(-_log_softmax(z[t])[labels[i, t]] for t in kept) / max(len(kept), 1)
        right = sum(pred[t] == labels[i, t] for t in kept)
        solved = right == len(kept)
        q_halt = q[i, 0].item()
        rows.append(dict(counted=bool(kept), accuracy=right / max(len(kept), 1),
                         exact=all(pred[t] == labels[i, t] for t in range(L) if inputs[i, t] == blank),
                         q_right=(q_halt >= 0) == solved, lm=lm, q_loss=_bce(q_halt, float(solved))))
    counted = [r for r in rows if r["counted"]]
    assert len(counted) == n - 1 and [r["exact"] for r in rows[:3]] == [True, True, False]
    expected = {"accuracy": sum(r["accuracy"] for r in counted) / len(counted),
                "exact_accuracy": sum(r["exact"] for r in counted) / len(counted),
                "q_halt_accuracy": sum(r["q_right"] for r in counted) / len(counted),
                "steps": float(steps),
                "lm_loss": sum(r["lm"] for r in rows) / n,
                "q_halt_loss": sum(r["q_loss"] for r in rows) / n,
                "loss": sum(r["lm"] + 0.5 * r["q_loss"] for r in rows) / n}
    assert set(stats) == set(expected)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key


# --------------------------------------------------------------------------- GRPO entropy and throughput
def _packed(seed: int, lengths):
    from models.policy.generation import Completion, pack
    g = torch.Generator().manual_seed(seed)
    comps = [Completion(i, 0, torch.randint(1, 11, (p,), generator=g).tolist(),
                        torch.randint(1, 11, (c,), generator=g).tolist(), "", True)
             for i, (p, c) in enumerate(lengths)]
    return comps, pack(comps, 0)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_grpo_entropy_and_window_throughput_equal_tokens_over_hand_timed_seconds(monkeypatch, tmp_path,
                                                                                    num_iterations):
    import dstrain.trainers.grpo as grpo
    import dstrain.trainers.grpo_sampling as gs
    from dstrain.trainers.rl_loop import window_stats
    from tests.unit.test_grpo_dapo import fake_step_trainer
    clock, temperature, tick = _Clock(), 0.7, 1.5
    monkeypatch.setattr(grpo, "time", clock)
    # (prompt, completion) lengths, row weights, grad_accum, generation seconds and tokens of two steps
    steps = [([(3, 4), (5, 1), (2, 6), (4, 2)], [1.0, 0.0, 1.0, 1.0], 2, 0.5, 10),
             ([(1, 2), (6, 3), (2, 2), (3, 5)], [1.0, 1.0, 1.0, 0.0], 4, 4.0, 40)]
    records, train_tokens, train_seconds = [], 0, 0.0
    for s, (lengths, weights, accum, gen_s, gen_tokens) in enumerate(steps):
        comps, batch = _packed(s, lengths)
        weights = torch.tensor(weights)
        sb = gs.StepBatch(batch, torch.randn(4) * weights, weights, {}, {"generation": gen_s, "reward": 0.0},
                          gen_tokens)
        tr = fake_step_trainer("dapo", sb, accum)
        tr.task = type(tr.task)(loss_type="dapo", max_new_tokens=8, temperature=temperature,
                                num_iterations=num_iterations)
        model = tr.engine.module
        plain = model.forward

        def ticking(ids, attention_mask=None, plain=plain):  # each forward takes 1.5 s on the clock
            clock.now += tick
            return plain(ids, attention_mask)

        model.forward = ticking
        with torch.no_grad():
            logits = plain(batch["input_ids"]).double() / temperature
        total, count = 0.0, 0
        for i, c in enumerate(comps):
            if weights[i] == 0:
                continue
            p, end = len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)
            for t in range(p - 1, end - 1):  # position t predicts token t + 1: the completion's tokens
                logp = _log_softmax(logits[i, t].tolist())
                total += -math.fsum(math.exp(x) * x for x in logp)
                count += 1
        out = tr.train_step(0)
        assert out["entropy"] == pytest.approx(total / count, rel=1e-6)
        tokens = sum(p + c for p, c in lengths) * num_iterations  # no padding
        forwards = accum * num_iterations + (accum if num_iterations > 1 else 0)  # + the old log-probs
        assert out["time/training"] == pytest.approx(tick * forwards)
        assert out["train_tokens_per_s"] == pytest.approx(tokens / (tick * forwards), rel=1e-12)
        train_tokens, train_seconds = train_tokens + tokens, train_seconds + tick * forwards
        records.append(out)
    stats = window_stats(records, grpo.GRPOTrainer.RATES)
    assert stats["gen_tokens_per_s"] == pytest.approx(50 / 4.5, rel=1e-12)  # not (10 / 0.5 + 40 / 4) / 2
    assert stats["train_tokens_per_s"] == pytest.approx(train_tokens / train_seconds, rel=1e-12)
    assert "gen_tokens" not in stats and "train_tokens" not in stats
    single = window_stats(records[:1], grpo.GRPOTrainer.RATES)
    assert single["gen_tokens_per_s"] == records[0]["gen_tokens_per_s"]
    logged = _logged_by_the_loop(grpo.GRPOTrainer, records, tmp_path)  # what the trainer's loop writes
    assert logged["train/gen_tokens_per_s"] == pytest.approx(50 / 4.5, rel=1e-12)
    assert logged["train/train_tokens_per_s"] == pytest.approx(train_tokens / train_seconds, rel=1e-12)
    assert "train/gen_tokens" not in logged and "train/train_tokens" not in logged


def _stub_run_parts(tr, tmp_path, steps: int, log_every: int, eval_every: int, every: int) -> None:
    """What a trainer's ``run`` reads besides its steps: one rank, no sinks but metrics.jsonl."""
    tr.cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(steps=steps, log_every=log_every, eval_every=eval_every, lr=1e-3),
        output=types.SimpleNamespace(tensorboard=False, progress=False),
        checkpoint=types.SimpleNamespace(every=every))
    tr.out, tr.start_step = tmp_path, 0
    tr.world = types.SimpleNamespace(rank=0, world_size=1, is_main=True)
    tr.task = types.SimpleNamespace(time_limit_s=0)
    tr.guards = types.SimpleNamespace(begin=lambda *a: None, settle=lambda *a: None, phase=lambda *a: None,
                                      stop_agreed=False, skipped=0, close=lambda: None)
    tr.stop = types.SimpleNamespace(set=False)
    tr.saver = types.SimpleNamespace(wait=lambda: None)
    tr.plan = types.SimpleNamespace(profile="zero0", precision="fp32")


def _logged_by_the_loop(cls, records, tmp_path) -> dict:
    tr = cls.__new__(cls)
    _stub_run_parts(tr, tmp_path, len(records), len(records), 0, 0)
    tr.pool, tr.samples_per_step, tr.rollouts = types.SimpleNamespace(close=lambda: None), 4, None
    tr.one_step = lambda step: dict(records[step])
    tr.evaluate = lambda step: {"pass_at_1": 0.0}
    tr.save = lambda step: None
    tr.log_extras = lambda: {}
    tr.summary_extras = lambda: {}
    tr.run()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in lines if "train/loss" in r)


def test_hrm_segments_per_second_leave_evaluation_and_saving_out(monkeypatch, tmp_path):
    import dstrain.trainers.hrm as hrm
    clock = _Clock()
    monkeypatch.setattr(hrm, "time", clock)
    step_s, eval_s, save_s, global_batch = 2.0, 7.0, 3.0, 6
    tr = hrm.HRMTrainer.__new__(hrm.HRMTrainer)
    _stub_run_parts(tr, tmp_path, steps=6, log_every=2, eval_every=2, every=3)
    tr.global_batch, tr.sparse_opt, tr._batches = global_batch, None, None
    tr.engine = types.SimpleNamespace(lr=1e-3, grad_norm=None, train=lambda: None, nonfinite_check="sync",
                                      device=torch.device("cpu"))

    def train_step(step):
        clock.now += step_s
        one = torch.ones(())
        return one, {"rows": one * global_batch, "count": one, "lm_loss": one}

    def evaluate():
        clock.now += eval_s
        return {"loss": 1.0}

    def save(step):
        clock.now += save_s

    tr.train_step, tr.evaluate, tr.save = train_step, evaluate, save
    tr.run()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rates = [r["train/segments_per_s"] for r in records if "train/segments_per_s" in r]
    assert rates == [pytest.approx(2 * global_batch / (2 * step_s), rel=1e-12)] * 3  # each window: 2 steps


# --------------------------------------------------------------------------- DAPO's dynamic-sampling bookkeeping
def _filler_by_hand(needed: int, G: int, carry_limit: int, rounds, carried):
    """The documented rules walked group by group: kept while short, then surplus (the first carry_limit
    spare), the others dropped (the first needed groups' rows remembered as fillers); the carried groups
    join after the first round; the next round's size after each round."""
    kept, fillers, spare = [], [], []
    generated = dropped = surplus = n_carried = 0
    sizes = []
    for k, rewards in enumerate(rounds):
        for g in range(len(rewards) // G):
            group = rewards[g * G:(g + 1) * G]
            generated += 1
            items = [("item", k, g, j) for j in range(G)]
            if len(set(group)) > 1:
                if len(kept) < needed:
                    kept.append((group, items))
                else:
                    surplus += 1
                    if len(spare) < carry_limit:
                        spare.append((group, items))
            else:
                dropped += 1
                if len(fillers) < needed:
                    fillers.append(items)
        if k == 0:
            for group in carried:
                if len(kept) < needed:
                    kept.append((group, [("carried", j) for j in range(G)]))
                    n_carried += 1
        deficit = needed - len(kept)
        informative_share = max((generated - dropped) / max(generated, 1), 0.1)
        sizes.append(0 if deficit <= 0 else min(needed, math.ceil(deficit / informative_share)))
    stats = {"dropped_fraction": dropped / max(generated, 1), "rounds": float(len(rounds)),
             "filled_fraction": len(kept) / needed, "generated_groups": float(generated),
             "surplus_groups": float(surplus)}
    if carry_limit or n_carried:
        stats.update(carried_groups=float(n_carried), spare_groups=float(len(spare)))
    return kept, fillers, spare, sizes, stats


def test_dynamic_sampling_bookkeeping_follows_its_documented_rules():
    from dstrain.rl.dapo import GroupFiller, KeepRate
    rng = np.random.default_rng(11)
    for trial in range(60):
        G = int(rng.integers(1, 5))
        needed, carry_limit = int(rng.integers(1, 6)), int(rng.integers(0, 3))
        rounds = [rng.choice([0.0, 0.5, 1.0], size=G * int(rng.integers(0, 7)), p=[0.5, 0.1, 0.4]).tolist()
                  for _ in range(int(rng.integers(1, 4)))]
        carried = [[0.0] * (G - 1) + [1.0] for _ in range(int(rng.integers(0, 3)))] if G > 1 else []
        kept, fillers, spare, sizes, stats = _filler_by_hand(needed, G, carry_limit, rounds, carried)
        f = GroupFiller(needed=needed, group_size=G, carry_limit=carry_limit)
        got_sizes = []
        for k, rewards in enumerate(rounds):
            items = [("item", k, i // G, i % G) for i in range(len(rewards))]
            f.add(torch.tensor(rewards, dtype=torch.float32), items)
            if k == 0:
                for group in carried:
                    if f.deficit > 0:
                        f.add_carried(group, [("carried", j) for j in range(G)])
            got_sizes.append(f.next_count())
        assert f.kept_rewards == [r for group, _ in kept for r in group], trial
        assert f.kept_items == [i for _, items in kept for i in items], trial
        assert f.filler_items == [i for items in fillers for i in items], trial
        assert f.spare_items == [i for _, items in spare for i in items], trial
        assert got_sizes == sizes, trial
        assert f.stats() == pytest.approx(stats, rel=1e-15), trial

    rate, ema = KeepRate(rate=0.5, weight=0.3, floor=0.05), 0.5
    for informative, generated in [(3, 10), (0, 8), (0, 8), (0, 8), (0, 0), (0, 9), (8, 8)]:
        if generated:
            ema = max(0.05, 0.7 * ema + 0.3 * informative / generated)
        assert rate.update(informative, generated) == pytest.approx(ema, rel=1e-15)


# --------------------------------------------------------------------------- code reward with partial credit
def _passes_by_hand(program: str, setup: str, tests) -> tuple[int, bool]:
    """(tests that pass, whether the program and setup ran) with each test run on its own, in plain Python."""
    ns: dict = {}
    try:
        exec(compile(program, "<program>", "exec"), ns)
        exec(compile(setup, "<setup>", "exec"), ns)
    except Exception:
        return 0, False
    passed = 0
    for test in tests:
        try:
            exec(compile(test, "<test>", "exec"), ns)
        except Exception:  # a failed assertion, an exception, a test that does not compile
            continue
        passed += 1
    return passed, True


def test_partial_credit_is_the_share_of_tests_that_pass_each_run_by_hand():
    from dstrain.data.tasks import Task
    from dstrain.rewards.code import evaluate_tasks, score_tasks, summarize
    from dstrain.rewards.sandbox import SandboxLimits, SandboxPool
    tests = ("assert f(1) == 2", "assert f(2) == 5", "assert f(3) == 4", "assert g(1) == 0",
             "assert f(4) ==", "assert f(0) == 1", "assert OFFSET + f(0) == 11", "assert f(-1) == 0")
    task = Task(task_id="t", prompt="def f(x):\n", kind="code", tests=tests, setup="OFFSET = 10",
                code_prefix="def f(x):\n")
    maths = Task(task_id="m", prompt="2 + 2?", kind="maths", answer="4")
    completions = ["    return x + 1\n",                     # every test that can pass
                   "    return x * x + 1 if x > 1 else x + 1\n",
                   "    return abs(x) + 1\n",
                   "    return 1 // x\n",                     # runs, but no test passes
                   "    return x +\n"]                        # does not compile
    tasks = [task] * len(completions) + [maths, maths]
    completions += ["#### 4", "#### 5"]
    with SandboxPool(workers=2, limits=SandboxLimits(cpu_seconds=5, wall_seconds=20)) as pool:
        rewards = score_tasks(tasks, completions, pool, partial_credit=True)
        plain = score_tasks(tasks, completions, pool)
        results = evaluate_tasks(tasks, completions, pool)
    expected, statuses = [], []
    for completion in completions[:5]:
        passed, ran = _passes_by_hand(task.code_prefix + completion, task.setup, tests)
        expected.append(passed / len(tests))
        statuses.append("error" if not ran else "passed" if passed == len(tests) else "failed")
    expected += [1.0, 0.0]
    statuses += ["passed", "failed"]
    assert [r.status for r in results] == statuses
    assert all(0 < e < 1 for e in expected[:3]) and expected[3:5] == [0.0, 0.0]  # failed (no test passes), error
    assert rewards == pytest.approx(expected, rel=1e-15)
    assert plain == [1.0 if s == "passed" else 0.0 for s in statuses]  # no test of the first passes them all
    stats = summarize(results, partial_credit=True)
    assert stats["reward"] == pytest.approx(sum(expected) / len(expected), rel=1e-15)
    assert {k: stats[k] for k in ("passed", "failed", "error")} == {
        k: float(statuses.count(k)) for k in ("passed", "failed", "error")}
