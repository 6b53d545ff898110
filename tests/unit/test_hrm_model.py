"""models.hrm: shapes, halting, the one-step gradient, losses, config errors, registry and tracing."""
import copy
import math

import pytest
import torch

from dstrain.engine import hardware
from models import registry
from models.hrm.model import HRM, log_stablemax, token_cross_entropy

B = 3


def make(**over) -> HRM:
    cfg = registry.make_model_config("hrm", "tiny", over)
    torch.manual_seed(0)
    return HRM(cfg)


def batch(cfg, b=B, seed=0):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(1, 11, (b, cfg.seq_len), generator=g)
    labels = torch.randint(2, 11, (b, cfg.seq_len), generator=g)
    emb = torch.randn(b, cfg.puzzle_emb_len * cfg.hidden_size, generator=g)
    return inputs, labels, emb


def test_forward_shapes_and_carry():
    m = make()
    c = m.config
    loss, out = m(*batch(c))
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert out["z_H"].shape == out["z_L"].shape == (B, c.seq_len + 1, c.hidden_size)
    assert not out["z_H"].requires_grad and not out["z_L"].requires_grad
    assert out["preds"].shape == (B, c.seq_len) and out["steps"].tolist() == [1] * B
    assert out["q_halt"].shape == (B,) and out["halted"].dtype == torch.bool


def test_q_head_init_and_no_early_halt():
    m = make(halt_max_steps=3)
    assert torch.all(m.q_head.weight == 0) and torch.all(m.q_head.bias == -5)
    m.train()
    inputs, labels, emb = batch(m.config)
    z_H = z_L = steps = None
    halted_at = []
    for _ in range(3):  # q_halt == q_continue: no row halts before halt_max_steps
        _, out = m(inputs, labels, emb, z_H, z_L, steps, None)
        z_H, z_L, steps = out["z_H"], out["z_L"], out["steps"]
        halted_at.append(out["halted"].tolist())
    assert halted_at == [[False] * B, [False] * B, [True] * B]


def test_halting_on_q_and_exploration():
    m = make(halt_max_steps=4, halt_exploration_prob=0.0)
    with torch.no_grad():
        m.q_head.bias.copy_(torch.tensor([5.0, -5.0]))  # q_halt > q_continue everywhere
    m.train()
    _, out = m(*batch(m.config))
    assert out["halted"].all()  # halts after its first step
    m.config.halt_exploration_prob = 1.0  # a minimum of 2..4 steps is always drawn
    torch.manual_seed(1)
    _, out = m(*batch(m.config))
    assert not out["halted"].any()
    m.eval()  # evaluation ignores Q and runs halt_max_steps
    inputs, labels, emb = batch(m.config)
    z = (None, None, None)
    for i in range(4):
        _, out = m(inputs, labels, emb, *z, None)
        z = (out["z_H"], out["z_L"], out["steps"])
        assert out["halted"].all() == (i == 3)


def test_reset_rows_restart_from_initial_state():
    m = make(halt_max_steps=4)
    m.eval()
    inputs, labels, emb = batch(m.config)
    _, first = m(inputs, labels, emb)
    _, second = m(inputs, labels, emb, first["z_H"], first["z_L"], first["steps"],
                  torch.tensor([True, False, False]))
    assert second["steps"].tolist() == [1, 2, 2]
    assert torch.allclose(second["z_H"][0], first["z_H"][0], atol=1e-5)  # row 0 started afresh
    assert not torch.allclose(second["z_H"][1], first["z_H"][1], atol=1e-3)


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def test_gradient_flows_only_through_the_last_L_and_H_update():
    m = make(H_cycles=2, L_cycles=3)
    m.train()
    c = m.config
    inputs, labels, emb = batch(c)
    z_H0, z_L0 = m.initial_state(B)
    # Carry from an earlier segment, so the carried state is not a constant.
    with torch.no_grad():
        z_H0, z_L0 = m.segment(z_H0, z_L0, m.input_embeddings(inputs, emb))

    def loss_from(z_H):
        logits, _ = m.heads(z_H)
        return token_cross_entropy(logits, labels, c.loss).sum()

    x = m.input_embeddings(inputs, emb)
    zH, zL = m.segment(z_H0, z_L0, x, one_step_grad=True)
    m.zero_grad()
    loss_from(zH).backward()
    one_step = _grads(m)

    # Independent computation: all updates but the last L and H without a graph, then those two.
    m.zero_grad()
    rot = (m.rotary.cos, m.rotary.sin)
    x = m.input_embeddings(inputs, emb)
    with torch.no_grad():
        zH, zL = z_H0, z_L0
        updates = [("L", h, l) for h in range(c.H_cycles) for l in range(c.L_cycles)]
        for h in range(c.H_cycles):
            for l in range(c.L_cycles):
                if (h, l) != (c.H_cycles - 1, c.L_cycles - 1):
                    zL = m.L_level(zL, zH + x.detach(), rot)
            if h < c.H_cycles - 1:
                zH = m.H_level(zH, zL, rot)
    zL = m.L_level(zL, zH + x, rot)
    zH = m.H_level(zH, zL, rot)
    loss_from(zH).backward()
    reference = _grads(m)
    for name, g in one_step.items():
        if g is None:
            assert reference[name] is None, name
        else:
            assert torch.allclose(g, reference[name], rtol=1e-4, atol=1e-6), name
    assert one_step["q_head.weight"] is None  # the Q-head is not in this loss
    assert len(updates) == 6

    # Full backpropagation through every update gives different L and H gradients.
    m.zero_grad()
    zH, _ = m.segment(z_H0, z_L0, m.input_embeddings(inputs, emb), one_step_grad=False)
    loss_from(zH).backward()
    full = _grads(m)
    name = "L_level.layers.0.attn.qkv.weight"
    assert not torch.allclose(full[name], one_step[name], rtol=1e-3, atol=1e-6)


