"""dstrain/hostfile.py and dstrain/launch_check.py: reading, writing and refusing hostfiles (no network)."""
from __future__ import annotations

import pytest

from dstrain import hostfile as hf
from dstrain import launch_check
from dstrain.launcher import LaunchSpec


def write(tmp_path, text, name="hostfile"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- parse / write


def test_parse_and_format_round_trip(tmp_path):
    hosts = [("node1", 2), ("gpu-b.example", 8)]
    path = write(tmp_path, "# cluster\n" + hf.format_hostfile(hosts) + "\n  # done\n")
    assert hf.parse_hostfile(path) == hosts
    assert hf.format_hostfile(hosts) == "node1 slots=2\ngpu-b.example slots=8\n"


@pytest.mark.parametrize("text, match", [
    ("a slots=2\nb slots=1\na slots=4\n", r":3: host 'a' already listed on line 1"),
    ("a slots=0\n", r":1: host 'a' has slots=0; need at least 1"),
    ("a slots=two\n", r":1: host 'a' has slots='two'; need an integer >= 1"),
    ("a slots=1.5\n", r"host 'a' has slots='1.5'"),
    ("a slots=-1\n", r"host 'a' has slots='-1'"),
    ("a slots=\n", r"host 'a' has slots=''"),
    ("a 4\n", r":1: expected 'hostname slots=N'"),
    ("# nothing\n", r"no hosts found"),
])
def test_parse_refusals_name_file_line_and_host(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(hf.HostfileError, match=match) as info:
        hf.parse_hostfile(path)
    assert str(info.value).startswith(path) and "\n" not in str(info.value)


def test_host_list():
    assert hf.parse_host_list(["node1", "node2:4"], slots=2) == [("node1", 2), ("node2", 4)]
    assert hf.parse_host_list(["a"]) == [("a", 1)]
    with pytest.raises(hf.HostfileError, match="host 'a' listed twice"):
        hf.parse_host_list(["a:2", "b", "a"])
    with pytest.raises(hf.HostfileError, match="host 'b' has slots=0"):
        hf.parse_host_list(["a", "b:0"])
    with pytest.raises(hf.HostfileError, match="host 'b' has slots='x'"):
        hf.parse_host_list(["b:x"])
    with pytest.raises(hf.HostfileError, match=r"^--slots must be an integer >= 1, got 0$"):
        hf.parse_host_list(["a"], slots=0)
    with pytest.raises(hf.HostfileError, match="bad host name"):
        hf.parse_host_list([":3"])


def test_hosts_from_slurm():
    env = {"SLURM_JOB_NODELIST": "gpu[07-08],cpu-a", "SLURM_TASKS_PER_NODE": "4(x2),1"}
    assert hf.hosts_from_slurm(env) == [("gpu07", 4), ("gpu08", 4), ("cpu-a", 1)]
    assert hf.hosts_from_slurm(env, slots=8) == [("gpu07", 8), ("gpu08", 8), ("cpu-a", 8)]
    with pytest.raises(hf.HostfileError, match="SLURM_JOB_NODELIST is not set"):
        hf.hosts_from_slurm({})
    with pytest.raises(hf.HostfileError, match="give --slots"):
        hf.hosts_from_slurm({"SLURM_JOB_NODELIST": "n1"})
    with pytest.raises(hf.HostfileError, match="one count for each of the 3 nodes"):
        hf.hosts_from_slurm({**env, "SLURM_TASKS_PER_NODE": "4(x2)"})


# --------------------------------------------------------------------------- ranks asked vs slots


HOSTS = [("node1", 2), ("node2", 2)]


@pytest.mark.parametrize("kwargs, match", [
    ({"num_nodes": 3}, r"num_nodes=3 but hostfile HF lists only 2 host\(s\)"),
    ({"nproc": 3}, r"nproc=3 exceeds the slots of node1 \(slots=2\), node2 \(slots=2\) in HF"),
    ({"include": "node1@node3"}, r"--include: host 'node3' is not in hostfile HF"),
    ({"include": "node2:0,2"}, r"--include: host 'node2' has no slot '2' \(slots=2 in HF\)"),
    ({"exclude": "node9:0"}, r"--exclude: host 'node9' is not in hostfile HF"),
])
def test_more_ranks_than_slots_refused(kwargs, match):
    with pytest.raises(hf.HostfileError, match=match):
        hf.select_hosts(HOSTS, "HF", **kwargs)


def test_select_hosts_keeps_what_fits():
    assert hf.select_hosts(HOSTS, "HF", num_nodes=1, nproc=2) == [("node1", 2)]
    assert hf.select_hosts(HOSTS, "HF", include="node1:1@node2") == HOSTS


# --------------------------------------------------------------------------- resolve, reach, master


def fake_ssh(table):
    return lambda host: table.get(host, (host, 22))


def fake_dns(table):
    return lambda name: table.get(name)


def test_resolve_through_ssh_alias_or_dns():
    ssh = fake_ssh({"node1": ("127.0.0.2", 2201)})
    dns = fake_dns({"127.0.0.2": "127.0.0.2", "db": "10.1.2.3"})
    assert hf.resolve_host("node1", ssh, dns) == hf.Resolved("node1", "127.0.0.2", "ssh config HostName 127.0.0.2", 2201)
    assert hf.resolve_host("db", ssh, dns) == hf.Resolved("db", "10.1.2.3", "DNS / hosts file", 22)
    assert hf.resolve_host("nowhere", ssh, dns) is None
    assert hf.resolve_host("db", lambda h: None, dns).how == "DNS / hosts file"  # no ssh installed


def test_address_of_real_lookups():
    assert hf.address_of("127.0.0.3") == "127.0.0.3"
    assert hf.address_of("no-such-host.invalid") is None


def resolved(table):
    return lambda host: hf.Resolved(host, table[host], "test table") if host in table else None


def test_unknown_host_refused_with_one_line():
    with pytest.raises(hf.HostfileError) as info:
        hf.check_hosts(HOSTS, "HF", reach=False, resolve=resolved({"node1": "10.0.0.1"}))
    assert str(info.value) == ("hostfile HF: host 'node2' does not resolve (not in DNS or the hosts file, "
                               "and no ssh config HostName for it)")


def test_unreachable_host_refused_only_when_reach_is_checked():
    table = resolved({"node1": "10.0.0.1", "node2": "10.0.0.2"})
    probed = []

    def probe(host):
        probed.append(host)
        return "ssh: connect to host 10.0.0.2 port 22: Connection refused" if host == "node2" else None

    with pytest.raises(hf.HostfileError, match=r"^hostfile HF: host 'node2' is unreachable by passwordless ssh "
                                               r"\(ssh: connect .* refused\); --no-ssh-check skips this check$"):
        hf.check_hosts(HOSTS, "HF", reach=True, resolve=table, probe=probe)
    assert sorted(probed) == ["node1", "node2"]
    found = hf.check_hosts(HOSTS, "HF", reach=False, resolve=table, probe=probe)
    assert found["node2"].address == "10.0.0.2" and len(probed) == 2


def test_check_reachable_names_the_problem(monkeypatch, tmp_path):
    fake = tmp_path / "ssh"
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\necho "ssh: Could not resolve hostname x" >&2\n'
                    "exit 255\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert hf.check_reachable("x") == "ssh: Could not resolve hostname x"
    assert (tmp_path / "args").read_text().split() == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "x", "true"]


def test_master_is_the_first_host_as_resolved_here():
    found = {"node1": hf.Resolved("node1", "127.0.0.2", "ssh config HostName 127.0.0.2"),
             "node2": hf.Resolved("node2", "127.0.0.3", "ssh config HostName 127.0.0.3")}
    addr, why = hf.choose_master(HOSTS, "HF", found)
    assert addr == "127.0.0.2" and why == "the first host (node1) of hostfile HF, resolved via ssh config HostName 127.0.0.2"
    assert hf.choose_master(HOSTS, "HF", found, given="10.9.9.9") == ("10.9.9.9", "given with --master-addr")
    found["node2"] = hf.Resolved("node2", "10.0.0.3", "DNS / hosts file")  # loopback first host, real second one
    addr, why = hf.choose_master(HOSTS, "HF", found)
    assert addr is None and "hostname -I" in why and "--master-addr" in why


def test_check_for_launch(tmp_path):
    path = write(tmp_path, "node1 slots=2\nnode2 slots=2\n")
    table = resolved({"node1": "127.0.0.2", "node2": "127.0.0.3"})
    spec = LaunchSpec("r.json", hostfile=path, nproc=2)
    check = launch_check.check_hosts_for_launch(spec, reach=True, resolve=table, probe=lambda h: None)
    assert check.remote and check.master_addr == "127.0.0.2" and check.hosts == HOSTS
    with pytest.raises(hf.HostfileError, match="'node2' is unreachable"):
        launch_check.check_hosts_for_launch(spec, reach=True, resolve=table, probe=lambda h: "no" if h == "node2" else None)
    # torchrun does not ssh: reachability is not its business
    assert launch_check.check_hosts_for_launch(spec, reach=True, torchrun=True, resolve=table,
                                               probe=lambda h: "no").master_addr == "127.0.0.2"
    local = write(tmp_path, "localhost slots=2\n", "local")
    check = launch_check.check_hosts_for_launch(LaunchSpec("r.json", hostfile=local), reach=True,
                                                resolve=lambda h: None, probe=lambda h: "no")
    assert not check.remote and check.master_addr == "127.0.0.1"
