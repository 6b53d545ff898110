"""HRM on Sudoku: the stateful ACT training loop every rank runs for ``dstrain train``.

Each rank holds ``global_batch / ranks`` rows. A row keeps its ACT carry (H and L
states, step count) from one optimizer step to the next; only the rows that halted
take a new puzzle, from the same row of this step's batch (the batch of step ``s`` is
a pure function of the data seed and ``s``, see :class:`SudokuGroups`). The dense
parameters train in the DeepSpeed engine; the puzzle-embedding table trains beside it
with :class:`SparseSignSGD`, whose learning rate follows the engine's schedule.

A checkpoint holds the engine's files, every rank's random state, the puzzle table and
every rank's carry (``hrm/``), so a resumed run continues the same rows.
Evaluation runs every held-out puzzle for ``halt_max_steps`` segments.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

from dstrain import runtime
from dstrain.resilience import NonFiniteError, torch_timeout_s
from dstrain.trainers.common import (CheckpointSaver, RunGuards, StopFlag, decide_resume, eval_and_save_due, fault,
                                     load_checkpoint, pin_plan, plan_and_record)
from dstrain.config import ConfigError, RunConfig, RunFolderError
from dstrain.trainers.run_files import write_summary
from dstrain.data import sudoku
from dstrain.data.prefetch import StepPrefetcher
from dstrain.engine.ds_trainers import schedule_reference_lr
from dstrain.engine.factory import create_engine
from dstrain.metrics import RunLogger, reduce_mean, reduce_mean_each
from dstrain.async_checkpoint import to_host
from dstrain.optim.ema import EMA
from dstrain.optim.sparse_sign_sgd import SparseEmbedding, SparseSignSGD
from dstrain.trainers import task_config
from dstrain.trainers.hrm_config import HRMTaskConfig

RATIO_KEYS = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")
"""Metrics averaged over the rows that halted; the rest are averaged over all rows."""


def load_sudoku(task: HRMTaskConfig, seed: int, global_batch: int = 0):
    """(train puzzles, train solutions, eval puzzles, eval solutions) as the task says. A training set whose
    puzzles and their augmentations number fewer than ``global_batch`` (each batch would hold one sample twice),
    or an ``eval_file`` sharing a puzzle with ``train_file``, is refused naming the key."""
    if task.source == "generate":
        train = sudoku.generate_many(task.train_puzzles, task.blanks, seed, size=task.grid)
        held = sudoku.generate_many(task.eval_puzzles, task.blanks, seed + 1_000_003, size=task.grid)
        _enough_for_batch(task, len(train[0]), global_batch, "task.train_puzzles")
        return (*train, *held)
    out = _read_sudoku_files(task)
    _enough_for_batch(task, len(out[0]), global_batch, "task.train_file")
    if task.eval_file:
        shared = {p.tobytes() for p in out[0]} & {p.tobytes() for p in out[2]}
        if shared:
            raise ConfigError("run config", "task.eval_file",
                              f"{task.eval_file} shares {len(shared)} puzzle(s) with task.train_file "
                              f"{task.train_file}: held-out puzzles must not be trained on; remove them from one file")
    return out


def _enough_for_batch(task: HRMTaskConfig, puzzles: int, global_batch: int, key: str) -> None:
    samples = puzzles * (task.augmentations + 1)
    if global_batch and samples < global_batch:
        raise ConfigError("run config", key,
                          f"{puzzles} training puzzle(s) x {task.augmentations + 1} (task.augmentations + 1) = "
                          f"{samples} samples, fewer than task.global_batch={global_batch}: every batch would "
                          f"repeat samples; add puzzles or augmentations, or lower task.global_batch")


def _read_sudoku_files(task: HRMTaskConfig):
    try:
        if task.eval_file:
            held = sudoku.read_puzzle_file(task.eval_file, limit=task.eval_puzzles)
            train = sudoku.read_puzzle_file(task.train_file, limit=task.train_puzzles)
        else:
            held = sudoku.read_puzzle_file(task.train_file, limit=task.eval_puzzles)
            train = sudoku.read_puzzle_file(task.train_file, limit=task.train_puzzles, skip=task.eval_puzzles)
    except (OSError, ValueError) as err:  # a missing, unreadable, empty or malformed puzzle file
        named = str(err) if not isinstance(err, OSError) or isinstance(err, FileNotFoundError) else \
            f"{err.filename}: cannot be read ({err.strerror}); make it readable (chmod a+r)"
        raise ConfigError("run config", "task.train_file" if str(task.train_file) in named else "task.eval_file",
                          named) from None
    return (*train, *held)


def summarise(sums: dict[str, float]) -> dict[str, float]:
    """Metric sums (already reduced over ranks) -> means: per halted row or per row."""
    out = {}
    rows, count = max(sums.get("rows", 0.0), 1e-9), sums.get("count", 0.0)
    for key, value in sums.items():
        if key in ("rows", "count"):
            continue
        if key in RATIO_KEYS:
            if count > 0:
                out[key] = value / count
        else:
            out[key] = value / rows
    out["halted_fraction"] = count / rows
    return out


def carry_layout_problem(ckpt_root: Path, tag: str, global_batch: int, world_size: int) -> str | None:
    """Why a run of ``global_batch`` puzzles over ``world_size`` ranks cannot take over checkpoint ``tag``'s ACT carry
    (each rank's rows, mid-puzzle), else None; ``dstrain launch --resume`` asks it before any rank starts."""
    state = json.loads((Path(ckpt_root) / tag / "trainer_state.json").read_text())
    old = int(state.get("global_batch", global_batch)), int(state.get("world_size", world_size))
    if old == (global_batch, world_size):
        return None
    return (f"checkpoint {Path(ckpt_root) / tag} holds the ACT carry of {old[0]} puzzles over {old[1]} rank(s) (each "
            f"row mid-puzzle); this run has {global_batch} over {world_size}: resume with task.global_batch={old[0]} "
            f"on {old[1]} rank(s), or start a new run from exported weights")


class HRMTrainer:
    """Owns the engine, the puzzle table, the data and the carries of one HRM run."""
    log_sums: dict[str, torch.Tensor] = {}
    """The metric sums of the steps since the last log (a resume sets them from the checkpoint; ``run`` copies)."""
    log_losses: list[torch.Tensor] = []
    """The losses of the steps since the last log, likewise."""

    def __init__(self, cfg: RunConfig):
        self.world = runtime.init_distributed(timeout_s=torch_timeout_s(cfg.train.collective_timeout_s))
        self.task: HRMTaskConfig = task_config(cfg)
        ws = self.world.world_size
        if cfg.train.grad_accum != 1:
            raise ConfigError("run config", "train.grad_accum",
                              f"the HRM trainer steps once per ACT segment: must be 1, got {cfg.train.grad_accum}")
        self.global_batch = self.task.global_batch or cfg.train.micro_batch * ws
        if self.global_batch % ws:
            raise ConfigError("run config", "task.global_batch",
                              f"{self.global_batch} puzzles do not split evenly over {ws} ranks")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch=self.global_batch // ws))
        self.cfg, self.local_batch = cfg, self.global_batch // ws
        self.out = Path(cfg.output.dir)
        self.ckpt_root = self.out / "checkpoints"
        resume_tag = decide_resume(self.cfg, self.world, self.out, self.ckpt_root)
        from models import registry
        self.spec = registry.get_spec(cfg.model.name)
        self.model_cfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
        n = self.task.grid
        if getattr(self.model_cfg, "seq_len", n * n) != n * n or \
                getattr(self.model_cfg, "vocab_size", n + 2) != sudoku.vocab_size(n):
            raise ConfigError("run config", "model.args",
                              f"a {n}x{n} Sudoku needs seq_len {n * n} and vocab_size {n + 2}, got "
                              f"{self.model_cfg.seq_len} and {self.model_cfg.vocab_size}")

        if resume_tag is not None:
            pin_plan(self.cfg, self.ckpt_root, resume_tag)
        tp, ts, ep, es = load_sudoku(self.task, cfg.data.seed, self.global_batch)
        self.train_set = sudoku.SudokuGroups(tp, ts, self.task.augmentations, cfg.data.seed, self.task.mask_givens)
        self.eval_inputs, self.eval_labels = sudoku.encode(ep, es, self.task.mask_givens)

        self.plan = plan_and_record(cfg, self.world, self.out, resume=(self.ckpt_root, resume_tag))

        runtime.seed_everything(cfg.train.seed)
        self.engine = create_engine(lambda: self.spec.build(self.model_cfg), self.spec.parallelize,
                                    self.plan, cfg.train)
        self.device = self.engine.device
        # the engine's rate as a fraction of its schedule's full rate scales the puzzle embedding's lr
        self.full_lr = schedule_reference_lr(self.plan.ds_config, cfg.train.lr)
        self.guards = RunGuards(cfg, self.world, {"": self.engine}, deferrable=True)  # step_ok followed below
        self.saver = CheckpointSaver(self.engine, self.ckpt_root, self.world, cfg, self.plan)
        emb_len = getattr(self.model_cfg, "puzzle_emb_len", 0)
        self.puzzle_emb = self.sparse_opt = None
        if emb_len:
            rows = 1 if self.task.puzzle_ids == "shared" else len(self.train_set) + 1
            self.puzzle_emb = SparseEmbedding(rows, emb_len * self.model_cfg.hidden_size, device=self.device)
            self.sparse_opt = SparseSignSGD(self.puzzle_emb, self.task.puzzle_emb_lr,
                                            self.task.puzzle_emb_weight_decay, equal_counts=True)
        self.ema = None
        if self.task.ema:
            if self.plan.zero["stage"] == 3:
                raise ConfigError("run config", "task.ema", "needs full parameters on every rank: "
                                  f"use a ZeRO stage below 3 (the plan chose {self.plan.profile})")
            self.ema = EMA(self.engine.module, self.task.ema)
        runtime.seed_everything(cfg.train.seed + 7919 * (self.world.rank + 1))  # per-rank exploration
        self.carry: dict | None = None
        self._prefetched: dict[int, dict] = {}
        self.start_step = 0
        if resume_tag is not None:
            self._resume(resume_tag)
        self._batch = functools.partial(self.train_set.local_batch, global_batch=self.global_batch,
                                        rank=self.world.rank, world_size=self.world.world_size)  # step -> Batch
        workers = self.task.data_workers if self.task.data_workers >= 0 else int(self.device.type == "cuda")
        # started last: nothing above can leave it running
        self._batches = StepPrefetcher(self._batch) if workers else None
        self.stop = StopFlag()

    # ---------------------------------------------------------------- folder, save, resume
    def save(self, step: int) -> None:
        def write_state(tag_dir: Path) -> None:
            state_dir = tag_dir / "hrm"
            state_dir.mkdir(parents=True, exist_ok=True)
            torch.save(self.carry, state_dir / f"carry_rank_{self.world.rank}.pt")
            if self.world.is_main and self.puzzle_emb is not None:
                torch.save(self.puzzle_emb.state_dict(), state_dir / "puzzle_emb.pt")
            if self.world.is_main and self.ema is not None:
                torch.save(to_host(self.ema.state_dict()), state_dir / "ema.pt")  # loads anywhere, GPU or not
        self.guards.phase("save", step)
        self.saver.save(step, {"global_batch": self.global_batch, "skipped_steps": self.guards.skipped,
                               "log_window": hrm_window_state(self.log_sums, self.log_losses)}, write_state)

    def _resume(self, tag: str) -> None:
        self._check_carry_layout(tag)
        state = load_checkpoint(self.engine, self.ckpt_root, tag, self.world)
        state_dir = self.ckpt_root / tag / "hrm"
        if self.puzzle_emb is not None:
            self.puzzle_emb.load_state_dict(torch.load(state_dir / "puzzle_emb.pt", weights_only=True,
                                                       map_location=self.device))
        self.carry = torch.load(state_dir / f"carry_rank_{self.world.rank}.pt", weights_only=True,
                                map_location=self.device)
        if self.ema is not None:
            self.ema.load_state_dict(torch.load(state_dir / "ema.pt", weights_only=True, map_location=self.device))
        self.start_step, self.guards.skipped = int(state["step"]), int(state.get("skipped_steps", 0))
        # the steps since the last log (older checkpoints: none, so the first log of the resumed run averages only
        # the steps after the checkpoint)
        window = state.get("log_window") or {}
        self.log_sums = {k: torch.tensor(v, dtype=torch.float32, device=self.device)
                         for k, v in window.get("sums", {}).items()}
        self.log_losses = [torch.tensor(v, dtype=torch.float32, device=self.device) for v in window.get("losses", [])]

    def _check_carry_layout(self, tag: str) -> None:
        """Refuse, before loading, a checkpoint whose ACT carry (each rank's rows, mid-puzzle) this run cannot take
        over: another global batch or number of ranks (the puzzles in flight would be lost or misplaced)."""
        problem = carry_layout_problem(self.ckpt_root, tag, self.global_batch, self.world.world_size)
        if problem:
            raise RunFolderError(problem)

    # ---------------------------------------------------------------- steps
    def _ids(self, groups: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(groups) if self.task.puzzle_ids == "shared" else groups + 1

    def _fetch(self, step: int) -> dict:
        """Step ``step``'s new puzzles, on the device (copied without waiting, from pinned memory on GPUs)."""
        b = self._batches.get(step) if self._batches is not None else self._batch(step)
        pin = self.device.type == "cuda"
        out = {}
        for key, array in (("inputs", b.inputs), ("labels", b.labels), ("groups", b.groups)):
            t = torch.from_numpy(array)
            out[key] = (t.pin_memory() if pin else t).to(self.device, non_blocking=True)
        return out

    def _next_rows(self, step: int) -> dict:
        """This step's rows: halted rows take this step's new puzzles, the others keep theirs.

        Everything stays on the device and keeps its shape (the halting mask selects with
        ``torch.where``), so no step waits for the device.
        """
        new = self._prefetched.pop(step, None) or self._fetch(step)
        self._prefetched = {step + 1: self._fetch(step + 1)}  # the next batch's copy overlaps this step
        if self.carry is None:
            return {**new, "reset": torch.ones(self.local_batch, dtype=torch.bool, device=self.device)}
        reset = self.carry["halted"].to(self.device)
        rows = {k: torch.where(reset.view(-1, *[1] * (v.dim() - 1)), v, self.carry[k].to(self.device))
                for k, v in new.items()}
        return {**rows, "reset": reset}

    def train_step(self, step: int) -> tuple[torch.Tensor, dict]:
        """One ACT segment and one optimizer step; returns this rank's loss and metric sums as
        device tensors (read them at log steps only: reading waits for the device)."""
        rows = self._next_rows(step)
        emb = None
        if self.puzzle_emb is not None:
            emb = self.puzzle_emb.lookup(self._ids(rows["groups"]))
        carry = self.carry or {}
        loss, out = self.engine(rows["inputs"], rows["labels"], emb,
                                carry.get("z_H"), carry.get("z_L"), carry.get("steps"), rows["reset"])
        self.engine.backward(loss)
        lr_factor = self.engine.next_lr / self.full_lr if self.full_lr > 0 else 1.0  # this update's
        taken = self.engine.step()  # False: skipped under train.nonfinite=skip (the table is left too)
        ok = self.engine.step_ok  # the deferred check's verdict on the device (None: taken says it)
        if self.sparse_opt is not None and taken:
            self.sparse_opt.step(self.task.puzzle_emb_lr * lr_factor, ok)
        if self.ema is not None and taken:
            self.ema.update(self.engine.module, ok)
        self.carry = {"z_H": out["z_H"], "z_L": out["z_L"], "steps": out["steps"],
                      "halted": out["halted"], "inputs": rows["inputs"], "labels": rows["labels"],
                      "groups": rows["groups"]}
        return loss.detach(), out["metrics"]

    @torch.no_grad()
    def evaluate(self, inputs: np.ndarray | None = None, labels: np.ndarray | None = None) -> dict:
        """Metrics over held-out puzzles (split over ranks), every row run ``halt_max_steps`` segments."""
        inputs = self.eval_inputs if inputs is None else inputs
        labels = self.eval_labels if labels is None else labels
        emb = None if self.puzzle_emb is None else self.puzzle_emb.weight[0]  # held-out puzzles: id 0
        args = (self.model_cfg.halt_max_steps, inputs, labels, self.local_batch, self.world.rank,
                self.world.world_size, self.device, emb)
        if self.ema is None:
            return evaluate_rows(self.engine, *args)
        with self.ema.applied(self.engine.module):
            stats = evaluate_rows(self.engine, *args)
        raw = evaluate_rows(self.engine, *args)  # the trained weights, logged as val_raw/
        return {**stats, **{f"raw_{k}": v for k, v in raw.items() if k in ("exact_accuracy", "accuracy", "loss")}}

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        log = RunLogger(self.out, self.world.rank, t.steps, self.start_step, tensorboard=cfg.output.tensorboard,
                        progress=cfg.output.progress, time_limit_s=self.task.time_limit_s or 0.0)
        timed, step, last_saved, stopped, val, val_step = 0, self.start_step, None, False, None, None
        self.log_sums, self.log_losses = dict(self.log_sums), list(self.log_losses)  # a resume's, or none
        self.engine.train()
        start = window = time.perf_counter()
        try:
            for step in range(self.start_step + 1, t.steps + 1):
                self.guards.begin(step)
                try:
                    loss, metrics = self.train_step(step - 1)
                    self.guards.settle(step, cfg)  # the deferred check's verdict before logging, evaluating, saving
                except NonFiniteError as err:  # train.nonfinite=stop, or too many skips in a row
                    self.guards.keep_last_good(step, self.start_step, last_saved, self.save, self.saver, err)
                    raise
                self.log_losses.append(loss)
                timed += 1
                for k, v in metrics.items():
                    self.log_sums[k] = self.log_sums[k] + v if k in self.log_sums else v.clone()
                log.advance()
                if step % t.log_every == 0 or step == t.steps or self.guards.stop_agreed:  # a stop: log, save, leave
                    sums = {k: float(v) for k, v in self.log_sums.items()}  # the one wait for the device per log step
                    losses = torch.stack(self.log_losses).double().cpu().tolist()
                    now = time.perf_counter()
                    limit = self.task.time_limit_s
                    out_of_time = bool(limit) and now - start > limit
                    reduced = reduce_mean({**sums, "step_loss": sum(losses) / len(losses),
                                           "stop": float(self.stop.set), "out_of_time": float(out_of_time)})
                    out_of_time = reduced.pop("out_of_time") > 0
                    stats = summarise({k: v for k, v in reduced.items() if k not in ("step_loss", "stop")})
                    stats.update(loss=reduced["step_loss"], lr=self.engine.lr, skipped_steps=self.guards.skipped,
                                 segments_per_s=timed * self.global_batch / max(now - window, 1e-9))
                    if self.sparse_opt is not None:
                        stats["puzzle_emb_lr"] = self.task.puzzle_emb_lr * self.engine.lr / max(self.full_lr, 1e-30)
                    norm = self.engine.grad_norm
                    if norm is not None:
                        stats["grad_norm"] = norm
                    log.log(step, stats)
                    self.log_sums, self.log_losses, timed, window = {}, [], 0, now
                    if reduced["stop"] > 0:
                        log.message(f"stop requested: saving step {step} and leaving")
                        self.save(step)
                        last_saved, stopped = step, True
                        break
                    if out_of_time:
                        log.message(f"time limit of {limit:.0f} s reached at step {step}")
                        break
                evaluating, saving = eval_and_save_due(cfg, step, self.engine.device)
                aside = time.perf_counter()  # evaluation and saving: not in the segments/s of the next window
                if evaluating:
                    self.guards.phase("eval", step)
                    val, val_step = self.evaluate(), step
                    log.log(step, val, prefix="val")
                    self.engine.train()
                if saving:
                    self.save(step)
                    last_saved = step
                window += time.perf_counter() - aside
                fault("DSTRAIN_FAULT_AFTER_STEP", step)
            if not stopped and last_saved != step and step > self.start_step:
                self.save(step)
            if stopped:
                val = None
            elif val_step != step:
                self.guards.phase("eval", step)
                val = self.evaluate()
                log.log(step, val, prefix="val")
            self.guards.phase("save", step)
            self.saver.wait()
        finally:
            if self._batches is not None:
                self._batches.close()
            self.guards.close()
            log.close()
        summary = {"step": step, "val_loss": val["loss"] if val else None,
                   "val_exact_accuracy": val.get("exact_accuracy") if val else None,
                   "val_accuracy": val.get("accuracy") if val else None, "stopped": stopped,
                   "seconds": time.perf_counter() - start, "profile": self.plan.profile,
                   "precision": self.plan.precision, "world_size": self.world.world_size,
                   "global_batch": self.global_batch, "skipped_steps": self.guards.skipped,
                   "nonfinite_check": self.engine.nonfinite_check}
        if self.world.is_main:
            write_summary(self.out, summary)
        return summary


def hrm_window_state(sums: dict[str, torch.Tensor], losses: list[torch.Tensor]) -> dict:
    """The metric sums and per-step losses of the steps since the last log, averaged over the ranks (one
    all-reduce; every rank holds the same steps): a checkpoint carries them so that the resumed run's first log
    averages the same steps as the uninterrupted run's (bit-exact on one rank)."""
    if not sums and not losses:
        return {}
    means = reduce_mean_each([{k: float(v) for k, v in sums.items()}]
                             + [{"loss": v} for v in (torch.stack(losses).cpu().tolist() if losses else [])])
    return {"sums": means[0], "losses": [r["loss"] for r in means[1:]]}


@torch.no_grad()
def evaluate_rows(model, halt_max_steps: int, inputs: np.ndarray, labels: np.ndarray, batch: int,
                  rank: int = 0, world_size: int = 1, device="cpu", puzzle_emb=None) -> dict:
    """Run rows ``rank::world_size`` of ``(inputs, labels)`` for ``halt_max_steps`` segments each.

    ``model`` is the engine (or a bare HRM); ``puzzle_emb`` one row ``[dim]`` used for every
    puzzle (default zeros: the shared identifier's start). Metrics are reduced over ranks;
    ``loss`` is that of the last segment.
    """
    model.eval()
    mine = np.arange(rank, len(inputs), world_size)
    sums: dict[str, float] = {}
    # Every rank runs as many batches as the rank with the most rows (rank 0): under ZeRO-3 each
    # forward gathers the parameters with all ranks, so a rank that stopped early would hang the rest.
    rounds = -(-(-(-len(inputs) // world_size)) // batch)
    for lo in range(0, rounds * batch, batch):
        idx = mine[lo:lo + batch]
        counted = len(idx) > 0
        if not counted:  # a batch for the others' sake: one row, its metrics dropped
            idx = np.zeros(1, dtype=np.int64)
        x = torch.from_numpy(inputs[idx]).to(device)
        y = torch.from_numpy(labels[idx]).to(device)
        emb = None if puzzle_emb is None else puzzle_emb.to(device).expand(len(idx), -1)
        z_H = z_L = steps = None
        for _ in range(halt_max_steps):
            loss, out = model(x, y, emb, z_H, z_L, steps, None)
            z_H, z_L, steps = out["z_H"], out["z_L"], out["steps"]
        if not counted:
            continue
        for k, v in out["metrics"].items():
            sums[k] = sums.get(k, 0.0) + float(v)
        sums["loss_sum"] = sums.get("loss_sum", 0.0) + float(loss) * len(idx)
    reduced = reduce_mean({k: sums.get(k, 0.0) for k in
                           ("rows", "count", "accuracy", "exact_accuracy", "q_halt_accuracy", "steps",
                            "lm_loss", "q_halt_loss", "q_continue_loss", "loss_sum")})
    loss_sum = reduced.pop("loss_sum")
    stats = summarise(reduced)
    stats["loss"] = loss_sum / max(reduced["rows"], 1e-9)
    stats.pop("q_continue_loss", None)
    stats.pop("halted_fraction", None)
    return stats


def train(cfg: RunConfig) -> dict:
    return HRMTrainer(cfg).run()
