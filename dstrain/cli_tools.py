"""The ``dstrain`` commands that neither train nor launch: ``hostfile``, ``plan``, ``check-config`` and ``export``
(``dstrain.cli`` builds the parser and dispatches to them)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dstrain.cli import EXIT_CONFIG, _adopt, _adopted_lines, _load, _task_file_problem


def cmd_hostfile(args, overrides) -> int:
    """Write ``host slots=N`` lines from HOST[:SLOTS] arguments or from SLURM's node list."""
    from dstrain import hostfile as hf
    try:
        if args.from_slurm == bool(args.hosts):
            raise hf.HostfileError("give host names or --from-slurm (one of the two)")
        hosts = (hf.hosts_from_slurm(os.environ, args.slots) if args.from_slurm
                 else hf.parse_host_list(args.hosts, 1 if args.slots is None else args.slots))
    except ValueError as err:
        print(f"dstrain: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    text = hf.format_hostfile(hosts)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as err:
            print(f"dstrain: error: -o {args.output}: cannot write it: {err.strerror or err}", file=sys.stderr)
            return EXIT_CONFIG
        print(f"wrote {args.output}: {len(hosts)} host(s), {sum(s for _, s in hosts)} slot(s)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def _fewest_ranks(cfg) -> int:
    """The default world size of ``plan`` and ``check-config``: the fewest ranks the run config's layout takes
    (tp x sp x pp; pp 2: 2 ranks, not 1; ``pp: auto`` counts as 1)."""
    par = cfg.parallel
    return par.tp * par.sp * (par.pp if isinstance(par.pp, int) else 1)


def cmd_plan(args, overrides) -> int:
    from models.registry import planning_without_weights
    with planning_without_weights() as weightless:  # a checkpoint folder may hold only its config.json here
        return _plan(args, overrides, weightless)


def _plan(args, overrides, weightless: list[str]) -> int:
    cfg = _load(args.recipe, overrides)
    for note in weightless:  # model.args.path without weights: planned from its config.json
        print(f"dstrain: note: {note}", file=sys.stderr)
    if args.gpus_per_node < 1:  # (0 was taken as "1 rank a node", -2 was refused by the planner)
        from dstrain.config import ConfigError
        raise ConfigError("command line", "--gpus-per-node", f"must be at least 1, got {args.gpus_per_node}")
    if args.device_memory:
        cfg.deepspeed.device_memory = args.device_memory
    from dstrain.engine.factory import plan_engine
    world = _fewest_ranks(cfg) if args.world_size is None else args.world_size  # 0 is refused below, as -1 is
    if args.world_size is None and world > 1:  # (1 rank was planned, and refused, for an sp 2 recipe)
        print(f"dstrain: note: planning for {world} ranks, the fewest the recipe's parallel layout takes "
              "(--world-size N plans for more)", file=sys.stderr)
    for line in _adopted_lines(_adopt(cfg, world)):
        print(line, file=sys.stderr)
    from dstrain.engine.ds_check import this_device
    from dstrain.engine.ds_preflight import check_run
    device = args.device or ("cuda" if args.device_memory else this_device())  # DS_ACCELERATOR=cpu: CPU ranks
    if device == "cpu" and not args.device:
        from dstrain.launch_check import cpu_fallback_note
        if note := cpu_fallback_note("auto", then="planning for this CPU (--device cuda plans for a GPU)"):
            print(f"dstrain: note: {note}", file=sys.stderr)  # a GPU machine whose GPU torch cannot see
    for note in check_run(cfg, world, device):  # the checks a launch runs
        print(f"dstrain: note: {note}", file=sys.stderr)
    plan = plan_engine(cfg, world, ranks_per_node=min(world, args.gpus_per_node), device_type=device)
    print(plan.explanation)
    from dstrain.trainers import get_trainer
    for note in getattr(get_trainer(cfg.trainer), "plan_notes", lambda c, p: [])(cfg, plan):
        print(f"dstrain: note: {note}", file=sys.stderr)
    if args.show_json:
        print(json.dumps(plan.ds_config, indent=2))
    report = getattr(get_trainer(cfg.trainer), "plan_report", None)  # trainers with several models
    if report is not None:
        table, problem = report(cfg, plan, world, min(world, args.gpus_per_node), device, args.gpus_per_node)
        print(table)
        if problem:
            print(f"dstrain: error: {problem}", file=sys.stderr)
            return EXIT_CONFIG
    if note := _data_note(cfg):  # policy RL: prompts against task.max_prompt_tokens (tasks read where cheap)
        print(f"dstrain: note: {note}", file=sys.stderr)
    return 0


def _data_note(cfg) -> str | None:
    """A policy-RL run's line on its prompts against ``task.max_prompt_tokens`` (tasks read where cheap)."""
    from dstrain.trainers.prompt_limit import POLICY_TRAINERS, prompt_note
    return prompt_note(cfg) if cfg.trainer in POLICY_TRAINERS else None


def cmd_check_config(args, overrides) -> int:
    from dstrain.config import ConfigError, RunConfig, read_json, run_config_from_dict
    try:
        data = read_json(args.file)
    except (ConfigError, UnicodeDecodeError):
        data = None  # not plain JSON: a DeepSpeed file may still be (comments: DeepSpeed reads hjson), or named there
        from dstrain.cli_checks import loose_run_config
        if loose_run_config(args.file) or Path(args.file).is_dir():  # a run config with comments: said so, not
            raise  # checked as a DeepSpeed JSON; a folder: named as one
    sections = {f for f in RunConfig.__dataclass_fields__}
    from dstrain.engine.ds_files import nests_ds_config
    if data and set(data) <= sections and not nests_ds_config(data):  # an empty {} is a DeepSpeed JSON that leaves everything to the run
        cfg = run_config_from_dict(data, args.file, overrides)
        if cfg.deepspeed.profile != "auto":  # the DeepSpeed JSON it names, against it, as a launch checks it
            from dstrain.engine.ds_check import this_device
            from dstrain.engine.ds_preflight import adopt_file_values, check_run
            world = _fewest_ranks(cfg) if args.world_size is None else args.world_size
            adopt_file_values(cfg, world)
            for note in check_run(cfg, world, args.device or this_device()):
                print(f"dstrain: note: {note}", file=sys.stderr)
        if (missing := _task_file_problem(cfg)) is not None:  # valid, but better heard now than at launch
            print(f"dstrain: note: {missing}", file=sys.stderr)
        elif note := _data_note(cfg):
            print(f"dstrain: note: {note}", file=sys.stderr)
        print(f"{args.file}: valid run config"
              + (f" with {cfg.deepspeed.profile} on {world} rank(s)"
                 if cfg.deepspeed.profile != "auto" else ""))
        return 0
    if overrides:  # they would be dropped without a word
        raise ConfigError("command line", overrides[0].split("=", 1)[0].lstrip("-"),
                          f"overrides apply to a run config; {args.file} is a DeepSpeed JSON")
    from dstrain.engine.ds_check import check_ds_file
    print(check_ds_file(args.file, device_type=args.device, world_size=args.world_size))
    return 0


def cmd_export(args, overrides) -> int:
    from dstrain.checkpoint import export_safetensors
    from dstrain.cli_checks import export_target_problem
    if problem := export_target_problem(args.out):  # before the weights are gathered
        print(f"dstrain: error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    if Path(args.out).suffix != ".safetensors":  # a policy run exports into a folder as a HF checkpoint
        from dstrain.trainers.policy_rl import export_policy_checkpoint
        if (folder := export_policy_checkpoint(args.checkpoint, args.out)) is not None:
            print(f"wrote a Hugging Face checkpoint to {folder} (--model.args.path={folder} loads it)")
            return 0
    out = export_safetensors(args.checkpoint, args.out)
    print(f"wrote {out}")
    return 0
