"""What the factory needs to know about the machine and the model, measured.

* :func:`detect_hardware` - device type, memory one rank may use, host memory, and
  whether bf16 is fast here (CUDA: the device says so; CPU: a timed matmul).
* :func:`model_stats` - parameter count and largest module, from a build on the
  meta device (no memory, so it works for sizes that would not fit here).
* :func:`trace_activations` - activation bytes of one training step at micro-batch 1 at
  their peak, with and without activation checkpointing: one forward and backward on fake
  tensors (the model's real graph, at no memory or compute cost), counting the bytes autograd
  saves and the bytes alive at once (temporaries, gradients in flight, recomputed blocks).
* :func:`matmul_peak_flops` - a measured matmul rate, the MFU reference on a CPU.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from dstrain.engine.profiles import Activations, Hardware, ModelStats, parse_bytes


@dataclass(frozen=True)
class MatmulRate:
    dtype: str
    size: int
    flops_per_s: float


def matmul_rate(dtype: torch.dtype, size: int, device: str = "cpu", min_time: float = 0.2) -> MatmulRate:
    """Time ``size``^3 matmuls of ``dtype`` for at least ``min_time`` seconds."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    (a @ b).sum().item()  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        c = a @ b
        n += 1
        if device != "cpu":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            break
    del c
    return MatmulRate(str(dtype).replace("torch.", ""), size, 2.0 * size ** 3 * n / elapsed)


