"""Run dstrain for real (2 CPU ranks through the deepspeed launcher) and read what it wrote."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
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


def launch_command(args: list[str], env: dict | None, nproc: int) -> tuple[list[str], dict]:
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    return [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", str(nproc), str(RECIPE), *args], full_env


def _checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def launch(args: list[str], env: dict | None = None, nproc: int = 2, timeout: int = 900,
           check: bool = True) -> subprocess.CompletedProcess:
    """``dstrain launch --nproc N RECIPE args`` in a subprocess."""
    cmd, full_env = launch_command(args, env, nproc)
    return _checked(subprocess.run(cmd, env=full_env, cwd=ROOT, capture_output=True, text=True, timeout=timeout),
                    check)


class Background:
    """A command (a ``dstrain launch``) started in the background, its output kept in files (a pipe nobody
    reads would fill and stall the job); :meth:`result` waits for it, as ``subprocess.run`` would."""

    def __init__(self, cmd: list[str], env: dict):
        self._logs = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        self.popen = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self._logs[0], stderr=self._logs[1])
        self.proc: subprocess.CompletedProcess | None = None

    def result(self, timeout: int = 900, check: bool = True) -> subprocess.CompletedProcess:
        if self.proc is None:
            code = self.popen.wait(timeout=timeout)
            text = []
            for log in self._logs:
                log.seek(0)
                text.append(log.read().decode("utf-8", "replace"))
                log.close()
            self.proc = subprocess.CompletedProcess(self.popen.args, code, text[0], text[1])
        return _checked(self.proc, check)

    def stop(self) -> None:
        """End the job (SIGTERM to ``dstrain launch``, which stops its ranks; SIGKILL if it lingers)."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@contextlib.contextmanager
def beside(args: list[str], env: dict | None = None, nproc: int = 2):
    """Run a launch in the background while the ``with`` block does other work (another, independent launch:
    on a 2-core machine their single-threaded start-ups overlap); ``.result()`` after the block. Ended if the
    block fails."""
    job = Background(*launch_command(args, env, nproc))
    try:
        yield job
    except BaseException:
        job.stop()
        raise


REFERENCE_STEPS, REFERENCE_EVERY = 8, 2


def reference_overrides(out: Path, profile: str) -> list[str]:
    """The uninterrupted reference run several tests compare with (shared: tests/dist/conftest.py
    ``gpt_reference``): 8 steps of 2 x 2 micro-batches per rank on 2 ranks, a checkpoint every 2 steps, all kept."""
    return overrides(out, REFERENCE_STEPS, f"--deepspeed.profile={profile}",
                     f"--checkpoint.every={REFERENCE_EVERY}", "--checkpoint.keep=4")


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
