"""GPU ranks that each see only their own GPU (``srun --gpus-per-task=1``, ``--gpu-bind=single:1``, a site prolog
or a container runtime setting CUDA_VISIBLE_DEVICES per task) while LOCAL_RANK runs 0..tasks_per_node-1: the rank
runs on cuda:0, LOCAL_RANK stays as it is, and DeepSpeed's own uses of LOCAL_RANK as a device follow. No GPU here:
torch.cuda is monkeypatched (device_count, set_device recorded) and the SLURM environment is made up."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dstrain import runtime
from dstrain.config import ConfigError, LaunchError


def _slurm_env(localid: int, visible: str) -> dict:
    """Task ``localid`` of 4 on one node, as srun gives it (no RANK / LOCAL_RANK: dstrain maps SLURM's)."""
    return {"SLURM_PROCID": str(localid), "SLURM_LOCALID": str(localid), "SLURM_NTASKS": "4", "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "77",
            "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": visible, "PATH": runtime.os.environ.get("PATH", "")}


@pytest.fixture
def fake_gpus(monkeypatch):
    """Pretend CUDA ranks: ``set(count)`` GPUs visible; ``calls`` records torch.cuda.set_device; DeepSpeed's
    accelerator is its real CUDA one; the process group start is recorded, not run."""
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch.distributed as dist
    from deepspeed.accelerator import real_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator
    state = SimpleNamespace(calls=[], count=1, started={}, acc=CUDA_Accelerator(), rank=0, error=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state.count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state.calls.append(d))
    monkeypatch.setattr(real_accelerator, "ds_accelerator", state.acc)

    def start(**kw):
        if state.error:
            raise state.error
        state.started.update(pg=kw)
    monkeypatch.setattr(deepspeed, "init_distributed", start)
    monkeypatch.setattr(dist, "is_initialized", lambda: "pg" in state.started)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: state.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    monkeypatch.setattr(ds_comm, "get_rank", lambda *a, **k: state.rank)
    monkeypatch.setattr(ds_comm, "get_world_size", lambda *a, **k: 4)

    def use(env: dict, count: int) -> None:
        state.count, state.rank = count, int(env["SLURM_PROCID"])
        monkeypatch.setattr(runtime.os, "environ", dict(env))
    state.use = use
    return state


def test_srun_task_that_sees_its_own_gpu_runs_on_it(fake_gpus):
    """srun --gpus-per-task=1: task 3 of a node sees one GPU (CUDA_VISIBLE_DEVICES=3). Before: set_device(3),
    "invalid device ordinal" on every task but local rank 0."""
    fake_gpus.use(_slurm_env(3, "3"), count=1)
    world = runtime.init_distributed()
    assert fake_gpus.calls == [0] and world.device == torch.device("cuda", 0)
    assert world.local_rank == 3 and runtime.os.environ["LOCAL_RANK"] == "3"  # LOCAL_RANK itself unchanged
    acc = fake_gpus.acc  # DeepSpeed's accelerator, through which its own code turns LOCAL_RANK into a device
    local = runtime.os.environ["LOCAL_RANK"]
    # zero.Init and ZeRO-3's trace checks (zero/utils.py): device_name(os.environ["LOCAL_RANK"])
    assert torch.device(acc.device_name(local)) == torch.device("cuda", 0)
    # PipelineModule: device_name(int LOCAL_RANK); inference engines: set_device(LOCAL_RANK)
    assert acc.device_name(3) == "cuda:0" and acc.device_name() == "cuda" and acc.device_name(0) == "cuda:0"
    acc.set_device(int(local))
    acc.set_device(torch.device("cuda", 3))
    assert fake_gpus.calls[1:] == [0, torch.device("cuda", 0)]
    # DeepSpeed's engine (_set_distributed_vars: args.device_rank if given, else LOCAL_RANK)
    from deepspeed.runtime.engine import DeepSpeedEngine
    engine = SimpleNamespace(local_rank=int(local))
    DeepSpeedEngine._set_distributed_vars(engine, None)
    assert engine.device == torch.device("cuda", 0) and fake_gpus.calls[-1] == 0
    # deepspeed.comm's start of the group binds device_id = device(LOCAL_RANK)
    import torch.distributed as dist
    from deepspeed.comm.torch import TorchBackend
    seen = {}

    def start_group(backend, device_id=None, **kw):  # (DeepSpeed passes device_id where the signature has it)
        seen.update(kw, device_id=device_id)
    backend = TorchBackend.__new__(TorchBackend)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "is_initialized", lambda: False)
        mp.setattr(dist, "init_process_group", start_group)
        mp.setattr(dist, "get_backend", lambda *a: "nccl")
        backend.init_process_group("nccl", None, None, 3, 4)
    assert seen.get("device_id") == torch.device("cuda", 0)


