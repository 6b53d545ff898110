"""``task.max_prompt_tokens``: overlong prompts are dropped when a policy-RL run loads its tasks.

Before, nothing bounded a prompt's length: an MBPP record whose ``test_list`` repeated one assert 2,000 times
reached generation, which asked for ~111 GB (KV cache and attention of an ~88,000-token prompt) and died. Now
GRPO and SCoRe drop every task whose prompt, tokenized as the policy is given it, is longer than the limit
(default 8192, far above any real MBPP/GSM8K prompt), say so in one note (training and held-out tasks counted
apart), refuse a run left with no training task, and ``dstrain plan`` plans for the limit + ``max_new_tokens``
where it is set. All on the tiny embedded policy and its byte tokenizer (one token a byte, no BOS).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dstrain.config import ConfigError, load_run_config
from dstrain.trainers import policy_rl as prl
from dstrain.trainers import task_config
from dstrain.trainers.prompt_limit import DEFAULT_MAX_PROMPT_TOKENS, drop_long_prompts, within_limit

GRPO = "models/policy/recipes/grpo_debug.json"
SCORE = "models/policy/recipes/score_debug.json"
ASSERT = "assert remove_Occ(\"hello\",\"l\") == \"heo\""


def _record(task_id: int, tests: list[str]) -> dict:
    return {"task_id": task_id, "text": f"Write a function number {task_id}.", "code": "def f(x):\n    return x",
            "test_list": tests, "test_setup_code": "", "challenge_test_list": []}


def _mbpp(tmp_path, train_repeat: int = 2000, eval_repeat: int = 150) -> str:
    """Training ids 601-604 (602 repeats one assert ``train_repeat`` times), test ids 11-13 (12: ``eval_repeat``)."""
    rows = [_record(i, [ASSERT] * (train_repeat if i == 602 else 1)) for i in range(601, 605)]
    rows += [_record(i, [ASSERT] * (eval_repeat if i == 12 else 1)) for i in range(11, 14)]
    path = tmp_path / "mbpp.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _load(recipe: str, *overrides: str):
    cfg = load_run_config(recipe, list(overrides))
    task = task_config(cfg)
    train, evals = prl.load_task_sets(task, cfg.data.seed)
    return cfg, task, train, evals


def test_an_mbpp_record_repeating_one_assert_2000_times_is_dropped_with_one_note(tmp_path):
    cfg, task, train, evals = _load(GRPO, "--task.source=mbpp", f"--task.path={_mbpp(tmp_path)}")
    assert len(train) == 4 and len(evals) == 3
    long_train = next(t for t in train if t.task_id == "mbpp/602").prompt
    long_eval = next(t for t in evals if t.task_id == "mbpp/12").prompt
    assert len(long_train.encode()) > DEFAULT_MAX_PROMPT_TOKENS > len(long_eval.encode()) > 4000
    lines: list[str] = []
    kept, kept_eval = drop_long_prompts(cfg, task, train, evals, log=lines.append)
    assert [t.task_id for t in kept] == ["mbpp/601", "mbpp/603", "mbpp/604"]
    assert [t.task_id for t in kept_eval] == ["mbpp/11", "mbpp/12", "mbpp/13"]  # under the default: kept
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "task.max_prompt_tokens=8192 (the default)" in lines[0]
    assert f"dropped 1 of 4 training tasks (longest prompt {len(long_train.encode())} tokens)" in lines[0]
    assert "0 of 3 held-out tasks" in lines[0]

    # a limit of its own: the held-out split is counted apart, with its own longest prompt
    cfg, task, train, evals = _load(GRPO, "--task.source=mbpp", f"--task.path={_mbpp(tmp_path)}",
                                    "--task.max_prompt_tokens=4000")
    lines.clear()
    kept, kept_eval = drop_long_prompts(cfg, task, train, evals, log=lines.append)
    assert len(kept) == 3 and [t.task_id for t in kept_eval] == ["mbpp/11", "mbpp/13"]
    assert "task.max_prompt_tokens=4000:" in lines[0] and "(the default)" not in lines[0]
    assert f"1 of 3 held-out tasks (longest prompt {len(long_eval.encode())} tokens)" in lines[0]


def test_tasks_within_the_limit_are_kept_without_a_note():
    cfg, task, train, evals = _load(GRPO)
    lines: list[str] = []
    kept, kept_eval = drop_long_prompts(cfg, task, train, evals, log=lines.append)
    assert kept == train and kept_eval == evals and lines == []


def test_a_run_left_without_training_tasks_is_refused_in_one_line(tmp_path):
    cfg, task, train, evals = _load(GRPO, "--task.source=mbpp", f"--task.path={_mbpp(tmp_path)}",
                                    "--task.max_prompt_tokens=20")
    with pytest.raises(ConfigError) as err:
        drop_long_prompts(cfg, task, train, evals, log=lambda line: None)
    text = str(err.value)
    assert "\n" not in text and "task.max_prompt_tokens" in text and "all 4 training tasks" in text
    shortest = min(len(t.prompt.encode()) for t in train)
    assert f"shortest {shortest}" in text


def test_a_negative_limit_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="task.max_prompt_tokens must not be negative"):
        load_run_config(GRPO, ["--task.max_prompt_tokens=-1"])


def test_score_measures_the_turn_one_prompt_the_policy_is_given():
    from dstrain.rl.episode import turn1_prompt
    from models.policy.tokenizer import byte_tokenizer

    cfg, task, train, evals = _load(SCORE)
    longest = max(len(t.prompt.encode()) for t in train)
    wrapped = max(len(turn1_prompt(t.prompt).encode()) for t in train)
    assert wrapped > longest
    limited = SimpleNamespace(max_prompt_tokens=longest)
    tok = byte_tokenizer()
    kept, _, note = within_limit("grpo", limited, tok, train, evals)  # the bare prompts all fit
    assert kept == train and note is None
    kept, _, note = within_limit("score", limited, tok, train, evals)  # the turn-1 prompts do not all fit
    over = sum(len(turn1_prompt(t.prompt).encode()) > longest for t in train)
    assert over > 0 and len(kept) == len(train) - over and f"dropped {over} of {len(train)}" in note


def _traced_seq_len(monkeypatch, recipe: str, *overrides: str) -> int:
    """The sequence length plan_engine traces activations at (the trace is stopped there)."""
    from dstrain.engine import factory, hardware

    seen = []

    class Traced(Exception):
        pass

    def trace(build, make_inputs, *_):
        seen.append(make_inputs()[0].shape[1])
        raise Traced

    monkeypatch.setattr(hardware, "trace_activations", trace)
    with pytest.raises(Traced):
        factory.plan_engine(load_run_config(recipe, list(overrides)), 1, hw=SimpleNamespace(device_type="cpu"))
    return seen[0]


def test_the_planner_plans_for_max_prompt_tokens_plus_max_new_tokens_where_set(monkeypatch):
    from dstrain.engine.ds_trainers import planned_seq_len
    from dstrain.rl.episode import turn1_prompt, turn2_prompt

    assert _traced_seq_len(monkeypatch, GRPO) == 128  # the default: data.seq_len, as before
    assert _traced_seq_len(monkeypatch, GRPO, "--task.max_prompt_tokens=200") == 200 + 24
    words = len(turn2_prompt("", "", "")) - len(turn1_prompt(""))
    assert _traced_seq_len(monkeypatch, SCORE, "--task.max_prompt_tokens=200") == 200 + 24 + 40 + 24 + words
    seq, line = planned_seq_len(load_run_config(GRPO, ["--task.max_prompt_tokens=200"]))
    assert seq == 224 and "task.max_prompt_tokens 200" in line and "data.seq_len 128 is not used" in line
    assert planned_seq_len(load_run_config(GRPO, [])) == (128, "")


def test_check_config_and_plan_notes_count_the_prompts_over_the_limit(tmp_path, capsys):
    from dstrain.cli import main
    from dstrain.trainers.prompt_limit import prompt_note

    path = _mbpp(tmp_path)
    assert main(["check-config", GRPO, "--task.source=mbpp", f"--task.path={path}"]) == 0
    err = capsys.readouterr().err
    assert "1 training and 0 held-out tasks are over it" in err and "task.max_prompt_tokens=8192" in err
    assert "longest prompt" in err and "Token indices sequence length" not in err
    note = prompt_note(load_run_config(GRPO, ["--task.source=mbpp", f"--task.path={path}",
                                              "--task.max_prompt_tokens=20"]))
    assert "every training task is over it" in note
    assert "none is over it" in prompt_note(load_run_config(GRPO, []))
    # a hub name is not read before the launch
    assert prompt_note(load_run_config(GRPO, ["--task.source=gsm8k", "--task.path=openai/gsm8k"])) is None
