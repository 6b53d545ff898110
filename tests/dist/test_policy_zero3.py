"""models.policy under ZeRO-3 on 2 CPU ranks (gloo): sharded loading, generation, reference engine.

Expected values come from the same checkpoint run unsharded in this (the test) process.
"""
import pytest
import torch

from models.policy import (EOS_ID, PolicyConfig, build_policy, byte_tokenizer, full_state_dict,
                           save_pretrained)
from models.policy.generation import generate
from models.policy.model import token_logprobs
from tests.dist import spawn

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本."
PROMPTS = {0: ["The quick", "The lazy"], 1: ["Ünï"]}
ZERO3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
         "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}


def _tiny(**kw) -> PolicyConfig:
    return PolicyConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=192, **kw)


def _count_collectives():
    """Patch DeepSpeed's communication backend: name -> number of gather calls."""
    from deepspeed.comm import comm as dcomm

    counts = {"gather": 0}
    for name in ("all_gather", "all_gather_into_tensor", "all_gather_base", "all_gather_coalesced"):
        original = getattr(dcomm.cdb, name, None)
        if original is None:
            continue

        def counted(*a, _original=original, **k):
            counts["gather"] += 1
            return _original(*a, **k)
        setattr(dcomm.cdb, name, counted)
    return counts


def _count_gathered_contexts():
    """Patch GatheredParameters.__enter__: {"n": number of contexts entered}."""
    import deepspeed
    entered = {"n": 0}
    original = deepspeed.zero.GatheredParameters.__enter__

    def enter(self):
        entered["n"] += 1
        return original(self)
    deepspeed.zero.GatheredParameters.__enter__ = enter
    return entered


def _texts(model, tok, prompts, n):
    return [c.text for c in generate(model, tok, prompts, greedy=True, max_new_tokens=n)]


def _loaded_worker(rank, world, path, ids, logits, texts, ref_logp):
    import deepspeed
    from models.policy import is_partitioned
    from models.policy.reference import ReferencePolicy

    deepspeed.init_distributed(dist_backend="gloo")
    tok = byte_tokenizer()
    model = build_policy(PolicyConfig(path=path), ZERO3)
    # sharded at load: each rank holds about half of every tensor, no full copy
    params = list(model.parameters())
    local = sum(p.ds_tensor.numel() for p in params)
    total = sum(p.ds_numel for p in params)
    assert is_partitioned(model) and all(p.numel() == 0 for p in params)
    assert total / 2 <= local <= total / 2 + len(params), (local, total)
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight  # tied, still one tensor
    with deepspeed.zero.GatheredParameters(params):
        assert torch.allclose(model(ids), logits, atol=1e-5)

    counts, entered = _count_collectives(), _count_gathered_contexts()
    mine = PROMPTS[rank]
    per_call = []
    for n in (3, 70):
        counts["gather"] = entered["n"] = 0
        got = _texts(model, tok, mine, n)
        per_call.append((counts["gather"], entered["n"]))
    assert got == texts[rank], (got, texts[rank])
    (short, e1), (long, e2) = per_call
    assert e1 == e2 == 1 and short == long > 0, per_call  # one gather per call, not per token
    # the gather is collective: a rank without prompts still takes part
    assert len(generate(model, tok, [] if rank else ["The"], greedy=True, max_new_tokens=5)) == 1 - rank

    # exported from the shards, loaded unsharded: the same model
    save_pretrained(model, path + "_export", tok)
    if rank == 0:
        again = build_policy(PolicyConfig(path=path + "_export"))
        assert not is_partitioned(again) and torch.allclose(again(ids), logits, atol=1e-5)

    # Inside a training engine: its fetch/release hooks are taken off during generation
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ZERO3)
    engine.train()
    before = engine(ids[:1], ids[:1]).item()
    per_call = []
    for target in (engine.module, engine):
        for n in (3, 70):
            counts["gather"] = 0
            got = _texts(target, tok, mine, n)
            per_call.append(counts["gather"])
        assert got == texts[rank] and engine.module.training
    assert per_call[0] == per_call[1] and per_call[2] == per_call[3], per_call
    loss = engine(ids[:1], ids[:1])  # hooks are back: training still works
    engine.backward(loss)
    engine.step()
    assert abs(loss.item() - before) < 1e-5

    # the frozen reference: ZeRO-3 inference engine with parameters offloaded to the CPU
    ref = ReferencePolicy.from_policy_config(PolicyConfig(path=path), "engine", ZERO3)
    assert is_partitioned(ref.module) and ref.engine is not None
    assert torch.allclose(ref.token_logprobs(ids, torch.ones_like(ids)), ref_logp, atol=1e-5)
    # a CPU reference is never partitioned, although a stage-3 config is registered with transformers
    cpu_ref = ReferencePolicy.from_policy_config(PolicyConfig(path=path), "cpu")
    assert not is_partitioned(cpu_ref.module)
    assert torch.allclose(cpu_ref.token_logprobs(ids), ref_logp, atol=1e-5)
    return local, total, per_call


