"""DAPO pieces: overlong punishment and filtering, dynamic sampling (fake policy and verifier),
short-batch normalisation against training on the kept samples alone, and the step's time split."""
from __future__ import annotations

import types

import pytest
import torch

from dstrain.rl import dapo
from dstrain.rl import grpo_math as gm
from dstrain.trainers import grpo_sampling as gs
from dstrain.trainers import policy_rl as prl
from dstrain.trainers.grpo_config import PolicyTaskConfig
from dstrain.trainers.rl_loop import format_time_split, split_prefixed, time_split
from models.policy import SPEC, Completion


# ---------------------------------------------------------------- overlong punishment

def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 15, 16, 18, 20, 25])
    # max 20, buffer 5: free up to 15, then (15 - L) / 5, then -1
    assert dapo.overlong_penalty(lengths, 20, 5).tolist() == pytest.approx([0, 0, -0.2, -0.6, -1.0, -1.0])
    assert dapo.overlong_penalty(lengths, 20, 5, factor=0.5).tolist() == pytest.approx(
        [0, 0, -0.1, -0.3, -0.5, -0.5])
    assert dapo.overlong_penalty(torch.tensor([1, 4]), 4, 4).tolist() == pytest.approx([-0.25, -1.0])
    with pytest.raises(ValueError, match="buffer"):
        dapo.overlong_penalty(lengths, 20, 0)


def _completion(text: str, n_tokens: int, finished: bool = True, index: int = 0) -> Completion:
    return Completion(index, 0, [1, 2], [3] * n_tokens, text, finished)


def test_shaped_rewards_and_filter_weights():
    task = PolicyTaskConfig(max_new_tokens=8, overlong_buffer=4, overlong_penalty=1.0, overlong_filter=True)
    comps = [_completion("a", 3), _completion("b", 6), _completion("c", 8, finished=False)]
    raw = torch.tensor([1.0, 1.0, 0.0])
    # free up to 4 tokens; 6 -> (4 - 6) / 4 = -0.5; 8 -> -1
    assert gs.shaped_rewards(raw, comps, task).tolist() == pytest.approx([1.0, 0.5, -1.0])
    assert gs.row_weights(comps, task).tolist() == [1.0, 1.0, 0.0]
    plain = PolicyTaskConfig(max_new_tokens=8)
    assert gs.shaped_rewards(raw, comps, plain).tolist() == raw.tolist()
    assert gs.row_weights(comps, plain).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kw, key", [({"overlong_buffer": 9, "max_new_tokens": 8}, "overlong_buffer"),
                                     ({"overlong_buffer": -1}, "overlong_buffer"),
                                     ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds"),
                                     ({"dynamic_sampling_oversample": -0.5}, "dynamic_sampling_oversample"),
                                     ({"dynamic_sampling_target": 1.0}, "dynamic_sampling_target"),
                                     ({"dynamic_sampling_sizing": "guess"}, "dynamic_sampling_sizing"),
                                     ({"dynamic_sampling_round_cost": -1}, "dynamic_sampling_round_cost"),
                                     ({"dynamic_sampling_max_oversample": -1}, "dynamic_sampling_max_oversample"),
                                     ({"sandbox_mode": "vm"}, "sandbox_mode")])
def test_bad_dapo_values_name_the_key(kw, key):
    with pytest.raises(ValueError, match=key):
        PolicyTaskConfig(**kw)


# ---------------------------------------------------------------- groups

def test_informative_groups_and_refill_prompts():
    r = torch.tensor([1, 1, 0, 1, 0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5])
    assert dapo.informative_groups(r, 4).tolist() == [True, False, False]
    a = dapo.refill_prompts(50, step=3, round_=1, rank=0, count=10, seed=7)
    assert a == dapo.refill_prompts(50, 3, 1, 0, 10, 7) and len(set(a)) == 10
    assert a != dapo.refill_prompts(50, 3, 2, 0, 10, 7) and a != dapo.refill_prompts(50, 3, 1, 1, 10, 7)
    assert len(dapo.refill_prompts(4, 0, 1, 0, 10, 7)) == 10  # more than there are tasks: wraps


