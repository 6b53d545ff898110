import pytest


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (the 2-rank runs beyond the representative few) run only when ``-m`` names them."""
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow (every trainable config as a real 2-rank run)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops(request):
    """Compile DeepSpeed's CPU kernels once before a real run needs them (as tests/dist does)."""
    if not any("dist" in item.keywords for item in request.session.items):
        return []
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()
