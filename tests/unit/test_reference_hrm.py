"""HRM's stablemax cross-entropy against its definition (the HRM reference's ``s(x) = x + 1`` for
x >= 0, ``1 / (1 - x)`` below, normalised), in float64, ignored labels contributing 0."""
from __future__ import annotations

import math

import torch

from models.hrm.model import IGNORE_LABEL, token_cross_entropy


def test_stablemax_cross_entropy_equals_the_definition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 6, generator=g) * 4
    labels = torch.randint(0, 6, (2, 4), generator=g)
    labels[1, 2] = IGNORE_LABEL
    got = token_cross_entropy(logits, labels, "stablemax")
    for b in range(2):
        for t in range(4):
            if labels[b, t] == IGNORE_LABEL:
                assert got[b, t] == 0
                continue
            s = [x + 1 if x >= 0 else 1 / (1 - x) for x in logits[b, t].double().tolist()]
            expect = -math.log(s[labels[b, t]] / sum(s))
            assert abs(got[b, t].item() - expect) < 1e-6
