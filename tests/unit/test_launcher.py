"""Unit tests for dstrain.launcher: argv/env of the deepspeed and torchrun builders, hostfiles, CLI."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from dstrain import launcher
from dstrain.launcher import (
    LaunchSpec,
    build_deepspeed_command,
    build_torchrun_command,
    deepspeed_env_file,
    env_delta,
    find_free_port,
    format_command,
    parse_hostfile,
)

REPO = Path(__file__).resolve().parents[2]
LOCAL = {"localhost", "127.0.0.1", "::1", "thisbox"}
OVERRIDES = ("--train.lr=3e-4", "--model.name=gpt tiny", "--data.path=a=b", "--x='q'")


def cpu():
    return "cpu"


def cuda():
    return "cuda"


def no_detect():
    raise AssertionError("detection must not run when the accelerator is known")


@pytest.fixture
def python(tmp_path):
    """A fake interpreter path whose bin dir holds a deepspeed script."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").write_text("")
    (bindir / "deepspeed").write_text("")
    return str(bindir / "python")


def hostfile(tmp_path, text, name="hostfile"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def ds(spec, python, base_env=None, cpu_count=4, detect=cpu):
    return build_deepspeed_command(spec, python, {} if base_env is None else base_env, cpu_count,
                                   detect=detect, local_hosts=LOCAL)


def tail():
    return ["--no_local_rank", "--module", "dstrain.cli", "train"]


# --------------------------------------------------------------------------- deepspeed


def test_deepspeed_cpu_single_node(python):
    base = {"PATH": "/bin", "HOME": "/h"}
    before = dict(base)
    argv, env = ds(LaunchSpec("r.json", OVERRIDES, nproc=2, master_port=1234), python, base)
    assert argv == [str(Path(python).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "1234",
                    "--no_local_rank", "--module", "dstrain.cli", "train", "r.json", *OVERRIDES]
    assert env == {**before, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}
    assert base == before  # not mutated
    assert env_delta(env, base) == {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"}


def test_deepspeed_falls_back_to_path_script(tmp_path):
    argv, _ = ds(LaunchSpec("r.json"), str(tmp_path / "python"))
    assert argv[0] == "deepspeed"


@pytest.mark.parametrize("cpus,nproc,want", [(4, 2, "2"), (1, 4, "1"), (16, 3, "5")])
def test_omp_threads_split(python, cpus, nproc, want):
    _, env = ds(LaunchSpec("r.json", nproc=nproc), python, cpu_count=cpus)
    assert env["OMP_NUM_THREADS"] == want


def test_omp_threads_preset_kept(python):
    _, env = ds(LaunchSpec("r.json", nproc=2), python, {"OMP_NUM_THREADS": "7"})
    assert env["OMP_NUM_THREADS"] == "7"


def test_deepspeed_cuda_leaves_env_alone(python):
    base = {"PATH": "/bin", "NCCL_DEBUG": "INFO"}
    argv, env = ds(LaunchSpec("r.json", nproc=4, accelerator="cuda"), python, base, detect=no_detect)
    assert env == base and env is not base
    assert argv[1:3] == ["--num_gpus", "4"]


def test_auto_uses_detection_and_preset(python):
    _, env = ds(LaunchSpec("r.json"), python, detect=cuda)
    assert "DS_ACCELERATOR" not in env and "OMP_NUM_THREADS" not in env
    _, env = ds(LaunchSpec("r.json"), python, {"DS_ACCELERATOR": "cpu"}, detect=no_detect)
    assert env["OMP_NUM_THREADS"] == "4"
    _, env = ds(LaunchSpec("r.json", accelerator="cpu"), python, {"DS_ACCELERATOR": "cuda"}, detect=no_detect)
    assert env["DS_ACCELERATOR"] == "cpu"


def test_cuda_visible_devices_become_include(python):
    base = {"CUDA_VISIBLE_DEVICES": "4, 5,6"}
    argv, _ = ds(LaunchSpec("r.json", nproc=2), python, base, detect=cuda)
    assert "--num_gpus" not in argv
    assert argv[argv.index("--include") + 1] == "localhost:4,5"
    with pytest.raises(ValueError, match="exposes only 3"):
        ds(LaunchSpec("r.json", nproc=4), python, base, detect=cuda)
    with pytest.raises(ValueError, match="numeric"):
        ds(LaunchSpec("r.json"), python, {"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}, detect=cuda)
    argv, _ = ds(LaunchSpec("r.json", nproc=2), python, base, detect=cpu)  # CPU ignores it
    assert argv[1:3] == ["--num_gpus", "2"]


def test_gpu_uuids_become_the_indices_nvidia_smi_gives(python, monkeypatch, tmp_path):
    """DeepSpeed's launcher takes numeric ids only; UUIDs (whole, or unique prefixes as CUDA accepts)
    are translated through nvidia-smi; MIG or unknown ids are refused with one line."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1\" = --query-gpu=index,uuid ] || exit 3\n"
                   "echo '0, GPU-aaaa1111-0000'\necho '1, GPU-bbbb2222-0000'\necho '2, GPU-bbbb3333-0000'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert launcher.nvidia_smi_uuids() == {"GPU-aaaa1111-0000": 0, "GPU-bbbb2222-0000": 1, "GPU-bbbb3333-0000": 2}
    visible = {"CUDA_VISIBLE_DEVICES": "GPU-bbbb3333-0000,GPU-aaaa"}
    argv, _ = ds(LaunchSpec("r.json", nproc=2), python, visible, detect=cuda)
    assert argv[argv.index("--include") + 1] == "localhost:2,0"
    for bad in ("GPU-bbbb", "MIG-aaaa1111-0000/1/0", "GPU-cccc"):  # ambiguous prefix, MIG, unknown
        with pytest.raises(ValueError, match="numeric device ids only"):
            ds(LaunchSpec("r.json"), python, {"CUDA_VISIBLE_DEVICES": bad}, detect=cuda)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert launcher.nvidia_smi_uuids() == {}


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "thisbox"])
def test_single_local_host_hostfile_runs_locally(tmp_path, python, host):
    hf = hostfile(tmp_path, f"# one box\n{host} slots=2\n")
    argv, env = ds(LaunchSpec("r.json", hostfile=hf, master_addr="10.0.0.9"), python)
    assert "--hostfile" not in argv and "--master_addr" not in argv and "--force_multi" not in argv
    assert argv[1:5] == ["--num_gpus", "2", "--master_port", "29500"]
    assert env["OMP_NUM_THREADS"] == "2"


def test_local_hostfile_nproc_caps_slots(tmp_path, python):
    hf = hostfile(tmp_path, "localhost slots=4\n")
    argv, env = ds(LaunchSpec("r.json", hostfile=hf, nproc=2), python)
    assert argv[1:3] == ["--num_gpus", "2"] and env["OMP_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="exceeds the slots"):
        ds(LaunchSpec("r.json", hostfile=hf, nproc=8), python)


def test_local_hostfile_include_renamed_to_localhost(tmp_path, python):
    hf = hostfile(tmp_path, "thisbox slots=4\n")
    argv, env = ds(LaunchSpec("r.json", hostfile=hf, include="thisbox:1,3"), python)
    assert argv[argv.index("--include") + 1] == "localhost:1,3"
    assert "--num_gpus" not in argv and "--hostfile" not in argv
    assert env["LOCAL_SIZE"] == "4"  # DeepSpeed's CPU device count = the pool, not NUMA nodes
    assert env["OMP_NUM_THREADS"] == "2"  # 4 cpus / 2 included slots
    argv, env = ds(LaunchSpec("r.json", hostfile=hf, exclude="thisbox:0"), python)
    assert argv[argv.index("--exclude") + 1] == "localhost:0"
    assert env["OMP_NUM_THREADS"] == "1"  # 3 processes


def test_include_exclude_without_hostfile(python):
    argv, env = ds(LaunchSpec("r.json", include="localhost:0,2"), python, detect=cuda)
    assert argv[1:] == ["--master_port", "29500", "--include", "localhost:0,2", *tail(), "r.json"]
    assert env == {}
    argv, env = ds(LaunchSpec("r.json", exclude="localhost:1"), python)
    assert argv[argv.index("--exclude") + 1] == "localhost:1"
    assert env["LOCAL_SIZE"] == "1"


def test_multi_host_hostfile(tmp_path, python):
    hf = hostfile(tmp_path, "thisbox slots=4\nworker-1 slots=4  # second\n\n")
    argv, env = ds(LaunchSpec("r.json", OVERRIDES, hostfile=hf, master_addr="10.0.0.1", master_port=2222), python)
    assert argv[1:] == ["--hostfile", hf, "--force_multi", "--master_port", "2222", "--master_addr", "10.0.0.1",
                        *tail(), "r.json", *OVERRIDES]
    assert env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"] == "1"
    argv, _ = ds(LaunchSpec("r.json", hostfile=hf, nproc=2, num_nodes=2), python)
    assert argv[1:8] == ["--hostfile", hf, "--num_nodes", "2", "--num_gpus", "2", "--force_multi"]
    with pytest.raises(ValueError, match="lists only 2"):
        ds(LaunchSpec("r.json", hostfile=hf, num_nodes=3), python)
    with pytest.raises(ValueError, match="worker-1"):
        ds(LaunchSpec("r.json", hostfile=hf, nproc=5), python)


def test_num_nodes_one_keeps_first_host(tmp_path, python):
    local_first = hostfile(tmp_path, "localhost slots=2\nworker-1 slots=2\n", "a")
    argv, _ = ds(LaunchSpec("r.json", hostfile=local_first, num_nodes=1), python)
    assert "--hostfile" not in argv and argv[1:3] == ["--num_gpus", "2"]
    remote_only = hostfile(tmp_path, "worker-7 slots=2\n", "b")
    argv, _ = ds(LaunchSpec("r.json", hostfile=remote_only), python)
    assert argv[1:4] == ["--hostfile", remote_only, "--force_multi"]


def test_num_nodes_without_hostfile_rejected(python):
    with pytest.raises(ValueError, match="needs a hostfile"):
        ds(LaunchSpec("r.json", num_nodes=2), python)


def test_deepspeed_env_file_lists_what_deepspeed_drops():
    delta = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2", "PYTHONPATH": "x", "NCCL_DEBUG": "INFO"}
    assert deepspeed_env_file(delta) == "DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=2\nNCCL_DEBUG=INFO\n"
    assert deepspeed_env_file(delta, "cuda") == "DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=2\n"
    assert deepspeed_env_file({"A": "two\nlines", "B": "1"}) == "B=1\n"  # the format has no room for it


def test_rank_env_keeps_what_ranks_on_other_hosts_need():
    shell = {"GLOO_SOCKET_IFNAME": "eth1", "TP_SOCKET_IFNAME": "eth1", "TORCH_EXTENSIONS_DIR": "/x",
             "DSTRAIN_FAULT_RANK": "1", "HF_HOME": "/hf", "OMP_NUM_THREADS": "4", "DS_ACCELERATOR": "cpu",
             "HOME": "/root", "PATH": "/bin", "SSH_AUTH_SOCK": "/s", "PYTHONPATH": "/src"}
    kept = launcher.rank_env(shell)
    assert set(kept) == {"GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "TORCH_EXTENSIONS_DIR", "DSTRAIN_FAULT_RANK",
                         "HF_HOME", "OMP_NUM_THREADS", "DS_ACCELERATOR", "PATH"}
    assert launcher.deepspeed_forwarded(shell) == ["PYTHONPATH"]


# --------------------------------------------------------------------------- DeepSpeed's own parser


@pytest.fixture(scope="module")
def ds_runner():
    return pytest.importorskip("deepspeed.launcher.runner")


def test_deepspeed_parser_accepts_local_argv(ds_runner, python):
    argv, _ = ds(LaunchSpec("r.json", OVERRIDES, nproc=2, master_port=4321), python)
    args = ds_runner.parse_args(argv[1:])
    assert (args.num_gpus, args.master_port, args.module, args.no_local_rank) == (2, 4321, True, True)
    assert args.user_script == "dstrain.cli"
    assert args.user_args == ["train", "r.json", *OVERRIDES]
    assert (args.include, args.exclude, args.num_nodes, args.force_multi) == ("", "", -1, False)


def test_deepspeed_parser_accepts_multi_host_argv(ds_runner, tmp_path, python):
    hf = hostfile(tmp_path, "worker-0 slots=8\nworker-1 slots=8\n")
    argv, _ = ds(LaunchSpec("r.json", ("--a.b=1",), hostfile=hf, num_nodes=2, nproc=4, master_addr="10.1.1.1"),
                 python, detect=cuda)
    args = ds_runner.parse_args(argv[1:])
    assert (args.hostfile, args.num_nodes, args.num_gpus, args.master_addr) == (hf, 2, 4, "10.1.1.1")
    assert args.force_multi and args.module and args.no_local_rank
    assert (args.user_script, args.user_args) == ("dstrain.cli", ["train", "r.json", "--a.b=1"])
    # DeepSpeed's own hostfile reader agrees with ours.
    assert list(ds_runner.fetch_hostfile(hf).items()) == parse_hostfile(hf)


def test_deepspeed_parser_accepts_include(ds_runner, python):
    argv, _ = ds(LaunchSpec("r.json", include="localhost:0,1"), python, detect=cuda)
    args = ds_runner.parse_args(argv[1:])
    assert (args.include, args.num_gpus, args.user_script) == ("localhost:0,1", -1, "dstrain.cli")


# --------------------------------------------------------------------------- torchrun


def tr(spec, python="py", base_env=None, cpu_count=4, detect=cpu):
    return build_torchrun_command(spec, python, {} if base_env is None else base_env, cpu_count,
                                  detect=detect, local_hosts=LOCAL)


def test_torchrun_single_node():
    base = {"A": "1"}
    argv, env = tr(LaunchSpec("r.json", OVERRIDES, nproc=2, master_port=5555), base_env=base)
    assert argv == ["py", "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", "5555",
                    "-m", "dstrain.cli", "train", "r.json", *OVERRIDES]
    assert env == {"A": "1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2"} and base == {"A": "1"}
    _, env = tr(LaunchSpec("r.json", nproc=2), detect=cuda)
    assert env == {}


def test_torchrun_multi_node():
    argv, _ = tr(LaunchSpec("r.json", nproc=8, num_nodes=2, master_addr="n0", master_port=6000), detect=cuda)
    assert argv[3:13] == ["--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", "n0:6000", "--rdzv-id", "dstrain"]
    with pytest.raises(ValueError, match="master_addr"):
        tr(LaunchSpec("r.json", num_nodes=2))


def test_torchrun_hostfile(tmp_path):
    hf = hostfile(tmp_path, "thisbox slots=4\nworker-1 slots=4\n")
    argv, env = tr(LaunchSpec("r.json", hostfile=hf))
    assert argv[3:7] == ["--nnodes", "2", "--nproc-per-node", "4"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "thisbox:29500"
    assert env["OMP_NUM_THREADS"] == "1"
    argv, _ = tr(LaunchSpec("r.json", hostfile=hf, num_nodes=1))
    assert argv[argv.index("--master-addr") + 1] == "127.0.0.1"
    uneven = hostfile(tmp_path, "a slots=4\nb slots=2\n", "uneven")
    with pytest.raises(ValueError, match="same slots"):
        tr(LaunchSpec("r.json", hostfile=uneven))
    argv, _ = tr(LaunchSpec("r.json", hostfile=uneven, nproc=2))
    assert argv[6] == "2"


def test_torchrun_rejects_include():
    with pytest.raises(ValueError, match="torchrun"):
        tr(LaunchSpec("r.json", include="localhost:0"))


def test_torch_parser_accepts_torchrun_argv():
    run = pytest.importorskip("torch.distributed.run")
    argv, _ = tr(LaunchSpec("r.json", OVERRIDES, nproc=2, master_port=5555))
    args = run.get_args_parser().parse_args(argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.master_addr, args.master_port) == ("1", "2", "127.0.0.1", 5555)
    assert args.module and args.training_script == "dstrain.cli"
    assert args.training_script_args == ["train", "r.json", *OVERRIDES]
    argv, _ = tr(LaunchSpec("r.json", nproc=2, num_nodes=3, master_addr="h0", local_addr="10.1.1.2"))
    args = run.get_args_parser().parse_args(argv[3:])
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint) == ("3", "c10d", "h0:29500")
    assert args.local_addr == "10.1.1.2"


def test_local_addr_is_torchrun_only(tmp_path, python):
    argv, _ = tr(LaunchSpec("r.json", num_nodes=2, master_addr="10.0.0.1", local_addr="10.0.0.2"))
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.2"
    assert "--local-addr" not in tr(LaunchSpec("r.json", num_nodes=2, master_addr="10.0.0.1"))[0]
    with pytest.raises(ValueError, match="local_addr .* is a torchrun option"):
        ds(LaunchSpec("r.json", local_addr="10.0.0.2"), python)


# --------------------------------------------------------------------------- SLURM (tests in test_slurm.py)


def test_slurm_names_still_importable_from_launcher():
    from dstrain import slurm
    from dstrain.launcher import build_srun_command, env_from_slurm, expand_nodelist

    assert (build_srun_command, env_from_slurm, expand_nodelist) == (
        slurm.build_srun_command, slurm.env_from_slurm, slurm.expand_nodelist)
    with pytest.raises(AttributeError):
        launcher.no_such_name


# --------------------------------------------------------------------------- hostfile, spec, misc


def test_parse_hostfile_good(tmp_path):
    hf = hostfile(tmp_path, "# cluster\n\nworker-0 slots=8\n  worker-1   slots=4   # half\n#worker-2 slots=1\n"
                            "worker-3 slots=2 max_slots=2\n")
    assert parse_hostfile(hf) == [("worker-0", 8), ("worker-1", 4), ("worker-3", 2)]


@pytest.mark.parametrize("text,match", [
    ("a slots=2\nb slot=2\n", r"hostfile:2: expected 'hostname slots=N'"),
    ("a slots=2\n\na slots=4\n", r"hostfile:3: host 'a' already listed on line 1"),
    ("a slots=0\n", r"hostfile:1: .*slots=0"),
    ("a\n", r"hostfile:1:"),
    ("a slots=2 extra\n", r"hostfile:1:"),
    ("a slots=2x\n", r"hostfile:1:"),
    ("# only comments\n\n", "no hosts"),
])
def test_parse_hostfile_bad(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        parse_hostfile(hostfile(tmp_path, text))


@pytest.mark.parametrize("kwargs,match", [
    ({"nproc": 0}, "nproc"),
    ({"nproc": True}, "nproc"),
    ({"master_port": 0}, "master_port"),
    ({"master_port": 70000}, "master_port"),
    ({"include": "a", "exclude": "b"}, "mutually exclusive"),
    ({"include": "a", "nproc": 2}, "include/exclude"),
    ({"exclude": "a", "num_nodes": 1}, "include/exclude"),
    ({"hostfile": "no/such/hostfile"}, "does not exist"),
    ({"num_nodes": 0}, "num_nodes"),
    ({"accelerator": "tpu"}, "accelerator"),
    ({"overrides": "--a=1"}, "overrides"),
    ({"recipe": ""}, "recipe"),
])
def test_validate_errors(kwargs, match):
    spec = LaunchSpec(**{"recipe": "r.json", **kwargs})
    with pytest.raises(ValueError, match=match):
        spec.validate()
    with pytest.raises(ValueError, match=match):
        build_torchrun_command(spec, "py", {}, 2, detect=cpu)


def test_validate_lists_all_problems_and_accepts_lists():
    with pytest.raises(ValueError) as err:
        LaunchSpec("r.json", nproc=0, master_port=-1).validate()
    assert "nproc" in str(err.value) and "master_port" in str(err.value)
    assert LaunchSpec("r.json", ["--a=1"]).overrides == ("--a=1",)


def test_format_command_round_trips():
    argv = ["deepspeed", "--num_gpus", "2", "train", "--model.name=gpt tiny", "--x='q'"]
    line = format_command(argv, {"OMP_NUM_THREADS": "2", "X": "a b"})
    assert line.startswith("OMP_NUM_THREADS=2 X='a b' deepspeed ")
    assert shlex.split(line) == ["OMP_NUM_THREADS=2", "X=a b", *argv]
    assert format_command(["a"], {}) == "a"


def test_find_free_port_is_bindable():
    port = find_free_port()
    assert 1 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_main_print(capsys, python, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(launcher, "detect_accelerator", cpu)
    monkeypatch.setattr(launcher.sys, "executable", python)
    assert launcher.main(["--print", "--nproc", "2", "--accelerator", "cpu", "r.json", "--a.b=1", "--c"]) == 0
    out = capsys.readouterr().out
    assert "DS_ACCELERATOR=cpu" in out and "--num_gpus 2" in out and out.rstrip().endswith("r.json --a.b=1 --c")
    with pytest.raises(SystemExit):
        launcher.main(["--print", "--include", "a", "--exclude", "b", "r.json"])


def test_main_checks_a_multi_host_hostfile_first(capsys, python, monkeypatch, tmp_path):
    from dstrain import hostfile as hf
    monkeypatch.setattr(launcher.sys, "executable", python)
    monkeypatch.setattr(hf, "resolve_host", lambda h: hf.Resolved(h, "10.0.0.7", "test") if h == "a" else None)
    path = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    with pytest.raises(SystemExit) as info:
        launcher.main(["--print", "--hostfile", path, "--accelerator", "cpu", "r.json"])
    assert info.value.code == 2 and f"hostfile {path}: host 'b' does not resolve" in capsys.readouterr().err
    monkeypatch.setattr(hf, "resolve_host", lambda h: hf.Resolved(h, {"a": "10.0.0.7", "b": "10.0.0.8"}[h], "test"))
    assert launcher.main(["--print", "--hostfile", path, "--accelerator", "cpu", "r.json"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[argv.index("--master_addr") + 1] == "10.0.0.7"


# --------------------------------------------------------------------------- launch/ scripts


@pytest.mark.parametrize("script", ["deepspeed.sh", "torchrun.sh", "slurm.sbatch"])
def test_launch_scripts_parse(script):
    path = REPO / "launch" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert "dstrain" in text


def test_slurm_script_header_and_srun():
    text = (REPO / "launch" / "slurm.sbatch").read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=" in text
    assert '-m dstrain.cli train "$RECIPE" ${args[@]+"${args[@]}"}' in text


def test_hostfile_example_parses():
    assert parse_hostfile(REPO / "launch" / "hostfile.example") == [("worker-0", 8), ("worker-1", 8)]
