"""Newcomer audit, round 8: a first user on a machine with one GPU (H100/H200), README's GPU commands read along
the path they take when CUDA is visible, checked here with torch.cuda patched (no GPU needed; the same tests pass
with one).

Found and fixed (what a first user typed; what happened before):

* ``CUDA_VISIBLE_DEVICES=1 dstrain launch --nproc 1 models/gpt/recipes/tiny.json`` on a one-GPU machine (a device
  it lacks; likewise ``CUDA_VISIBLE_DEVICES=`` or a CPU build of torch beside the NVIDIA driver): torch saw no GPU,
  so the launch silently trained on CPU ranks with gloo; the only trace was ``DS_ACCELERATOR=cpu`` in the printed
  command. Now one note line says no GPU is visible to torch, why, and that the ranks run on CPU;
  ``dstrain plan`` says the same before planning for the CPU.
* ``dstrain launch --nproc 1 RECIPE`` with GPU ranks and a torch built without NCCL: the launch went ahead and
  every rank stopped in ``init_process_group("nccl")`` with torch's traceback. Now refused before any rank starts,
  in one line naming the way out.
* ``CUDA_VISIBLE_DEVICES=MIG-<uuid> dstrain launch --nproc 1 RECIPE`` (a MIG slice): refused, rightly (DeepSpeed's
  launcher takes numeric ids), but the line said "launch with torchrun" without saying how; now it names
  ``dstrain launch --launcher torchrun``, which keeps the variable as set (pinned below).
"""
import pytest
import torch

from dstrain import cli, cli_checks, launch_check, launcher

RECIPE = "models/gpt/recipes/tiny.json"


@pytest.fixture
def no_gpu_seen(monkeypatch):
    """A GPU machine (the driver reports one GPU) whose GPU torch cannot open; DS_ACCELERATOR left to detection."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(launch_check, "nvidia_gpus_here", lambda: 1)
    monkeypatch.setattr(cli_checks, "check_before_launch", lambda cfg, args, accelerator: None)  # (the plan: slow)


def test_a_cuda_visible_devices_naming_a_missing_gpu_is_said_before_cpu_ranks_start(no_gpu_seen, monkeypatch,
                                                                                        tmp_path, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    rc = cli.main(["launch", "--dry-run", "--nproc", "1", RECIPE, f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 0
    notes = [line for line in err.splitlines() if "no GPU visible to torch" in line]
    assert notes == ["dstrain: note: no GPU visible to torch: CUDA_VISIBLE_DEVICES='1' names no device torch can "
                     "open; the driver reports 1 GPU(s) here; the ranks run on CPU with gloo (--accelerator cpu "
                     "to mean it)"], err


@pytest.mark.parametrize("env, build, gpus, reason", [
    ({"CUDA_VISIBLE_DEVICES": ""}, "13.0", 1, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, None, 0, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
    ({}, None, 2, "is a CPU build; the driver reports 2 GPU(s) here (install torch's CUDA build"),
    ({}, "13.0", 1, "torch (CUDA 13.0) cannot open the GPU(s) the driver reports"),
])
def test_why_no_gpu_is_seen_names_the_cause(env, build, gpus, reason):
    note = launch_check.cpu_fallback_note("auto", env, gpus_here=gpus, cuda_available=False, torch_cuda=build)
    assert note is not None and reason in note and "\n" not in note


@pytest.mark.parametrize("accelerator, env, gpus, available", [
    ("auto", {}, 0, False),                                     # a plain CPU machine (CI): nothing to say
    ("cpu", {"CUDA_VISIBLE_DEVICES": "0"}, 1, False),           # CPU ranks asked for
    ("auto", {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "0"}, 1, False),  # as the 2-rank tests run on a GPU
    ("auto", {"CUDA_VISIBLE_DEVICES": "0"}, 1, True),           # the GPU is seen
])
def test_no_note_where_cpu_ranks_are_meant_or_a_gpu_is_seen(accelerator, env, gpus, available):
    assert launch_check.cpu_fallback_note(accelerator, env, gpus_here=gpus, cuda_available=available,
                                          torch_cuda="13.0") is None


def test_dstrain_plan_says_it_plans_for_the_cpu_when_the_gpu_is_hidden(monkeypatch, capsys):
    """``CUDA_VISIBLE_DEVICES= dstrain plan RECIPE`` on a GPU machine: the plan was the CPU's, unannounced."""
    import dstrain.engine.factory as factory

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch_check, "nvidia_gpus_here", lambda: 1)
    seen = []

    def plan_engine(cfg, world, ranks_per_node, device_type):
        seen.append(device_type)
        raise SystemExit(0)  # (the note comes before the plan; the plan itself is tested elsewhere)

    monkeypatch.setattr(factory, "plan_engine", plan_engine)
    with pytest.raises(SystemExit):
        cli.main(["plan", RECIPE])
    err = capsys.readouterr().err
    assert seen == ["cpu"]
    assert ("dstrain: note: no GPU visible to torch: CUDA_VISIBLE_DEVICES='' hides every GPU; planning for this "
            "CPU (--device cuda plans for a GPU)") in err.splitlines(), err


def test_gpu_ranks_without_nccl_are_refused_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU here
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    monkeypatch.setattr(cli_checks, "check_before_launch", lambda cfg, args, accelerator: None)
    rc = cli.main(["launch", "--dry-run", "--nproc", "1", RECIPE, f"--output.dir={tmp_path / 'run'}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dstrain: error")]
    assert rc == cli.EXIT_CONFIG
    assert len(err) == 1 and "has no NCCL" in err[0] and "--accelerator cpu" in err[0], err
    assert launch_check.nccl_problem("cpu", False, nccl_available=False) is None  # gloo ranks need none


def test_a_mig_slice_is_pointed_to_the_torchrun_launcher_which_keeps_it(monkeypatch):
    mig = "MIG-0d1e2f3a-1111-2222-3333-444455556666"
    monkeypatch.setattr(launcher, "nvidia_smi_uuids", lambda: {"GPU-aaaa": 0})  # nvidia-smi lists GPUs, not slices
    spec = launcher.LaunchSpec(recipe=RECIPE, nproc=1, accelerator="cuda")
    with pytest.raises(ValueError) as err:
        launcher.build_deepspeed_command(spec, base_env={"CUDA_VISIBLE_DEVICES": mig})
    assert "dstrain launch --launcher torchrun" in str(err.value)
    _, env = launcher.build_torchrun_command(spec, base_env={"CUDA_VISIBLE_DEVICES": mig})
    assert env["CUDA_VISIBLE_DEVICES"] == mig


def test_a_sequence_parallel_recipe_on_one_gpu_names_the_flag_that_fits_it():
    """``dstrain launch --nproc 1 models/dilated_lm/recipes/debug.json`` (README's model table; one GPU): "world
    size 1 is not divisible by tp x sp = 1 x 2 = 2; use a world size that is a multiple of 2", and 2 ranks are
    refused on one GPU. Now the line also names ``--parallel.sp=1``, with which the recipe plans on one rank."""
    from dstrain.parallel.dims import ParallelDims

    with pytest.raises(ValueError) as err:
        ParallelDims.from_world(1, tp=1, sp=2)
    assert str(err.value).endswith("multiple of 2, or drop that parallelism (--parallel.sp=1)")
    with pytest.raises(ValueError) as err:
        ParallelDims.from_world(3, tp=2, sp=1, pp=2)
    assert "(--parallel.tp=2" not in str(err.value) and "(--parallel.tp=1 --parallel.pp=1)" in str(err.value)
    assert ParallelDims.from_world(1, tp=1, sp=1).world_size == 1
