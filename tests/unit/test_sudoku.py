"""dstrain.data.sudoku: solver, generator uniqueness, file reading, augmentation validity, batches."""
import os
from pathlib import Path

import numpy as np
import pytest

from dstrain.data import sudoku as S

ROOT = Path(__file__).resolve().parents[2]
DIABOLICAL = Path(os.environ.get("DSTRAIN_DATA_DIR") or ROOT.parent / "shared" / "data") / "sudoku_diabolical.txt"

# A well-known puzzle with a unique solution (and that solution).
PUZZLE = ("530070000600195000098000060800060003400803001700020006060000280000419005000080079")
SOLUTION = ("534678912672195348198342567859761423426853791713924856961537284287419635345286179")


def grid(text: str) -> np.ndarray:
    return np.array([int(c) for c in text])


def test_solver_finds_the_known_solution_and_counts():
    assert np.array_equal(S.solve(grid(PUZZLE)), grid(SOLUTION))
    assert S.count_solutions(grid(PUZZLE)) == 1
    assert S.count_solutions(np.zeros(81, dtype=int), limit=5) == 5  # the empty grid has many
    clash = grid(PUZZLE).copy()
    clash[1] = 5  # two 5s in the first row
    assert S.solve(clash) is None and S.count_solutions(clash) == 0


def test_is_solution_and_agrees():
    sol = grid(SOLUTION)
    assert S.is_solution(sol) and S.agrees(grid(PUZZLE), sol)
    bad = sol.copy()
    bad[[0, 1]] = bad[[1, 0]]  # swap two cells of a row: columns break
    assert not S.is_solution(bad)
    other = grid(PUZZLE).copy()
    other[2] = 1  # a given the solution does not keep
    assert not S.agrees(other, sol)
    with pytest.raises(ValueError, match="81 cells"):
        S.solve(np.zeros(80, dtype=int))
    with pytest.raises(ValueError, match="0 \\(blank\\) or 1-9"):
        S.solve(np.full(81, 10))


@pytest.mark.parametrize("blanks", [0, 5, 30, 45])
def test_generator_blanks_and_uniqueness(blanks):
    rng = np.random.default_rng(blanks)
    for _ in range(3):
        puzzle, solution = S.generate(blanks, rng)
        assert (puzzle == 0).sum() == blanks
        assert S.agrees(puzzle, solution)
        # Independent check of uniqueness: the solver finds exactly one completion.
        assert S.count_solutions(puzzle, limit=3) == 1


def test_generator_is_seeded_and_rejects_bad_blanks():
    a, b = S.generate_many(4, 10, seed=7), S.generate_many(4, 10, seed=7)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[0], S.generate_many(4, 10, seed=8)[0])
    for bad in (-1, 65, 2.5, True):
        with pytest.raises(ValueError, match="blanks"):
            S.generate(bad, np.random.default_rng(0))


def test_augmentation_keeps_puzzles_valid():
    puzzles, solutions = S.generate_many(20, 40, seed=3)
    rng = np.random.default_rng(0)
    changed = 0
    for p, s in zip(puzzles, solutions):
        for _ in range(5):
            ap, asol = S.augment(p, s, rng)
            assert (ap == 0).sum() == (p == 0).sum()
            assert S.is_solution(asol) and S.agrees(ap, asol)
            found = S.solve(ap)  # the solver, run on the augmented puzzle, finds the augmented solution
            assert np.array_equal(found, asol) and S.count_solutions(ap) == 1
            changed += not np.array_equal(ap, p)
    assert changed > 90


def test_transform_covers_transposition_and_digit_relabelling():
    rng = np.random.default_rng(1)
    transposed = relabelled = 0
    for _ in range(50):
        cells, digits = S.random_transform(rng)
        assert sorted(cells) == list(range(81)) and digits[0] == 0 and sorted(digits[1:]) == list(range(1, 10))
        # cells 0 and 1 share a row; after a transposition they share a column
        transposed += cells[0] // 9 != cells[1] // 9
        relabelled += not np.array_equal(digits, np.arange(10))
    assert 10 < transposed < 40 and relabelled == 50


