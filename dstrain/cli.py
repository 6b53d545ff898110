"""``dstrain`` command line: train, launch, hostfile, plan, bench, export, check-config.

Every subcommand that takes a recipe also takes dotted overrides
(``--train.lr=3e-4 --model.size=small``) that win over the file. Config problems
print one line naming the file and the key and exit with status 2 before
anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dstrain.cli_checks import _only_launch_folders, _remove_if_only_cache  # (rank 0's clean-up of a failed fresh run)

EXIT_CONFIG = 2


def _split_overrides(extra: list[str]) -> tuple[list[str], list[str]]:
    """Config overrides (``--a.b=c``, or ``--trainer=x`` for a top-level key) vs anything else."""
    overrides, unknown = [], []
    for item in extra:
        if item.startswith("--local_rank"):
            continue  # added by `deepspeed` without --no_local_rank; LOCAL_RANK is in the env
        is_override = item.startswith("--") and ("." in item.split("=", 1)[0] or "=" in item)
        (overrides if is_override else unknown).append(item)
    return overrides, unknown


def _load(recipe: str, overrides: list[str], resume: bool = False):
    from dstrain.cli_checks import deepspeed_json_as_recipe
    from dstrain.config import ConfigError, load_run_config
    try:
        cfg = load_run_config(recipe, overrides)
    except ConfigError as err:
        raise deepspeed_json_as_recipe(recipe, err) or err from None
    cfg.output.dir = os.path.expanduser(cfg.output.dir)  # "--output.dir=~/runs/x": the shell leaves "~" after "="
    if resume:
        cfg.checkpoint.resume = True
    return cfg


def _task_file_problem(cfg):
    """A task or corpus file the ranks would not find or read (see :mod:`dstrain.cli_checks`), else None."""
    from dstrain.cli_checks import corpus_problem, task_file_problem
    return task_file_problem(cfg) or corpus_problem(cfg)


def _adopt(cfg, world_size: int) -> list[tuple[str, object, str]]:
    """``deepspeed.values_from_file``: the DeepSpeed JSON's explicit values into ``cfg``; what changed."""
    from dstrain.engine.ds_preflight import adopt_file_values
    return adopt_file_values(cfg, world_size)


def _adopted_lines(adopted) -> list[str]:
    from dstrain.engine.ds_config import format_override
    return [f"dstrain: {key}={format_override(value)} adopted from {where}" for key, value, where in adopted]


_TRAIN_STARTED = False
"""Set once a rank's checks have passed and its trainer starts (see :func:`_reports_failure`)."""


