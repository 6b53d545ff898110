"""The HRM segment step compiles as one graph (no host syncs, fixed shapes) and matches eager."""
import torch

from models import registry


def test_compiled_segment_step_is_one_graph_and_matches_eager():
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": 3, "halt_exploration_prob": 0.0})
    torch.manual_seed(0)
    eager = registry.get_spec("hrm").build(cfg).train()
    twin = registry.get_spec("hrm").build(cfg).train()
    twin.load_state_dict(eager.state_dict())
    # fullgraph: a .item(), nonzero or data-dependent shape anywhere in the step would fail here
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 11, (4, 81), generator=g)
    y = torch.randint(2, 11, (4, 81), generator=g)
    emb = torch.randn(4, 32, generator=g)
    z_H, z_L = eager.initial_state(4)
    carry = {"z_H": z_H, "z_L": z_L, "steps": torch.zeros(4, dtype=torch.long)}
    carries = [carry, carry]
    resets = (torch.ones(4, dtype=torch.bool), torch.tensor([True, False, True, False]))
    for seg, reset in enumerate(resets):  # same shapes and types every call: one compilation
        outs, losses = [], []
        for model, c in zip((eager, compiled), carries):
            loss, out = model(x, y, emb, c["z_H"], c["z_L"], c["steps"], reset)
            loss.backward()
            outs.append(out)
            losses.append(loss)
        carries = outs
        assert torch.allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6), seg
        for key in ("z_H", "z_L", "q_halt", "q_continue"):
            assert torch.allclose(outs[0][key], outs[1][key], rtol=1e-4, atol=1e-5), (seg, key)
        for key in ("steps", "halted", "preds"):
            assert torch.equal(outs[0][key], outs[1][key]), (seg, key)
    assert carries[0]["steps"].tolist() == [1, 2, 1, 2]  # rows 0 and 2 restarted
    for (name, p), (_, q) in zip(eager.named_parameters(), twin.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name
