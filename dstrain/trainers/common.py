"""What every trainer shares: the resume decision, the plan (kept on resume), checkpoints, fault guards."""
from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Callable

from dstrain import checkpoint as ckpt
from dstrain import run_lock, runtime, shared_folder
from dstrain.faults import fault, fault_hang, fault_raise  # noqa: F401  (fault_hang, fault_raise: the trainers import them from here)
from dstrain.config import RunConfig, RunFolderError
from dstrain.trainers.run_files import write_run_records


def decide_resume(cfg: RunConfig, world: runtime.World, out: Path, ckpt_root: Path) -> str | None:
    """Rank 0 decides whether to resume and from which tag; every rank gets the answer.

    A folder that already holds a checkpoint is never overwritten by a fresh run
    (RunFolderError); ``--resume`` without a checkpoint starts from step 0. A run that takes the folder removes
    the ``summary.json`` an earlier run left (it writes its own when it ends); a resume whose run config differs
    from the checkpoint's says what changed (:func:`changed_settings_note`).
    """
    from dstrain import elastic, versions
    decision, job_agents, marker = None, elastic.gather_agents(), None
    versions.check_same(world.world_size)  # hosts running other dstrain/torch/deepspeed: refused on every rank
    elastic.note_run_folder(out)
    if world.is_main:
        latest = ckpt.find_latest(ckpt_root)
        busy = _lock_run_folder(out)
        restarted = (latest is not None and not cfg.checkpoint.resume and elastic.restart_count() > 0
                     and elastic.written_by_this_job(ckpt_root / latest, job_agents))
        stopped = elastic.stopped_job_problem(out, job_agents) if elastic.restart_count() > 0 else None
        stopped = stopped or elastic.repeated_error_problem(out, job_agents)  # the same error twice: not a third
        if busy:
            decision = ("error", busy)
        elif stopped:  # torchrun restarted ranks that a signal stopped: they leave with the stop's status
            decision = ("stopped", (str(stopped), stopped.exit_code))
        elif cfg.checkpoint.resume or restarted:  # restarted: torchrun --max-restarts, this job's own checkpoint
            if restarted:
                print(f"dstrain: torchrun restart {elastic.restart_count()}: continuing this job's checkpoint "
                      f"{latest}", flush=True)
            decision = ("resume", latest)
            problem = _resume_problem(cfg, ckpt_root, latest) if latest is not None else None
            if problem:
                decision = ("error", problem)
        elif latest is not None:
            decision = ("error", f"{out} already holds checkpoint {latest}; "
                                 "pass --resume to continue it or choose another output.dir")
        else:
            decision = ("fresh", None)
        if decision[0] not in ("error", "stopped"):  # an earlier run's summary (finished, or garbled) must not
            with contextlib.suppress(OSError):  # speak for this one, which writes its own when it ends
                (out / "summary.json").unlink(missing_ok=True)
            elastic.clear_stopped_job(out)
            if elastic.restart_count() == 0:  # (a restart keeps its job's attempts' errors, compared above)
                elastic.clear_attempt_errors(out)
            marker = shared_folder.write_marker(out) if world.world_size > 1 else None
    (kind, value), marker = runtime.broadcast_object((decision, marker))
    if kind == "error":
        raise RunFolderError(value)
    if (unshared := shared_folder.problem(out, marker, world.is_main)) is not None:  # each host its own folder
        raise RunFolderError(unshared)
    if kind == "stopped":
        raise elastic.StoppedJobRestarted(*value)
    if kind == "resume" and value is None and world.is_main:
        where = ckpt_root if ckpt_root.is_absolute() else (  # a resume started from another directory
            f"{ckpt_root} ({ckpt_root.resolve()}: a relative output.dir is read from the working directory)")
        print(f"no complete checkpoint in {where}: starting from step 0", flush=True)
    if kind == "resume" and value is not None and world.is_main:
        note = changed_settings_note(cfg, ckpt_root / value)
        if note:
            print(note, flush=True)
    return value if kind == "resume" else None


