"""Real-world Hugging Face checkpoints, round 2: chat templates, SCoRe at ZeRO-3, GSM8K rewards.

What was tried, on the tiny local checkpoints of ``tests/hf_checkpoints.py`` (byte-level BPE
tokenizers trained here; a ChatML template where ``chat=True``):

* Chat templates. Before: no option existed; every prompt was encoded as plain text, so a
  chat-tuned checkpoint never saw ``<|im_start|>user ... <|im_start|>assistant``. Now
  ``task.chat_template`` (off | on | auto, default off) switches the tokenizer to render each
  prompt as one user message with the generation prompt appended, encoded without a second
  BOS; ``on`` is refused (ConfigError) for a tokenizer without a template, ``auto`` then stays
  off. Since the choice lives on the tokenizer and every prompt goes through ``encode_prompt``,
  generation (and the packed ids that log-probs are scored on), vLLM (checked with a stand-in
  engine: the ``prompt_token_ids`` it gets are the rendered ones), the warm start, the SCoRe
  hint and both SCoRe turns render alike (turn 2 is its labelled text as one user message).
* SCoRe at ZeRO-3 with a Qwen2-shaped checkpoint on 2 CPU ranks (2 steps, warm start, guidance,
  critic and value engines, with and without the chat template): it ran and evaluated; the slow
  test below keeps it so.
* GSM8K rewards from completions a byte-level BPE tokenizer produced: ``#### 42`` survives
  merges and spaces, an EOS id (``<|im_end|>``, special or not) and the ``\\nQuestion:`` stop
  cut; no failure was found, the test pins it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dstrain.config import ConfigError
from dstrain.trainers import policy_rl as prl
from dstrain.trainers.grpo_config import PolicyTaskConfig
from models.policy.config import PolicyConfig
from models.policy.generation import cut_at_stop, generate
from models.policy.model import build_policy
from models.policy.tokenizer import byte_tokenizer, encode_prompt, load_tokenizer, use_chat_template
from tests.hf_checkpoints import available, build_checkpoint, build_tokenizer

pytestmark = pytest.mark.skipif("qwen2" not in available(), reason="transformers lacks Qwen2")


class _Toolkit:
    load_tokenizer = staticmethod(load_tokenizer)


def chat_ids(tok, text):
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return rendered, tok(rendered, add_special_tokens=False)["input_ids"]


def test_chat_template_renders_prompts_for_generation_and_scoring(tmp_path):
    path = build_checkpoint("qwen2", str(tmp_path / "ck"), chat=True, eos_list=True, tie=True)
    cfg = PolicyConfig(path=path)
    tok = prl.task_tokenizer(_Toolkit, cfg, PolicyTaskConfig(chat_template="on"))
    rendered, want = chat_ids(tok, "def add(a")
    assert rendered.startswith("<|im_start|>user\ndef add(a") and rendered.endswith("<|im_start|>assistant\n")
    assert encode_prompt(tok, "def add(a") == want
    torch.manual_seed(0)
    out = generate(build_policy(cfg), tok, ["def add(a"], max_new_tokens=4, greedy=True)[0]
    assert out.prompt_ids == want  # pack() scores log-probs after exactly these ids
    # the supervised warm start conditions on the same ids
    x, y = prl.supervised_batch(tok, ["def add(a"], ["b)"])
    assert x[0, :len(want)].tolist() == want and (y[0, :len(want) - 1] == -100).all()


def test_chat_template_adds_no_second_bos():
    tok = build_tokenizer(bos="<s>", add_bos=True, eos="</s>", chat=True)
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    use_chat_template(tok, "on")
    ids = encode_prompt(tok, "x = 1")
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1


def test_chat_template_off_by_default_auto_and_refused_without_template(tmp_path):
    path = build_checkpoint("gpt2", str(tmp_path / "ck"), pad=None)  # a base model: no template
    cfg = PolicyConfig(path=path)
    assert PolicyTaskConfig().chat_template == "off"
    plain = prl.task_tokenizer(_Toolkit, cfg, PolicyTaskConfig())
    assert encode_prompt(plain, "x") == plain("x", add_special_tokens=False)["input_ids"]
    auto = prl.task_tokenizer(_Toolkit, cfg, PolicyTaskConfig(chat_template="auto"))
    assert encode_prompt(auto, "x") == encode_prompt(plain, "x")
    with pytest.raises(ConfigError, match="no chat template"):
        prl.task_tokenizer(_Toolkit, cfg, PolicyTaskConfig(chat_template="on"))
    with pytest.raises(ValueError, match="no chat template"):
        use_chat_template(byte_tokenizer(), "on")
    with pytest.raises(ValueError, match="chat_template"):
        PolicyTaskConfig(chat_template="yes")
    chat = build_tokenizer(chat=True)
    assert encode_prompt(use_chat_template(chat, "auto"), "x") == chat_ids(chat, "x")[1]


def test_score_turn_two_and_hint_prompts_are_rendered_like_turn_one():
    from dstrain.rl import episode as ep

    tok = use_chat_template(build_tokenizer(chat=True), "on")
    turn2 = ep.turn2_prompt("def f(x):\n    return ", "x + 1", "Wrong.")
    hint = ep.hint_prompt("def f(x):\n    return ", "x + 1")
    for text in (ep.turn1_prompt("def f(x):\n    return "), turn2, hint):
        assert encode_prompt(tok, text) == chat_ids(tok, text)[1]
    assert "x + 1" in chat_ids(tok, turn2)[0] and "Wrong." in chat_ids(tok, turn2)[0]


def test_vllm_backend_receives_the_chat_rendered_prompt_ids():
    from types import SimpleNamespace

    from dstrain.rl.vllm_generation import VLLMToolkit

    tok = use_chat_template(build_tokenizer(chat=True), "on")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    seen = []

    def fake_generate(requests, sampling_params, use_tqdm):  # an engine that answers "7" then EOS
        seen.extend(r["prompt_token_ids"] for r in requests)
        out = SimpleNamespace(token_ids=tok("7", add_special_tokens=False)["input_ids"] + [end],
                              finish_reason="stop", stop_reason=end)
        return [SimpleNamespace(outputs=[out]) for _ in requests]

    tk = object.__new__(VLLMToolkit)  # no engine here: only the prompt path is under test
    tk.sync, tk.own_tokenizer = (lambda: None), False
    # the policy's output rows (generate reads its vocabulary size and rope settings): the tokenizer's, no padding
    tk.tr = SimpleNamespace(policy=SimpleNamespace(hf=SimpleNamespace(config=SimpleNamespace(vocab_size=len(tok)))))
    tk.vllm = SimpleNamespace(SamplingParams=lambda **kw: kw)
    tk.llm = SimpleNamespace(generate=fake_generate)
    got = tk.generate(None, tok, ["def add(a", "x"], num_samples=2, seed=1)
    assert seen == [chat_ids(tok, "def add(a")[1]] * 2 + [chat_ids(tok, "x")[1]] * 2
    assert [c.prompt_ids for c in got] == seen and {c.text for c in got} == {"7"}


@pytest.mark.parametrize("special", [True, False])
def test_gsm8k_final_answer_survives_a_bpe_tokenizer(special):
    from dstrain.rewards.maths import maths_reward

    tok = build_tokenizer(chat=special)
    if not special:  # an end token the tokenizer does not mark special: its text stays in decodes
        tok.add_tokens(["<|im_end|>"])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for text, answer in (("3 + 4 = 7 so 7 * 6 = 42\n#### 42", "42"), (" ####  1,234", "1234"),
                         ("x = 2\n####-5\n\nQuestion: next", "-5")):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [end]
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert maths_reward(decoded, answer) == 1.0, decoded
        cut = cut_at_stop(ids, tok, ["\nQuestion:"])
        assert maths_reward(cut[1] if cut else decoded, answer) == 1.0
    assert maths_reward(tok.decode(tok("#### 41", add_special_tokens=False)["input_ids"] + [end]), "42") == 0.0


@pytest.mark.slow
def test_score_zero3_two_ranks_with_a_chat_checkpoint(tmp_path):
    path = build_checkpoint("qwen2", str(tmp_path / "ck"), chat=True, eos_list=True)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", "models/policy/recipes/score_debug.json",
           f"--model.args.path={path}", "--deepspeed.profile=zero3", "--train.steps=2",
           "--task.warm_start_steps=2", "--task.warm_start_batch=4", "--train.micro_batch=4",
           "--task.num_generations=2", "--task.n_train=16", "--task.n_eval=4", "--task.max_new_tokens=8",
           "--task.hint_max_new_tokens=8", "--train.eval_every=0", "--checkpoint.every=0",
           "--task.chat_template=on", f"--output.dir={out}"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    last = [json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"step"')][-1]
    assert last["step"] == 2 and last["profile"] == "zero3" and last["eval_after"]["tasks"] == 4.0


def test_chat_template_on_without_a_template_is_refused_when_the_config_loads(tmp_path):
    """Refused by the run config's check (before: only once the trainer loaded its tokenizer, after the engines
    were built), naming the key; a checkpoint with a template passes."""
    from dstrain.config import load_run_config
    recipe = "models/policy/recipes/grpo_debug.json"
    with pytest.raises(ConfigError, match="task.chat_template.*embedded byte tokenizer"):
        load_run_config(recipe, ["--task.chat_template=on"])
    base = build_checkpoint("qwen2", str(tmp_path / "base"), chat=False)
    with pytest.raises(ConfigError, match="task.chat_template.*has no chat template"):
        load_run_config(recipe, ["--task.chat_template=on", f"--model.args.path={base}"])
    chat = build_checkpoint("qwen2", str(tmp_path / "chat"), chat=True)
    assert load_run_config(recipe, ["--task.chat_template=on", f"--model.args.path={chat}"]).task["chat_template"] == "on"
    assert load_run_config(recipe, ["--task.chat_template=auto"]).task["chat_template"] == "auto"
