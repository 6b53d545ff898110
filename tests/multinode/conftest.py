"""Two pretend hosts on this machine (one sshd per loopback address, pdsh over ssh); see hosts.py.

Every test in this folder is marked ``multinode`` and ``dist`` (real multi-process runs); those
marked ``slow`` (hosts in network namespaces) run only when ``-m`` names slow.
Where the machine lacks sshd/pdsh or refuses to start them, the tests are skipped with the reason.
"""
import os

import pytest

from tests.multinode.hosts import HostsUnavailable, start_hosts


def pytest_collection_modifyitems(config, items):
    run_slow = "slow" in (config.option.markexpr or "")
    for item in items:
        if os.sep + "multinode" + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.multinode)
            item.add_marker(pytest.mark.dist)
            if "slow" in item.keywords and not run_slow:
                item.add_marker(pytest.mark.skip(reason="slow: run with -m slow"))


@pytest.fixture(scope="session")
def deepspeed_cpu_ops_built():
    """DeepSpeed's CPU kernels compiled once here, so ranks on every pretend host only load them."""
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()


@pytest.fixture(scope="session")
def hosts(tmp_path_factory, request):
    try:
        started = start_hosts(tmp_path_factory.mktemp("hosts"))
    except HostsUnavailable as why:
        pytest.skip(f"no pretend hosts on this machine: {why}")
    try:
        request.getfixturevalue("deepspeed_cpu_ops_built")  # only once the hosts are up (a skip builds nothing)
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory, request):
    """Two hosts in network namespaces of their own (eth0 on a private bridge, sshd on port 22)."""
    try:
        started = start_hosts(tmp_path_factory.mktemp("netns_hosts"), netns=True)
    except HostsUnavailable as why:
        pytest.skip(f"no namespaced hosts on this machine: {why}")
    try:
        request.getfixturevalue("deepspeed_cpu_ops_built")
        yield started
    finally:
        started.stop()
