"""rollout.generator: hf (default) or vllm. The config's refusal where vLLM is missing, and the vLLM
adapter (weight copies, sampling arguments, completions cut like the hf generator's) against a fake
``vllm`` module, so that it is checked on machines without vLLM or a GPU."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from dstrain.config import ConfigError, load_run_config
from dstrain.rl import vllm_generation as vg
from dstrain.rl.rollout import LocalRollout, make_rollout
from models.policy import SPEC
from models.policy.config import PolicyConfig

RECIPE = Path(__file__).resolve().parents[2] / "models" / "policy" / "recipes" / "grpo_debug.json"


def test_hf_is_the_default_and_unknown_generators_are_refused():
    assert load_run_config(RECIPE).rollout.generator == "hf"
    with pytest.raises(ConfigError, match=r"rollout\.generator.*hf, vllm"):
        load_run_config(RECIPE, ["--rollout.generator=sglang"])


@pytest.mark.skipif(vg.vllm_missing() == "", reason="vllm is installed here: nothing to refuse")
def test_vllm_is_refused_in_one_line_where_it_is_not_installed():
    with pytest.raises(ConfigError) as err:
        load_run_config(RECIPE, ["--rollout.generator=vllm"])
    text = str(err.value)
    assert "\n" not in text and "rollout.generator" in text and "vllm package" in text and "generator=hf" in text


@pytest.mark.parametrize("override, key", [(["--rollout.backend=ray"], "rollout.generator"),
                                           (["--rollout.vllm_gpu_memory_utilization=1.5"],
                                            "rollout.vllm_gpu_memory_utilization")])
def test_vllm_combinations_that_cannot_work_are_refused(override, key, monkeypatch):
    monkeypatch.setattr(vg, "vllm_missing", lambda: "")  # as if installed: the other checks come first
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_run_config(RECIPE, ["--rollout.generator=vllm", *override])
    load_run_config(RECIPE, ["--rollout.generator=vllm"])  # installed and local: accepted


def test_hf_state_drops_the_wrapper_prefix():
    assert list(vg.hf_state({"hf.model.embed_tokens.weight": 1, "other": 2})) == ["model.embed_tokens.weight",
                                                                                 "other"]


# ---------------------------------------------------------------- the adapter, on a fake vllm

def _out(ids, finish="length", stop_reason=None):
    return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=ids, finish_reason=finish,
                                                                stop_reason=stop_reason, text="")])


def test_completions_are_cut_like_the_hf_generator_cuts():
    tok = SPEC.rl.load_tokenizer(PolicyConfig())
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    outs = [_out(enc("x + 1\nmore")), _out(enc("abc") + [eos] + enc("zz"), "stop"), _out(enc("abc"), "stop"),
            _out(enc("abcdef"))]
    rows = [enc("p")] * 4
    comps = vg.to_completions(outs, rows, 2, tok, ("\n",))
    assert [(c.index, c.sample) for c in comps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert comps[0].text == "x + 1" and comps[0].completion_ids == enc("x + 1\n") and comps[0].stop == "\n"
    assert comps[1].completion_ids == enc("abc") + [eos] and comps[1].finished and comps[1].text == "abc"
    assert comps[2].completion_ids == enc("abc") + [eos] and comps[2].finished  # EOS not listed by vLLM: added
    assert comps[3].completion_ids == enc("abcdef") and not comps[3].finished  # the length cut it
    assert comps[0].prompt_ids == enc("p")
    SPEC.rl.pack(comps, tok.pad_token_id)  # packs for training like any other completions


class FakeLLM:
    """Records what the adapter asks; answers every request with its prompt's last 3 ids, then EOS."""

    made: list = []

    def __init__(self, model, **kw):
        self.model_dir, self.kw, self.loaded, self.requests = model, kw, [], []
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self.loaded.append))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=runner)))
        FakeLLM.made.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=False):
        self.requests.append((prompts, sampling_params))
        return [_out(p["prompt_token_ids"][-3:] + [256], "stop") for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(vg, "vllm_missing", lambda: "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    FakeLLM.made = []
    return module


def _trainer(tmp_path):
    torch.manual_seed(0)
    mcfg = PolicyConfig()
    policy = SPEC.rl.build(mcfg)
    engine = types.SimpleNamespace(module=policy, global_steps=0)
    return types.SimpleNamespace(out=tmp_path, policy=policy, tokenizer=SPEC.rl.load_tokenizer(mcfg), rl=SPEC.rl,
                                 engine=engine, model_cfg=mcfg, world=types.SimpleNamespace(rank=0, world_size=1),
                                 cfg=types.SimpleNamespace(train=types.SimpleNamespace(seed=7)))


def test_vllm_generator_copies_weights_after_each_step_and_samples_per_request(fake_vllm, tmp_path):
    tr = _trainer(tmp_path)
    rollout = make_rollout(tr, types.SimpleNamespace(backend="local", generator="vllm",
                                                     vllm_gpu_memory_utilization=0.25))
    assert isinstance(rollout, LocalRollout) and isinstance(tr.rl, vg.VLLMToolkit)
    llm = FakeLLM.made[0]
    assert (tmp_path / "vllm_init" / "config.json").is_file() and llm.kw["skip_tokenizer_init"]
    assert llm.kw["gpu_memory_utilization"] == 0.25 and llm.kw["seed"] == 7
    assert tr.rl.pack is SPEC.rl.pack  # everything but generate is the family's own toolkit

    comps = tr.rl.generate(tr.policy, tr.tokenizer, ["abcd", "xy"], num_samples=2, temperature=0.7, top_p=0.9,
                           max_new_tokens=5, stop=("\n",), seed=3)
    prompts, params = llm.requests[-1]
    assert len(prompts) == 4 and prompts[0]["prompt_token_ids"] == tr.tokenizer("abcd")["input_ids"]
    assert [p.seed for p in params] == [3 * 1_000_003 + i for i in range(4)]
    assert params[0].temperature == 0.7 and params[0].top_p == 0.9 and params[0].max_tokens == 5
    assert params[0].stop is None  # the byte tokenizer stays with the trainer: cut afterwards
    assert comps[0].text == "bcd" and comps[2].text == "xy"[-3:] and comps[0].finished
    assert llm.loaded == [] and rollout.last_sync == {}  # nothing stepped yet: no copy

    with torch.no_grad():
        next(tr.policy.parameters()).add_(1.0)
    tr.engine.global_steps = 1
    tr.rl.generate(tr.policy, tr.tokenizer, [], greedy=True)  # a rank with no prompts still copies
    (pairs,) = llm.loaded
    names = dict(pairs)
    expect = {k[len("hf."):]: v for k, v in tr.policy.state_dict().items()}
    assert names.keys() == expect.keys() and all(torch.equal(names[k], expect[k]) for k in expect)
    assert rollout.last_sync["weight_sync_bytes"] > 0
    rollout.last_sync = {}
    assert rollout.last_sync == {}
    tr.rl.generate(tr.policy, tr.tokenizer, ["q"], greedy=True)
    assert len(llm.loaded) == 1 and llm.requests[-1][1][0].temperature == 0.0  # same step: no second copy


def test_hf_generator_leaves_the_toolkit_alone(tmp_path):
    tr = _trainer(tmp_path)
    make_rollout(tr, types.SimpleNamespace(backend="local", generator="hf"))
    assert tr.rl is SPEC.rl and not (tmp_path / "vllm_init").exists()
