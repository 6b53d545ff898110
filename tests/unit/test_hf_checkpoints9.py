"""Real-world Hugging Face checkpoints, round 9: planning before the download, windowed attention's FLOPs, and what a
user meets trying checkpoints.

* ``dstrain plan`` for a large policy needed the weights on disk: a folder holding only ``config.json`` (and the
  tokenizer), what a user sizing hardware before a 140 GB download has, was refused ("it holds no weights"), though
  the planner builds the architecture on the meta device and never reads a weight. Now ``dstrain plan`` (only plan:
  ``models.registry.planning_without_weights``) plans from ``config.json`` and says in one line that the weights
  were not read; train and launch still refuse the folder. The parameter count of the meta build is checked below
  against each config's own arithmetic for Llama-3-70B, Qwen2.5-72B and Mixtral-8x7B shapes.
* FLOPs per token (MFU's numerator) counted every attention layer as full: Mistral's ``sliding_window`` (4096 at
  32k tokens: 8x the pairs), the local layers of Gemma-2/3 and GPT-OSS, Qwen2's ``use_sliding_window`` layers and
  Llama-4's chunked layers were counted at the whole length. Now each layer's pairs come from its mask
  (``models.policy.flops.layer_masks`` / ``mask_pairs``), checked against the (query, key) pairs the attention
  probabilities transformers computes are non-zero on, per layer, and against a brute-force enumeration. dstrain's
  convention (PaLM's, ``tests/unit/test_flops_counted.py``) of not taking the causal half off is kept: a pair the
  mask joins counts in both directions, so full layers count as before.
* Tried as a user would, found working and left as they are: tied-embedding checkpoints (Llama, Qwen2, Mistral,
  Phi-3, GPT-NeoX tied; GPT-2, Gemma, OPT) exported and reloaded give the same logits with the head still tied; a
  ``torch_dtype: float16`` checkpoint loads as fp32 on the CPU, samples, and exports fp16; left padding in batched
  generation leaves the scores of every absolute-position model tried (GPT-2, OPT, GPT-BigCode, GPT-Neo, CodeGen,
  BioGPT, XGLM) equal to the prompt alone.
* Found broken: ``generation_config.json`` ``eos_token_id: [null, 2]`` crashed the tokenizer load with a
  ``TypeError`` traceback, and an unreadable ``generation_config.json`` with a JSON traceback: both are now refused
  when the run config loads, in one line. A tokenizer with no EOS (and no pad) whose checkpoint lists end ids, the
  first past the tokenizer, was refused as naming none: the first end id the tokenizer has is its EOS now. A
  tokenizer with no EOS anywhere gave a traceback in GRPO/SCoRe: now one line naming ``model.args.path``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dstrain.config import ConfigError
from models.registry import planning_without_weights
from tests.hf_checkpoints import _ARCHS, available, build_checkpoint

SFT = "models/policy/recipes/sft_debug.json"
GRPO = "models/policy/recipes/grpo_debug.json"


def _config_only(tmp_path, kind="llama", **kw) -> str:
    """A checkpoint folder as a user has it before downloading the weights: config.json and tokenizer files."""
    path = build_checkpoint(kind, str(tmp_path / kind), **kw)
    os.remove(os.path.join(path, "model.safetensors"))
    return path


# ----------------------------------------------------------------------------------------------- plan before download
def test_plan_plans_a_folder_without_weights_and_says_so(tmp_path, capsys):
    from dstrain.cli import main

    path = _config_only(tmp_path)
    assert main(["plan", SFT, f"--model.args.path={path}", "--device", "cuda", "--device-memory", "80GB"]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "weights were not read" in line]
    assert len(notes) == 1 and path in notes[0] and "config.json" in notes[0], err
    c = json.load(open(os.path.join(path, "config.json")))
    d, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
    params = 2 * v * d + layers * (2 * d * d + 2 * d * kv + 3 * d * i + 2 * d) + d  # untied head
    assert f"model: P={params:,} params" in out, out


@pytest.mark.parametrize("command", ["train", "launch"])
def test_train_and_launch_still_refuse_a_folder_without_weights(command, tmp_path, capsys):
    from dstrain.cli import main

    path = _config_only(tmp_path)
    argv = [command] + (["--nproc", "1"] if command == "launch" else []) + [GRPO, f"--model.args.path={path}",
                                                                           f"--output.dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds no weights" in err and "weights were not read" not in err
    assert not (tmp_path / "run").exists()


def test_only_the_missing_weights_are_let_through_when_planning(tmp_path):
    from models.policy import PolicyConfig

    path = _config_only(tmp_path)
    with pytest.raises(ValueError, match="holds no weights"):
        PolicyConfig(path=path)
    with planning_without_weights() as notes:
        PolicyConfig(path=path)
        PolicyConfig(path=path)  # validated again by the planner: one note
    assert len(notes) == 1 and "the weights were not read" in notes[0]
    conf = json.load(open(os.path.join(path, "config.json")))
    conf["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    conf["model_type"] = "not_in_transformers"
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    with planning_without_weights(), pytest.raises(ValueError, match="trust_remote_code"):
        PolicyConfig(path=path)  # a checkpoint that could never load is still refused


LLAMA3_70B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=False,
                  torch_dtype="bfloat16")
QWEN25_72B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=8192, intermediate_size=29568,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                  max_position_embeddings=32768, use_sliding_window=False, sliding_window=131072,
                  max_window_layers=70, tie_word_embeddings=False, torch_dtype="bfloat16")
MIXTRAL_8X7B = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=4096,
                    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                    tie_word_embeddings=False, torch_dtype="bfloat16")


def _by_hand(c: dict) -> int:
    """Parameters of a Llama-family config.json, weight matrix by weight matrix: embedding and untied head, per
    layer q/k/v/o (Qwen2: biases on q, k, v), the SwiGLU MLP (Mixtral: per expert, plus the router), two norms;
    the final norm."""
    d, heads, kv, v = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    hd = d // heads
    attention = d * heads * hd + 2 * d * kv * hd + heads * hd * d
    if c["model_type"] == "qwen2":
        attention += heads * hd + 2 * kv * hd
    mlp = 3 * d * c["intermediate_size"]
    if "num_local_experts" in c:
        mlp = c["num_local_experts"] * mlp + d * c["num_local_experts"]
    return 2 * v * d + c["num_hidden_layers"] * (attention + mlp + 2 * d) + d


@pytest.mark.parametrize("conf, published", [(LLAMA3_70B, 70.6e9), (QWEN25_72B, 72.7e9), (MIXTRAL_8X7B, 46.7e9)],
                         ids=["llama3-70b", "qwen2.5-72b", "mixtral-8x7b"])
def test_a_large_config_alone_plans_with_its_own_parameter_count(conf, published, tmp_path):
    from dstrain.engine import hardware
    from models.policy import PolicyConfig, build_policy

    if conf["architectures"][0] not in {_ARCHS[k][0] for k in available()}:
        pytest.skip(f"transformers lacks {conf['architectures'][0]}")
    folder = tmp_path / conf["model_type"]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(conf))
    with planning_without_weights():
        cfg = PolicyConfig(path=str(folder))
    stats = hardware.model_stats(lambda: build_policy(cfg))  # what dstrain plan counts (a meta build)
    assert stats.params == _by_hand(conf)
    assert abs(stats.params - published) < 0.001 * published  # the figure the model cards give


# ------------------------------------------------------------------------------------------ windowed attention FLOPs
def _brute_pairs(kind: str, size, t: int) -> int:
    """Pairs (i, j) of 0..t-1 joined by the causal mask of ``kind`` in either direction, enumerated."""
    def joined(q, k):
        if k > q:
            return False
        if kind == "sliding":
            return k > q - size
        if kind == "chunked":
            return k // size == q // size
        return True
    return sum(1 for i in range(t) for j in range(t) if joined(i, j) or joined(j, i))


@pytest.mark.parametrize("kind", ["full", "sliding", "chunked"])
def test_mask_pairs_are_the_enumerated_pairs(kind):
    from models.policy.flops import mask_pairs

    for t in range(1, 24):
        for size in ([None] if kind == "full" else range(1, t + 3)):
            assert mask_pairs(kind, size, t) == _brute_pairs(kind, size, t), (kind, size, t)


# kind -> config overrides that give it windowed layers (a window of 3, chunks of 4) next to full ones
WINDOWED = {
    "mistral": dict(sliding_window=3),
    "phi3": dict(sliding_window=3),
    "qwen2": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "gemma2": dict(sliding_window=3),
    "gemma3": dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(sliding_window=3),
    "llama4": dict(attention_chunk_size=4, layer_types=["chunked_attention", "full_attention"]),
    "recurrent_gemma": dict(attention_window_size=3),
    "llama": {},
}


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_attention_flops_count_the_pairs_transformers_attends(kind):
    """Each attention layer's pairs against those its attention probabilities are non-zero on (eager attention:
    transformers' own mask), and the attention FLOPs per token against them."""
    import transformers

    from models.policy.flops import attention_flops_per_token

    if kind not in available():
        pytest.skip(f"{kind} not in this transformers")
    model_cls, config_cls, arch = _ARCHS[kind]
    cfg = getattr(transformers, config_cls)(**{**arch, **WINDOWED[kind]}, vocab_size=64, pad_token_id=0, bos_token_id=1,
                                              eos_token_id=2)
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)._from_config(cfg, attn_implementation="eager").eval()
    t = 11
    with torch.no_grad():
        probs = [a for a in hf(torch.randint(3, 60, (1, t)), output_attentions=True).attentions if a is not None]
    pairs = []
    for p in probs:
        seen = (p[0] > 0).any(0)
        pairs.append(int((seen | seen.T).sum()))
    if WINDOWED[kind]:
        assert min(pairs) < t * t  # some layer is windowed
    c = hf.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    want = 6 * c.num_attention_heads * 2 * head_dim * sum(pairs) / t
    assert attention_flops_per_token(hf, t) == round(want)


