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


@pytest.fixture(scope="session", autouse=True)
def cpu_bf16_measured_once():
    """Whether bf16 is fast on this CPU (``hardware.cpu_bf16_is_fast``: ten timed matmuls, about 0.4 s) is
    measured once per session and the answer, note included, reused by every plan made in this process (the
    dry-run launches of tests/configs, the planner's unit tests): the machine does not change during a run.
    Where a test has replaced ``matmul_rate`` or ``cpu_bf16_flags`` (to test the decision itself) the real
    function runs. Subprocesses (real launches) measure for themselves."""
    from dstrain.engine import hardware
    real, rate, flags = hardware.cpu_bf16_is_fast, hardware.matmul_rate, hardware.cpu_bf16_flags
    answers = {}

    def measured_once(*args, **kwargs):
        if hardware.matmul_rate is not rate or hardware.cpu_bf16_flags is not flags:
            return real(*args, **kwargs)
        key = (args, tuple(sorted(kwargs.items())))
        if key not in answers:
            answers[key] = real(*args, **kwargs)
        return answers[key]

    hardware.cpu_bf16_is_fast = measured_once
    yield
    hardware.cpu_bf16_is_fast = real
