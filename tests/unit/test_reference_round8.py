"""Round 8 of the independent references: each quantity recomputed from its definition (plain loops,
float64, the paper's formula or the library's documented rule), never through dstrain's helpers.

Compared here:

* HRM's rotary position embedding (RoFormer, in the rotate-half layout HRM's reference and Llama use:
  dimension ``i`` and ``i + D/2`` rotate together by ``p * theta^(-2i/D)`` at position ``p``, the
  puzzle-embedding prefix counted as positions ``0 .. puzzle_emb_len - 1``) against a float64 loop, for
  an ordinary build and for one under ZeRO-3's ``zero.Init`` in bf16 (DeepSpeed's own constructor
  wrappers in process, and, marked slow, a real ``zero.Init`` on one gloo rank with the factory's replay
  of the initialisation): the tables, the initial states and every weight must equal the fp32 build's
  (the weights rounded once to bf16);
* sampling (``models.policy.generate``): the probabilities handed to the sampler at every step against
  ``softmax(logits / temperature)`` over the ids that may be generated (not pad, not BOS, not the rows of
  a padded embedding), restricted to the nucleus (the fewest most probable ids whose mass reaches
  ``top_p``) and renormalised, computed in float64 from the logits the model returned;
* the ids the vLLM generator keeps vLLM from sampling (``logit_bias`` of -1e4, probability 0 in fp32) against
  the complement of the same set;
* greedy generation of left-padded prompts of different lengths in one batch with the KV cache against
  each prompt alone, recomputed from scratch at every token without a cache (argmax over the allowed
  ids), for the Llama-style policy (rotary) and a GPT-2 checkpoint (absolute positions);
* the weight-decay groups of every model family (GPT with biases, dilated LM, HRM, the Llama-style
  policy) against README's rule written by module type: the ``weight`` of a Linear or Embedding layer
  decays; biases and norm gains do not.

Found and fixed:

* HRM could not be built under ``zero.Init`` (``--deepspeed.zero_init=true``, or ``auto`` on a host short
  of RAM, at ZeRO-3): ``lecun_init_`` divided by the fan-in of the empty shard (ZeroDivisionError on every
  rank). The fan-in now comes from the full shape (``ds_shape``).
* Under a bf16 ``zero.Init`` DeepSpeed turns every floating tensor that ``torch.arange`` / ``torch.empty``
  make into bf16: HRM's rotary tables were computed in bf16 (angles off by up to 0.19 rad at position 96,
  cos/sin off by 0.09), its initial states ``H_init`` / ``L_init`` were bf16 buffers (fp32 in every other
  build), and its truncated normals were drawn in bf16 arithmetic (weights up to 0.57 away from the fp32
  build of the same seed). The tables are now formed from integer ranges cast to fp32, the states cast
  to fp32, and a 16-bit tensor gets fp32 draws rounded once: the build equals the unsharded one.

* The vLLM generator (``rollout.generator=vllm``) promised the hf generator's sampling but asked vLLM for
  every id of the model's embedding: the pad and BOS tokens and the rows of a padded vocabulary (Qwen2's
  151,936 rows for a 151,665-token tokenizer) could be sampled, and a padded row decodes to no text. It
  now gives the ids the hf generator never produces a logit bias of -1e4 (probability 0 in vLLM's fp32
  sampler; one rule, ``models.policy.generation.never_generated``, serves both). Not ``allowed_token_ids``:
  vLLM checks that list id by id in Python for every request, nearly the whole vocabulary each time.

Deliberate deviation, documented (models/hrm/README.md): HRM's reference decays every parameter with
AdamATan2's weight decay, the Q-head's bias included; dstrain applies its one rule to every family, so
that bias (the only vector parameter HRM has) is not decayed.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from models import registry

# ------------------------------------------------------------------------------ rotary positions


def _rotated_reference(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoFormer's rotation of ``x`` ``[B, H, T, D]`` in the rotate-half layout, element by element in float64."""
    b, h, t, d = x.shape
    half = d // 2
    out = torch.empty(b, h, t, d, dtype=torch.float64)
    xs = x.double().tolist()
    for bi in range(b):
        for hi in range(h):
            for p in range(t):
                row = xs[bi][hi][p]
                for i in range(half):
                    angle = p * theta ** (-2.0 * i / d)
                    c, s = math.cos(angle), math.sin(angle)
                    out[bi, hi, p, i] = row[i] * c - row[i + half] * s
                    out[bi, hi, p, i + half] = row[i + half] * c + row[i] * s
    return out