def test_mistral_at_four_windows_counts_the_band():
    """Mistral-7B's shape at 16,384 tokens with its 4,096 window: attention per token is the band's, a quarter
    of the length and less, not the whole length (the figure before)."""
    import transformers

    from models.policy.flops import attention_flops_per_token

    if "mistral" not in available():
        pytest.skip("transformers lacks Mistral")
    cfg = transformers.MistralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, sliding_window=4096)
    with torch.device("meta"):
        hf = transformers.MistralForCausalLM(cfg)
    t, w = 16384, 4096
    band = (2 * w - 1) * t - w * (w - 1)  # |i - j| < w
    assert attention_flops_per_token(hf, t) == round(6 * 32 * 32 * 256 * band / t)
    assert attention_flops_per_token(hf, w) == 6 * 32 * 32 * 256 * w  # within the window: PaLM's count


# ------------------------------------------------------------------------------------------------------- end tokens
def _no_eos_no_pad(tmp_path, name, generation_eos):
    path = build_checkpoint("llama", str(tmp_path / name), pad=None, chat=True)
    tok = json.load(open(os.path.join(path, "tokenizer_config.json")))
    tok["eos_token"] = tok["pad_token"] = None
    json.dump(tok, open(os.path.join(path, "tokenizer_config.json"), "w"))
    for file, eos in (("generation_config.json", generation_eos), ("config.json", None)):
        conf = json.load(open(os.path.join(path, file)))
        conf["eos_token_id"], conf["pad_token_id"] = eos, None
        json.dump(conf, open(os.path.join(path, file), "w"))
    return path


