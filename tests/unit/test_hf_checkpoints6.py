"""Real-world Hugging Face checkpoints, round 6: mixtures of experts, classifier heads, tokenizer-only folders.

On the tiny local checkpoints of ``tests/hf_checkpoints.py`` (nothing downloaded); the mixtures of experts are
Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE and OLMoE, top-2 of 4 experts (transformers 5 keeps a
layer's experts as one module of 3-D weights and converts the per-expert tensors of the files at load).

* ``output_router_logits: true`` in ``config.json`` (a MoE fine-tune that trained with the load-balancing loss):
  every generation of a left-padded batch failed inside transformers (``load_balancing_loss_func``: "The size of
  tensor a (8) must match the size of tensor b (384)": the mask covers every past token, the router logits only
  the new one), so GRPO died at its first rollout. Now dstrain's forwards and generation ask for no router logits;
  the export keeps the config as it was. Then on every MoE kind: KV-cached left-padded sampling scores as the
  no-cache training forward (also with a sliding window shorter than the padding), a supervised step trains,
  the export reloads with the same logits, a sharded bf16 copy loads the same weights (pinned).
* The router auxiliary loss was not added to any dstrain loss: ``dstrain plan`` said so where the config asks for
  it, with the parameters in all and those a token runs through (it is added since ``test_moe_router_loss.py``;
  the plan now names its coefficient).
* ``dstrain plan`` on any MoE checkpoint (fp32, as the policy recipes run) failed while tracing activations:
  ``torch._grouped_mm``'s shape rule accepts only bf16 while its CPU kernel runs fp32 ("Expected inputs of BF16
  type"). Now a planning build runs transformers' portable grouped matmul, which saves the same tensors.
* FLOPs per token (MFU of the SFT trainer and the benchmarks) counted ``nn.Linear`` weights only: the experts'
  3-D weights, most of a MoE, were missing. Now the share a token runs through (``num_experts_per_tok``) counts.
* ``router_jitter_noise`` (Mixtral's config: hidden states scaled by random factors before routing, in train
  mode): train-mode log-probs differed from the sampler's, silently, like dropout did. Now it is switched off.
* ZeRO-3 on 2 ranks, one expert of 8 per token (experts without tokens on a rank): no hang, since a layer's
  experts are one module that every rank gathers whole (DeepSpeed's ``set_z3_leaf_modules`` is for experts kept as
  separate modules); the slow test runs GRPO there on a sharded bf16 Qwen2-MoE and exports it.
* A classifier or reward model (``config.json`` ``architectures``: ``LlamaForSequenceClassification``) or an
  untied checkpoint saved without ``lm_head.weight``: loaded as a causal LM with a random output head (a
  transformers log table, nothing else) and trained from it. Now the first is refused when the config loads and
  any weight missing from the files is refused at load, naming it.
* A tokenizer folder of only ``tokenizer.json`` + ``tokenizer_config.json`` (no special-tokens map) whose chat
  template adds a default system prompt, with no pad token and ``padding_side: right``: the prompt carries the
  system turn, pad is EOS, batched generation equals one prompt at a time (pinned).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dstrain.config import ConfigError, load_run_config
from models.policy.config import PolicyConfig
from models.policy.generation import generate
from models.policy.model import build_policy
from models.policy.tokenizer import encode_prompt, load_tokenizer, use_chat_template
from tests.hf_checkpoints import available, build_checkpoint
from tests.unit.test_hf_checkpoints3 import cached_and_scored
from tests.unit.test_hf_checkpoints4 import scores_as_generated_and_trains

RECIPE = "models/policy/recipes/grpo_debug.json"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MOE = [k for k in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe") if k in available()]
WINDOWS = {"mixtral": {"sliding_window": 4}, "qwen2_moe": {"use_sliding_window": True, "sliding_window": 4}}


def load(path):
    cfg = PolicyConfig(path=str(path))
    return build_policy(cfg), load_tokenizer(cfg)


@pytest.mark.parametrize("kind", MOE)
def test_moe_with_router_logits_on_generates_scores_trains_and_exports(kind, tmp_path):
    import transformers

    from models.policy.reference import export_pretrained, full_state_dict

    path = build_checkpoint(kind, str(tmp_path / "ck"), pad=None, config=dict(output_router_logits=True))
    model, tok = load(path)
    scores_as_generated_and_trains(model, tok, ["x", "The quick brown fox jumps over", "def add(a, b):"])
    export_pretrained(full_state_dict(model), PolicyConfig(path=path), str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["output_router_logits"] is True  # left as it was
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids, output_router_logits=False).logits, model.eval()(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", [k for k in WINDOWS if k in MOE])
def test_moe_sliding_window_shorter_than_the_padding_scores_as_generated(kind, tmp_path):
    model, tok = load(build_checkpoint(kind, str(tmp_path / "ck"), pad=None, config=WINDOWS[kind]))
    cached, scored = cached_and_scored(model, tok, ["x", "The quick brown fox jumps over"], 6)  # 16 pads, window 4
    torch.testing.assert_close(cached, scored, atol=1e-4, rtol=0)


def test_sharded_bf16_moe_loads_the_experts_of_every_shard(tmp_path):
    whole = build_checkpoint("qwen2_moe", str(tmp_path / "a"), dtype=torch.bfloat16)
    sharded = build_checkpoint("qwen2_moe", str(tmp_path / "b"), dtype=torch.bfloat16, shard="20KB")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    a, b = load(whole)[0].state_dict(), load(sharded)[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _trace(path):
    from dstrain.engine import hardware
    from dstrain.engine.factory import _model_parts

    cfg = load_run_config(RECIPE, [f"--model.args.path={path}"])
    spec, mcfg = _model_parts(cfg)
    return hardware.trace_activations(lambda: spec.build(mcfg), lambda: spec.inputs_for_trace(mcfg, 1, 32),
                                      lambda m, flag: spec.parallelize(m, activation_checkpointing=flag))


def test_plan_traces_the_activations_of_a_moe_checkpoint(tmp_path):
    moe = _trace(build_checkpoint("mixtral", str(tmp_path / "moe")))
    dense = _trace(build_checkpoint("mistral", str(tmp_path / "dense")))  # the same model with one MLP per layer
    assert moe.per_sample > dense.per_sample > 0 and 0 < moe.per_sample_checkpointed < moe.per_sample


def test_flops_count_the_experts_a_token_runs_through(tmp_path):
    from torch import nn

    def counts(k):
        model = load(build_checkpoint("mixtral", str(tmp_path / f"k{k}"), config=dict(num_experts_per_tok=k)))[0]
        linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
        experts = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                      for layer in model.hf.model.layers)
        routers = sum(layer.mlp.gate.weight.numel() for layer in model.hf.model.layers)  # not nn.Linear modules
        return model.num_matmul_params(), linear + routers, experts

    for k in (1, 2, 4):  # of 4 experts
        got, linear, experts = counts(k)
        assert got == linear + experts * k // 4


def test_router_jitter_is_off_so_train_mode_scores_as_the_sampler(tmp_path):
    model, _ = load(build_checkpoint("mixtral", str(tmp_path / "ck"), config=dict(router_jitter_noise=0.5)))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        model.eval()
        sampler = model(ids)
        model.train()
        torch.testing.assert_close(model(ids), sampler, atol=1e-6, rtol=0)


def test_plan_notes_the_experts_and_the_router_loss_it_does_not_add(tmp_path):
    from dstrain.trainers.policy_rl import plan_notes

    def note(path):
        cfg = load_run_config(RECIPE, [f"--model.args.path={path}"])
        return [n for n in plan_notes(cfg, SimpleNamespace(precision="fp32")) if n.startswith("experts:")]

    (on,) = note(build_checkpoint("mixtral", str(tmp_path / "on"), config=dict(output_router_logits=True)))
    model = load(tmp_path / "on")[0]
    experts = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                  for layer in model.hf.model.layers)
    total = model.num_params()
    assert "(2 of 4 experts per token)" in on and f"{total:,} parameters, {total - experts // 2:,} of them used" in on
    assert f"one module ({experts // 2:,} parameters)" in on  # one layer's experts
    assert "added to the training loss with coefficient 0.001 (config.json output_router_logits=true, " \
           "router_aux_loss_coef=0.001)" in on  # added since test_moe_router_loss.py
    (off,) = note(build_checkpoint("qwen3_moe", str(tmp_path / "off")))
    assert "(2 of 4 experts per token)" in off and "load-balancing loss is not added (coefficient 0" in off
    assert note(build_checkpoint("llama", str(tmp_path / "dense"))) == []


def test_a_classifier_checkpoint_is_refused_when_the_config_loads(tmp_path):
    import transformers

    path = build_checkpoint("llama", str(tmp_path / "ck"))
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.num_labels = 1
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(path)  # a reward model, same tokenizer
    with pytest.raises(ConfigError, match="architectures names LlamaForSequenceClassification: a classifier or "
                                          "reward model"):
        load_run_config(RECIPE, [f"--model.args.path={path}"])
    base = build_checkpoint("llama", str(tmp_path / "base"))
    transformers.LlamaModel(cfg).save_pretrained(base)  # the body without any head: refused when it loads
    with pytest.raises(ValueError, match=r"\(lm_head.weight\) and would start random: config.json architectures "
                                         "names LlamaModel, not a causal language model"):
        build_policy(PolicyConfig(path=base))


def test_an_untied_checkpoint_without_its_output_head_is_refused_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    path = build_checkpoint("qwen2", str(tmp_path / "ck"), tie=False)
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 weight\(s\) of the causal LM are not in the checkpoint's files "
                                         r"\(lm_head.weight\) and would start random: an incomplete checkpoint"):
        build_policy(PolicyConfig(path=path))
    assert load(build_checkpoint("qwen2", str(tmp_path / "tied"), tie=True))[0]._tied()  # tied: nothing missing


def test_a_tokenizer_json_only_folder_with_a_system_prompt_template(tmp_path):
    path = build_checkpoint("qwen2", str(tmp_path / "ck"), pad=None, chat=True, padding_side="right")
    template = ("{%- if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>"
                "\n{%- endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    for name in os.listdir(path):
        if name.startswith(("special_tokens_map", "chat_template", "vocab", "merges")):
            os.remove(os.path.join(path, name))
    conf = json.load(open(os.path.join(path, "tokenizer_config.json")))
    json.dump({**conf, "chat_template": template}, open(os.path.join(path, "tokenizer_config.json"), "w"))
    cfg = PolicyConfig(path=path)
    model, tok = build_policy(cfg), use_chat_template(load_tokenizer(cfg), "on")
    assert tok.pad_token_id == tok.eos_token_id and tok.padding_side == "left"
    assert tok.decode(encode_prompt(tok, "add 1 and 2")) == ("<|im_start|>system\nYou are a helpful assistant."
                                                              "<|im_end|><|im_start|>user\nadd 1 and 2<|im_end|>\n"
                                                              "<|im_start|>assistant\n")
    prompts = ["x", "add 1 and 2, then print the sum"]
    batched = generate(model, tok, prompts, greedy=True, max_new_tokens=5)
    assert [c.completion_ids for c in batched] == [generate(model, tok, [q], greedy=True, max_new_tokens=5)[0]
                                                   .completion_ids for q in prompts]


@pytest.mark.slow
def test_grpo_zero3_two_ranks_on_a_sharded_bf16_moe_with_idle_experts(tmp_path):
    import transformers

    build_checkpoint("qwen2_moe", str(tmp_path / "ck"), dtype=torch.bfloat16, shard="20KB",
                     config=dict(num_experts=8, num_experts_per_tok=1, output_router_logits=True))
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", os.path.join(ROOT, RECIPE),
           "--model.args.path=ck", "--task.warm_start_steps=2", "--task.warm_start_batch=4", "--train.steps=2",
           "--checkpoint.every=2", "--task.num_generations=4", "--train.micro_batch=8", "--deepspeed.profile=zero3",
           "--task.n_eval=4", "--train.log_every=1", "--train.eval_every=0", "--output.dir=run"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "(1 of 8 experts per token)" in (tmp_path / "run" / "plan.txt").read_text()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "train/kl" in r)
    assert first["step"] == 1 and abs(first["train/kl"]) < 1e-6 and first["train/clip_fraction"] == 0.0, first
    res = subprocess.run([sys.executable, "-m", "dstrain.cli", "export", "run", "hf"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert again.config.num_experts == 8 and again.config.output_router_logits is True
    model, tok = load(tmp_path / "hf")
    assert generate(model, tok, ["x", "def add(a"], max_new_tokens=3, greedy=True)[1].completion_ids
