"""Real-world Hugging Face checkpoints, round 3: weight formats and dtypes, custom code, vocabularies, rotary scaling.

What was tried, on the tiny local checkpoints of ``tests/hf_checkpoints.py`` (byte-level BPE tokenizers
trained here, nothing downloaded), and what happens now:

* Weights saved in bf16 or fp16 (``config.json`` ``dtype``): loaded and trained in fp32 (the master
  weights DeepSpeed's bf16 mode keeps too), as before. ``export_pretrained`` wrote them back in fp32:
  twice the size of what the user brought, with ``dtype: float32`` in the config. Now the export keeps
  the dtype the source checkpoint declares; fp32 where it declares none. A GRPO/SCoRe warm start
  writes its folder in fp32 (the next phase trains those exact weights) and records the source dtype
  (``dstrain_export_dtype``), so a run that started from it exports bf16 too. ``dstrain plan`` and
  ``plan.txt`` said nothing of the checkpoint's dtype; now one note says it (and cautions against
  fp16 for a bf16 checkpoint: activations learnt in bf16's range may overflow fp16's).
* A sharded checkpoint (``model.safetensors.index.json`` + shards) and one with only ``pytorch_model.bin``
  loaded the same weights already (pinned). A folder with no weights, or a sharded copy missing a
  shard (an interrupted download), passed the run config and failed in transformers inside every
  rank. Now the config check refuses it in one line naming the folder, before any rank starts.
* A config whose architecture exists only as code in the checkpoint (``auto_map``, a ``model_type``
  transformers does not have) passed the config check, then transformers asked "Do you wish to run
  the custom code? [y/N]" inside each rank (a hang under a launcher, or an error pointing at
  ``https://hf.co/<folder>``); a tokenizer with ``auto_map`` and a class transformers lacks, alike.
  dstrain has no flag to run a checkpoint's code: both are refused when the config loads, naming
  ``trust_remote_code`` and saying that nothing is downloaded. ``auto_map`` on an architecture or
  tokenizer class transformers has (early Phi-3 uploads) still loads with transformers' code.
* A pad token added to the tokenizer without resizing the model (pad id == vocab_size): every
  left-padded generation batch failed with ``IndexError: index out of range in self``. Now the
  pad becomes the EOS token (padded positions are masked; only their ids must exist). Any other
  id past the embedding (a tokenizer larger than ``vocab_size``) is refused at load, naming both
  sizes; before, it failed only once a prompt held such an id.
* Rotary scaling: ``linear``, ``llama3`` and ``yarn`` ``rope_scaling``, Mistral's ``sliding_window``
  shorter than prompt + completion, Qwen2's ``use_sliding_window``, Phi-3's ``sliding_window``:
  log-probs of tokens generated with the KV cache equal the no-cache scoring GRPO trains on
  (pinned). ``dynamic`` (NTK) scaling past ``max_position_embeddings`` did not: the cached sampling
  and the scoring differed by up to a nat per token, silently, so GRPO's ratio and KL were off
  from the first step (``longrope`` switches its factors at a length in the same way). Now
  ``generate`` (hf and vLLM) refuses a batch whose prompt + ``max_new_tokens`` passes that length.
* ``generation_config.json`` with its own sampling settings: the task's settings win and the rest are
  ignored (already so, ``tests/unit/test_policy.py``; README now says it). A tokenizer that appends
  EOS (``add_eos_token=True``): no EOS inside prompts, warm-start rows or corpus documents (pinned).
* Slow: GRPO at ZeRO-3 on 2 ranks on a bf16, sharded, untied, llama3-scaled checkpoint: KL 0 and no
  clipping at step 1; the export is bf16, untied, and scores as the trained weights rounded to bf16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dstrain.config import ConfigError, load_run_config
from models.policy.config import PolicyConfig
from models.policy.generation import Completion, generate, pack
from models.policy.model import build_policy, token_logprobs
from models.policy.tokenizer import CorpusTokenizer, encode_prompt, load_tokenizer
from tests.hf_checkpoints import available, build_checkpoint

pytestmark = pytest.mark.skipif(not {"llama", "qwen2", "mistral"} <= set(available()),
                                reason="transformers lacks Llama, Qwen2 or Mistral")
RECIPE = "models/policy/recipes/grpo_debug.json"
LLAMA = dict(pad=None, bos="<s>", add_bos=True, eos="</s>")


def load(path):
    cfg = PolicyConfig(path=str(path))
    return build_policy(cfg), load_tokenizer(cfg)


def refusal(path) -> str:
    with pytest.raises(ConfigError) as err:
        load_run_config(RECIPE, [f"--model.args.path={path}"])
    assert "model.args.path" in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_checkpoint_trains_in_fp32_and_exports_in_its_own_dtype(dtype, tmp_path):
    from safetensors import safe_open

    from models.policy.reference import export_pretrained, full_state_dict

    path = build_checkpoint("llama", str(tmp_path / "ck"), dtype=dtype, **LLAMA)
    assert json.load(open(os.path.join(path, "config.json")))["dtype"] == str(dtype)[6:]
    model, _ = load(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the master weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.013)  # a step that bf16/fp16 rounding alone would not reproduce
    export_pretrained(full_state_dict(model), PolicyConfig(path=path), str(tmp_path / "out"))
    assert json.load(open(tmp_path / "out" / "config.json"))["dtype"] == str(dtype)[6:]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}
    again, _ = load(tmp_path / "out")
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    rounded = build_policy(PolicyConfig(path=path)).eval()
    rounded.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
    torch.testing.assert_close(again.eval()(ids), rounded(ids))


def test_a_warm_start_of_a_bf16_checkpoint_keeps_fp32_weights_and_exports_bf16(tmp_path):
    from models.policy.reference import export_pretrained, full_state_dict, save_pretrained

    path = build_checkpoint("llama", str(tmp_path / "ck"), dtype=torch.bfloat16, **LLAMA)
    model, tok = load(path)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.013)
    save_pretrained(model, str(tmp_path / "warm"), tok)  # as the GRPO/SCoRe warm start writes its folder
    warm, _ = load(tmp_path / "warm")  # what the run then trains: the warm start's fp32 weights, unrounded
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), warm.state_dict().values()))
    export_pretrained(full_state_dict(warm), PolicyConfig(path=str(tmp_path / "warm")), str(tmp_path / "out"))
    exported = json.load(open(tmp_path / "out" / "config.json"))
    assert exported["dtype"] == "bfloat16" and "dstrain_export_dtype" not in exported


def test_the_plan_says_what_a_16_bit_checkpoint_is_trained_and_exported_in(tmp_path):
    from types import SimpleNamespace

    from dstrain.trainers import get_trainer

    path = build_checkpoint("llama", str(tmp_path / "bf16"), dtype=torch.bfloat16, **LLAMA)
    cfg = load_run_config(RECIPE, [f"--model.args.path={path}"])
    note, = get_trainer("grpo").plan_notes(cfg, SimpleNamespace(precision="bf16"))  # what `dstrain plan` prints
    assert "holds bfloat16 weights" in note and "fp32 master weights" in note and "trained in bf16" in note
    assert "written back in bfloat16" in note and "Caution" not in note
    note, = get_trainer("score").plan_notes(cfg, SimpleNamespace(precision="fp16"))
    assert "may overflow fp16's range" in note and "--deepspeed.precision=bf16" in note


def test_the_plan_note_of_a_warm_start_folder_says_it_holds_fp32(tmp_path):
    # a folder dstrain wrote in fp32 from a bf16 checkpoint (its warm start), given as model.args.path itself
    import json
    from types import SimpleNamespace

    from dstrain.trainers import get_trainer

    path = build_checkpoint("llama", str(tmp_path / "warm"), **LLAMA)
    config = json.load(open(f"{path}/config.json"))
    json.dump({**config, "dstrain_export_dtype": "bfloat16"}, open(f"{path}/config.json", "w"))
    cfg = load_run_config(RECIPE, [f"--model.args.path={path}"])
    note, = get_trainer("grpo").plan_notes(cfg, SimpleNamespace(precision="bf16"))
    assert "holds the fp32 weights dstrain wrote from a bfloat16 checkpoint" in note
    assert "holds bfloat16 weights" not in note and "written back in bfloat16" in note
    fp32 = build_checkpoint("llama", str(tmp_path / "fp32"), **LLAMA)
    assert get_trainer("grpo").plan_notes(load_run_config(RECIPE, [f"--model.args.path={fp32}"]),
                                          SimpleNamespace(precision="bf16")) == []


def test_sharded_and_bin_checkpoints_load_the_same_weights(tmp_path):
    single, _ = load(build_checkpoint("qwen2", str(tmp_path / "one"), pad=None))
    sharded = build_checkpoint("qwen2", str(tmp_path / "sh"), pad=None, shard="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    binary = build_checkpoint("qwen2", str(tmp_path / "bin"), pad=None, weights="bin")
    assert sorted(f for f in os.listdir(binary) if "model" in f) == ["pytorch_model.bin"]
    ids = torch.tensor([[5, 6, 7, 8]])
    for path in (sharded, binary):
        assert load_run_config(RECIPE, [f"--model.args.path={path}"]).model.args["path"] == path
        torch.testing.assert_close(load(path)[0].eval()(ids), single.eval()(ids))


def test_a_folder_without_weights_or_with_a_missing_shard_is_refused_when_the_config_loads(tmp_path):
    bare = build_checkpoint("gpt2", str(tmp_path / "bare"), pad=None)
    os.remove(os.path.join(bare, "model.safetensors"))
    why = refusal(bare)
    assert bare in why and "holds no weights" in why
    sharded = build_checkpoint("qwen2", str(tmp_path / "sh"), pad=None, shard="20KB")
    shards = sorted(f for f in os.listdir(sharded) if f.startswith("model-"))
    os.remove(os.path.join(sharded, shards[1]))
    why = refusal(sharded)
    assert sharded in why and f"1 of the {len(shards)} weight shards" in why and shards[1] in why


def test_custom_code_checkpoint_is_refused_naming_trust_remote_code(tmp_path):
    path = build_checkpoint("llama", str(tmp_path / "custom"), pad=None)
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    json.dump({**cfg, "model_type": "my_arch", "auto_map": {"AutoConfig": "configuration_my.MyConfig",
                                                            "AutoModelForCausalLM": "modeling_my.MyForCausalLM"}},
              open(cfg_file, "w"))
    why = refusal(path)
    assert "trust_remote_code" in why and "downloads nothing" in why and "my_arch" in why and "\n" not in why
    with pytest.raises(ValueError, match="trust_remote_code"):  # the direct API too, before transformers asks
        PolicyConfig(path=path)
    # auto_map on an architecture transformers has: its own code loads it, as from_pretrained does
    json.dump({**cfg, "auto_map": {"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}}, open(cfg_file, "w"))
    assert type(load(path)[0].hf).__name__ == "LlamaForCausalLM"
    # a tokenizer that exists only as the checkpoint's code (ChatGLM, InternLM style): the same refusal
    tok_file = os.path.join(path, "tokenizer_config.json")
    tok_cfg = json.load(open(tok_file))
    json.dump({**tok_cfg, "tokenizer_class": "MyTokenizer",
               "auto_map": {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}}, open(tok_file, "w"))
    why = refusal(path)
    assert "MyTokenizer" in why and "tokenizer_config.json" in why and "trust_remote_code" in why
    json.dump({**tok_cfg, "auto_map": {"AutoTokenizer": ["tokenization_my.MyTokenizer", None]}}, open(tok_file, "w"))
    assert load_tokenizer(PolicyConfig(path=path)).eos_token_id is not None  # its class is transformers' own


def test_a_pad_token_past_the_embedding_becomes_the_eos_token(tmp_path):
    path = build_checkpoint("llama", str(tmp_path / "ck"), **LLAMA)
    tok = load_tokenizer(PolicyConfig(path=path))
    tok.add_special_tokens({"pad_token": "<pad>"})  # added to the tokenizer, the model never resized
    tok.save_pretrained(path)
    model, tok = load(path)
    assert model.hf.config.vocab_size == len(tok) - 1 and tok.pad_token_id == tok.eos_token_id
    out = generate(model, tok, ["x", "The quick brown fox"], max_new_tokens=4, greedy=True)
    p = pack(out, tok.pad_token_id)
    assert token_logprobs(model(p["input_ids"], attention_mask=p["attention_mask"]), p["input_ids"]).isfinite().all()


def test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both(tmp_path):
    path = build_checkpoint("llama", str(tmp_path / "ck"), **LLAMA)
    tok = load_tokenizer(PolicyConfig(path=path))
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.save_pretrained(path)
    rows = json.load(open(os.path.join(path, "config.json")))["vocab_size"]
    with pytest.raises(ValueError, match=f"has {rows + 2} ids but the checkpoint's embedding has {rows} rows.*"
                                         "'<tool_call>'"):
        load_tokenizer(PolicyConfig(path=path))


def cached_and_scored(model, tok, prompts, new_tokens):
    """(log-probs of greedily generated tokens as generate computed them with its KV cache, the same
    tokens' log-probs from one no-cache forward over the packed rows, as GRPO scores them)."""
    from transformers import GenerationConfig

    enc = [encode_prompt(tok, p) for p in prompts]
    width = max(map(len, enc))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(e)) + e for e in enc])
    mask = (ids != tok.pad_token_id).long()
    mask[:, -1] = 1
    cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id,
                           output_logits=True, return_dict_in_generate=True)
    model.eval()
    with torch.no_grad():
        out = model.hf.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        steps = torch.stack(out.logits, 1).log_softmax(-1)
        rows = [Completion(i, 0, e, out.sequences[i, width:].tolist(), "", False) for i, e in enumerate(enc)]
        p = pack(rows, tok.pad_token_id)
        scored = token_logprobs(model(p["input_ids"], attention_mask=p["attention_mask"]), p["input_ids"])
    cached = torch.stack([steps[i].gather(-1, torch.tensor(c.completion_ids)[:, None])[:, 0] for i, c in enumerate(rows)])
    return cached, torch.stack([scored[i, len(c.prompt_ids) - 1:][:new_tokens] for i, c in enumerate(rows)])