def test_encoding():
    p, s = grid(PUZZLE), grid(SOLUTION)
    inputs, labels = S.encode(p[None], s[None])
    assert inputs.dtype == np.int64 and inputs.shape == (1, 81)
    assert inputs.min() >= 1 and inputs.max() <= 10 and ((inputs == S.BLANK) == (p == 0)[None]).all()
    assert np.array_equal(labels[0], s + 1)
    _, masked = S.encode(p[None], s[None], mask_givens=True)
    assert (masked[0][p != 0] == S.IGNORE_LABEL).all() and np.array_equal(masked[0][p == 0], s[p == 0] + 1)
    assert np.array_equal(S.decode(inputs[0]), p)
    with pytest.raises(ValueError, match="must both be"):
        S.encode(p[None], s[None, :80])


def test_file_reader(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(f"# comment\nabc {PUZZLE} 7.1\n\n{'..' + SOLUTION[2:]}\n")  # (a repeated puzzle is refused)
    puzzles, solutions = S.read_puzzle_file(f)
    assert puzzles.shape == (2, 81) and np.array_equal(solutions[1], grid(SOLUTION))
    assert len(S.read_puzzle_file(f, skip=1)[0]) == 1
    f.write_text("x 123\n")
    with pytest.raises(ValueError, match=r"p.txt:1: no 81-character"):
        S.read_puzzle_file(f)
    f.write_text("0" * 81 + "\n")
    with pytest.raises(ValueError, match="more than one solution"):
        S.read_puzzle_file(f)
    with pytest.raises(FileNotFoundError):
        S.read_puzzle_file(tmp_path / "missing.txt")
    f.write_text(f"{PUZZLE}\n{PUZZLE.replace('0', '.')}\n")  # the same puzzle written two ways
    with pytest.raises(ValueError, match="p.txt:2: repeats the puzzle of line 1"):
        S.read_puzzle_file(f)


@pytest.mark.skipif(not DIABOLICAL.is_file(), reason=f"shared data not in {DIABOLICAL.parent} (set DSTRAIN_DATA_DIR)")
def test_reads_and_solves_diabolical_puzzles():
    puzzles, solutions = S.read_puzzle_file(DIABOLICAL, limit=20)
    assert puzzles.shape == (20, 81) and (puzzles == 0).sum(1).min() > 40
    assert all(S.agrees(p, s) for p, s in zip(puzzles, solutions))


def test_groups_epochs_and_rank_shards():
    puzzles, solutions = S.generate_many(10, 5, seed=0)
    ds = S.SudokuGroups(puzzles, solutions, augmentations=3, seed=1)
    # One sample per group per epoch.
    epoch = ds.samples(0, 10)
    assert sorted(epoch.groups.tolist()) == list(range(10))
    for i, g in enumerate(epoch.groups):  # each sample is a valid member of its group
        p, s = S.decode(epoch.inputs[i]), epoch.labels[i] - 1
        assert S.agrees(p, s) and (p == 0).sum() == (puzzles[g] == 0).sum()
    # Rank shards of a step are contiguous slices of the global batch; pure function of step.
    whole = ds.samples(3 * 8, 8)
    parts = [ds.local_batch(3, 8, r, 2) for r in range(2)]
    assert np.array_equal(np.concatenate([p.inputs for p in parts]), whole.inputs)
    assert np.array_equal(ds.local_batch(3, 8, 1, 2).labels, parts[1].labels)
    with pytest.raises(ValueError, match="not divisible by 3 ranks"):
        ds.local_batch(0, 8, 0, 3)


# ---------------------------------------------------------------- 4x4 and 6x6 grids

def all_4x4_grids() -> np.ndarray:
    """Every valid 4x4 grid, by brute force over row permutations (independent of the solver)."""
    import itertools
    perms = list(itertools.permutations(range(1, 5)))
    out = []

    def extend(rows):
        if len(rows) == 4:
            out.append(np.array(rows).reshape(16))
            return
        for p in perms:
            g = np.array(rows + [p])
            if any(len(set(g[:, c])) < len(g) for c in range(4)):
                continue
            if len(g) % 2 == 0 and any(len(set(g[-2:, b:b + 2].ravel())) < 4 for b in (0, 2)):
                continue
            extend(rows + [p])

    extend([])
    return np.stack(out)


def test_4x4_grids_solver_and_generator_against_brute_force():
    grids = all_4x4_grids()
    assert len(grids) == 288  # the known number of 4x4 Sudoku grids
    assert all(S.is_solution(g) for g in grids[::17])
    rng = np.random.default_rng(0)
    for blanks in (6, 10, 12):
        for _ in range(10):
            puzzle, solution = S.generate(blanks, rng, size=4)
            assert (puzzle == 0).sum() == blanks and S.agrees(puzzle, solution)
            keep = puzzle != 0
            matches = grids[(grids[:, keep] == puzzle[keep]).all(1)]
            assert len(matches) == 1 and np.array_equal(matches[0], solution)  # unique, by enumeration
    with pytest.raises(ValueError, match=r"within \[0, 12\] for a 4x4 grid"):
        S.generate(13, rng, size=4)
    with pytest.raises(ValueError, match="grid size must be one of"):
        S.generate(5, rng, size=5)


def test_6x6_generator_augmentation_and_encoding():
    puzzles, solutions = S.generate_many(15, 24, seed=5, size=6)
    assert puzzles.shape == (15, 36) and ((puzzles == 0).sum(1) == 24).all()
    rng = np.random.default_rng(1)
    for p, s in zip(puzzles, solutions):
        assert S.is_solution(s) and S.agrees(p, s) and S.count_solutions(p, limit=3) == 1
        ap, asol = S.augment(p, s, rng)
        assert S.agrees(ap, asol) and S.count_solutions(ap, limit=3) == 1 and (ap == 0).sum() == 24
    latin = np.array([[(r + c) % 6 + 1 for c in range(6)] for r in range(6)]).reshape(36)
    assert not S.is_solution(latin)  # rows and columns fine, the 2x3 boxes are not
    fixed = latin.reshape(6, 6)[[0, 3, 1, 4, 2, 5]].reshape(36)  # rows 0,3 / 1,4 / 2,5 form the bands
    assert S.is_solution(fixed)
    for _ in range(20):  # 6x6 boxes are not square: never transposed
        cells, digits = S.random_transform(rng, 6)
        assert sorted(cells) == list(range(36)) and sorted(digits[1:]) == list(range(1, 7))
        assert len({c // 6 for c in cells[:6]}) == 1  # the first row comes from one row
    inputs, labels = S.encode(puzzles, solutions)
    assert inputs.max() <= 7 and labels.min() >= 2 and labels.max() == 7 and S.vocab_size(6) == 8
    with pytest.raises(ValueError, match="16, 36 or 81 cells"):
        S.solve(np.zeros(25, dtype=int))
    with pytest.raises(ValueError, match=r"0 \(blank\) or 1-6"):
        S.solve(np.full(36, 7))


def test_propagation_rounds():
    sol = grid(SOLUTION)
    one = sol.copy()
    one[[0, 40, 80]] = 0  # isolated blanks: each is a naked single
    assert S.propagation_rounds(one) == 1 and S.propagation_rounds(sol) == 0
    assert S.propagation_rounds(np.zeros(16, dtype=int)) == -1  # nothing forced on an empty grid
    g4 = all_4x4_grids()[0].copy()
    chain = g4.copy()
    chain[[0, 1, 4, 5]] = 0  # a whole box blank: every cell still sees a full row and column
    assert S.propagation_rounds(chain) == 1
    puzzles, _ = S.generate_many(30, 45, seed=2)
    rng = np.random.default_rng(0)
    for p in puzzles[:10]:  # the count does not depend on how the grid is drawn
        q, _ = S.augment(p, S.solve(p), rng)
        assert S.propagation_rounds(q) == S.propagation_rounds(p)
    rounds = [S.propagation_rounds(p) for p in puzzles]
    assert max(rounds) >= 3  # 45 blanks: deductions depend on earlier ones
