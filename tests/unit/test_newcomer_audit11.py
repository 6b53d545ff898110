"""Newcomer audit, round 11: ``dstrain plan`` and README's "How the factory chooses" read with real hardware in
mind: every GPT size on 1, 8 and 64 GPUs of 80, 40 and 24 GB, sizes that need offload, odd input (0 ranks, a million
ranks, 0.5 GB GPUs, an unknown size, tp on a model without it), the dilated LM, HRM and a policy recipe; the
model-state figures recomputed by hand from DESIGN.md's 2+2+12 bytes per parameter (xl zero0 at bf16 autocast:
16 x 1,477,176,000 = 23.6 GB, as printed; xl zero1 on 64 ranks: (2 + 2 + 12/64) x P = 6.2 GB, as printed; large
zero0 11.4 GB; small 1.4 GB), the activations against seq x hidden x layers x micro-batch (xl, seq 128,
micro-batch 8: 5.8 GB, about 37 bytes per element, Korthikanti's 34 for 16-bit plus fp32 residuals).

Found and fixed (what a first user typed; what happened before; what happens now):

* ``dstrain plan models/gpt/recipes/tiny.json --model.size=xl --world-size 8 --device-memory 0.5GB`` (or any plan
  that fits nowhere): "no profile fits: ...; use more ranks, a smaller micro-batch or a machine with more memory",
  with no number: how many ranks, would micro-batch 1 do, how much host memory? Now the line ends with what
  would fit, each re-estimated with the same profiles: "what would fit: 16 ranks at 8 a node (zero3_offload +
  checkpointing: 205.3 MB per rank); or 27.8 GB host memory per node (...: --deepspeed.host_memory=28GB)", and
  ``--train.micro_batch=1`` where that alone fits.
* The same command from a laptop or a CPU login node: the offload profiles' host budget was this machine's RAM
  (25.3 GB here), not the GPU nodes', and nothing said so or how to change it (``deepspeed.host_memory``, named
  nowhere in README). Now ``dstrain plan`` says "host memory per node: this machine's 25.3 GB
  (--deepspeed.host_memory=512GB plans for the GPU nodes' own)", and README's plan command says it too.
* ``dstrain plan ... --device-memory 80GB``: the plan named two of README's GPU-only choices (fused AdamW,
  torch.compile) but not the attention kernel. Now "attention: FlashAttention-2 first on the GPU (...)" (the
  memory-efficient kernel at fp32); a CPU plan names none of the three
  (already so for the other two).

Checked and already right: 0 ranks, tp=2 on GPT, an unknown size end in one line (exit 2); a million ranks plans
zero0 for xl on 80 GB (it fits without partitioning: README's order takes the first that fits).
"""
import re
from pathlib import Path

import pytest
import torch

from dstrain.engine import hardware
from dstrain.engine.profiles import Activations, Hardware, ModelStats, PlanError, choose_plan

GB = 10**9
RECIPE = Path(__file__).resolve().parents[2] / "models" / "gpt" / "recipes" / "tiny.json"


def gpu(mem, host, per_node=1):
    return Hardware("cuda", int(mem), int(host), per_node, True, True, "cuda (assumed)")


STATS = ModelStats(params=7 * GB, largest_module_params=GB // 2, hidden_size=4096, num_layers=32)


def test_a_plan_that_fits_nowhere_names_the_fewest_ranks_that_would_and_that_figure_holds():
    acts = Activations(GB, GB // 5)
    with pytest.raises(PlanError) as err:
        choose_plan(STATS, gpu(24 * GB, 64 * GB), acts, world_size=1, micro_batch=1)
    text = str(err.value)
    assert "use more ranks, a smaller micro-batch" not in text and "what would fit: " in text
    ranks = int(re.search(r"what would fit: (\d+) ranks at 1 a node", text).group(1))
    choose_plan(STATS, gpu(24 * GB, 64 * GB), acts, world_size=ranks, micro_batch=1)  # fits
    with pytest.raises(PlanError):
        choose_plan(STATS, gpu(24 * GB, 64 * GB), acts, world_size=ranks // 2, micro_batch=1)


def test_a_plan_short_of_host_memory_names_the_host_memory_that_would_fit_and_the_switch():
    acts = Activations(GB, GB // 5)
    with pytest.raises(PlanError) as err:
        choose_plan(STATS, gpu(24 * GB, 64 * GB), acts, world_size=1, micro_batch=1)
    host = int(re.search(r"--deepspeed.host_memory=(\d+)GB", str(err.value)).group(1))
    assert "planned with 64.0 GB" in str(err.value)
    assert "offload" in choose_plan(STATS, gpu(24 * GB, host * GB), acts, world_size=1, micro_batch=1).profile


def test_a_plan_whose_micro_batch_does_not_fit_says_micro_batch_1_would():
    small = ModelStats(params=GB, largest_module_params=GB // 20, hidden_size=2048, num_layers=24)
    acts = Activations(8 * GB, 4 * GB)  # even checkpointed, 8 samples do not fit 20.4 GB; one does
    with pytest.raises(PlanError) as err:
        choose_plan(small, gpu(24 * GB, 8 * GB), acts, world_size=1, micro_batch=8)
    assert "--train.micro_batch=1 with a larger grad_accum (" in str(err.value)
    choose_plan(small, gpu(24 * GB, 8 * GB), acts, world_size=1, micro_batch=1)


def test_planning_for_a_gpu_elsewhere_says_whose_host_memory_the_offload_budget_is(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    hw, notes = hardware.detect_hardware("80GB", None, 8, device_type="cuda")
    assert f"host memory per node: this machine's {hw.host_memory / 1e9:.1f} GB" in notes
    assert "--deepspeed.host_memory=" in notes
    hw, notes = hardware.detect_hardware("80GB", "512GB", 8, device_type="cuda")
    assert hw.host_memory == 512 * GB and "this machine's" not in notes


def test_the_plan_for_a_gpu_names_flash_attention_and_the_plan_for_a_cpu_does_not():
    # `dstrain plan tiny.json --device-memory 80GB` named the fused AdamW kernel and torch.compile (GPU-only
    # choices) but not the attention kernel, README's third; the factory now passes the device and precision.
    from dstrain.config import load_run_config
    from dstrain.engine import compiling
    cfg = load_run_config(RECIPE)
    assert compiling.attention_note(cfg, "cuda", "bf16").startswith("attention: FlashAttention-2 first on the GPU")
    assert "memory-efficient kernel for fp32" in compiling.attention_note(cfg, "cuda", "fp32")
    assert compiling.attention_note(cfg, "cpu", "fp32") == ""
    cfg.train.attention_backend = "cudnn"
    assert "SDPA tries cudnn's kernels first" in compiling.attention_note(cfg, "cuda", "bf16")

