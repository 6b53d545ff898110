"""The outer loop every policy-RL trainer (GRPO, SCoRe) runs: steps, logging, stop, checkpoints, eval.

A trainer subclasses :class:`RLLoop` and provides ``one_step(step) -> dict`` (this rank's
metrics of step ``step``, 0-based), ``evaluate(step) -> dict``, ``save(step)``,
``log_extras() -> dict`` (learning rate, gradient norm) and ``summary_extras() -> dict``,
plus the attributes set in its ``__init__``: ``cfg``, ``task``, ``world``, ``out``,
``start_step``, ``stop`` (a StopFlag), ``pool`` (the sandbox), ``samples_per_step``, ``plan``,
``guards`` (``common.RunGuards`` over its trained engines: ``train.nonfinite`` and the hang
watchdog) and ``saver`` (``common.CheckpointSaver``, which its ``save`` uses). Its ``save`` puts
``window_state(self.window)`` in the checkpoint's state as ``log_window`` and its resume passes that
state to :meth:`RLLoop.take_log_window`.
"""
from __future__ import annotations

import sys
import time

from dstrain.config import ConfigError
from dstrain.metrics import RunLogger, peak_memory_bytes, reduce_mean, reduce_mean_each
from dstrain.resilience import NonFiniteError
from dstrain.trainers.common import fault
from dstrain.trainers.run_files import write_summary


def batch_layout(train, num_generations: int, world_size: int, what: str = "completions") -> tuple[int, int]:
    """(samples per step, prompts per step); a ConfigError unless the groups fill the step exactly."""
    samples = train.micro_batch * train.grad_accum * world_size
    if samples % num_generations:
        raise ConfigError("run config", "train.micro_batch",
                          f"micro_batch x grad_accum x ranks = {samples} {what} per step "
                          f"must be a multiple of task.num_generations = {num_generations}")
    return samples, samples // num_generations


def sandbox_pool(task):
    """The pool of sandboxed code runners the task section asks for."""
    from dstrain.rewards import SandboxLimits, SandboxPool
    from dstrain.rewards.sandbox import SandboxFolderError
    limits = SandboxLimits(cpu_seconds=task.sandbox_cpu_s, wall_seconds=task.sandbox_wall_s,
                           memory_bytes=task.sandbox_memory_mb << 20, mode=getattr(task, "sandbox_mode", ""))
    try:
        return SandboxPool(task.sandbox_workers, limits)  # checks the folder before any program runs
    except SandboxFolderError as err:  # one line, as other run problems (every reward would be 0 otherwise)
        raise ConfigError("environment", "TMPDIR", str(err)) from None


def window_mean(window: list[dict]) -> dict[str, float]:
    """Mean of each key over the steps of a log window that have it (some keys appear every k steps)."""
    keys = set().union(*window)
    return {k: sum(x[k] for x in window if k in x) / sum(k in x for x in window) for k in keys}


def window_stats(window: list[dict], rates: dict[str, tuple[str, str]]) -> dict[str, float]:
    """The log window's values: :func:`window_mean` of each key, except each rate of ``rates``
    (``{rate: (count key, seconds key)}``), which is the window's total count over its total seconds
    (tokens over the time they took, as the LM trainer's meter measures them, not the mean of each
    step's rate: a short fast step would weigh as much as a long slow one). The count keys are not
    logged themselves."""
    counts = {count for count, _ in rates.values()}
    out = window_mean([{k: v for k, v in x.items() if k not in counts} for x in window])
    for rate, (count, seconds) in rates.items():
        steps = [x for x in window if count in x and seconds in x]
        if steps:
            out[rate] = sum(x[count] for x in steps) / max(sum(x[seconds] for x in steps), 1e-9)
    return out


def split_prefixed(stats: dict[str, float], default: str = "train") -> dict[str, dict[str, float]]:
    """``{"loss": 1, "time/generation": 2}`` -> ``{"train": {"loss": 1}, "time": {"generation": 2}}``:
    keys that name their own section are logged under it (``time/generation``, ``dynamic/rounds``)."""
    out: dict[str, dict[str, float]] = {default: {}}
    for key, value in stats.items():
        prefix, _, rest = key.partition("/") if "/" in key else (default, "", key)
        out.setdefault(prefix, {})[rest] = value
    return out


def time_split(sums: dict[str, float]) -> dict[str, dict[str, float]]:
    """Total seconds and share of ``time/step`` of each ``time/<part>`` summed over a run."""
    total = sums.get("time/step", 0.0)
    if total <= 0:
        return {}
    parts = {k.split("/", 1)[1]: v for k, v in sums.items() if k != "time/step"}
    parts["other"] = max(total - sum(parts.values()), 0.0)
    return {name: {"seconds": v, "share": v / total} for name, v in parts.items()} | {
        "step": {"seconds": total, "share": 1.0}}


