"""The engine on a real GPU: every ZeRO stage learns in bf16, compile on/off agree, resume after a crash,
export, and the factory's memory estimate against torch.cuda.max_memory_allocated."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import child_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]
RECIPE = "models/gpt/recipes/tiny.json"
STEPS, EVERY = 40, 20


def _launch(out: Path, *extra: str, env: dict | None = None, check: bool = True):
    proc = subprocess.run(
        [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "1", RECIPE, f"--train.steps={STEPS}",
         "--train.log_every=10", f"--checkpoint.every={EVERY}", f"--output.dir={out}", "--output.progress=false",
         *extra],
        cwd=ROOT, env=child_env(env), capture_output=True, text=True,
        timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run per setting, shared by the tests below (each launch costs seconds of start-up)."""
    base = tmp_path_factory.mktemp("gpu_runs")
    cache = {}

    def get(name, *extra):
        if name not in cache:
            _launch(base / name, *extra)
            cache[name] = base / name
        return cache[name]
    return get


@pytest.mark.parametrize("profile", ["zero0", "zero1", "zero2", "zero3"])
def test_every_stage_learns_in_bf16(runs, profile):
    out = runs(profile, f"--deepspeed.profile={profile}")
    losses = _losses(out)
    assert losses[STEPS] < losses[10] - 0.5, losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["precision"] == "bf16"
    plan = (out / "plan.txt").read_text()
    assert "torch.compile on" in plan and "fused kernel" in plan
    if profile == "zero0":  # bf16 autocast: dstrain clips and keeps the norm (DeepSpeed logged none there)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        norms = [r["train/grad_norm"] for r in rows if "train/loss" in r]
        assert norms and all(math.isfinite(n) and n > 0 for n in norms), rows


def test_grad_norm_kernels_on_cuda():
    """dstrain.engine.grad_norm on CUDA (ZeRO-0 clipping, ZeRO-1/2's norm): bf16 and fp32 gradients in one
    multi-tensor norm per dtype accumulated in fp32 (torch._foreach_norm's dtype argument on CUDA), against
    an fp64 reference; clipping scales every gradient by DeepSpeed's factor."""
    from dstrain.engine.grad_norm import _squared_norm, clip_to, total_grad_norm
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n, device="cuda", dtype=dt)) for n, dt in
              ((1000, torch.bfloat16), (37, torch.bfloat16), (513, torch.float32), (5, torch.float32))]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g).to(p.dtype) * 3
    ref = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    norm = total_grad_norm(params)
    assert norm.device.type == "cuda" and norm.dtype == torch.float32
    assert float(norm) == pytest.approx(float(ref), rel=1e-5)
    assert float(_squared_norm([p.grad for p in params], "cuda:0")) == pytest.approx(float(ref) ** 2, rel=1e-5)
    before = [p.grad.double().clone() for p in params]
    clip_to(params, 1.0, norm)
    for p, b in zip(params, before):
        assert torch.allclose(p.grad.double(), b * (1.0 / (float(ref) + 1e-6)), rtol=1e-2, atol=1e-6)


def test_compile_on_and_off_follow_the_same_curve(runs):
    on = _losses(runs("zero0", "--deepspeed.profile=zero0"))
    off = _losses(runs("zero0_eager", "--deepspeed.profile=zero0", "--train.compile=false"))
    assert on.keys() == off.keys()
    for step in on:  # bf16 noise only: the same maths in a different kernel order
        assert on[step] == pytest.approx(off[step], rel=3e-2), (step, on, off)


def test_crash_during_save_then_resume_continues_the_run(runs, tmp_path):
    full = runs("zero0_eager", "--deepspeed.profile=zero0", "--train.compile=false")
    broken = tmp_path / "broken"
    extra = ("--deepspeed.profile=zero0", "--train.compile=false")
    proc = _launch(broken, *extra, env={"DSTRAIN_FAULT_IN_SAVE": str(STEPS)}, check=False)
    assert proc.returncode != 0
    proc = _launch(broken, *extra, "--resume")
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = _losses(full), _losses(broken)
    assert [b[s] for s in (30, 40)] == pytest.approx([a[s] for s in (30, 40)], rel=1e-2)

    from safetensors.torch import load_file
    from dstrain.cli import main
    assert main(["export", str(broken), str(tmp_path / "w.safetensors")]) == 0
    state = load_file(str(tmp_path / "w.safetensors"))
    from models.gpt.model import GPT, GPTConfig
    from models.gpt.sizes import SIZES
    model = GPT(GPTConfig(**SIZES["tiny"]))
    model.load_state_dict(state, strict=True)


def test_memory_estimate_within_ten_percent(tmp_path):
    """GPT small, seq 1024: the chosen profile's planned device bytes vs the allocator's peak."""
    from dstrain.config import load_run_config
    from dstrain.engine.factory import plan_engine
    extra = ["--model.size=small", "--data.seq_len=1024", "--train.micro_batch=8", "--train.steps=6",
             "--train.log_every=3", "--checkpoint.every=0"]
    cfg = load_run_config(str(ROOT / RECIPE), [*extra, f"--output.dir={tmp_path}"])
    plan = plan_engine(cfg, 1, ranks_per_node=1, device_type="cuda")
    estimate = next(e.device_total for e in plan.plan.estimates
                    if e.profile == plan.profile and e.activation_checkpointing == plan.activation_checkpointing)
    proc = subprocess.run(
        [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "1", RECIPE, *extra,
         f"--output.dir={tmp_path}", "--output.progress=false"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    measured = max(r["train/memory_gb"] for r in rows if "train/memory_gb" in r) * 1e9
    assert abs(estimate - measured) / measured < 0.10, (estimate, measured)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0),
                    reason="cuDNN's fused attention needs compute capability 8.0 or later")
def test_cudnn_attention_backend_runs_cudnn_and_matches():
    """train.attention_backend=cudnn on a GPU: GPT's attention runs cuDNN's kernel (seen by the profiler), and
    the loss and gradients agree with PyTorch's default kernel within bf16 noise."""
    from torch.profiler import ProfilerActivity, profile

    from dstrain.ops.attention import sdpa_priority
    from models.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=256, n_layer=2, n_head=4, n_embd=256, vocab_size=512)).cuda()
    x = torch.randint(0, 512, (4, 256), device="cuda")
    results = {}
    for backend in ("auto", "cudnn"):
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_priority(backend):
                loss = model(x, x)
            loss.backward()
        ops = {e.name for e in prof.events()}
        results[backend] = (float(loss), [p.grad.float().clone() for p in model.parameters()], ops)
    assert any("cudnn_attention" in op for op in results["cudnn"][2]), sorted(results["cudnn"][2])
    assert not any("cudnn_attention" in op for op in results["auto"][2])
    assert results["cudnn"][0] == pytest.approx(results["auto"][0], rel=1e-2)
    for a, b in zip(results["auto"][1], results["cudnn"][1]):
        assert torch.allclose(a, b, rtol=5e-2, atol=5e-3)
