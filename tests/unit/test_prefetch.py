"""dstrain.data.prefetch: batches built ahead in a worker process are the trainer's own batches."""
import functools
import os
import pickle
import signal

import numpy as np
import pytest

from dstrain.data import sudoku
from dstrain.data.prefetch import StepPrefetcher


def _groups():
    puzzles, solutions = sudoku.generate_many(12, 30, seed=3)
    return sudoku.SudokuGroups(puzzles, solutions, augmentations=5, seed=3, mask_givens=True)


def _same(a, b):
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("inputs", "labels", "groups"))


def _print_and_return(step):
    print(f"building {step}")
    return step


def _fail_at_three(step):
    if step == 3:
        raise ValueError("no batch 3")
    return step * 10


def test_batches_equal_the_inline_ones_in_order_and_after_a_jump():
    data = _groups()
    make = functools.partial(data.local_batch, global_batch=8, rank=1, world_size=2)
    with StepPrefetcher(make, depth=3) as ahead:
        for step in [0, 1, 2, 3, 9, 10, 11, 4]:  # 9: a jump (resume), 4: back (nothing pending for it)
            assert _same(ahead.get(step), data.local_batch(step, 8, 1, 2)), step
        assert ahead._wanted == {5, 6, 7} and ahead.alive


def test_an_error_of_the_batch_function_is_raised_by_get():
    with StepPrefetcher(_fail_at_three, depth=4) as ahead:
        assert [ahead.get(s) for s in range(3)] == [0, 10, 20]
        with pytest.raises(ValueError, match="no batch 3"):
            ahead.get(3)
        assert ahead.get(4) == 40


def test_a_killed_worker_is_reported_and_the_trainer_builds_the_batches(capfd):
    data = _groups()
    make = functools.partial(data.local_batch, global_batch=4, rank=0, world_size=1)
    ahead = StepPrefetcher(make, depth=2)
    assert _same(ahead.get(0), make(0)) and _same(ahead.get(1), make(1))  # the worker answered step 1
    os.kill(ahead._proc.pid, signal.SIGKILL)
    for step in range(2, 6):
        assert _same(ahead.get(step), make(step)), step
    assert not ahead.alive
    assert capfd.readouterr().err.count("prefetch worker stopped") == 1
    ahead.close()  # twice is fine


def test_an_unpicklable_function_is_refused_before_a_worker_starts():
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        StepPrefetcher(lambda step: step)


def test_prints_of_the_batch_function_do_not_break_the_stream(capfd):
    with StepPrefetcher(_print_and_return, depth=2) as ahead:
        assert [ahead.get(s) for s in range(5)] == list(range(5))
    assert "building 3" in capfd.readouterr().err


def test_the_worker_leaves_ctrl_c_to_the_trainer():
    """SIGINT (Ctrl-C reaches the whole process group) does not stop the worker: the trainer decides."""
    with StepPrefetcher(_print_and_return, depth=2) as ahead:
        assert ahead.get(0) == 0 and ahead.get(1) == 1  # step 1 came from the worker: it is up
        os.kill(ahead._proc.pid, signal.SIGINT)
        assert [ahead.get(s) for s in range(2, 6)] == [2, 3, 4, 5] and ahead.alive
