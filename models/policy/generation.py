"""Sampling completions from a policy, and packing them into a training batch.

:func:`generate` wraps ``transformers``' ``generate`` (left padding, sampling with
temperature and nucleus ``top_p``, EOS) and adds stop strings; under ZeRO-3 it
gathers the parameters once for the whole call. :func:`pack` lays the prompts
and completions out right-padded for the training forward.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Sequence

import torch

from .model import (PolicyModel, is_partitioned, learned_position_limit, position_limit_problem,
                    rope_length_problem)
from .moe import no_router_logits
from .tokenizer import continuation_reader, decode_continuation, encode_prompt, eos_token_ids


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    index: int
    """Index of the prompt in the ``prompts`` list."""
    sample: int
    """Which of the ``num_samples`` completions of that prompt (0-based)."""
    prompt_ids: list[int]
    """Token ids of the prompt (no padding)."""
    completion_ids: list[int]
    """Generated ids: up to and including the first stop string's tokens, or EOS."""
    text: str
    """Decoded completion (special tokens dropped), cut where the stop string begins."""
    finished: bool
    """True if a stop string or EOS ended it; False if ``max_new_tokens`` did."""
    stop: str | None = None
    """The stop string that ended it, if any."""


class StopOnStrings:
    """A ``transformers`` stopping criterion: a row is done once its completion contains a stop string.

    Only the last ``window`` tokens of each row are decoded per step (enough to hold
    the longest stop string: every non-special token decodes to at least one byte). While
    the window starts at the completion's start it is read after the prompt's last tokens
    (as :func:`~models.policy.tokenizer.decode_continuation` reads it): decoded alone, a
    SentencePiece decoder strips the space of the first ``▁``, and a stop string that starts
    with a space (``" ###"``) at the very start of a completion was missed.
    """

    def __init__(self, tokenizer, stops: Sequence[str], prompt_len: int):
        self.tokenizer, self.stops, self.prompt_len = tokenizer, list(stops), prompt_len
        self.window = max(len(s.encode("utf-8")) for s in self.stops) + 4

    def __call__(self, input_ids: torch.Tensor, scores=None, **kwargs) -> torch.Tensor:
        start = max(self.prompt_len, input_ids.shape[1] - self.window)
        decode = self.tokenizer.batch_decode
        if start > self.prompt_len:
            # a stop string complete in this step starts at least 4 tokens into the window, so the space the
            # decoder strips from the window's first token is never part of it: the window alone, one decode
            tails = decode(input_ids[:, start:].tolist(), skip_special_tokens=True)
        else:  # the window is the whole completion so far: read it after the prompt's last tokens
            lo = max(0, start - 8)  # (decode_continuation reads the prompt's last 8 tokens)
            tails = [decode_continuation(self.tokenizer, row[:start - lo], row[start - lo:])
                     for row in input_ids[:, lo:].tolist()]
        return torch.tensor([any(s in t for s in self.stops) for t in tails],
                            dtype=torch.bool, device=input_ids.device)


def cut_at_stop(ids: list[int], tokenizer, stops: Sequence[str], prompt_ids: Sequence[int] = ()
                ) -> tuple[int, str, str] | None:
    """Find the shortest prefix ``ids[:k]`` whose text contains a stop string.

    Returns ``(k, text before the stop string, the stop string)`` or None. The
    prefix keeps the stop string's tokens; if several stop strings are present,
    the one that appears first in that prefix wins. The text is read as it follows
    ``prompt_ids`` (:func:`~models.policy.tokenizer.decode_continuation`).
    """
    read = continuation_reader(tokenizer, prompt_ids)  # the prompt's tail decoded once for the whole search
    decode = lambda n: read(ids[:n])  # noqa: E731
    hit = lambda text: any(s in text for s in stops)  # noqa: E731
    if not stops or not hit(decode(len(ids))):
        return None
    lo, hi = 1, len(ids)  # invariant: decode(hi) contains a stop
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(decode(mid)):
            hi = mid
        else:
            lo = mid + 1
    text = decode(hi)
    start, stop = min((text.find(s), s) for s in stops if s in text)
    return hi, text[:start], stop