def config_changes(saved, now, prefix: str = "") -> list[str]:
    """``key old -> new`` for every leaf of run config ``now`` that differs from ``saved`` (a checkpoint's),
    leaving out where the run writes (output), how it checkpoints and "auto" values a resume fills in."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return [] if saved == now else [f"{prefix} {json.dumps(saved)} -> {json.dumps(now)}"]
    out = []
    for key in now:
        name = f"{prefix}.{key}" if prefix else key
        if name in ("output", "checkpoint") or now[key] == "auto" or key not in saved:
            continue
        out += config_changes(saved[key], now[key], name)
    return out


def changed_settings_note(cfg: RunConfig, where: Path) -> str | None:
    """The line a resume prints when the run config differs from checkpoint ``where``'s: the changed values
    (``train.lr``, ``data.seq_len`` ...) are this run's from the next step on, on the checkpoint's weights,
    optimizer moments, step and data position. None when nothing changed (or the checkpoint's config is unreadable)."""
    try:
        saved = json.loads((where / "run_config.json").read_text())
    except (OSError, ValueError):
        return None
    changes = config_changes(saved, cfg.to_dict())
    if not changes:
        return None
    return (f"dstrain: note: resuming {where} with settings changed since it was written: {', '.join(changes)}; "
            "they apply from the next step on (the optimizer's learning rate, betas and weight decay included), "
            "on the checkpoint's weights, optimizer moments, step count and data position")


def _lock_run_folder(out: Path) -> str | None:
    """Hold an exclusive lock on ``out`` for this process's lifetime; the problem if another run holds it.

    Two runs writing one folder would interleave their metrics and overwrite each other's checkpoints
    (:mod:`dstrain.run_lock`: a flock, and a heartbeat for hosts sharing the folder)."""
    return run_lock.take(out)


def _resume_problem(cfg: RunConfig, ckpt_root: Path, tag: str) -> str | None:
    """Why ``tag`` cannot be resumed by this run (a damaged checkpoint, another model), else None;
    said before anything is planned or written (the folder's files stay the checkpoint's run's)."""
    where = ckpt_root / tag
    try:
        state = json.loads((where / "trainer_state.json").read_text())
        saved = json.loads((where / "run_config.json").read_text())
        int(state["step"])
        world = int(state.get("world_size") or 0) or None
        layout = saved.get("parallel") or {} if isinstance(saved, dict) else {}
        whole = all(layout.get(k, 1) == 1 for k in ("tp", "sp", "pp"))  # then every rank holds one ZeRO shard
        damage = ckpt.files_problem(where, world, world if whole else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        damage = f"{type(err).__name__}: {err}"
    if damage:
        before = [t for t in ckpt.complete_tags(ckpt_root) if t != tag and ckpt.step_of(t) < ckpt.step_of(tag)] \
            if ckpt._TAG.match(tag) else []
        return (f"checkpoint {where} is damaged ({damage}); remove it (or its COMPLETE file) to resume from the one "
                f"before{f' ({before[-1]})' if before else ''}, or choose another output.dir")
    mine = cfg.to_dict()["model"]

    def shape(model) -> dict:  # what decides the weights' layout: not where a warm start was loaded from
        model = model if isinstance(model, dict) else {}
        args = model.get("args") if isinstance(model.get("args"), dict) else {}
        return {**model, "args": {k: v for k, v in args.items() if k != "path"}}
    if isinstance(saved, dict) and shape(saved.get("model", mine)) != shape(mine):
        ours = [t for t in ckpt.complete_tags(ckpt_root)
                if t != tag and shape(_saved_model(ckpt_root / t)) == shape(mine)]
        mixed = (f" (the folder mixes two runs' checkpoints: {ours[-1]} holds this run's model; move the other "
                 f"run's checkpoints out to resume from it)") if ours else ""
        return (f"checkpoint {where} holds model {json.dumps(saved.get('model'))}, this run builds "
                f"{json.dumps(mine)}; resume with the checkpoint's model section or choose another output.dir{mixed}")
    explicit = (cfg.to_dict().get("deepspeed") or {}).get("precision", "auto")  # (auto: the checkpoint's, pin_plan)
    return _layout_problem(cfg, saved, where) or (
        precision_problem(ckpt_root, tag, explicit) if explicit != "auto" else None)


def _saved_model(where: Path):
    try:
        saved = json.loads((where / "run_config.json").read_text())
    except (OSError, ValueError):
        return None
    return saved.get("model") if isinstance(saved, dict) else None


def _layout_problem(cfg: RunConfig, saved, where: Path) -> str | None:
    """A tensor- or pipeline-parallel degree other than the checkpoint's: its weights are cut another way
    (only the data-parallel size may change, ``dstrain.reshard``), and DeepSpeed's load would fail on a
    file or a shape, which reads as a damaged checkpoint. ``parallel.pp = auto`` takes the checkpoint's."""
    from dstrain.reshard import saved_layout
    old = saved_layout(saved, where)
    now = cfg.to_dict().get("parallel") or {}
    mine = {k: now.get(k, 1) for k in ("tp", "pp")}
    changed = [f"parallel.{k}={old[k]}" for k in mine if isinstance(mine[k], int) and mine[k] != old[k]]
    if not changed:
        return None
    return (f"checkpoint {where} was written with {', '.join(changed)}, this run has "
            f"{', '.join(f'parallel.{k}={v}' for k, v in mine.items())}: only the "
            f"data-parallel size may change on resume; resume with {' '.join('--' + c for c in changed)}, or "
            f"export its weights (dstrain export) to start a new run with another layout")


def stage_problem(ckpt_root: Path, tag: str, ds_config: dict) -> str | None:
    """Why the plan's ZeRO stage cannot load ``tag`` (DeepSpeed cannot load optimizer states saved under
    another stage's layout, and fails with a bare assertion); None when it can."""
    try:
        saved = json.loads((ckpt_root / tag / "ds_config.json").read_text())
    except (OSError, ValueError):
        return None
    stage = lambda c: int((c.get("zero_optimization") or {}).get("stage", 0) or 0)  # noqa: E731
    old, new = stage(saved), stage(ds_config)
    if old == new or {old, new} == {1, 2}:  # (stages 1 and 2 save the same partitioned optimizer state)
        return None
    return (f"checkpoint {ckpt_root / tag} was written at ZeRO stage {old}, this run plans stage {new}: DeepSpeed "
            f"cannot load one stage's optimizer state into the other; resume with the checkpoint's profile "
            f"(leave deepspeed.profile at auto) or export the weights and start a new run")


def precision_problem(ckpt_root: Path, tag: str, precision: str) -> str | None:
    """Why a plan of ``precision`` cannot load ``tag``, saved under another (an explicit
    ``deepspeed.precision`` wins over the checkpoint's, :func:`pin_plan`): DeepSpeed keeps each precision's
    optimizer state in other files and fields, and failed with a ``KeyError`` traceback (ZeRO-0) or a missing
    ``bf16_...optim_states.pt`` read as a damaged checkpoint (ZeRO-1/2). None when it can (or is not recorded)."""
    try:
        saved = json.loads((ckpt_root / tag / "trainer_state.json").read_text()).get("precision")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(saved, str) or saved in ("auto", precision):
        return None
    return (f"checkpoint {ckpt_root / tag} was written in {saved}, this run plans {precision}: DeepSpeed cannot "
            f"load one precision's optimizer state into the other; resume with --deepspeed.precision={saved} (or "
            f"leave it at auto), or export the weights (dstrain export) and start a new run from them")


def resume_plan_problem(ckpt_root: Path, tag: str, plan) -> str | None:
    """Why ``plan`` (its ZeRO stage, its precision) cannot load checkpoint ``tag``, else None."""
    return stage_problem(ckpt_root, tag, plan.ds_config) or precision_problem(ckpt_root, tag, plan.precision)


def pin_plan(cfg: RunConfig, ckpt_root: Path, tag: str) -> None:
    """A resumed run keeps the checkpoint's profile, precision and activation checkpointing.

    The factory's choice depends on measurements (memory, bf16 speed) that may come
    out differently on the second start; DeepSpeed cannot load optimizer states
    saved under another precision or stage. Values the run config names explicitly win.
    """
    state = json.loads((ckpt_root / tag / "trainer_state.json").read_text())
    ds = cfg.deepspeed
    if ds.profile == "auto" and state.get("profile", "auto") != "auto":
        # not a dataclass field (never saved): lets the plan say the profile is the checkpoint's, not the user's
        ds.pinned_from = str(ckpt_root / tag)
    for key in ("profile", "precision", "activation_checkpointing"):
        if key in state and getattr(ds, key) in ("auto", state[key]):
            setattr(ds, key, state[key])


def eval_and_save_due(cfg: RunConfig, step: int, device) -> tuple[bool, bool]:
    """Whether ``step`` evaluates (``train.eval_every``) and saves (``checkpoint.every``). When it does either, the
    device's queued work is waited for first (:func:`dstrain.metrics.wait_for_device`), so the time a trainer sets
    aside from its throughput window for them holds none of the step's own GPU work; other steps never wait."""
    from dstrain.metrics import wait_for_device
    evaluating = bool(cfg.train.eval_every and step % cfg.train.eval_every == 0)
    saving = bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
    if evaluating or saving:
        wait_for_device(device)
    return evaluating, saving


def plan_and_record(cfg: RunConfig, world: runtime.World, out: Path, extra_text: str = "",
                    resume: tuple[Path, str] | None = None):
    """Rank 0 plans the engine (``plan_engine``); every rank gets the plan. Rank 0 writes
    ``run_config.json``, ``ds_config.json`` and ``plan.txt`` (plus ``extra_text``) and prints the plan.
    ``resume``: ``(checkpoint root, tag)`` the run will load, refused first if its ZeRO stage or precision cannot
    (:func:`resume_plan_problem`); a record the disk cannot hold is refused too (``run_files.write_run_records``).
    A DeepSpeed scheduler's horizon counts the trainer's optimizer updates (``plan_engine`` stretches it: GRPO)."""
    from dstrain.engine.factory import plan_engine
    plan, problem = None, None
    if world.is_main:
        plan = plan_engine(cfg, world.world_size, ranks_per_node=world.local_world_size,
                           device_type=world.device.type)
        problem = resume_plan_problem(*resume, plan) if resume is not None and resume[1] else None
        if problem is None:
            text = plan.explanation + (f"\n{extra_text}" if extra_text else "")
            try:
                write_run_records(out, cfg, plan.ds_config, text)
            except RunFolderError as err:  # (said by every rank: the others wait for this answer)
                problem = str(err)
            else:
                print(text, flush=True)
    plan, problem = runtime.broadcast_object((plan, problem))
    if problem:
        raise RunFolderError(problem)
    return plan


def save_checkpoint(engine, ckpt_root: Path, step: int, world: runtime.World, cfg: RunConfig, plan,
                    state: dict | None = None, write_extra: Callable[[Path], None] | None = None) -> None:
    """Write checkpoint ``step``: DeepSpeed's files, every rank's RNG, ``write_extra(tag_dir)``
    (each rank), then rank 0's COMPLETE marker with the trainer state once all ranks are done."""
    tag = ckpt.tag_for(step)
    if world.is_main:
        run_lock.recheck()  # output.dir deleted or renamed since the last heartbeat: its lock taken again first
        ckpt.prepare_tag_dir(ckpt_root, tag)
    runtime.barrier()
    with writing(ckpt_root, tag):
        engine.save(str(ckpt_root), tag, client_state={"step": step})
        ckpt.save_rng(ckpt_root, tag, world.rank)
        if write_extra is not None:
            write_extra(ckpt_root / tag)
    runtime.barrier()
    fault("DSTRAIN_FAULT_IN_SAVE", step)
    if world.is_main:
        with writing(ckpt_root, tag):
            ckpt.mark_complete(ckpt_root, tag, cfg.to_dict(), plan.ds_config,
                               _trainer_state(step, world, plan, state),
                               keep=cfg.checkpoint.keep, param_groups=engine.param_group_names)
    runtime.barrier()


@contextlib.contextmanager
def writing(ckpt_root: Path, tag: str):
    """A file write failing inside (disk full, quota, read-only) leaves as one ``CheckpointWriteError`` that
    names the folder, the free space and the checkpoint still the latest; the incomplete ``tag`` is removed.
    Other errors (a peer lost in a collective) pass unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        from dstrain.rank_exit import CheckpointWriteError, checkpoint_write_error
        if isinstance(err, CheckpointWriteError):
            raise
        error = checkpoint_write_error(err, ckpt_root, tag)
        if error is None:
            raise
        raise error from err


def _trainer_state(step: int, world: runtime.World, plan, state: dict | None) -> dict:
    from dstrain import elastic
    launched = {"torchrun_agents": elastic.agents()} if elastic.agents() else {}  # dstrain.elastic: whose it is
    return {"step": step, "world_size": world.world_size, "profile": plan.profile, "precision": plan.precision,
            "activation_checkpointing": plan.activation_checkpointing, **launched, **(state or {})}


class CheckpointSaver:
    """``save(step)`` for one run: synchronous, or with ``checkpoint.async_write`` stalling training only for
    the copy to host memory (``dstrain.async_checkpoint``: files written in the background, COMPLETE once
    every rank's files are on disk, at most one save in flight). ``stalls`` holds each save's stall (s)."""

    def __init__(self, engine, ckpt_root: Path, world: runtime.World, cfg: RunConfig, plan):
        self.engine, self.ckpt_root, self.world, self.cfg, self.plan = engine, ckpt_root, world, cfg, plan
        self.stalls: list[float] = []
        self.breakdown: list[dict] = []
        """Asynchronous saves: per save, seconds waiting for the previous one and copying to host memory."""
        self.writer = self.finisher = None
        if cfg.checkpoint.async_write:
            from dstrain import async_checkpoint
            self.writer = async_checkpoint.install_writer(engine.ds)
            self.finisher = async_checkpoint.BackgroundFinisher()

    def save(self, step: int, state: dict | None = None,
             write_extra: Callable[[Path], None] | None = None) -> None:
        import time
        start = time.perf_counter()
        if self.writer is None:
            save_checkpoint(self.engine, self.ckpt_root, step, self.world, self.cfg, self.plan, state, write_extra)
        else:
            self._save_async(step, state, write_extra)
        self.stalls.append(time.perf_counter() - start)

    def _save_async(self, step, state, write_extra) -> None:
        import time
        start = time.perf_counter()
        self.finisher.wait()  # the previous save is complete (or its error is raised here)
        waited = time.perf_counter() - start
        self.writer.copy_s = 0.0
        tag, world = ckpt.tag_for(step), self.world
        if world.is_main:
            run_lock.recheck()  # (as save_checkpoint)
            ckpt.prepare_tag_dir(self.ckpt_root, tag)
        runtime.barrier()
        with writing(self.ckpt_root, tag):
            self.engine.save(str(self.ckpt_root), tag, client_state={"step": step})  # host copies, queued
            ckpt.save_rng(self.ckpt_root, tag, world.rank)
            if write_extra is not None:
                write_extra(self.ckpt_root / tag)
        meta = (self.cfg.to_dict(), self.plan.ds_config, _trainer_state(step, world, self.plan, state),
                self.engine.param_group_names)
        self.breakdown.append({"wait_previous_s": round(waited, 4), "host_copy_s": round(self.writer.copy_s, 4)})
        self.finisher.submit(lambda: self._finish(tag, step, meta))

    def _finish(self, tag: str, step: int, meta) -> None:
        with writing(self.ckpt_root, tag):  # raised to the trainer by the next save's (or the last) wait
            self._finish_writes(tag, step, meta)

    def _finish_writes(self, tag: str, step: int, meta) -> None:
        from dstrain import async_checkpoint
        self.writer.wait()
        fault("DSTRAIN_FAULT_IN_SAVE", step)
        written = self.ckpt_root / tag / async_checkpoint.WRITTEN
        written.mkdir(parents=True, exist_ok=True)
        (written / f"rank_{self.world.rank:05d}").touch()
        if self.world.is_main:
            async_checkpoint.wait_for_markers(written, self.world.world_size, self.cfg.train.collective_timeout_s)
            run_cfg, ds_cfg, trainer_state, groups = meta
            ckpt.mark_complete(self.ckpt_root, tag, run_cfg, ds_cfg, trainer_state, keep=self.cfg.checkpoint.keep,
                               param_groups=groups)

    def wait(self) -> None:
        """Until the last save is complete on disk (every rank calls it before leaving)."""
        if self.finisher is not None:
            self.finisher.wait()
            runtime.barrier()


def _device_or_comm_error(err: BaseException) -> bool:
    """A CUDA out-of-memory or other accelerator error, or a collective's failure (NCCL): RuntimeErrors
    that say nothing about the checkpoint's files."""
    import torch
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None),
                              getattr(torch, "AcceleratorError", None), getattr(dist, "DistError", None))
                  if isinstance(k, type))
    return isinstance(err, kinds)


