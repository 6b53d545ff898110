"""The deferred non-finite check (``dstrain.engine.deferred_check``): updates skipped on the device through
``found_inf``, checked against optimizers that never saw the bad step; the pending verdict's bookkeeping."""
from types import SimpleNamespace

import pytest
import torch

from dstrain.engine.deferred_check import DeferredCheck, decode, device_skip_support, verdict
from dstrain.optim.adam_atan2 import AdamATan2
from dstrain.optim.ema import EMA
from dstrain.optim.sparse_sign_sgd import SparseEmbedding, SparseSignSGD
from dstrain.resilience import NonFiniteError, NonFiniteGuard

BAD_GRADS = [float("nan"), float("inf"), float("-inf"), 3e38]  # the last: finite, but its square is not


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _grads(model, seed):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(3, 5)).pow(2).sum().backward()


def _run(make_opt, steps, found_inf=False):
    """Steps on ``_model``; ``steps`` holds gradient seeds, None for a step whose gradients are non-finite
    (skipped through found_inf when ``found_inf``, else simply left out)."""
    model = _model()
    opt = make_opt(model.parameters())
    for i, seed in enumerate(steps):
        if seed is None:
            if not found_inf:
                continue
            _grads(model, 99)
            for p, bad in zip(model.parameters(), BAD_GRADS):
                p.grad.view(-1)[0] = bad
        else:
            _grads(model, seed)
        if found_inf:
            opt.found_inf = torch.tensor(float(seed is None))
        opt.step()
        if found_inf:
            del opt.found_inf
            if seed is None and hasattr(opt, "uncount_last_step"):
                opt.uncount_last_step()
    return model, opt


@pytest.mark.parametrize("make_opt", [
    lambda ps: AdamATan2(ps, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1, fused=True),
], ids=["adam_atan2", "torch_fused_adamw"])
def test_a_step_skipped_on_the_device_is_as_if_it_never_happened(make_opt):
    skipped, opt = _run(make_opt, [1, 2, None, 3, None, 4], found_inf=True)
    reference, ref_opt = _run(make_opt, [1, 2, None, 3, None, 4], found_inf=False)
    for p, q in zip(skipped.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=1e-6, atol=1e-7)
    assert float(opt.state[next(skipped.parameters())]["step"]) == 4