def _split(model) -> tuple[PolicyModel, object | None]:
    """(the PolicyModel, its DeepSpeed engine or None) from a PolicyModel, dstrain Engine or DeepSpeed engine."""
    engine = getattr(model, "ds", None) or (model if not isinstance(model, PolicyModel) else None)
    policy = engine.module if engine is not None else model
    if not isinstance(policy, PolicyModel):
        raise TypeError(f"generate expects a PolicyModel (or an engine around one), got "
                        f"{type(policy).__name__}")
    return policy, engine


def _zero_offload(policy: PolicyModel, engine=None):
    """DeepSpeed's ZeRO-3 parameter coordinator (``DeepSpeedZeRoOffload``) driving ``policy``, or None.

    From the engine when given; else found through the fetch hook DeepSpeed put on
    the top module (so a trainer may pass ``engine.module``).
    """
    if engine is not None:
        offload = getattr(engine, "optimizer", None)
        offload = getattr(offload, "parameter_offload", offload)
        return offload if hasattr(offload, "forward_hooks") else None
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    # DeepSpeed's hook functions close over the coordinator; they come wrapped (compiler.disable, nvtx)
    todo = [*policy._forward_pre_hooks.values(), *policy._forward_hooks.values()]
    for _ in range(4 * len(todo) + 4):
        if not todo:
            break
        fn = todo.pop()
        if isinstance(fn, DeepSpeedZeRoOffload):
            return fn
        todo.extend(x for x in [getattr(fn, "__wrapped__", None), getattr(fn, "_torchdynamo_orig_callable", None)]
                    if x is not None)
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, DeepSpeedZeRoOffload) or inspect.isfunction(value):
                todo.append(value)
    return None


@contextlib.contextmanager
def gathered_for_generation(policy: PolicyModel, engine=None):
    """Gather ZeRO-3 parameters once (collective: every rank must enter) and keep them.

    A DeepSpeed engine's per-module fetch/release hooks would partition each layer
    again after its forward (an all-gather per layer per token); they are taken off
    for the duration and put back afterwards, as DeepSpeed's own
    ``unwrap_model_for_generation`` does.
    """
    import deepspeed

    offload = _zero_offload(policy, engine)
    with deepspeed.zero.GatheredParameters(list(policy.parameters())):
        if offload is not None:
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            if offload is not None:
                offload._register_deepspeed_module(offload.module)


def generate(model: PolicyModel, tokenizer, prompts: list[str], *, num_samples: int = 1,
             temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 64,
             stop: Sequence[str] = (), greedy: bool = False, seed: int | None = None,
             gather_zero3: bool | None = None) -> list[Completion]:
    """Sample ``num_samples`` completions per prompt; returns them prompt-major.

    ``model`` is a :class:`PolicyModel`, or a (dstrain or DeepSpeed) engine around one.
    Prompts are left-padded (for a model whose recurrence reads the padding, :func:`left_padding_leaks`, the
    prompts of each length are generated as a batch of their own, unpadded). ``greedy`` takes
    the argmax (temperature and top_p unused); otherwise sampling from
    ``softmax(logits / temperature)`` restricted to the ``top_p`` nucleus (no top-k).
    Prompts get the special tokens the tokenizer puts in front (:func:`encode_prompt`);
    every id of :func:`eos_token_ids` ends a completion. The pad and BOS tokens are never
    generated, nor ids past ``len(tokenizer)`` (a padded embedding). ``seed`` makes sampling reproducible
    without touching the caller's RNG state. The model is put in eval mode (and back),
    with gradients off.

    ZeRO-3 (``gather_zero3`` None = when the parameters are partitioned): the
    parameters are gathered ONCE around the whole call, so every rank must call
    ``generate`` together (with its own prompts, possibly none); the gathered model
    must fit on one device.
    """
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"num_samples ({num_samples}) and max_new_tokens ({max_new_tokens}) "
                         "must be at least 1")
    if not greedy and not (temperature > 0 and 0 < top_p <= 1):
        raise ValueError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got "
                         f"{temperature}, {top_p}")
    if isinstance(stop, str):
        stop = (stop,)
    policy, engine = _split(model)
    gather = is_partitioned(policy) if gather_zero3 is None else gather_zero3
    context = gathered_for_generation(policy, engine) if gather else contextlib.nullcontext()
    was_training = policy.training
    policy.eval()
    try:
        with context, torch.no_grad():
            if not prompts:
                return []
            return _generate(policy, tokenizer, prompts, num_samples, temperature, top_p,
                             max_new_tokens, list(stop), greedy, seed)
    finally:
        policy.train(was_training)


