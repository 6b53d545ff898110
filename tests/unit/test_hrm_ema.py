"""EMA of the weights (``task.ema``): the update against a hand computation, swap and restore,
checkpoint state, the config check, and the report loading the average."""
import pytest
import torch

from dstrain.config import ConfigError, load_run_config
from dstrain.optim.ema import EMA
from tests.unit.test_hrm_trainer import DEBUG


def _linear(value: float) -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 1)
    with torch.no_grad():
        layer.weight.fill_(value)
        layer.bias.fill_(-value)
    return layer


def test_update_follows_the_warmed_up_decay_by_hand():
    layer = _linear(1.0)
    ema = EMA(layer, decay=0.5)
    # rates min(0.5, (1 + n) / (10 + n)): 0.1, 2/11, 0.25, 4/13, ... up to 0.5 at n = 8
    expected, shadow = [], 1.0
    for n, w in enumerate([3.0, -2.0, 5.0, 0.0, 4.0, 8.0, 1.0, 2.0]):
        assert ema.rate() == pytest.approx(min(0.5, (1 + n) / (10 + n)))
        with torch.no_grad():
            layer.weight.fill_(w)
            layer.bias.fill_(-w)
        ema.update(layer)
        d = min(0.5, (1 + n) / (10 + n))
        shadow = d * shadow + (1 - d) * w
        expected.append(shadow)
        assert ema.shadow["weight"] == pytest.approx(torch.full((1, 2), shadow))
        assert ema.shadow["bias"] == pytest.approx(torch.full((1,), -shadow))
    # by hand, the first three: 0.1*1 + 0.9*3 = 2.8; (2/11)*2.8 - (9/11)*2 = -1.127...; 0.25*that + 0.75*5
    assert expected[0] == pytest.approx(2.8)
    assert expected[1] == pytest.approx(2 / 11 * 2.8 - 9 / 11 * 2.0)
    assert expected[2] == pytest.approx(0.25 * expected[1] + 3.75)
    assert ema.updates == 8 and ema.rate() == 0.5  # (1 + 8) / 18 = 0.5: the cap is reached


def test_applied_swaps_the_average_in_and_restores_the_weights_even_on_error():
    layer = _linear(2.0)
    ema = EMA(layer, decay=0.9)
    with torch.no_grad():
        layer.weight.fill_(7.0)
    with ema.applied(layer):
        assert torch.all(layer.weight == 2.0)
        out = layer(torch.ones(1, 2))
        assert out.item() == pytest.approx(2.0 * 2 - 2.0)
    assert torch.all(layer.weight == 7.0)
    with pytest.raises(RuntimeError, match="inside"):
        with ema.applied(layer):
            raise RuntimeError("inside")
    assert torch.all(layer.weight == 7.0) and torch.all(layer.bias == -2.0)


def test_state_round_trip_and_mismatch():
    layer = _linear(1.0)
    ema = EMA(layer, decay=0.99)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    ema.update(layer)
    again = EMA(_linear(0.0), decay=0.99)
    again.load_state_dict(ema.state_dict())
    assert again.updates == 1 and torch.equal(again.shadow["weight"], ema.shadow["weight"])
    with pytest.raises(ValueError, match="does not match the module"):
        EMA(torch.nn.Linear(2, 1, bias=False), 0.99).load_state_dict(ema.state_dict())
    with pytest.raises(ValueError, match=r"within \(0, 1\)"):
        EMA(layer, 1.0)


@pytest.mark.parametrize("value", ["1.0", "-0.1"])
def test_task_ema_must_be_a_decay(value):
    with pytest.raises(ConfigError, match=r"ema must be within \[0, 1\)"):
        load_run_config(DEBUG, [f"--task.ema={value}"])
    assert load_run_config(DEBUG, ["--task.ema=0.999"]) is not None


def hrm_run_with_ema(tmp_path, monkeypatch, save=torch.save):
    """A tiny HRM run in ``tmp_path`` whose checkpoint ``report.load_checkpoint_model`` finds: trained weights that
    are its EMA + 1, the EMA written to ``hrm/ema.pt`` by ``save(obj, path)``; returns (EMA, checkpoint folder)."""
    from dstrain import checkpoint as ckpt
    from models import registry

    cfg = load_run_config(DEBUG, ["--model.size=tiny"])
    model_cfg = registry.make_model_config("hrm", "tiny", cfg.model.args)
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(model_cfg)
    ema = EMA(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # trained weights = average + 1
    tag = tmp_path / "checkpoints" / "step_00000001"
    (tag / "hrm").mkdir(parents=True)
    save(ema.state_dict(), tag / "hrm" / "ema.pt")
    fake = (model.state_dict(), {"model": {"name": "hrm", "size": "tiny", "args": cfg.model.args}})
    monkeypatch.setattr(ckpt, "resolve_checkpoint", lambda run_dir: (tmp_path / "checkpoints", "step_00000001"))
    monkeypatch.setattr(ckpt, "consolidated_state_dict", lambda path: fake)
    return ema, tag


def test_report_loads_the_average_unless_asked_for_raw(tmp_path, monkeypatch):
    from models.hrm import report

    ema, _ = hrm_run_with_ema(tmp_path, monkeypatch)
    avg, *_, loaded = report.load_checkpoint_model(tmp_path)
    raw, *_, loaded_raw = report.load_checkpoint_model(tmp_path, weights="raw")
    assert (loaded, loaded_raw) == ("ema", "raw")
    for (name, a), (_, r) in zip(avg.named_parameters(), raw.named_parameters()):
        assert torch.allclose(a, ema.shadow[name]) and torch.allclose(r, ema.shadow[name] + 1.0), name