def _loaded_model(folder):
    """A tiny policy partly trained here, saved to ``folder``: ``(ids, logits, texts, reference log-probs)`` of it
    unsharded, in this (the test) process."""
    torch.manual_seed(0)
    model = build_policy(_tiny(tie_embeddings=True))
    tok = byte_tokenizer()
    seq = torch.tensor([tok.encode(TEXT) + [EOS_ID]])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):  # partly memorised: greedy text is varied, and not the whole TEXT
        loss = model(seq[:, :-1], seq[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.hf.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        logits = model(ids)
    texts = {r: _texts(model, tok, p, 70) for r, p in PROMPTS.items()}
    return ids, logits, texts, token_logprobs(logits, ids)


def _built_worker(rank, world, expected, ids, logits):
    import deepspeed
    from dstrain.engine.factory import _init_sharded
    from models.policy import is_partitioned
    from models.policy.reference import ReferencePolicy

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = _tiny()
    # 1. built from config with a stage-3 config: sharded, and the same weights as unsharded
    torch.manual_seed(7)
    model = build_policy(cfg, ZERO3)
    assert is_partitioned(model)
    state = full_state_dict(model)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    # 2. dstrain's factory path: an outer zero.Init and the init_module replay
    torch.manual_seed(7)
    with deepspeed.zero.Init(config_dict_or_path=ZERO3):
        outer = build_policy(cfg)
    _init_sharded(outer)
    state = full_state_dict(outer)
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    # zero.Init with bf16 casts tensors made in constructors; the rotary frequencies are rebuilt
    with deepspeed.zero.Init(config_dict_or_path={**ZERO3, "bf16": {"enabled": True}}):
        half = build_policy(cfg)
    assert next(half.parameters()).ds_tensor.dtype == torch.bfloat16
    torch.manual_seed(7)
    _init_sharded(half)  # drawn in fp32 on the CPU, then rounded: the unsharded numbers in bf16
    state = full_state_dict(half)
    assert all(torch.equal(state[k], expected[k].bfloat16()) for k in expected)
    rope = half.hf.model.rotary_emb.inv_freq
    fresh = 1.0 / (cfg.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert rope.dtype == torch.float32 and torch.allclose(rope, fresh)
    # 3. the reference engine at stage 3 from the same seed matches the policy
    ref = ReferencePolicy.from_policy_config(cfg, "engine", ZERO3, seed=7)
    assert torch.allclose(ref.token_logprobs(ids), token_logprobs(logits, ids), atol=1e-5)
    # 4. a stage-0 reference engine from the gathered initial state
    ref0 = ReferencePolicy.from_policy_config(cfg, "engine", {"zero_optimization": {"stage": 0}},
                                              state_dict=full_state_dict(model))
    assert not is_partitioned(ref0.module)
    assert torch.allclose(ref0.token_logprobs(ids), token_logprobs(logits, ids), atol=1e-5)
    return True


def _built_model():
    """The unsharded tiny policy from seed 7: ``(state, ids, logits)``."""
    torch.manual_seed(7)
    model = build_policy(_tiny())
    ids = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        logits = model(ids)
    return full_state_dict(model), ids, logits


def _both_workers(rank, world, built, loaded):
    """``_built_worker`` then ``_loaded_worker`` in the same 2 processes (one start for both; the built one first,
    before the loaded one patches DeepSpeed's gathers to count them): what each returned, or an AssertionError
    holding every rank's traceback (so that each test below fails on its own worker's error only)."""
    import traceback

    import torch.distributed as dist
    results = {}
    for name, worker, args in (("built", _built_worker, built), ("loaded", _loaded_worker, loaded)):
        try:
            results[name], error = worker(rank, world, *args), None
        except Exception:  # noqa: BLE001 - raised again by the test that reads this worker
            error = f"rank {rank}:\n{traceback.format_exc()}"
        errors = [None] * world
        dist.all_gather_object(errors, error)
        if any(errors):  # (and the next worker is not started: a rank may have left a collective unfinished)
            results[name] = AssertionError("\n".join(e for e in errors if e))
            break
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """``worker name -> what rank 0's worker returned (or the error it raised)``: both workers in one spawn."""
    folder = tmp_path_factory.mktemp("policy")
    loaded = _loaded_model(folder)
    results = spawn.run(_both_workers, 2, _built_model(), (str(folder), *loaded), timeout=400)
    results["loaded_inputs"] = loaded
    return results


def _result(two_ranks, name):
    if name not in two_ranks:
        raise AssertionError(f"{name}: not run, the worker before it failed")
    if isinstance(two_ranks[name], BaseException):
        raise two_ranks[name]
    return two_ranks[name]


def test_load_sharded_generate_once_and_reference_engine(two_ranks):
    _, _, texts, _ = two_ranks["loaded_inputs"]
    assert len(set(texts[0][0])) > 5
    local, total, _ = _result(two_ranks, "loaded")
    assert local < total


def test_built_from_config_sharded_matches_unsharded_and_factory_replay(two_ranks):
    assert _result(two_ranks, "built")