def policy_vocab_size(policy: PolicyModel) -> int:
    """Rows of the output head (the checkpoint's ``vocab_size``, which may exceed the tokenizer's)."""
    cfg = policy.hf.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.vocab_size)


def never_generated(tok, vocab: int) -> list[int]:
    """Ids no completion may contain (sorted): the pad and BOS tokens (unless one of them ends a
    completion) and the rows of a padded embedding (``vocab`` rounded up past the tokenizer: no text
    decodes to them). Every generation backend leaves them out."""
    ends = eos_token_ids(tok)
    banned = {t for t in (tok.pad_token_id, tok.bos_token_id) if t is not None and t not in ends}
    return sorted(banned | set(range(len(tok), vocab)))


LEFT_PADDING_LEAKS = ("recurrent_gemma",)
"""``model_type``s whose recurrent layers read the padding of a left-padded batch: RecurrentGemma's temporal
convolution runs over the pad positions before a row's first token (its RG-LRU resets there, the convolution does
not), so a short prompt batched with a long one was continued from another state than alone (0.7 nats per token
on a tiny checkpoint) and GRPO's no-cache scoring disagreed with the sampler. Mamba, Mamba-2, Jamba, Bamba,
Falcon-H1, Zamba2, LFM2, Qwen3-Next and Granite-MoE-hybrid mask it (tests/unit/test_hf_checkpoints7.py)."""


def left_padding_leaks(hf) -> bool:
    """Whether ``hf`` (a transformers model; False for a module without a config) must generate without left padding (:data:`LEFT_PADDING_LEAKS`):
    :func:`generate` then runs the prompts of each length as one batch."""
    cfg = getattr(hf, "config", None)  # (a critic's backbone may be any module)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "model_type", None) in LEFT_PADDING_LEAKS


