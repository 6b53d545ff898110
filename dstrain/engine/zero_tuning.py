"""ZeRO bucket sizes and thresholds for the keys a profile leaves as "auto".

Hugging Face's convention (reduce and all-gather buckets of ``hidden**2`` elements,
stage-3 prefetch ``0.9 * hidden**2``, persistence ``10 * hidden``) makes buckets small:
1.6M elements for a 1280-wide model, so a 710M-parameter model is reduced in ~440
pieces, each a collective launch (and on CPU a gloo round trip) with its own
synchronisation. Measured (benchmarks/results, see benchmarks/README.md): on the 2-core
CPU the tiny GPT's ZeRO-1/2 steps were 1.10x / 1.18x the plain loop with those sizes.

Here a bucket holds ``min(P, 5e7)`` elements but never fewer than ``hidden**2``: a
model small enough is reduced in one piece, a large one in pieces of 5e7 elements
(100 MB in bf16: DeepSpeed's stage-3 prefetch default, a tenth of its reduce-bucket
default, and two such buffers are what ``overlap_comm`` holds). Stage-3 parameters
below ``max(10 * hidden, 1e5)`` elements (DeepSpeed's own default threshold) stay whole
on every rank: gathering norms and biases one by one costs more than keeping them.

Only keys the profile sets to "auto" are filled, before ds_config's own filling (which
then has nothing left to do for them); a number in the file is kept.
"""
from __future__ import annotations

BUCKET_CAP = 50_000_000
PERSISTENCE_FLOOR = 100_000

_BUCKETS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size")
_PERSIST = ("stage3_param_persistence_threshold", "param_persistence_threshold")


def zero_sizes(params: int, hidden: int) -> dict[str, int]:
    """The values used for "auto" bucket and threshold keys of ``zero_optimization``."""
    bucket = max(hidden * hidden, min(params, BUCKET_CAP))
    persist = max(10 * hidden, PERSISTENCE_FLOOR)
    return {**{k: int(bucket) for k in _BUCKETS}, **{k: int(persist) for k in _PERSIST}}


def fill_zero_sizes(template: dict, params: int, hidden: int) -> dict:
    """A copy of the DeepSpeed JSON ``template`` with its "auto" ZeRO sizes set (see module doc)."""
    zo = template.get("zero_optimization")
    if not isinstance(zo, dict):
        return template
    sizes = zero_sizes(params, hidden)
    filled = {k: (sizes[k] if k in sizes and isinstance(v, str) and v.strip().lower() == "auto" else v)
              for k, v in zo.items()}
    return {**template, "zero_optimization": filled}
