"""``dstrain`` command line: train, launch, plan, bench, export, check-config.

Every subcommand that takes a recipe also takes dotted overrides
(``--train.lr=3e-4 --model.size=small``) that win over the file. Config problems
print one line naming the file and the key and exit with status 2 before
anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

EXIT_CONFIG = 2


def _split_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """Dotted ``--a.b=c`` overrides vs anything else (reported as an error)."""
    overrides, unknown = [], []
    for item in extra:
        if item.startswith("--local_rank"):
            continue  # added by `deepspeed` without --no_local_rank; LOCAL_RANK is in the env
        (overrides if item.startswith("--") and "." in item.split("=", 1)[0] else unknown).append(item)
    return overrides, unknown


def _load(recipe: str, overrides: list[str], resume: bool = False):
    from dstrain.config import load_run_config
    cfg = load_run_config(recipe, overrides)
    if resume:
        cfg.checkpoint.resume = True
    return cfg


# ---------------------------------------------------------------- subcommands

def cmd_train(args, overrides) -> int:
    cfg = _load(args.recipe, overrides, args.resume)
    from dstrain.runtime import use_cpu_accelerator_if_no_gpu
    use_cpu_accelerator_if_no_gpu()
    from dstrain.trainers.lm import train
    summary = train(cfg)
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(summary), flush=True)
    return 0


def cmd_launch(args, overrides) -> int:
    _load(args.recipe, overrides)  # fail here, once, rather than on every rank
    from dstrain import launcher
    extra = tuple(overrides) + (("--resume",) if args.resume else ())
    spec = launcher.LaunchSpec(recipe=args.recipe, overrides=extra, nproc=args.nproc,
                               hostfile=args.hostfile, master_addr=args.master_addr,
                               master_port=args.master_port or launcher.find_free_port(),
                               num_nodes=args.num_nodes)
    spec.validate()
    if args.launcher == "torchrun":
        argv, env = launcher.build_torchrun_command(spec)
    else:
        argv, env = launcher.build_deepspeed_command(spec)
    delta = {k: v for k, v in env.items() if os.environ.get(k) != v}
    print(launcher.format_command(argv, delta), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(argv, env=env)


def cmd_plan(args, overrides) -> int:
    cfg = _load(args.recipe, overrides)
    if args.device_memory:
        cfg.deepspeed.device_memory = args.device_memory
    from dstrain.engine.factory import plan_engine
    world = args.world_size or 1
    device = args.device or ("cuda" if args.device_memory else None)
    plan = plan_engine(cfg, world, ranks_per_node=min(world, args.gpus_per_node), device_type=device)
    print(plan.explanation)
    if args.show_json:
        print(json.dumps(plan.ds_config, indent=2))
    return 0


def cmd_check_config(args, overrides) -> int:
    from dstrain.config import RunConfig, read_json, run_config_from_dict
    data = read_json(args.file)
    sections = {f for f in RunConfig.__dataclass_fields__}
    if set(data) <= sections:
        run_config_from_dict(data, args.file, overrides)
        print(f"{args.file}: valid run config")
        return 0
    from dstrain.engine.ds_check import check_ds_file
    print(check_ds_file(args.file))
    return 0


def cmd_export(args, overrides) -> int:
    from dstrain.checkpoint import export_safetensors
    out = export_safetensors(args.checkpoint, args.out)
    print(f"wrote {out}")
    return 0


def cmd_bench(args, overrides) -> int:
    from dstrain import bench
    return bench.main([args.recipe, *overrides, *args.bench_args])


# ---------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstrain", allow_abbrev=False,
                                description="DeepSpeed-centric training driven by JSON configs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", allow_abbrev=False, help="run training (what each rank runs)")
    t.add_argument("recipe")
    t.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    t.set_defaults(func=cmd_train)

    la = sub.add_parser("launch", allow_abbrev=False, help="build and run the deepspeed command")
    la.add_argument("recipe")
    la.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per node")
    la.add_argument("--hostfile")
    la.add_argument("--num-nodes", type=int)
    la.add_argument("--master-addr")
    la.add_argument("--master-port", type=int)
    la.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    la.add_argument("--resume", action="store_true")
    la.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    la.set_defaults(func=cmd_launch)

    pl = sub.add_parser("plan", allow_abbrev=False, help="print the memory plan without training")
    pl.add_argument("recipe")
    pl.add_argument("--world-size", type=int, help="data-parallel ranks to plan for")
    pl.add_argument("--device-memory", help='memory of one device, e.g. "80GB" (plans for GPUs)')
    pl.add_argument("--gpus-per-node", type=int, default=8)
    pl.add_argument("--device", choices=["cpu", "cuda"])
    pl.add_argument("--show-json", action="store_true", help="also print the resolved DeepSpeed JSON")
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("check-config", allow_abbrev=False, help="validate a run config or a DeepSpeed JSON")
    c.add_argument("file")
    c.set_defaults(func=cmd_check_config)

    e = sub.add_parser("export", allow_abbrev=False, help="consolidated fp32 safetensors from a checkpoint")
    e.add_argument("checkpoint", help="output folder, checkpoints folder or one step_* folder")
    e.add_argument("out", help="a .safetensors file or a folder")
    e.set_defaults(func=cmd_export)

    b = sub.add_parser("bench", allow_abbrev=False, help="throughput benchmark (see benchmarks/throughput.py)")
    b.add_argument("recipe")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from dstrain.config import ConfigError
    from dstrain.engine.ds_config import DSConfigError
    from dstrain.engine.profiles import PlanError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides, unknown = _split_overrides(extra)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args, overrides)
    except (ConfigError, DSConfigError, PlanError) as err:
        print(f"dstrain: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except (FileNotFoundError, ValueError) as err:
        if args.command in ("export", "check-config", "plan"):
            print(f"dstrain: error: {err}", file=sys.stderr)
            return EXIT_CONFIG
        raise


if __name__ == "__main__":
    sys.exit(main())
