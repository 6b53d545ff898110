"""The ``task`` section of an HRM run config (light: no torch import, so configs validate fast)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HRMTaskConfig:
    """Sudoku data, batching and puzzle-embedding optimizer of the HRM trainer.

    The data order and the generated puzzles follow ``data.seed``; ``train.*`` sets the
    dense optimizer (AdamW in the DeepSpeed engine) and its schedule, which the
    puzzle-embedding learning rate follows too.
    """

    source: str = "generate"
    """generate (puzzles made by the generator) | file (puzzles read from ``train_file``)."""
    train_file: str = ""
    """Puzzle file for ``source=file`` (one 81-digit puzzle per line), relative to the working dir."""
    eval_file: str = ""
    """Held-out puzzles; empty: the first ``eval_puzzles`` of ``train_file`` (generate: a second seed)."""
    train_puzzles: int = 1000
    """Training groups (original puzzles)."""
    eval_puzzles: int = 200
    """Held-out puzzles evaluated every ``train.eval_every`` steps and at the end."""
    grid: int = 9
    """Side of the Sudoku grid: 4, 6 or 9 (files hold 9x9 puzzles); the model needs
    ``seq_len = grid**2`` and ``vocab_size = grid + 2``."""
    blanks: int = 8
    """Blank cells of each generated puzzle (generate only)."""
    augmentations: int = 0
    """Transformed copies per group; an epoch takes one member (original or copy) of each group."""
    mask_givens: bool = False
    """Ignore the labels of given cells (the loss then sees only the blanks)."""
    global_batch: int = 0
    """Puzzles per step over all ranks (0: ``train.micro_batch`` x ranks); must divide by the ranks."""
    puzzle_ids: str = "shared"
    """shared (one identifier for every puzzle, as the paper's Sudoku data) | group (one per group;
    held-out puzzles use the shared identifier 0)."""
    puzzle_emb_lr: float = 1e-2
    """Peak learning rate of the sparse sign-SGD on the puzzle-embedding table."""
    puzzle_emb_weight_decay: float = 0.1
    ema: float = 0.0
    """Decay of an exponential moving average of the dense weights (0: off; the TRM paper uses
    0.999). When on, evaluation and checkpoint reports use the average
    (:class:`dstrain.optim.ema.EMA`), and ``val_raw/`` metrics score the trained weights beside it."""
    data_workers: int = -1
    """Worker processes that build the next batches while the device steps (``dstrain.data.prefetch``):
    0 builds them in the trainer, between steps; 1 in one worker; -1 (auto): 1 on GPUs, 0 on CPUs
    (where a worker would take a core from the kernels). The batches are the same either way."""
    time_limit_s: float = 0.0
    """Stop (checkpoint, evaluate, leave) at the first log step after this many seconds of
    training (0: no limit); with ``train.min_lr_ratio = 1`` the schedule does not depend on it."""

    def __post_init__(self) -> None:
        if self.source not in ("generate", "file"):
            raise ValueError(f"task.source must be generate or file, got {self.source!r}")
        if self.source == "file" and not self.train_file:
            raise ValueError("task.train_file must name a puzzle file when task.source is file")
        if self.puzzle_ids not in ("shared", "group"):
            raise ValueError(f"task.puzzle_ids must be shared or group, got {self.puzzle_ids!r}")
        for name in ("train_puzzles", "eval_puzzles"):
            if getattr(self, name) < 1:
                raise ValueError(f"task.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("augmentations", "global_batch", "puzzle_emb_lr", "puzzle_emb_weight_decay",
                     "time_limit_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"task.{name} must not be negative, got {getattr(self, name)}")
        if isinstance(self.data_workers, bool) or self.data_workers not in (-1, 0, 1):
            raise ValueError(f"task.data_workers must be -1 (auto), 0 or 1, got {self.data_workers!r}")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"task.ema must be within [0, 1) (0: off), got {self.ema}")
        clues = {4: 4, 6: 8, 9: 17}  # fewest clues of a uniquely solvable grid
        if isinstance(self.grid, bool) or self.grid not in clues:
            raise ValueError(f"task.grid must be 4, 6 or 9, got {self.grid!r}")
        if self.source == "file" and self.grid != 9:
            raise ValueError("task.grid must be 9 when task.source is file (puzzle files hold 9x9 grids)")
        most = self.grid ** 2 - clues[self.grid]
        if not 0 <= self.blanks <= most:
            raise ValueError(f"task.blanks must be within [0, {most}] (a unique {self.grid}x{self.grid} Sudoku "
                             f"needs {clues[self.grid]} clues), got {self.blanks}")