def load_checkpoint(engine, ckpt_root: Path, tag: str, world: runtime.World) -> dict:
    """Load DeepSpeed's state and this rank's RNG from ``tag``; return the trainer state.

    A checkpoint written by another number of ranks is resharded (``dstrain.reshard``:
    optimizer state included); ranks it has no random state for are seeded from
    (step, rank) instead.
    """
    state = json.loads((ckpt_root / tag / "trainer_state.json").read_text())
    saved_world = int(state.get("world_size", world.world_size))
    if saved_world != world.world_size:
        from dstrain import reshard
        saved_cfg = json.loads((ckpt_root / tag / "run_config.json").read_text())
        dims = getattr(getattr(engine, "parallel", None), "dims", None)
        try:
            reshard.check_layout(saved_cfg, {k: getattr(dims, k, 1) for k in ("tp", "sp", "pp")}, tag,
                                 ckpt_root / tag)
            reshard.load_resharded(engine, ckpt_root, tag, saved_world, world,
                                   log=lambda msg: print(msg, flush=True))
        except reshard.ReshardError as err:
            raise RunFolderError(str(err)) from None
    else:
        try:
            engine.load(str(ckpt_root), tag)
        except (RuntimeError, AssertionError, OSError, EOFError, ValueError) as err:  # a shard missing or cut short
            if _device_or_comm_error(err):
                raise  # the GPU or the process group failed, not the checkpoint: never advise removing it
            why = " ".join(str(err).split())[:200] or "a file is missing or unreadable"
            raise RunFolderError(
                f"checkpoint {ckpt_root / tag} could not be loaded ({type(err).__name__}: {why}); remove it (or "
                "its COMPLETE file) to resume from the one before, or choose another output.dir") from err
    if (ckpt_root / tag / "rng" / f"rank_{world.rank}.pt").is_file():
        ckpt.load_rng(ckpt_root, tag, world.rank)
    else:
        runtime.seed_everything(1_000_003 * int(state["step"]) + world.rank)
    if world.is_main:
        print(f"resumed from {ckpt_root / tag} at step {state['step']}", flush=True)
    return state


