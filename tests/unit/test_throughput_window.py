"""The LM trainer's logged tokens/s leaves evaluation and checkpoint saves out of its window.

Before: the window after an evaluation or a save counted that time as training time, so tokens/s dipped
(tiny.json, 1 CPU rank, log every step, evaluation every 3: ~2,000 tokens/s at the step after each
evaluation against ~19,000 at the others)."""
from __future__ import annotations

import time

from dstrain.metrics import Throughput


def test_excluded_seconds_are_not_in_the_rate():
    meter = Throughput(flops_per_token=6.0)
    meter.add(1000)
    time.sleep(0.05)
    meter.exclude(10.0)  # more than the window: the rate would be ~100 tokens/s if counted
    rates = meter.read()
    assert rates["tokens_per_s"] > 1000 / 0.5 and rates["flops_per_s"] == rates["tokens_per_s"] * 6.0
    meter.add(1000)
    time.sleep(0.05)
    assert meter.read()["tokens_per_s"] < 1000 / 0.04  # the next window starts afresh

