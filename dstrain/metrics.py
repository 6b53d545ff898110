"""Throughput, memory, cross-rank averaging and the rank-0 sinks (TensorBoard, JSONL, progress bar).

With DeepSpeed's comms logger on (``output.comms``), every ``train`` record is followed by a
``comm`` record of per-step bytes and time per collective family (:mod:`dstrain.comms`)."""
from __future__ import annotations

import contextlib
import json
import resource
import sys
import time
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from dstrain.comms import CommsMeter


def peak_memory_bytes() -> int:
    """Peak memory of this rank: CUDA allocator peak on a GPU, peak RSS on a CPU (CPU ranks on a machine
    with a GPU, ``DS_ACCELERATOR=cpu``, included: a CUDA context they opened holds none of their tensors)."""
    from dstrain.runtime import ranks_use_cuda
    if ranks_use_cuda() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss_kb * (1 if sys.platform == "darwin" else 1024))


def reduce_mean(values: Mapping[str, float]) -> dict[str, float]:
    """Average each value over all ranks (one all-reduce); identity without a process group."""
    from dstrain.runtime import all_reduce
    keys = sorted(values)
    t = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    if dist.is_available() and dist.is_initialized():
        t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


def reduce_mean_each(records: list[Mapping[str, float]]) -> list[dict[str, float]]:
    """Each record's values averaged over all ranks, in one all-reduce (every rank holds as many records, with the
    same keys): the steps of a log window that a checkpoint carries (the LM, HRM and RL trainers)."""
    if not records:
        return []
    means = reduce_mean({f"{i:06d}\t{k}": float(v) for i, record in enumerate(records) for k, v in record.items()})
    out: list[dict[str, float]] = [{} for _ in records]
    for key, value in means.items():
        i, _, k = key.partition("\t")
        out[int(i)][k] = value
    return out


def wait_for_device(device) -> None:
    """Wait for the work queued on ``device`` (a GPU; nothing to wait for elsewhere) before timing work that a
    throughput window leaves out (an evaluation, a checkpoint save). A GPU runs behind the host (the deferred
    non-finite check waits for nothing), so the last step's kernels were still running when such work began, and
    its first wait (a loss read, a copy to the host) counted them as set aside: each evaluation or save off a log
    step took one step's time out of the window, and the rate came out too high. Call it only where there is
    work to set aside (it is one sync)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Throughput:
    """Tokens/s, FLOP/s and MFU over the steps since the last :meth:`read`."""

    def __init__(self, flops_per_token: float, peak_flops: float | None = None):
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._tokens = 0
        self._start = time.perf_counter()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` out of the current window: work between two log steps that trains no token (an
        evaluation, a checkpoint save), which would otherwise show as a dip in the next window's rates."""
        self._start += seconds

    def read(self) -> dict[str, float]:
        """Per-rank rates since the previous read; resets the window."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        tps = self._tokens / elapsed
        out = {"tokens_per_s": tps, "flops_per_s": tps * self.flops_per_token}
        if self.peak_flops:
            out["mfu"] = out["flops_per_s"] / self.peak_flops
        self._tokens, self._start = 0, now
        return out


def keep_records_until(path: Path, step: int) -> None:
    """Drop the records of ``path`` (metrics.jsonl) past ``step``, where this run starts (a resume's checkpoint step,
    0 for a fresh run), as TensorBoard's ``purge_step`` does for its events: the steps an interrupted run logged
    after its last checkpoint are trained again, and would otherwise appear twice, with the dead attempt's values
    first. A line cut short (a kill or a full disk mid-write) goes too; the next record would be glued to it."""
    import os
    try:
        src = open(path)
    except OSError:
        return
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    dropped = 0
    try:
        with src, open(tmp, "w") as dst:
            for line in src:
                try:
                    keep = int(json.loads(line)["step"]) <= step
                except (ValueError, KeyError, TypeError):
                    keep = False
                if keep:
                    dst.write(line if line.endswith("\n") else line + "\n")
                dropped += not keep
        if dropped:
            os.replace(tmp, path)
    except OSError:
        pass  # (a full disk: the records stay as they were)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


PROGRESS_LINE_EVERY_S = 30.0


def _stream_is_a_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def progress_bar(total: int, initial: int, stream, time_limit_s: float = 0.0):
    """tqdm's bar on a terminal; where the stream is not one (``nohup``, SLURM's ``--output`` file, a pipe to
    ``tee``), :class:`LineProgress`: tqdm redraws there with a carriage return at every step, which a log file
    keeps, so a 300-step run left one line of 300 bars (52,000 for HRM's ``sudoku_extreme``)."""
    if _stream_is_a_terminal(stream):
        from tqdm import tqdm
        return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=stream)
    return LineProgress(total, initial, stream, time_limit_s=time_limit_s)