def batch_change_message(where: Path, step: int, steps: int, old: int, new: int,
                         data_at: int | None = None) -> str | None:
    """What resuming checkpoint ``where`` (taken at ``step``, ``old`` samples per step) with ``new`` samples
    per step changes (the data position, the schedule's meaning); None when the global batch is kept.

    The task samplers (GRPO, SCoRe) index their data order by step x global batch, so the samples the
    checkpoint's run would have taken next are not the ones this run takes next. The LM trainer continues at
    the sample the checkpoint reached (``data_at``), so only the schedule's meaning changes."""
    if not old or not new or int(old) == int(new):
        return None
    reached, starts = step * old, step * new
    jump = (f"samples {reached}..{starts - 1} of the order are skipped" if starts > reached
            else f"samples {starts}..{reached - 1} are trained on again")
    data = (f"the data order is indexed by step x global batch, so step {step + 1} starts at sample {starts}, "
            f"not {reached} ({jump})" if data_at is None else
            f"the data continues at sample {data_at}, where the checkpoint's run stopped (none skipped or "
            "repeated)")
    return (f"resuming {where} with a global batch of {new} samples per step where it was trained with {old} "
            f"(micro_batch x grad_accum x data-parallel ranks): {data}; the learning-rate schedule "
            f"counts steps (warm-up, decay to train.steps={steps}), so its remaining {max(steps - step, 0)} steps "
            f"now take {new / old:.3g}x the samples each, and train.lr is not rescaled. To continue the same "
            f"run, keep micro_batch x grad_accum x data-parallel ranks = {old}")


