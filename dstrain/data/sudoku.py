"""Sudoku data for HRM: exact solver, generator, file reader, augmentation, encoding, batches.

Grids are ``numpy`` int arrays of 81 cells in row-major order, 0 = blank, 1-9 = digits.

* :func:`solve` / :func:`count_solutions` - exact depth-first search over bitmask
  candidates, most-constrained cell first (diabolical puzzles take milliseconds).
* :func:`generate` - a random complete grid, then cells blanked in random order
  while the solution stays unique, until the chosen number of blanks is reached.
* :func:`read_puzzle_file` - one puzzle per line (``<id> <81 digits> <rating>`` as in
  the sudoku-exchange bank, or a bare 81-character line with ``0`` or ``.`` for blanks),
  each solved to give its label.
* :func:`augment` - a validity-preserving transform (digit relabelling, transposition,
  band/row/stack/column shuffles) applied identically to a puzzle and its solution.
* :func:`encode` - HRM's tokens: pad 0, blank 1, digit d -> d + 1 (vocabulary 11).
* :class:`SudokuGroups` - the train set as groups (an original and its augmentations),
  one sample per group per epoch; :meth:`SudokuGroups.local_batch` gives rank ``r`` its
  slice of a fixed global batch, a pure function of (seed, step).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAD, BLANK, VOCAB_SIZE, SEQ_LEN = 0, 1, 11, 81
IGNORE_LABEL = -100
"""Label value the loss skips (given cells when ``mask_givens`` is on)."""
MAX_BLANKS = 64
"""81 - 17: no Sudoku with fewer than 17 clues has a unique solution."""

_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_ALL = 0x3FE  # bits 1..9


def _as_grid(grid, name: str = "puzzle") -> np.ndarray:
    arr = np.asarray(grid)
    if arr.size != 81:
        raise ValueError(f"{name} must have 81 cells, got {arr.size}")
    arr = arr.reshape(81).astype(np.int64)
    if arr.min() < 0 or arr.max() > 9:
        raise ValueError(f"{name} cells must be 0 (blank) or 1-9, got values in [{arr.min()}, {arr.max()}]")
    return arr


# ---------------------------------------------------------------- solver

def _search(cells: list, rows: list, cols: list, boxes: list, limit: int, out: list, rng) -> None:
    best, best_mask, best_count = -1, 0, 10
    for i in range(81):
        if cells[i] == 0:
            mask = _ALL & ~(rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]])
            count = mask.bit_count()
            if count < best_count:
                best, best_mask, best_count = i, mask, count
                if count <= 1:
                    break
    if best < 0:
        out.append(list(cells))
        return
    if best_count == 0:
        return
    digits = [d for d in range(1, 10) if best_mask >> d & 1]
    if rng is not None and len(digits) > 1:
        rng.shuffle(digits)
    r, c, b = _ROW[best], _COL[best], _BOX[best]
    for d in digits:
        bit = 1 << d
        cells[best] = d
        rows[r] |= bit
        cols[c] |= bit
        boxes[b] |= bit
        _search(cells, rows, cols, boxes, limit, out, rng)
        rows[r] ^= bit
        cols[c] ^= bit
        boxes[b] ^= bit
        cells[best] = 0
        if len(out) >= limit:
            return


def _solutions(puzzle, limit: int, rng=None) -> list[np.ndarray]:
    cells = [int(v) for v in _as_grid(puzzle)]
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, d in enumerate(cells):
        if d:
            bit = 1 << d
            if (rows[_ROW[i]] | cols[_COL[i]] | boxes[_BOX[i]]) & bit:
                return []  # the givens already clash
            rows[_ROW[i]] |= bit
            cols[_COL[i]] |= bit
            boxes[_BOX[i]] |= bit
    out: list = []
    _search(cells, rows, cols, boxes, limit, out, rng)
    return [np.array(s, dtype=np.int64) for s in out]


def solve(puzzle) -> np.ndarray | None:
    """The first solution found (the solution, for a proper puzzle), or None if there is none."""
    found = _solutions(puzzle, 1)
    return found[0] if found else None


def count_solutions(puzzle, limit: int = 2) -> int:
    """Number of solutions, counting stops at ``limit`` (2 is enough to test uniqueness)."""
    return len(_solutions(puzzle, limit))


def is_solution(grid) -> bool:
    """Whether ``grid`` is a complete, valid Sudoku grid."""
    g = _as_grid(grid, "grid").reshape(9, 9)
    if (g == 0).any():
        return False
    full = np.arange(1, 10)
    boxes = g.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)
    return all((np.sort(part, axis=1) == full).all() for part in (g, g.T, boxes))


def agrees(puzzle, solution) -> bool:
    """Whether ``solution`` is valid and keeps every given of ``puzzle``."""
    p, s = _as_grid(puzzle), _as_grid(solution, "solution")
    return is_solution(s) and bool(((p == 0) | (p == s)).all())


# ---------------------------------------------------------------- generator

def random_solution(rng: np.random.Generator) -> np.ndarray:
    """A uniformly-seeded random complete grid (random digit order in the search)."""
    import random
    local = random.Random(int(rng.integers(2**63)))
    return _solutions(np.zeros(81, dtype=np.int64), 1, rng=local)[0]


def generate(blanks: int, rng: np.random.Generator, max_tries: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """A puzzle with exactly ``blanks`` blank cells and a unique solution -> (puzzle, solution).

    Cells are removed in random order, skipping any whose removal would allow a
    second solution; if a grid runs out of removable cells first, a new grid is tried.
    """
    if isinstance(blanks, bool) or not isinstance(blanks, (int, np.integer)):
        raise ValueError(f"blanks must be an integer, got {blanks!r}")
    if not 0 <= blanks <= MAX_BLANKS:
        raise ValueError(f"blanks must be within [0, {MAX_BLANKS}], got {blanks}")
    for _ in range(max_tries):
        solution = random_solution(rng)
        puzzle = solution.copy()
        removed = 0
        for cell in rng.permutation(81):
            if removed == blanks:
                break
            puzzle[cell] = 0
            # Up to about 20 blanks a second solution is rare; check each removal anyway.
            if count_solutions(puzzle, 2) == 1:
                removed += 1
            else:
                puzzle[cell] = solution[cell]
        if removed == blanks:
            return puzzle, solution
    raise RuntimeError(f"could not reach {blanks} blanks with a unique solution in {max_tries} grids")


def generate_many(n: int, blanks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` generated puzzles and solutions, ``int64[n, 81]`` each, a pure function of the seed."""
    if n < 0:
        raise ValueError(f"n must not be negative, got {n}")
    rng = np.random.default_rng(seed)
    pairs = [generate(blanks, rng) for _ in range(n)]
    empty = np.zeros((0, 81), dtype=np.int64)
    return (np.stack([p for p, _ in pairs]) if pairs else empty,
            np.stack([s for _, s in pairs]) if pairs else empty)


