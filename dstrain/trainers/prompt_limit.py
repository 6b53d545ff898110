"""``task.max_prompt_tokens``: the longest prompt a policy-RL run (GRPO, SCoRe) takes.

A task whose prompt, as the policy is given it (tokenized with the policy's tokenizer: its BOS, the chat
template where ``task.chat_template`` applies one, SCoRe's turn-1 sections), is longer than the limit is dropped
when the tasks load, with one note giving the counts (training and held-out tasks apart) and the longest
length; a run left with no training task is refused in one line naming the setting. Before, such a prompt
reached generation: an MBPP record whose ``test_list`` repeats one assert 2,000 times asked for a KV cache and
attention of ~111 GB and the run died.

The default (0: ``DEFAULT_MAX_PROMPT_TOKENS``) is far above the longest prompt of the shipped recipes and of
MBPP and GSM8K (4,340 tokens with the byte tokenizer, MBPP's test split), so it drops nothing real. With the
limit set, ``dstrain plan`` traces activations at the longest sequence the run can then see
(:func:`planned_seq_len`); with the default it keeps ``data.seq_len``, and its note names the longest prompt.
"""
from __future__ import annotations

DEFAULT_MAX_PROMPT_TOKENS = 8192
"""Used when ``task.max_prompt_tokens`` is 0: about twice the longest real prompt measured (MBPP's test split with
the byte tokenizer, 4,340 tokens; GSM8K's train split 1,044), far below the ~80,000 tokens of the record that
failed."""

POLICY_TRAINERS = ("grpo", "score")


def prompt_limit(task) -> int:
    """The limit in tokens the task section sets (its default where it says 0)."""
    return int(getattr(task, "max_prompt_tokens", 0) or DEFAULT_MAX_PROMPT_TOKENS)


def _setting(task) -> str:
    given = getattr(task, "max_prompt_tokens", 0)
    return f"task.max_prompt_tokens={prompt_limit(task)}" + ("" if given else " (the default)")


def policy_prompts(trainer: str, tasks: list) -> list[str]:
    """The text each task's first generation starts from: the prompt itself (GRPO), or SCoRe's turn-1 prompt."""
    if trainer == "score":
        from dstrain.rl.episode import turn1_prompt
        return [turn1_prompt(t.prompt) for t in tasks]
    return [t.prompt for t in tasks]


def prompt_lengths(tokenizer, texts: list[str]) -> list[int]:
    """Tokens of each prompt as generation encodes it (``encode_prompt``: BOS, chat template). Transformers'
    warning that a sequence is longer than the tokenizer's ``model_max_length`` is held back while they are
    counted (a prompt over it is what is looked for here)."""
    from models.policy.tokenizer import encode_prompt
    warned = getattr(tokenizer, "deprecation_warnings", None)
    key = "sequence-length-is-longer-than-the-specified-maximum"
    before = warned.get(key) if isinstance(warned, dict) else None
    if isinstance(warned, dict):
        warned[key] = True
    try:
        return [len(encode_prompt(tokenizer, text)) for text in texts]
    finally:
        if isinstance(warned, dict):
            if before is None:
                warned.pop(key, None)
            else:
                warned[key] = before


def _count(lengths: list[int], limit: int) -> tuple[list[bool], int, int]:
    """(kept flags, number dropped, longest length)."""
    keep = [n <= limit for n in lengths]
    return keep, keep.count(False), max(lengths, default=0)


def within_limit(trainer: str, task, tokenizer, train: list, evals: list) -> tuple[list, list, str | None]:
    """``(train, evals, note)``: the tasks whose prompt fits ``task.max_prompt_tokens``, and one line saying
    what was dropped (None when nothing was). A ConfigError when no training task is left."""
    from dstrain.config import ConfigError
    limit = prompt_limit(task)
    lengths = prompt_lengths(tokenizer, policy_prompts(trainer, train))
    eval_lengths = prompt_lengths(tokenizer, policy_prompts(trainer, evals))
    keep, dropped, longest = _count(lengths, limit)
    eval_keep, eval_dropped, eval_longest = _count(eval_lengths, limit)
    if train and not any(keep):
        raise ConfigError("run config", "task.max_prompt_tokens",
                          f"all {len(train)} training tasks have prompts longer than {limit} tokens (shortest "
                          f"{min(lengths)}, longest {longest}); raise task.max_prompt_tokens above {min(lengths)} "
                          "or use shorter prompts")
    if not dropped and not eval_dropped:
        return train, evals, None
    note = (f"dstrain: note: {_setting(task)}: dropped {dropped} of {len(train)} training tasks"
            + (f" (longest prompt {longest} tokens)" if dropped else "")
            + f" and {eval_dropped} of {len(evals)} held-out tasks"
            + (f" (longest prompt {eval_longest} tokens)" if eval_dropped else "")
            + f" whose prompt is longer than {limit} tokens")
    return ([t for t, k in zip(train, keep) if k], [t for t, k in zip(evals, eval_keep) if k], note)


