"""Round 14 of the independent references: each quantity recomputed from its definition (plain loops,
float64, the sampler's documented order), never through dstrain's helpers for the expected value.

Compared here:

* the LM trainer's validation loss (``LMTrainer.evaluate``: ``val/loss`` and ``summary.json``'s ``val_loss``)
  against the float64 mean of ``-log p(target)`` over the validation windows, each window once, computed token
  by token from a bigram table (the fake engine's model): a validation stream holding fewer windows than
  ``eval_batches x micro_batch x ranks`` (every window of the stream, the last batch ragged, a rank left with
  none), one holding more (the first windows of the epoch-0 permutation, as before), 1..3 data-parallel ranks
  and 2 sequence-parallel ranks simulated in one process; the pipeline engine's whole batches;
* where a resumed run's data order continues when ``data.seq_len`` changed (``LMTrainer._samples_at_this_length``)
  against the documented point ("the same point of the same epoch"), walked window by window: the checkpoint's
  epoch and the tokens its windows took of that epoch, then the new length's windows of that epoch that fit in
  them;
* the LM trainer's logged ``train/loss`` (``mean_of_taken``) against the mean over the taken steps of each step's
  loss (a skipped step, a NaN loss with a verdict of 0);
* HRM's logged ratio metrics (``summarise`` of the sums averaged over ranks) against the same metrics pooled over
  every halted puzzle of every rank, ranks halting different numbers of puzzles;
* GRPO's ``overlong_filtered`` under dynamic sampling (``grpo_sampling.dynamic_batch``) on 2 ranks simulated by
  threads whose collectives meet at a barrier, one rank keeping no group: the share of every rank's trained rows
  (rows of a kept group) that the overlong filter dropped;
* GRPO's ``kl``, ``clip_fraction`` and ``entropy`` (``GRPOTrainer.train_step``) on 2 such ranks, one whose rows all
  weigh 0: TRL's mean over every rank's micro-batch passes holding a trained token, and the token mean over every
  trained completion token of the step, recomputed in float64 from the logits of each forward.

Found and fixed:

* The validation loss wrapped the window order into a reshuffled second epoch when the validation stream held
  fewer than ``eval_batches x micro_batch x ranks`` windows, counting some windows twice: 5 windows at
  micro-batch 2, 4 batches, one rank, evaluated 8 windows (3 of them twice) and reported their mean, not the
  stream's. Each window is now evaluated once, the last batch ragged (a rank with none left runs one window at
  weight 0, which keeps ZeRO-3's gathers in step), the ranks' sums pooled; the pipeline engine, whose
  micro-batch shape is fixed, evaluates whole batches only.
* A resume with another ``data.seq_len`` continued ``samples x old // new`` samples in, counting tokens from the
  start of the data, while an epoch holds ``(tokens - 1) // seq_len`` windows: its tokens depend on the length,
  so the position drifted by up to a window an epoch and left the epoch it promised to stay in (a 1,001-token
  stream, 3 -> 7 tokens, the checkpoint one window before the end of epoch 9: sample 1,426, 6 windows into epoch
  10, for 1,420, the end of epoch 9). It now keeps the epoch and the tokens into it.
* GRPO's ``overlong_filtered`` and ``trained_zero_variance_groups`` under dynamic sampling were each rank's share of
  its own kept rows, and 0 on a rank that kept none (the sampling cap reached), then averaged over ranks: rank 0
  keeping nothing and rank 1 dropping 2 of its 8 rows logged 0.125 for 0.25. Both are now every rank's counts
  pooled (one all-reduce).
* GRPO's ``kl``, ``clip_fraction`` and ``entropy`` were each rank's means, a rank without a trained token logging 0
  for each, then averaged over ranks: with one such rank all three were halved (kl 1.066 for 2.133). The passes'
  sums, their count and the entropy's token sum are now pooled over the ranks (one all-reduce a step), so a rank
  without a token weighs nothing, as TRL's mean over processes skips its NaN.

Pinned (agreeing): ``train/loss`` and HRM's ratio metrics (the sums' ratio, whatever each rank halts).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dstrain.trainers import hrm as hrm_trainer
from dstrain.trainers import lm
from tests.unit.grpo_recording import RecordingSGD, next_token

VOCAB = 7


def _table(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


class BigramEngine:
    """A model whose logits at a position are ``table[input token]``; its loss the mean cross-entropy of the batch."""

    device = torch.device("cpu")

    def __init__(self, table: torch.Tensor):
        self.table, self.batches = table, []

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, x, y):
        self.batches.append(x.shape[0])
        logits = self.table[x.long()]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.long().reshape(-1))


class PipelineEngine(BigramEngine):
    is_pipeline = True

    def eval_batch(self, data_iter):
        (x, y), = list(data_iter)
        return float(self(x, y))


def _reference_token_loss(table: torch.Tensor, x: list[int], y: list[int]) -> list[float]:
    out = []
    for a, b in zip(x, y):
        row = [float(v) for v in table[a]]
        m = max(row)
        out.append(m + math.log(sum(math.exp(v - m) for v in row)) - row[b])
    return out


def _window(stream: list[int], i: int, seq: int) -> tuple[list[int], list[int]]:
    return stream[i * seq:i * seq + seq], stream[i * seq + 1:i * seq + seq + 1]


def _order(num_windows: int, seed: int) -> list[int]:
    """The sampler's documented epoch-0 order: randperm seeded with ``seed * 1_000_003``."""
    return torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 1_000_003)).tolist()


