"""Host work of one training step per ZeRO profile: operations dispatched in forward, backward and step.

    python benchmarks/step_ops.py [RECIPE] [--profiles zero0,zero1,zero2,zero3] [--model-args JSON]
        [--deepspeed-norms] [--out benchmarks/results/step_ops_cpu.json] [--a.b=c ...]

On a GPU every dispatched operation is a kernel launch of a few microseconds of host time;
where the step waits for the device (the non-finite check, a loss read), launches that follow
run with the device idle. This counts them, on any machine (one process, world size 1, gloo on
the CPU): every ATen operation dispatched by ``engine(x, y)``, ``engine.backward(loss)`` and
``engine.step()`` of one step after a warm-up step (a ``TorchDispatchMode``), and the host
time of each phase (without the counting; on the CPU it includes the arithmetic).

The model: the recipe's, by default the GPT recipe at ``--model.size=large`` with a narrow width
(``--model-args '{"n_embd": 64, "n_head": 4}'``): GPT large's parameter tensors, small
arithmetic. Precision as the factory runs it on a GPU: bf16, as ``torch.autocast`` at ZeRO-0 and as
DeepSpeed's bf16 at ZeRO-1/2/3. ``--deepspeed-norms`` also measures each profile with DeepSpeed's own
gradient clipping (ZeRO-0), ZeRO-1/2 norm (``dstrain/engine/grad_norm.py`` replaces both) and bf16
overflow check (which the factory turns off under dstrain's non-finite guard), for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dstrain.bench_args import check_out  # noqa: E402


def _counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return Count


def measure(recipe: str, profile: str, model_args: str, overrides: list[str], deepspeed_norms: bool) -> dict:
    import torch

    from dstrain.config import load_run_config
    from dstrain.engine.factory import create_engine, plan_engine
    from dstrain.resilience import NonFiniteGuard
    from models import registry
    mixed = "autocast" if profile == "zero0" else "deepspeed"
    cfg = load_run_config(recipe, ["--model.size=large", f"--model.args={model_args}", "--train.micro_batch=1",
                                   "--data.seq_len=32", "--deepspeed.precision=bf16", f"--deepspeed.profile={profile}",
                                   f"--deepspeed.mixed_precision={mixed}", "--train.compile=false", *overrides])
    spec = registry.get_spec(cfg.model.name)
    mcfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    plan = plan_engine(cfg, 1, ranks_per_node=1, device_type="cpu")
    if deepspeed_norms and isinstance(plan.ds_config.get("bf16"), dict):  # DeepSpeed's default
        plan.ds_config["bf16"].pop("check_grad_overflow", None)
    torch.manual_seed(0)
    engine = create_engine(lambda: spec.build(mcfg), spec.parallelize, plan, cfg.train)
    if deepspeed_norms:
        for owner, name in ((engine.ds, "clip_fp32_gradients"), (engine.ds.optimizer, "get_grad_norm_direct")):
            if name in vars(owner):
                delattr(owner, name)
    t = cfg.train
    engine.watch(NonFiniteGuard(t.nonfinite, t.max_consecutive_skips, 0, 1))  # as `dstrain train` runs
    vocab = getattr(mcfg, "vocab_size", 256)
    gen = torch.Generator().manual_seed(1)
    Count = _counter()

    def step(counting: bool) -> dict:
        x = torch.randint(0, vocab, (1, cfg.data.seq_len), generator=gen)
        out = {}
        for phase, fn in (("forward", lambda: engine(x, torch.roll(x, -1, 1))), ("backward", None),
                          ("step", lambda: engine.step())):
            if phase == "backward":
                fn = lambda: engine.backward(loss)  # noqa: E731
            start = time.perf_counter()
            if counting:
                with Count() as c:
                    result = fn()
                out[phase] = c.ops
            else:
                result = fn()
                out[phase] = (time.perf_counter() - start) * 1e3
            if phase == "forward":
                loss = result
        return out

    step(False)  # warm-up: optimizer state, buffers
    ops = step(True)
    times = [step(False) for _ in range(3)]
    ms = {k: sorted(r[k] for r in times)[1] for k in ops}
    params = sum(1 for p in engine.module.parameters())
    return {"profile": profile, "precision": plan.precision, "mixed_precision": mixed, "parameter_tensors": params,
            "ops": ops, "host_ms": ms, "deepspeed_norms": deepspeed_norms}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("recipe", nargs="?", default="models/gpt/recipes/tiny.json",
                   help="run config measured, at GPT size large cut by --model-args (default: %(default)s); "
                        "--section.key=value overrides follow it")
    p.add_argument("--profiles", default="zero0,zero1,zero2,zero3",
                   help="comma-separated ds_configs profiles (default: %(default)s)")
    p.add_argument("--model-args", default='{"n_embd": 64, "n_head": 4}',
                   help="JSON object of model.args over the large size (default: %(default)s)")
    p.add_argument("--deepspeed-norms", action="store_true",
                   help="also measure with DeepSpeed's own norm code and bf16 overflow check")
    p.add_argument("--out", default="benchmarks/results/step_ops_cpu.json",
                   help="result JSON file (default: the committed benchmarks/results/step_ops_cpu.json)")
    args, overrides = p.parse_known_args(argv)
    check_out(p, args.out)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", "29577")
    import deepspeed
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    rows = []
    for profile in args.profiles.split(","):
        for ds_norms in ((False, True) if args.deepspeed_norms else (False,)):
            row = measure(args.recipe, profile, args.model_args, overrides, ds_norms)
            rows.append(row)
            label = profile + (" (DeepSpeed's own)" if ds_norms else "")
            print(f"{label:34s} {row['parameter_tensors']} tensors  ops forward {row['ops']['forward']:5d}  backward "
                  f"{row['ops']['backward']:5d}  step {row['ops']['step']:5d}   host ms "
                  + "  ".join(f"{k} {v:.1f}" for k, v in row["host_ms"].items()), flush=True)
    result = {"rows": rows, "recipe": args.recipe, "model_args": args.model_args, "overrides": overrides,
              "device": f"cpu ({platform.processor() or platform.machine()}), 1 thread",
              "torch": torch.__version__, "deepspeed": deepspeed.__version__, "python": platform.python_version(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/step_ops.py", *(argv if argv is not None else sys.argv[1:])])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
