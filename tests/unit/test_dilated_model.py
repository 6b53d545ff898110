"""The dilated LM plug-in: sizes, config checks, causality, planner tracing, recipes, entropy baseline."""
import json
import math
from pathlib import Path

import pytest
import torch

from dstrain.config import load_run_config
from dstrain.data.stats import unigram_entropy
from dstrain.engine import hardware
from models import registry
from models.dilated_lm import SIZES, SPEC, DilatedLM, parallelize_dilated_lm

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "models" / "dilated_lm" / "recipes").glob("*.json"))


def _debug(**kw):
    return registry.make_model_config("dilated_lm", "debug", kw)


def test_sizes_on_meta_device():
    counts = {}
    for size in SIZES:
        with torch.device("meta"):
            counts[size] = DilatedLM(registry.make_model_config("dilated_lm", size)).num_params()
    assert counts["debug"] < 2e6 and counts["tiny"] < 3e6
    assert 80e6 < counts["small"] < 130e6 and 300e6 < counts["medium"] < 400e6
    assert 1.2e9 < counts["large"] < 1.4e9
    assert len(SIZES["medium"]["segment_lengths"]) == 4 and len(SIZES["large"]["segment_lengths"]) == 5


@pytest.mark.parametrize("change,match", [({"dilation_rates": [1, 2]}, "same length"),
                                          ({"n_head": 5}, "divisible"), ({"sparse_keep": 0.0}, "sparse_keep"),
                                          ({"segment_lengths": [32, 64, 130]}, "multiple"),
                                          ({"positions": "rotary"}, "positions")])
def test_bad_config_is_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        _debug(**change)


def test_loss_is_causal_and_learnable():
    torch.manual_seed(0)
    model = DilatedLM(_debug())
    x = torch.randint(0, 257, (2, 128))
    logits = model(x)
    assert logits.shape == (2, 128, 320)
    x2 = x.clone()
    x2[:, 100:] = (x2[:, 100:] + 1) % 257  # change the future only
    torch.testing.assert_close(model(x2)[:, :100], logits[:, :100])
    loss = model(x, x)
    assert abs(loss.item() - math.log(320)) < 0.5  # near uniform at init
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_sinusoidal_positions_have_no_parameters_and_the_textbook_values():
    from dstrain.parallel.pipeline_layers import SINUSOID_SCALE, TokenPositionEmbedding, sinusoidal_positions
    learned, fixed = DilatedLM(_debug()), DilatedLM(_debug(positions="sinusoidal"))
    assert fixed.pos_emb is None and learned.num_params() - fixed.num_params() == 256 * 128
    table = sinusoidal_positions(torch.arange(1_000_000 - 3, 1_000_000), 6, torch.float64, chunk=2)
    for row, p in enumerate(range(1_000_000 - 3, 1_000_000)):
        for i in range(3):  # column 2i: sin(p w_i), 2i + 1: cos(p w_i), w_i = 10000^(-2i/6)
            w = 10000 ** (-2 * i / 6)
            assert table[row, 2 * i].item() == pytest.approx(SINUSOID_SCALE * math.sin(p * w), abs=1e-12)
            assert table[row, 2 * i + 1].item() == pytest.approx(SINUSOID_SCALE * math.cos(p * w), abs=1e-12)
    # a causal LM that learns with them; the pipeline's embedding layer computes the same input
    torch.manual_seed(0)
    x = torch.randint(0, 257, (2, 128))
    loss = fixed(x, x)
    loss.backward()
    assert torch.isfinite(loss) and fixed.tok_emb.weight.grad.abs().sum() > 0
    layer = TokenPositionEmbedding(320, 128, 256, 0.0, "sinusoidal")
    layer.tok_emb.load_state_dict(fixed.tok_emb.state_dict())
    expected = fixed.tok_emb(x) + sinusoidal_positions(torch.arange(128), 128, torch.float32)
    torch.testing.assert_close(layer(x), expected)
    assert [n for n, _ in layer.named_parameters()] == ["tok_emb.weight"]


def test_activation_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    a = DilatedLM(_debug())
    b = DilatedLM(_debug())
    b.load_state_dict(a.state_dict())
    parallelize_dilated_lm(b, activation_checkpointing=True)
    x = torch.randint(0, 257, (2, 64))
    a(x, x).backward()
    b(x, x).backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad)


