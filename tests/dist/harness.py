"""Run dstrain for real (2 CPU ranks through the deepspeed launcher) and read what it wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dstrain.config import load_run_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "models" / "gpt" / "recipes" / "tiny.json"

# Small and quick: 4 layers x 128 wide, 64-token samples, 2 x 2 micro-batches per rank.
QUICK = ["--data.seq_len=64", "--data.max_bytes=1000000", "--train.micro_batch=2",
         "--train.grad_accum=2", "--train.log_every=1", "--train.warmup_steps=2",
         "--train.eval_batches=1", "--output.tensorboard=false", "--output.progress=false",
         "--deepspeed.precision=fp32"]


def overrides(out: Path, steps: int, *extra: str) -> list[str]:
    return [*QUICK, f"--train.steps={steps}", f"--output.dir={out}", *extra]


def launch(args: list[str], env: dict | None = None, nproc: int = 2, timeout: int = 900,
           check: bool = True) -> subprocess.CompletedProcess:
    """``dstrain launch --nproc N RECIPE args`` in a subprocess."""
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(nproc), str(RECIPE), *args]
    proc = subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def torchrun_restarting(args: list[str], env: dict, max_restarts: int = 1,
                        timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --max-restarts N -m dstrain.cli train RECIPE args`` on 2 CPU ranks of one node, run by hand
    (torchrun's own agent restarts the ranks; no ``dstrain launch`` around it); not checked."""
    from dstrain.launcher import find_free_port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "--master-addr", "127.0.0.1", "--master-port", str(find_free_port()),
           "-m", "dstrain.cli", "train", str(RECIPE), *args]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    return subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def metrics(out: Path, key: str = "train/loss") -> dict[int, float]:
    """step -> value of ``key`` from metrics.jsonl (later lines win, as after a resume)."""
    values = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if key in record:
            values[record["step"]] = record[key]
    return values


def run_config(out: Path, steps: int, *extra: str):
    return load_run_config(RECIPE, overrides(out, steps, *extra))


def tiny_engine(world: int, overrides: list[str]):
    """``(engine, plan)``: the tiny GPT recipe with ``overrides``, planned for ``world`` CPU ranks and
    built in this process with seed 0, for tests that drive the engine themselves (inside ``spawn.run``)."""
    import torch

    from dstrain.engine.factory import create_engine, plan_engine
    from models import registry
    cfg = load_run_config(str(RECIPE), overrides)
    spec = registry.get_spec("gpt")
    mcfg = registry.make_model_config("gpt", "tiny", {})
    plan = plan_engine(cfg, world, ranks_per_node=world, device_type="cpu")
    torch.manual_seed(0)
    return create_engine(lambda: spec.build(mcfg), spec.parallelize, plan, cfg.train), plan