def _zero_init_constructors(monkeypatch, dtype):
    """What ``deepspeed.zero.Init`` does to tensor constructors while a model is built (DeepSpeed's wrapper)."""
    from deepspeed.runtime.zero import partition_parameters as pp
    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn"):
        monkeypatch.setattr(torch, name, pp.zero_wrapper_for_fp_tensor_constructor(getattr(torch, name), dtype, None))


def _hrm_config(**kw):
    from models.hrm.model import HRMConfig
    base = dict(vocab_size=11, seq_len=81, puzzle_emb_len=16, hidden_size=64, num_heads=2, H_layers=1,
                L_layers=1, H_cycles=1, L_cycles=1, halt_max_steps=2)
    return HRMConfig(**{**base, **kw})


@pytest.mark.parametrize("under_zero_init", [False, True])
@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_hrm_rotary_equals_the_roformer_rotation(monkeypatch, under_zero_init, theta):
    from models.hrm.layers import Rotary, apply_rotary
    if under_zero_init:
        _zero_init_constructors(monkeypatch, torch.bfloat16)
    rot = Rotary(16, 97, theta)  # 81 Sudoku cells after a 16-position puzzle-embedding prefix
    monkeypatch.undo()
    assert rot.cos.dtype == rot.sin.dtype == torch.float32
    x = torch.randn(2, 2, 97, 16, generator=torch.Generator().manual_seed(3))
    got = apply_rotary(x, rot.cos, rot.sin).double()
    ref = _rotated_reference(x, theta)
    # fp32 angles (as HRM's reference forms them): within 2e-6 of the exact rotation at |x| ~ 4
    assert (got - ref).abs().max().item() < 2e-5
    # and 16-bit inputs rotate with the fp32 tables, cast as the attention does
    xb = x.bfloat16()
    got16 = apply_rotary(xb, rot.cos, rot.sin).double()
    assert (got16 - _rotated_reference(xb, theta)).abs().max().item() < 0.1


def test_hrm_built_under_16bit_zero_init_constructors_equals_the_fp32_build(monkeypatch):
    from models.hrm.model import HRM
    cfg = _hrm_config()
    torch.manual_seed(5)
    ref = HRM(cfg)
    _zero_init_constructors(monkeypatch, torch.bfloat16)
    torch.manual_seed(5)
    built = HRM(cfg)
    monkeypatch.undo()
    for name in ("H_init", "L_init"):
        assert getattr(built, name).dtype == torch.float32
        assert torch.equal(getattr(built, name), getattr(ref, name)), name
    assert torch.equal(built.rotary.cos, ref.rotary.cos) and torch.equal(built.rotary.sin, ref.rotary.sin)
    for (name, p), (_, q) in zip(built.named_parameters(), ref.named_parameters()):
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, q.bfloat16()), name


def test_lecun_init_of_an_empty_zero3_shard_reads_the_full_fan_in():
    from models.hrm.layers import lecun_init_
    shard = torch.empty(0)
    shard.ds_shape = torch.Size([8, 16])  # what zero.Init leaves on a partitioned parameter
    assert lecun_init_(shard).numel() == 0
    full = lecun_init_(torch.empty(4000, 400))
    assert full.std().item() == pytest.approx(1 / math.sqrt(400), rel=0.02)