def cpu_bf16_flags() -> list[str]:
    """Native bf16 instruction sets the kernel reports for this CPU (Linux only)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return []
    return sorted({f for f in ("avx512_bf16", "amx_bf16") if f" {f}" in text})


def cpu_bf16_is_fast(size: int = 512, min_speedup: float = 1.5, rounds: int = 5) -> tuple[bool, str]:
    """Decide whether bf16 is fast on this CPU: native instructions AND a measured speed-up.

    Without native bf16 (no AVX512-BF16/AMX) PyTorch emulates 16-bit matmuls and
    bf16 runs hundreds of times slower; with it, about 2-5x faster. The two dtypes
    are timed in alternation and the best of ``rounds`` taken for each, so a busy
    machine slows both alike rather than flipping the decision. The casts of mixed
    precision cost something, hence ``min_speedup``.
    """
    fp32 = bf16 = 0.0
    for _ in range(rounds):
        fp32 = max(fp32, matmul_rate(torch.float32, size, min_time=0.03).flops_per_s)
        bf16 = max(bf16, matmul_rate(torch.bfloat16, size, min_time=0.03).flops_per_s)
    speedup = bf16 / fp32
    flags = cpu_bf16_flags()
    note = (f"measured {size}^3 matmul (best of {rounds}): fp32 {fp32 / 1e9:.1f} GFLOP/s, bf16 "
            f"{bf16 / 1e9:.2f} GFLOP/s ({speedup:.2f}x); native bf16: {', '.join(flags) or 'none reported'}")
    fast = bool(flags) and speedup >= min_speedup
    if fast:
        note += "; bf16 is fast"
    elif not flags:
        note += "; no native bf16 (16-bit matmuls would be emulated): fp32"
    else:
        note += f"; bf16 under the {min_speedup:g}x that pays for mixed precision's casts: fp32"
    return fast, note


def gpu_bf16_native(props) -> bool:
    """Whether the GPU described by ``props`` (``torch.cuda.get_device_properties``) computes bf16 in hardware:
    compute capability 8.0 or later (Ampere, Hopper, Blackwell), or a ROCm GPU. Not
    ``torch.cuda.is_bf16_supported()``, whose default (``including_emulation=True``) also says yes for a V100 or
    T4, where torch merely can make bf16 tensors and emulates their maths: the planner then chose bf16 there
    instead of fp16 with loss scaling."""
    return bool(torch.version.hip) or props.major >= 8


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("DSTRAIN_LOCAL_RANKS", "1")))


def detect_hardware(device_memory=None, host_memory=None, ranks_per_node: int | None = None,
                    device_type: str | None = None) -> tuple[Hardware, str]:
    """Describe this machine as the planner sees it; returns (hardware, notes).

    ``device_memory``/``host_memory`` ("80GB", bytes) override what is detected,
    which is how ``dstrain plan --device-memory 80GB`` plans for a GPU elsewhere.
    """
    import psutil

    ranks = ranks_per_node or local_world_size()
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    host = parse_bytes(host_memory) if host_memory is not None else psutil.virtual_memory().total
    notes = []
    if device_type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        mem = props.total_memory
        bf16 = gpu_bf16_native(props)
        name = props.name
        notes.append(f"{name}: {mem / 2**30:.1f} GiB, bf16 {'supported' if bf16 else 'not supported'}")
    elif device_type == "cuda":
        # Planning for GPUs from a machine without one: assume a modern (bf16) GPU.
        mem, bf16, name = parse_bytes(device_memory or "80GB"), True, "cuda (assumed)"
        notes.append("no GPU here: planning for a bf16-capable GPU")
        if host_memory is None:  # the offload profiles' host budget would silently be this machine's RAM
            notes.append(f"host memory per node: this machine's {host / 1e9:.1f} GB "
                         "(--deepspeed.host_memory=512GB plans for the GPU nodes' own)")
    else:
        mem = host // max(ranks, 1)
        bf16, speed = cpu_bf16_is_fast()
        name = "cpu"
        notes.append(speed)
        notes.append(f"CPU budget: {host / 2**30:.1f} GiB RAM / {ranks} local rank(s)")
    if device_memory is not None:
        mem = parse_bytes(device_memory)
        notes.append(f"device memory set to {mem / 1e9:.1f} GB")
    hw = Hardware(device_type=device_type, device_memory=int(mem), host_memory=int(host),
                  ranks_per_node=ranks, bf16_supported_fast=bool(bf16),
                  fp16_supported=device_type == "cuda", name=name)
    return hw, "; ".join(notes)


def model_stats(build: Callable[[], torch.nn.Module]) -> ModelStats:
    """Count parameters of a model built on the meta device.

    The largest module is the one owning the most parameters directly (what
    ZeRO-3 gathers at once: a parameter tied to another module's counts in both,
    as DeepSpeed's ``model_to_params`` counts it); tied parameters are counted
    once in the total.
    """
    with torch.device("meta"):
        model = build()
    seen, total, largest = set(), 0, 0
    for module in model.modules():
        own = {id(p): p.numel() for p in module.parameters(recurse=False)}
        total += sum(n for k, n in own.items() if k not in seen)
        seen.update(own)
        largest = max(largest, sum(own.values()))
    return ModelStats(params=total, largest_module_params=largest,
                      hidden_size=int(getattr(model, "hidden_size", 0)),
                      num_layers=int(getattr(model, "num_layers", 0)))


@dataclass
class _Trace:
    """What one traced forward saves: ``total`` bytes (distinct storages, parameters excluded), each module
    call's own saved bytes as ``(module id, bytes)``, the modules that ran as checkpointed regions, and ``peak``:
    the most bytes alive at once over the forward and backward (parameters, their gradients and the inputs
    excluded; see :class:`_LiveBytes`)."""
    total: int
    calls: list
    regions: set
    peak: int = 0


class _LiveBytes(TorchDispatchMode):
    """The bytes of the storages the ops make, alive at once, at their peak: each op's new output storages are
    added, and a storage is taken off once nothing holds it any more (a weak reference to it expired), looked
    for whenever the count passes the peak so far (exact, and cheap on a long trace). Saved activations are only part of it: the forward also holds what it
    computes without keeping for backward (HRM's no-grad segment for the Q target, a layer's temporaries), and
    the backward the gradients it is passing on and, under checkpointing, the block it recomputes. Storages
    alive when it starts (parameters, gradients, inputs) are not counted."""

    def __init__(self, before: set[int]):
        super().__init__()
        self.before = before  # storage ids alive at the start
        self.live: dict[int, tuple] = {}
        self.bytes = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            # (a sparse tensor, e.g. the gradient of an Embedding(sparse=True), has no storage to weigh: left out)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self.before or (key in self.live and not self.live[key][0].expired()):
                    continue
                if key in self.live:  # a freed storage's address, taken again
                    self.bytes -= self.live.pop(key)[1]
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.bytes += storage.nbytes()
        if self.bytes > self.peak:  # what is freed is taken off only here: below the peak it cannot matter
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                self.bytes -= self.live.pop(key)[1]
            self.peak = max(self.peak, self.bytes)
        return out


def _top_hook():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(True)


def _saved_bytes(model: torch.nn.Module, make_batch: Callable[[], tuple]) -> _Trace:
    """Bytes autograd saves for backward during one forward (distinct storages, parameters excluded), per module
    call too; the outermost modules that run under another saved-tensor hook than this one (activation
    checkpointing's, which keeps what they save for recomputation) are the checkpointed regions."""
    storages: dict[int, int] = {}
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    open_calls: list[tuple[int, dict]] = []
    calls: list[tuple[int, int]] = []
    regions: set[int] = set()
    inside = [0]

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            storages[storage._cdata] = storage.nbytes()
            for _, own in open_calls:
                own[storage._cdata] = storage.nbytes()
        return t

    def before(module, _args):
        top = _top_hook()
        if inside[0] or (top is not None and top[0] is not pack):
            if not inside[0]:
                regions.add(id(module))
            inside[0] += 1
        open_calls.append((id(module), {}))

    def after(module, _args, _out):
        key, own = open_calls.pop()
        calls.append((key, sum(own.values())))
        if inside[0]:
            inside[0] -= 1

    grads = [p for p in model.parameters() if p.requires_grad and p.grad is None]
    for p in grads:  # allocated beforehand, as the engine's are: model state, not activations
        p.grad = torch.zeros_like(p)
    batch = make_batch()
    alive = (*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None),
             *pytree.tree_leaves(batch))
    live = _LiveBytes({t.untyped_storage()._cdata for t in alive if isinstance(t, torch.Tensor)})
    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(before),
                                                    m.register_forward_hook(after, always_call=True))]
    try:
        with live:
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(*batch)
            finally:
                for h in handles:
                    h.remove()
            # models that return (loss, extras), e.g. HRM's ACT carry (alive through the backward, as in a step)
            (out[0] if isinstance(out, (tuple, list)) else out).backward()
    finally:
        for p in grads:
            p.grad = None
    return _Trace(sum(storages.values()), calls, regions, live.peak)