def _evaluate(stream, seq, micro, batches, dp_world, sp=1, engine_cls=BigramEngine, monkeypatch=None):
    """Every simulated rank's evaluate; the sums they all-reduce pooled by hand. Returns (loss, engines)."""
    table, sent, engines = _table(), [], []
    monkeypatch.setattr(lm.runtime, "all_reduce", lambda t, op="sum": sent.append(t.clone()) or t)
    for dp_rank in range(dp_world):
        for sp_rank in range(sp):
            tr = lm.LMTrainer.__new__(lm.LMTrainer)
            tr.cfg = SimpleNamespace(train=SimpleNamespace(eval_batches=batches, micro_batch=micro),
                                     data=SimpleNamespace(seq_len=seq, seed=11), parallel=SimpleNamespace(sp=sp))
            tr.val_tokens = torch.tensor(stream, dtype=torch.int16)
            tr.engine = engine_cls(table)
            tr.pipelined = engine_cls is PipelineEngine
            tr.dp_rank, tr.dp_world, tr.parallel = dp_rank, dp_world, SimpleNamespace(sp_rank=sp_rank)
            returned = tr.evaluate()
            engines.append(tr.engine)
    if dp_world * sp == 1:  # one rank: its own answer
        return returned, engines, table
    total = torch.stack(sent).sum(0)  # (loss x windows, windows) of each rank
    return total[0].item() / total[1].item(), engines, table


