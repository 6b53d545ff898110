import pytest


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops():
    """Compile DeepSpeed's CPU kernels once before any timed subprocess needs them."""
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()
