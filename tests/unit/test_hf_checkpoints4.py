"""Real-world Hugging Face checkpoints, round 4: more architectures, SentencePiece tokenizers, paths, adapters.

What was tried, on the tiny local checkpoints of ``tests/hf_checkpoints.py`` (tokenizers trained here with
``tokenizers``, nothing downloaded), and what happens now:

* Architectures: Gemma-2 (attention and final soft-capping, sliding window, tied), Gemma-3 text, Qwen3, StableLM,
  Falcon (new decoder), GPT-J, Bloom and MPT (ALiBi), Cohere (logit_scale, tied), OLMo-2, Granite (its four
  multipliers), SmolLM3 (layers without rotary, tied), GPT-BigCode. Gemma-2, Bloom and MPT did not load at
  all: dstrain asked transformers for SDPA attention, which they lack ("does not support an attention
  implementation through torch.nn.functional.scaled_dot_product_attention"). Now such an architecture gets
  transformers' eager attention (``attention_implementation``). On every one: the log-probs of tokens sampled
  with the KV cache in a left-padded batch (prompts of 1 to 7 tokens) equal the no-cache, right-padded,
  train-mode scoring GRPO trains on (so each row was generated as if alone), a supervised (warm-start) step
  trains, and the export loads with ``AutoModelForCausalLM`` giving the same logits.
* Learned absolute positions (GPT-2, GPT-BigCode, OPT) past the checkpoint's ``n_positions``: an
  ``IndexError: index out of range in self`` from the embedding (a device-side assert on a GPU). Now
  generation and the forward refuse it, naming the limit and the length.
* SentencePiece-style tokenizers (Unigram and BPE with byte fallback, ``Metaspace``, the decoder that strips the
  first space, as Llama-2/Mistral/Gemma ship): a completion's ``text`` was decoded on its own, so it lost its
  first space: an indented code line came back one column short (``"   return a"`` for ``"    return a"``),
  breaking the Python it was meant to be. Now the text is read after the prompt's last tokens (also where a
  stop string cuts it, and for vLLM). Byte fallback round-trips non-ASCII text; ``model_max_length``
  smaller than prompt + completion truncates nothing (pinned).
* A byte-level tokenizer with ``add_prefix_space``: the supervised warm start encoded each reference
  completion on its own, with a space in front that is not in the reference (its ids decoded to
  ``" b)"`` for ``"b)"``). Now the target is encoded as a continuation (``encode_continuation``).
* ``--model.args.path`` relative, with a trailing slash, or ``~/...``: kept as typed (``~`` never expanded:
  "no config.json there"), so ``dstrain export`` and ``--resume`` from another directory could not find it
  (a warm-start folder under a relative ``output.dir`` alike). Now made absolute when the run config
  loads; a symlink is kept as named.
* A PEFT/LoRA adapter folder (``adapter_config.json``, no ``config.json``; peft is not installed here): "not a
  Hugging Face checkpoint directory". Now the refusal says it is an adapter and how to merge it.
* ``generation_config.json`` with ``do_sample``, ``temperature``, ``top_k``, ``repetition_penalty``,
  ``forced_eos_token_id``, ``suppress_tokens``, ``bad_words_ids``: ignored (generation blanks it), silently.
  Now ``dstrain plan`` (and ``plan.txt``) names each ignored setting.
* Activation checkpointing on a loaded checkpoint: training forwards and gradients are unchanged and generation
  still uses its KV cache (pinned); slow: GRPO on 2 ranks at ZeRO-3 with checkpointing on the Gemma-2
  checkpoint, launched from another directory with a relative path, then exported.
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
from models.policy.generation import generate, pack
from models.policy.model import build_policy, token_logprobs
from models.policy.tokenizer import encode_prompt, load_tokenizer
from tests.hf_checkpoints import available, build_checkpoint, build_tokenizer

RECIPE = "models/policy/recipes/grpo_debug.json"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["x", "The quick brown fox jumps over", "def add(a, b):"]
NEW = ["gemma2", "gemma3", "qwen3", "stablelm", "falcon", "gptj", "bloom", "mpt", "cohere", "olmo2", "granite",
       "smollm3", "gpt_bigcode"]
TIED = {"gemma2", "gemma3", "cohere", "smollm3"}


def load(path):
    cfg = PolicyConfig(path=str(path))
    return build_policy(cfg), load_tokenizer(cfg)


def generation_logprobs(model, tok, prompts, **kw):
    """Sampled completions and, per completion, the log-prob of each of its tokens under the generation's own
    (KV-cached, left-padded) logits."""
    steps = []
    hook = model.hf.register_forward_hook(lambda m, i, o: steps.append(o.logits[:, -1].float().log_softmax(-1)))
    try:
        out = generate(model, tok, prompts, **kw)
    finally:
        hook.remove()
    lp = torch.stack(steps, 1)
    return out, [[lp[i, j, t].item() for j, t in enumerate(c.completion_ids)] for i, c in enumerate(out)]


def scores_as_generated_and_trains(model, tok, prompts) -> None:
    """Completions sampled with the KV cache from ``prompts`` left-padded together, scored as GRPO scores them (no
    cache, right-padded rows, train mode), have the log-probs they were sampled with (each row generated as if
    alone); then one warm-start step (``supervised_step``) has a positive loss and changes the weights."""
    from dstrain.trainers.policy_rl import supervised_step

    sampled, gen_lp = generation_logprobs(model, tok, prompts, num_samples=2, max_new_tokens=5, seed=3)
    p = pack(sampled, tok.pad_token_id)
    model.train()
    lp = token_logprobs(model(p["input_ids"], attention_mask=p["attention_mask"]), p["input_ids"])
    for i, c in enumerate(sampled):
        start = len(c.prompt_ids) - 1
        torch.testing.assert_close(lp[i, start:start + len(c.completion_ids)], torch.tensor(gen_lp[i]),
                                   atol=1e-4, rtol=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = SimpleNamespace(prompt="def add(a, b):\n", reference="    return a + b", stop=["\n"])
    loss = supervised_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tok, [task])
    assert loss > 0 and any(not torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("kind", [k for k in NEW if k in available()])
def test_architecture_generates_scores_trains_and_exports(kind, tmp_path):
    import transformers

    from models.policy.reference import export_pretrained, full_state_dict

    path = build_checkpoint(kind, str(tmp_path / "ck"), pad=None, tie=True if kind in TIED else None)
    model, tok = load(path)
    # sampled with the KV cache, prompts of 1..7 tokens left-padded together; scored as GRPO does (no cache,
    # right-padded rows, train mode): the same log-probs, so each row was generated as if alone
    scores_as_generated_and_trains(model, tok, PROMPTS)
    export_pretrained(full_state_dict(model), PolicyConfig(path=path), str(tmp_path / "out"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model.eval()(ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", [k for k in ("gpt2", "gpt_bigcode", "opt") if k in available()])
def test_learned_positions_past_the_table_are_refused_naming_the_limit(kind, tmp_path):
    size = {"gpt2": "n_positions", "gpt_bigcode": "n_positions", "opt": "max_position_embeddings"}[kind]
    model, tok = load(build_checkpoint(kind, str(tmp_path / "ck"), pad=None, config={size: 16}))
    prompt = "def add(a"
    n = len(encode_prompt(tok, prompt))
    assert n < 10
    with pytest.raises(ValueError, match="is 17 tokens, past the 16 positions"):  # was an IndexError
        generate(model, tok, [prompt], max_new_tokens=17 - n, greedy=True)
    assert len(generate(model, tok, [prompt], max_new_tokens=16 - n, greedy=True)[0].prompt_ids) == n
    with pytest.raises(ValueError, match="is 17 tokens, past the 16 positions"):
        model(torch.arange(5, 22)[None])
    assert model(torch.arange(5, 21)[None]).shape[:2] == (1, 16)


def forced(model, ids):
    """Make ``model`` emit exactly ``ids`` (then whatever), one per generation step."""
    calls = []

    def hook(module, args, out):
        bias = torch.full_like(out, -1e4)
        bias[..., ids[min(len(calls), len(ids) - 1)]] = 1e4
        calls.append(1)
        return out + bias
    return model.hf.lm_head.register_forward_hook(hook)


@pytest.mark.parametrize("sp", ["unigram", "bpe"])
def test_sentencepiece_tokenizer_keeps_the_first_space_of_a_completion(sp, tmp_path):
    path = build_checkpoint("llama", str(tmp_path / "ck"), sp=sp)
    tcfg = json.load(open(os.path.join(path, "tokenizer_config.json")))
    tcfg["model_max_length"] = 4  # shorter than every prompt + completion here: nothing is truncated for it
    json.dump(tcfg, open(os.path.join(path, "tokenizer_config.json"), "w"))
    model, tok = load(path)
    assert tok.pad_token_id == tok.eos_token_id and tok.model_max_length == 4
    text = "héllo ☃ x = 1"  # not in the training text: byte fallback
    assert encode_prompt(tok, text)[0] == tok.bos_token_id and tok.decode(encode_prompt(tok, text)[1:]) == text
    sampled, gen_lp = generation_logprobs(model, tok, PROMPTS, num_samples=2, max_new_tokens=5, seed=3)
    p = pack(sampled, tok.pad_token_id)
    lp = token_logprobs(model(p["input_ids"], attention_mask=p["attention_mask"]), p["input_ids"])
    for i, c in enumerate(sampled):
        start = len(c.prompt_ids) - 1
        torch.testing.assert_close(lp[i, start:start + len(c.completion_ids)], torch.tensor(gen_lp[i]),
                                   atol=1e-4, rtol=0)
    prompt, body = "def add(a, b):\n", "    return a + b"
    head = encode_prompt(tok, prompt)
    whole = encode_prompt(tok, prompt + body + "\nx")
    assert whole[:len(head)] == head
    rest = whole[len(head):]
    assert tok.decode(rest[:1]) == ""  # the first "▁" alone decodes to nothing: the space lives in context
    outs = []
    for stop in ((), ["\n"]):
        hook = forced(model, rest + [tok.eos_token_id])
        try:
            outs.append(generate(model, tok, [prompt], max_new_tokens=len(rest) + 2, greedy=True, stop=stop)[0])
        finally:
            hook.remove()
    ended, cut = outs
    assert ended.completion_ids == rest + [tok.eos_token_id] and ended.finished
    assert ended.text == body + "\nx"  # was "   return a + b\nx": one column short
    assert cut.text == body and cut.stop == "\n"
    assert len(encode_prompt(tok, prompt + body)) > tok.model_max_length  # not truncated to 4


def test_warm_start_targets_of_an_add_prefix_space_tokenizer_gain_no_space():
    from dstrain.trainers.policy_rl import supervised_batch

    tok = build_tokenizer(pad=None)
    tok.backend_tokenizer.pre_tokenizer.add_prefix_space = True  # as saved by a tokenizer with add_prefix_space
    assert tok.decode(tok("b)", add_special_tokens=False)["input_ids"]) == " b)"
    for target in ("b)", "return a + b\n", "    return a"):
        x, y = supervised_batch(tok, ["def add(a, "], [target])
        assert tok.decode([t for t in y[0].tolist() if t != -100]) == target  # was " b)", " return a + b\n"
    from models.policy.tokenizer import encode_continuation

    plain = build_tokenizer(pad=None)  # a text that starts with its own space keeps it, as encoded plainly
    assert encode_continuation(plain, " b)") == plain(" b)", add_special_tokens=False)["input_ids"]


def test_checkpoint_path_is_made_absolute_when_the_run_config_loads(tmp_path, monkeypatch):
    from dstrain.trainers.policy_rl import with_model_path

    path = build_checkpoint("qwen2", str(tmp_path / "ck"), pad="<|endoftext|>")
    os.symlink(path, tmp_path / "link")
    monkeypatch.chdir(tmp_path)
    recipe = os.path.join(ROOT, RECIPE)
    for given, want in (("ck", path), ("ck/", path), ("./link", str(tmp_path / "link"))):
        cfg = load_run_config(recipe, [f"--model.args.path={given}"])
        assert cfg.model.args["path"] == want  # was kept as typed: relative to this directory only
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_run_config(recipe, ["--model.args.path=~/ck"]).model.args["path"] == path  # was refused
    assert with_model_path(cfg, "runs/x/warm_start").model.args["path"] == str(tmp_path / "runs/x/warm_start")
    monkeypatch.chdir(ROOT)
    model, _ = load(cfg.model.args["path"])  # the symlink still loads, from anywhere
    assert model.weights_loaded


def test_a_lora_adapter_folder_is_refused_as_an_adapter(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8,
                                                            "base_model_name_or_path": str(tmp_path / "base")}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="PEFT .LoRA. adapter .* merge_and_unload"):
        load_run_config(RECIPE, [f"--model.args.path={folder}"])


def test_plan_names_the_generation_settings_dstrain_ignores(tmp_path):
    from dstrain.trainers.policy_rl import plan_notes

    path = build_checkpoint("llama", str(tmp_path / "ck"), pad=None, generation=dict(
        do_sample=True, temperature=0.6, top_k=20, repetition_penalty=1.3, forced_eos_token_id=1,
        suppress_tokens=[5, 6], bad_words_ids=[[7]]))
    cfg = load_run_config(RECIPE, [f"--model.args.path={path}"])
    notes = plan_notes(cfg, SimpleNamespace(precision="fp32"))
    line = next(n for n in notes if n.startswith("generation:"))
    for setting in ("do_sample=True", "temperature=0.6", "top_k=20", "repetition_penalty=1.3", "forced_eos_token_id=1",
                    "suppress_tokens=[5, 6]", "bad_words_ids=[[7]]", "the ids it suppresses or bans can be sampled"):
        assert setting in line
    plain = build_checkpoint("llama", str(tmp_path / "plain"), pad=None)
    assert not [n for n in plan_notes(load_run_config(RECIPE, [f"--model.args.path={plain}"]),
                                      SimpleNamespace(precision="fp32")) if n.startswith("generation:")]


def test_activation_checkpointing_keeps_gradients_and_the_generation_cache(tmp_path):
    path = build_checkpoint("gemma2", str(tmp_path / "ck"), pad=None, tie=True)
    plain, tok = load(path)
    ckpt, _ = load(path)
    ckpt.set_activation_checkpointing(True)
    assert ckpt.activation_checkpointing
    ids = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11]])
    for m in (plain, ckpt):
        m.train()
        m(ids[:, :-1], ids[:, 1:]).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0, msg=name)
    lengths = []
    hook = ckpt.hf.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]),
                                            with_kwargs=True)
    try:
        out = generate(ckpt, tok, ["def add(a"], max_new_tokens=4, greedy=True)[0]
    finally:
        hook.remove()
    assert lengths[1:] == [1] * (len(lengths) - 1)  # one new token per step: the KV cache is used
    assert out.completion_ids == generate(plain, tok, ["def add(a"], max_new_tokens=4, greedy=True)[0].completion_ids
    assert ckpt.training  # and back in train mode, checkpointing on


@pytest.mark.slow
def test_grpo_zero3_two_ranks_with_checkpointing_on_gemma2_from_another_directory(tmp_path):
    import transformers

    build_checkpoint("gemma2", str(tmp_path / "ck"), sp="bpe", tie=True, generation=dict(
        do_sample=True, top_k=64, suppress_tokens=[5]))
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", os.path.join(ROOT, RECIPE),
           "--model.args.path=ck/", "--task.warm_start_steps=2", "--task.warm_start_batch=4", "--train.steps=2",
           "--checkpoint.every=2", "--task.num_generations=4", "--train.micro_batch=8",
           "--deepspeed.profile=zero3", "--deepspeed.activation_checkpointing=true", "--task.n_eval=4",
           "--train.log_every=1", "--train.eval_every=0", "--output.dir=run"]
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=ROOT)
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "incompatible with gradient checkpointing" not in res.stdout + res.stderr  # no use_cache clash
    plan = (tmp_path / "run" / "plan.txt").read_text()
    assert "top_k=64" in plan and "suppress_tokens=[5]" in plan
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "train/kl" in r)  # sampler, scorer and reference agree at step 1
    assert first["step"] == 1 and abs(first["train/kl"]) < 1e-6 and first["train/clip_fraction"] == 0.0, first
    res = subprocess.run([sys.executable, "-m", "dstrain.cli", "export", str(tmp_path / "run"), str(tmp_path / "hf")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # another directory
    assert res.returncode == 0, res.stderr[-3000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert again.config.model_type == "gemma2" and again.config.attn_logit_softcapping == 5.0
    model, tok = load(tmp_path / "hf")
    assert generate(model, tok, ["x"], max_new_tokens=3, greedy=True)[0].prompt_ids[0] == tok.bos_token_id
