"""benchmarks/grpo_mbpp_heldout.py: the paired statistics of GRPO minus the lr-0 control."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("grpo_mbpp_heldout", ROOT / "benchmarks" / "grpo_mbpp_heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _module()


def test_bootstrap_of_a_constant_difference_is_that_difference():
    mean, low, high = H.paired_bootstrap([0.0, 0.25, 0.5], [0.125, 0.375, 0.625], resamples=200)
    assert mean == pytest.approx(0.125) and low == pytest.approx(0.125) and high == pytest.approx(0.125)


def test_bootstrap_is_paired_deterministic_and_brackets_the_mean():
    first = [0.0] * 30 + [1.0] * 30
    second = [x + (0.25 if i % 2 else 0.0) for i, x in enumerate(first)]  # +0.125 on average, paired
    a = H.paired_bootstrap(first, second, resamples=2000, seed=3)
    assert a == H.paired_bootstrap(first, second, resamples=2000, seed=3)
    mean, low, high = a
    assert mean == pytest.approx(0.125)
    assert 0.0 < low < mean < high < 0.25
    # Pairing matters: the per-problem spread of first/second (0 or 1) does not widen the interval.
    assert high - low < 0.15
    # A difference of exactly 0 on every problem gives [0, 0].
    assert H.paired_bootstrap(first, first, resamples=100)[1:] == (0.0, 0.0)


def test_bootstrap_refuses_unpaired_input():
    with pytest.raises(ValueError):
        H.paired_bootstrap([0.0, 1.0], [1.0])
    with pytest.raises(ValueError):
        H.paired_bootstrap([], [])


def _figures(ids, passed, passes, samples=4):
    return {"task_ids": ids, "passed": passed, "sampled_passes": passes, "samples": samples}


def test_compare_counts_discordant_problems_and_signs_the_difference():
    ids = [f"mbpp/{i}" for i in range(20)]
    lr0 = _figures(ids, ["mbpp/0"], [0] * 20)
    grpo = _figures(ids, ["mbpp/0", "mbpp/1", "mbpp/2"], [4, 4, 2] + [0] * 17)
    c = H.compare(lr0, grpo, resamples=500)
    assert c["greedy_passed"] == {"baseline": 1, "run": 3}
    assert c["greedy_only_baseline"] == 0 and c["greedy_only_run"] == 2
    assert c["greedy_difference"] == pytest.approx(2 / 20)
    low, high = c["greedy_ci95_newcombe"]
    assert low < 2 / 20 < high
    assert c["sampled_rate"] == pytest.approx({"baseline": 0.0, "run": 10 / 80})
    assert c["sampled_difference"] == pytest.approx(10 / 80)
    assert c["problems_any_sample_passed"] == {"baseline": 0, "run": 3}
    assert c["sampled_ci95_bootstrap"][0] >= 0.0
    flipped = H.compare(grpo, lr0, resamples=500)
    assert flipped["greedy_difference"] == pytest.approx(-2 / 20)
    assert flipped["sampled_difference"] == pytest.approx(-10 / 80)
    assert "sampled_ran_difference" not in c  # only where both runs counted programs that ran
    with pytest.raises(ValueError):
        H.compare(lr0, _figures(ids[:-1], [], [0] * 19))


def test_compare_reports_the_share_of_programs_that_ran():
    ids = [f"mbpp/{i}" for i in range(10)]
    lr0 = {**_figures(ids, [], [0] * 10), "sampled_ran": [1] * 10}
    grpo = {**_figures(ids, [], [0] * 10), "sampled_ran": [3] * 10}
    c = H.compare(lr0, grpo, resamples=300)
    assert c["sampled_ran_rate"] == pytest.approx({"baseline": 0.25, "run": 0.75})
    assert c["sampled_ran_difference"] == pytest.approx(0.5)
    assert c["sampled_ran_ci95_bootstrap"] == pytest.approx([0.5, 0.5])
    assert c["greedy_difference"] == 0.0 and c["sampled_difference"] == 0.0


class _Result:
    def __init__(self, status):
        self.status = status


def test_statuses_counts_each_sandbox_verdict():
    got = H.statuses([_Result(s) for s in ("error", "passed", "error", "failed")])
    assert got == {"error": 2, "failed": 1, "passed": 1}
