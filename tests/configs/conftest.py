import pytest


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops(request):
    """Compile DeepSpeed's CPU kernels once before a real run needs them (as tests/dist does)."""
    if not any("dist" in item.keywords for item in request.session.items):
        return []
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()
