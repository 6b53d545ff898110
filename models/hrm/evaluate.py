"""Segment-by-segment evaluation of a trained HRM: accuracy after each segment, adaptive halting.

The trainer's evaluation (``dstrain.trainers.hrm.evaluate_rows``) runs every puzzle for
``halt_max_steps`` segments, as the reference does. Here every puzzle's prediction and
Q-head decision are kept after each segment, so one pass gives:

* exact accuracy after 1 segment (one pass, no iteration) and after ``halt_max_steps``;
* adaptive halting as at training time without exploration: a puzzle stops at the first
  segment where the Q-head says halt (``q_halt > q_continue``, or ``q_halt > 0`` under
  ``halt_rule = "solved"``; or at the last), and is scored there;
* all of it by difficulty: number of blanks and :func:`dstrain.data.sudoku.propagation_rounds`.
"""
from __future__ import annotations

import numpy as np
import torch

from dstrain.data import sudoku

BLANK = sudoku.BLANK


@torch.no_grad()
def run_segments(model, inputs: np.ndarray, labels: np.ndarray, max_steps: int, batch: int = 256,
                 puzzle_emb: torch.Tensor | None = None, device="cpu") -> tuple[np.ndarray, np.ndarray]:
    """``(correct, halt)``, both ``bool[n, max_steps]``: all blanks right after segment ``t``, and
    whether the Q-head says halt after it (``HRM.wants_halt``: the model's ``halt_rule``)."""
    model.eval()
    correct, halt = [], []
    for lo in range(0, len(inputs), batch):
        x = torch.from_numpy(inputs[lo:lo + batch]).to(device)
        y = torch.from_numpy(labels[lo:lo + batch]).to(device)
        emb = None if puzzle_emb is None else puzzle_emb.to(device).expand(len(x), -1)
        z_H = z_L = steps = None
        rows_c, rows_h = [], []
        for _ in range(max_steps):
            _, out = model(x, y, emb, z_H, z_L, steps, None)
            z_H, z_L, steps = out["z_H"], out["z_L"], out["steps"]
            rows_c.append(((out["preds"] == y) | (x != BLANK)).all(-1))
            rows_h.append(out["wants_halt"])
        correct.append(torch.stack(rows_c, 1).cpu())
        halt.append(torch.stack(rows_h, 1).cpu())
    return torch.cat(correct).numpy(), torch.cat(halt).numpy()


def adaptive(correct: np.ndarray, halt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per puzzle: segments used (first ``halt`` or the last) and whether it is right there."""
    if correct.shape != halt.shape or correct.ndim != 2:
        raise ValueError(f"correct {correct.shape} and halt {halt.shape} must be the same [n, steps]")
    h = halt.copy()
    h[:, -1] = True
    stop = h.argmax(1)
    return stop + 1, correct[np.arange(len(stop)), stop]


def summarise(correct: np.ndarray, halt: np.ndarray, groups: np.ndarray | None = None) -> dict:
    """Exact accuracy after 1 and after all segments, adaptive accuracy and steps; by group if given."""
    steps, right = adaptive(correct, halt)

    def one(mask) -> dict:
        return {"puzzles": int(mask.sum()),
                "exact_1_segment": float(correct[mask, 0].mean()),
                "exact_max_segments": float(correct[mask, -1].mean()),
                "exact_adaptive": float(right[mask].mean()),
                "mean_act_steps": float(steps[mask].mean()),
                "exact_by_segment": [round(float(v), 4) for v in correct[mask].mean(0)]}

    out = {"all": one(np.ones(len(correct), dtype=bool))}
    if groups is not None:
        out["by_group"] = {int(g): one(groups == g) for g in np.unique(groups)}
    return out
