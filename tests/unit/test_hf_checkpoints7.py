"""Real-world Hugging Face checkpoints, round 7: hybrid and recurrent caches, multi-latent attention, more MoE routers.

On the tiny local checkpoints of ``tests/hf_checkpoints.py`` (nothing downloaded; transformers 5's PyTorch paths, no
``mamba_ssm`` or ``flash-linear-attention`` kernels): Mamba and Mamba-2 (no attention at all); the hybrids Jamba,
Bamba, Falcon-H1, Zamba2 (a shared attention block), RecurrentGemma (RG-LRU + local attention), LFM2 (short
convolutions), Qwen3-Next (gated delta-net linear attention + MoE), Granite-MoE-hybrid; DeepSeek-V2 and V3
(multi-latent attention, grouped top-k routers, shared experts), GLM-4-MoE, Ernie 4.5 MoE, GPT-OSS (attention sinks,
sliding-window layers, expert biases), Phi-MoE and Llama-4 text (chunked attention, a top-1 router).

* Left padding and recurrent state. Every kind but one masks it: completions sampled with the cache in a left-padded
  batch score, under GRPO's no-cache right-padded train-mode forward, as they were sampled (Zamba2 within 2e-4: its
  chunked scan and per-token step differ by that even unpadded). RecurrentGemma did not: its temporal convolution
  runs over the pads before a short prompt (its RG-LRU resets at position 0, the convolution does not), so that row
  was continued from another state than alone and scored 0.7 nats per token away from what was sampled, silently
  (GRPO's ratio and KL off from step one). Now ``generate`` runs the prompts of each length as their own batch for
  such a model (``LEFT_PADDING_LEAKS``); the others keep one left-padded batch.
* FLOPs per token (the SFT trainer's MFU, benchmarks): ``flops_per_token`` read ``num_attention_heads``, which
  Mamba's config lacks: SFT on a Mamba checkpoint died with an AttributeError before its first step. It also counted
  attention in every layer (twice the attention of a Jamba or Bamba with one attention layer in two, none of whose
  recurrent layers attend) and took DeepSeek's ``head_dim`` (its rotary part, 4 here) for its query/key and value
  heads (12 and 8 here). Now attention counts in the layers with an attention module only (a shared block in each
  layer calling it), with ``qk_nope + qk_rope`` and ``v_head_dim`` head sizes; 0 for Mamba. Dense kinds unchanged.
* Llama-4's experts module has no config, so all its experts counted as run per token (FLOPs of a dense model for a
  top-1 router); now the model's ``num_experts_per_tok`` counts. GPT-OSS's per-expert biases (``[experts, out]``)
  counted as router weights; now only the routers' do.
* PhiMoE's routers (SparseMixer) pick each expert by Gumbel sampling in train mode, and its ``router_jitter_noise``
  is no noise but the threshold that decides which experts share the softmax, in eval mode too. dstrain took it for
  jitter and set it to 0: the policy routed other than the checkpoint (its eval logits 2.4 away from transformers'
  own model here at 0.5; 0.01 in Phi-3.5-MoE), and only that made train mode deterministic. Now the threshold is
  kept and the routers route in train mode as in eval mode (gradients still reach them), as dropout is off.
* Router loss. DeepSeek-V2/V3, GLM-4-MoE and Llama-4 have ``output_router_logits`` but their forward computes no
  load-balancing loss (``aux_loss`` None): a config asking for one (Llama-4's ``router_aux_loss_coef``) made the plan
  say it was added with that coefficient while nothing was, and ``--model.args.router_aux_loss_coef=0.01`` was
  silently dropped. Now the default coefficient is 0 there, the plan says transformers computes none, and an
  explicit coefficient is refused at load. Ernie 4.5's ``moe_num_experts`` / ``moe_k`` were not read: ``dstrain
  plan`` said nothing of its experts and a router-loss coefficient was refused as "dense"; now both work.
* Held already (pinned here): load, a supervised step, export and reload with the same logits on every kind; a
  ``head_dim`` wider than hidden / heads with attention and MLP biases (cache and FLOPs as for any Llama);
  ``dstrain plan`` traces the activations of Mamba, RecurrentGemma and DeepSeek-V3 (grouped router, MLA); a layer's
  experts are one module (ZeRO-3 gathers it whole, the plan's largest module). GRPO 2 steps on 1 CPU rank and
  ``dstrain export`` ran by hand on RecurrentGemma, DeepSeek-V3, Mamba, GPT-OSS, Qwen3-Next, Llama-4, Jamba, Zamba2,
  Granite-MoE-hybrid, Ernie 4.5 MoE and LFM2 (not repeated here: each takes minutes on 2 shared cores).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from models.policy.config import PolicyConfig
from models.policy.generation import generate, pack
from models.policy.model import build_policy, token_logprobs
from models.policy.tokenizer import load_tokenizer
from tests.hf_checkpoints import available, build_checkpoint

RECIPE = "models/policy/recipes/grpo_debug.json"
RECURRENT = ["mamba", "mamba2", "jamba", "bamba", "falcon_h1", "zamba2", "recurrent_gemma", "lfm2", "qwen3_next",
             "granitemoehybrid"]
OTHERS = ["deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe", "gpt_oss", "phimoe", "llama4"]
KINDS = [k for k in RECURRENT + OTHERS if k in available()]
PROMPTS = ["x", "The quick brown fox jumps over", "def add(a, b):"]  # 1, 17 and 5 tokens


def load(path, **kw):
    cfg = PolicyConfig(path=str(path), **kw)
    return build_policy(cfg), load_tokenizer(cfg)


def sampled_and_scored(model, tok, prompts, **kw):
    """Completions from dstrain's ``generate`` and, per completion, (the log-probs of its tokens under the logits the
    KV-cached generation sampled from, those of GRPO's no-cache scoring: right-padded rows, train mode). The
    generation's logits are read per prompt, whatever batches ``generate`` made of them."""
    seen = {}
    real = model.hf.generate

    def spy(input_ids, attention_mask, generation_config, **k):
        generation_config.output_logits, generation_config.return_dict_in_generate = True, True
        out = real(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config, **k)
        steps = torch.stack(out.logits, 1).float().log_softmax(-1)
        for j in range(len(input_ids)):
            seen[tuple(input_ids[j][attention_mask[j].bool()].tolist())] = steps[j]
        return out.sequences

    model.hf.generate = spy
    try:
        out = generate(model, tok, prompts, **kw)
    finally:
        del model.hf.generate
    p = pack(out, tok.pad_token_id)
    model.train()
    with torch.no_grad():
        lp = token_logprobs(model(p["input_ids"], attention_mask=p["attention_mask"]), p["input_ids"])
    pairs = []
    for i, c in enumerate(out):
        ids = torch.tensor(c.completion_ids)
        cached = seen[tuple(c.prompt_ids)][torch.arange(len(ids)), ids]
        start = len(c.prompt_ids) - 1
        pairs.append((cached, lp[i, start:start + len(ids)]))
    return out, pairs