def test_model_forward_uses_the_one_step_gradient():
    m = make()
    m.train()
    loss, _ = m(*batch(m.config))
    loss.backward()
    one_step = _grads(m)
    assert all(g is not None for n, g in one_step.items()), [n for n, g in one_step.items() if g is None]
    assert m.H_init.grad is None and not m.H_init.requires_grad  # initial states are buffers


def test_stablemax_and_losses():
    x = torch.tensor([[-3.0, 0.0, 2.0, 1.0]], dtype=torch.float64, requires_grad=True)
    logp = log_stablemax(x)
    s = torch.tensor([0.25, 1.0, 3.0, 2.0])
    assert torch.allclose(logp.exp().float(), s / s.sum())
    logp.sum().backward()
    assert torch.isfinite(x.grad).all()
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[2, 3, -100, 4, 5], [-100] * 5])
    for kind in ("stablemax", "softmax"):
        loss = token_cross_entropy(logits, labels, kind)
        assert loss.shape == (2, 5) and loss[0, 2] == 0 and (loss[1] == 0).all() and (loss[0, [0, 1, 3, 4]] > 0).all()
    soft = token_cross_entropy(logits, labels, "softmax")
    assert torch.allclose(soft[0, 0], -torch.log_softmax(logits[0, 0], -1)[2])


def test_loss_is_per_sequence_mean_plus_q_losses():
    m = make(halt_max_steps=1)  # no Q-continue target with a single step
    m.eval()
    inputs, labels, emb = batch(m.config)
    labels[0, 10:] = -100
    loss, out = m(inputs, labels, emb)
    logits, q = m.heads(out["z_H"])
    per_seq = token_cross_entropy(logits, labels, "stablemax").sum(-1) / (labels != -100).sum(-1)
    correct = ((logits.argmax(-1) == labels) | (labels == -100)).all(-1).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(q[:, 0], correct, reduction="sum")
    assert torch.allclose(loss, (per_seq.sum() + 0.5 * bce) / B, rtol=1e-5)
    assert out["metrics"]["count"] == B and out["metrics"]["steps"] == B


def test_metrics_exact_counts_blanks_only():
    m = make(halt_max_steps=1)
    m.eval()
    inputs, labels, emb = batch(m.config)
    with torch.no_grad():
        _, out = m(inputs, labels, emb)
    preds = out["preds"]
    inputs[:] = 5  # no blanks: every row is "all blanks right"
    _, out = m(inputs, labels, emb)
    assert out["metrics"]["exact_accuracy"] == B
    inputs[0, 0] = 1  # one blank in row 0, labelled with the prediction: still right
    labels[0, 0] = preds[0, 0]
    assert m(inputs, labels, emb)[1]["metrics"]["exact_accuracy"] == B
    labels[0, 0] = (preds[0, 0] + 1) % 11  # now wrong
    assert m(inputs, labels, emb)[1]["metrics"]["exact_accuracy"] == B - 1


def test_config_errors():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        registry.make_model_config("hrm", "tiny", {"hidden_size": 30, "num_heads": 4})
    with pytest.raises(ValueError, match="halt_max_steps must be at least 1"):
        registry.make_model_config("hrm", "tiny", {"halt_max_steps": 0})
    with pytest.raises(ValueError, match="loss must be stablemax or softmax"):
        registry.make_model_config("hrm", "tiny", {"loss": "hinge"})
    with pytest.raises(ValueError, match="halt_exploration_prob"):
        registry.make_model_config("hrm", "tiny", {"halt_exploration_prob": 2.0})
    m = make()
    inputs, labels, emb = batch(m.config)
    with pytest.raises(ValueError, match="inputs must be"):
        m(inputs[:, :80], labels[:, :80], emb)
    with pytest.raises(ValueError, match="puzzle_emb must be"):
        m(inputs, labels, emb[:, :5])


def test_sizes_registry_and_activation_trace():
    spec = registry.get_spec("hrm")
    assert {"tiny", "debug", "sudoku"} <= set(spec.sizes)
    with torch.device("meta"):
        big = spec.build(registry.make_model_config("hrm", "sudoku"))
    assert sum(p.numel() for p in big.parameters()) == 27_275_266  # the reference's count at Sudoku defaults
    c = big.config
    assert (c.hidden_size, c.num_heads, c.H_layers, c.L_layers, c.H_cycles, c.L_cycles, c.halt_max_steps) == \
        (512, 8, 4, 4, 2, 2, 16)
    cfg = registry.make_model_config("hrm", "tiny")
    acts = hardware.trace_activations(lambda: spec.build(cfg), lambda: spec.inputs_for_trace(cfg, 1, 999),
                                      lambda m, f: spec.parallelize(m, activation_checkpointing=f))
    assert 0 < acts.per_sample_checkpointed < acts.per_sample