@pytest.mark.parametrize("tokens, seq, micro, batches, dp, sp", [
    (26, 5, 2, 4, 1, 1),    # 5 windows for a budget of 8: each once (before: 3 counted twice)
    (36, 5, 2, 2, 3, 1),    # 7 windows, 3 ranks x 2: the last batch holds 1, two ranks run theirs at weight 0
    (22, 4, 3, 1, 2, 2),    # 5 windows for 6, 2 sequence-parallel ranks of 2 tokens each
    (61, 4, 2, 9, 1, 1),    # 15 windows for 18: a ragged last batch of 1
])
def test_validation_loss_is_the_mean_over_every_window_once(monkeypatch, tokens, seq, micro, batches, dp, sp):
    stream = [(i * 5 + i // 3) % VOCAB for i in range(tokens)]
    windows = (tokens - 1) // seq
    assert windows < batches * micro * dp
    loss, engines, table = _evaluate(stream, seq, micro, batches, dp, sp, monkeypatch=monkeypatch)
    per_token = [v for i in range(windows) for v in _reference_token_loss(table, *_window(stream, i, seq))]
    assert loss == pytest.approx(sum(per_token) / len(per_token), rel=1e-12)
    assert len({len(e.batches) for e in engines}) == 1  # every rank runs as many forwards (ZeRO-3's gathers)
    assert max(b for e in engines for b in e.batches) <= micro


@pytest.mark.parametrize("dp", [1, 2])
def test_a_long_validation_stream_gives_the_first_windows_of_the_seeded_order(monkeypatch, dp):
    seq, micro, batches, tokens = 4, 2, 3, 121  # 30 windows, 12 or 24 evaluated
    stream = [(i * i + 3) % VOCAB for i in range(tokens)]
    loss, engines, table = _evaluate(stream, seq, micro, batches, dp, monkeypatch=monkeypatch)
    first = _order(30, 11)[:batches * micro * dp]
    per_token = [v for i in first for v in _reference_token_loss(table, *_window(stream, i, seq))]
    assert loss == pytest.approx(sum(per_token) / len(per_token), rel=1e-12)
    assert all(e.batches == [micro] * batches for e in engines)


def test_the_pipeline_engine_evaluates_whole_batches_of_distinct_windows(monkeypatch):
    seq, micro, batches, dp, tokens = 4, 2, 4, 2, 45  # 11 windows for a budget of 16: 2 whole batches of 4
    stream = [(i * 3 + i // 5) % VOCAB for i in range(tokens)]
    loss, engines, table = _evaluate(stream, seq, micro, batches, dp, engine_cls=PipelineEngine,
                                     monkeypatch=monkeypatch)
    first = _order(11, 11)[:8]
    per_token = [v for i in first for v in _reference_token_loss(table, *_window(stream, i, seq))]
    assert loss == pytest.approx(sum(per_token) / len(per_token), rel=1e-12)
    assert all(e.batches == [micro] * 2 for e in engines)


def _resumed_at(tmp_path, stream: int, saved: int, now: int, samples: int) -> int:
    import json
    tag = tmp_path / "step_00000001"
    tag.mkdir(exist_ok=True)
    (tag / "run_config.json").write_text(json.dumps({"data": {"seq_len": saved}}))
    tr = lm.LMTrainer.__new__(lm.LMTrainer)
    tr.ckpt_root, tr.world, tr.train_tokens = tmp_path, SimpleNamespace(is_main=False), range(stream)
    tr.cfg = SimpleNamespace(data=SimpleNamespace(seq_len=now))
    return tr._samples_at_this_length(tag.name, samples)


def _reference_resume_point(stream: int, saved: int, now: int, samples: int) -> int:
    """Walk the checkpoint's samples window by window (epoch, tokens taken of it), then the new length's windows."""
    epoch, taken, per_epoch = 0, 0, 0
    while (per_epoch + 1) * saved + 1 <= stream:
        per_epoch += 1  # windows of seq_len + 1 tokens sharing their boundary token
    for _ in range(samples):
        taken += saved
        if taken == per_epoch * saved:
            epoch, taken = epoch + 1, 0
    new_per_epoch = 0
    while (new_per_epoch + 1) * now + 1 <= stream:
        new_per_epoch += 1
    g = epoch * new_per_epoch
    while (g - epoch * new_per_epoch + 1) * now <= taken:  # the next window of the epoch ends within the tokens
        g += 1
    return g


@pytest.mark.parametrize("stream, saved, now, samples", [
    (1001, 3, 7, 3329),    # one window before the end of epoch 9 (before: 1426, in epoch 10)
    (1001, 3, 7, 333 * 40 + 100),
    (1001, 7, 3, 142 * 25 + 141),
    (5000, 64, 100, 78 * 6 + 30),
    (5000, 100, 64, 49 * 11),  # an epoch boundary
    (230_401, 128, 64, 900),   # within epoch 0: as many tokens in (unchanged)
])
def test_a_resume_with_another_seq_len_keeps_the_epoch_and_the_tokens_into_it(tmp_path, stream, saved, now, samples):
    expected = _reference_resume_point(stream, saved, now, samples)
    assert _resumed_at(tmp_path, stream, saved, now, samples) == expected
    old_windows, new_windows = (stream - 1) // saved, (stream - 1) // now
    assert expected // new_windows == samples // old_windows or expected % new_windows == 0


def test_logged_train_loss_is_the_mean_over_the_taken_steps():
    steps = [(torch.tensor(2.5), None), (torch.tensor(float("nan")), torch.tensor(0.0)),
             (torch.tensor(1.25), torch.tensor(1.0)), (torch.tensor(4.0), torch.tensor(0.0)),
             (torch.tensor(0.75), torch.tensor(1.0))]
    taken = [2.5, 1.25, 0.75]
    assert lm.mean_of_taken(steps) == {"loss": pytest.approx(sum(taken) / len(taken), rel=1e-7)}
    assert lm.mean_of_taken([(torch.tensor(3.0), torch.tensor(0.0))]) == {}


def test_hrm_ratio_metrics_pool_every_halted_puzzle_of_every_rank():
    # per rank: puzzles (rows), halted ones, and for each halted puzzle (cell accuracy, exact, q right, steps)
    ranks = [[(0.5, 0, 1, 3), (1.0, 1, 1, 2)], [(0.25, 0, 0, 4)], [], [(1.0, 1, 0, 1), (0.75, 0, 1, 2),
                                                                        (1.0, 1, 1, 4)]]
    rows = [4, 3, 2, 5]
    losses = [1.5, 0.5, 2.0, 1.0]  # each rank's summed loss over its rows
    sums = []
    for halted, n, loss in zip(ranks, rows, losses):
        sums.append({"rows": float(n), "count": float(len(halted)), "lm_loss": loss,
                     "accuracy": float(sum(h[0] for h in halted)), "exact_accuracy": float(sum(h[1] for h in halted)),
                     "q_halt_accuracy": float(sum(h[2] for h in halted)), "steps": float(sum(h[3] for h in halted))})
    reduced = {k: sum(s[k] for s in sums) / len(sums) for k in sums[0]}  # reduce_mean over the ranks
    out = hrm_trainer.summarise(reduced)
    pooled = [h for r in ranks for h in r]
    for j, key in enumerate(("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")):
        assert out[key] == pytest.approx(sum(h[j] for h in pooled) / len(pooled), rel=1e-12)
    assert out["lm_loss"] == pytest.approx(sum(losses) / sum(rows), rel=1e-12)
    assert out["halted_fraction"] == pytest.approx(len(pooled) / sum(rows), rel=1e-12)


class ThreadCollectives:
    """A stand-in for torch.distributed over threads (one per rank): all_reduce and all_gather meet at a barrier."""

    def __init__(self, world: int):
        import threading
        self.world, self.barrier, self.slots, self.local = world, threading.Barrier(world, timeout=30), {}, \
            threading.local()

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = t.clone()
        self.barrier.wait()
        parts = [self.slots[i] for i in range(self.world)]
        self.barrier.wait()
        return parts

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        stacked = torch.stack(self._exchange(t))
        return {"sum": stacked.sum(0), "max": stacked.max(0).values, "min": stacked.min(0).values}[op].to(t.dtype)

    def all_gather_1d(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t))


CUT = 9
"""The token a cut completion ends with (so that the reference can find the cut rows in the packed batch)."""


class RankRL:
    """Rank 0's policy answers every prompt right (no group informative: it keeps none); rank 1's answers right on
    even sample seeds, and the last completion of every group of 4 is cut at the token limit."""

    def __init__(self, rank: int):
        from tests.unit.test_grpo_dapo import FakeRL
        self.rank, self.pack = rank, FakeRL.pack

    def generate(self, model, tok, prompts, num_samples=1, seed=0, **kw):
        from models.policy import Completion
        out = []
        for i, _ in enumerate(prompts):
            right = self.rank == 0 or (seed + i) % 2 == 0
            cut = self.rank == 1 and i % 4 == 3
            out.append(Completion(i, 0, [5, 6], [7, 7, CUT if cut else 7], "right" if right else "wrong", not cut))
        return out


def test_grpo_overlong_filtered_under_dynamic_sampling_is_the_share_of_every_ranks_trained_rows(monkeypatch):
    """2 ranks; rank 0 keeps no group, rank 1 fills its share with groups of 4, one row each cut and filtered."""
    from dstrain.trainers import grpo_sampling as gs
    from dstrain.trainers.grpo_config import PolicyTaskConfig
    from tests.unit.test_grpo_dapo import fake_trainer
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_rounds=2,
                            overlong_filter=True)
    comm = ThreadCollectives(2)
    monkeypatch.setattr(gs.runtime, "all_reduce", comm.all_reduce)
    monkeypatch.setattr(gs.runtime, "all_gather_1d", comm.all_gather_1d)
    trainers = []
    for rank in range(2):
        tr = fake_trainer(["q"] * 40, task, local_samples=8, monkeypatch=monkeypatch)
        tr.world, tr.rl, tr.prompts_per_step = SimpleNamespace(rank=rank), RankRL(rank), 4  # 2 ranks x 8 / 4
        trainers.append(tr)
    results, errors = [None, None], []

    def run(rank):
        comm.local.rank = rank
        try:
            results[rank] = gs.dynamic_batch(trainers[rank], step=0)
        except Exception as err:  # (reported below; the barrier then times out for the other rank)
            errors.append(err)
            comm.barrier.abort()

    import threading
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # the definition: over every rank's trained rows (rows of an informative group), the share the filter dropped
    trained = cut = 0
    for rank, sb in enumerate(results):
        ids, adv = sb.batch["input_ids"], sb.advantages
        if rank == 0:
            assert adv.abs().sum() == 0  # nothing informative: its rows are weight-0 fillers
            continue
        trained += ids.shape[0]  # rank 1: every row of its share is a kept group's
        cut += int((ids == CUT).any(dim=1).sum())
    assert (trained, cut) == (8, 2)
    logged = sum(sb.log["overlong_filtered"] for sb in results) / 2  # what the log's mean over ranks gives
    assert logged == pytest.approx(cut / trained, rel=1e-12)
    assert all(sb.log["trained_zero_variance_groups"] == 0.0 for sb in results)  # kept groups have a spread


def _run_ranks(comm: ThreadCollectives, work) -> list:
    import threading
    results, errors = [None] * comm.world, []

    def run(rank):
        comm.local.rank = rank
        try:
            results[rank] = work(rank)
        except Exception as err:  # (reported below; the other ranks' barrier is broken so they end too)
            errors.append(err)
            comm.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(comm.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not [e for e in errors if not isinstance(e, threading.BrokenBarrierError)], errors
    return results


def test_grpo_kl_clip_fraction_and_entropy_pool_every_ranks_passes_and_tokens(monkeypatch):
    """2 ranks; rank 0's 8 rows all weigh 0 (dynamic sampling kept no group there), rank 1 trains round 13's
    batch (ragged completions, one micro-batch of padding only) for 2 passes. The definitions over the step:
    ``kl`` and ``clip_fraction`` the mean over every rank's micro-batch passes holding a trained token of their
    token means (TRL's, whose mean over processes skips the passes without one), ``entropy`` the mean over every
    trained completion token of the step; recomputed in float64 from the logits of each forward."""
    from dstrain import runtime
    from dstrain.rl import grpo_math as gm
    from dstrain.trainers import grpo_sampling as gs
    from dstrain.trainers.grpo_config import PolicyTaskConfig
    from tests.unit.test_grpo_dapo import _TinyLM, fake_step_trainer
    torch.manual_seed(4)
    B, T, GA, temp, eps_low, eps_high = 8, 9, 4, 0.7, 0.2, 0.28
    ids = torch.randint(1, 11, (B, T))
    starts, ends = [3, 5, 2, 4, 3, 6, 2, 5], [9, 7, 9, 6, 9, 9, 8, 9]
    cmask, attn = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for r in range(B):
        cmask[r, starts[r]:ends[r]] = 1
        attn[r, :ends[r]] = 1
    weights = [torch.zeros(B), torch.tensor([1, 1, 0, 0, 1, 0, 1, 1.0])]
    advs = [torch.zeros(B), torch.randn(B) * 2 * weights[1]]
    ref = torch.randn(B, T - 1) * 0.3 - 2.0
    trainers = []
    for rank in range(2):
        batch = {"input_ids": ids.clone(), "attention_mask": attn.clone(), "completion_mask": cmask.clone()}
        sb = gs.StepBatch(batch, advs[rank], weights[rank], {}, {"generation": 0.01, "reward": 0.01}, 10)
        tr = fake_step_trainer("grpo", sb, GA)
        tr.engine = RecordingSGD(_TinyLM(), GA, lr=1.0)
        tr.world, tr.samples_per_step = SimpleNamespace(world_size=2, rank=rank), 2 * B
        tr.task = PolicyTaskConfig(loss_type="grpo", max_new_tokens=T, num_iterations=2, beta=0.05,
                                   temperature=temp, epsilon=eps_low, epsilon_high=eps_high)
        tr.loss_cfg = gm.GRPOLossConfig(eps_low, eps_high, 0.05, "grpo", T)
        tr.reference = type("Ref", (), {"token_logprobs": lambda self, i, a, temperature: ref.clone()})()
        trainers.append(tr)
    comm = ThreadCollectives(2)
    monkeypatch.setattr(runtime, "all_reduce", comm.all_reduce)
    outs = _run_ranks(comm, lambda rank: trainers[rank].train_step(0))

    kls, clips, ent_sum, tokens = [], [], 0.0, 0.0
    rows = [slice(m * 2, m * 2 + 2) for m in range(GA)]
    for rank, tr in enumerate(trainers):
        mask = (cmask[:, 1:] * weights[rank][:, None]).double()
        tokens += 2 * float(mask.sum())
        old = torch.cat([next_token(lg, ids[r], temp)[0] for lg, r in zip(tr.engine.scored, rows)])
        for n, logits in enumerate(tr.engine.trained):
            r = rows[n % GA]
            logp, ent = next_token(logits, ids[r], temp)
            m = mask[r]
            ent_sum += float((ent * m).sum())
            if m.sum() == 0:
                continue
            d = ref[r].double() - logp
            kls.append(float(((d.exp() - d - 1) * m).sum() / m.sum()))
            ratio, a = (logp - old[r]).exp(), advs[rank][r, None].double()
            bound = ((ratio > 1 + eps_high) & (a > 0)) | ((ratio < 1 - eps_low) & (a < 0))
            clips.append(float((bound * m).sum() / m.sum()))
    assert len(kls) == 2 * (GA - 1) and 0 < sum(clips) < len(clips)
    for key, expected, rel in (("kl", sum(kls) / len(kls), 1e-5), ("clip_fraction", sum(clips) / len(clips), 1e-6),
                               ("entropy", ent_sum / tokens, 1e-5)):
        logged = sum(out[key] for out in outs) / 2  # the log's mean over ranks
        assert logged == pytest.approx(expected, rel=rel), key