class LineProgress:
    """The progress bar for a log file: one plain line when training starts, then at most one every
    ``every_s`` seconds and one at the end, e.g. ``train: 120/300 steps (40%), 5.51 step/s, 0:00:33 left,
    loss=2.2467``. With a time limit (HRM's ``task.time_limit_s``) that comes before the last step, the time left
    is the limit's. It offers what :class:`RunLogger` calls on tqdm's bar (update, set_postfix, write, close)."""

    def __init__(self, total: int, initial: int, stream, every_s: float = PROGRESS_LINE_EVERY_S,
                 clock=time.monotonic, time_limit_s: float = 0.0):
        self.total, self.n, self.stream, self.every_s, self.clock = total, initial, stream, every_s, clock
        self.time_limit_s = time_limit_s
        self.start_n, self.start_t = initial, clock()
        self.postfix: dict[str, str] = {}
        self.shown = None
        self.shown_t = self.start_t
        self._show(self.start_t)

    def _show(self, now: float) -> None:
        done = self.n - self.start_n
        parts = [f"train: {self.n}/{self.total} steps ({100 * self.n / max(1, self.total):.0f}%)"]
        if done > 0 and now > self.start_t:
            rate = done / (now - self.start_t)
            parts.append(f"{rate:.3g} step/s" if rate >= 1 else f"{1 / rate:.3g} s/step")
            left = max(0, self.total - self.n) / rate
            by_time = self.time_limit_s - (now - self.start_t) if self.time_limit_s else left
            end = " (the time limit)" if by_time < left else ""
            left = round(max(0.0, min(left, by_time)))
            parts.append(f"{left // 3600}:{left // 60 % 60:02d}:{left % 60:02d} left{end}")
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        self.write(", ".join(parts))
        self.shown = (self.n, dict(self.postfix))
        self.shown_t = now

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.shown_t >= self.every_s and self.n < self.total:  # the last line is close's
            self._show(now)

    def set_postfix(self, refresh: bool = False, **values) -> None:
        self.postfix.update({k: str(v) for k, v in values.items()})

    def write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.shown != (self.n, self.postfix):  # the last step's loss comes after its update
            self._show(self.clock())


class RunLogger:
    """Rank-0 sinks: metrics.jsonl (always), TensorBoard and a tqdm bar (optional).

    Every rank constructs one; only rank 0 writes anything.
    """

    def __init__(self, out_dir: str | Path, rank: int, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress: bool = True, time_limit_s: float = 0.0):
        self.rank = rank
        self.active = rank == 0
        self.writer = self.bar = self.jsonl = None
        self.comms = CommsMeter(start_step)  # every rank reads (and so resets) DeepSpeed's comms logger
        if not self.active:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        keep_records_until(out / "metrics.jsonl", start_step)
        # A sink that cannot be opened (its folder a link to a mount that is gone, not writable, a file in the
        # way) costs one warning and that sink, as one that fails later does (:meth:`_drop_sink`); before,
        # rank 0's traceback ended the run before its first step, and every restart met it again.
        try:
            self.jsonl = open(out / "metrics.jsonl", "a")
        except OSError as err:
            self._unopened("metrics.jsonl", out / "metrics.jsonl", err)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            try:
                self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start_step + 1)
            except OSError as err:
                self._unopened("TensorBoard events", out / "tensorboard", err)
        if progress:
            self.bar = progress_bar(total_steps, start_step, sys.stderr, time_limit_s)

    def log(self, step: int, values: Mapping[str, float], prefix: str = "train") -> None:
        comm = self.comms.read(step) if prefix == "train" else {}
        if not self.active:
            return
        if comm:
            self.log(step, comm, prefix="comm")
        record = {"step": step, **{f"{prefix}/{k}": v for k, v in values.items()}}
        if self.jsonl is not None:
            try:
                self.jsonl.write(json.dumps(record) + "\n")
                self.jsonl.flush()
            except OSError as err:
                self._drop_sink("jsonl", err)
        if self.writer is not None:
            try:
                for key, value in values.items():
                    self.writer.add_scalar(f"{prefix}/{key}", value, step)
            except OSError as err:
                self._drop_sink("writer", err)
        if self.bar is not None and prefix == "train" and "loss" in values:
            self.bar.set_postfix(loss=f"{values['loss']:.4f}", refresh=False)

    def _drop_sink(self, name: str, err: OSError) -> None:
        """A sink that cannot be written (disk full, its folder gone) is closed with one warning; training goes on,
        and so do the other sinks (a full disk then stops the run at its next checkpoint, with the line that says
        which checkpoint stays the latest)."""
        sink = getattr(self, name)
        setattr(self, name, None)
        with contextlib.suppress(OSError):
            sink.close()
        what = "TensorBoard events" if name == "writer" else "metrics.jsonl"
        self.message(f"dstrain: warning: {what} could not be written ({err.strerror or err}); no more {what} "
                     f"for the rest of this run, which goes on")

    def _unopened(self, what: str, path: Path, err: OSError) -> None:
        self.message(f"dstrain: warning: {what} cannot be written at {path} ({err.strerror or err}); no {what} "
                     "for this run, which goes on (make it writable, or remove what is in the way, for the next)")

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for name in ("writer", "jsonl"):
            sink = getattr(self, name)
            if sink is not None:
                try:
                    sink.close()
                except OSError as err:
                    self._drop_sink(name, err)
