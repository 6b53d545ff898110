"""Sudoku data for HRM: exact solver, generator, file reader, augmentation, encoding, batches.

Grids are ``numpy`` int arrays of ``n*n`` cells in row-major order, 0 = blank, 1-n =
digits, for ``n`` in :data:`GRID_SIZES`: 4 (2x2 boxes), 6 (boxes of 2 rows x 3 columns)
and 9 (3x3 boxes). The size of a grid is read from its number of cells.

* :func:`solve` / :func:`count_solutions` - exact depth-first search over bitmask
  candidates, most-constrained cell first (diabolical puzzles take milliseconds).
* :func:`generate` - a random complete grid, then cells blanked in random order
  while the solution stays unique, until the chosen number of blanks is reached.
* :func:`read_puzzle_file` - one puzzle per line (``<id> <81 digits> <rating>`` as in
  the sudoku-exchange bank, or a bare 81-character line with ``0`` or ``.`` for blanks),
  each solved to give its label.
* :func:`augment` - a validity-preserving transform (digit relabelling, transposition
  where boxes are square, band/row/stack/column shuffles) applied identically to a
  puzzle and its solution.
* :func:`encode` - HRM's tokens: pad 0, blank 1, digit d -> d + 1 (vocabulary n + 2).
* :class:`SudokuGroups` - the train set as groups (an original and its augmentations),
  one sample per group per epoch; :meth:`SudokuGroups.local_batch` gives rank ``r`` its
  slice of a fixed global batch, a pure function of (seed, step).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

PAD, BLANK, VOCAB_SIZE, SEQ_LEN = 0, 1, 11, 81
"""Tokens, and the vocabulary and length of a 9x9 grid (see :func:`vocab_size`)."""
IGNORE_LABEL = -100
"""Label value the loss skips (given cells when ``mask_givens`` is on)."""
MAX_BLANKS = 64
"""81 - 17: no 9x9 Sudoku with fewer than 17 clues has a unique solution."""
GRID_SIZES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}
"""Side n -> (rows, columns) of one box."""
MIN_CLUES = {4: 4, 6: 8, 9: 17}
"""Fewest clues a puzzle with a unique solution can have (known results)."""


def max_blanks(size: int) -> int:
    """Most blanks a uniquely solvable ``size x size`` puzzle can have."""
    return size * size - MIN_CLUES[_check_size(size)]


def vocab_size(size: int) -> int:
    """Tokens of a ``size x size`` grid: pad, blank and the digits."""
    return _check_size(size) + 2


def _check_size(size) -> int:
    if isinstance(size, bool) or size not in GRID_SIZES:
        raise ValueError(f"grid size must be one of {sorted(GRID_SIZES)}, got {size!r}")
    return int(size)


def grid_size(cells: int) -> int:
    """Side of a grid of ``cells`` cells (16 -> 4, 36 -> 6, 81 -> 9)."""
    for n in GRID_SIZES:
        if n * n == cells:
            return n
    raise ValueError(f"a grid must have 16, 36 or 81 cells (a 4x4, 6x6 or 9x9 grid), got {cells}")


def _as_grid(grid, name: str = "puzzle", size: int | None = None) -> np.ndarray:
    arr = np.asarray(grid)
    if size is None:
        try:
            size = grid_size(arr.size)
        except ValueError:
            raise ValueError(f"{name} must have 16, 36 or 81 cells (a 4x4, 6x6 or 9x9 grid), got {arr.size}") from None
    elif arr.size != size * size:
        raise ValueError(f"{name} must have {size * size} cells, got {arr.size}")
    arr = arr.reshape(size * size).astype(np.int64)
    if arr.min() < 0 or arr.max() > size:
        raise ValueError(f"{name} cells must be 0 (blank) or 1-{size}, got values in [{arr.min()}, {arr.max()}]")
    return arr


@lru_cache(maxsize=None)
def _geometry(size: int) -> tuple[list, list, list, int]:
    """(row of each cell, column, box, bitmask of digits 1..size)."""
    br, bc = GRID_SIZES[size]
    cells = range(size * size)
    rows = [i // size for i in cells]
    cols = [i % size for i in cells]
    boxes = [(r // br) * (size // bc) + c // bc for r, c in zip(rows, cols)]
    return rows, cols, boxes, ((1 << (size + 1)) - 1) & ~1


# ---------------------------------------------------------------- solver

def _search(cells: list, rows: list, cols: list, boxes: list, limit: int, out: list, rng, geo) -> None:
    g_row, g_col, g_box, full = geo
    best, best_mask, best_count = -1, 0, 99
    for i in range(len(cells)):
        if cells[i] == 0:
            mask = full & ~(rows[g_row[i]] | cols[g_col[i]] | boxes[g_box[i]])
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
    digits = [d for d in range(1, full.bit_length()) if best_mask >> d & 1]
    if rng is not None and len(digits) > 1:
        rng.shuffle(digits)
    r, c, b = g_row[best], g_col[best], g_box[best]
    for d in digits:
        bit = 1 << d
        cells[best] = d
        rows[r] |= bit
        cols[c] |= bit
        boxes[b] |= bit
        _search(cells, rows, cols, boxes, limit, out, rng, geo)
        rows[r] ^= bit
        cols[c] ^= bit
        boxes[b] ^= bit
        cells[best] = 0
        if len(out) >= limit:
            return


def _solutions(puzzle, limit: int, rng=None) -> list[np.ndarray]:
    grid = _as_grid(puzzle)
    size = grid_size(grid.size)
    geo = _geometry(size)
    g_row, g_col, g_box, _ = geo
    cells = [int(v) for v in grid]
    rows, cols, boxes = [0] * size, [0] * size, [0] * size
    for i, d in enumerate(cells):
        if d:
            bit = 1 << d
            if (rows[g_row[i]] | cols[g_col[i]] | boxes[g_box[i]]) & bit:
                return []  # the givens already clash
            rows[g_row[i]] |= bit
            cols[g_col[i]] |= bit
            boxes[g_box[i]] |= bit
    out: list = []
    _search(cells, rows, cols, boxes, limit, out, rng, geo)
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
    flat = _as_grid(grid, "grid")
    n = grid_size(flat.size)
    br, bc = GRID_SIZES[n]
    g = flat.reshape(n, n)
    if (g == 0).any():
        return False
    full = np.arange(1, n + 1)
    boxes = g.reshape(n // br, br, n // bc, bc).transpose(0, 2, 1, 3).reshape(n, n)
    return all((np.sort(part, axis=1) == full).all() for part in (g, g.T, boxes))


def agrees(puzzle, solution) -> bool:
    """Whether ``solution`` is valid and keeps every given of ``puzzle``."""
    p, s = _as_grid(puzzle), _as_grid(solution, "solution")
    return p.size == s.size and is_solution(s) and bool(((p == 0) | (p == s)).all())


def _candidates(grid: np.ndarray, size: int) -> np.ndarray:
    """``bool[cells, size + 1]``: digits each cell may hold given the filled cells (column 0 unused)."""
    g_row, g_col, g_box, _ = _geometry(size)
    rows, cols, boxes = (np.zeros((size, size + 1), dtype=bool) for _ in range(3))
    filled = np.flatnonzero(grid)
    for table, idx in ((rows, g_row), (cols, g_col), (boxes, g_box)):
        table[np.asarray(idx)[filled], grid[filled]] = True
    cand = ~(rows[g_row] | cols[g_col] | boxes[g_box])
    cand[:, 0] = False
    cand[grid != 0] = False
    return cand


def propagation_rounds(puzzle) -> int:
    """Rounds of simultaneous single-candidate steps that solve ``puzzle``; -1 if they stall.

    Each round fills, from the same grid, every blank with one candidate left (naked
    single) and every digit with one place left in a row, column or box (hidden single).
    The count measures how many dependent deductions a solver must chain: a puzzle of
    ``k`` rounds cannot be solved by filling cells independently in fewer than ``k`` passes.
    """
    grid = _as_grid(puzzle).copy()
    size = grid_size(grid.size)
    units = [np.flatnonzero(np.asarray(idx) == u) for idx in _geometry(size)[:3] for u in range(size)]
    rounds = 0
    while (grid == 0).any():
        cand = _candidates(grid, size)
        fill = np.zeros_like(grid)
        naked = (grid == 0) & (cand.sum(1) == 1)
        fill[naked] = cand[naked].argmax(1)
        for unit in units:
            places = cand[unit]  # [cells of the unit, digits]
            for d in np.flatnonzero(places.sum(0) == 1):
                fill[unit[places[:, d].argmax()]] = d
        if not fill.any():
            return -1
        grid = np.where(grid == 0, fill, grid)
        rounds += 1
    return rounds


# ---------------------------------------------------------------- generator

def random_solution(rng: np.random.Generator, size: int = 9) -> np.ndarray:
    """A uniformly-seeded random complete ``size x size`` grid (random digit order in the search)."""
    import random
    local = random.Random(int(rng.integers(2**63)))
    return _solutions(np.zeros(_check_size(size) ** 2, dtype=np.int64), 1, rng=local)[0]


def generate(blanks: int, rng: np.random.Generator, max_tries: int = 50, size: int = 9
             ) -> tuple[np.ndarray, np.ndarray]:
    """A puzzle with exactly ``blanks`` blank cells and a unique solution -> (puzzle, solution).

    Cells are removed in random order, skipping any whose removal would allow a
    second solution; if a grid runs out of removable cells first, a new grid is tried.
    """
    size = _check_size(size)
    if isinstance(blanks, bool) or not isinstance(blanks, (int, np.integer)):
        raise ValueError(f"blanks must be an integer, got {blanks!r}")
    if not 0 <= blanks <= max_blanks(size):
        raise ValueError(f"blanks must be within [0, {max_blanks(size)}] for a {size}x{size} grid, got {blanks}")
    for _ in range(max_tries):
        solution = random_solution(rng, size)
        puzzle = solution.copy()
        removed = 0
        for cell in rng.permutation(size * size):
            if removed == blanks:
                break
            puzzle[cell] = 0
            # Up to about 20 blanks (9x9) a second solution is rare; check each removal anyway.
            if count_solutions(puzzle, 2) == 1:
                removed += 1
            else:
                puzzle[cell] = solution[cell]
        if removed == blanks:
            return puzzle, solution
    raise RuntimeError(f"could not reach {blanks} blanks with a unique solution in {max_tries} grids")


def generate_many(n: int, blanks: int, seed: int, size: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """``n`` generated puzzles and solutions, ``int64[n, size*size]`` each, a pure function of the seed."""
    if n < 0:
        raise ValueError(f"n must not be negative, got {n}")
    rng = np.random.default_rng(seed)
    pairs = [generate(blanks, rng, size=size) for _ in range(n)]
    empty = np.zeros((0, size * size), dtype=np.int64)
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
    path = Path(path).expanduser()  # "--task.train_file=~/data/x.txt": the shell leaves "~" after "="
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a puzzle file; name the file itself")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such puzzle file")
    puzzles, solutions, seen = [], [], 0
    first_line: dict[bytes, int] = {}  # each puzzle's first line (those skipped too: the held-out ones)
    for lineno, line in _text_lines(path):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        seen += 1
        if limit is not None and seen > skip and len(puzzles) >= limit:
            break
        where = f"{path}:{lineno}"
        puzzle = parse_puzzle_line(line, where)
        if (before := first_line.setdefault(puzzle.tobytes(), lineno)) != lineno:
            raise ValueError(f"{where}: repeats the puzzle of line {before}; a puzzle file holds each puzzle once "
                             "(a repeat is trained on twice, or held out and trained on): remove the repeats")
        if seen <= skip:
            continue
        found = _solutions(puzzle, 2)
        if len(found) != 1:
            raise ValueError(f"{where}: puzzle has {'no' if not found else 'more than one'} solution")
        puzzles.append(puzzle)
        solutions.append(found[0])
    if not puzzles:
        raise ValueError(f"{path}: no puzzles read (skip={skip}, limit={limit})")
    return np.stack(puzzles), np.stack(solutions)


def _text_lines(path: Path):
    """(line number, line) of a UTF-8 text file; a ValueError naming the file and byte where it is not text."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:  # (a UTF-8 byte-order mark, as Windows editors write, is not part of line 1's puzzle)
                yield lineno, raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}); a puzzle file holds one puzzle per line, in digits") from None