def drop_long_prompts(cfg, task, train: list, evals: list, log=print) -> tuple[list, list]:
    """The trainer's step after loading the tasks: :func:`within_limit` with the run's policy tokenizer (the
    checkpoint's, before a warm start replaces it with its own copy); its note goes to ``log``."""
    from dstrain.trainers import policy_rl as prl
    _, mcfg, rl = prl.policy_toolkit(cfg)
    tokenizer = prl.task_tokenizer(rl, mcfg, task)
    train, evals, note = within_limit(cfg.trainer, task, tokenizer, train, evals)
    if note:
        log(note)
    return train, evals


def _score_overhead(task) -> int:
    """SCoRe's turn-2 episode beyond its turn-1 prompt: the first answer, the hint, the second answer and the
    sections' words (counted in bytes: no tokenizer used here gives more tokens than bytes)."""
    from dstrain.rl.episode import turn1_prompt, turn2_prompt
    words = len(turn2_prompt("", "", "").encode()) - len(turn1_prompt("").encode())
    return task.max_new_tokens + getattr(task, "hint_max_new_tokens", 0) + words


def planned_seq_len(cfg) -> int | None:
    """The sequence length the memory plan traces for a policy-RL run whose ``task.max_prompt_tokens`` is set:
    that limit plus ``task.max_new_tokens`` (SCoRe: plus the turn-2 episode's first answer, hint and words).
    None (``data.seq_len`` stays the planned length) for other trainers and for the default limit."""
    if cfg.trainer not in POLICY_TRAINERS or not isinstance(cfg.task, dict):
        return None
    limit = cfg.task.get("max_prompt_tokens", 0)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    from dstrain.trainers import task_config
    task = task_config(cfg)
    return limit + task.max_new_tokens + (_score_overhead(task) if cfg.trainer == "score" else 0)


def _cheap(task) -> bool:
    """The tasks can be read here without a download: generated, or local files."""
    from pathlib import Path
    if task.source not in ("mbpp", "gsm8k"):
        return True
    return all(Path(p).expanduser().is_file() for p in (task.path, task.eval_path) if p)


def prompt_note(cfg) -> str | None:
    """``dstrain plan``'s and ``check-config``'s line on the prompts' lengths against ``task.max_prompt_tokens``
    where the tasks are cheap to read (generated, or local files; not a hub name), else None."""
    from dstrain.config import ConfigError
    from dstrain.trainers import policy_rl as prl
    from dstrain.trainers import task_config
    task = task_config(cfg)
    if not _cheap(task):
        return None
    try:
        train, evals = prl.load_task_sets(task, cfg.data.seed)
        _, mcfg, rl = prl.policy_toolkit(cfg)
        tokenizer = prl.task_tokenizer(rl, mcfg, task)
    except (ConfigError, OSError, ValueError):  # said by the checks of their own, or at launch
        return None
    limit = prompt_limit(task)
    lengths = prompt_lengths(tokenizer, policy_prompts(cfg.trainer, train))
    eval_lengths = prompt_lengths(tokenizer, policy_prompts(cfg.trainer, evals))
    keep, dropped, longest = _count(lengths, limit)
    _, eval_dropped, eval_longest = _count(eval_lengths, limit)
    head = (f"prompts: {len(train)} training tasks (longest prompt {longest} tokens) and {len(evals)} held-out "
            f"(longest {eval_longest}) against {_setting(task)}: ")
    if train and not any(keep):
        return head + "every training task is over it: the run will be refused; raise task.max_prompt_tokens"
    line = head + (f"{dropped} training and {eval_dropped} held-out tasks are over it and will be dropped when the "
                   "run loads them" if dropped or eval_dropped else "none is over it")
    kept = max((n for n, k in zip(lengths, keep) if k), default=0)
    episode = kept + task.max_new_tokens + (_score_overhead(task) if cfg.trainer == "score" else 0)
    if planned_seq_len(cfg) is None and episode > cfg.data.seq_len:
        extra = ", the turn-2 episode's answer, hint and words" if cfg.trainer == "score" else ""
        line += (f"; activations are planned at data.seq_len={cfg.data.seq_len}, shorter than the longest sequence "
                 f"the run will see ({episode} tokens: the longest prompt kept + task.max_new_tokens{extra}): "
                 f"--task.max_prompt_tokens={kept} plans for it")
    return line