def test_adam_atan2_with_a_clear_flag_equals_its_plain_update():
    flagged, _ = _run(lambda ps: AdamATan2(ps, lr=0.05, weight_decay=0.1), [1, 2, 3], found_inf=True)
    plain, _ = _run(lambda ps: AdamATan2(ps, lr=0.05, weight_decay=0.1), [1, 2, 3])
    for p, q in zip(flagged.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_which_optimizers_skip_on_the_device():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert device_skip_support(AdamATan2(params)) is None
    assert device_skip_support(torch.optim.AdamW(params, fused=True)) is None
    assert "fused=True" in device_skip_support(torch.optim.AdamW(params, foreach=True))
    assert "SGD takes no found_inf" in device_skip_support(torch.optim.SGD(params, lr=0.1))


def test_verdict_codes():
    one, nan, inf, no, yes = (torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(float("inf")),
                              torch.tensor(False), torch.tensor(True))
    alone = [verdict([one, one], one), verdict([one, nan], one), verdict([one], inf), verdict([inf], nan),
             verdict([], nan), verdict([one], one, stop=True)]
    assert [v.tolist() for v in alone] == [[3, 1], [0, 1], [1, 1], [0, 1], [1, 1], [3, 0]]
    assert [decode(v[0].item(), 1) for v in alone] == [(None, None), (0, None), (None, 0), (0, None), (None, 0),
                                                       (None, None)]
    # rank 2 of 4 (no process group here, so the all-reduce leaves the rank's own): its own loss, its own
    # gradient (its GradWatch), the reduced gradients' norm alone, a good step
    four = [verdict([nan], one, no, 2, 4), verdict([one], nan, yes, 2, 4), verdict([one], nan, no, 2, 4),
            verdict([one], one, no, 2, 4)]
    assert [int(v[0]) for v in four] == [2, 6, 8, 12]
    assert [decode(int(v[0]), 4) for v in four] == [(2, None), (None, 2), (None, 0), (None, None)]


def test_sparse_rows_and_ema_follow_the_device_verdict():
    emb = SparseEmbedding(6, 3, init_std=1.0)
    opt = SparseSignSGD(emb, lr=0.1, weight_decay=0.5)
    ids, grads = torch.tensor([1, 4, 1]), torch.full((3, 3), float("nan"))
    before = emb.weight.clone()
    opt.update(ids, grads, ok=torch.tensor(0.0))
    assert torch.equal(emb.weight, before)
    grads = torch.randn(3, 3)
    opt.update(ids, grads, ok=torch.tensor(1.0))
    after_ok = emb.weight.clone()
    emb.weight.copy_(before)
    opt.update(ids, grads)
    assert torch.equal(emb.weight, after_ok) and not torch.equal(after_ok, before)

    model = _model()
    ema = EMA(model, 0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    shadow = {k: v.clone() for k, v in ema.shadow.items()}
    ema.update(model, ok=torch.tensor(0.0))
    assert all(torch.equal(ema.shadow[k], shadow[k]) for k in shadow)
    ema.update(model, ok=torch.tensor(1.0))
    plain = EMA(_model(), 0.9)
    plain.shadow = shadow
    plain.updates = 1
    plain.update(model)
    for k in shadow:
        torch.testing.assert_close(ema.shadow[k], plain.shadow[k])


def _pending(check, code, step, opt, go_on=1):
    """``code`` as ``verdict`` makes it for one process: 0 a bad loss, 1 a bad gradient, 3 a good step."""
    both = torch.tensor([code, go_on])
    ok = check.arm(opt, both)
    assert float(opt.found_inf) == float(code < 3) and float(ok) == float(code == 3)
    check.disarm(opt)
    assert "found_inf" not in vars(opt)
    check.post(both, step)


def test_settle_applies_the_policy_one_step_late(capsys):
    opt = AdamATan2([torch.nn.Parameter(torch.zeros(2))])
    guard = NonFiniteGuard("skip", 2, 0, 1)
    check = DeferredCheck(guard, "")
    _pending(check, 3, 1, opt)
    check.settle(opt)
    assert check.last_taken and guard.skipped == 0 and not check.pending and not guard.stop_agreed
    _pending(check, 1, 2, opt)
    check.settle(opt)
    assert not check.last_taken and guard.skipped == 1
    assert "non-finite gradient at step 2 on rank 0: update skipped" in capsys.readouterr().out
    check.settle(opt)  # nothing pending: nothing happens
    assert guard.skipped == 1
    _pending(check, 0, 3, opt)
    with pytest.raises(NonFiniteError, match="2 steps skipped in a row") as err:
        check.settle(opt)
    assert err.value.good_step == 3

    stop = DeferredCheck(NonFiniteGuard("stop", 5, 0, 1), "critic")
    _pending(stop, 3, 6, opt, go_on=0)  # a stop signal on some rank: agreed at the same step everywhere
    stop.settle(opt)
    assert stop.guard.stop_agreed and stop.last_taken
    _pending(stop, 0, 7, opt)
    with pytest.raises(NonFiniteError, match=r"non-finite loss at step 7 on rank 0 \(critic\): stopped") as err:
        stop.settle(opt)
    assert err.value.step == 7 and err.value.good_step == 7  # its update was not taken: its state is good


def test_settle_takes_back_adam_atan2_step_counts():
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamATan2([p], lr=0.1)
    p.grad = torch.full((3,), float("nan"))
    check = DeferredCheck(NonFiniteGuard("skip", 5, 0, 1))
    bad_gradient = torch.tensor([1, 1])
    check.arm(opt, bad_gradient)
    opt.step()
    check.disarm(opt)
    check.post(bad_gradient, 1)
    assert float(opt.state[p]["step"]) == 1 and torch.equal(p.detach(), torch.ones(3))
    check.settle(opt)
    assert float(opt.state[p]["step"]) == 0


def test_keep_last_good_saves_the_step_the_deferred_check_names():
    from dstrain.config import load_run_config
    from dstrain.runtime import World
    from dstrain.trainers.common import RunGuards
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    engine = SimpleNamespace(updates=0, watch=lambda g, w, n, check: None)
    guards = RunGuards(load_run_config("models/gpt/recipes/tiny.json", ["--train.nonfinite=stop"]), world,
                       {"": engine}, deferrable=True)
    saved, saver = [], SimpleNamespace(wait=lambda: None)
    try:
        guards.begin(8)
        engine.updates += 1  # step 8 ran; its verdict (bad) arrives at its settle
        guards.keep_last_good(8, 0, None, saved.append, saver, NonFiniteError("x", 8, 0, good_step=8))
        guards.keep_last_good(8, 0, None, saved.append, saver, NonFiniteError("x", 8, 0))  # synchronous: none
    finally:
        guards.close()
    assert saved == [8]


def test_the_lm_trainer_logs_the_mean_loss_of_the_steps_taken():
    from dstrain.trainers.lm import mean_of_taken
    one, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    assert mean_of_taken([]) == {}
    assert mean_of_taken([(one, None), (torch.tensor(3.0), None)]) == {"loss": 2.0}  # synchronous: all taken
    steps = [(one, torch.tensor(1.0)), (nan, torch.tensor(0.0)), (torch.tensor(4.0), torch.tensor(1.0))]
    assert mean_of_taken(steps) == {"loss": 2.5}  # the skipped step's NaN is left out
    assert mean_of_taken([(nan, torch.tensor(0.0))]) == {}