def _generate(policy, tok, prompts, num_samples, temperature, top_p, max_new_tokens, stops,
              greedy, seed) -> list[Completion]:
    from transformers import GenerationConfig, StoppingCriteriaList

    encoded = [encode_prompt(tok, p) for p in prompts]
    rows = [ids for ids in encoded for _ in range(num_samples)]
    width = max(len(r) for r in rows)
    if width == 0:
        raise ValueError("all prompts are empty: give at least one token to condition on")
    if (why := rope_length_problem(policy.hf.config, width + max_new_tokens) or position_limit_problem(
            learned_position_limit(policy.hf), width + max_new_tokens, "the longest prompt + max_new_tokens")):
        raise ValueError(why)
    vocab = policy_vocab_size(policy)
    if max(max(r, default=0) for r in rows) >= vocab:
        raise ValueError(f"a prompt holds token id {max(max(r, default=0) for r in rows)}, past the model's "
                         f"vocabulary ({vocab} embedding rows): tokenizer and checkpoint do not belong together")
    device = next(policy.parameters()).device
    pad, ends = tok.pad_token_id, eos_token_ids(tok)
    banned = never_generated(tok, vocab)
    sampling = {} if greedy else dict(temperature=float(temperature), top_p=float(top_p), top_k=0)
    gen_cfg = GenerationConfig(do_sample=not greedy, max_new_tokens=max_new_tokens,
                               pad_token_id=pad, eos_token_id=ends,
                               suppress_tokens=banned or None, **sampling)
    # rows generated together: all (left-padded), or, where padding leaks into the state, those of one length
    groups = ([list(range(len(rows)))] if not left_padding_leaks(policy.hf) else
              [[i for i, r in enumerate(rows) if max(len(r), 1) == n] for n in sorted({max(len(r), 1) for r in rows})])
    fork = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                 enabled=seed is not None)
    # transformers fills every option left unset from the model's own generation_config
    # (a checkpoint's repetition_penalty, top_k, min_p...): blank it so that sampling is
    # exactly softmax(logits / temperature) within the top_p nucleus.
    saved, policy.hf.generation_config = policy.hf.generation_config, GenerationConfig()
    generated: list[list[int]] = [[] for _ in rows]
    try:
        with fork:
            if seed is not None:
                torch.manual_seed(seed)
            for group in groups:
                width = max(1, *(len(rows[i]) for i in group))
                input_ids = torch.full((len(group), width), pad, dtype=torch.long)
                mask = torch.zeros_like(input_ids)
                for j, i in enumerate(group):
                    if rows[i]:
                        input_ids[j, width - len(rows[i]):] = torch.tensor(rows[i])
                        mask[j, width - len(rows[i]):] = 1
                criteria = StoppingCriteriaList([StopOnStrings(tok, stops, width)] if stops else [])
                out = policy.hf.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                         generation_config=gen_cfg, stopping_criteria=criteria,
                                         synced_gpus=False, **no_router_logits(policy.hf))
                for i, seq in zip(group, out[:, width:].tolist()):
                    generated[i] = seq
    finally:
        policy.hf.generation_config = saved
    results = []
    for i, seq in enumerate(generated):
        ids, finished, hit = seq, False, None
        end = next((j for j, t in enumerate(ids) if t in ends), None)
        if end is not None:
            ids, finished = ids[:end + 1], True
        cut = cut_at_stop([t for t in ids if t not in ends], tok, stops, rows[i]) if stops else None
        if cut is not None:
            ids, text, hit = ids[:cut[0]], cut[1], cut[2]
            finished = True
        else:
            text = decode_continuation(tok, rows[i], ids)
        results.append(Completion(index=i // num_samples, sample=i % num_samples,
                                  prompt_ids=list(rows[i]), completion_ids=ids, text=text,
                                  finished=finished, stop=hit))
    return results


def pack(completions: Sequence[Completion], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded training batch of ``prompt + completion`` rows, in the given order.

    Returns ``input_ids`` ``[N, T]`` (``pad_id`` after each row's end),
    ``attention_mask`` (1 on prompt and completion tokens), ``completion_mask``
    (1 on completion tokens only), ``prompt_lengths`` and ``completion_lengths``
    ``[N]``. Right padding keeps every row's positions at ``0..len-1``, as in
    generation. ``token_logprobs(logits, input_ids)`` is ``[N, T-1]``, entry t
    scoring token t+1: its loss mask is ``completion_mask[:, 1:]``.
    """
    if not completions:
        raise ValueError("pack needs at least one completion")
    rows = [list(c.prompt_ids) + list(c.completion_ids) for c in completions]
    width = max(len(r) for r in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    completion = torch.zeros((n, width), dtype=torch.long)
    for i, (c, r) in enumerate(zip(completions, rows)):
        p = len(c.prompt_ids)
        input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        attention[i, :len(r)] = 1
        completion[i, p:len(r)] = 1
    return dict(input_ids=input_ids, attention_mask=attention, completion_mask=completion,
                prompt_lengths=torch.tensor([len(c.prompt_ids) for c in completions]),
                completion_lengths=torch.tensor([len(c.completion_ids) for c in completions]))