def test_a_null_in_the_eos_list_is_refused_when_the_config_loads(tmp_path):
    from dstrain.config import load_run_config

    path = _no_eos_no_pad(tmp_path, "nulls", [None, 4])
    with pytest.raises(ConfigError, match=r"generation_config.json eos_token_id is \[null, 4\]"):
        load_run_config(GRPO, [f"--model.args.path={path}"])
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        f.write('{"eos_token_id": 4,')  # cut short
    with pytest.raises(ConfigError, match="generation_config.json is not readable JSON"):
        load_run_config(GRPO, [f"--model.args.path={path}"])


def test_a_tokenizer_without_eos_takes_the_first_end_id_it_has(tmp_path):
    from models.policy import PolicyConfig, load_tokenizer

    path = _no_eos_no_pad(tmp_path, "past", [100000, 4])
    tok = load_tokenizer(PolicyConfig(path=path))
    assert tok.eos_token_id == 4 and tok.pad_token_id == 4 and tok.dstrain_eos_ids == [4]


def test_no_end_token_anywhere_is_one_line_naming_the_checkpoint(tmp_path):
    from dstrain.trainers.policy_rl import task_tokenizer
    from models.policy import RL, PolicyConfig

    path = _no_eos_no_pad(tmp_path, "none", None)
    task = type("Task", (), {"chat_template": "off"})()
    with pytest.raises(ConfigError, match="model.args.path: .*has no EOS token"):
        task_tokenizer(RL, PolicyConfig(path=path), task)