# ---------------------------------------------------------------- files

def parse_puzzle_line(line: str, where: str = "line") -> np.ndarray:
    """One puzzle from ``<id> <81 digits> [rating]`` or a bare 81-character line (``.`` = blank)."""
    fields = line.split()
    grid = next((f for f in fields if len(f) == 81), None)
    if grid is None:
        raise ValueError(f"{where}: no 81-character puzzle field in {line.strip()[:100]!r}")
    grid = grid.replace(".", "0")
    if not grid.isdigit():
        raise ValueError(f"{where}: puzzle field must hold digits 0-9 or '.', got {grid!r}")
    return np.frombuffer(grid.encode(), dtype=np.uint8).astype(np.int64) - ord("0")


def read_puzzle_file(path: str | Path, limit: int | None = None, skip: int = 0,
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Read and solve puzzles from ``path`` -> ``(puzzles, solutions)``, ``int64[n, 81]``.

    Blank lines and lines starting with ``#`` are skipped; ``skip`` puzzles are passed
    over, then at most ``limit`` read. A puzzle without a solution, or with more than
    one, raises ``ValueError`` naming the line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such puzzle file")
    puzzles, solutions, seen = [], [], 0
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            seen += 1
            if seen <= skip:
                continue
            if limit is not None and len(puzzles) >= limit:
                break
            where = f"{path}:{lineno}"
            puzzle = parse_puzzle_line(line, where)
            found = _solutions(puzzle, 2)
            if len(found) != 1:
                raise ValueError(f"{where}: puzzle has {'no' if not found else 'more than one'} solution")
            puzzles.append(puzzle)
            solutions.append(found[0])
    if not puzzles:
        raise ValueError(f"{path}: no puzzles read (skip={skip}, limit={limit})")
    return np.stack(puzzles), np.stack(solutions)


# ---------------------------------------------------------------- augmentation

def random_transform(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random validity-preserving transform -> (cell map ``int[81]``, digit map ``int[10]``).

    ``new[i] = digit_map[old[cell_map[i]]]``; ``digit_map[0] == 0`` keeps blanks blank.
    """
    bands = rng.permutation(3)
    rows = np.concatenate([b * 3 + rng.permutation(3) for b in bands])
    stacks = rng.permutation(3)
    cols = np.concatenate([s * 3 + rng.permutation(3) for s in stacks])
    cell_map = (rows[:, None] * 9 + cols[None, :])
    if rng.random() < 0.5:
        cell_map = cell_map.T
    digit_map = np.concatenate([[0], rng.permutation(9) + 1])
    return cell_map.reshape(81), digit_map


def apply_transform(grid: np.ndarray, cell_map: np.ndarray, digit_map: np.ndarray) -> np.ndarray:
    """Apply a transform from :func:`random_transform` to one grid or a batch ``[..., 81]``."""
    return digit_map[np.asarray(grid)[..., cell_map]]


def augment(puzzle, solution, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same random transform applied to a puzzle and its solution."""
    cell_map, digit_map = random_transform(rng)
    return (apply_transform(_as_grid(puzzle), cell_map, digit_map),
            apply_transform(_as_grid(solution, "solution"), cell_map, digit_map))


# ---------------------------------------------------------------- encoding

def encode(puzzles: np.ndarray, solutions: np.ndarray, mask_givens: bool = False
           ) -> tuple[np.ndarray, np.ndarray]:
    """HRM tokens -> ``(inputs, labels)``, ``int64[n, 81]``: blank 1, digit d -> d + 1.

    With ``mask_givens`` the label of every given cell is :data:`IGNORE_LABEL`, so the
    loss sees only the blanks.
    """
    puzzles, solutions = np.asarray(puzzles), np.asarray(solutions)
    if puzzles.shape != solutions.shape or puzzles.shape[-1] != 81:
        raise ValueError(f"puzzles {puzzles.shape} and solutions {solutions.shape} must both be [n, 81]")
    inputs = puzzles.astype(np.int64) + 1
    labels = solutions.astype(np.int64) + 1
    if (solutions == 0).any():
        raise ValueError("solutions must be complete (no 0 cells)")
    if mask_givens:
        labels = np.where(puzzles == 0, labels, IGNORE_LABEL)
    return inputs, labels


def decode(tokens: np.ndarray) -> np.ndarray:
    """Inverse of the input encoding: tokens -> digits (blank and pad -> 0)."""
    return np.clip(np.asarray(tokens) - 1, 0, 9)


# ---------------------------------------------------------------- grouped dataset

_EPOCH_STRIDE = 1_000_003


@dataclass
class Batch:
    """One rank's samples: ``inputs``/``labels`` ``int64[b, 81]``, ``groups`` ``int64[b]``."""

    inputs: np.ndarray
    labels: np.ndarray
    groups: np.ndarray


class SudokuGroups:
    """Training groups: original ``g`` plus ``augmentations`` transformed copies of it.

    Member 0 of a group is the original; member ``k >= 1`` is the original under the
    transform drawn from ``(seed, g, k)``. Each epoch visits every group once (in a
    seeded order) and takes one member drawn at random, so an epoch is ``len(self)``
    samples. Global sample ``i`` counts across steps; step ``s`` of a global batch
    ``B`` holds samples ``s*B .. s*B+B-1``, so the data order needs no saved state.
    """

    def __init__(self, puzzles: np.ndarray, solutions: np.ndarray, augmentations: int = 0,
                 seed: int = 0, mask_givens: bool = False):
        if len(puzzles) == 0:
            raise ValueError("SudokuGroups needs at least one puzzle")
        if augmentations < 0:
            raise ValueError(f"augmentations must not be negative, got {augmentations}")
        self.puzzles, self.solutions = np.asarray(puzzles), np.asarray(solutions)
        encode(self.puzzles[:1], self.solutions[:1])  # shape check
        self.augmentations, self.seed, self.mask_givens = augmentations, seed, mask_givens
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.puzzles)

    def member(self, group: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(puzzle, solution) of member ``k`` of ``group`` (0: the original)."""
        p, s = self.puzzles[group], self.solutions[group]
        if k == 0:
            return p, s
        return augment(p, s, np.random.default_rng([self.seed, group, k]))

    def _epoch(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng(self.seed * _EPOCH_STRIDE + epoch)
            self._perm = (epoch, rng.permutation(len(self)))
        return self._perm[1]

    def samples(self, start: int, count: int) -> Batch:
        """Global samples ``start .. start+count-1``, encoded."""
        puzzles, solutions, groups = [], [], []
        for i in range(start, start + count):
            epoch, pos = divmod(i, len(self))
            group = int(self._epoch(epoch)[pos])
            k = 0
            if self.augmentations:
                k = int(np.random.default_rng([self.seed, epoch, group]).integers(self.augmentations + 1))
            p, s = self.member(group, k)
            puzzles.append(p)
            solutions.append(s)
            groups.append(group)
        inputs, labels = encode(np.stack(puzzles), np.stack(solutions), self.mask_givens)
        return Batch(inputs, labels, np.array(groups, dtype=np.int64))

    def local_batch(self, step: int, global_batch: int, rank: int, world_size: int) -> Batch:
        """Rank ``rank``'s contiguous share of the global batch of step ``step``."""
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
        local = global_batch // world_size
        return self.samples(step * global_batch + rank * local, local)
