"""Supervised language-model training: the loop every rank runs for ``dstrain train``.

Data order is a pure function of (data seed, sample) (see ``WindowSampler``), so a
resumed run only needs the step number and the samples taken (``samples`` in the
trainer state: another global batch continues where the checkpoint's run stopped);
each rank's random state is saved and restored beside it. Metrics are averaged over ranks before
rank 0 logs them.

Test hooks (environment; ``DSTRAIN_FAULT_RANK`` picks the rank, default 0):
``DSTRAIN_FAULT_AFTER_STEP=n`` kills it right after step n; ``DSTRAIN_FAULT_IN_SAVE=n``
while checkpoint n is being written (after DeepSpeed's files, before the COMPLETE
marker); ``DSTRAIN_FAULT_NAN_STEP=n`` makes its loss of step n NaN;
``DSTRAIN_FAULT_HANG_STEP=n`` makes it sleep in step n (see ``trainers/common.py``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dstrain import runtime
from dstrain.trainers.common import (CheckpointSaver, RunGuards, StopFlag, decide_resume, eval_and_save_due, fault,
                                     fault_hang, fault_raise, load_checkpoint, pin_plan, plan_and_record,
                                     warn_batch_change)
from dstrain.resilience import NonFiniteError, torch_timeout_s
from dstrain.trainers.run_files import cache_space_problem, write_summary
from dstrain.config import ConfigError, RunConfig, RunFolderError
from dstrain.data.corpus import ByteTokenizer, build_token_streams, load_documents, short_stream_problem
from dstrain.data.sampler import WindowSampler, get_batch
from dstrain.engine.factory import create_engine
from dstrain.metrics import RunLogger, Throughput, peak_memory_bytes, reduce_mean, reduce_mean_each


def corpus_tokenizer(cfg: RunConfig):
    """What the corpus is read with: the bytes (``ByteTokenizer``), or the model's own tokenizer where
    its spec has one (a policy loaded from a Hugging Face checkpoint with tokenizer files)."""
    from models import registry
    rl = getattr(registry.get_spec(cfg.model.name), "rl", None)
    own = getattr(rl, "corpus_tokenizer", None)
    if own is not None:
        found = own(registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args))
        if found is not None:
            return found
    return ByteTokenizer()


def load_token_streams(cfg: RunConfig, world: runtime.World) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 reads (and lets ``datasets`` cache) the corpus first; the others then read the cache."""
    cache = str(Path(cfg.output.dir) / ".cache" / "datasets")

    def read():
        docs = load_documents(cfg.data.corpus, cache_dir=cache, max_bytes=cfg.data.max_bytes)
        train, val = build_token_streams(docs, corpus_tokenizer(cfg), val_every=cfg.data.val_every)
        if problem := short_stream_problem(train, val, cfg.data.seq_len, cfg.data.val_every):
            raise ValueError(f"corpus {cfg.data.corpus!r}: {problem}")
        return train, val

    streams, error = None, None
    if world.is_main:
        try:
            streams = read()
        except (FileNotFoundError, ValueError) as err:  # a missing, empty or malformed corpus
            error = str(err)
        except OSError as err:  # a full disk under output.dir: one line, said by every rank
            error = cache_space_problem(err, cache)
            if error is None:
                raise
            error = ("full", error)
    error = runtime.broadcast_object(error)  # also the barrier: the others read rank 0's cache
    if isinstance(error, tuple):
        raise RunFolderError(error[1])
    if error is not None:
        raise ConfigError("run config", "data.corpus", error)
    return streams if world.is_main else read()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without the host waiting: from a CPU tensor to CUDA through pinned memory, non-blocking.
    PyTorch's blocking copy of pageable memory to a GPU synchronises the stream first, so every micro-batch's
    copy waited for the previous one's backward and optimizer step (the host wait the deferred non-finite check
    exists to avoid); the pinned block is kept until its copy is done (PyTorch's caching host allocator)."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class LMTrainer:
    """Owns the engine, data and sinks of one supervised LM run."""
    window: list = []
    """(loss, verdict) of the steps since the last log (checkpoints carry them; a resume sets them, ``run`` copies)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.world = runtime.init_distributed(timeout_s=torch_timeout_s(cfg.train.collective_timeout_s))
        self.out = Path(cfg.output.dir)
        self.ckpt_root = self.out / "checkpoints"
        resume_tag = decide_resume(self.cfg, self.world, self.out, self.ckpt_root)
        from models import registry
        self.spec = registry.get_spec(cfg.model.name)
        self.model_cfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
        self.train_tokens, self.val_tokens = load_token_streams(cfg, self.world)

        if resume_tag is not None:
            pin_plan(self.cfg, self.ckpt_root, resume_tag)
            if cfg.parallel.pp == "auto":  # resume with the stages the checkpoint was written by
                from dstrain.parallel.pipeline import stages_in_checkpoint
                cfg.parallel.pp = stages_in_checkpoint(self.ckpt_root / resume_tag)
        self.plan = plan_and_record(cfg, self.world, self.out, resume=(self.ckpt_root, resume_tag))
        if self.world.is_main:
            for note in plan_notes(cfg, self.plan):
                print(note, flush=True)
                with open(self.out / "plan.txt", "a") as fh:
                    fh.write(note + "\n")
        # After the plan: parallel.pp = auto is decided there.
        pp = self.plan.pipeline.pp if self.plan.pipeline is not None else 1
        self.parallel, self.dp_rank, self.dp_world = _parallel_layout(cfg, self.world, pp)

        runtime.seed_everything(cfg.train.seed)  # identical initial weights on every rank
        pipeline_parts = (None if self.spec.pipeline is None
                          else lambda ckpt: self.spec.pipeline(self.model_cfg, ckpt))
        self.engine = create_engine(lambda: self.spec.build(self.model_cfg), self.spec.parallelize,
                                    self.plan, cfg.train, parallel=self.parallel, sp_mode=cfg.parallel.sp_mode,
                                    pipeline_parts=pipeline_parts)
        self.pipelined = getattr(self.engine, "is_pipeline", False)
        # Per-rank dropout; tensor-parallel ranks share a seed (their replicated activations must agree).
        runtime.seed_everything(cfg.train.seed + 7919 * (self.world.rank // cfg.parallel.tp + 1))
        self.start_step = 0
        self.router_aux: list = []  # (mean load-balancing loss, verdict) of the steps since the last log (policy MoE)
        self.data_start = (0, 0)  # (step, sample): the data order continues from the checkpoint's position
        self.saver = CheckpointSaver(self.engine, self.ckpt_root, self.world, cfg, self.plan)
        self.guards = RunGuards(cfg, self.world, {"": self.engine}, deferrable=True)  # no updates of its own
        if resume_tag is not None:
            self._resume(resume_tag)
        with torch.device("meta"):
            self.flops_per_token = self.spec.build(self.model_cfg).flops_per_token(cfg.data.seq_len)
        self.sampler = WindowSampler(len(self.train_tokens), cfg.data.seq_len, cfg.data.seed)
        self.stop = StopFlag()

    # ---------------------------------------------------------------- folder and resume
    def _resume(self, tag: str) -> None:
        state = load_checkpoint(self.engine, self.ckpt_root, tag, self.world)
        self.start_step = int(state["step"])
        saved = json.loads((self.ckpt_root / tag / "ds_config.json").read_text())  # micro x accum x dp, resolved
        old = int(saved.get("train_batch_size") or 0) or self.global_batch
        # Where the data order stands: the samples the checkpoint's run took (older checkpoints: step x its batch).
        samples = int(state.get("samples", self.start_step * old))
        self.data_start = (self.start_step, self._samples_at_this_length(tag, samples))
        warn_batch_change(self.world, self.ckpt_root / tag, self.start_step, self.cfg.train.steps,
                          saved.get("train_batch_size"), self.plan.ds_config.get("train_batch_size"),
                          data_at=self.data_start[1])
        self.guards.skipped = int(state.get("skipped_steps", 0))
        # the steps since the last log, already averaged over ranks (older checkpoints: none, so the first log of
        # the resumed run averages only the steps after the checkpoint)
        # on the engine's device, as the new steps' losses are: window_state stacks both (a GPU run resumed and saved
        # again before its next log stacked CPU and GPU tensors: "Expected all tensors to be on the same device")
        window, aux = state.get("log_window", []), state.get("router_aux_window", [])
        dev = self.engine.device if window or aux else None
        self.window = [(torch.tensor(v, dtype=torch.float32, device=dev), None) for v in window]
        self.router_aux = [(torch.tensor(v, dtype=torch.float32, device=dev), None) for v in aux]

    def _samples_at_this_length(self, tag: str, samples: int) -> int:
        """Where the data order continues when ``data.seq_len`` changed since checkpoint ``tag``: in the same epoch,
        as many tokens into it (the same point of the same epoch), in samples of the new length. Before, the
        sample count was kept: doubling the length 90% through epoch 0 went on 80% through epoch 1 (most of
        the data left out), halving it went back to 45% of epoch 0 (trained on again). An epoch holds
        ``(tokens - 1) // seq_len`` windows, so its tokens depend on the length: counting tokens from the start of
        the data drifted by up to a window an epoch (``seq_len`` 3 -> 7 on a 1,001-token stream: 10 epochs in,
        the order went on in the next epoch)."""
        try:
            saved = int(json.loads((self.ckpt_root / tag / "run_config.json").read_text())["data"]["seq_len"])
        except (OSError, ValueError, KeyError, TypeError):
            return samples
        now = self.cfg.data.seq_len
        if saved <= 0 or saved == now:
            return samples
        stream = len(self.train_tokens)
        windows_then, windows_now = (stream - 1) // saved, (stream - 1) // now
        if windows_then <= 0 or windows_now <= 0:  # (the new length holds no window: the sampler says so)
            return samples * saved // now
        epoch, within = divmod(samples, windows_then)
        moved = epoch * windows_now + within * saved // now
        if self.world.is_main:
            print(f"dstrain: note: data.seq_len {saved} -> {now}: the data order continues {within * saved} tokens "
                  f"into epoch {epoch}, as the checkpoint's {samples} samples of {saved} tokens left it (sample "
                  f"{moved} of {now}; the same epoch); windows of the new length come in another order, so the rest "
                  "of this epoch may repeat or leave out some of the text already trained on", flush=True)
        return moved

    @property
    def global_batch(self) -> int:
        t = self.cfg.train
        return t.micro_batch * t.grad_accum * self.dp_world

    def first_sample(self, step: int) -> int:
        """Where (0-based) step ``step`` starts in the data order."""
        return self.data_start[1] + (step - self.data_start[0]) * self.global_batch

    def save(self, step: int) -> None:
        self.guards.phase("save", step)
        self.saver.save(step, state={"skipped_steps": self.guards.skipped, "samples": self.first_sample(step),
                                     "log_window": window_state(self.window),
                                     "router_aux_window": window_state(self.router_aux)})

    # ---------------------------------------------------------------- steps
    def _local(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a batch: its chunk of the sequence under sequence parallelism."""
        sp = self.cfg.parallel.sp
        if sp == 1:
            return x, y
        from dstrain.parallel.dims import sequence_chunk
        return sequence_chunk(x, y, sp, self.parallel.sp_rank)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """One optimizer step (grad_accum micro-batches); returns this rank's mean loss (a device tensor: read
        at log steps) and the deferred check's verdict (``Engine.step_ok``, None under the synchronous one),
        or None if the update was skipped for a non-finite loss or gradient (``train.nonfinite``, checked by
        the engine's step; the watchdog sees each phase)."""
        t, n = self.cfg.train, step + 1
        self.guards.begin(n)
        indices = self.sampler.local_batch_indices(step, t.micro_batch, t.grad_accum,
                                                   self.dp_rank, self.dp_world, self.first_sample(step))
        if self.pipelined:  # DeepSpeed's 1F1B over the grad_accum micro-batches; the loss is the dp mean
            self.guards.phase("pipeline step", n)
            loss = self.engine.train_batch(
                get_batch(self.train_tokens, micro, self.cfg.data.seq_len) for micro in indices)
            return (torch.as_tensor(loss, dtype=torch.float32), None) if self.engine.last_step_taken else None
        losses, auxes, taken = [], [], False
        for k, micro in enumerate(indices):
            x, y = self._local(*get_batch(self.train_tokens, micro, self.cfg.data.seq_len))
            if k == 0:
                self.guards.phase("forward", n)
                fault_hang(n)
            loss = self.engine(to_device(x, self.engine.device), to_device(y, self.engine.device))
            losses.append(loss.detach())
            aux = getattr(getattr(self.engine, "module", None), "router_aux_loss", None)  # a policy MoE's, in the loss
            if aux is not None:  # (each forward sets it: None where it computes none); a copy: under compile_mode
                auxes.append(aux.detach().float().clone())  # reduce-overhead the next replay overwrites it
            self.engine.backward(loss)
            taken = self.engine.step()  # the last micro-batch's may raise NonFiniteError (train.nonfinite)
        if taken and auxes:
            self.router_aux.append((torch.stack(auxes).mean(), self.engine.step_ok))
        return (torch.stack(losses).float().mean(), self.engine.step_ok) if taken else None

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first ``eval_batches x micro_batch x dp world`` validation windows of the seeded
        order, each window once: a validation stream holding fewer windows is evaluated whole (the last batch
        ragged), every window weighing the same (``micro_batch`` or fewer of them per forward; a rank with none
        left runs a whole micro-batch at weight 0, so that ZeRO-3's gathers stay in step: one window was another
        shape, which a CUDA run's static-shape compiled forward compiled again). Before, the order wrapped into a
        reshuffled second epoch and counted some windows twice. The pipeline engine keeps its micro-batch
        shape: it evaluates whole batches only (the last, ragged one left out where there are more)."""
        t, seq = self.cfg.train, self.cfg.data.seq_len
        val = WindowSampler(len(self.val_tokens), seq, self.cfg.data.seed)
        per_batch = t.micro_batch * self.dp_world
        total = min(t.eval_batches * per_batch, val.num_windows)
        if self.pipelined and total >= per_batch:
            total -= total % per_batch
        order = val.global_indices(0, max(total, per_batch))  # (fewer windows than one batch: wrapped, as before)
        self.engine.eval()
        sums = torch.zeros(2, dtype=torch.float64)  # loss x windows, windows
        for b in range(-(-total // per_batch)):
            first = b * per_batch + self.dp_rank * t.micro_batch
            idx = order[first:min(first + t.micro_batch, total)]
            weight = len(idx)
            if self.pipelined:
                idx, weight = order[first:first + t.micro_batch], t.micro_batch
            elif weight == 0:  # a whole micro-batch: the shape a compiled forward (CUDA, static shapes) has
                idx = order[:t.micro_batch]
            x, y = self._local(*get_batch(self.val_tokens, idx, seq))
            if self.pipelined:
                loss = self.engine.eval_batch(iter([(x, y)]))
            else:
                loss = self.engine(x.to(self.engine.device), y.to(self.engine.device)).item()
            sums += torch.tensor([loss * weight, weight], dtype=torch.float64)
        self.engine.train()
        sums = runtime.all_reduce(sums)
        return sums[0].item() / max(sums[1].item(), 1e-30)

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        log = RunLogger(self.out, self.world.rank, t.steps, self.start_step,
                        tensorboard=cfg.output.tensorboard, progress=cfg.output.progress)
        meter = Throughput(self.flops_per_token)
        tokens_per_step = cfg.tokens_per_step
        step, last_saved, stopped = self.start_step, None, False
        self.window = list(self.window)  # the checkpoint's steps since its last log, on a resume
        self.engine.train()
        start = time.perf_counter()
        try:
            for step in range(self.start_step + 1, t.steps + 1):
                try:
                    loss = self.train_step(step - 1)
                    self.guards.settle(step, cfg)  # the deferred check's verdict before logging, evaluating, saving
                except NonFiniteError as err:
                    self.guards.keep_last_good(step, self.start_step, last_saved, self.save, self.saver, err)
                    raise
                if loss is not None:
                    self.window.append(loss)
                meter.add(tokens_per_step)
                log.advance()
                if step % t.log_every == 0 or step == t.steps or self.guards.stop_agreed:  # a stop: log, save, leave
                    self.guards.phase("log", step)
                    rates = meter.read()
                    mean = mean_of_taken(self.window)  # empty: every update skipped
                    mean.update(mean_of_taken(self.router_aux, "router_aux_loss"))  # a policy MoE's
                    self.router_aux = []
                    stats = reduce_mean({**mean, "stop": float(self.stop.set),
                                         "memory_gb": peak_memory_bytes() / 1e9, **rates})
                    self.window = []
                    stats["tokens_per_s"] *= self.dp_world  # whole job (a replica's ranks share its tokens)
                    stats["flops_per_s"] *= self.dp_world
                    stats.pop("mfu", None)
                    stop = stats.pop("stop") > 0
                    stats.update(lr=self.engine.lr, skipped_steps=self.guards.skipped)
                    norm = self.engine.grad_norm
                    if norm is not None:
                        stats["grad_norm"] = norm
                    log.log(step, stats)
                    if stop:
                        log.message(f"stop requested: saving step {step} and leaving")
                        self.save(step)
                        last_saved, stopped = step, True
                        break
                evaluating, saving = eval_and_save_due(cfg, step, self.engine.device)
                aside = time.perf_counter()  # evaluation and saving: not in the tokens/s of the next window
                if evaluating:
                    self.guards.phase("eval", step)
                    log.log(step, {"loss": self.evaluate()}, prefix="val")
                if saving:
                    self.save(step)
                    last_saved = step
                meter.exclude(time.perf_counter() - aside)
                fault("DSTRAIN_FAULT_AFTER_STEP", step)
                fault_raise(step)
            if not stopped and last_saved != step and step > self.start_step:
                self.save(step)
            self.guards.phase("eval", step)
            val_loss = self.evaluate() if not stopped else None
            if val_loss is not None:
                log.log(step, {"loss": val_loss}, prefix="val")
            self.guards.phase("save", step)
            self.saver.wait()
        finally:
            self.guards.close()
            log.close()
        summary = {"step": step, "val_loss": val_loss, "stopped": stopped,
                   "seconds": time.perf_counter() - start, "profile": self.plan.profile,
                   "precision": self.plan.precision, "world_size": self.world.world_size,
                   "skipped_steps": self.guards.skipped, "nonfinite_check": self.engine.nonfinite_check,
                   "checkpoint_stalls_s": self.saver.stalls,
                   "checkpoint_async_s": self.saver.breakdown}
        if self.world.is_main:
            write_summary(self.out, summary)
        return summary


def mean_of_taken(losses: list[tuple[torch.Tensor, torch.Tensor | None]], name: str = "loss") -> dict:
    """``{name: mean}`` over the steps whose update was taken (``train_step``'s pairs: a verdict of 0 drops its
    step, a NaN loss included); one read from the device. Empty when there is none."""
    if not losses:
        return {}
    kept = [(loss, torch.ones((), device=loss.device) if ok is None else ok.to(loss.device)) for loss, ok in losses]
    total = sum(torch.where(ok > 0, loss.float(), torch.zeros((), device=loss.device)) for loss, ok in kept)
    count = sum(ok.float() for _, ok in kept)
    total, count = torch.stack([total, count]).tolist()
    return {name: total / count} if count > 0 else {}


def window_state(window: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[float]:
    """The losses of the steps since the last log whose update was taken, each averaged over the ranks (one
    all-reduce; every rank holds the same steps): a checkpoint carries them so that the resumed run's first
    log averages the same steps as the uninterrupted run's (bit-exact on one rank)."""
    kept = [loss.float() for loss, ok in window if ok is None or float(ok) > 0]
    if not kept:
        return []
    return [r["loss"] for r in reduce_mean_each([{"loss": v} for v in torch.stack(kept).cpu().tolist()])]


def _parallel_layout(cfg: RunConfig, world: runtime.World, pp: int = 1):
    """(ParallelState or None, data-parallel rank, data-parallel world size) of this rank (``pp``: the plan's)."""
    par = cfg.parallel
    if par.tp * par.sp * pp == 1:
        return None, world.rank, world.world_size
    from dstrain.parallel.dims import init_parallel
    try:
        state = init_parallel(par.tp, par.sp, pp)
    except ValueError as err:
        from dstrain.config import ConfigError
        raise ConfigError("run config", "parallel", str(err)) from None
    return state, state.dp_rank, state.dims.dp


def plan_notes(cfg: RunConfig, plan) -> list[str]:
    """``dstrain plan``'s notes (and plan.txt's): a policy mixture of experts' (``policy_rl.experts_note``: the
    experts a token runs through, the router load-balancing loss and its coefficient); none for other models."""
    from models import registry
    if getattr(registry.get_spec(cfg.model.name), "rl", None) is None:
        return []
    from dstrain.trainers.policy_rl import experts_note
    return [n for n in (experts_note(cfg),) if n]


def train(cfg: RunConfig) -> dict:
    return LMTrainer(cfg).run()
