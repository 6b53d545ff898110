"""models.hrm init: the truncated normal has the requested standard deviation (as the reference's)."""
import numpy as np
import torch

from models import registry
from models.hrm.layers import TRUNC_STD_RATIO, trunc_normal_


def test_trunc_std_ratio_matches_numerical_integration():
    x = np.linspace(-2.0, 2.0, 200_001)
    pdf = np.exp(-0.5 * x * x)
    var = np.trapezoid(x * x * pdf, x) / np.trapezoid(pdf, x)
    assert abs(TRUNC_STD_RATIO - np.sqrt(var)) < 1e-6
    assert abs(TRUNC_STD_RATIO - 0.8796) < 1e-4


def test_trunc_normal_has_the_requested_std_and_bounds():
    torch.manual_seed(0)
    for std in (1.0, 0.125):
        t = trunc_normal_(torch.empty(400_000), std)
        assert abs(t.std().item() / std - 1.0) < 0.01  # plain truncation would give 0.88
        bound = 2 * std / TRUNC_STD_RATIO
        assert t.abs().max().item() <= bound + 1e-6 and t.abs().max().item() > 0.99 * bound
        assert abs(t.mean().item()) < 0.01 * std


def test_model_init_scales():
    cfg = registry.make_model_config("hrm", "debug")
    torch.manual_seed(0)
    m = registry.get_spec("hrm").build(cfg)
    h = cfg.hidden_size
    # LeCun: std 1/sqrt(fan_in) for projections; embeddings and LM head 1/sqrt(hidden); states 1
    w = m.L_level.layers[0].mlp.down.weight
    assert abs(w.std().item() * w.shape[1] ** 0.5 - 1.0) < 0.05
    assert abs(m.embed_tokens.weight.std().item() * h ** 0.5 - 1.0) < 0.1
    assert abs(m.lm_head.weight.std().item() * h ** 0.5 - 1.0) < 0.1
    both = torch.cat([m.H_init, m.L_init])
    assert abs(both.std().item() - 1.0) < 0.15
