"""ValueHead on a tiny Llama (built from a config, nothing downloaded)."""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from models.policy.heads import ValueHead, last_token_index  # noqa: E402


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (3, 7))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]])
    return ids.masked_fill(mask == 0, 0), mask


def test_last_token_index():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [2, 3, 3, 0]


def test_shapes_and_dtype():
    vh = ValueHead(_llama())
    ids, mask = _batch()
    assert vh(ids, mask).shape == (3,)
    assert vh(ids, mask, per_token=True).shape == (3, 7)
    assert vh(ids).shape == (3,) and vh(ids).dtype == torch.float32


def test_reads_the_last_real_token_under_right_padding():
    vh = ValueHead(_llama())
    ids, mask = _batch()
    with torch.no_grad():
        values = vh(ids, mask)
        per_token = vh(ids, mask, per_token=True)
        lengths = mask.sum(1).tolist()
        for b, n in enumerate(lengths):
            alone = vh(ids[b:b + 1, :n]).item()  # the same sequence without any padding
            assert values[b].item() == pytest.approx(alone, abs=1e-5)
            assert values[b].item() == pytest.approx(per_token[b, n - 1].item(), abs=1e-6)
        # rows differ, so reading a fixed position (the padding) would have been caught
        assert len({round(v, 4) for v in values.tolist()}) == 3
        assert values[1].item() != pytest.approx(per_token[1, -1].item(), abs=1e-4)


def test_base_model_path_equals_full_forward_hidden_states():
    lm = _llama()
    vh = ValueHead(lm)
    ids, mask = _batch()
    with torch.no_grad():
        full = lm(ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        assert torch.allclose(vh.hidden_states(ids, mask), full, atol=1e-6)
        expected = vh.head(full[torch.arange(3), mask.sum(1) - 1]).squeeze(-1)
        assert torch.allclose(vh(ids, mask), expected, atol=1e-6)


def test_gradients_reach_head_and_backbone():
    vh = ValueHead(_llama())
    vh.train()
    ids, mask = _batch()
    loss = ((vh(ids, mask) - torch.tensor([1.0, 0.0, 11.0])) ** 2).mean()
    loss.backward()
    assert vh.head.weight.grad.abs().sum() > 0 and vh.head.bias.grad.abs().sum() > 0
    emb = vh.backbone.get_input_embeddings().weight.grad
    assert emb is not None and emb.abs().sum() > 0
    layer_grads = [p.grad for n, p in vh.backbone.named_parameters() if "layers.0." in n]
    assert layer_grads and all(g is not None for g in layer_grads)
    assert sum(g.abs().sum() for g in layer_grads) > 0
    # the LM head's logits are not computed, so its weight is not in the graph (unless tied to the embedding)
    if not vh.backbone.config.tie_word_embeddings:
        assert vh.backbone.lm_head.weight.grad is None


def test_zero_init_starts_at_zero():
    vh = ValueHead(_llama(), init="zero")
    ids, mask = _batch()
    out = vh(ids, mask)
    assert torch.equal(out, torch.zeros(3))
    out.sum().backward()
    assert vh.head.weight.grad.abs().sum() > 0  # the head learns; the backbone waits for it


def test_plain_module_with_hidden_states():
    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
            assert output_hidden_states
            h = self.emb(input_ids)
            return SimpleNamespace(hidden_states=(h * 0, h))

    toy = Toy()
    with pytest.raises(ValueError, match="hidden_size"):
        ValueHead(toy)
    vh = ValueHead(toy, hidden_size=4)
    ids = torch.tensor([[1, 2, 3], [4, 5, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = vh(ids, mask)
    expected = vh.head(toy.emb(torch.tensor([3, 5]))).squeeze(-1)
    assert torch.allclose(out, expected)
