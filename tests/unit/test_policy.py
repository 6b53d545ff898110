"""models.policy: tokenizer, model wrapper, log-probs, generation, packing, reference, registry."""
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from models import registry
from models.policy import (EOS_ID, PAD_ID, SPEC, PolicyConfig, build_policy, byte_tokenizer,
                           full_state_dict, load_tokenizer, save_pretrained, token_entropy,
                           token_logprobs)
from models.policy import model as policy_model
from models.policy.generation import Completion, StopOnStrings, cut_at_stop, generate, pack
from models.policy.reference import ReferencePolicy, reference_ds_config

ROOT = Path(__file__).resolve().parents[2]
TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本."
_TOK = byte_tokenizer()


def tiny(**kw) -> PolicyConfig:
    return PolicyConfig(**{**registry.get_spec("policy").sizes["tiny"], **kw})


def seeded(cfg: PolicyConfig, seed: int = 0):
    torch.manual_seed(seed)
    return build_policy(cfg)


@pytest.fixture(scope="module")
def tok():
    return _TOK


@pytest.fixture(scope="module")
def trained(tok):
    """A tiny policy that has memorised TEXT followed by EOS (greedy continues it exactly)."""
    model = seeded(tiny(), 0)
    ids = torch.tensor([tok.encode(TEXT) + [EOS_ID]])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(ids[:, :-1], ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05
    return model.eval()


# ------------------------------------------------------------------------ config
@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("num_layers", -1), ("num_heads", 3), ("num_kv_heads", 3), ("dropout", 1.0),
    ("rope_theta", 0.0), ("tie_embeddings", 1), ("path", "no/such/checkpoint"), ("intermediate_size", 2.0)])
def test_config_rejects_with_field_name(field, value):
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})


def test_registry_sizes_and_overrides():
    assert "policy" in registry.available() and SPEC.name == "policy"
    cfg = registry.make_model_config("policy", "small", {"num_layers": 2, "rope_theta": 500000})
    assert (cfg.hidden_size, cfg.num_layers, cfg.rope_theta) == (256, 2, 500000.0)
    with pytest.raises(ValueError, match="path"):
        registry.make_model_config("policy", "tiny", {"path": 3})


# ------------------------------------------------------------------------ tokenizer
@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_tokenizer_round_trips_any_text(text):
    tok = _TOK
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one id per byte, id = byte value
    assert tok.decode(ids) == text



def test_tokenizer_special_tokens_and_padding(tok):
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, len(tok)) == (256, 257, 258, 259)
    assert tok("a<eos>", add_special_tokens=False)["input_ids"] == list(b"a<eos>")  # text never special
    assert tok("ab")["input_ids"] == [97, 98]  # no BOS/EOS added
    assert tok.decode([104, 105, EOS_ID], skip_special_tokens=True) == "hi"
    batch = tok(["a", "abc"], padding=True)
    assert tok.padding_side == "left"
    assert batch["input_ids"][0] == [PAD_ID, PAD_ID, 97] and batch["attention_mask"][0] == [0, 0, 1]