# ---------------------------------------------------------------- augmentation

def random_transform(rng: np.random.Generator, size: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """A random validity-preserving transform -> (cell map ``int[n*n]``, digit map ``int[n+1]``).

    ``new[i] = digit_map[old[cell_map[i]]]``; ``digit_map[0] == 0`` keeps blanks blank.
    Bands (rows of boxes) and the rows inside each band are shuffled, likewise stacks
    and columns; the grid is transposed half the time where boxes are square (a 6x6
    grid's 2x3 boxes would become 3x2).
    """
    br, bc = GRID_SIZES[_check_size(size)]
    bands = rng.permutation(size // br)
    rows = np.concatenate([b * br + rng.permutation(br) for b in bands])
    stacks = rng.permutation(size // bc)
    cols = np.concatenate([s * bc + rng.permutation(bc) for s in stacks])
    cell_map = (rows[:, None] * size + cols[None, :])
    if br == bc and rng.random() < 0.5:
        cell_map = cell_map.T
    digit_map = np.concatenate([[0], rng.permutation(size) + 1])
    return cell_map.reshape(size * size), digit_map


def apply_transform(grid: np.ndarray, cell_map: np.ndarray, digit_map: np.ndarray) -> np.ndarray:
    """Apply a transform from :func:`random_transform` to one grid or a batch ``[..., n*n]``."""
    return digit_map[np.asarray(grid)[..., cell_map]]


def augment(puzzle, solution, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same random transform applied to a puzzle and its solution."""
    p, s = _as_grid(puzzle), _as_grid(solution, "solution")
    if p.size != s.size:
        raise ValueError(f"puzzle ({p.size} cells) and solution ({s.size} cells) differ in size")
    cell_map, digit_map = random_transform(rng, grid_size(p.size))
    return apply_transform(p, cell_map, digit_map), apply_transform(s, cell_map, digit_map)


# ---------------------------------------------------------------- encoding

def encode(puzzles: np.ndarray, solutions: np.ndarray, mask_givens: bool = False
           ) -> tuple[np.ndarray, np.ndarray]:
    """HRM tokens -> ``(inputs, labels)``, ``int64[n, cells]``: blank 1, digit d -> d + 1.

    With ``mask_givens`` the label of every given cell is :data:`IGNORE_LABEL`, so the
    loss sees only the blanks.
    """
    puzzles, solutions = np.asarray(puzzles), np.asarray(solutions)
    if puzzles.shape != solutions.shape or puzzles.ndim != 2:
        raise ValueError(f"puzzles {puzzles.shape} and solutions {solutions.shape} must both be [n, cells]")
    grid_size(puzzles.shape[-1])
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
    """One rank's samples: ``inputs``/``labels`` ``int64[b, cells]``, ``groups`` ``int64[b]``."""

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