def test_rank_that_sees_every_gpu_keeps_cuda_local_rank(fake_gpus):
    """The node's 4 GPUs visible: cuda:LOCAL_RANK, as before, and DeepSpeed's accelerator left as it is;
    then the one-visible case on the same accelerator object maps only LOCAL_RANK."""
    fake_gpus.use(_slurm_env(2, "0,1,2,3"), count=4)
    world = runtime.init_distributed()
    assert fake_gpus.calls == [2] and world.device == torch.device("cuda", 2)
    assert fake_gpus.acc.device_name("2") == "cuda:2" and not hasattr(fake_gpus.acc, "dstrain_bound")
    fake_gpus.started.clear()
    fake_gpus.use(_slurm_env(1, "1"), count=1)
    assert runtime.init_distributed().device == torch.device("cuda", 0)
    assert fake_gpus.acc.dstrain_bound == (1, 0) and fake_gpus.acc.device_name(2) == "cuda:2"
    fake_gpus.started.clear()  # started again seeing every GPU: the binding is undone
    fake_gpus.use(_slurm_env(1, "0,1,2,3"), count=4)
    assert runtime.init_distributed().device == torch.device("cuda", 1) and fake_gpus.acc.device_name(1) == "cuda:1"


def test_local_rank_past_several_visible_gpus_is_refused_in_one_line(fake_gpus):
    """Two GPUs visible to task 3 (--gpus-per-task=2 with 4 tasks a node, or a wrong CUDA_VISIBLE_DEVICES): it is
    none of them; refused before any device is set, naming CUDA_VISIBLE_DEVICES and the fix."""
    fake_gpus.use(_slurm_env(3, "6,7"), count=2)
    with pytest.raises(LaunchError) as info:
        runtime.init_distributed()
    text = str(info.value)
    assert "\n" not in text and fake_gpus.calls == [] and "pg" not in fake_gpus.started
    assert text.startswith("LOCAL_RANK=3 but this rank sees 2 GPU(s) (CUDA_VISIBLE_DEVICES='6,7')")
    assert "--gpus-per-task=1" in text and "unset CUDA_VISIBLE_DEVICES" in text


def test_readiness_check_allows_a_rank_with_its_own_gpu():
    """check_given_rank_env (dstrain train, before WORLD_SIZE is read): one GPU seen is the rank's own whatever its
    LOCAL_RANK; past several is still refused, in one line with the fix."""
    runtime.check_given_rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                                  "CUDA_VISIBLE_DEVICES": "3"}, gpus=1)
    runtime.check_given_rank_env({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, gpus=2)
    with pytest.raises(LaunchError) as info:
        runtime.check_given_rank_env({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4", "CUDA_VISIBLE_DEVICES": "0,1"},
                                     gpus=2)
    assert "CUDA_VISIBLE_DEVICES='0,1'" in str(info.value) and "--gpu-bind=single:1" in str(info.value)


def test_two_ranks_given_the_same_single_gpu_are_named(fake_gpus):
    """torchrun --nproc 2 under CUDA_VISIBLE_DEVICES=0 (bypassing dstrain launch's count): both ranks take their one
    GPU, the same; NCCL's "Duplicate GPU detected" becomes one line naming CUDA_VISIBLE_DEVICES."""
    fake_gpus.use(_slurm_env(1, "0"), count=1)
    fake_gpus.error = RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, invalid usage, NCCL version 2.27.3\n"
                                   "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
                                   "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000")
    with pytest.raises(LaunchError) as info:
        runtime.init_distributed()
    text = str(info.value)
    assert "\n" not in text and text.startswith("two ranks of this node run on the same GPU "
                                                "(CUDA_VISIBLE_DEVICES='0' here, LOCAL_RANK=1)")


def test_score_placement_on_a_rank_with_its_own_gpu():
    """SCoRe's placement where each rank sees one GPU: models go on cuda:0 (its GPU, not cuda:LOCAL_RANK); another
    GPU is refused saying why (before: "4 rank(s) per node on 1 GPU(s)", as if the ranks shared one)."""
    from pathlib import Path

    from dstrain import trainers
    from dstrain.config import load_run_config
    from dstrain.trainers import score_models as sc
    recipe = Path(__file__).resolve().parents[2] / "models" / "policy" / "recipes" / "score_debug.json"
    cfg = load_run_config(recipe)
    p = sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=1, local_ranks=4)
    world = runtime.World(3, 4, 3, 4, torch.device("cuda", 0))
    assert {sc.torch_device(p.role(r).device, world) for r in sc.pl.ROLES if p.role(r).device != "cpu"} == \
        {torch.device("cuda", 0)}
    cfg = load_run_config(recipe, ["--placement.reference.device=cuda:1"])
    with pytest.raises(ConfigError, match=r"cuda:1 but each rank sees one GPU here, its own \(CUDA_VISIBLE_DEVICES"):
        sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=1, local_ranks=4)


