"""Unit tests for dstrain.slurm: srun commands, SLURM -> torch.distributed variables, node lists."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dstrain.launcher import LaunchSpec
from dstrain.slurm import build_srun_command, env_from_slurm, expand_nodelist, tasks_per_node_counts

OVERRIDES = ("--train.lr=3e-4", "--model.name=gpt tiny", "--data.path=a=b", "--x='q'")


def cpu():
    return "cpu"


def cuda():
    return "cuda"


def test_srun_command():
    base = {"A": "1"}
    argv, env = build_srun_command(LaunchSpec("r.json", OVERRIDES, nproc=4, master_port=7000), 2, "py", base,
                                   detect=cuda)
    assert argv == ["srun", "--nodes=2", "--ntasks-per-node=4", "--ntasks=8", "--gpus-per-node=4",
                    "--kill-on-bad-exit=1", "py", "-m", "dstrain.cli", "train", "r.json", *OVERRIDES]
    assert env == {"A": "1", "MASTER_PORT": "7000"} and base == {"A": "1"}
    argv, env = build_srun_command(LaunchSpec("r.json", master_addr="n9"), 1, "py", {}, detect=cpu)
    assert not any(a.startswith("--gpus") for a in argv)
    assert env == {"MASTER_PORT": "29500", "MASTER_ADDR": "n9", "DS_ACCELERATOR": "cpu"}


@pytest.mark.parametrize("kwargs,nodes,match", [
    ({"include": "a"}, 1, "srun picks hosts"),
    ({"num_nodes": 3}, 2, "disagrees"),
    ({}, 0, "nodes must be"),
])
def test_srun_rejects(kwargs, nodes, match):
    with pytest.raises(ValueError, match=match):
        build_srun_command(LaunchSpec("r.json", **kwargs), nodes, "py", {}, detect=cpu)


SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "node[01-04,07]", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_CPUS_PER_TASK": "6"}


def test_env_from_slurm_maps_everything():
    assert env_from_slurm(SLURM) == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node01", "MASTER_PORT": "29500",
        "NODE_RANK": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "6"}


def test_env_from_slurm_preferences():
    env = {**SLURM, "SLURM_NODEID": "3", "MASTER_PORT": "1999", "OMP_NUM_THREADS": "1",
           "SLURM_STEP_NODELIST": "gpu-b,gpu-c", "SLURM_STEP_NUM_TASKS": "7"}
    out = env_from_slurm(env)
    assert (out["MASTER_ADDR"], out["MASTER_PORT"], out["WORLD_SIZE"]) == ("gpu-b", "1999", "7")
    assert out["LOCAL_WORLD_SIZE"] == "1" and "OMP_NUM_THREADS" not in out
    assert env_from_slurm({**SLURM, "MASTER_ADDR": "10.2.3.4"})["MASTER_ADDR"] == "10.2.3.4"
    assert env_from_slurm({**SLURM, "SLURM_JOB_NODELIST": "a,b"})["MASTER_ADDR"] == "a"


def test_env_from_slurm_not_under_slurm_or_already_set():
    assert env_from_slurm({"PATH": "/bin"}) == {}
    assert env_from_slurm({**SLURM, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) == {}


@pytest.mark.parametrize("drop,extra,match", [
    ("SLURM_LOCALID", {}, "SLURM_LOCALID"),
    ("SLURM_NTASKS", {}, "SLURM_NTASKS"),
    ("SLURM_JOB_NODELIST", {}, "SLURM_JOB_NODELIST"),
    (None, {"SLURM_PROCID": "x"}, "not an integer"),
    (None, {"SLURM_PROCID": "8"}, "outside the world"),
])
def test_env_from_slurm_errors(drop, extra, match):
    env = {k: v for k, v in SLURM.items() if k != drop}
    with pytest.raises(ValueError, match=match):
        env_from_slurm({**env, **extra})


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a,b", ["a", "b"]),
    ("solo", ["solo"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("x[1,3]-y,z[009-010]", ["x1-y", "x3-y", "z009", "z010"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-", "node]1[", "n[a-b]", "", "n[[1]]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


def test_launcher_main_srun_backend(capsys, monkeypatch):
    from dstrain import launcher

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert launcher.main(["--backend", "srun", "--nodes", "2", "--print", "--nproc", "4", "--accelerator", "cpu",
                          "r.json", "--a.b=1"]) == 0
    out = capsys.readouterr().out
    assert "DS_ACCELERATOR=cpu" in out and "srun --nodes=2 --ntasks-per-node=4 --ntasks=8" in out
    assert out.rstrip().endswith("-m dstrain.cli train r.json --a.b=1")


@pytest.mark.parametrize("code", ["import dstrain.slurm", "from dstrain.launcher import env_from_slurm",
                                  "import dstrain.launcher, dstrain.slurm"])
def test_no_import_cycle_in_either_order(code):
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("text, counts", [("2(x3),1", [2, 2, 2, 1]), ("8", [8]), ("1(x2)", [1, 1]),
                                          ("2,x", None), ("(x2)", None)])
def test_tasks_per_node_counts(text, counts):
    assert tasks_per_node_counts(text) == counts