def test_group_filler_bookkeeping():
    f = dapo.GroupFiller(needed=3, group_size=2)
    f.add(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), list("abcdef"))  # kept ab; dropped cd, ef
    assert (f.kept, f.deficit, f.dropped, f.generated) == (1, 2, 2, 3)
    assert f.kept_items == ["a", "b"] and f.filler_items == list("cdef")
    assert f.next_count() == 3  # deficit 2 / kept rate 1/3 = 6, at most the 3 of a share
    f.add(torch.tensor([0.0, 1.0, 1.0, 0.5, 0.2, 0.3]), list("ghijkl"))  # three informative, two needed
    assert (f.kept, f.deficit, f.dropped, f.surplus, f.rounds) == (3, 0, 2, 1, 2)
    assert f.kept_rewards == [1.0, 0.0, 0.0, 1.0, 1.0, 0.5]
    assert f.stats() == {"dropped_fraction": 2 / 6, "rounds": 2.0, "filled_fraction": 1.0,
                         "generated_groups": 6.0, "surplus_groups": 1.0}
    assert f.next_count() == 0


# ---------------------------------------------------------------- dynamic sampling, fake policy and verifier

class FakeRL:
    """Answers 'easy' prompts always right, 'hard' always wrong, 'mixed' right on even sample seeds."""

    pack = staticmethod(SPEC.rl.pack)
    calls: list

    def __init__(self):
        self.calls = []

    def generate(self, model, tok, prompts, num_samples=1, seed=0, **kw):
        self.calls.append(len(prompts))
        out = []
        for i, p in enumerate(prompts):
            right = p.startswith("easy") or (p.startswith("mixed") and (seed + i) % 2 == 0)
            out.append(Completion(i, 0, [5, 6], [7] * (2 + i % 3), "right" if right else "wrong", True))
        return out


def fake_trainer(kinds: list[str], task: PolicyTaskConfig, local_samples: int, monkeypatch):
    tasks = [types.SimpleNamespace(prompt=f"{k} {i}", stop=()) for i, k in enumerate(kinds)]
    monkeypatch.setattr(prl, "score", lambda ts, texts, pool, pc: ([float(t == "right") for t in texts],
                                                                 ["passed" if t == "right" else "failed"
                                                                  for t in texts]))
    cfg = types.SimpleNamespace(data=types.SimpleNamespace(seed=3), train=types.SimpleNamespace(seed=5))
    return types.SimpleNamespace(task=task, local_samples=local_samples, world=types.SimpleNamespace(rank=0),
                                 train_tasks=tasks, prompts_per_step=local_samples // task.num_generations,
                                 cfg=cfg, rl=FakeRL(), tokenizer=types.SimpleNamespace(pad_token_id=0),
                                 policy=None, pool=None)


def trained_groups(sb, G):
    w = sb.weights.view(-1, G)
    return [i for i in range(w.shape[0]) if w[i].sum() > 0]


def test_dynamic_sampling_trains_no_zero_variance_group(monkeypatch):
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_rounds=8)
    kinds = ["easy", "hard", "mixed"] * 10
    tr = fake_trainer(kinds, task, local_samples=16, monkeypatch=monkeypatch)
    sb = gs.dynamic_batch(tr, step=0)
    assert sb.batch["input_ids"].shape[0] == 16 and sb.weights.tolist() == [1.0] * 16
    rewards = (sb.advantages != 0).view(-1, 4)
    assert rewards.any(dim=1).all()  # every trained group has a spread, so nonzero advantages
    assert sb.log["trained_zero_variance_groups"] == 0.0 and sb.log["dynamic/filled_fraction"] == 1.0
    rounds = int(sb.log["dynamic/rounds"])
    assert rounds >= 2 and len(tr.rl.calls) == rounds
    generated = sum(tr.rl.calls) // 4
    assert sb.log["dynamic/generated_groups"] == generated
    # the first round's prompts are the step's regular ones; by construction only 'mixed' groups survive
    round0 = prl.step_prompts(len(kinds), 0, 4, 3)
    assert sb.log["zero_variance_groups"] == pytest.approx(sum(kinds[i] != "mixed" for i in round0) / 4)
    for g in range(4):
        assert sb.advantages[g * 4:(g + 1) * 4].sum().abs() < 1e-5  # group-centred