def _reports_failure() -> bool:
    """Whether this rank prints its failure: once per job, by the first rank that failed.

    Checks before the trainer starts find the same on every rank: rank 0 reports. After
    that, the first rank to fail claims ``$DSTRAIN_FAILURE_DIR/first_failure`` (a folder
    ``dstrain launch`` makes for the job) before its process exits, so that the ranks its
    exit breaks (gloo's "Connection closed by peer" and the like) stay quiet. Without the
    folder (ranks started by hand) every rank reports.
    """
    if not _TRAIN_STARTED:
        return int(os.environ.get("RANK", 0)) == 0
    folder = os.environ.get("DSTRAIN_FAILURE_DIR")
    if not folder:
        return True
    try:
        fd = os.open(os.path.join(folder, "first_failure"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    except OSError:
        return True
    os.write(fd, os.environ.get("RANK", "0").encode())
    os.close(fd)
    return True


# ---------------------------------------------------------------- subcommands

def cmd_train(args, overrides) -> int:
    """One rank: the checks ``dstrain launch`` runs (refused before anything is written), then the trainer."""
    global _TRAIN_STARTED
    from dstrain import rank_exit
    cfg = _load(args.recipe, overrides, args.resume)
    from dstrain.runtime import release_cpu_comm_buffer, shutdown_distributed, use_cpu_accelerator_if_no_gpu
    use_cpu_accelerator_if_no_gpu()
    from dstrain.runtime import check_given_rank_env, ranks_use_cuda
    check_given_rank_env(gpus=_visible_gpus() if ranks_use_cuda() else None)  # before WORLD_SIZE is read
    world = int(os.environ.get("WORLD_SIZE", 1))
    adopted = _adopt(cfg, world)
    from dstrain.engine.ds_preflight import check_run
    notes = check_run(cfg, world, "cpu" if os.environ.get("DS_ACCELERATOR") == "cpu" else "cuda")
    if int(os.environ.get("RANK", 0)) == 0:
        for line in _adopted_lines(adopted):
            print(line, flush=True)
        if "DSTRAIN_FAILURE_DIR" not in os.environ:  # not started by dstrain launch, which printed them
            for note in notes:
                print(f"dstrain: note: {note}", file=sys.stderr, flush=True)
    from dstrain.trainers import get_trainer
    out = Path(cfg.output.dir)
    fresh = not out.exists() or _only_launch_folders(out)
    _TRAIN_STARTED = True
    try:
        summary = get_trainer(cfg.trainer).train(cfg)
        code = rank_exit.stop_exit_code(summary, cfg.train.steps)  # stopped early by a signal: 128 + N
    except BaseException:
        if os.environ.get("DS_ACCELERATOR") == "cpu":  # peers are failing too; the file goes either way
            release_cpu_comm_buffer(int(os.environ.get("RANK", 0)))
        if fresh and int(os.environ.get("RANK", 0)) == 0:
            _remove_if_only_cache(out)
        raise
    shutdown_distributed()  # a barrier first: every peer is done with this rank's shared memory
    if os.environ.get("DS_ACCELERATOR") == "cpu":
        release_cpu_comm_buffer(int(os.environ.get("RANK", 0)))
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(summary), flush=True)
        if code:
            print(rank_exit.stop_line(summary, cfg.train.steps, out / "checkpoints", code), file=sys.stderr, flush=True)
    if code:
        rank_exit.note_stopped(code)
        if int(os.environ.get("RANK", 0)) == 0:  # torchrun --max-restarts would restart it: dstrain.elastic
            from dstrain import checkpoint as ckpt
            from dstrain import elastic
            elastic.note_stopped_job(out, code, int(summary.get("step", 0)), ckpt.find_latest(out / "checkpoints"))
    return code


def _visible_gpus() -> int:
    import torch
    return torch.cuda.device_count()


def cmd_launch(args, overrides) -> int:
    """Validate the recipe once, build the deepspeed/torchrun command, run it (or print it).

    Ranks run ``python -m dstrain.cli train RECIPE [overrides] [--resume]``. Ranks on
    other hosts (deepspeed with a hostfile naming them) start through pdsh, which
    forwards only a few variables and the lines of ``.deepspeed_env``: the ones the
    ranks need are written there unless the file is someone else's. SIGINT, SIGTERM
    (and SIGHUP unless ignored) go to the launcher's whole process group; the
    return value is its exit status (128+N when killed by signal N).
    """
    from dstrain.cli_checks import JOBS_STARTED, nested_launch_problem
    JOBS_STARTED.clear()  # (this launch's, for the Ctrl-C line in main)
    if nested := nested_launch_problem():  # `deepspeed -m dstrain.cli launch`: one job per rank, on one folder
        if os.environ.get("LOCAL_RANK") == "0":  # said once per host, every rank leaves
            print(f"dstrain: error: {nested}", file=sys.stderr)
        return EXIT_CONFIG
    cfg = _load(args.recipe, overrides)  # fail here, once, rather than on every rank
    if not args.hostfile and (missing := _task_file_problem(cfg)):  # one machine: named before any rank starts
        raise missing
    if args.max_restarts < 0:
        print(f"dstrain: error: --max-restarts must not be negative, got {args.max_restarts}", file=sys.stderr)
        return EXIT_CONFIG
    import contextlib
    import shutil
    import signal
    import tempfile

    from dstrain import launcher, rank_exit
    try:
        sizes = launcher.launch_world_size(launcher.spec_from_args(args, []), torchrun=args.launcher == "torchrun")
    except (ValueError, OSError):
        sizes = None  # a bad launch spec: the command builder below names the problem
    adopted = _adopt(cfg, sizes[0] if sizes else 1)
    from dstrain.engine.ds_preflight import adopted_overrides
    overrides = [*overrides, *adopted_overrides(adopted)]  # the ranks see them on their command line
    if args.master_port is None:  # one node: any free port; several: the one port every node can agree on
        one_node = args.hostfile is None and (args.num_nodes or 1) == 1
        args.master_port = launcher.find_free_port() if one_node else launcher.DEFAULT_MASTER_PORT
    from dstrain import launch_check
    try:  # a bad hostfile, an unknown or unreachable host: refused before anything starts
        hosts = launch_check.check_hosts_for_launch(launcher.spec_from_args(args, []), torchrun=args.launcher == "torchrun",
                                                    reach=not (args.dry_run or args.no_ssh_check))
    except (ValueError, OSError) as err:
        print(f"dstrain: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if hosts.remote and not args.master_addr:
        args.master_addr = hosts.master_addr  # the first host's address as resolved here (see launch_check)
    port_problem = None if args.dry_run else launch_check.master_port_problem(args.master_addr, args.master_port)
    if hosts.remote and args.launcher != "torchrun" and not args.dry_run:
        from dstrain.hostfile import pdsh_problem
        port_problem = port_problem or pdsh_problem()  # else DeepSpeed's traceback, after the launch began
    if port_problem:  # rank 0's store could not listen there (and the other ranks would reach whoever does)
        print(f"dstrain: error: {port_problem}", file=sys.stderr)
        return EXIT_CONFIG
    if hosts.remote and args.launcher == "torchrun" and not args.local_addr:
        args.local_addr = hosts.local_addr  # this machine's hostfile entry, else torchrun's own guess
    extra = [*overrides, *(["--resume"] if args.resume else [])]
    build = launcher.build_torchrun_command if args.launcher == "torchrun" else launcher.build_deepspeed_command
    try:
        argv, env = build(launcher.spec_from_args(args, extra))
    except (ValueError, OSError) as err:
        print(f"dstrain: error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    accelerator = env.get("DS_ACCELERATOR") or launcher.detect_accelerator()
    fallback = None if hosts.remote or accelerator != "cpu" else launch_check.cpu_fallback_note(args.accelerator)
    if fallback:  # a GPU machine whose GPU torch cannot see: CPU ranks, said in one line
        print(f"dstrain: note: {fallback}", file=sys.stderr)
    problem = launch_check.rank_shortfall(launcher.spec_from_args(args, []), hosts.remote, accelerator,
                                          torchrun=args.launcher == "torchrun")
    cores = None if problem else launch_check.cpu_cores_note(launcher.spec_from_args(args, []), hosts.remote,
                                                               accelerator, torchrun=args.launcher == "torchrun")
    if cores:  # --nproc 3 on 2 cores: allowed, said
        print(f"dstrain: note: {cores}", file=sys.stderr)
    named = args.accelerator if args.accelerator != "auto" else os.environ.get("DS_ACCELERATOR") or accelerator
    no_gpu = None if problem else launch_check.no_gpu_problem(named, hosts.remote)
    if no_gpu and args.dry_run:  # (a dry run on a login node prints the command meant for the GPU nodes)
        print(f"dstrain: note: {no_gpu}", file=sys.stderr)
        no_gpu = None
    problem = problem or no_gpu or launch_check.nccl_problem(accelerator, hosts.remote)
    problem = problem or _output_problem(cfg, args.resume)
    if problem is None and args.resume:  # HRM: a checkpoint's ACT carry on another layout, refused by rank 0 too
        from dstrain.cli_checks import resume_layout_problem
        problem = resume_layout_problem(cfg, sizes[0] if sizes else None)
    if problem is None and not args.resume:
        from dstrain.cli_checks import check_before_launch
        problem = check_before_launch(cfg, args, accelerator)
    if problem:
        print(f"dstrain: error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    from dstrain.cli_checks import resume_note
    notes = [f"dstrain: note: {note}"] if args.resume and (note := resume_note(cfg)) else []
    for line in [*_adopted_lines(adopted), *notes]:
        print(line, file=sys.stderr)
    print(launcher.format_command(argv, launcher.env_delta(env)), flush=True)

    shared_failures = rank_exit.launch_failure_dir(cfg.output.dir, hosts.remote and args.launcher != "torchrun")
    out_fresh = not Path(cfg.output.dir).exists()
    if shared_failures:  # ranks on other hosts write their errors where this launcher reads them (see rank_exit)
        env["DSTRAIN_FAILURE_DIR"] = shared_failures
    lines, path = "", Path(os.environ.get("DS_ENV_FILE", ".deepspeed_env"))
    if "--hostfile" in argv:  # DeepSpeed reads ~/NAME and ./NAME, NAME = $DS_ENV_FILE or .deepspeed_env
        marker = "DSTRAIN_WROTE_DEEPSPEED_ENV=1\n"  # first line of a file dstrain wrote (no comments allowed)
        needed = launcher.rank_env(env) | launcher.env_delta(env)
        lines = launcher.deepspeed_env_file(needed, env.get("DS_ACCELERATOR", "cuda"))
        old = path.read_text() if path.is_file() else None
        if old is not None and old.startswith(marker):  # a variable the user added there stays
            lines += "".join(line + "\n" for line in launcher.user_env_lines(old, lines))
        shown = " ".join(lines.splitlines()) or "(nothing)"
        if old is not None and not old.startswith(marker):
            if not set(lines.splitlines()) <= set(old.splitlines()):
                print(f"dstrain: warning: {path} was not written by dstrain; left as is. Ranks on other hosts "
                      f"need these lines in it: {shown}", file=sys.stderr)
        elif old is None and not lines:
            pass  # nothing to forward, no stale file of ours to clear
        elif args.dry_run:
            print(f"dstrain: would write {path} for ranks on other hosts: {shown}", file=sys.stderr)
        else:
            path.write_text(marker + lines)
            print(f"dstrain: wrote {path} for ranks on other hosts: {shown}", file=sys.stderr)
    if args.dry_run:
        for line in launch_check.launch_summary(hosts, argv, env, args.master_port, str(path), lines,
                                                torchrun=args.launcher == "torchrun"):
            print(f"dstrain: {line}", file=sys.stderr)
        return 0

    errors: list[str | None] = []  # each attempt's first unexpected error and where (see run_with_restarts)

    def run_once(argv, env) -> int:
        if shared_failures:  # in output.dir, which every host shares: the same path each attempt (.deepspeed_env);
            shutil.rmtree(shared_failures, ignore_errors=True)  # emptied (a launcher killed outright left its own)
            os.makedirs(shared_failures, exist_ok=True)
            failures = shared_failures
        else:
            failures = tempfile.mkdtemp(prefix="dstrain-job-")
        env["DSTRAIN_FAILURE_DIR"] = failures  # see _reports_failure
        from dstrain.cli_checks import JOBS_STARTED
        from dstrain.job_guard import start_job, stop_job, wait_for_group  # own group (Ctrl-C reaches us only), ended
        proc = start_job(argv, env, args.master_port)  # with a stop if this process is killed outright
        JOBS_STARTED.append(proc.pid)

        got = []  # the signals forwarded: the job ends as stopped by the first (128 + N), never restarted

        def forward(signum, _frame):
            got.append(signum)
            rank_exit.note_forwarded(failures, signum)  # rank 0's stop line names it, not the SIGTERM passed on
            # as SIGTERM to the ranks (they save and leave; see job_guard.stop_job); a second Ctrl-C / SIGTERM:
            # the ranks did not stop in time for the user, so the job goes now
            if len(got) > 1:
                print("dstrain: a second stop signal: killing the job now (the stop's checkpoint, if not yet "
                      "complete, is not written; --resume takes the latest complete one)", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            else:
                stop_job(proc.pid, signal.SIGTERM)

        signals = [signal.SIGINT, signal.SIGTERM]
        if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:  # nohup sets it to SIG_IGN: keep it so
            signals.append(signal.SIGHUP)
        previous = {sig: signal.signal(sig, forward) for sig in signals}
        try:
            code = proc.wait()
            if got:  # DeepSpeed's runner leaves at once on a signal, its ranks may still be saving
                wait_for_group(proc.pid)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if env.get("DS_ACCELERATOR") == "cpu":  # ranks that crashed or were killed leave theirs behind
                from dstrain.runtime import release_job_comm_buffers
                release_job_comm_buffers(args.master_port)
            stopped = rank_exit.stopped_code(failures)  # a rank stopped by a signal sent to it, not to us
            failed = rank_exit.failed_code(failures)
            errors.append(rank_exit.error_of(failures))  # (the first failing rank's: compared across restarts)
            shutil.rmtree(failures, ignore_errors=True)
            if shared_failures and out_fresh:  # output.dir made for it, and the failed run left nothing else there
                with contextlib.suppress(OSError):
                    Path(cfg.output.dir).rmdir()
        if got:
            if hosts.remote and args.launcher != "torchrun":  # the other hosts' ranks may still be saving
                print(launch_check.remote_stop_line(Path(cfg.output.dir), got[0]), file=sys.stderr, flush=True)
            return 128 + got[0]
        if stopped and code:  # (torchrun reports a rank's 128 + N as 1)
            return stopped
        if failed and code:  # the first rank's reason (3, 4, 124), not a peer's exit 1 the launcher saw first
            return failed
        if code == 255 and hosts.remote and args.launcher != "torchrun":  # pdsh -S: ssh's own failure
            print(f"dstrain: {launch_check.ssh_ended_line(hosts.hosts)}", file=sys.stderr, flush=True)
            return code  # a failure, restarted (not 128 + SIGHUP, a stop)
        if 128 + 64 < code < 256:  # DeepSpeed's launcher exits with -N when a rank died of signal N
            where = ("" if not hosts.remote or args.launcher == "torchrun" else  # pdsh -S: the largest host status
                     f" on one of {', '.join(h for h, _ in hosts.hosts)} (the 'pdsh@... HOST: ssh exited with exit code "
                     f"{code}' line above names it)")
            print(f"dstrain: a rank{where} was killed by signal {256 - code} ({signal.Signals(256 - code).name}"
                  f"{': out of memory, or killed by hand' if code == 256 - 9 else ''})", file=sys.stderr, flush=True)
            return 128 + 256 - code
        return 128 - code if code < 0 else code

    def attempt(restart: bool) -> int:
        if not restart:
            return run_once(argv, env)
        if args.hostfile is None and (args.num_nodes or 1) == 1:
            args.master_port = launcher.find_free_port()  # the dead attempt's port may linger
        elif hosts.remote and args.launcher != "torchrun" and not args.no_ssh_check and \
                (gone := launch_check.gone_hosts_problem(hosts.hosts, args.hostfile)):
            print(f"dstrain: error: {gone}", file=sys.stderr, flush=True)
            return EXIT_CONFIG
        again, again_env = build(launcher.spec_from_args(args, [*overrides, "--resume"]))
        print(launcher.format_command(again, launcher.env_delta(again_env)), flush=True)
        return run_once(again, again_env)

    from dstrain import checkpoint as ckpt
    from dstrain.cli_checks import INTERRUPTED
    if INTERRUPTED:  # a Ctrl-C that a library swallowed while this process imported it
        raise KeyboardInterrupt
    from dstrain.supervise import run_with_restarts
    return run_with_restarts(attempt, args.max_restarts, lambda line: print(line, file=sys.stderr, flush=True),
                             lambda: ckpt.find_latest(Path(cfg.output.dir) / "checkpoints"),
                             error=lambda: errors[-1] if errors else None)


def _output_problem(cfg, resume: bool = False) -> str | None:
    """Why the ranks could not write ``output.dir`` (seen before they start, not at their first save), or
    must not: it holds a checkpoint and the launch does not ``--resume`` (rank 0 would refuse it too)."""
    from dstrain import checkpoint as ckpt
    out = Path(cfg.output.dir)
    if out.exists() and not out.is_dir():
        return f"output.dir {out}: is a file, not a folder"
    from dstrain import run_lock  # held by a run's rank 0 while it runs
    if busy := run_lock.probe(out):
        return busy
    latest = ckpt.find_latest(out / "checkpoints")
    if latest is not None and not resume:
        return f"{out} already holds checkpoint {latest}; pass --resume to continue it or choose another output.dir"
    from dstrain.trainers.common import _resume_problem  # damaged, or another model's: refused before any rank starts
    if latest is not None and (problem := _resume_problem(cfg, out / "checkpoints", latest)):
        return problem
    from dstrain.cli_checks import writable_problem  # where the ranks would create it: a file, no permission
    return writable_problem(out, "output.dir")


def cmd_bench(args, overrides) -> int:
    from dstrain import bench
    return bench.main([*args.bench_args, *overrides])


# ---------------------------------------------------------------- parser

RECIPE_HELP = "run config JSON, e.g. models/gpt/recipes/tiny.json"


def build_parser() -> argparse.ArgumentParser:
    from dstrain.cli_tools import cmd_check_config, cmd_export, cmd_hostfile, cmd_plan
    p = argparse.ArgumentParser(prog="dstrain", allow_abbrev=False,
                                description="DeepSpeed-centric training driven by JSON configs.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", allow_abbrev=False, help="run training (what each rank runs)",
                       description="--dotted.key=value overrides (e.g. --train.lr=3e-4) win over the recipe.")
    t.add_argument("recipe", help=RECIPE_HELP)
    t.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    t.set_defaults(func=cmd_train)

    from dstrain import launcher
    la = sub.add_parser("launch", allow_abbrev=False, help="build and run the deepspeed (or torchrun) command",
                        description="Options may come before or after RECIPE; --dotted.key=value overrides "
                                    "are passed to every rank in order.")
    la.add_argument("recipe", help=RECIPE_HELP)
    launcher.add_launch_options(la)  # the options of `python -m dstrain.launcher`
    la.set_defaults(master_port=None)  # unset: a free port on one node, 29500 across nodes
    la.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed",
                    help="what starts the ranks (default: deepspeed)")
    la.add_argument("--resume", action="store_true", help="ranks continue from the latest complete checkpoint")
    la.add_argument("--dry-run", action="store_true", help="print the command, do not run it; show the master "
                    "address chosen and why, the ports and the environment ranks on other hosts receive")
    la.add_argument("--no-ssh-check", action="store_true",
                    help="do not check passwordless ssh to every host of the hostfile before starting")
    la.add_argument("--max-restarts", type=int, default=0, metavar="K",
                    help="when the job fails, start it again from the latest complete checkpoint, at most K times")
    la.set_defaults(func=cmd_launch)

    h = sub.add_parser("hostfile", allow_abbrev=False, help="write a DeepSpeed hostfile from hosts or SLURM's node list")
    h.add_argument("hosts", nargs="*", metavar="HOST[:SLOTS]")
    h.add_argument("--slots", type=int, default=None,
                   help="slots of every host given without :SLOTS (default 1); with --from-slurm, "
                        "instead of SLURM_TASKS_PER_NODE")
    h.add_argument("--from-slurm", action="store_true", help="hosts from SLURM_JOB_NODELIST")
    h.add_argument("-o", "--output", default=None, help="file to write (default: standard output)")
    h.set_defaults(func=cmd_hostfile)

    pl = sub.add_parser("plan", allow_abbrev=False, help="print the memory plan without training",
                        description="--dotted.key=value overrides (e.g. --model.size=xl) win over the recipe.")
    pl.add_argument("recipe", help=RECIPE_HELP)
    pl.add_argument("--world-size", type=int, help="ranks to plan for, all of them (tp x sp x pp x data-parallel; "
                                                   "default: the recipe's tp x sp x pp)")
    pl.add_argument("--device-memory", help='memory of one device, e.g. "80GB" (plans for GPUs)')
    pl.add_argument("--gpus-per-node", type=int, default=8, help="ranks that share one node's host memory "
                                                                 "(default 8)")
    pl.add_argument("--device", choices=["cpu", "cuda"], help="device to plan for (default: this machine's; "
                                                              "cuda with --device-memory)")
    pl.add_argument("--show-json", action="store_true", help="also print the resolved DeepSpeed JSON")
    pl.set_defaults(func=cmd_plan)

    c = sub.add_parser("check-config", allow_abbrev=False, help="validate a run config or a DeepSpeed JSON",
                       description="A run config takes --dotted.key=value overrides (e.g. --train.lr=3e-4).")
    c.add_argument("file", help="a run config (models/*/recipes/*.json) or a DeepSpeed JSON (ds_configs/*.json)")
    c.add_argument("--device", choices=["cpu", "cuda"], help="device a DeepSpeed JSON is checked for "
                                                             "(default: this machine's)")
    c.add_argument("--world-size", type=int, help="data-parallel ranks for a DeepSpeed JSON's batch keys "
                                                  "(default: inferred from them, else 1); for a run config, "
                                                  "the ranks it runs on (default: its tp x sp x pp)")
    c.set_defaults(func=cmd_check_config)

    e = sub.add_parser("export", allow_abbrev=False, help="consolidated weights from a checkpoint of any ZeRO stage")
    e.add_argument("checkpoint", help="output folder, checkpoints folder or one step_* folder")
    e.add_argument("out", help="a .safetensors file or a folder (a policy run's: a Hugging Face checkpoint folder, "
                               "which --model.args.path loads)")
    e.set_defaults(func=cmd_export)

    b = sub.add_parser("bench", allow_abbrev=False, help="throughput benchmark (see benchmarks/throughput.py)")
    b.add_argument("bench_args", nargs=argparse.REMAINDER)  # (read by dstrain.bench's own parser: see main)
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from dstrain.config import ConfigError, LaunchError, RunFolderError
    from dstrain.engine.ds_config import DSConfigError
    from dstrain.engine.profiles import PlanError
    from dstrain import rank_exit
    from dstrain.rank_exit import CheckpointWriteError
    from dstrain.elastic import StoppedJobRestarted
    from dstrain.resilience import NonFiniteError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # all of it for the benchmark's own parser: its --help, its flags in any order
        args, extra = argparse.Namespace(command="bench", func=cmd_bench, bench_args=argv[1:]), []
    else:
        args, extra = parser.parse_known_args(argv)
    overrides, unknown = _split_overrides(extra)
    from dstrain.cli_flags import flags_written_as_overrides, subcommand_parser, unknown_flags_problem
    sub = subcommand_parser(parser, args.command)  # its usage, and the flag meant (--nprocs: --nproc)
    unknown += flags_written_as_overrides(overrides, sub)  # --nprocs=2 is not a run config key
    if unknown:
        for i, item in enumerate(extra[:-1]):  # "--train.steps 5": an override written without its "="
            if item in overrides and "=" not in item and extra[i + 1] in unknown:
                print(f"dstrain: error: command line: {item} {extra[i + 1]}: overrides look like "
                      f"--section.key=value ({item}={extra[i + 1]})", file=sys.stderr)
                return EXIT_CONFIG
        sub.error(unknown_flags_problem(unknown, sub))
    if args.command in ("train", "launch"):  # a terminal that hangs up (ssh ended) must not end a run
        from dstrain.lost_terminal import guard
        guard()
    if args.command != "train":  # (a rank holds Ctrl-C for its trainer: dstrain.rank_exit.hold_stop_signals)
        from dstrain.cli_checks import catch_ctrl_c
        catch_ctrl_c()
    try:
        return args.func(args, overrides)
    except KeyboardInterrupt:  # Ctrl-C outside a job (a launch's checks, the pause between restarts, plan, export)
        if args.command == "train":
            raise
        from dstrain.cli_checks import JOBS_STARTED
        when = "" if args.command != "launch" else " between two attempts" if JOBS_STARTED else \
            " before any rank started"
        print(f"dstrain: {args.command} interrupted (Ctrl-C){when}", file=sys.stderr)
        return 128 + 2  # as a shell reports a command Ctrl-C ended
    except (ConfigError, DSConfigError, PlanError, RunFolderError, LaunchError) as err:
        if args.command != "train" or _reports_failure():
            print(f"dstrain: error: {err}", file=sys.stderr)
            rank_exit.note_failed(EXIT_CONFIG)  # (a refusal by one rank: not restarted either)
        return EXIT_CONFIG
    except (StoppedJobRestarted, rank_exit.StoppedBeforeTraining) as err:  # a stop before the steps, or after
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"dstrain: {err}", file=sys.stderr, flush=True)
        rank_exit.note_stopped(err.exit_code)
        return err.exit_code
    except (NonFiniteError, CheckpointWriteError) as err:  # a training stop in one line, by the first to report
        if _reports_failure():
            print(f"dstrain: error: {err}", file=sys.stderr)
            rank_exit.note_failed(err.exit_code)
        from dstrain import elastic  # torchrun's own restarts leave at once (dstrain launch does not restart it)
        elastic.note_attempt_error(f"{type(err).__name__}: {err}", err.exit_code)
        return err.exit_code
    except (FileNotFoundError, ValueError) as err:
        if args.command in ("export", "check-config", "plan"):
            print(f"dstrain: error: {err}", file=sys.stderr)
            return EXIT_CONFIG
        if args.command == "train":
            return _rank_failed()
        raise
    except ModuleNotFoundError as err:  # a clone run without `pip install -e .` (or another Python than its)
        from dstrain.cli_checks import missing_requirement_line
        if (line := missing_requirement_line(err)) is None:
            raise
        if args.command != "train" or _reports_failure():
            print(f"dstrain: error: {line}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception:
        if args.command == "train":
            return _rank_failed()
        raise


def _rank_failed() -> int:
    """A rank's unexpected error: its traceback if it is the first rank to fail, else nothing (exit 1).
    A collective that lost its peer (killed, out of memory) is one line, not gloo's or NCCL's traceback."""
    from dstrain.rank_exit import PEER_LOST_EXIT_DELAY_S, peer_lost_line
    from dstrain.resilience import Watchdog
    line = peer_lost_line(sys.exc_info()[1], os.environ.get("RANK", "0"), Watchdog.last)
    if _reports_failure():
        if line:
            print(line, file=sys.stderr, flush=True)
        else:
            import traceback
            traceback.print_exc()
            from dstrain.rank_exit import error_signature, note_error
            note_error(error_signature(sys.exc_info()[1], Watchdog.last))  # (compared by --max-restarts)
    if line:  # the peer is gone: let the launcher find its status (a signal, named) before this exit 1
        import time
        time.sleep(PEER_LOST_EXIT_DELAY_S)
    return 1

if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:  # a rank (launchers run `python -m dstrain.cli train`): a stop while starting
        from dstrain.rank_exit import hold_stop_signals  # is kept for the trainer, not fatal
        hold_stop_signals()
    code = main()
    if sys.argv[1:2] == ["train"]:  # a rank started by the launcher: skip the native teardown
        from dstrain.runtime import exit_rank
        exit_rank(code)
    sys.exit(code)
