"""What only a GPU machine would show, checked here on the CPU (and passing there too).

* The lse-gradient backward of the fused attention primitives at head dim 256: FlashAttention-2 serves the
  forward, and the backward's eight extra head columns (``lse_grad_columns``) take it to 264, past the kernel's
  limit; the CUDA kernels are stood in for by the math kernel with the real ones' contracts (and limit).
* DeepSpeed's CPU kernels prebuilt for the CPU ranks the tests start on a machine with a GPU: before, nothing
  was built there (``DS_ACCELERATOR`` unset, a GPU visible), and each rank built them inside its timed run.
* The LM trainer's batches copied to the GPU from pinned memory without blocking: the blocking copy of pageable
  memory synchronised the stream at every micro-batch.
"""
from __future__ import annotations

import os
import types

import pytest
import torch

from dstrain.ops import attention


def bare_lm_trainer(engine):
    """An ``LMTrainer`` with only what ``train_step`` reads (3 micro-batches of 2 x 8 tokens, one rank, no pipeline,
    a fresh run's data position) around ``engine``, a stand-in for DeepSpeed's."""
    from dstrain.data.sampler import WindowSampler
    from dstrain.trainers import lm
    tr = object.__new__(lm.LMTrainer)
    tr.cfg = types.SimpleNamespace(train=types.SimpleNamespace(micro_batch=2, grad_accum=3),
                                   data=types.SimpleNamespace(seq_len=8), parallel=types.SimpleNamespace(sp=1))
    tr.guards = types.SimpleNamespace(begin=lambda n: None, phase=lambda *a: None)
    tr.train_tokens = torch.arange(500) % 7
    tr.sampler, tr.dp_rank, tr.dp_world, tr.pipelined = WindowSampler(500, 8, 0), 0, 1, False
    tr.data_start, tr.router_aux, tr.engine = (0, 0), [], engine
    return tr