def test_oversampling_adds_fresh_groups_to_the_first_round(monkeypatch):
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_oversample=1.0,
                            dynamic_sampling_sizing="fixed")  # the fixed oversampling (no running estimate)
    kinds = ["mixed"] * 20
    tr = fake_trainer(kinds, task, local_samples=16, monkeypatch=monkeypatch)
    sb = gs.dynamic_batch(tr, step=0)
    assert tr.rl.calls == [32]  # 4 regular groups + 4 fresh ones, one round
    assert sb.log["dynamic/rounds"] == 1.0 and sb.log["dynamic/generated_groups"] == 8.0
    assert sb.batch["input_ids"].shape[0] == 16 and sb.weights.sum() == 16


def test_dynamic_sampling_cap_leaves_a_weighted_short_batch(monkeypatch):
    task = PolicyTaskConfig(num_generations=2, dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    kinds = ["easy"] * 40 + ["mixed"]
    tr = fake_trainer(kinds, task, local_samples=8, monkeypatch=monkeypatch)
    sb = gs.dynamic_batch(tr, step=0)
    kept = int(sb.weights.sum().item()) // 2
    assert sb.batch["input_ids"].shape[0] == 8 and kept < 4
    assert sb.log["dynamic/filled_fraction"] == kept / 4 and sb.log["dynamic/rounds"] == 2.0
    assert sb.weights[:2 * kept].tolist() == [1.0] * (2 * kept) and sb.weights[2 * kept:].sum() == 0
    assert sb.advantages[2 * kept:].abs().sum() == 0


def test_plain_batch_matches_the_old_layout(monkeypatch):
    task = PolicyTaskConfig(num_generations=4, overlong_filter=True)
    tr = fake_trainer(["easy", "mixed", "hard"] * 4, task, local_samples=8, monkeypatch=monkeypatch)
    sb = gs.plain_batch(tr, step=1)
    prompts = prl.step_prompts(12, 1, 2, 3)
    kinds = ["easy", "mixed", "hard"] * 4
    expect_zero = [kinds[p] != "mixed" for p in prompts]
    groups = sb.advantages.view(2, 4).abs().sum(1)
    assert [bool(g == 0) for g in groups] == expect_zero
    assert sb.log["overlong_filtered"] == 0.0 and len(tr.rl.calls) == 1


# ---------------------------------------------------------------- short batch = kept samples alone

@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_short_batch_normalisation_equals_kept_samples_alone(loss_type):
    torch.manual_seed(0)
    B, T, micro = 8, 6, 4
    logits = torch.randn(B, T, requires_grad=True)
    old = logits.detach() + 0.1 * torch.randn(B, T)
    adv = torch.randn(B)
    mask = (torch.rand(B, T) > 0.3).float()
    mask[:, 0] = 1
    weights = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0.0])  # rows 3, 6, 7 are padding / filtered
    cfg = gm.GRPOLossConfig(loss_type=loss_type, max_completion_length=T)
    kept = weights.bool()

    ref_loss, _ = gm.grpo_loss(logits[kept], old[kept], None, adv[kept], mask[kept], cfg,
                               token_normaliser=mask[kept].sum().item())
    ref_grad, = torch.autograd.grad(ref_loss, logits)

    m = mask * weights[:, None]
    total = 0.0
    for s in range(0, B, micro):
        sl = slice(s, s + micro)
        loss, _ = gm.grpo_loss(logits[sl], old[sl], None, adv[sl] * weights[sl], m[sl], cfg,
                               token_normaliser=m.sum().item(), sequence_normaliser=weights.sum().item())
        total = total + loss
    grad, = torch.autograd.grad(total, logits)
    assert total.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-7)


# ---------------------------------------------------------------- time split

def test_prefixed_keys_get_their_own_section_and_the_split_adds_up():
    stats = {"loss": 1.0, "time/generation": 3.0, "time/reward": 1.0, "time/step": 5.0, "dynamic/rounds": 2.0}
    assert split_prefixed(stats) == {"train": {"loss": 1.0}, "time": {"generation": 3.0, "reward": 1.0, "step": 5.0},
                                     "dynamic": {"rounds": 2.0}}
    split = time_split({"time/generation": 6.0, "time/reward": 2.0, "time/step": 10.0})
    assert split["generation"] == {"seconds": 6.0, "share": 0.6} and split["other"]["seconds"] == pytest.approx(2.0)
    assert "generation 60%" in format_time_split(split)
    assert time_split({}) == {}


# ---------------------------------------------------------------- the trainer's step with a fake engine