def warn_batch_change(world: runtime.World, where: Path, step: int, steps: int, old, new,
                      data_at: int | None = None) -> None:
    """Rank 0 prints :func:`batch_change_message` as a warning, when there is one."""
    message = batch_change_message(where, step, steps, int(old or 0), int(new or 0), data_at)
    if message and world.is_main:
        import sys
        print(f"dstrain: warning: {message}", file=sys.stderr, flush=True)


class StopFlag:
    """Set by SIGTERM, SIGINT (Ctrl-C) or SIGUSR1; the loop checkpoints and leaves at the next log step, or
    at the next step where the non-finite guard's per-step agreement carries it (``RunGuards.stop_agreed``).
    The rank then exits 128 + the signal's number (``dstrain.rank_exit.stop_exit_code``)."""

    def __init__(self):
        from dstrain import rank_exit
        self.set = False
        pending, rank_exit.PENDING_STOP[0] = rank_exit.PENDING_STOP[0], 0  # one that came while starting
        for sig in rank_exit.STOP_SIGNALS:
            signal.signal(sig, self._handle)
        if pending:
            self._handle(pending, None)

    def _handle(self, signum, _frame):
        from dstrain import resilience
        self.set = True
        resilience.STOP_REQUESTED[0] = resilience.STOP_REQUESTED[0] or signum  # the first signal: the exit status


