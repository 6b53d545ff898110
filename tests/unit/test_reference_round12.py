"""Round 12 of the independent references: each quantity recomputed from its definition (plain loops,
float64, exact counts from a ``config.json``), never through dstrain's helpers for the expected value.

Compared here:

* the training FLOPs per token of the mixture-of-experts policies (``PolicyModel.flops_per_token``, what MFU
  and the benchmarks divide by) against PaLM's ``6 N + 12 L (heads x head_dim) T`` with ``N`` counted by hand
  from the checkpoint's config, weight matrix by weight matrix, for the weights one token is multiplied by:
  q/k/v/o (and their biases where the config has them), each layer's router ``[experts, hidden]``, the
  ``num_experts_per_tok`` experts' gate/up/down, Qwen2-MoE's shared expert and its one-output gate, the dense
  MLP of Qwen2-MoE's layers left dense (``mlp_only_layers``, ``decoder_sparse_step``), and the output head
  (tied or not): Mixtral, Qwen2-MoE, Qwen3-MoE (``head_dim`` x heads != hidden) and OLMoE, 1..4 of 4 experts;
* the parameters and model-state bytes ``dstrain plan`` counts for a Hugging Face checkpoint
  (``hardware.model_stats`` of the meta-device build, then ``profiles.model_state_bytes``) against a count from
  its config (a tied head counted once, an untied one twice the embedding's size; the largest module the
  embedding or a layer's fused experts) and DESIGN's table (16P, 4P + 12P/N, 16P/N + 4L, ...), Llama and Mixtral,
  tied and untied;
* SCoRe's per-step self-correction statistics (``accuracy@t1``, ``accuracy@t2``, ``delta(t1,t2)``,
  ``incorrect_to_correct``, ``correct_to_incorrect``) against the paper's definitions counted by hand, a task
  counted correct when its answer is right (reward 1: every test passes), as the held-out evaluation
  (``ScoreStep.evaluate`` / ``eval_stats``) counts it, with partial-credit rewards;
* the held-out evaluation's statistics (``eval_stats``) from hand-counted 2x2 tables against the same
  definitions, its ``delta`` interval containing the difference and agreeing in sign with the table.

Found and fixed (the plan's model states and the held-out statistics agreed; pinned):

* FLOPs per token left the routers out: transformers 5 builds every MoE router (``MixtralTopKRouter``,
  ``Qwen2MoeTopKRouter``...) as a module of its own holding a 2-D weight, not an ``nn.Linear``, so
  ``num_matmul_params`` counted ``linear + experts x k / E`` and missed ``experts x hidden`` per layer (e.g.
  Mixtral-8x7B: 32 x 8 x 4096 weights). ``moe.router_params`` now counts them.
* SCoRe's training statistics counted a reward ``> 0.5`` as correct: with ``task.partial_credit`` a completion
  passing 2 of 3 tests (reward 0.667) was a solved task in ``train/accuracy@t1`` and the transitions, while
  ``val/`` counts reward 1 only; rewards (1, 2/3, 0, 1/2) against (1, 1, 2/3, 1) logged accuracy@t1 0.5
  (the definition: 0.25) and incorrect_to_correct 0.25 (0.5). Correct now means reward 1 in both.
"""

from __future__ import annotations

import types

import pytest
import torch

from dstrain.rl import episode as ep
from dstrain.trainers.score_step import Episodes, ScoreStep, eval_stats
from models.policy.config import PolicyConfig
from models.policy.model import build_policy
from tests.hf_checkpoints import _ARCHS, available, build_checkpoint


# ------------------------------------------------------------------ MoE FLOPs per token
def hand_matmul_weights(kind: str, c: dict, vocab: int) -> int:
    """Weights one token is multiplied by, counted from the config's numbers (no model looked at)."""
    H, L = c["hidden_size"], c["num_hidden_layers"]
    nh, nkv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or H // nh
    qkv_bias = kind == "qwen2_moe"  # Qwen2's q/k/v projections carry biases (counted as dstrain counts them)
    attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + (nh * hd + 2 * nkv * hd if qkv_bias else 0)
    E = c.get("num_local_experts") or c["num_experts"]
    k = c["num_experts_per_tok"]
    inter = c["moe_intermediate_size"] if kind in ("qwen2_moe", "qwen3_moe") else c["intermediate_size"]
    total = 0
    for layer in range(L):
        total += attn
        sparse = True
        if kind == "qwen2_moe":
            sparse = layer not in c.get("mlp_only_layers", []) and (layer + 1) % c.get("decoder_sparse_step", 1) == 0
        if not sparse:
            total += 3 * H * c["intermediate_size"]  # a dense gate/up/down MLP
            continue
        total += E * H  # the router: every token's logits over the experts
        total += k * 3 * H * inter  # the k experts' gate, up and down projections
        if kind == "qwen2_moe":
            total += 3 * H * c["shared_expert_intermediate_size"] + H  # shared expert + its sigmoid gate
    return total + vocab * H  # the output head, tied or not (a matmul either way)