def test_activation_checkpointing_gives_the_same_gradients():
    m = make()
    m2 = copy.deepcopy(m)
    registry.get_spec("hrm").parallelize(m2, activation_checkpointing=True)
    torch.manual_seed(3)
    m(*batch(m.config))[0].backward()
    torch.manual_seed(3)
    m2(*batch(m.config))[0].backward()
    for (n, p), (_, p2) in zip(m.named_parameters(), m2.named_parameters()):
        assert torch.allclose(p.grad, p2.grad, atol=1e-6), n
    assert math.isclose(m.embed_scale, math.sqrt(m.config.hidden_size))


def test_act_off_runs_fixed_segments_without_q_losses():
    m = make(halt_max_steps=3, act=False, halt_exploration_prob=0.0)
    with torch.no_grad():
        m.q_head.bias.copy_(torch.tensor([5.0, -5.0]))  # ACT would halt every row at once
    m.train()
    inputs, labels, emb = batch(m.config)
    z_H = z_L = steps = None
    halted_at = []
    for _ in range(3):
        loss, out = m(inputs, labels, emb, z_H, z_L, steps, None)
        z_H, z_L, steps = out["z_H"], out["z_L"], out["steps"]
        halted_at.append(out["halted"].tolist())
    assert halted_at == [[False] * B, [False] * B, [True] * B]
    logits, _ = m.heads(z_H)  # z_H of the last call, detached: recompute the loss it reported
    per_seq = token_cross_entropy(logits, labels, "stablemax").mean(-1)
    assert torch.allclose(loss, per_seq.sum() / B, rtol=1e-5)  # no Q-head terms
    assert out["metrics"]["q_continue_loss"] == 0
    with pytest.raises(ValueError, match="act"):
        registry.make_model_config("hrm", "tiny", {"act": 1})


def test_halt_rule_solved_halts_on_q_halt_alone_without_a_target_segment():
    inputs, labels, emb = batch(make().config)
    for bias, compare_halts, solved_halts in (([1.0, 5.0], False, True), ([-1.0, -5.0], True, False)):
        for rule, expected in (("compare", compare_halts), ("solved", solved_halts)):
            m = make(halt_max_steps=4, halt_exploration_prob=0.0, halt_rule=rule)
            with torch.no_grad():
                m.q_head.bias.copy_(torch.tensor(bias))
            m.train()
            calls = []
            segment = m.segment
            m.segment = lambda *a, **k: calls.append(1) or segment(*a, **k)
            _, out = m(inputs, labels, emb)
            assert out["halted"].tolist() == [expected] * B, (rule, bias)
            assert out["wants_halt"].tolist() == [expected] * B
            assert len(calls) == (2 if rule == "compare" else 1)  # compare: one more segment for the Q target
    m = make(halt_max_steps=4, halt_exploration_prob=0.0, halt_rule="solved")
    m.train()
    loss, out = m(inputs, labels, emb)
    logits, q = m.heads(out["z_H"])  # recompute the loss by hand: LM + 0.5 BCE(q_halt, solved), no q_continue term
    per_seq = token_cross_entropy(logits, labels, "stablemax").mean(-1)
    correct = (logits.argmax(-1) == labels).all(-1).float()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(q[:, 0], correct, reduction="sum")
    assert torch.allclose(loss, (per_seq.sum() + 0.5 * bce) / B, rtol=1e-5)
    assert out["metrics"]["q_continue_loss"] == 0
    with torch.no_grad():
        m.q_head.bias.copy_(torch.tensor([1.0, 5.0]))
    m.config.halt_exploration_prob = 1.0  # a minimum of 2..4 steps holds under this rule too
    torch.manual_seed(1)
    _, out = m(inputs, labels, emb)
    assert not out["halted"].any()
    full = make(halt_rule="compare")
    assert m.flops_per_segment_token() < full.flops_per_segment_token()
    with pytest.raises(ValueError, match="halt_rule"):
        registry.make_model_config("hrm", "tiny", {"halt_rule": "never"})
    m.config.halt_exploration_prob = 0.0
    for threshold, halts in ((0.5, True), (2.0, False)):  # q_halt is the bias, 1.0 (the weight is 0)
        m.config.halt_threshold = threshold
        _, out = m(inputs, labels, emb)
        assert out["halted"].tolist() == out["wants_halt"].tolist() == [halts] * B
    with pytest.raises(ValueError, match="halt_threshold"):
        registry.make_model_config("hrm", "tiny", {"halt_threshold": 1.0})  # the compare rule has none
    with pytest.raises(ValueError, match="halt_threshold"):
        registry.make_model_config("hrm", "tiny", {"halt_rule": "solved", "halt_threshold": float("nan")})