def test_colocated_vllm_starts_on_the_ranks_own_gpu(monkeypatch, tmp_path):
    """rollout.generator=vllm on 4 ranks: vLLM's external launcher reads LOCAL_RANK as its device (cuda:LOCAL_RANK).
    A rank that sees one GPU shows it LOCAL_RANK=0 while vLLM starts, and LOCAL_RANK=3 again after."""
    import sys
    import types

    from dstrain.rl import vllm_generation as vg
    seen = []

    class LLM:
        def __init__(self, model, **kw):
            seen.append((runtime.os.environ.get("LOCAL_RANK"), kw.get("distributed_executor_backend")))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=LLM))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    base = SimpleNamespace(save_pretrained=lambda model, folder: None)
    policy = torch.nn.Linear(2, 2)
    for device, shown in ((torch.device("cuda", 0), "0"), (torch.device("cuda", 3), "3")):
        tr = SimpleNamespace(out=tmp_path, policy=policy, model_cfg=SimpleNamespace(path=""), engine=policy,
                             world=SimpleNamespace(rank=3, world_size=4, local_rank=3, device=device),
                             cfg=SimpleNamespace(train=SimpleNamespace(seed=7)))
        vg.VLLMToolkit(base, tr, SimpleNamespace(vllm_gpu_memory_utilization=0.3))
        assert seen.pop() == (shown, "external_launcher") and runtime.os.environ["LOCAL_RANK"] == "3"


def test_every_accelerator_method_taking_a_device_index_maps_local_rank(monkeypatch):
    """Task 3 that sees one GPU: a call passing LOCAL_RANK to any of the accelerator's device_index methods
    (memory_allocated, synchronize, current_stream, set_rng_state's second argument...) reaches cuda:0, as
    device_name / device / set_device do; other indexes and no index pass unchanged. Before: only those three were
    mapped, and torch.cuda.memory_allocated(3) met "invalid device ordinal"."""
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from dstrain.gpu_binding import bind_accelerator
    seen = []
    for name in ("memory_allocated", "synchronize", "current_stream", "set_rng_state", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: seen.append((_n, a[-1] if a else None)))
    acc = CUDA_Accelerator()
    assert bind_accelerator(acc, 3, 0)
    acc.memory_allocated(3)
    acc.synchronize(device_index="3")
    acc.current_stream(torch.device("cuda", 3))
    acc.set_rng_state("state", 3)
    acc.max_memory_allocated()
    acc.memory_allocated(0)
    assert seen == [("memory_allocated", 0), ("synchronize", 0), ("current_stream", torch.device("cuda", 0)),
                    ("set_rng_state", 0), ("max_memory_allocated", None), ("memory_allocated", 0)]
    assert acc.device_name(3) == "cuda:0" and acc.device(3) == torch.device("cuda", 0)
    assert not bind_accelerator(acc, 0, 0) and "memory_allocated" not in acc.__dict__  # undone where they agree