def test_tokenizer_save_and_load_offline(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(str(tmp_path))
    loaded = load_tokenizer_from(tmp_path)
    text = "héllo <pad> wörld 🤖\n"
    assert loaded(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert loaded.decode(list(text.encode())) == text
    assert (loaded.eos_token_id, loaded.pad_token_id, loaded.padding_side) == (256, 257, "left")


def load_tokenizer_from(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


# ------------------------------------------------------------------------ model
def test_forward_loss_equals_manual_cross_entropy():
    model = seeded(tiny())
    ids = torch.randint(0, 256, (3, 12))
    targets = torch.randint(0, 256, (3, 12))
    targets[0, :5] = -100
    logits = model(ids)
    assert logits.shape == (3, 12, 259)
    keep = targets != -100
    manual = -torch.log_softmax(logits.double(), -1)[keep].gather(-1, targets[keep][:, None]).mean()
    assert torch.allclose(model(ids, targets).double(), manual, atol=1e-5)
    mask = torch.ones_like(ids)
    assert torch.allclose(model(ids, attention_mask=mask), logits, atol=1e-6)


def test_build_is_seeded_and_initialised_like_llama():
    a, b, c = seeded(tiny(), 1), seeded(tiny(), 1), seeded(tiny(), 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.hf.lm_head.weight, c.hf.lm_head.weight)
    emb = a.hf.model.embed_tokens.weight
    assert torch.count_nonzero(emb[PAD_ID]) == 0 and 0.015 < emb[:256].std() < 0.025
    assert torch.equal(a.hf.model.norm.weight, torch.ones(64))
    tied = seeded(tiny(tie_embeddings=True))
    assert tied.hf.lm_head.weight is tied.hf.model.embed_tokens.weight
    assert tied.num_params() == a.num_params() - 259 * 64


def test_meta_build_counts_and_flops():
    with torch.device("meta"):
        model = build_policy(tiny())
    assert model.num_params() == 131776 and (model.hidden_size, model.num_layers) == (64, 2)
    linear = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 192) + 64 * 259
    assert model.num_matmul_params() == linear
    assert model.flops_per_token(128) == 6 * linear + 12 * 2 * 64 * 128


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_and_load_by_path_gives_identical_logits(tmp_path, tok, tie):
    model = seeded(tiny(tie_embeddings=tie), 3)
    save_pretrained(model, str(tmp_path), tok)
    # architecture fields are ignored when path is set: the checkpoint's config rules
    loaded = build_policy(tiny(path=str(tmp_path), num_layers=7, hidden_size=32))
    assert loaded.weights_loaded and loaded.num_layers == 2
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(model.eval()(ids), loaded.eval()(ids))
    assert load_tokenizer(tiny(path=str(tmp_path))).decode(list(b"ok")) == "ok"
    with torch.device("meta"):  # the factory's planning build: architecture only, from config.json
        meta = build_policy(tiny(path=str(tmp_path)))
    assert meta.num_params() == model.num_params() and next(meta.parameters()).is_meta
    before = loaded.hf.lm_head.weight.clone()
    loaded.reset_parameters()  # the factory's zero.Init replay must not touch loaded weights
    assert torch.equal(before, loaded.hf.lm_head.weight)


def test_activation_checkpointing_same_loss_and_grads():
    model = seeded(tiny()).train()
    ids = torch.randint(0, 256, (2, 16))
    SPEC.parallelize(model, activation_checkpointing=False)
    model(ids, ids).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    SPEC.parallelize(model, activation_checkpointing=True)
    assert model.activation_checkpointing
    model(ids, ids).backward()
    assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(plain, model.parameters()))
    SPEC.parallelize(model, activation_checkpointing=False)
    assert not model.activation_checkpointing


# ------------------------------------------------------------------------ log-probs
def plain_logprobs(logits, ids, temperature):
    return torch.log_softmax(logits[:, :-1].double() / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk", [1 << 26, 700])  # 700 elements: blocks of 2 positions
def test_token_logprobs_and_grad_match_plain_torch(monkeypatch, temperature, chunk):
    monkeypatch.setattr(policy_model, "_CHUNK_ELEMENTS", chunk)
    logits = torch.randn(3, 7, 300, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 300, (3, 7))
    weights = torch.randn(3, 6, dtype=torch.float64)
    ours = token_logprobs(logits, ids, temperature)
    assert ours.shape == (3, 6) and ours.dtype == torch.float64
    ref = plain_logprobs(logits, ids, temperature)
    assert torch.allclose(ours, ref, atol=1e-12)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    assert torch.allclose(g_ours, g_ref, atol=1e-12)
    assert torch.count_nonzero(g_ours[:, -1]) == 0


def test_token_logprobs_of_bf16_logits_are_fp32_and_keep_dtype_of_grad():
    logits = (torch.randn(2, 5, 259) * 3).bfloat16().requires_grad_()
    ids = torch.randint(0, 259, (2, 5))
    out = token_logprobs(logits, ids)
    assert out.dtype == torch.float32
    assert torch.allclose(out, plain_logprobs(logits.float(), ids, 1.0).float(), atol=1e-5)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_token_logprobs_saves_no_fp32_copy_for_backward():
    logits = torch.randn(2, 64, 1000).bfloat16().requires_grad_()
    ids = torch.randint(0, 1000, (2, 64))
    saved = []

    def pack_hook(t):
        saved.append(t.untyped_storage().nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        token_logprobs(logits, ids, temperature=0.9).sum().backward()
    logits_bytes = logits.numel() * logits.element_size()
    assert sum(saved) < logits_bytes * 1.1  # the bf16 logits themselves, ids and one float per position
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        plain_logprobs(logits, ids, 0.9)
    assert sum(saved) > 2 * logits_bytes  # what the plain computation keeps


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_entropy_matches_plain_torch(monkeypatch, temperature):
    monkeypatch.setattr(policy_model, "_CHUNK_ELEMENTS", 500)
    logits = torch.randn(2, 6, 250) * 2
    p = torch.softmax(logits[:, :-1].double() / temperature, -1)
    expected = -(p * p.log()).sum(-1)
    assert torch.allclose(token_entropy(logits, temperature).double(), expected, atol=1e-5)
    flat = torch.zeros(1, 3, 250)
    assert torch.allclose(token_entropy(flat), torch.full((1, 2), torch.log(torch.tensor(250.0)).item()))


def test_logprob_inputs_are_checked():
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="shape"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


# ------------------------------------------------------------------------ generation
def test_greedy_is_deterministic_continues_and_stops_at_eos(trained, tok):
    a = generate(trained, tok, ["The quick", "The lazy"], greedy=True, max_new_tokens=80)
    b = generate(trained, tok, ["The quick", "The lazy"], greedy=True, max_new_tokens=80)
    assert [c.completion_ids for c in a] == [c.completion_ids for c in b]
    first = a[0]
    assert first.text == TEXT[len("The quick"):] and first.finished and first.stop is None
    assert first.completion_ids[-1] == EOS_ID and first.prompt_ids == list(b"The quick")
    assert tok.decode(first.completion_ids[:-1]) == first.text


def test_length_limit_is_not_finished(trained, tok):
    (c,) = generate(trained, tok, ["The quick"], greedy=True, max_new_tokens=5)
    assert c.completion_ids == list(b" brow") and not c.finished and c.text == " brow"


@pytest.mark.parametrize("stops, expected_text, stop", [
    ([" over"], " brown fox jumps", " over"),
    (["dog", "fox"], " brown ", "fox"),             # the stop string that appears first wins
    (["✓", "日本"], " brown fox jumps over the lazy dog. Ünïcödé ", "✓"),  # multi-byte stop string
])
def test_stop_strings_cut_text_and_keep_their_tokens(trained, tok, stops, expected_text, stop):
    (c,) = generate(trained, tok, ["The quick"], greedy=True, max_new_tokens=80, stop=stops)
    assert c.text == expected_text and c.finished and c.stop == stop
    assert c.completion_ids == list((expected_text + stop).encode())


def test_num_samples_seed_top_p_and_mode(trained, tok):
    trained.train()
    out = generate(trained, tok, ["The", "x"], num_samples=3, temperature=1.5, max_new_tokens=6, seed=5)
    assert trained.training and torch.is_grad_enabled()
    assert [(c.index, c.sample) for c in out] == [(i, s) for i in range(2) for s in range(3)]
    again = generate(trained, tok, ["The", "x"], num_samples=3, temperature=1.5, max_new_tokens=6, seed=5)
    assert [c.completion_ids for c in out] == [c.completion_ids for c in again]
    trained.eval()
    other = generate(trained, tok, ["The", "x"], num_samples=3, temperature=1.5, max_new_tokens=6, seed=6)
    assert not trained.training
    assert [c.completion_ids for c in out] != [c.completion_ids for c in other]
    # a nucleus this small keeps only the top token: sampling then equals greedy
    nucleus = generate(trained, tok, ["The quick"], top_p=1e-6, max_new_tokens=10, seed=1)
    greedy = generate(trained, tok, ["The quick"], greedy=True, max_new_tokens=10)
    assert nucleus[0].completion_ids == greedy[0].completion_ids
    assert all(PAD_ID not in c.completion_ids for c in out + other)


def test_checkpoint_generation_config_does_not_change_sampling(trained, tok, tmp_path):
    trained.hf.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    cfg_file = tmp_path / "generation_config.json"
    settings_ = json.loads(cfg_file.read_text())
    settings_.update(repetition_penalty=50.0, top_k=1, no_repeat_ngram_size=1, max_new_tokens=2)
    cfg_file.write_text(json.dumps(settings_))
    loaded = build_policy(tiny(path=str(tmp_path)))
    assert loaded.hf.generation_config.repetition_penalty == 50.0
    for kw in (dict(greedy=True), dict(temperature=1.3, seed=2)):
        a = generate(trained, tok, ["The quick"], max_new_tokens=30, **kw)[0]
        b = generate(loaded, tok, ["The quick"], max_new_tokens=30, **kw)[0]
        assert a.completion_ids == b.completion_ids and len(a.completion_ids) == 30
    assert loaded.hf.generation_config.repetition_penalty == 50.0  # restored


def test_generate_rejects_bad_arguments(trained, tok):
    with pytest.raises(ValueError, match="temperature"):
        generate(trained, tok, ["a"], temperature=0.0)
    with pytest.raises(ValueError, match="num_samples"):
        generate(trained, tok, ["a"], num_samples=0)
    assert generate(trained, tok, [], greedy=True) == []


def test_stop_criterion_and_cut_at_stop(tok):
    rows = torch.tensor([list(b"xx ab END"), list(b"xx abcdef"), list(b"ENDabcdef")])
    done = StopOnStrings(tok, ["END", "日"], prompt_len=3)(rows, None)
    assert done.tolist() == [True, False, False]  # a stop string inside the prompt does not count
    ids = list("a日b".encode()) + [EOS_ID]
    assert cut_at_stop(ids, tok, ["日"]) == (4, "a", "日")
    assert cut_at_stop(ids, tok, ["zz"]) is None


def test_pack_masks_and_right_padding():
    comps = [Completion(0, 0, [1, 2, 3], [4, 5], "", True),
             Completion(1, 0, [6], [7, 8, 9, 10], "", False)]
    b = pack(comps, pad_id=PAD_ID)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    comps[0].completion_ids = [4]
    b = pack(comps, pad_id=PAD_ID)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, PAD_ID], [6, 7, 8, 9, 10]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert b["completion_mask"].tolist() == [[0, 0, 0, 1, 0], [0, 1, 1, 1, 1]]
    assert b["prompt_lengths"].tolist() == [3, 1] and b["completion_lengths"].tolist() == [1, 4]


def test_packed_logprobs_equal_unpadded_logprobs(trained, tok):
    out = generate(trained, tok, ["The quick", "x"], greedy=True, max_new_tokens=6)
    b = pack(out, tok.pad_token_id)
    logp = token_logprobs(trained(b["input_ids"], attention_mask=b["attention_mask"]), b["input_ids"])
    for i, c in enumerate(out):
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        alone = token_logprobs(trained(ids), ids)[0]
        n = ids.shape[1] - 1
        assert torch.allclose(logp[i, :n], alone, atol=1e-5)
        assert b["completion_mask"][i, 1:].sum() == len(c.completion_ids)


# ------------------------------------------------------------------------ reference
def test_reference_on_cpu_matches_initial_policy_and_has_no_grad():
    cfg = tiny()
    torch.manual_seed(11)
    policy = build_policy(cfg)
    state = full_state_dict(policy)
    ids = torch.randint(0, 256, (2, 10))
    mask = torch.ones_like(ids)
    expected = token_logprobs(policy(ids, attention_mask=mask), ids, 0.8)
    rng = torch.get_rng_state()
    by_seed = ReferencePolicy.from_policy_config(cfg, "cpu", seed=11)
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left alone
    by_state = ReferencePolicy.from_policy_config(cfg, "cpu", state_dict=state)
    for ref in (by_seed, by_state):
        out = ref.token_logprobs(ids, mask, temperature=0.8)
        assert torch.allclose(out, expected, atol=1e-6) and not out.requires_grad
        assert not any(p.requires_grad for p in ref.module.parameters()) and not ref.module.training
    with torch.no_grad():
        policy.hf.lm_head.weight.add_(1.0)  # training the policy leaves the reference as it was
    assert torch.allclose(by_state.token_logprobs(ids, mask, 0.8), expected, atol=1e-6)
    with pytest.raises(ValueError, match="state_dict"):
        ReferencePolicy.from_policy_config(cfg, "cpu")
    with pytest.raises(ValueError, match="placement"):
        ReferencePolicy.from_policy_config(cfg, "gpu", seed=1)


def test_reference_ds_config_builder():
    z3 = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW"}}
    out = reference_ds_config(z3)
    assert out["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}}
    assert out["bf16"] == {"enabled": True} and "optimizer" not in out and "scheduler" not in out
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 1
    z2 = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": False}}
    out = reference_ds_config(z2, pin_memory=True)
    assert out["zero_optimization"] == {"stage": 0} and "fp16" not in out and "bf16" not in out
    assert reference_ds_config(None)["train_micro_batch_size_per_gpu"] == 1
    json.dumps(out)


# ------------------------------------------------------------------------ framework
def test_plan_engine_on_the_sft_recipe():
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import Hardware

    cfg = load_run_config(ROOT / "models" / "policy" / "recipes" / "sft_debug.json")
    hw = Hardware(device_type="cpu", device_memory=8 * 10**9, host_memory=16 * 10**9, ranks_per_node=1,
                  bf16_supported_fast=False, fp16_supported=False, name="cpu")
    plan = plan_engine(cfg, world_size=1, hw=hw)
    assert plan.profile == "zero0" and plan.precision == "fp32"
    assert "P=131,776 params" in plan.explanation
    assert plan.plan.estimates[0].activations > 0
