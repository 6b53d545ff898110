"""Non-finite loss policy, skipped updates and the hang watchdog, in one process."""
import io
import time
from types import SimpleNamespace

import pytest
import torch

from dstrain.resilience import (EXIT_HANG, NonFiniteError, NonFiniteGuard, Watchdog, base_optimizer,
                                update_skipped)

NAN, ONE = torch.tensor(float("nan")), torch.tensor(1.0)


def test_skip_counts_and_resets_on_a_good_step():
    guard = NonFiniteGuard("skip", max_consecutive=3, rank=0, world_size=1)
    assert guard.check([ONE, ONE], 1) is False
    assert guard.check([ONE, NAN], 2) is True
    assert guard.check([torch.tensor(float("inf"))], 3) is True
    assert (guard.skipped, guard.consecutive) == (2, 2)
    assert guard.check([ONE], 4) is False
    assert (guard.skipped, guard.consecutive) == (2, 0)


def test_too_many_consecutive_skips_stop_the_run():
    guard = NonFiniteGuard("skip", max_consecutive=2, rank=0, world_size=1)
    guard.check([NAN], 7)
    with pytest.raises(NonFiniteError, match=r"step 8 on rank 0: 2 steps skipped in a row") as err:
        guard.check([NAN], 8)
    assert err.value.step == 8 and err.value.exit_code == 3


def test_stop_names_step_and_rank():
    guard = NonFiniteGuard("stop", max_consecutive=5, rank=0, world_size=1)
    assert guard.check([ONE], 1) is False
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 2 on rank 0: stopped"):
        guard.check([ONE, NAN], 2)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="skip or stop"):
        NonFiniteGuard("ignore", 1, 0, 1)


def _engine(optimizer):
    return SimpleNamespace(optimizer=optimizer)


def test_update_skipped_leaves_weights_and_moments_alone():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # moments exist
    before = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    model(torch.randn(2, 4)).sum().backward()
    wrapper = SimpleNamespace(optimizer=opt)  # as ZeRO wraps the base optimizer
    with update_skipped(_engine(wrapper)):
        base_optimizer(_engine(wrapper)).step()
    for p, b, m in zip(model.parameters(), before, moments):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["exp_avg"], m)
    opt.step()  # restored afterwards: the next update is taken
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_base_optimizer_of_a_plain_torch_optimizer_is_itself():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    assert base_optimizer(_engine(opt)) is opt


def test_watchdog_reports_rank_phase_and_step_then_exits():
    codes, out = [], io.StringIO()
    dog = Watchdog(rank=3, timeout_s=0.2, exit=codes.append, out=out)
    dog.phase("allreduce", 12)
    deadline = time.monotonic() + 5
    while not codes and time.monotonic() < deadline:
        time.sleep(0.02)
    dog.close()
    assert codes == [EXIT_HANG]
    assert "hang: rank 3 waited" in out.getvalue() and "in allreduce of step 12" in out.getvalue()


def test_watchdog_quiet_while_progressing_or_paused():
    codes = []
    dog = Watchdog(rank=0, timeout_s=0.3, exit=codes.append, out=io.StringIO())
    for step in range(10):  # phases change faster than the timeout
        dog.phase("forward", step)
        time.sleep(0.05)
    dog.pause()
    time.sleep(0.6)
    dog.close()
    assert codes == [] and dog.fired is None


def test_grad_watch_sees_a_nan_gradient_behind_a_finite_loss():
    from dstrain.faults import _nan_gradient
    from dstrain.resilience import GradWatch
    model = torch.nn.Linear(3, 2)
    watch = GradWatch(model)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    assert watch.take() is False
    loss = _nan_gradient(model(x).sum())
    assert torch.isfinite(loss)
    loss.backward()
    assert watch.take() is True and watch.take() is False  # read once, then cleared
    watch.remove()
    _nan_gradient(model(x).sum()).backward()
    assert watch.take() is False


@pytest.mark.parametrize("values", [(float("inf"), 0.0), (float("-inf"), float("inf")), (float("nan"), 1.0),
                                    (3e38, 3e38)])
def test_grad_watch_flags_any_non_finite_element(values):
    from dstrain.resilience import GradWatch
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    watch = GradWatch(torch.nn.ParameterList([a, b]))
    ((a * torch.tensor([1.0, values[0], 2.0])).sum() + (b * torch.tensor([values[1], 3.0])).sum()).backward()
    # inf and -inf in two gradients sum to NaN; a sum past the fp32 range counts as non-finite (documented)
    assert watch.take() is True
    a.grad = b.grad = None
    ((a * torch.tensor([1e30, -1e30, 5.0])).sum() + b.sum()).backward()
    assert watch.take() is False


def test_guard_names_the_gradient_and_the_model_and_counts_skips_per_model():
    guard = NonFiniteGuard("skip", max_consecutive=2, rank=0, world_size=1)
    assert guard.check([ONE], 4, grads_bad=True, name="critic") is True
    assert guard.check([ONE], 4, name="policy") is False  # another model's good step resets nothing of the critic
    with pytest.raises(NonFiniteError, match=r"^non-finite gradient at step 5 on rank 0 \(critic\): 2 steps"):
        guard.check([ONE], 5, grads_bad=True, name="critic")
    stop = NonFiniteGuard("stop", max_consecutive=5, rank=0, world_size=1)
    with pytest.raises(NonFiniteError, match=r"^non-finite loss at step 1 on rank 0: stopped"):
        stop.check([NAN], 1, grads_bad=True)  # a NaN loss is named before its gradients


def test_run_guards_last_good_step_depends_on_whether_an_update_was_taken():
    from dstrain.config import load_run_config
    from dstrain.runtime import World
    from dstrain.trainers.common import RunGuards
    cfg = load_run_config("models/gpt/recipes/tiny.json", ["--train.nonfinite=skip"])
    attached = {}
    engines = {name: SimpleNamespace(updates=0, watch=lambda g, w, n, check: attached.setdefault(n, (g, w, check)))
               for name in ("policy", "critic")}
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    guards = RunGuards(cfg, world, engines)
    try:
        assert set(attached) == {"policy", "critic"} and attached["critic"][0] is guards.guard
        assert attached["critic"][2] == "sync"  # a trainer that did not say it follows step_ok: never deferred
        guards.begin(7)
        assert guards.last_good(7) == 6  # nothing updated yet in step 7: step 6's state is the last good one
        engines["policy"].updates += 1
        assert guards.last_good(7) is None  # the policy moved on before the critic failed
        guards.skipped = 3
        assert guards.guard.skipped == 3
    finally:
        guards.close()
    off = RunGuards(load_run_config("models/gpt/recipes/tiny.json", ["--train.nonfinite=off"]), world, {})
    assert off.guard is None and off.skipped == 0
    off.close()
