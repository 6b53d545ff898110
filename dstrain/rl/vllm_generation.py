"""Generation backends behind the policy toolkit's ``generate``: ``hf`` (the policy's own) or ``vllm``.

``rollout.generator = "vllm"`` (GRPO, ``rollout.backend = "local"``) puts a vLLM engine in
each training rank's process, on that rank's GPU ("colocated": no second set of GPUs).
:class:`VLLMToolkit` wraps the model family's RL toolkit: ``generate`` goes to vLLM, every
other call (``pack``, ``token_logprobs``, ...) to the toolkit itself, so the trainer, its
rollouts and its pass@k evaluation run unchanged.

Weights: vLLM starts from a Hugging Face checkpoint of the policy written at start-up
(``<output>/vllm_init``, by rank 0, gathered under ZeRO-3); before a ``generate`` that
follows an optimizer step, the policy's full state is read once (one ``GatheredParameters``
under ZeRO-3, a collective every rank joins: every rank calls ``generate`` together, as
with the ``hf`` generator) and loaded into vLLM's model in place (``load_weights``).

Sampling matches the ``hf`` generator's contract (``models/policy/generation.py``): prompts
go in as token ids of the trainer's tokenizer; completions are cut by the same function
(``cut_at_stop``), so ``completion_ids`` keep the stop string's tokens or the EOS and
``text`` ends where the stop string begins; temperature and top-p only (no top-k), over the same
ids (pad, BOS and a padded embedding's rows get a logit bias of :data:`BANNED_LOGIT_BIAS`, whose
probability is exactly 0 in vLLM's fp32 sampler); each
sample draws from its own seed derived from ``seed``.
Not installed here: the config refuses ``vllm`` with one line (:func:`vllm_missing`).
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

GENERATORS = ("hf", "vllm")


def vllm_missing() -> str:
    """Why ``rollout.generator=vllm`` cannot run here ("" when it can be tried)."""
    if importlib.util.find_spec("vllm") is None:
        return "rollout.generator=vllm needs the vllm package, which is not installed (pip install vllm, on a CUDA machine)"
    return ""


def _vllm_model(llm):
    """The ``torch.nn.Module`` inside a single-process vLLM engine (V0 and V1 layouts)."""
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    for path in ("model_runner.model", "worker.model_runner.model"):
        obj = worker
        try:
            for attr in path.split("."):
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            continue
    raise RuntimeError("cannot reach the model inside this vLLM version's engine to load weights into it; "
                       "run with VLLM_ENABLE_V1_MULTIPROCESSING=0 or use rollout.generator=hf")


def hf_state(policy_state: dict) -> dict:
    """The policy's state dict under the Hugging Face names vLLM loads (``hf.`` prefix dropped)."""
    return {(k[3:] if k.startswith("hf.") else k): v for k, v in policy_state.items()}


def to_completions(outputs, rows: list[list[int]], num_samples: int, tokenizer, stops) -> list:
    """vLLM ``RequestOutput``s (one request per prompt x sample, prompt-major) as ``Completion``s, cut
    exactly as the hf generator cuts (``models/policy/generation.py``): at the first EOS (kept), else
    right after the first stop string's tokens (kept; ``text`` ends where it begins)."""
    from models.policy.generation import Completion, cut_at_stop
    from models.policy.tokenizer import decode_continuation, eos_token_ids
    ends = eos_token_ids(tokenizer)
    results = []
    for i, out in enumerate(outputs):
        o = out.outputs[0]
        ids, finished, hit = list(o.token_ids), False, None
        end = next((j for j, t in enumerate(ids) if t in ends), None)
        if end is not None:
            ids, finished = ids[:end + 1], True
        elif o.finish_reason == "stop" and not isinstance(o.stop_reason, str) and ends:
            # vLLM ended it on an EOS without listing it: keep that EOS (stopping is learnt)
            ids, finished = ids + [o.stop_reason if o.stop_reason in ends else ends[0]], True
        cut = cut_at_stop([t for t in ids if t not in ends], tokenizer, stops, rows[i]) if stops else None
        if cut is not None:
            ids, text, hit, finished = ids[:cut[0]], cut[1], cut[2], True
        else:
            text = decode_continuation(tokenizer, rows[i], ids)
        results.append(Completion(index=i // num_samples, sample=i % num_samples, prompt_ids=list(rows[i]),
                                  completion_ids=ids, text=text, finished=finished, stop=hit))
    return results


BANNED_LOGIT_BIAS = -1.0e4
"""The logit bias of the ids the hf generator never samples (``models.policy.generation.never_generated``). vLLM
adds it to the fp32 logits before temperature and top-p, and exp(-1e4) is 0 in fp32: those ids are never drawn,
as under the hf generator's mask. ``logit_bias`` names the few banned ids, where ``allowed_token_ids`` would hand
vLLM nearly the whole vocabulary per request (150k ids for Qwen2, each checked in Python for every request)."""


