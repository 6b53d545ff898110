"""What ``dstrain`` checks on the user's side before it starts ranks or writes a file.

Each check returns the one line to print (or raises the ``ConfigError`` naming the key), so that a
mistake in a path ends in ``dstrain: error: ...`` and exit 2, not in a traceback or in the ranks:

* task and corpus files a run reads (missing, or a folder where a file is needed);
* folders a run or a command writes (a file in the way, a folder nobody can create: ``/proc``);
* a DeepSpeed JSON given as the recipe, or a run config written with comments;
* ``--resume``: HRM's ACT carry on another layout; a finished run with no step left to train;
* the plan rank 0 will make (:func:`check_before_launch`);
* Ctrl-C before the job starts (:func:`catch_ctrl_c`).
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def task_file_problem(cfg):
    """A task file the ranks would not find (``task.path`` / ``eval_path`` naming a file, not a hub dataset;
    HRM's ``train_file`` / ``eval_file`` under ``source=file``), or a folder named where the file is needed:
    the ConfigError naming it, else None."""
    from dstrain.config import ConfigError
    from dstrain.data.tasks import _looks_like_path, missing_task_file
    task = cfg.task if isinstance(cfg.task, dict) else {}
    for key in ("path", "eval_path") + (("train_file", "eval_file") if task.get("source") == "file" else ()):
        value = task.get(key)
        named = key.endswith("_file") or _looks_like_path(value or "")  # *_file: always a file, never a hub name
        if not (isinstance(value, str) and value):
            continue
        path = Path(value).expanduser()
        if path.is_dir():  # MBPP's reader and HRM's puzzle reader take one file
            return ConfigError("run config", f"task.{key}", f"{value} is a folder; name the file itself with "
                                                           f"--task.{key}=FILE")
        if named and not path.exists():
            return ConfigError("run config", f"task.{key}", missing_task_file(value, key))
    return None


def corpus_problem(cfg):
    """The LM trainer's ``data.corpus`` the ranks would not find or read: the ConfigError naming it, else None."""
    from dstrain.config import ConfigError
    corpus = getattr(getattr(cfg, "data", None), "corpus", "stdlib")
    if cfg.trainer != "lm" or corpus == "stdlib":
        return None
    path = Path(corpus).expanduser()
    where = "" if path.is_absolute() else f" (relative paths are read from {Path.cwd()})"
    if not path.exists():
        what = "is a symbolic link to nothing (a loop, or its target is gone)" if path.is_symlink() else \
            "does not exist"
        return ConfigError("run config", "data.corpus", f"{corpus} {what}{where}; use stdlib, a .txt or "
                                                        ".jsonl file or a folder of .txt/.py/.md files")
    if path.is_file() and path.suffix not in (".txt", ".jsonl"):
        return ConfigError("run config", "data.corpus", f"{corpus}: unsupported file type (expected .txt, .jsonl "
                                                        "or a folder)")
    from dstrain.data.corpus import corpus_files, text_file_problem  # unreadable, binary, not UTF-8
    first = corpus_files(path)[:1000]  # (quick here; rank 0 checks every file before it reads them)
    problem = next((p for f in first if (p := text_file_problem(f))), None)
    return ConfigError("run config", "data.corpus", problem) if problem else None


def writable_problem(folder: Path, what: str, shown: str | Path | None = None) -> str | None:
    """Why ``folder`` (to be created if absent) cannot be written: a file in its path, no permission, or a
    file system that refuses (as ``/proc`` does, even to root, whom ``os.access`` always answers yes). The
    probe creates and removes one empty folder in the nearest existing parent. ``shown``: the path the user
    gave, when ``folder`` is the one it goes into."""
    folder = Path(folder)
    shown = folder if shown is None else shown
    there = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if there is None:
        return None
    if not there.is_dir():
        return f"{what} {shown}: {there} is a file, not a folder"
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{what} {shown}: {there} is not writable (read-only, or not yours)"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dstrain-probe-", dir=there))
    except OSError as err:
        return f"{what} {shown}: nothing can be created in {there} ({err.strerror or err})"
    return None


def export_target_problem(out: str | Path) -> str | None:
    """``dstrain export``'s OUT (a .safetensors file or a folder) cannot be written: the line, else None."""
    out = Path(out)
    if out.suffix == ".safetensors":
        if out.is_dir():
            return f"export to {out}: is a folder; name a file, or a folder without the .safetensors suffix"
        return writable_problem(out.parent, "export to", out)
    if out.exists() and not out.is_dir():
        return f"export to {out}: is a file and not a .safetensors one; name a .safetensors file or a folder"
    return writable_problem(out, "export to")