@pytest.mark.parametrize("kind", KINDS)
def test_kind_samples_left_padded_as_it_scores_trains_and_exports(kind, tmp_path):
    import transformers

    from dstrain.trainers.policy_rl import supervised_step
    from models.policy.reference import export_pretrained, full_state_dict

    path = build_checkpoint(kind, str(tmp_path / "ck"), pad=None)
    model, tok = load(path)
    out, pairs = sampled_and_scored(model, tok, PROMPTS[:2], max_new_tokens=4, seed=3)  # 16 pads before "x"
    assert len(out) == 2 and all(len(c.completion_ids) for c in out)
    for cached, scored in pairs:  # each row was sampled as if alone: the no-cache forward agrees
        torch.testing.assert_close(cached, scored, atol=2e-4 if kind == "zamba2" else 1e-4, rtol=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = SimpleNamespace(prompt="def add(a, b):\n", reference="    return a + b", stop=["\n"])
    loss = supervised_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tok, [task])
    assert loss > 0 and any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    export_pretrained(full_state_dict(model), PolicyConfig(path=path), str(tmp_path / "out"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model.eval()(ids), atol=1e-5, rtol=0)


def test_recurrent_gemma_generates_each_prompt_length_unpadded(tmp_path):
    model, tok = load(build_checkpoint("recurrent_gemma", str(tmp_path / "ck"), pad=None))
    batches = []
    real = model.hf.generate
    model.hf.generate = lambda **k: batches.append(k["attention_mask"].clone()) or real(**k)
    try:
        out = generate(model, tok, PROMPTS, num_samples=2, max_new_tokens=4, greedy=True)
    finally:
        del model.hf.generate
    assert len(batches) == 3 and all(bool(m.all()) and len(m) == 2 for m in batches)  # no pads, one length each
    assert [(c.index, c.sample) for c in out] == [(i, s) for i in range(3) for s in range(2)]  # prompt-major still
    alone = [generate(model, tok, [p], max_new_tokens=4, greedy=True)[0].completion_ids for p in PROMPTS]
    assert [c.completion_ids for c in out[::2]] == alone
    from models.policy.generation import left_padding_leaks

    dense, _ = load(build_checkpoint("llama", str(tmp_path / "dense"), pad=None))
    assert left_padding_leaks(model.hf) and not left_padding_leaks(dense.hf)


def _flops_parts(kind, tmp_path, **config):
    """(flops_per_token at 32 and at 33 tokens, the model): the difference is the attention of one more token."""
    model, _ = load(build_checkpoint(kind, str(tmp_path / kind), pad=None, config=config or None))
    return model.flops_per_token(32), model.flops_per_token(33), model


def test_flops_count_attention_where_there_is_attention(tmp_path):
    a, b, model = _flops_parts("mamba", tmp_path)  # no attention: the weights alone
    assert a == b == 6 * model.num_matmul_params()
    a, b, model = _flops_parts("jamba", tmp_path)  # attention in one layer of two: 4 heads of 8
    assert b - a == 6 * 1 * 4 * (8 + 8)
    a, b, model = _flops_parts("zamba2", tmp_path)  # its shared attention block, called by its one hybrid layer
    assert b - a == 6 * 1 * 4 * (16 + 16)
    a, b, model = _flops_parts("deepseek_v3", tmp_path)  # MLA: q/k heads of 8 + 4, value heads of 8, both layers
    assert b - a == 6 * 2 * 4 * (12 + 8)
    a, b, model = _flops_parts("llama", tmp_path)  # a dense model as before: 12 x layers x heads x head_dim
    assert b - a == 12 * 2 * 4 * 8


def test_flops_count_the_experts_a_llama4_token_runs_through(tmp_path):
    from models.policy.moe import expert_modules, expert_params

    model, _ = load(build_checkpoint("llama4", str(tmp_path / "ck"), pad=None))  # top-1 of 4, one MoE layer of 2
    total = sum(p.numel() for _, w in expert_modules(model.hf) for p in w)
    assert expert_params(model.hf) == (total, total // 4)


def test_gpt_oss_expert_biases_are_not_router_weights(tmp_path):
    from models.policy.moe import router_params

    model, _ = load(build_checkpoint("gpt_oss", str(tmp_path / "ck"), pad=None))
    routers = sum(layer.mlp.router.weight.numel() for layer in model.hf.model.layers)
    assert router_params(model.hf) == routers


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "llama4"])
def test_router_loss_of_a_model_that_computes_none_is_not_claimed(kind, tmp_path):
    from dstrain.config import load_run_config
    from dstrain.trainers.policy_rl import experts_note

    path = build_checkpoint(kind, str(tmp_path / "ck"), pad=None,
                            config={"output_router_logits": True, "router_aux_loss_coef": 0.001})
    model, _ = load(path)
    assert model.router_aux_coef == 0.0  # nothing would be added: the forward's aux_loss is None
    note = experts_note(load_run_config(RECIPE, [f"--model.args.path={path}"]))
    assert "is not added" in note and "computes no load-balancing loss" in note
    with pytest.raises(ValueError, match="computes no router load-balancing loss"):
        load(path, router_aux_loss_coef=0.01)