class VLLMToolkit:
    """The model family's RL toolkit with ``generate`` served by a colocated vLLM engine."""

    def __init__(self, base, tr, rollout_cfg):
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("rollout.generator=vllm needs a CUDA GPU in every rank; use rollout.generator=hf")
        import vllm
        self.base, self.tr, self.vllm = base, tr, vllm
        from dstrain import runtime
        from models.policy.tokenizer import has_tokenizer_files
        folder = Path(tr.out) / "vllm_init"
        base.save_pretrained(tr.policy, str(folder))  # gathered under ZeRO-3; rank 0 writes
        runtime.barrier()
        # A checkpoint's own tokenizer lets vLLM stop on the stop strings itself; the embedded byte
        # tokenizer is not one vLLM can load: it then gets token ids only and runs to EOS or the length.
        source = getattr(tr.model_cfg, "path", "")
        self.own_tokenizer = bool(source) and has_tokenizer_files(source)
        tokenizer_args = {"tokenizer": source} if self.own_tokenizer else {"skip_tokenizer_init": True}
        dtype = str(next(tr.policy.parameters()).dtype).replace("torch.", "")
        launcher = {"distributed_executor_backend": "external_launcher"} if tr.world.world_size > 1 else {}
        from dstrain.gpu_binding import local_rank_as_device
        with local_rank_as_device(tr.world):  # (its external launcher runs on cuda:LOCAL_RANK)
            self.llm = vllm.LLM(model=str(folder), dtype=dtype, seed=tr.cfg.train.seed + tr.world.rank,
                                gpu_memory_utilization=rollout_cfg.vllm_gpu_memory_utilization, enforce_eager=True,
                                tensor_parallel_size=1, **tokenizer_args, **launcher)
        from dstrain.rl.rollout import policy_version
        self.version = policy_version(self.tr.engine)
        self.last_sync: dict = {}

    def __getattr__(self, name):
        return getattr(self.base, name)

    def sync(self) -> None:
        """Copy the policy's weights into vLLM if it stepped since the last copy (every rank together)."""
        from dstrain.rl.rollout import _full_state, policy_version
        version = policy_version(self.tr.engine)
        if version == self.version:
            return
        start = time.perf_counter()
        state = hf_state(_full_state(self.tr.engine))
        _vllm_model(self.llm).load_weights(list(state.items()))
        self.version = version
        self.last_sync = {"weight_sync_s": time.perf_counter() - start,
                          "weight_sync_bytes": sum(v.numel() * v.element_size() for v in state.values())}

    def generate(self, model, tokenizer, prompts: list[str], *, num_samples: int = 1, temperature: float = 1.0,
                 top_p: float = 1.0, max_new_tokens: int = 64, stop=(), greedy: bool = False, seed=None,
                 gather_zero3=None) -> list:
        self.sync()
        if not prompts:
            return []
        from models.policy.generation import never_generated, policy_vocab_size
        from models.policy.tokenizer import encode_prompt, eos_token_ids
        encoded = [encode_prompt(tokenizer, p) for p in prompts]
        rows = [ids for ids in encoded for _ in range(num_samples)]
        from models.policy.model import rope_length_problem
        if (why := rope_length_problem(self.tr.policy.hf.config, max(map(len, rows)) + max_new_tokens)):
            raise ValueError(why)
        base_seed = 0 if seed is None else int(seed)
        # the hf generator's suppressed ids (pad, BOS, a padded embedding's rows), left out here too
        vocab = policy_vocab_size(self.tr.policy)
        bias = {i: BANNED_LOGIT_BIAS for i in never_generated(tokenizer, vocab)} or None
        params = [self.vllm.SamplingParams(n=1, temperature=0.0 if greedy else float(temperature),
                                           top_p=1.0 if greedy else float(top_p), top_k=-1,
                                           max_tokens=max_new_tokens,
                                           stop=(list(stop) or None) if self.own_tokenizer else None,
                                           stop_token_ids=eos_token_ids(tokenizer),
                                           include_stop_str_in_output=True, detokenize=self.own_tokenizer,
                                           logit_bias=bias,
                                           seed=None if greedy else base_seed * 1_000_003 + i)
                  for i in range(len(rows))]
        outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sampling_params=params, use_tqdm=False)
        return to_completions(outputs, rows, num_samples, tokenizer, stop)


def make_toolkit(base, tr, rollout_cfg):
    """The toolkit the trainer generates with: ``base`` itself (``hf``) or its vLLM wrapper."""
    if getattr(rollout_cfg, "generator", "hf") == "vllm":
        missing = vllm_missing()
        if missing:
            raise RuntimeError(missing + "; use rollout.generator=hf")
        return VLLMToolkit(base, tr, rollout_cfg)
    return base
