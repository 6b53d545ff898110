"""CPU ranks on a machine that also has a GPU (``DS_ACCELERATOR=cpu`` with CUDA visible, as every 2-rank test
runs on a GPU test machine): the MFU reference is this CPU's measured matmul, and the peak memory is the
process's RSS, not the GPU's datasheet or the allocator of a CUDA context that holds none of the run's tensors
(``peak_flops`` asking for the device name opened one, so the benchmark reported 0 bytes); checkpoints keep no
CUDA generator (reading it opened a context on GPU 0 in every rank), and ``dstrain plan`` plans for the CPU."""
from pathlib import Path

import pytest
import torch

from dstrain import metrics
from dstrain.engine import hardware
from dstrain.engine.hardware import MatmulRate


@pytest.fixture
def gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(hardware, "matmul_rate", lambda dtype, size, **kw: MatmulRate("float32", size, 9e10))


def test_cpu_ranks_measure_the_cpu(gpu_visible, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert hardware.peak_flops("fp32") == (9e10, "measured 1024^3 float32 matmul on this CPU")
    assert metrics.peak_memory_bytes() > 10 * 2**20  # this process's RSS


def test_gpu_ranks_use_the_datasheet_and_the_allocator(gpu_visible, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert hardware.peak_flops("fp32") == (67e12, "NVIDIA H100 80GB HBM3 fp32 datasheet peak")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 12345)
    assert metrics.peak_memory_bytes() == 12345


def test_cpu_ranks_keep_no_cuda_generator(gpu_visible, monkeypatch):
    from dstrain import checkpoint

    def no_cuda(*a, **k):
        raise AssertionError("a CPU rank opened the GPU's generator")
    monkeypatch.setattr(torch.cuda, "get_rng_state", no_cuda)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_cuda)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    state = checkpoint.rng_state()
    assert "cuda_device" not in state
    checkpoint.set_rng_state({**state, "cuda_device": torch.zeros(8, dtype=torch.uint8)})  # a GPU run's: left alone


def test_plan_of_cpu_ranks_plans_for_the_cpu(gpu_visible, monkeypatch, capsys):
    from dstrain import cli
    from dstrain.engine import factory
    seen = []
    real = factory.plan_engine
    monkeypatch.setattr(factory, "plan_engine", lambda *a, **k: seen.append(k["device_type"]) or real(*a, **k))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    recipe = Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json"
    assert cli.main(["plan", str(recipe)]) == 0
    assert seen == ["cpu"] and "cpu" in capsys.readouterr().out.lower()


def test_benchmark_default_profile_is_planned_for_the_ranks_device(gpu_visible, monkeypatch):
    from dstrain import bench
    from dstrain.config import load_run_config
    from dstrain.engine import factory
    seen = []
    real = factory.plan_engine
    monkeypatch.setattr(factory, "plan_engine", lambda *a, **k: seen.append(k["device_type"]) or real(*a, **k))
    cfg = load_run_config(Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    bench.default_profiles(cfg, 2)
    assert seen == ["cpu"]