def test_planner_traces_it_under_fake_tensors():
    cfg = _debug()
    acts = hardware.trace_activations(lambda: SPEC.build(cfg), lambda: SPEC.inputs_for_trace(cfg, 1, 128),
                                      lambda m, f: SPEC.parallelize(m, activation_checkpointing=f))
    assert 0 < acts.per_sample_checkpointed < acts.per_sample


def test_planner_trace_is_the_same_on_every_kernel(monkeypatch):
    """The trace runs the CPU kernel under fake tensors; with the kernels swapped for the math
    stand-in (the CUDA path's algorithm on another kernel) it counts the same bytes: attention
    saves q, k, v, out and lse whichever kernel runs, so a GPU plan is not a CPU-kernel estimate."""
    import dstrain.ops.attention as attention
    cfg = _debug()

    def trace():
        return hardware.trace_activations(lambda: SPEC.build(cfg), lambda: SPEC.inputs_for_trace(cfg, 1, 128),
                                          lambda m, f: SPEC.parallelize(m, activation_checkpointing=f))

    fused = trace()
    monkeypatch.setattr(attention, "kernel_for", lambda q, fused=True, masked=False: "math")
    assert trace() == fused


@pytest.mark.parametrize("t", [100, 129, 200])
def test_sequence_the_segments_do_not_tile_trains_as_a_prefix_of_one_they_do(t):
    """A length the segments (32, 64, 128) do not tile runs padded at the end: every logit and every gradient
    of a loss on the first ``t`` positions equals the model's on a length-256 sequence with other tokens
    after them (causal: later tokens cannot change earlier logits); the FLOPs count the padded computation."""
    torch.manual_seed(0)
    model = DilatedLM(_debug()).double()
    x = torch.randint(0, 257, (2, 256))
    w = torch.randn(2, t, 320, dtype=torch.float64)
    grads = []
    for ids in (x[:, :t], x):
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        (logits[:, :t] * w).sum().backward()
        grads.append((logits[:, :t].detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-9, atol=1e-9)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    padded = 128 * -(-t // 128)
    c = model.config
    matmul = sum(p.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear) for p in mod.parameters())
    keys = padded / t * (32 / 1 + 64 / 4 + 128 / 16)
    assert model.flops_per_token(t) == int(6 * matmul + 12 * c.n_layer * c.n_embd * keys)


def test_flops_count_attention_per_branch():
    with torch.device("meta"):
        m = DilatedLM(_debug())
    c = m.config
    # Keys each token attends to, averaged over heads, counted from the reference's masks (non-causal, as
    # PaLM counts): a head sees a branch only at its own offset's positions.
    from tests.dilated_reference import branch_mask
    keys = sum(float(branch_mask(128, w, r, j % r, False).sum()) / 128 / c.n_head
               for w, r in zip(c.segment_lengths, c.dilation_rates) for j in range(c.n_head))
    assert keys == 32 / 1 + 64 / 4 + 128 / 16
    matmul = sum(p.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear) for p in mod.parameters())
    assert m.flops_per_token(128) == int(6 * matmul + 12 * c.n_layer * c.n_embd * keys)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipes_load(recipe):
    cfg = load_run_config(recipe)
    # a recipe is named after its size, optionally with a suffix (small_32k.json trains size small)
    assert cfg.model.name == "dilated_lm" and recipe.stem.split("_")[0] == cfg.model.size
    mcfg = registry.make_model_config("dilated_lm", cfg.model.size, cfg.model.args)
    assert cfg.data.seq_len <= mcfg.block_size


def test_debug_recipe_is_sequence_parallel():
    cfg = json.loads((ROOT / "models/dilated_lm/recipes/debug.json").read_text())
    assert cfg["parallel"]["sp"] == 2


def test_unigram_entropy():
    assert unigram_entropy(torch.tensor([0, 1, 2, 3] * 5)) == pytest.approx(math.log(4))
    assert unigram_entropy(torch.tensor([7, 7, 7])) == pytest.approx(0.0)
    p = torch.tensor([0.75, 0.25])
    assert unigram_entropy(torch.tensor([0, 0, 0, 1])) == pytest.approx(float(-(p * p.log()).sum()))
    with pytest.raises(ValueError):
        unigram_entropy(torch.tensor([], dtype=torch.long))