def _checkpointed_peak(plain: _Trace, ckpt: _Trace) -> int:
    """Activation bytes of a checkpointed run at its peak: the traced forward and backward's live peak (the
    backward holds the block it recomputes besides the kept inputs, and that block's gradients), and at least
    what the checkpointed forward keeps plus the largest region's own saves. That sum alone was 13-50 % under the
    measured peak (a region's temporaries and gradients, HRM's no-grad Q-target segment): GPT tiny 1.58 MB for
    1.86, HRM sudoku 5.3 MB for 10.7, measured on CPU allocations (tests/unit/test_reference_round17.py)."""
    region = max((b for key, b in plain.calls if key in ckpt.regions), default=0)
    return max(ckpt.peak, ckpt.total + region)


def _peak(trace: _Trace) -> int:
    """Activation bytes of a run without checkpointing at its peak: the saved bytes, or the live peak of the
    traced forward and backward when higher (HRM's no-grad Q-target segment runs while its saved activations
    are alive: 1.2x the saved bytes on HRM debug)."""
    return max(trace.total, trace.peak)


def trace_activations(build: Callable[[], torch.nn.Module], make_inputs: Callable[[], tuple],
                      set_checkpointing: Callable[[torch.nn.Module, bool], None],
                      make_inputs_2: Callable[[], tuple] | None = None) -> Activations:
    """Activation bytes of one forward on ``make_inputs()`` (micro-batch 1), fp32, with and without checkpointing.

    Runs the real model under ``FakeTensorMode``: CPU kernels are chosen as for a
    real run, but no memory is allocated and nothing is computed. Attention is one
    autograd function per call (``dstrain.ops``) that saves q, k, v, its output and
    lse whichever kernel runs, so this trace is also the CUDA path's saved memory.

    With ``make_inputs_2`` (micro-batch 2) the model is also traced under bf16
    ``torch.autocast`` at micro-batches 1 and 2 (fake CPU tensors take CPU autocast,
    which keeps the same ops in fp32 as CUDA's: norms, softmax, the loss): the
    difference is the per-sample bytes, the rest the fixed bytes (the bf16 weight copies).

    Each figure is the step's peak (``_peak``, ``_checkpointed_peak``): the bytes alive at once over the traced
    forward and backward, at least the saved bytes (and, checkpointed, what the forward keeps plus the largest
    region the backward recomputes). The same ops run for a GPU target but inside ``dstrain.ops``' attention
    function, whose saved tensors are the same on either device.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build()
        model.train()

        plain = _saved_bytes(model, make_inputs)
        set_checkpointing(model, True)
        ckpt = _checkpointed_peak(plain, _saved_bytes(model, make_inputs))
        autocast = None
        if make_inputs_2 is not None:
            autocast = []
            set_checkpointing(model, False)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                plain_1, plain_2 = _saved_bytes(model, make_inputs), _saved_bytes(model, make_inputs_2)
            set_checkpointing(model, True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ckpt_1, ckpt_2 = _saved_bytes(model, make_inputs), _saved_bytes(model, make_inputs_2)
            for one, two in ((_peak(plain_1), _peak(plain_2)),
                             (_checkpointed_peak(plain_1, ckpt_1), _checkpointed_peak(plain_2, ckpt_2))):
                autocast.append((two - one, max(0, 2 * one - two)))
        set_checkpointing(model, False)
    return Activations(per_sample=_peak(plain), per_sample_checkpointed=ckpt,
                       autocast=None if autocast is None else tuple(autocast))


# Dense (no 2:4 sparsity) datasheet peak of common GPUs (FLOP/s) for MFU, by substring of the device
# name; the longest matching name wins ("H100 PCIe" before "H100", "A100" before "A10"). fp16 and bf16
# share the tensor-core rate; fp32 is the plain (non-TF32) rate, as dstrain leaves TF32 off.
GPU_PEAK_FLOPS = {
    ("H200", "bf16"): 989e12, ("H200", "fp16"): 989e12, ("H200", "fp32"): 67e12,
    ("H100", "bf16"): 989e12, ("H100", "fp16"): 989e12, ("H100", "fp32"): 67e12,  # SXM (HBM3)
    ("H100 PCIe", "bf16"): 756e12, ("H100 PCIe", "fp16"): 756e12, ("H100 PCIe", "fp32"): 51e12,
    ("H100 NVL", "bf16"): 835e12, ("H100 NVL", "fp16"): 835e12, ("H100 NVL", "fp32"): 60e12,
    ("A100", "bf16"): 312e12, ("A100", "fp16"): 312e12, ("A100", "fp32"): 19.5e12,
    ("L40S", "bf16"): 362e12, ("L40S", "fp16"): 362e12, ("A10", "bf16"): 125e12, ("V100", "fp16"): 125e12,
}


def gpu_peak(name: str, precision: str) -> float | None:
    """The datasheet peak of the device called ``name`` at ``precision`` (longest matching key)."""
    hits = [(len(key), value) for (key, prec), value in GPU_PEAK_FLOPS.items() if key in name and prec == precision]
    return max(hits)[1] if hits else None


def peak_flops(precision: str, measure_cpu: bool = True) -> tuple[float | None, str]:
    """Peak FLOP/s for MFU: the GPU's datasheet figure, or a matmul measured on this CPU.

    CPU ranks on a machine with a GPU (``DS_ACCELERATOR=cpu``) measure the CPU, not the GPU's datasheet."""
    from dstrain.runtime import ranks_use_cuda
    if ranks_use_cuda():
        name = torch.cuda.get_device_name()
        value = gpu_peak(name, precision)
        if value is not None:
            return value, f"{name} {precision} datasheet peak"
        return None, f"no peak known for {name} {precision}"
    if not measure_cpu:
        return None, "not measured"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(precision, torch.float32)
    rate = matmul_rate(dtype, 1024 if dtype == torch.float32 else 256, min_time=0.5)
    return rate.flops_per_s, f"measured {rate.size}^3 {rate.dtype} matmul on this CPU"