def _zero_init_build(rank, world):
    import deepspeed

    from dstrain.engine.factory import _init_sharded
    from models.hrm.model import HRM
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    cfg = _hrm_config(pos_encodings="rope")
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = HRM(cfg)
    _init_sharded(model)
    torch.manual_seed(0)
    ref = HRM(cfg)
    differ = []
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        with deepspeed.zero.GatheredParameters([p]):
            if not torch.equal(p.float(), q.bfloat16().float()):
                differ.append(name)
    buffers = all(torch.equal(getattr(model, n), getattr(ref, n)) for n in ("H_init", "L_init"))
    return differ, buffers, model.rotary.cos.clone(), model.rotary.sin.clone()


@pytest.mark.slow
def test_hrm_under_a_real_bf16_zero_init_equals_the_unsharded_build():
    from tests.dist import spawn
    differ, buffers, cos, sin = spawn.run(_zero_init_build, 1)
    assert differ == [] and buffers
    assert cos.dtype == torch.float32
    d = cos.shape[1]
    for p in range(cos.shape[0]):
        for j in range(d):
            angle = p * 10000.0 ** (-2.0 * (j % (d // 2)) / d)
            assert abs(cos[p, j].item() - math.cos(angle)) < 1e-5 and abs(sin[p, j].item() - math.sin(angle)) < 1e-5


# ------------------------------------------------------------------------------ generation

@functools.lru_cache(maxsize=None)
def _byte_policy(scale: float):  # generate leaves the model as it found it: one build per scale
    from models.policy import PolicyConfig, build_policy, byte_tokenizer
    torch.manual_seed(0)
    model = build_policy(PolicyConfig(**registry.get_spec("policy").sizes["tiny"])).eval()
    with torch.no_grad():  # spread the logits: nuclei of a few ids, no near-ties
        model.hf.lm_head.weight.mul_(scale)
    return model, byte_tokenizer()


def _checkpoint_policy(tmp_path, kind: str, **kw):
    from models.policy import PolicyConfig, build_policy, load_tokenizer
    from tests.hf_checkpoints import build_checkpoint
    path = build_checkpoint(kind, str(tmp_path / kind), **kw)
    cfg = PolicyConfig(**{**registry.get_spec("policy").sizes["tiny"], "path": path})
    return build_policy(cfg).eval(), load_tokenizer(cfg)


def _allowed(tok, vocab: int) -> list[int]:
    """Ids that may be generated: the tokenizer's (not a padded row), not pad or BOS unless they end a completion."""
    from models.policy.tokenizer import eos_token_ids
    ends = set(eos_token_ids(tok))
    never = {t for t in (tok.pad_token_id, tok.bos_token_id) if t is not None} - ends
    return [v for v in range(min(vocab, len(tok))) if v not in never]


def _sampling_reference(logits: list[float], allowed: list[int], temperature: float, top_p: float) -> list[float]:
    scaled = {v: logits[v] / temperature for v in allowed}
    top = max(scaled.values())
    weights = {v: math.exp(z - top) for v, z in scaled.items()}
    total = sum(weights.values())
    probs = {v: w / total for v, w in weights.items()}
    nucleus, mass = [], 0.0
    for v in sorted(probs, key=lambda v: -probs[v]):
        nucleus.append(v)
        mass += probs[v]
        if mass >= top_p:
            break
    kept = sum(probs[v] for v in nucleus)
    out = [0.0] * len(logits)
    for v in nucleus:
        out[v] = probs[v] / kept
    return out


def _record_sampling(monkeypatch, model):
    """(the last-position logits of every forward, the probabilities every torch.multinomial call got)."""
    logits, probs = [], []
    handle = model.hf.register_forward_hook(lambda m, a, out: logits.append(out.logits[:, -1].detach().clone()))
    draw = torch.multinomial

    def recording(p, *args, **kwargs):
        probs.append(p.detach().clone())
        return draw(p, *args, **kwargs)
    monkeypatch.setattr(torch, "multinomial", recording)
    return logits, probs, handle


@pytest.mark.parametrize("temperature, top_p", [(0.7, 0.8), (1.3, 0.95), (1.0, 1.0), (0.5, 0.3)])
def test_sampling_probabilities_are_the_tempered_nucleus(monkeypatch, temperature, top_p):
    from models.policy.generation import generate
    model, tok = _byte_policy(6.0)
    logits, probs, handle = _record_sampling(monkeypatch, model)
    generate(model, tok, ["ab", "hello wor"], num_samples=2, temperature=temperature, top_p=top_p,
             max_new_tokens=5, seed=3)
    handle.remove()
    assert len(logits) == len(probs) == 5
    allowed = _allowed(tok, logits[0].shape[-1])
    assert 257 not in allowed and 258 not in allowed and 256 in allowed  # pad, BOS out; EOS in
    sizes = set()
    for lg, pr in zip(logits, probs):
        for r in range(lg.shape[0]):
            ref = _sampling_reference(lg[r].double().tolist(), allowed, temperature, top_p)
            sizes.add(sum(x > 0 for x in ref))
            assert max(abs(a - b) for a, b in zip(ref, pr[r].double().tolist())) < 1e-6
    assert max(sizes) > 1  # a nucleus of several ids was compared, not only argmax picks


def test_sampling_never_reaches_padded_rows_or_bos_of_a_checkpoint(monkeypatch, tmp_path):
    from models.policy.generation import generate
    model, tok = _checkpoint_policy(tmp_path, "llama", extra_vocab=5, bos="<s>", add_bos=True)
    vocab = model.hf.config.vocab_size
    assert vocab == len(tok) + 5
    logits, probs, handle = _record_sampling(monkeypatch, model)
    generate(model, tok, ["def add", "x ="], num_samples=2, temperature=1.1, top_p=0.9, max_new_tokens=4, seed=1)
    handle.remove()
    allowed = _allowed(tok, vocab)
    assert tok.bos_token_id not in allowed and len(allowed) == len(tok) - 2  # BOS and pad
    for lg, pr in zip(logits, probs):
        for r in range(lg.shape[0]):
            ref = _sampling_reference(lg[r].double().tolist(), allowed, 1.1, 0.9)
            assert max(abs(a - b) for a, b in zip(ref, pr[r].double().tolist())) < 1e-6


@pytest.mark.parametrize("kind", ["byte", "llama"])
def test_the_vllm_generator_samples_over_the_same_ids(tmp_path, kind):
    """vLLM (not installed here: its ``SamplingParams`` and ``LLM`` are stand-ins that record the request)
    must be asked for the ids the hf generator may produce, no more."""
    import types

    from dstrain.rl.vllm_generation import BANNED_LOGIT_BIAS, VLLMToolkit
    if kind == "byte":
        model, tok = _byte_policy(1.0)
    else:
        model, tok = _checkpoint_policy(tmp_path, kind, extra_vocab=3, bos="<s>", add_bos=True)
    requests = []

    def answer(prompts, sampling_params, use_tqdm=False):
        requests.extend(sampling_params)
        out = types.SimpleNamespace(token_ids=[tok.eos_token_id], finish_reason="stop", stop_reason=None, text="")
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    kit = VLLMToolkit.__new__(VLLMToolkit)  # what __init__ would hold, without a GPU or vLLM
    kit.base, kit.version, kit.own_tokenizer, kit.last_sync = None, 0, False, {}
    kit.tr = types.SimpleNamespace(policy=model, engine=types.SimpleNamespace(global_steps=0))
    kit.vllm = types.SimpleNamespace(SamplingParams=lambda **kw: types.SimpleNamespace(**kw))
    kit.llm = types.SimpleNamespace(generate=answer)
    kit.generate(model, tok, ["ab", "x"], num_samples=2, temperature=0.9, top_p=0.8, max_new_tokens=3, seed=1)
    kit.generate(model, tok, ["ab"], greedy=True, max_new_tokens=3)
    vocab = model.hf.config.vocab_size
    banned = sorted(set(range(vocab)) - set(_allowed(tok, vocab)))
    assert banned  # pad and BOS at least
    assert len(requests) == 5
    for params in requests:
        assert not getattr(params, "allowed_token_ids", None)
        assert sorted(params.logit_bias) == banned
        # a bias whose probability is exactly 0 in fp32, whatever the real logits (|x| < 100) and temperature
        for temperature in (1.0, 0.05):
            logits = torch.tensor([50.0, -50.0, BANNED_LOGIT_BIAS - 50.0]) / temperature
            assert torch.softmax(logits, 0)[2].item() == 0.0
        assert all(b == BANNED_LOGIT_BIAS for b in params.logit_bias.values())


def _greedy_alone(model, tok, prompt_ids: list[int], steps: int) -> list[int]:
    """Each token the argmax over the allowed ids of a fresh forward of the whole row (no cache, no padding)."""
    from models.policy.tokenizer import eos_token_ids
    ends = set(eos_token_ids(tok))
    new: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([prompt_ids + new]))[0, -1].double().tolist()
            allowed = _allowed(tok, len(row))
            new.append(max(allowed, key=lambda v: row[v]))
            if new[-1] in ends:
                break
    return new


@pytest.mark.parametrize("kind", ["byte", "gpt2"])
def test_batched_left_padded_greedy_with_cache_equals_each_row_alone(tmp_path, kind):
    from models.policy.generation import generate
    from models.policy.tokenizer import encode_prompt
    model, tok = _byte_policy(5.0) if kind == "byte" else _checkpoint_policy(tmp_path, kind)
    prompts = ["a", "def add(a, b):\n    return", "x = x * 2"]  # 1 .. 25 tokens: up to 24 pads in front
    out = generate(model, tok, prompts, greedy=True, max_new_tokens=8)
    for c, prompt in zip(out, prompts):
        ids = encode_prompt(tok, prompt)
        assert c.prompt_ids == ids
        assert c.completion_ids == _greedy_alone(model, tok, ids, 8), prompt


# ------------------------------------------------------------------------------ weight decay

def _family_models():
    from models.policy import PolicyConfig, build_policy
    torch.manual_seed(0)
    yield "gpt", registry.get_spec("gpt").build(registry.make_model_config("gpt", "tiny", {"bias": True}))
    yield "dilated_lm", registry.get_spec("dilated_lm").build(registry.make_model_config("dilated_lm", "debug"))
    yield "hrm", registry.get_spec("hrm").build(registry.make_model_config("hrm", "debug"))
    yield "hrm_learned", registry.get_spec("hrm").build(
        registry.make_model_config("hrm", "debug", {"pos_encodings": "learned"}))
    yield "policy", build_policy(PolicyConfig(**registry.get_spec("policy").sizes["tiny"]))


def test_weight_decay_groups_of_every_family_follow_the_readme_rule():
    from dstrain.engine.factory import param_groups
    norms = (nn.LayerNorm,)
    for family, model in _family_models():
        decays, kinds = {}, set()
        for mname, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                kind = type(module).__name__
                kinds.add(kind)
                layer = isinstance(module, (nn.Linear, nn.Embedding))
                assert layer or isinstance(module, norms) or kind.endswith("RMSNorm"), (family, mname, kind)
                decays[id(p)] = (layer and pname == "weight", f"{mname}.{pname}")
        decayed, plain = param_groups(model, 0.1)
        assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
        got = {id(p): True for p in decayed["params"]} | {id(p): False for p in plain["params"]}
        assert len(got) == len(decays) == len(decayed["params"]) + len(plain["params"])
        wrong = [name for key, (want, name) in decays.items() if got[key] != want]
        assert wrong == [], (family, wrong)
        names = {name for want, name in decays.values() if not want}
        if family.startswith("hrm"):
            assert names == {"q_head.bias"}  # weightless norms: the Q-head's bias is HRM's only vector
        elif family == "gpt":
            assert any(n.endswith("bias") for n in names) and any("ln" in n for n in names)
        if family == "hrm_learned":
            assert any(name == "embed_pos.weight" for want, name in decays.values() if want)
