"""Host-side collectives (counts, flags, rewards) go through dstrain.runtime, which moves them to the
GPU under NCCL: NCCL refuses CPU tensors, so a direct ``dist.all_reduce`` of a CPU tensor works on the
CPU (gloo) and fails on the first multi-GPU run."""
import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dstrain import runtime

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_group(monkeypatch):
    """A two-rank group whose collectives run here: all_reduce doubles (the other rank holds the same
    values), all_gather repeats; every tensor handed to a collective is recorded."""
    seen = []

    def all_reduce(t, op=dist.ReduceOp.SUM):
        seen.append(("all_reduce", t.device, op))
        if op == dist.ReduceOp.SUM:
            t.mul_(2)

    def all_gather(parts, t):
        seen.append(("all_gather", t.device, None))
        for p in parts:
            p.copy_(t)

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    return seen


def test_all_reduce_returns_a_new_tensor_and_leaves_the_input(fake_group):
    x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    out = runtime.all_reduce(x)
    assert out.tolist() == [2.0, 4.0] and x.tolist() == [1.0, 2.0]
    assert runtime.all_reduce(x, "max").tolist() == [1.0, 2.0]
    assert [op for _, _, op in fake_group] == [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
    with pytest.raises(ValueError, match="sum, max or min|one of"):
        runtime.all_reduce(x, "mean")


def test_all_gather_1d_concatenates_in_rank_order(fake_group):
    assert runtime.all_gather_1d(torch.tensor([3.0, 4.0])).tolist() == [3.0, 4.0, 3.0, 4.0]


def test_without_a_group_values_come_back_unchanged():
    x = torch.tensor([5.0])
    if not dist.is_initialized():
        assert runtime.all_reduce(x) is x and runtime.all_gather_1d(x) is x


def test_nccl_collectives_take_this_ranks_gpu(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert runtime.comm_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert runtime.comm_device() == torch.device("cpu")


def test_host_collective_callers_use_the_runtime_helpers(fake_group):
    """The trainers' and guards' reductions, run through the fake group: every tensor that reaches a
    collective is on runtime.comm_device() (the CPU here; the GPU under NCCL)."""
    from dstrain import metrics
    from dstrain.resilience import _first_bad_ranks
    from dstrain.trainers import grpo, grpo_sampling
    assert _first_bad_ranks([True, False], rank=1, world_size=2) == [1, None]
    assert metrics.reduce_mean({"a": 1.0, "b": 3.0}) == {"a": 1.0, "b": 3.0}
    assert grpo._sum_all(2.0) == 4.0 and grpo_sampling.sum_over_ranks([1.0, 2.0]) == [2.0, 4.0]
    assert grpo_sampling._max_all(1.0) == 1.0
    assert len(fake_group) == 5 and all(dev == runtime.comm_device() for _, dev, _ in fake_group)


# Modules whose direct collectives take tensors that already live on the model's device.
DEVICE_TENSOR_COLLECTIVES = {
    "dstrain/runtime.py",                # the helpers themselves
    "dstrain/parallel/sequence.py",      # activations and their gradients
    "dstrain/optim/sparse_sign_sgd.py",  # embedding gradients
    "dstrain/engine/grad_norm.py",       # tensor-parallel gradient norms
    "dstrain/bench_worker.py",           # timings built on world.device
}


def test_no_other_module_calls_tensor_collectives_directly():
    """A new ``dist.all_reduce`` / ``all_gather`` / ``reduce_scatter`` / ``broadcast`` on a host tensor
    would pass every CPU test and fail under NCCL: outside the modules above, use runtime.all_reduce /
    all_gather_1d (object collectives, which torch places itself, are fine)."""
    names = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "reduce", "all_to_all", "all_to_all_single"}
    offenders = []
    for path in sorted((ROOT / "dstrain").rglob("*.py")) + sorted((ROOT / "models").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"
                    and rel not in DEVICE_TENSOR_COLLECTIVES):
                offenders.append(f"{rel}:{node.lineno} dist.{node.func.attr}")
    assert not offenders, offenders


def test_a_stop_signal_rides_the_guards_per_step_all_reduce(fake_group, monkeypatch):
    """Rank 0 got no signal, rank 1 did: rank 0 learns the stop from the guard's one all-reduce of the step,
    whose tensor is on runtime.comm_device() (this rank's GPU under NCCL), not a separate collective."""
    from dstrain import resilience
    other_rank = torch.tensor([2, 2, 1])  # rank 1: finite loss and gradients, stop requested

    def all_reduce(t, op=dist.ReduceOp.SUM):
        fake_group.append(("all_reduce", t.device, op))
        assert op == dist.ReduceOp.MIN
        t.copy_(torch.minimum(t, other_rank.to(t.device)))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(resilience, "STOP_REQUESTED", [False])
    guard = resilience.NonFiniteGuard("stop", 3, rank=0, world_size=2)
    assert guard.check([torch.tensor(1.0)], step=5) is False and guard.stop_agreed
    assert [(kind, dev) for kind, dev, _ in fake_group] == [("all_reduce", runtime.comm_device())]