PROMPTS = ["x", "The quick brown fox jumps over"]  # 1 and 17 tokens
ROPE_AND_WINDOWS = {
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}),
    "mistral_window": ("mistral", {"sliding_window": 4}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "phi3_window": ("phi3", {"sliding_window": 5}),
}


@pytest.mark.parametrize("name", [n for n, (k, _) in ROPE_AND_WINDOWS.items() if k in available()])
def test_kv_cache_generation_scores_as_the_no_cache_forward(name, tmp_path):
    kind, extra = ROPE_AND_WINDOWS[name]
    model, tok = load(build_checkpoint(kind, str(tmp_path / name), pad=None, config=extra))
    cached, scored = cached_and_scored(model, tok, PROMPTS, 16)  # past every window and original length
    torch.testing.assert_close(cached, scored, atol=1e-4, rtol=0)


LENGTH_DEPENDENT = {  # rotary scaling that changes at 24 tokens
    "dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 24}),
    "longrope": ("phi3", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
                                           "original_max_position_embeddings": 24}, "original_max_position_embeddings": 24}),
}


@pytest.mark.parametrize("name", [n for n, (k, _) in LENGTH_DEPENDENT.items() if k in available()])
def test_length_dependent_rope_past_its_length_is_refused_and_equal_within_it(name, tmp_path):
    kind, extra = LENGTH_DEPENDENT[name]
    model, tok = load(build_checkpoint(kind, str(tmp_path / name), pad=None, config=extra))
    width = len(encode_prompt(tok, PROMPTS[1]))
    cached, scored = cached_and_scored(model, tok, PROMPTS, 24 - width)  # up to the length: as plain rope
    torch.testing.assert_close(cached, scored, atol=1e-4, rtol=0)
    cached, scored = cached_and_scored(model, tok, PROMPTS, 16)  # what sampling past it would train on
    assert (cached - scored).abs().max() > 1e-2
    with pytest.raises(ValueError, match=rf"'{name}'.*past 24 tokens.*log-probabilities.*task.max_new_tokens"):
        generate(model, tok, PROMPTS, max_new_tokens=16, greedy=True)
    assert len(generate(model, tok, PROMPTS, max_new_tokens=24 - width, greedy=True)) == 2
    from types import SimpleNamespace

    from dstrain.rl.vllm_generation import VLLMToolkit
    vllm = object.__new__(VLLMToolkit)  # no engine here: the check comes before any request
    vllm.sync, vllm.tr = (lambda: None), SimpleNamespace(policy=model)
    with pytest.raises(ValueError, match=rf"'{name}'.*past 24 tokens"):
        vllm.generate(None, tok, PROMPTS, max_new_tokens=16)


