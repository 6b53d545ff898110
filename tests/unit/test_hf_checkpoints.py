"""dstrain's policy on tiny random-weight checkpoints of real Hugging Face architectures.

Each checkpoint is built here by ``tests/hf_checkpoints.py`` (hidden 32, 2 layers,
``save_pretrained`` into ``tmp_path``) with a byte-level BPE tokenizer trained locally:
nothing is downloaded. Architectures tried (those the installed transformers has):
GPT-2 (absolute learned positions), Llama, Qwen2, Mistral, GPT-NeoX, OPT (positions
from the attention mask, offset 2), Phi, Phi-3 and Gemma. Tokenizer shapes tried: no pad
token (EOS becomes pad), pad == EOS, a separate pad, a BOS added by the tokenizer's
post-processor (Llama/Gemma), a chat template with ``<|im_end|>``, ``generation_config``
``eos_token_id`` a list (Llama-3/Qwen style), padding side left or right in the saved
tokenizer, an embedding larger than the tokenizer (padded vocabulary), tied embeddings.

What held already: greedy batched (left-padded) generation equals one-prompt-at-a-time
generation on every architecture, GPT-2 included (transformers derives position ids
from the attention mask in ``generate``); right-padded (``pack``) log-probs equal
unpadded ones in eval mode; 2-rank GRPO (GPT-2 at ZeRO-3, Mistral at ZeRO-0), SCoRe (Qwen2)
and SFT (Llama, ZeRO-3) runs, ``--resume`` and ``dstrain plan`` went through.

What failed before, and what happens now:

* A LEFT-padded batch through ``PolicyModel.forward`` or ``ValueHead`` on GPT-2 (absolute
  positions): positions were ``0..T-1``, so each row was shifted by its padding and its
  log-probs / values were wrong (only right padding was safe). Now the position ids start
  at each row's first real token (for any model whose forward takes them).

* EOS list (Qwen/Llama-3 ``generation_config``: ``[<|endoftext|>, <|im_end|>]``):
  generation stopped only at the tokenizer's EOS, so a completion ran on past
  ``<|im_end|>`` to ``max_new_tokens`` and was marked unfinished. Now every id of the
  checkpoint's EOS list ends a completion (also for the vLLM generator).
* Tokenizer that adds a BOS (Llama, Gemma): prompts were encoded without special
  tokens, so the model never saw the BOS it was trained behind (silently). Now a prompt
  gets the special tokens the tokenizer puts in front (an appended EOS is left off), in
  generation and in the GRPO warm start.
* Padded vocabulary (``vocab_size`` > ``len(tokenizer)``): generation sampled ids no text
  decodes to (an empty string, reward on nothing). Now those rows are never generated.
* Dropout in the checkpoint (GPT-2's 0.1 ``*_pdrop``, OPT's ``dropout``): the policy trained
  with it, so its train-mode log-probs differed from eval-mode ones (GRPO's old/new
  ratio and KL off from step one, by up to 3.6 nats per token here). Now every dropout
  probability is set to the policy config's ``dropout`` (default 0) at load.
* SFT (``sft_debug.json``, the LM trainer) on a checkpoint with its own tokenizer: the
  corpus was fed as UTF-8 byte ids 0..256 whatever the tokenizer (silently training a
  BPE model on meaningless ids; streams were int16, too narrow past 32768 ids). Now the
  corpus is read with the checkpoint's tokenizer (BOS where it adds one, EOS after each
  document), int32 streams for large vocabularies.
* ``dstrain export RUN DIR`` of a policy run wrote dstrain's flat file (``hf.``-prefixed
  names) that ``--model.args.path`` cannot load. Now a folder OUT gets a Hugging Face
  checkpoint (config, transformers' names, tokenizer, generation config; a tied head
  may be absent from the gathered weights).
* A tokenizer and checkpoint with no EOS at all: a ``None`` pad and EOS reached
  ``generate`` (a confusing error deep in transformers). Now ``load_tokenizer`` says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from models.policy.config import PolicyConfig
from models.policy.generation import generate, pack
from models.policy.model import build_policy, token_logprobs
from models.policy.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from tests.hf_checkpoints import available, build_checkpoint

PROMPTS = ["x", "The quick brown fox jumps over"]

# (architecture, checkpoint/tokenizer options)
SHAPES = {
    "gpt2": dict(pad=None),
    "llama": dict(pad=None, bos="<s>", add_bos=True, eos="</s>"),
    "qwen2": dict(pad="<|endoftext|>", chat=True, eos_list=True, tie=True),
    "mistral": dict(extra_vocab=37, padding_side="left"),
    "gpt_neox": dict(pad="<|endoftext|>"),
    "opt": dict(bos="</s>", eos="</s>"),
    "phi": dict(extra_vocab=20),
    "phi3": dict(pad=None, chat=True, eos_list=True),
    "gemma": dict(bos="<bos>", add_bos=True, eos="<eos>", tie=True),
}
KINDS = [k for k in SHAPES if k in available()]


def load(path):
    cfg = PolicyConfig(path=str(path))
    return build_policy(cfg), load_tokenizer(cfg)


@pytest.mark.parametrize("kind", KINDS)
def test_batched_generation_and_packed_logprobs_equal_one_at_a_time(kind, tmp_path):
    model, tok = load(build_checkpoint(kind, str(tmp_path / kind), **SHAPES[kind]))
    batch = generate(model, tok, PROMPTS, max_new_tokens=6, greedy=True)
    for i, p in enumerate(PROMPTS):
        alone = generate(model, tok, [p], max_new_tokens=6, greedy=True)[0]
        assert batch[i].completion_ids == alone.completion_ids
    # sampled rows, right-padded for training, in TRAIN mode (as the trainers run the forward)
    sampled = generate(model, tok, PROMPTS, num_samples=2, max_new_tokens=6, seed=1)
    assert model.training
    p = pack(sampled, tok.pad_token_id)
    lp = token_logprobs(model(p["input_ids"], attention_mask=p["attention_mask"]), p["input_ids"])
    for i, c in enumerate(sampled):
        assert max(c.completion_ids, default=0) < len(tok)  # a padded embedding's rows never come out
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        alone = token_logprobs(model(ids), ids)[0]
        torch.testing.assert_close(lp[i, :alone.shape[0]], alone, atol=1e-4, rtol=0)
    # the same rows LEFT-padded (positions must come from the attention mask: GPT-2, OPT...)
    rows = [c.prompt_ids + c.completion_ids for c in sampled]
    width = max(map(len, rows))
    left = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    lp_left = token_logprobs(model(left, attention_mask=mask), left)
    for i, r in enumerate(rows):
        n = len(r) - 1
        torch.testing.assert_close(lp_left[i, width - 1 - n:], lp[i, :n], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", [k for k in ("gpt2", "llama") if k in KINDS])
def test_value_head_on_a_left_padded_row_equals_the_unpadded_row(kind, tmp_path):
    from models.policy.heads import ValueHead

    model, tok = load(build_checkpoint(kind, str(tmp_path / kind), **SHAPES[kind]))
    head = ValueHead(model.hf).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    left = torch.tensor([[tok.pad_token_id] * 3 + ids[0].tolist()])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(head(left, attention_mask=mask), head(ids, attention_mask=torch.ones_like(ids)),
                                   atol=1e-5, rtol=0)


def test_eos_list_of_generation_config_ends_completions(tmp_path):
    path = build_checkpoint("qwen2", str(tmp_path / "q"), **SHAPES["qwen2"])
    model, tok = load(path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos_token_ids(tok) == [tok.eos_token_id, im_end]
    logits_bias = torch.full((model.hf.config.vocab_size,), -30.0)
    logits_bias[im_end] = 30.0
    # make <|im_end|> the certain next token everywhere
    model.hf.lm_head.register_forward_hook(lambda m, i, o: o + logits_bias)
    out = generate(model, tok, ["def add(a"], max_new_tokens=8, greedy=True)[0]
    assert out.completion_ids == [im_end] and out.finished and out.text == ""


@pytest.mark.parametrize("kind", [k for k in ("llama", "gemma") if k in KINDS])
def test_prompts_get_the_bos_the_tokenizer_adds(kind, tmp_path):
    model, tok = load(build_checkpoint(kind, str(tmp_path / kind), **SHAPES[kind]))
    plain = tok("def add(a", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, "def add(a") == [tok.bos_token_id] + plain
    assert encode_prompt(tok, "") == [tok.bos_token_id]
    out = generate(model, tok, ["def add(a", "x"], max_new_tokens=4, greedy=True)
    assert out[0].prompt_ids == [tok.bos_token_id] + plain
    assert out[1].prompt_ids[0] == tok.bos_token_id


def test_prompt_encoding_leaves_off_an_appended_eos_and_keeps_plain_tokenizers(tmp_path):
    from tokenizers import processors

    from tests.hf_checkpoints import build_tokenizer

    tok = build_tokenizer(bos="<s>", eos="</s>")
    core = tok.backend_tokenizer
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.bos_token_id), ("</s>", tok.eos_token_id)])
    plain = tok("x = 1", add_special_tokens=False)["input_ids"]
    assert tok("x = 1")["input_ids"] == [tok.bos_token_id] + plain + [tok.eos_token_id]
    assert encode_prompt(tok, "x = 1") == [tok.bos_token_id] + plain
    gpt2_like = build_tokenizer(pad=None)
    assert encode_prompt(gpt2_like, "x = 1") == gpt2_like("x = 1", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", [k for k in ("gpt2", "opt") if k in KINDS])
def test_checkpoint_dropout_is_replaced_by_the_policy_config(kind, tmp_path):
    path = build_checkpoint(kind, str(tmp_path / kind), **SHAPES[kind])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    model = build_policy(PolicyConfig(path=path)).train()
    torch.manual_seed(0)
    a, b = model(ids), model(ids)
    torch.testing.assert_close(a, b)  # no dropout: train mode is deterministic
    torch.testing.assert_close(a, model.eval()(ids))
    noisy = build_policy(PolicyConfig(path=path, dropout=0.3)).train()
    assert not torch.allclose(noisy(ids), noisy(ids))
    assert json.load(open(os.path.join(path, "config.json"))).get(
        "resid_pdrop" if kind == "gpt2" else "dropout") == 0.1  # the checkpoint itself is untouched


def test_tokenizer_larger_than_the_embedding_is_named(tmp_path):
    model, _ = load(build_checkpoint("llama", str(tmp_path / "small"), **SHAPES["llama"]))
    from tests.hf_checkpoints import build_tokenizer

    big = build_tokenizer(vocab=400, pad=None)  # ids past the 300 rows of the checkpoint
    big.pad_token = big.eos_token
    with pytest.raises(ValueError, match="do not belong together"):
        generate(model, big, ["The quick brown fox jumps over the lazy dog"], max_new_tokens=2, greedy=True)


def test_tokenizer_without_any_eos_is_refused_at_load(tmp_path):
    path = build_checkpoint("llama", str(tmp_path / "l"), **SHAPES["llama"])
    cfg_file = os.path.join(path, "tokenizer_config.json")
    tcfg = json.load(open(cfg_file))
    tcfg["eos_token"] = None
    tcfg["pad_token"] = None
    json.dump(tcfg, open(cfg_file, "w"))
    for name in ("generation_config.json", "config.json"):
        c = json.load(open(os.path.join(path, name)))
        c["eos_token_id"] = None
        json.dump(c, open(os.path.join(path, name), "w"))
    with pytest.raises(ValueError, match="no EOS token"):
        load_tokenizer(PolicyConfig(path=path))


@pytest.mark.parametrize("kind", [k for k in ("gpt2", "qwen2") if k in KINDS])
def test_exported_weights_load_back_as_a_hugging_face_checkpoint(kind, tmp_path):
    from models.policy.reference import export_pretrained, full_state_dict

    path = build_checkpoint(kind, str(tmp_path / "ck"), **SHAPES[kind])
    cfg = PolicyConfig(path=path)
    trained = build_policy(cfg).eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    state = full_state_dict(trained)
    state.pop("hf.lm_head.weight")  # tied in both: ZeRO's consolidated weights may hold it once
    export_pretrained(state, cfg, str(tmp_path / "out"))
    again, tok = load(tmp_path / "out")
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(again.eval()(ids), trained(ids))
    assert eos_token_ids(tok) == eos_token_ids(load_tokenizer(cfg))
    state["hf.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="unexpected"):
        export_pretrained(state, cfg, str(tmp_path / "bad"))


def test_sft_corpus_is_read_with_the_checkpoints_own_tokenizer(tmp_path):
    from dstrain.config import run_config_from_dict
    from dstrain.runtime import World
    from dstrain.trainers.lm import load_token_streams

    path = build_checkpoint("llama", str(tmp_path / "ck"), **SHAPES["llama"])
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(4)]
    for i, text in enumerate(texts):
        (docs / f"{i}.txt").write_text(text)
    cfg = run_config_from_dict({"model": {"name": "policy", "size": "tiny", "args": {"path": path}},
                                "data": {"corpus": str(docs), "val_every": 2, "seq_len": 8},
                                "output": {"dir": str(tmp_path / "run")}})
    train, val = load_token_streams(cfg, World(0, 1, 0, 1, torch.device("cpu")))
    tok = load_tokenizer(PolicyConfig(path=path))
    want = [t for text in texts for t in [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"],
                                            tok.eos_token_id]]
    assert sorted(train.tolist() + val.tolist()) == sorted(want)  # not the texts' UTF-8 bytes
    assert max(train.tolist()) >= 256 and train.tolist().count(tok.bos_token_id) == 2


def test_token_streams_of_a_large_vocabulary_keep_their_ids():
    import numpy as np

    from dstrain.data.corpus import build_token_streams

    class Big:
        vocab_size, eos_id = 151_936, 151_643

        def encode_array(self, text):
            return np.array([100_000 + len(text), 40_000], dtype=np.int64)

    train, val = build_token_streams(["a", "bb", "ccc"], Big(), val_every=2)
    assert train.tolist() == [100_001, 40_000, 151_643, 100_003, 40_000, 151_643]
    assert val.tolist() == [100_002, 40_000, 151_643]


@pytest.mark.slow
def test_grpo_two_ranks_zero3_on_a_qwen2_checkpoint(tmp_path):
    path = build_checkpoint("qwen2", str(tmp_path / "ck"), **SHAPES["qwen2"])
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", "models/policy/recipes/grpo_debug.json",
           f"--model.args.path={path}", "--task.warm_start_steps=0", "--train.steps=2", "--checkpoint.every=2",
           "--task.num_generations=4", "--train.micro_batch=8", "--deepspeed.profile=zero3",
           "--task.n_eval=8", f"--output.dir={out}"]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.load(open(out / "summary.json"))
    assert summary["step"] == 2 and summary["profile"] == "zero3"
    res = subprocess.run([sys.executable, "-m", "dstrain.cli", "export", str(out), str(tmp_path / "hf")],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    model, tok = load(tmp_path / "hf")  # a Hugging Face checkpoint again, with the EOS list
    assert eos_token_ids(tok) == [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    assert generate(model, tok, ["x"], max_new_tokens=3, greedy=True)[0].prompt_ids