def resume_note(cfg) -> str | None:
    """``--resume`` of a run whose latest checkpoint is already at or past ``train.steps``: the ranks would load
    it and leave at once (exit 0, nothing trained); the note that says so, else None."""
    from dstrain import checkpoint as ckpt
    root = Path(cfg.output.dir) / "checkpoints"
    latest = ckpt.find_latest(root)
    if latest is None or ckpt.step_of(latest) < cfg.train.steps:
        return None
    return (f"checkpoint {root / latest} is at step {ckpt.step_of(latest)}, train.steps is {cfg.train.steps}: "
            f"nothing is left to train; pass --train.steps=N with N above {ckpt.step_of(latest)} to train on")


def loose_run_config(path: str | Path) -> bool:
    """Whether ``path``, which strict JSON refused, is a run config written with comments or trailing commas (its
    sections are the run config's), rather than a DeepSpeed JSON, which may be written so."""
    from dstrain.config import RunConfig
    from dstrain.engine.ds_files import _as_hjson, nests_ds_config
    try:
        data = _as_hjson(Path(path).read_text())
    except (OSError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and bool(data) and set(data) <= set(RunConfig.__dataclass_fields__) \
        and not nests_ds_config(data)


def deepspeed_json_as_recipe(recipe: str, err):
    """A DeepSpeed JSON given where a run config goes (``dstrain launch ds_configs/zero3.json``), which the run config
    loader refused for its first DeepSpeed key: the ConfigError that says what to do instead, else None."""
    from dstrain.config import ConfigError
    from dstrain.engine.ds_files import KNOWN_TOP_LEVEL_KEYS
    if err.source != str(recipe) or err.key not in KNOWN_TOP_LEVEL_KEYS:
        return None
    from dstrain.config import RunConfig, read_json
    if set(read_json(recipe)) & set(RunConfig.__dataclass_fields__):  # a run config with a stray key: as it was
        return None
    return ConfigError(str(recipe), "", f"a DeepSpeed JSON ({err.key!r} is one of its keys), not a run config; a run "
                                        f"config names it: dstrain launch --nproc 2 models/gpt/recipes/tiny.json "
                                        f"--deepspeed.profile={recipe}")


def check_before_launch(cfg, args, accelerator: str) -> str | None:
    """Resolve the run as rank 0 will, with the launch's world size; the problem, or None.

    The factory's plan (precision the device can run, the DeepSpeed JSON filled and
    checked against the recipe) and DeepSpeed's own strict parsing of every section:
    a config that would stop inside the ranks stops here, before anything starts or
    is written. Where include/exclude filters decide the world size, or the ranks run
    on other hosts, memory is not judged here (the ranks see their own devices).
    """
    from dstrain import launcher
    from dstrain.config import ConfigError
    from dstrain.engine.ds_check import deepspeed_problems
    from dstrain.engine.ds_config import DSConfigError
    from dstrain.engine.factory import plan_engine
    from dstrain.engine.profiles import PlanError
    spec = launcher.spec_from_args(args, [])
    sizes = launcher.launch_world_size(spec, torchrun=args.launcher == "torchrun")
    world, per_node = sizes if sizes is not None else (1, 1)
    device = "cuda" if accelerator == "cuda" else "cpu"
    saved = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = device  # the child's environment is already built
    try:
        from dstrain.engine.ds_preflight import check_run
        for note in check_run(cfg, world, device):  # the user's file against the run and this device
            print(f"dstrain: note: {note}", file=sys.stderr)
        plan = plan_engine(cfg, world, ranks_per_node=per_node, device_type=device)
        problems = deepspeed_problems(plan.ds_config)
        if problems:
            raise DSConfigError(cfg.deepspeed.profile, problems)
    except PlanError as err:
        local = sizes is not None and (spec.hostfile is None or world == per_node)
        return str(err) if local else None
    except (ConfigError, DSConfigError, ValueError) as err:
        return str(err)
    finally:
        if saved is None:
            os.environ.pop("DS_ACCELERATOR", None)
        else:
            os.environ["DS_ACCELERATOR"] = saved
    return None


def nested_launch_problem(environ=os.environ) -> str | None:
    """``deepspeed --module dstrain.cli launch RECIPE`` (or torchrun ... launch): every rank of that job would start
    a job of its own, all on one run folder (one ran, the others were refused by its lock, and the outer launcher
    then stopped the one that ran). The variables only a launcher's children have name it: deepspeed's launch.py
    sets LOCAL_SIZE beside LOCAL_RANK, torchrun's agent TORCHELASTIC_RUN_ID."""
    if "LOCAL_RANK" not in environ:
        return None
    outer = ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else "deepspeed" if "LOCAL_SIZE" in environ else None)
    if outer is None:
        return None
    return (f"dstrain launch is running inside rank {environ.get('RANK', environ['LOCAL_RANK'])} of a job that "
            f"{outer} started: it starts the ranks itself; run `dstrain launch ... RECIPE` from a shell, or give "
            f"{outer} `--module dstrain.cli train RECIPE` (what `dstrain launch --dry-run` prints)")