class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb, self.out = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, ids, attention_mask=None):
        return self.out(torch.tanh(self.emb(ids)))


class FakeEngine:
    """DeepSpeed's contract as the GRPO trainer uses it: backward divides by grad_accum; step is a no-op here
    (also tests/unit/test_moe_router_loss.py's, around a policy)."""

    def __init__(self, module, grad_accum):
        self.module, self.grad_accum, self.device = module, grad_accum, torch.device("cpu")

    def __call__(self, ids, attention_mask=None):
        return self.module(ids, attention_mask=attention_mask)

    def backward(self, loss):
        (loss / self.grad_accum).backward()

    def step(self):
        pass

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


def _step_trainer(loss_type, weights):
    torch.manual_seed(2)
    B, T, GA = 8, 7, 2
    ids = torch.randint(1, 11, (B, T))
    cmask = torch.zeros(B, T, dtype=torch.long)
    cmask[:, 3:] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": cmask}
    adv = torch.randn(B) * weights
    sb = gs.StepBatch(batch, adv, weights, {"reward_mean": 0.5}, {"generation": 0.01, "reward": 0.02}, 10)
    return fake_step_trainer(loss_type, sb, GA), batch, adv


def fake_step_trainer(loss_type: str, sb, grad_accum: int):
    """A GRPOTrainer (one rank, no reference model) whose every step trains on the StepBatch ``sb`` through
    :class:`FakeEngine` over :class:`_TinyLM`, in ``grad_accum`` micro-batches."""
    from dstrain.trainers.grpo import GRPOTrainer
    from models.policy.model import token_entropy, token_logprobs
    B, T = sb.batch["input_ids"].shape
    tr = GRPOTrainer.__new__(GRPOTrainer)
    tr.cfg = types.SimpleNamespace(train=types.SimpleNamespace(micro_batch=B // grad_accum, grad_accum=grad_accum))
    tr.engine = FakeEngine(_TinyLM(), grad_accum)
    tr.task = PolicyTaskConfig(loss_type=loss_type, max_new_tokens=T)
    tr.world = types.SimpleNamespace(world_size=1, rank=0)
    tr.samples_per_step, tr.reference = B, None
    tr.loss_cfg = gm.GRPOLossConfig(loss_type=loss_type, max_completion_length=T)
    tr.rl = types.SimpleNamespace(token_logprobs=token_logprobs, token_entropy=token_entropy)
    tr.sample = lambda step: sb
    return tr


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_train_step_on_a_short_batch_equals_the_kept_rows_alone(loss_type):
    weights = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0.0])
    tr, batch, adv = _step_trainer(loss_type, weights)
    out = tr.train_step(0)
    grads = [p.grad.clone() for p in tr.engine.module.parameters()]

    model = tr.engine.module
    model.zero_grad()
    kept = weights.bool()
    ids = batch["input_ids"][kept]
    from models.policy.model import token_logprobs
    logp = token_logprobs(model(ids), ids)
    mask = batch["completion_mask"][kept][:, 1:].float()
    loss, _ = gm.grpo_loss(logp, logp.detach(), None, adv[kept], mask, tr.loss_cfg, token_normaliser=mask.sum().item())
    loss.backward()
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6), loss_type
    for part in ("generation", "reward", "reference", "training", "step"):
        assert f"time/{part}" in out and out[f"time/{part}"] >= 0
    assert out["time/step"] >= out["time/training"] and out["time/generation"] == 0.01
    assert out["reward_mean"] == 0.5


def test_train_step_on_a_full_batch_is_unchanged_by_the_weights_path():
    tr, batch, adv = _step_trainer("grpo", torch.ones(8))
    tr.train_step(0)
    grads = [p.grad.clone() for p in tr.engine.module.parameters()]
    model = tr.engine.module
    model.zero_grad()
    from models.policy.model import token_logprobs
    total = 0.0
    for m in (slice(0, 4), slice(4, 8)):  # the mean of the two micro-batch means, as DeepSpeed averages them
        ids = batch["input_ids"][m]
        logp = token_logprobs(model(ids), ids)
        loss, _ = gm.grpo_loss(logp, logp.detach(), None, adv[m], batch["completion_mask"][m][:, 1:].float(),
                               tr.loss_cfg)
        total = total + loss / 2
    total.backward()
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)
