"""GPU readiness, round 4: the CUDA-only branches read again, for what only a GPU machine would show.

Found and fixed (checked here with stand-ins for the device; passes on a GPU machine too):

* ``hardware.detect_hardware`` took "bf16 is fast" from ``torch.cuda.is_bf16_supported()``, whose default
  (``including_emulation=True``) also answers yes on a V100 or T4 (compute capability 7.x), where torch can make
  bf16 tensors but has no bf16 tensor cores: the planner chose bf16 there instead of fp16 with loss scaling (the
  design's rule, and ``tests/gpu/test_gpu.py::test_factory_picks_bf16_on_ampere_or_later``, say fp16 below 8.0).
  Now the compute capability decides (``hardware.gpu_bf16_native``).
* The HRM trainer saves its EMA (``hrm/ema.pt``) as the shadow weights are kept, on the weights' device: a GPU
  run's file holds CUDA tensors. ``models/hrm/report.py`` (``load_checkpoint_model``: the checkpoint evaluation of
  the HRM report) read it without ``map_location``, so evaluating a GPU-trained checkpoint on a machine without a
  GPU failed ("Attempting to deserialize object on a CUDA device"); CPU runs write CPU tensors, and tests saw
  nothing. Now it reads to the CPU (the puzzle-embedding file too).
* Tests that assumed CPU ranks (``tests/unit/test_bench_parallel.py::test_refused_in_one_line_before_any_launch``,
  ``tests/unit/test_newcomer_audit9.py::test_bench_out_that_cannot_be_written_is_refused_before_any_job``):
  ``dstrain bench`` with its default 2 ranks on a machine showing one GPU refuses the rank count first, before the
  layout or ``--out`` problem those tests expect. They now name CPU ranks (``DS_ACCELERATOR=cpu``).
* ``benchmarks/pipeline.py`` timed DeepSpeed's ``ForwardPass`` / ``BackwardPass`` instructions on the host clock
  alone. On a GPU they return once their kernels are queued, so the compute share was the launch time and the
  measured bubble (``1 - compute / schedule``) came out near 1 whatever the schedule (on the CPU a kernel is done
  when its call returns). Now the device is waited for around each timed instruction on CUDA.
"""
from __future__ import annotations

import importlib.util
import time
import types
from pathlib import Path

import pytest
import torch

from dstrain.engine import hardware
from dstrain.engine.profiles import choose_precision


def _visible_gpu(monkeypatch, name: str, major: int, minor: int = 0):
    """torch reports one GPU called ``name`` of compute capability ``major.minor`` (no kernel runs), with
    ``is_bf16_supported`` answering as torch 2.3+ does: yes from 8.0, and below it yes unless emulation is
    excluded (a bf16 tensor can be made there)."""
    props = types.SimpleNamespace(name=name, total_memory=32 * 2**30, major=major, minor=minor)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: major >= 8 or including_emulation)


@pytest.mark.parametrize("name, major, minor, precision", [
    ("Tesla V100-SXM2-32GB", 7, 0, "fp16"), ("Tesla T4", 7, 5, "fp16"),
    ("NVIDIA A100-SXM4-80GB", 8, 0, "bf16"), ("NVIDIA H100 80GB HBM3", 9, 0, "bf16"),
])
def test_gpus_without_bf16_tensor_cores_get_fp16(monkeypatch, name, major, minor, precision):
    """Before: a V100 or T4 was planned in bf16 (emulated there, many times slower than fp16)."""
    _visible_gpu(monkeypatch, name, major, minor)
    hw, notes = hardware.detect_hardware(ranks_per_node=1, device_type="cuda")
    assert hw.name == name and hw.bf16_supported_fast == (precision == "bf16"), notes
    assert choose_precision(hw)[0] == precision


def _save_as_a_gpu_run_does(obj, path, monkeypatch):
    """``torch.save`` of ``obj`` with every storage recorded as on ``cuda:0``, as a GPU run's file records it (torch
    then needs CUDA, or a ``map_location``, to read it back)."""
    import torch.serialization
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(obj, path)


def test_hrm_report_reads_a_gpu_runs_ema_and_puzzle_embedding_on_a_cpu(tmp_path, monkeypatch):
    """Before: RuntimeError "Attempting to deserialize object on a CUDA device" on a machine without a GPU."""
    from models.hrm import report
    from tests.unit.test_hrm_ema import hrm_run_with_ema
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (as on a CPU build of torch)
    ema, tag = hrm_run_with_ema(tmp_path, monkeypatch,
                                save=lambda obj, path: _save_as_a_gpu_run_does(obj, path, monkeypatch))
    _save_as_a_gpu_run_does({"weight": torch.full((3, 4), 0.5)}, tag / "hrm" / "puzzle_emb.pt", monkeypatch)
    avg, _, _, emb, _, loaded = report.load_checkpoint_model(tmp_path)
    assert loaded == "ema" and emb.device.type == "cpu" and torch.equal(emb, torch.full((4,), 0.5))
    for name, p in avg.named_parameters():
        assert torch.allclose(p, ema.shadow[name]), name


class _DeviceQueue:
    """A GPU's stream, simulated: ``queue`` adds kernel time and returns at once; ``synchronize`` waits it out."""

    def __init__(self):
        self.queued = 0.0

    def queue(self, seconds: float):
        self.queued += seconds

    def synchronize(self, device=None):
        time.sleep(self.queued)
        self.queued = 0.0


def test_pipeline_benchmark_counts_an_instructions_device_time_on_a_gpu(monkeypatch):
    """A forward that queues 0.1 s of kernels: before, its host-timed 'compute' was about 0 (the launches)."""
    spec = importlib.util.spec_from_file_location("pipeline_gpu4", Path(__file__).resolve().parents[2]
                                                  / "benchmarks" / "pipeline.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    stream = _DeviceQueue()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", stream.synchronize)

    class Forward:  # (a schedule instruction class)
        pass

    class Engine:
        _INSTRUCTION_MAP = {Forward: lambda self, **kwargs: stream.queue(0.1)}

    engine, bucket = Engine(), {"compute": 0.0}
    bench._timed(engine, Forward, bucket, "compute")
    stream.queue(0.2)  # a receive still running when the forward starts: not the forward's time
    engine._INSTRUCTION_MAP[Forward](engine, buffer_id=0)
    assert 0.1 <= bucket["compute"] < 0.2 and stream.queued == 0.0, bucket