def format_time_split(split: dict[str, dict[str, float]]) -> str:
    parts = [f"{name} {v['share'] * 100:.0f}% ({v['seconds']:.1f} s)" for name, v in split.items() if name != "step"]
    return f"step time split over {split['step']['seconds']:.1f} s: " + ", ".join(parts)


window_state = reduce_mean_each
"""A log window's steps with their values averaged over the ranks: a checkpoint carries them so that the resumed
run's first log averages the same steps as the uninterrupted run's (bit-exact on one rank)."""


class RLLoop:
    RATE_KEYS: tuple[str, ...] = ()
    """Per-rank rates that are multiplied by the world size when logged (whole-job rates)."""
    RATES: dict[str, tuple[str, str]] = {}
    """Rates formed over a log window from a count and a seconds key of each step (:func:`window_stats`)."""
    window: list[dict] = []
    """This rank's metrics of the steps since the last log (:meth:`take_log_window` sets it on a resume)."""

    def take_log_window(self, state: dict) -> None:
        """Start the log window with the steps a checkpoint carries (an older one without them: none, so the
        first log of the resumed run averages only the steps after the checkpoint)."""
        self.window = [dict(x) for x in state.get("log_window", [])]

    def run(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        log = RunLogger(self.out, self.world.rank, t.steps, self.start_step,
                        tensorboard=cfg.output.tensorboard, progress=cfg.output.progress)
        self.window = list(self.window)  # the checkpoint's steps since its last log, on a resume
        carried = list(self.window)  # their time went into the previous run's time split, not this one's
        time_sums: dict[str, float] = {}
        step, last_saved, stopped = self.start_step, None, False
        before = after = None
        start = time.perf_counter()
        try:
            if t.eval_every and self.start_step == 0:
                before = self.evaluate(0)
                log.log(0, before, prefix="val")
            for step in range(self.start_step + 1, t.steps + 1):
                self.guards.begin(step, "rollout")
                try:
                    self.window.append(self.one_step(step - 1))
                except NonFiniteError:  # train.nonfinite=stop, or too many skips in a row
                    self.guards.keep_last_good(step, self.start_step, last_saved, self.save, self.saver)
                    raise
                log.advance()
                if step % t.log_every == 0 or step == t.steps or self.guards.stop_agreed:  # a stop: log, save, leave
                    window, len_window = self.window, len(self.window)
                    limit = self.task.time_limit_s
                    out_of_time = float(bool(limit) and time.perf_counter() - start > limit)
                    stats = reduce_mean({**window_stats(window, self.RATES), "stop": float(self.stop.set),
                                         "out_of_time": out_of_time, "memory_gb": peak_memory_bytes() / 1e9})
                    for k in self.RATE_KEYS:
                        if k in stats:
                            stats[k] *= self.world.world_size
                    stop, out_of_time = stats.pop("stop") > 0, stats.pop("out_of_time") > 0
                    stats.update(self.log_extras(), skipped_steps=self.guards.skipped)
                    for prefix, values in split_prefixed(stats).items():
                        log.log(step, values, prefix=prefix)
                    for k, v in stats.items():
                        if k.startswith("time/"):
                            time_sums[k] = time_sums.get(k, 0.0) + v * len_window - sum(x.get(k, 0.0) for x in carried)
                    self.window, carried = [], []
                    if stop or out_of_time:
                        log.message(("stop requested" if stop else f"time limit of {limit:.0f} s reached")
                                    + f": saving step {step} and leaving")
                        self.save(step)
                        last_saved, stopped = step, stop
                        break
                if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                    self.guards.phase("eval", step)
                    log.log(step, self.evaluate(step), prefix="val")
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    self.guards.phase("save", step)
                    self.save(step)
                    last_saved = step
                fault("DSTRAIN_FAULT_AFTER_STEP", step)
            if not stopped and last_saved != step and step > self.start_step:
                self.save(step)
            if not stopped:
                self.guards.phase("eval", step)
                after = self.evaluate(step)
                log.log(step, after, prefix="val")
            self.guards.phase("save", step)
            self.saver.wait()
        finally:
            self.guards.close()
            log.close()
            self.pool.close()
            rollouts = getattr(self, "rollouts", None)
            if rollouts is not None:  # a Ray cluster: leave it (and end it on rank 0); no barrier after a crash
                rollouts.close(clean=sys.exc_info()[0] is None)
        split = time_split(time_sums)
        if split and self.world.is_main:
            print(format_time_split(split), flush=True)
        summary = {"step": step, "stopped": stopped, "seconds": time.perf_counter() - start,
                   **({"time_split": split} if split else {}),
                   "eval_before": before, "eval_after": after, "profile": self.plan.profile,
                   "precision": self.plan.precision, "world_size": self.world.world_size,
                   "samples_per_step": self.samples_per_step, "skipped_steps": self.guards.skipped,
                   **self.summary_extras()}
        if self.world.is_main:
            write_summary(self.out, summary)
        return summary
