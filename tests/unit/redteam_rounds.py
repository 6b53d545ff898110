"""What the red-team rounds after the first share (``test_sandbox_redteam8.py`` on): their sandbox pool and the
check every attack must pass. A module of its own, so the first round's ``pool`` (which puts a secret in the
environment) stays that file's."""
from __future__ import annotations

import dataclasses

import pytest

from dstrain.rewards.sandbox import MODES, SandboxPool
from tests.unit.test_sandbox_redteam import LIMITS


@pytest.fixture(scope="module", params=MODES, name="pool")
def round_pool(request):
    """One worker per mode, no secret in the environment; a round imports it to use it as ``pool``."""
    with SandboxPool(workers=1, limits=dataclasses.replace(LIMITS, mode=request.param)) as p:
        yield p


def scores_zero(pool, name: str, program: str, tests, setup: str = ""):
    """Runs one attack and checks it got nothing: reward 0, also with partial credit, and no test passed.
    Returns the result for a round's own checks."""
    r = pool.run(program, tests, setup)
    assert r.reward(partial_credit=True) == 0.0, (name, r.status, r.detail)
    assert r.passed == 0 or r.status != "passed"
    return r