class RunGuards:
    """A run's non-finite policy and hang watchdog (``train.nonfinite``, ``train.collective_timeout_s``),
    attached to each of its trained engines (``Engine.watch``: they check at every optimizer step).

    ``begin(step)`` at the start of a trainer step; when the step raises ``NonFiniteError``,
    ``last_good(step)`` says which step to checkpoint as the last good state: ``step - 1`` when no
    engine took an update during the failed step, None when one did (a trainer stepping several
    models, or several times per step: the latest checkpoint on disk is then the last good state).
    """

    def __init__(self, cfg: RunConfig, world: runtime.World, engines: dict, deferrable: bool = False):
        """``deferrable``: the trainer follows ``Engine.step_ok`` with its own per-step updates, so the
        engines may defer their check (``train.nonfinite_check``; see dstrain.engine.deferred_check)."""
        from dstrain.resilience import NonFiniteGuard, Watchdog
        t = cfg.train
        self.guard = (None if t.nonfinite == "off" else
                      NonFiniteGuard(t.nonfinite, t.max_consecutive_skips, world.rank, world.world_size))
        self.watchdog = Watchdog(world.rank, t.collective_timeout_s)
        from dstrain import resilience
        resilience.STOP_REQUESTED[0] = False  # (a run started in the same process after a stopped one)
        self.engines = dict(engines)
        for name, engine in self.engines.items():
            engine.watch(self.guard, self.watchdog, name, check=t.nonfinite_check if deferrable else "sync")
            note = getattr(engine, "nonfinite_check_note", "")
            if note and world.is_main:
                print(f"dstrain: {note}", flush=True)
        self._updates_at_begin = 0

    @property
    def stop_agreed(self) -> bool:
        """Whether a stop signal reached some rank, agreed by every rank at the same step (through the
        non-finite guard's per-step all-reduce; without the guard, the loops see it at their log step)."""
        return self.guard is not None and self.guard.stop_agreed

    @property
    def skipped(self) -> int:
        return self.guard.skipped if self.guard is not None else 0

    @skipped.setter
    def skipped(self, value: int) -> None:
        if self.guard is not None:
            self.guard.skipped = value

    def phase(self, name: str, step: int | None = None) -> None:
        self.watchdog.phase(name, step)

    def begin(self, step: int, phase: str = "data") -> None:
        self._updates_at_begin = sum(e.updates for e in self.engines.values())
        self.watchdog.phase(phase, step)

    def last_good(self, step: int) -> int | None:
        untouched = sum(e.updates for e in self.engines.values()) == self._updates_at_begin
        return step - 1 if untouched else None

    def settle(self, step: int, cfg: RunConfig) -> None:
        """At a step whose outcome the trainer is about to use (the last, a stop, a log, eval or checkpoint step):
        read the deferred check's pending verdict of each engine (``Engine.settle``; may raise ``NonFiniteError``)."""
        t = cfg.train
        if step == t.steps or self.stop_agreed or any(
                every and step % every == 0 for every in (t.log_every, t.eval_every, cfg.checkpoint.every)):
            for engine in self.engines.values():
                getattr(engine, "settle", lambda: None)()

    def keep_last_good(self, step: int, start_step: int, last_saved: int | None, save, saver,
                       error=None) -> None:
        """After ``NonFiniteError`` ``error`` in ``step``: ``save`` the last good step unless it is already on
        disk (or is the start), then wait until the saves in flight are complete. The deferred check names
        that step itself (``error.good_step``)."""
        good = getattr(error, "good_step", None)
        good = self.last_good(step) if good is None else good
        if good is not None and good > start_step and good != last_saved:
            save(good)
        saver.wait()

    def close(self) -> None:
        self.watchdog.close()