def test_ernie_moe_is_seen_as_a_mixture_of_experts(tmp_path):
    from dstrain.config import load_run_config
    from dstrain.trainers.policy_rl import experts_note

    path = build_checkpoint("ernie4_5_moe", str(tmp_path / "ck"), pad=None)
    with open(f"{path}/config.json") as f:
        assert json.load(f)["moe_num_experts"] == 4
    note = experts_note(load_run_config(RECIPE, [f"--model.args.path={path}"]))
    assert note and "(2 of 4 experts per token)" in note
    model, _ = load(path, router_aux_loss_coef=0.01)
    assert model.router_aux_coef == 0.01
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model(ids, ids)
    assert model.router_aux_loss is not None and model.router_aux_loss.requires_grad


@pytest.mark.parametrize("kind", ["mamba", "recurrent_gemma", "deepseek_v3"])
def test_plan_traces_the_activations(kind, tmp_path):
    from tests.unit.test_hf_checkpoints6 import _trace

    traced = _trace(build_checkpoint(kind, str(tmp_path / kind), pad=None))
    assert traced.per_sample > 0 and 0 < traced.per_sample_checkpointed <= traced.per_sample


def test_head_dim_wider_than_hidden_over_heads_with_biases(tmp_path):
    from tests.unit.test_hf_checkpoints3 import cached_and_scored

    model, tok = load(build_checkpoint("llama", str(tmp_path / "ck"), pad=None,
                                       config={"head_dim": 16, "attention_bias": True, "mlp_bias": True}))
    assert model.hf.model.layers[0].self_attn.q_proj.weight.shape == (64, 32)  # 4 heads of 16 on a width of 32
    cached, scored = cached_and_scored(model, tok, PROMPTS[:2], 6)
    torch.testing.assert_close(cached, scored, atol=1e-4, rtol=0)
    assert model.flops_per_token(33) - model.flops_per_token(32) == 12 * 2 * 4 * 16


def test_phimoe_routes_in_train_mode_as_the_sampler_and_as_the_checkpoint(tmp_path):
    import transformers

    path = build_checkpoint("phimoe", str(tmp_path / "ck"), pad=None, config={"router_jitter_noise": 0.5})
    model, _ = load(path)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    own = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        sampler = model.eval()(ids)
        torch.testing.assert_close(sampler, own(ids).logits, atol=1e-5, rtol=0)  # the checkpoint's routing
        model.train()
        for seed in range(3):  # train mode: no Gumbel sampling of the experts
            torch.manual_seed(seed)
            torch.testing.assert_close(model(ids), sampler, atol=1e-5, rtol=0)
    model.train()
    model(ids, ids).backward()
    assert all(layer.mlp.router.weight.grad.abs().sum() > 0 for layer in model.hf.model.layers)
