import pytest


def pytest_collection_modifyitems(config, items):
    """``slow`` tests (long real runs beyond the representative few) run only when ``-m`` names them, whichever
    folders are collected."""
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
