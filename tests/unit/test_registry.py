"""models.registry: lookup, size/override handling and its error messages."""

import pytest
import torch

from models import registry
from models.registry import ModelSpec, available, get_spec, make_model_config


def test_available_and_spec():
    assert "gpt" in available()
    spec = get_spec("gpt")
    assert isinstance(spec, ModelSpec)
    assert spec.name == "gpt"
    assert set(spec.sizes) >= {"tiny", "small", "medium", "large", "xl"}


def test_every_registered_model_builds_its_sizes_on_meta():
    for name in available():
        spec = get_spec(name)
        for size in spec.sizes:
            cfg = make_model_config(name, size)
            with torch.device("meta"):
                model = spec.parallelize(spec.build(cfg), activation_checkpointing=False)
            assert sum(p.numel() for p in model.parameters()) > 0


def test_unknown_model():
    with pytest.raises(KeyError, match=r"unknown model 'nope'; available: dilated_lm, gpt"):
        get_spec("nope")
    with pytest.raises(KeyError, match="nope"):
        make_model_config("nope", "tiny")


def test_size_and_overrides_applied():
    cfg = make_model_config("gpt", "tiny", {"n_layer": 2, "dropout": 0, "bias": True})
    assert (cfg.n_layer, cfg.n_embd, cfg.block_size) == (2, 128, 256)
    assert cfg.dropout == 0.0 and isinstance(cfg.dropout, float)  # int accepted for float
    assert cfg.bias is True
    # the shared size table is not mutated by overrides
    assert make_model_config("gpt", "tiny").n_layer == 4


def test_build_is_seeded():
    spec = get_spec("gpt")
    cfg = make_model_config("gpt", "tiny", {"n_layer": 1})
    torch.manual_seed(5)
    a = spec.build(cfg)
    torch.manual_seed(5)
    b = spec.build(cfg)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_unknown_size():
    with pytest.raises(ValueError, match=r"unknown size 'huge'.*tiny.*small.*xl"):
        make_model_config("gpt", "huge")


def test_unknown_override_key():
    with pytest.raises(ValueError, match=r"'n_layers'.*valid keys: .*n_layer"):
        make_model_config("gpt", "tiny", {"n_layers": 2})


@pytest.mark.parametrize(
    "key, value, expected, got",
    [
        ("n_layer", "2", "int", "str"),
        ("n_layer", True, "int", "bool"),
        ("n_head", 2.0, "int", "float"),
        ("dropout", "0.1", "float", "str"),
        ("dropout", False, "float", "bool"),
        ("bias", 1, "bool", "int"),
    ],
)
def test_wrong_type(key, value, expected, got):
    with pytest.raises(ValueError, match=rf"'{key}'.*expected {expected}, got {got}"):
        make_model_config("gpt", "tiny", {key: value})


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"n_head": 3}, "n_embd"),  # 128 % 3 != 0
        ({"n_embd": 0}, "n_embd"),
        ({"n_layer": -2}, "n_layer"),
        ({"dropout": 1.0}, "dropout"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_impossible_values(overrides, key):
    with pytest.raises(ValueError, match=key):
        make_model_config("gpt", "tiny", overrides)


def test_registry_maps_to_module_paths():
    # lazy: the registry stores import paths, not modules
    assert all(isinstance(v, str) for v in registry._REGISTRY.values())
