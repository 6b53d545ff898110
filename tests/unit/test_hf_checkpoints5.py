"""Real-world Hugging Face checkpoints, round 5: what round 4's continuation decoding left open.

On the tiny local checkpoints and SentencePiece-style tokenizers of ``tests/hf_checkpoints.py``:

* Early stop with a SentencePiece tokenizer: the per-step stop check (``StopOnStrings``) decoded the last few
  tokens on their own, so the decoder's Strip took the space off a stop string's first ``▁`` and a stop string
  that begins with a space (``" ###"``, ``"\\nQuestion:"`` after a space) at the very start of a completion was
  never seen: generation ran on to ``max_new_tokens`` (the final cut still found it). Now the window is read
  after the tokens before it: generation stops at the stop string.
* A code completion after a prompt that does not end in a newline (``"[/INST]"``, ``"<|assistant|>"``,
  ``"...:"``) is read, rightly, with the space that separates it from the prompt (``" def add..."``); the code
  reward ran it as is: an IndentationError, the honest completion failed. Now code that starts the program
  (no ``code_prefix``) is moved to the top level; code after a ``def`` line in ``code_prefix`` is kept as written.
* Rotary checkpoints (Llama, Qwen) with ``task.max_new_tokens`` that leaves little or no room under
  ``max_position_embeddings``: nothing said. Now ``dstrain plan`` (and ``plan.txt``) carries one note.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dstrain.config import load_run_config
from dstrain.data.tasks import Task
from dstrain.rewards import SandboxLimits, SandboxPool, score_tasks
from models.policy.config import PolicyConfig
from models.policy.generation import StopOnStrings, generate
from models.policy.model import build_policy
from models.policy.tokenizer import decode_continuation, encode_prompt, load_tokenizer
from tests.hf_checkpoints import build_checkpoint, build_sp_tokenizer

RECIPE = "models/policy/recipes/grpo_debug.json"
PROMPTS = ["x", "The quick brown fox jumps over", "def add(a, b):", "print(add(1, 2))", "return a", "a + b"]


def test_a_stop_string_that_starts_with_a_space_stops_sentencepiece_generation_early(tmp_path):
    path = build_checkpoint("llama", str(tmp_path / "ck"), sp="bpe")
    cfg = PolicyConfig(path=path)
    model, tok = build_policy(cfg), load_tokenizer(cfg)
    free = generate(model, tok, PROMPTS, greedy=True, max_new_tokens=12)
    # a completion whose text starts with a space (a first token "▁..."), its first two tokens not the last ones
    row = next(c for c in free if c.text.startswith(" ") and len(c.text.strip()) >= 2
               and len(c.completion_ids) == 12 and not c.finished)
    stop = decode_continuation(tok, row.prompt_ids, row.completion_ids[:2])
    assert stop.startswith(" ") and stop not in decode_continuation(tok, row.prompt_ids, row.completion_ids[1:])
    steps = []
    hook = model.hf.register_forward_hook(lambda *a: steps.append(1))
    try:
        out = generate(model, tok, [PROMPTS[row.index]], greedy=True, max_new_tokens=12, stop=[stop])
    finally:
        hook.remove()
    assert out[0].stop == stop and out[0].text == "" and out[0].completion_ids == row.completion_ids[:2]
    assert len(steps) == 2  # stopped as soon as the stop string was complete, not after 12 tokens


@pytest.mark.parametrize("sp", ["unigram", "bpe"])
def test_the_stop_check_reads_the_window_as_a_continuation(sp):
    import torch

    tok = build_sp_tokenizer(sp)
    prompt = encode_prompt(tok, "Answer:")
    full = tok("Answer: 42\n###", add_special_tokens=True)["input_ids"]
    assert full[:len(prompt)] == prompt
    ids = torch.tensor([full])
    crit = StopOnStrings(tok, [" 42"], len(prompt))
    assert crit(ids).tolist() == [True]
    assert StopOnStrings(tok, [" 43"], len(prompt))(ids).tolist() == [False]
    # once the window has slid past the prompt it is decoded alone: a stop string completed in this step
    # starts inside it, past the space the decoder strips
    long = tok("Answer: 1 2 3 4 5 6 7 8 9 10 11 ###", add_special_tokens=True)["input_ids"]
    crit = StopOnStrings(tok, [" ###"], len(prompt))
    assert len(long) - crit.window > len(prompt) and crit(torch.tensor([long])).tolist() == [True]
    assert crit(torch.tensor([long[:-1]])).tolist() == [False]


@pytest.mark.parametrize("prompt", ["[INST] Write add(a, b). [/INST]", "<|assistant|>", "Write add(a, b) in Python:"])
def test_an_unfenced_code_completion_after_a_prompt_without_newline_passes(prompt):
    tok = build_sp_tokenizer("unigram")
    code = "def add(a, b):\n    return a + b\n"
    prompt_ids = encode_prompt(tok, prompt)
    full = tok(prompt + " " + code, add_special_tokens=True)["input_ids"]
    assert full[:len(prompt_ids)] == prompt_ids
    text = decode_continuation(tok, prompt_ids, full[len(prompt_ids):])
    assert text == " " + code  # the separating space is part of the completion's text
    tasks = [Task(task_id="t", prompt=prompt, kind="code", tests=("assert add(1, 2) == 3",)),
             Task(task_id="u", prompt=prompt, kind="code", tests=("assert add(1, 2) == 3",)),
             # code after the task's own def line keeps its indentation as written (a body)
             Task(task_id="v", prompt=prompt + "def add(a, b):\n", kind="code", tests=("assert add(1, 2) == 3",),
                  code_prefix="def add(a, b):\n"),
             Task(task_id="w", prompt=prompt + "def add(a, b):\n", kind="code", tests=("assert add(1, 2) == 3",),
                  code_prefix="def add(a, b):\n")]
    completions = [text, "  x = 1\n  def add(a, b):\n      return a + b + x - 1\n", "    return a + b\n",
                   "return a + b\n"]
    with SandboxPool(workers=1, limits=SandboxLimits(wall_seconds=5.0, memory_bytes=512 << 20)) as pool:
        assert score_tasks(tasks, completions, pool) == [1.0, 1.0, 1.0, 0.0]


def test_plan_notes_a_rotary_checkpoint_run_past_its_trained_length(tmp_path):
    from dstrain.trainers.policy_rl import plan_notes

    path = build_checkpoint("llama", str(tmp_path / "ck"))  # max_position_embeddings=256, rotary
    gpt2 = build_checkpoint("gpt2", str(tmp_path / "gpt2"))  # learned positions: refused at generation instead

    def notes(p, new):
        cfg = load_run_config(RECIPE, [f"--model.args.path={p}", f"--task.max_new_tokens={new}"])
        return [n for n in plan_notes(cfg, SimpleNamespace(precision="fp32")) if n.startswith("positions:")]

    every, some = notes(path, 300), notes(path, 200)
    assert len(every) == 1 and "max_position_embeddings=256" in every[0] and "task.max_new_tokens=300" in every[0]
    assert "every completion runs past" in every[0] and "untested" in every[0]
    assert len(some) == 1 and "prompt longer than 56 tokens" in some[0] and "not known before the data" in some[0]
    assert notes(path, 24) == [] and notes(gpt2, 300) == []