MOE = [k for k in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe") if k in available()]
CASES = [
    ("mixtral", {"num_experts_per_tok": 1}, None),
    ("mixtral", {"num_experts_per_tok": 3}, True),
    ("qwen2_moe", {"num_experts_per_tok": 2}, None),
    ("qwen2_moe", {"num_experts_per_tok": 4, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                   "mlp_only_layers": [3]}, True),
    ("qwen3_moe", {"num_experts_per_tok": 2, "head_dim": 16}, None),
    ("olmoe", {"num_experts_per_tok": 1}, False),
]


@pytest.mark.parametrize("kind,extra,tie", [c for c in CASES if c[0] in MOE])
def test_moe_flops_per_token_count_every_weight_a_token_is_multiplied_by(kind, extra, tie, tmp_path):
    path = build_checkpoint(kind, str(tmp_path / kind), config=extra, tie=tie)
    model = build_policy(PolicyConfig(path=path))
    conf = {**_ARCHS[kind][2], **extra}
    vocab = model.hf.get_output_embeddings().weight.shape[0]
    n = hand_matmul_weights(kind, conf, vocab)
    assert model.num_matmul_params() == n
    nh, hd = conf["num_attention_heads"], conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
    for T in (1, 37):
        assert model.flops_per_token(T) == 6 * n + 12 * conf["num_hidden_layers"] * nh * hd * T


# ------------------------------------------------------------------ the plan's model states of a checkpoint
def hand_params(kind: str, c: dict, vocab: int, tied: bool) -> tuple[int, int]:
    """(distinct parameters, the most one module owns directly) of a Llama or Mixtral checkpoint from its config:
    embedding, per layer q/k/v/o + (a gate/up/down MLP, or the router and the experts' 3-D weights) + two RMSNorm
    gains, the final norm, and the output head unless it is the embedding (tied: counted once)."""
    H, L, I = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = H // nh
    attn = 2 * H * nh * hd + 2 * H * nkv * hd
    if kind == "mixtral":
        E = c["num_local_experts"]
        experts = E * (2 * I * H + H * I)  # gate_up_proj [E, 2I, H] and down_proj [E, H, I]: one module
        mlp, big_mlp = E * H + experts, experts
    else:
        mlp, big_mlp = 3 * H * I, H * I
    total = vocab * H + L * (attn + mlp + 2 * H) + H + (0 if tied else vocab * H)
    return total, max(vocab * H, big_mlp, H * nh * hd)


@pytest.mark.parametrize("kind,tie", [("llama", True), ("llama", False), ("mixtral", False), ("mixtral", True)])
def test_plan_model_states_of_a_checkpoint_against_a_hand_count(kind, tie, tmp_path):
    from dstrain.engine.hardware import model_stats
    from dstrain.engine.profiles import model_state_bytes

    path = build_checkpoint(kind, str(tmp_path / kind), tie=tie)
    cfg = PolicyConfig(path=path)
    stats = model_stats(lambda: build_policy(cfg))  # what the plan counts: a meta-device build
    vocab = 300  # the tiny tokenizer's vocabulary (build_checkpoint: no extra rows)
    P, big = hand_params(kind, _ARCHS[kind][2], vocab, tie)
    assert (stats.params, stats.largest_module_params) == (P, big)
    # DESIGN's table: 16-bit weights and gradients (2 + 2 bytes), fp32 master weights and Adam moments (12)
    for n in (1, 3, 8):
        assert model_state_bytes("zero0", stats, n, "bf16", 8) == (16 * P, 0)
        assert model_state_bytes("zero1", stats, n, "bf16", 8) == (round(4 * P + 12 * P / n), 0)
        assert model_state_bytes("zero3", stats, n, "bf16", 8) == (round(16 * P / n + 4 * big), 0)
        assert model_state_bytes("zero3", stats, n, "fp32", 8) == (round(20 * P / n + 8 * big), 0)
        assert model_state_bytes("zero3_offload", stats, n, "bf16", 2) == (4 * big, round(16 * P * min(1, 2 / n)))


# ------------------------------------------------------------------ SCoRe transition statistics
def hand_transitions(r1: list[float], r2: list[float]) -> dict[str, float]:
    """The paper's statistics, a task correct when its reward is 1 (its answer right: every test passes)."""
    n = len(r1)
    c1 = [x == 1.0 for x in r1]
    c2 = [x == 1.0 for x in r2]
    a1 = sum(1 for x in c1 if x) / n
    a2 = sum(1 for x in c2 if x) / n
    i2c = sum(1 for a, b in zip(c1, c2) if not a and b) / n
    c2i = sum(1 for a, b in zip(c1, c2) if a and not b) / n
    return {"accuracy@t1": a1, "accuracy@t2": a2, "delta(t1,t2)": a2 - a1, "incorrect_to_correct": i2c,
            "correct_to_incorrect": c2i}


def episodes(r1, r2) -> Episodes:
    roll = types.SimpleNamespace(gen_tokens=len(r1) * 3)
    hints = [types.SimpleNamespace(completion_ids=[1, 2]) for _ in r1]
    return Episodes(tasks=[None] * len(r1), turn1=roll, hints=hints, turn2=roll,
                    r1=torch.tensor(r1, dtype=torch.float32), r2=torch.tensor(r2, dtype=torch.float32))


@pytest.mark.parametrize("r1,r2", [
    ([1.0, 2 / 3, 0.0, 0.5], [1.0, 1.0, 2 / 3, 1.0]),  # partial credit: 2 of 3 tests is not solved
    ([0.75, 1.0, 0.9, 0.0, 1.0], [1.0, 0.8, 0.9, 0.51, 1.0]),
    ([0.0, 1.0, 0.0], [1.0, 0.0, 0.0]),  # 0/1 rewards (maths): unchanged
])
def test_score_training_transitions_count_a_task_correct_when_its_reward_is_1(r1, r2):
    got = ScoreStep._episode_stats(ScoreStep.__new__(ScoreStep), episodes(r1, r2), stage=2)
    expect = hand_transitions(r1, r2)
    for key, value in expect.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert got["delta(t1,t2)"] == pytest.approx(got["incorrect_to_correct"] - got["correct_to_incorrect"])
    assert got["reward_t1"] == pytest.approx(sum(r1) / len(r1), rel=1e-6)  # the rewards themselves stay raw


@pytest.mark.parametrize("table", [(5, 1, 3, 2), (0, 0, 4, 6), (7, 2, 0, 0), (1, 0, 0, 0), (0, 3, 1, 0)])
def test_eval_stats_from_a_hand_counted_table(table):
    both, c2i, i2c, neither = table
    n = sum(table)
    r1 = [1.0] * both + [1.0] * c2i + [0.0] * i2c + [0.0] * neither
    r2 = [1.0] * both + [0.0] * c2i + [1.0] * i2c + [0.0] * neither
    got = eval_stats(n, both + c2i, both + i2c, i2c, c2i)
    expect = hand_transitions(r1, r2)
    for key, value in expect.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key
    assert got["pass@1"] == expect["accuracy@t2"] and got["tasks"] == n
    assert got["delta_ci95_low"] <= expect["delta(t1,t2)"] <= got["delta_ci95_high"]
    assert -1.0 <= got["delta_ci95_low"] and got["delta_ci95_high"] <= 1.0
    # the training statistics of the same episodes agree with the held-out ones
    train = ep.transition_stats(r1, r2)
    for key, value in expect.items():
        assert train[key] == pytest.approx(value, abs=1e-12), key


def test_router_weights_of_zero3_partitioned_routers_count_by_their_full_size():
    from torch import nn

    from models.policy.moe import router_params

    class Router(nn.Module):  # transformers 5's TopKRouter: a 2-D [experts, hidden] weight, not an nn.Linear
        def __init__(self):
            super().__init__()
            self.num_experts, self.top_k = 4, 2
            self.weight = nn.Parameter(torch.zeros(4, 16))

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 16))  # 3-D: the experts', not a router's

    hf = nn.Sequential(nn.Linear(16, 16), Router(), Experts(), Router())
    assert router_params(hf) == 2 * 4 * 16
    for p in hf.parameters():  # what deepspeed.zero.Init leaves on a rank: an empty shard, the full size aside
        p.ds_shape, p.ds_numel = p.shape, p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    assert router_params(hf) == 2 * 4 * 16
    assert router_params(nn.Sequential(nn.Linear(4, 4))) == 0  # a dense model (its Linear counted elsewhere)
