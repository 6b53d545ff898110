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