def test_a_tokenizer_that_appends_eos_puts_none_inside_prompts_rows_or_documents(tmp_path):
    from dstrain.trainers.policy_rl import supervised_batch

    path = build_checkpoint("llama", str(tmp_path / "ck"), add_eos=True, **LLAMA)
    tok = load_tokenizer(PolicyConfig(path=path))
    assert tok("x = 1")["input_ids"][-1] == tok.eos_token_id  # what the tokenizer does on its own
    prompt = encode_prompt(tok, "x = 1")
    assert prompt[0] == tok.bos_token_id and tok.eos_token_id not in prompt
    x, y = supervised_batch(tok, ["x = 1"], [" + 2"])
    assert tok.eos_token_id not in x[0].tolist()
    doc = CorpusTokenizer(tok).encode_array("def f(x):\n    return x\n").tolist()
    assert doc[0] == tok.bos_token_id and tok.eos_token_id not in doc


@pytest.mark.slow
def test_grpo_zero3_two_ranks_on_a_bf16_sharded_untied_llama3_checkpoint(tmp_path):
    from safetensors import safe_open

    rope = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16}}
    path = build_checkpoint("llama", str(tmp_path / "ck"), tie=False, dtype=torch.bfloat16, shard="40KB",
                            config=rope, generation={"do_sample": True, "temperature": 0.05,
                                                     "repetition_penalty": 1.5}, **LLAMA)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", RECIPE, f"--model.args.path={path}",
           "--task.warm_start_steps=0", "--train.steps=2", "--checkpoint.every=2", "--task.num_generations=4",
           "--train.micro_batch=8", "--deepspeed.profile=zero3", "--task.n_eval=4", "--train.log_every=1",
           "--train.eval_every=0", f"--output.dir={out}"]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "holds bfloat16 weights (config.json dtype); loaded as fp32 master weights" in (out / "plan.txt").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "train/kl" in r)  # the policy still equals the reference and the sampler
    assert first["step"] == 1 and abs(first["train/kl"]) < 1e-6 and first["train/clip_fraction"] == 0.0, first
    res = subprocess.run([sys.executable, "-m", "dstrain.cli", "export", str(out), str(tmp_path / "hf")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    exported = json.load(open(tmp_path / "hf" / "config.json"))
    assert exported["dtype"] == "bfloat16" and exported["tie_word_embeddings"] is False
    assert (exported.get("rope_parameters") or exported.get("rope_scaling"))["rope_type"] == "llama3"
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        head, emb = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert head.dtype == torch.bfloat16 and not torch.equal(head, emb)
    model, tok = load(tmp_path / "hf")
    assert not model._tied() and generate(model, tok, ["x"], max_new_tokens=3, greedy=True)[0].prompt_ids
