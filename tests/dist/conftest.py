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