REQUIRED = ("torch", "deepspeed", "fairscale", "transformers", "accelerate", "datasets", "tensorboard", "tqdm",
            "safetensors", "psutil", "numpy")  # setup.py's install_requires, as imported


def missing_requirement_line(err: ModuleNotFoundError) -> str | None:
    """The one line for one of setup.py's requirements that this Python cannot import; None for anything else."""
    name = (err.name or "").split(".")[0]
    if name not in REQUIRED:
        return None
    return (f"the {name} package is not installed for {sys.executable}: install dstrain and its requirements "
            "with `pip install -e .` from the repository's root (README: Three commands), in this Python's "
            "environment")


def resume_layout_problem(cfg, world: int | None) -> str | None:
    """HRM's ``--resume`` on another global batch or number of ranks (``world``: the launch's, when known): the
    checkpoint's ACT carry cannot be taken over; said before any rank starts, as rank 0 would say it. Else None."""
    from dstrain import checkpoint as ckpt
    root = Path(cfg.output.dir) / "checkpoints"
    if cfg.trainer != "hrm" or not world or (latest := ckpt.find_latest(root)) is None:
        return None
    from dstrain.trainers import task_config
    from dstrain.trainers.hrm import carry_layout_problem
    return carry_layout_problem(root, latest, task_config(cfg).global_batch or cfg.train.micro_batch * world, world)


JOBS_STARTED: list[int] = []
"""The jobs ``dstrain launch`` started (their guards' process ids): a Ctrl-C between two of them is not "before any
rank started"."""
INTERRUPTED: list[int] = []
"""The Ctrl-C a ``dstrain`` command got before it started anything (see :func:`catch_ctrl_c`)."""


def catch_ctrl_c() -> None:
    """Ctrl-C while a command reads, plans and checks raises KeyboardInterrupt as usual (``dstrain.cli.main`` ends it
    in one line) and is remembered: one that a library's bare ``except:`` swallowed (while importing) still stops
    ``dstrain launch`` before its job starts. A SIGINT the shell ignores (a script's background job) stays ignored."""
    import signal
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def interrupt(signum, _frame):
        INTERRUPTED.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


def _only_launch_folders(out: Path) -> bool:
    """Whether ``out`` holds nothing but the failure folder of a multi-host ``dstrain launch`` (which made it)."""
    from dstrain.rank_exit import is_launch_failure_dir
    try:
        names = [p.name for p in out.iterdir()] if out.is_dir() else []
        return bool(names) and all(is_launch_failure_dir(name) for name in names)
    except OSError:
        return False


def _remove_if_only_cache(out: Path) -> None:
    """A run folder this failed run created and left holding nothing but the data cache and this run's lock:
    removed. Before, a failure after rank 0 took the lock (the run records refused by a full disk, an error in
    the model's set-up) left the folder with ``.dstrain.lock``, and the lock record of a rank that exits through
    ``os._exit`` stayed in it: the retry found a folder that looked like a run's (and was refused for
    :data:`dstrain.run_lock.STALE_S` from another host)."""
    import shutil

    from dstrain import run_lock
    try:
        from dstrain.rank_exit import is_launch_failure_dir
        if not out.is_dir():
            return
        names = {p.name for p in out.iterdir() if not is_launch_failure_dir(p.name)}  # dstrain launch's, it goes
        if not names <= {".cache", run_lock.NAME}:
            return
        held = bool(run_lock._HELD) and run_lock._HELD[0][0] == out.resolve()
        lock = out / run_lock.NAME
        if lock.exists() and not held and lock.read_text().strip():
            return  # another run's lock (it took the folder meanwhile): its folder now
        if held:
            run_lock.release()  # (first: the heartbeat would make the folder again)
        if any(is_launch_failure_dir(p.name) for p in out.iterdir()):  # the launcher still reads it, then removes
            for name in names:  # the folder (this rank's error is in it)
                if (out / name).is_dir():
                    shutil.rmtree(out / name, ignore_errors=True)
                else:
                    (out / name).unlink(missing_ok=True)
            return
        shutil.rmtree(out, ignore_errors=True)
    except (OSError, UnicodeDecodeError):
        pass