def _fake_cuda_kernels(calls: list):
    """aten's CUDA attention entry points on CPU tensors: the math kernel behind each one's signature;
    FlashAttention-2 refuses a head dim over 256, as the real kernel does."""
    def flash_forward(q, k, v, dropout, causal, debug, scale=None):
        out, lse = attention._math_forward(q, k, v, causal, scale)
        calls.append(("flash_forward", q.shape[-1]))
        return (out, lse.float(), None, None, q.shape[-2], k.shape[-2], None, None, None)

    def flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, m, n, dropout, causal, seed, offset, scale=None):
        if q.shape[-1] > 256:
            raise RuntimeError("FlashAttention backward only supports head dimension at most 256")
        calls.append(("flash_backward", q.shape[-1]))
        return attention._math_backward(dout, q, k, v, out, lse, causal, scale)

    def efficient_backward(dout, q, k, v, bias, out, lse_padded, seed, offset, dropout, grad_mask, causal,
                           scale=None):
        assert lse_padded.shape[-1] % 32 == 0  # the kernel's padded lse
        calls.append(("efficient_backward", q.shape[-1]))
        return (*attention._math_backward(dout, q, k, v, out, lse_padded[..., :q.shape[-2]], causal, scale), None)

    return types.SimpleNamespace(_scaled_dot_product_flash_attention=flash_forward,
                                 _scaled_dot_product_flash_attention_backward=flash_backward,
                                 _scaled_dot_product_efficient_attention_backward=efficient_backward)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_lse_gradient_backward_fits_the_kernel_at_head_dim_256(head_dim, monkeypatch):
    """A bf16 head dim of 256 on CUDA runs FlashAttention-2 (kernel_for); an attention whose lse is used later
    (ring / dilated merges) then failed in its backward on a GPU. Now that backward takes the memory-efficient
    kernel (same out and lse), and the gradients equal the math reference's."""
    cuda_q = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, shape=(1, 2, 16, head_dim))
    assert attention.kernel_for(cuda_q) == "flash"  # what a GPU picks for this shape
    calls = []
    monkeypatch.setattr(attention, "_aten", _fake_cuda_kernels(calls))
    monkeypatch.setattr(attention, "kernel_for", lambda q, fused=True, masked=False: "flash" if fused else "math")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, head_dim, generator=g, requires_grad=True)
               for _ in range(3))
    w = torch.randn(1, 2, 16, generator=g)

    def grads(fused):
        out, lse = attention.attention_with_lse(q, k, v, causal=True, fused=fused)
        (out.square().sum() + (lse * w).sum()).backward()  # the lse is used: its gradient reaches the backward
        got = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        return got

    got, want = grads(True), grads(False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    expected_backward = "flash_backward" if head_dim + 8 <= 256 else "efficient_backward"
    assert calls == [("flash_forward", head_dim), (expected_backward, head_dim + 8)]


def test_cpu_ops_are_prebuilt_for_cpu_ranks_beside_a_gpu(monkeypatch):
    """``DS_ACCELERATOR`` unset with a GPU visible (``python -m pytest`` on a GPU machine, whose tests/dist,
    tests/configs and tests/recipes runs are CPU ranks): the kernels are built as a CPU rank builds them, and
    this process's environment, DeepSpeed's accelerator and its loaded-op cache are what they were."""
    pytest.importorskip("deepspeed")
    import deepspeed.ops.op_builder.cpu as cpu_builders
    from deepspeed.accelerator import get_accelerator, real_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    from dstrain import runtime
    seen = []

    def fake(name):
        class Builder:
            def __init__(self):
                self.name = name

            def load(self, verbose=True):
                seen.append((name, os.environ.get("DS_ACCELERATOR"), get_accelerator()._name))
                OpBuilder._loaded_ops[name] = object()
        return Builder

    for cls, name in (("ShareMemCommBuilder", "deepspeed_shm_comm"), ("FusedAdamBuilder", "fused_adam"),
                      ("CPUAdamBuilder", "cpu_adam")):
        monkeypatch.setattr(cpu_builders, cls, fake(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    gpus_choice = object()  # the accelerator this process chose (CUDA's, on a GPU machine)
    monkeypatch.setattr(real_accelerator, "ds_accelerator", gpus_choice)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})

    assert runtime.prebuild_cpu_ops() == ["deepspeed_shm_comm", "fused_adam", "cpu_adam"]
    assert seen == [(n, "cpu", "cpu") for n in ("deepspeed_shm_comm", "fused_adam", "cpu_adam")]
    assert "DS_ACCELERATOR" not in os.environ
    assert real_accelerator.ds_accelerator is gpus_choice and OpBuilder._loaded_ops == {}

    seen.clear()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # GPU ranks named by hand: nothing to build for the CPU
    assert runtime.prebuild_cpu_ops() == [] and seen == []


class _HostTensor:
    """A CPU tensor's copy calls, recorded (this machine may have no CUDA to copy to)."""

    def __init__(self, calls, pinned=False):
        self.calls, self.pinned, self.device = calls, pinned, torch.device("cpu")

    def pin_memory(self):
        self.calls.append("pin_memory")
        return _HostTensor(self.calls, pinned=True)

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking, self.pinned))
        return self


def test_batches_reach_the_gpu_without_a_host_wait():
    """A blocking copy of pageable memory to a GPU synchronises the stream: each micro-batch's copy waited
    for the previous step to finish on the device. On CUDA the copy now goes from pinned memory, non-blocking;
    elsewhere it is the plain copy."""
    from dstrain.trainers.lm import to_device
    calls = []
    to_device(_HostTensor(calls), torch.device("cuda", 0))
    assert calls == ["pin_memory", ("to", "cuda:0", True, True)]
    calls.clear()
    to_device(_HostTensor(calls), torch.device("cpu"))
    assert calls == [("to", "cpu", False, False)]
    t = torch.arange(3)
    assert to_device(t, torch.device("cpu")) is t


def test_lm_train_step_copies_each_micro_batch_through_to_device(monkeypatch):
    from dstrain.trainers import lm
    copied = []
    monkeypatch.setattr(lm, "to_device", lambda t, device: copied.append((tuple(t.shape), device)) or t)

    class Engine:  # a stand-in on a GPU: the trainer asks it for its device and hands it the batch
        device, step_ok = torch.device("cuda", 0), None

        def __call__(self, x, y):
            return (x.float() - y.float()).pow(2).mean().requires_grad_()

        def backward(self, loss):
            pass

        def step(self):
            return True

    loss, ok = bare_lm_trainer(Engine()).train_step(0)
    assert torch.isfinite(loss) and ok is None
    assert copied == [((2, 8), torch.device("cuda", 0))] * 6  # inputs and targets of 3 micro-batches
