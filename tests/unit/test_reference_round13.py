"""Round 13 of the independent references: each quantity recomputed from its definition (plain loops,
float64, DESIGN's table and the library's documented rule), never through dstrain's helpers for the expected
value.

Compared here:

* the model-state bytes ``dstrain plan`` (and ``dstrain bench``'s ``estimated_memory_bytes``) counts per profile
  (``choose_plan``'s estimates: device, host per node, a CPU rank's share of the offloaded states) against DESIGN's
  table by hand for every ZeRO stage and offload, 16-bit and fp32 rows, bf16 as DeepSpeed's 16-bit weights and as
  torch.autocast over fp32 weights (``deepspeed.mixed_precision``), N = 1, 3, 16 at 8 ranks a node; the pipeline
  stages' states (ZeRO-0/1 of each stage's own parameters) and in-flight activations (1F1B: ``min(pp - s, accum)``
  micro-batches on stage s); ``parallel.pp=auto``'s first question (does ZeRO-0/1/2 fit the whole model);
* the dilated LM's FLOPs per token (MFU's numerator) against the (query, key) pairs its kernels are given,
  enumerated position by position per head and branch, on sequences the segments do not tile (the causal
  sequence run padded at the end to the shortest length every branch tiles, a segment longer than the
  sequence, more heads than offsets, one dilated position per head), and the kernel's output on such a
  sequence against the float64 brute force of ``tests/dilated_reference.py`` (the padding is exact);
* the FLOPs per token of a GPT-2 checkpoint (``PolicyModel.flops_per_token``) against PaLM's ``6 N + 12 L d T``
  with ``N`` counted from its ``config.json`` weight matrix by weight matrix, head tied and untied;
* GRPO's logged ``kl``, ``clip_fraction`` and ``entropy`` over a step of 4 micro-batches and 2 passes
  (``num_iterations``; plain SGD between them, so the second pass is clipped on some tokens), ragged
  completions, rows of weight 0 filling a whole micro-batch, temperature 0.7 and a frozen reference, recomputed
  in float64 from the logits of every forward: TRL's k3 KL and clip ratio as token means per micro-batch pass,
  averaged over the passes that train a token; the entropy as one token mean over the step.

Found and fixed:

* Under ``deepspeed.mixed_precision=autocast`` (bf16 as torch.autocast over fp32 weights, at any ZeRO stage) the
  plan counted the 16-bit row: 2-byte weights and gradients. DeepSpeed then runs its fp32 ZeRO optimizer over
  fp32 weights and gradients, with its own fp32 master partition beside them (stage 1/2 clone it whatever the
  dtype): the fp32 row. A 1B-parameter model on 8 GPUs at ZeRO-1 was planned at 5.5 GB of model states for
  9.5 GB (ZeRO-2: 3.75 GB for 6 GB; ZeRO-3 offload: 4L on the GPU for 8L, 16P on the host for 20P), so a
  profile could be chosen that does not fit. ``profiles.states_precision`` now gives the fp32 row under
  autocast above ZeRO-0 (ZeRO-0 keeps 16P: its optimizer updates the fp32 weights in place, no master copy),
  in the flat plan, in the pipeline stages' plan (which did not see ``mixed_precision`` at all) and in
  ``parallel.pp=auto``'s check (which did not either).
* A GPT-2 checkpoint's FLOPs per token counted its output head only: transformers builds GPT-2's q/k/v,
  attention-output and MLP projections as ``Conv1D`` (a Linear with its weight transposed), which
  ``num_matmul_params`` (``nn.Linear`` only) left out. For the tiny test checkpoint N was 9,600 for 34,752; for
  GPT-2 small 38.6M for 123.6M: at 1,024 tokens 0.34 GFLOP per token for 0.85, its MFU 40% of the true one.
  ``Conv1D`` now counts.

Pinned (deliberate): the dilated FLOPs count the padded length's pairs (the kernel computes them) and every pair
of a causal segment (PaLM's convention: no causal halving); under autocast at ZeRO-3 the fp32 row is 4P/N above
DeepSpeed's allocation (its stage 3 uses fp32 weights as their own master copy), as it is for fp32 training;
GRPO's KL and clip fraction are TRL's mean of micro-batch means, the entropy a token mean (round 11).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstrain.config import load_run_config
from dstrain.engine.profiles import (Activations, Hardware, ModelStats, PlanError, choose_pipeline_plan, choose_plan,
                                     stage_estimates)
from dstrain.ops.dilated import dilated_attention, make_branches, padded_length
from dstrain.parallel import pipeline
from dstrain.parallel.dims import ParallelDims
from models import registry
from models.dilated_lm import DilatedLM
from models.policy.config import PolicyConfig
from models.policy.model import build_policy
from tests.dilated_reference import reference_dilated
from tests.hf_checkpoints import _ARCHS, build_checkpoint
from tests.unit.grpo_recording import RecordingSGD, next_token

GB = 10 ** 9
ROOT = Path(__file__).resolve().parents[2]
ORDER = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_optimizer", "zero3_offload"]


# ---------------------------------------------------------------- model-state bytes: DESIGN's table by hand

def _design_bytes(profile: str, P: int, L: int, N: int, rpn: int, weight_bytes: int) -> tuple[float, float]:
    """DESIGN's table with ``weight_bytes`` for the 2-byte terms (4 when weights and gradients are fp32:
    'fp32 training doubles the 2-byte terms'); 12 bytes of fp32 master copy and Adam moments per parameter;
    the host column per node, a node holding ``min(1, rpn / N)`` of the partitions."""
    b, share = weight_bytes, min(1.0, rpn / N)
    return {"zero0": ((2 * b + 12) * P, 0), "zero1": (2 * b * P + 12 * P / N, 0),
            "zero2": (b * P + (b + 12) * P / N, 0), "zero3": ((2 * b + 12) * P / N + 2 * b * L, 0),
            "zero2_offload": (2 * b * P, 12 * P * share),
            "zero3_offload_optimizer": (b * P / N + 2 * b * L, (12 + b) * P * share),  # grads on the host
            "zero3_offload": (2 * b * L, (12 + 2 * b) * P * share)}[profile]


def _weight_bytes(profile: str, precision: str, autocast: bool) -> int:
    """Bytes of one weight (and one gradient) as the run holds them. bf16 under torch.autocast keeps fp32
    weights; above ZeRO-0 DeepSpeed's fp32 ZeRO optimizer keeps its own fp32 master partition beside them (its
    stage 1/2 clones the partition whatever the weights' dtype), so the fp32 row applies. At ZeRO-0 the
    optimizer updates the fp32 weights in place (4 + 4 + 8 moments = 16 bytes: the 16-bit row's total)."""
    if precision == "fp32" or (autocast and profile != "zero0"):
        return 4
    return 2


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("mixed", ["autocast", "deepspeed"])
@pytest.mark.parametrize("N,rpn", [(1, 8), (3, 8), (16, 8)])
def test_plan_model_states_follow_designs_table_for_the_weights_the_run_keeps(device, mixed, N, rpn):
    P, L, per_sample, mb = 123_456_789, 9_876_543, 3_000_001, 3
    hw = Hardware(device, 10 ** 15, 10 ** 15, rpn, bf16_supported_fast=True, fp16_supported=device == "cuda")
    acts = Activations(per_sample, per_sample // 7)  # no autocast trace: activations are half the fp32 trace
    for profile in ORDER:
        plan = choose_plan(ModelStats(P, L, 64, 4), hw, acts, N, mb, precision="bf16",
                           activation_checkpointing=False, profiles=(profile,), mixed_precision=mixed)
        est = plan.estimates[0]
        autocast = mixed == "autocast" or (mixed == "auto" and profile == "zero0" and device == "cuda")
        dev, host = _design_bytes(profile, P, L, N, rpn, _weight_bytes(profile, "bf16", autocast))
        act = round(per_sample * mb * 0.5)
        assert (est.model_states, est.host_total) == (round(dev), round(host)), (profile, mixed)
        mine = round(host) / min(rpn, N) if device == "cpu" else 0  # a CPU rank's share of the host states
        assert est.device_total == round(dev) + act + round(mine), profile


def test_autocast_zero1_example_from_the_bytes_deepspeed_allocates():
    """A 1B-parameter model on 8 GPUs at ZeRO-1 under bf16 autocast: fp32 weights 4 GB, fp32 gradients 4 GB
    (stage 1 does not partition them), and this rank's fp32 master partition and two moments 12 GB / 8:
    9.5 GB. The 16-bit row (4P + 12P/N = 5.5 GB) left out 4 GB a GPU."""
    hw = Hardware("cuda", 80 * GB, 1000 * GB, 8, True, True)
    plan = choose_plan(ModelStats(10 ** 9, 10 ** 7, 2048, 24), hw, Activations(1, 1), 8, 1, precision="bf16",
                       activation_checkpointing=False, profiles=("zero1",), mixed_precision="autocast")
    assert plan.estimates[0].model_states == 9_500_000_000


@pytest.mark.parametrize("mixed", ["autocast", "deepspeed", "auto"])
def test_pipeline_stage_states_follow_the_same_rule(mixed):
    """The pipeline engine takes ZeRO-0/1; its bf16 is DeepSpeed's 16-bit weights unless autocast is asked for."""
    layers = [7_000_001, 13_000_003, 13_000_003, 5_000_011]
    bounds, dp = [0, 2, 4], 3
    hw = Hardware("cuda", 10 ** 15, 10 ** 15, 8, True, True)
    acts = Activations(4_000_000, 400_000)
    for profile in ("zero0", "zero1"):
        plan, stages = choose_pipeline_plan(layers, bounds, hw, acts, dp, 2, 4, precision="bf16",
                                            activation_checkpointing=False, mixed_precision=mixed)
        assert plan.profile == "zero0"  # everything fits: the walk stops at ZeRO-0; ZeRO-1 checked directly
        if profile == "zero1":
            stages = stage_estimates("zero1", layers, bounds, acts, dp, 2, 4, "bf16", False,
                                     autocast=mixed == "autocast")
        for s, est in enumerate(stages):
            p = sum(layers[bounds[s]:bounds[s + 1]])
            dev, _ = _design_bytes(profile, p, 0, dp, 1, _weight_bytes(profile, "bf16", mixed == "autocast"))
            assert est.model_states == round(dev), (profile, s)
            in_flight = min(len(bounds) - 1 - s, 4)  # 1F1B: stage s holds pp - s micro-batches (at most accum)
            assert est.activations == round(acts.per_sample * (bounds[s + 1] - bounds[s]) / len(layers) * 2
                                            * in_flight * 0.5)


# ---------------------------------------------------------------- dilated LM FLOPs: brute-force pair count

def _tiles(n: int, segs, rates) -> bool:
    return all(n % min(w, n) == 0 and min(w, n) % r == 0 for w, r in zip(segs, rates))


def _given_pairs(T: int, segs, rates, heads: int) -> tuple[int, int]:
    """(query, key) pairs the kernels are given on a sequence of ``T`` tokens, and the length they run at.

    A causal sequence the segments do not tile runs padded at the end to the shortest length they tile
    (README / ``dilated_attention``); in branch (w, r) on n tokens the segment is min(w, n); head h takes
    the positions of each segment whose offset in it is congruent to h mod r, each attending to every such
    position of its segment (the kernel is handed the full square; no causal halving, as PaLM counts)."""
    n = T
    while not _tiles(n, segs, rates):
        n += 1
    pairs = 0
    for w, r in zip(segs, rates):
        w = min(w, n)
        for h in range(heads):
            for start in range(0, n, w):
                picked = [p for p in range(start, start + w) if (p - start) % r == h % r]
                pairs += len(picked) ** 2
    return pairs, n


@pytest.mark.parametrize("segs,rates,T,heads", [
    ([8, 16], [1, 2], 20, 4),     # 20 is no multiple of 8 or 16: runs at 32
    ([6, 12], [1, 4], 13, 2),     # 13 -> 24; two heads, offsets 0 and 1 of rate 4
    ([32], [4], 21, 4),           # shorter than the segment, not a multiple of the rate: 24, one segment
    ([8, 24], [2, 3], 50, 3),     # 50 -> 72 (lcm 24); three heads, rate 2: offsets 0, 1, 0
    ([16], [8], 5, 2),            # 5 -> 8: one dilated position per head
    ([4, 16, 64], [1, 2, 4], 64, 4),  # tiled: nothing padded
])
def test_dilated_flops_per_token_are_the_pairs_its_kernels_are_given(segs, rates, T, heads):
    cfg = registry.make_model_config("dilated_lm", "debug", {"segment_lengths": segs, "dilation_rates": rates,
                                                             "n_head": heads, "n_embd": 8 * heads,
                                                             "block_size": 128})
    with torch.device("meta"):
        model = DilatedLM(cfg)
    matmul = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    pairs, n = _given_pairs(T, segs, rates, heads)
    assert (n == T) == _tiles(T, segs, rates)
    # per pair and head dimension: 2 FLOPs for q.k and 2 for p.v, forward; backward twice that
    want = 6 * matmul + 12 * (cfg.n_embd // heads) * pairs * cfg.n_layer / T
    assert model.flops_per_token(T) == pytest.approx(want, abs=1.0)


def test_the_padded_positions_counted_are_the_ones_the_kernel_runs():
    """What the count assumes of the kernel: a causal sequence of 20 tokens under segments (8, 16) runs as 32
    tokens, the padded keys unseen by every real query (its outputs equal the unpadded brute force)."""
    branches = make_branches([8, 16], [1, 2])
    assert padded_length(20, branches) == _given_pairs(20, [8, 16], [1, 2], 4)[1] == 32
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = dilated_attention(q, k, v, branches, causal=True, fused=False)
    ref = reference_dilated(q, k, v, [8, 16], [1, 2], causal=True)
    assert torch.allclose(out, ref, atol=1e-10)



def test_a_pipelined_run_plans_its_autocast_stages_with_fp32_weights(monkeypatch, tmp_path):
    """``parallel.plan_stages`` (what ``dstrain plan`` runs for ``parallel.pp`` > 1) hands the run config's
    ``deepspeed.mixed_precision`` to the stage walk: a budget between the 16-bit and the fp32 ZeRO-1 bytes of
    the fullest stage fits DeepSpeed's bf16 and not autocast."""
    tiny = ROOT / "models" / "gpt" / "recipes" / "tiny.json"
    spec = registry.get_spec("gpt")

    def plan(mixed):
        cfg = load_run_config(tiny, [f"--output.dir={tmp_path}", f"--deepspeed.mixed_precision={mixed}",
                                     "--deepspeed.precision=bf16", "--parallel.pp=2", "--parallel.pp_partition=parameters",
                                     "--deepspeed.activation_checkpointing=false"])
        mcfg = registry.make_model_config("gpt", cfg.model.size, cfg.model.args)
        counts = spec.pipeline(mcfg, False).param_counts()
        monkeypatch.setattr(pipeline, "layer_activations", lambda *a: ([1] * len(counts), [1] * len(counts)))
        bounds, _ = pipeline.stage_split(spec.pipeline(mcfg, False), 2, "parameters")
        p = max(sum(counts[bounds[s]:bounds[s + 1]]) for s in range(2))
        budget = (4 * p + 12 * p / 2 + 8 * p + 12 * p / 2) / 2 + 1000  # between 16-bit (10p) and fp32 (14p)
        hw = Hardware("cuda", int(budget / 0.85), 1000 * GB, 8, True, True)
        return pipeline.plan_stages(spec, mcfg, cfg, ParallelDims.from_world(4, pp=2), hw, Activations(1, 1))

    assert plan("deepspeed")[1].profile == "zero1"
    with pytest.raises(PlanError, match="no profile fits"):
        plan("autocast")


def test_pp_auto_decides_on_the_autocast_bytes(monkeypatch, tmp_path):
    """``parallel.pp=auto`` first asks whether ZeRO-0/1/2 fits the whole model: under autocast that is the fp32
    row (ZeRO-2: 4P + 16P/N), not the 16-bit one (2P + 14P/N) it asked about before."""
    from dstrain.engine.factory import _auto_pp
    spec = registry.get_spec("gpt")
    monkeypatch.setattr(pipeline, "layer_activations", lambda spec, mcfg, seq: ([1] * 8, [1] * 8))

    def note(mixed):
        cfg = load_run_config(ROOT / "models" / "gpt" / "recipes" / "tiny.json",
                              [f"--output.dir={tmp_path}", f"--deepspeed.mixed_precision={mixed}",
                               "--deepspeed.precision=bf16", "--parallel.pp=auto"])
        mcfg = registry.make_model_config("gpt", cfg.model.size, cfg.model.args)
        P, N = 10 ** 9, 4
        budget = (2 * P + 14 * P / N + 4 * P + 16 * P / N) / 2  # between the two rows
        hw = Hardware("cuda", int(budget / cfg.deepspeed.margin), 1000 * GB, 8, True, True)
        return _auto_pp(spec, mcfg, cfg, ModelStats(P, 10 ** 6, 64, 4), hw, Activations(1, 1), N)[1]

    assert "ZeRO-0/1/2 fits the whole model" in note("deepspeed")
    assert "ZeRO-0/1/2 does not fit" in note("autocast")


# ---------------------------------------------------------------- a GPT-2 checkpoint's FLOPs per token

@pytest.mark.parametrize("tie", [True, False])
def test_gpt2_checkpoint_flops_per_token_count_its_conv1d_projections(tie, tmp_path):
    """PaLM's ``6 N + 12 L (heads x head_dim) T`` with ``N`` counted from GPT-2's ``config.json``: per layer the
    fused q/k/v projection ``d x 3d``, the attention output ``d x d``, the MLP ``d x n_inner`` and ``n_inner x d``
    (``n_inner`` 4d when unset), their biases (counted as dstrain counts Linear biases), and the output head
    ``vocab x d``. transformers builds GPT-2's four projections as ``Conv1D`` modules, not ``nn.Linear``."""
    c = _ARCHS["gpt2"][2]
    d, L, vocab = c["n_embd"], c["n_layer"], 300  # heads x head_dim = d; the tiny tokenizer has 300 ids
    inner = c.get("n_inner") or 4 * d
    per_layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
    N = L * per_layer + vocab * d
    model = build_policy(PolicyConfig(path=build_checkpoint("gpt2", str(tmp_path / "gpt2"), tie=tie)))
    for T in (1, 17, 64):
        assert model.flops_per_token(T) == 6 * N + 12 * L * d * T


# ---------------------------------------------------------------- GRPO's logged KL, clip fraction and entropy

@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_logged_kl_clip_fraction_and_entropy_against_their_definitions(loss_type):
    """Two passes (``num_iterations`` 2) over 8 rows in 4 micro-batches of 2, ragged completions and padding
    rows (weight 0; one micro-batch holds no trained token), temperature 0.7, a frozen reference. From the logits
    the policy produced at every forward, in float64:

    * ``kl``: TRL's (and DeepSeekMath's) k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` per completion token,
      its token mean over each micro-batch pass, averaged over the passes that hold a trained token;
    * ``clip_fraction``: TRL's, the share of the pass's trained tokens whose ratio ``exp(logp - old)`` the clip
      binds (above ``1 + eps_high`` with a positive advantage, below ``1 - eps_low`` with a negative one), likewise;
    * ``entropy``: the mean over every trained completion token of both passes of the entropy of
      ``softmax(logits / T)`` at the position predicting it (round 11's definition)."""
    from dstrain.rl import grpo_math as gm
    from dstrain.trainers import grpo_sampling as gs
    from dstrain.trainers.grpo_config import PolicyTaskConfig
    from tests.unit.test_grpo_dapo import _TinyLM, fake_step_trainer
    torch.manual_seed(4)
    B, T, GA, temp, eps_low, eps_high = 8, 9, 4, 0.7, 0.2, 0.28
    ids = torch.randint(1, 11, (B, T))
    starts = [3, 5, 2, 4, 3, 6, 2, 5]
    ends = [9, 7, 9, 6, 9, 9, 8, 9]
    cmask, attn = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for r in range(B):
        cmask[r, starts[r]:ends[r]] = 1
        attn[r, :ends[r]] = 1
    weights = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1.0])  # micro-batch 1 (rows 2, 3) trains nothing
    adv = torch.randn(B) * 2 * weights
    batch = {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask}
    sb = gs.StepBatch(batch, adv, weights, {}, {"generation": 0.01, "reward": 0.01}, 10)
    ref = torch.randn(B, T - 1) * 0.3 - 2.0
    tr = fake_step_trainer(loss_type, sb, GA)
    tr.engine = RecordingSGD(_TinyLM(), GA, lr=1.0)
    tr.task = PolicyTaskConfig(loss_type=loss_type, max_new_tokens=T, num_iterations=2, beta=0.05, temperature=temp,
                               epsilon=eps_low, epsilon_high=eps_high)
    tr.loss_cfg = gm.GRPOLossConfig(eps_low, eps_high, 0.05, loss_type, T)
    tr.reference = type("Ref", (), {"token_logprobs": lambda self, i, a, temperature: ref.clone()})()
    out = tr.train_step(0)

    mask = (cmask[:, 1:] * weights[:, None]).double()
    rows = [slice(m * 2, m * 2 + 2) for m in range(GA)]
    old = torch.cat([next_token(lg, ids[r], temp)[0] for lg, r in zip(tr.engine.scored, rows)])
    assert len(tr.engine.trained) == 2 * GA
    kls, clips, ent_sum = [], [], 0.0
    for n, logits in enumerate(tr.engine.trained):
        r = rows[n % GA]
        logp, ent = next_token(logits, ids[r], temp)
        m = mask[r]
        ent_sum += float((ent * m).sum())
        if m.sum() == 0:
            continue
        d = ref[r].double() - logp
        kls.append(float(((d.exp() - d - 1) * m).sum() / m.sum()))
        ratio, a = (logp - old[r]).exp(), adv[r, None].double()
        bound = ((ratio > 1 + eps_high) & (a > 0)) | ((ratio < 1 - eps_low) & (a < 0))
        clips.append(float((bound * m).sum() / m.sum()))
    assert len(kls) == 2 * (GA - 1)
    assert 0 < sum(clips) < len(clips)  # the second pass moved the policy past the clip on some tokens, not all
    assert out["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert out["clip_fraction"] == pytest.approx(sum(clips) / len(clips), rel=1e-6, abs=1e-9)
    assert out["entropy"] == pytest.approx(ent_sum / (2 * float(mask.sum())), rel=1e-5)
