import os

import pytest


# Every test in this folder starts real processes; mark them so `-m "not dist"` skips them.
def pytest_collection_modifyitems(items):
    for item in items:
        if os.sep + "dist" + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.dist)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops():
    """Compile DeepSpeed's CPU kernels once before any timed subprocess needs them."""
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()


@pytest.fixture(scope="session")
def rank_killed_after_step_3(tmp_path_factory):
    """One 2-rank job (4 steps, a checkpoint every 2) whose rank 0 dies with no clean-up of its own after step 3,
    launched without ``--max-restarts``: ``(master port, completed process)``. Two files read it
    (test_launch_failures: what the survivor says and the shared memory left; test_restart: no restart
    without ``--max-restarts``, although a checkpoint to restart from exists): one launch for both."""
    from dstrain.launcher import find_free_port
    from tests.dist.harness import launch, overrides
    port = find_free_port()
    out = tmp_path_factory.mktemp("killed_after_3") / "run"
    proc = launch([*overrides(out, 4, "--checkpoint.every=2"), "--master-port", str(port)],
                  env={"DSTRAIN_FAULT_AFTER_STEP": "3"}, check=False, timeout=600)
    return port, proc
