"""Communication you can see: bytes and time of every collective, per optimizer step.

DeepSpeed wraps each collective in ``deepspeed.comm`` (``timed_op``); with its
``comms_logger`` enabled it records, per op name and message size, the count
and the time (after synchronising the device, so the figure is the op's own
time, not its launch). Two facts about DeepSpeed 0.19.8 that shape this module:

- the recorded "latency" of a call is read with ``elapsed(reset=False)`` from a
  timer that is never reset, so it is the running total of every earlier call of
  that name, and the timer's list of records grows for the whole run (each call
  sums it again). The per-step figures here therefore come from the timers
  themselves, read and reset once per logged window, which also keeps their cost
  bounded;
- the message size is the tensor handed to the call (the input of
  ``reduce_scatter_tensor``, the shard of ``all_gather_into_tensor``).

:class:`CommsMeter` turns that into per-step averages grouped by family
(all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, p2p, barrier,
other) plus the share of wall time spent in communication. The run config's
``output.comms`` switches DeepSpeed's logger on (:func:`comms_sections`); a
user's JSON with ``comms_logger.enabled`` gets the same metrics. The figures are
rank 0's view (other ranks may wait longer or shorter).
"""
from __future__ import annotations

import sys
import time
from typing import Mapping

#: DeepSpeed op (log) name -> family reported.
FAMILIES: dict[str, str] = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "inference_all_reduce": "all_reduce",
    "reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
    "all_gather_coalesced": "all_gather", "all_gather_object": "all_gather",
    "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
    "broadcast": "broadcast", "broadcast_object_list": "broadcast",
    "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p", "batch_isend_irecv": "p2p",
    "barrier": "barrier",
}
COMM_DTYPES = ("auto", "fp32", "bf16", "fp16")


def family(log_name: str) -> str:
    """The family of a DeepSpeed log name (``"all_reduce | [Caller Func: f]"`` -> ``all_reduce``)."""
    return FAMILIES.get(log_name.split(" | ", 1)[0].strip(), "other")


def summarize(raw: Mapping[str, Mapping[int, list]], seconds_by_name: Mapping[str, float], steps: int,
              wall_s: float | None = None) -> dict[str, float]:
    """Per-step averages from DeepSpeed's raw record and the time spent per op name.

    ``raw``: ``{log_name: {msg_bytes: [count, latencies, algbw, busbw]}}`` (DeepSpeed's
    ``comms_dict``); ``seconds_by_name``: total seconds per log name over the window;
    ``steps``: optimizer steps in the window; ``wall_s``: the window's wall time (for
    ``share``). Returns ``{"<family>_bytes", "<family>_ms", "<family>_calls", "total_bytes",
    "total_ms", "calls", "share"}``, the families present only.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    out: dict[str, float] = {}
    for name in set(raw) | set(seconds_by_name):
        fam = family(name)
        sizes = raw.get(name, {})
        calls = sum(rec[0] for rec in sizes.values())
        nbytes = sum(size * rec[0] for size, rec in sizes.items())
        for key, value in ((f"{fam}_bytes", nbytes), (f"{fam}_calls", calls),
                           (f"{fam}_ms", 1e3 * seconds_by_name.get(name, 0.0))):
            out[key] = out.get(key, 0.0) + value
    fams = sorted({k.rsplit("_", 1)[0] for k in out})
    per_step = {k: v / steps for k, v in out.items()}
    per_step["total_bytes"] = sum(per_step[f"{f}_bytes"] for f in fams)
    per_step["total_ms"] = sum(per_step[f"{f}_ms"] for f in fams)
    per_step["calls"] = sum(per_step[f"{f}_calls"] for f in fams)
    if wall_s:
        per_step["share"] = per_step["total_ms"] * steps / 1e3 / wall_s
    return per_step


def comms_sections(resolved: dict, log_comms: bool, comm_dtype: str, source: str) -> tuple[dict, list[str]]:
    """The DeepSpeed JSON with dstrain's communication switches applied, and notes for plan.txt.

    ``log_comms`` (``output.comms``): turn DeepSpeed's comms_logger on for every op
    (quietly: dstrain reads it per step). ``comm_dtype`` (``deepspeed.comm_dtype``): the
    dtype gradients are reduced in (DeepSpeed's ``communication_data_type``); a file that
    already names a different one is refused.
    """
    from dstrain.engine.ds_files import DSConfigError
    out, notes = dict(resolved), []
    if comm_dtype not in COMM_DTYPES:
        raise DSConfigError(source, f"deepspeed.comm_dtype must be one of {', '.join(COMM_DTYPES)}, "
                                    f"got {comm_dtype!r}")
    if comm_dtype != "auto":
        have = out.get("communication_data_type")
        if have not in (None, comm_dtype):
            raise DSConfigError(source, f"communication_data_type is {have!r} in the file but the run asks "
                                        f"--deepspeed.comm_dtype={comm_dtype}; make them agree")
        out["communication_data_type"] = comm_dtype
    if out.get("communication_data_type"):
        notes.append(f"gradients are reduced in {out['communication_data_type']} "
                     "(communication_data_type)")
    if log_comms:
        block = dict(out.get("comms_logger") or {})
        block.update(enabled=True, prof_all=True)
        block.setdefault("verbose", False)
        out["comms_logger"] = block
    if (out.get("comms_logger") or {}).get("enabled"):
        notes.append("communication logged per step (comm/* in metrics.jsonl and TensorBoard; each "
                     "collective is synchronised to be timed, which costs some overlap on GPUs)")
    return out, notes


class CommsMeter:
    """Reads DeepSpeed's comms logger once per logged window; ``read()`` gives per-step figures."""

    def __init__(self, start_step: int = 0):
        self._last_step = start_step
        self._start = time.perf_counter()

    @staticmethod
    def _deepspeed_comm():
        """DeepSpeed's comm module when it is loaded and its logger is on, else None (never imports it)."""
        mod = sys.modules.get("deepspeed.comm.comm")
        logger = getattr(mod, "comms_logger", None)
        return mod if logger is not None and logger.enabled else None

    def active(self) -> bool:
        return self._deepspeed_comm() is not None

    def read(self, step: int) -> dict[str, float]:
        """Per-step averages since the previous read (empty when the logger is off or nothing ran)."""
        mod = self._deepspeed_comm()
        now = time.perf_counter()
        steps = step - self._last_step
        if mod is None or steps < 1:
            return {}
        raw = mod.comms_logger.get_raw_data()
        seconds = {}
        timers = getattr(getattr(mod, "timers", None), "timers", {})
        for name, sizes in raw.items():
            timer = timers.get(name)
            if timer is not None:
                seconds[name] = timer.elapsed(reset=True) / 1e3
            else:  # no timer to read: fall back to the logger's own figures (ms)
                seconds[name] = sum(sum(rec[1]) for rec in sizes.values()) / 1e3
        mod.comms_logger.reset_data()
        wall, self._start, self._last_step = now - self._start, now, step
        return summarize(raw, seconds, steps, wall) if raw else {}
