"""Communication accounting: DeepSpeed's raw log -> per-step figures, and the config switches."""
from __future__ import annotations

import pytest

from dstrain import comms
from dstrain.engine.ds_files import DSConfigError


def test_family_strips_debug_suffix_and_groups_variants():
    assert comms.family("all_reduce") == "all_reduce"
    assert comms.family("all_reduce_coalesced | [Caller Func: average_tensor]") == "all_reduce"
    assert comms.family("reduce_scatter_tensor") == "reduce_scatter"
    assert comms.family("all_gather_into_tensor") == "all_gather"
    assert comms.family("all_to_all_single") == "all_to_all"
    assert comms.family("isend") == "p2p"
    assert comms.family("something_new") == "other"


def test_summarize_counts_bytes_calls_and_time_per_step():
    # 2 steps: all_reduce of 400 B x 3 calls and 100 B x 1; reduce_scatter 800 B x 2.
    raw = {"all_reduce": {400: [3, [1.0, 2.0, 3.0], [], []], 100: [1, [4.0], [], []]},
           "reduce_scatter_tensor": {800: [2, [5.0, 6.0], [], []]}}
    seconds = {"all_reduce": 0.010, "reduce_scatter_tensor": 0.030}
    out = comms.summarize(raw, seconds, steps=2, wall_s=0.4)
    assert out["all_reduce_bytes"] == pytest.approx((400 * 3 + 100) / 2)
    assert out["all_reduce_calls"] == pytest.approx(2.0)
    assert out["all_reduce_ms"] == pytest.approx(5.0)
    assert out["reduce_scatter_bytes"] == pytest.approx(800.0)
    assert out["reduce_scatter_ms"] == pytest.approx(15.0)
    assert out["total_bytes"] == pytest.approx(650 + 800)
    assert out["total_ms"] == pytest.approx(20.0)
    assert out["calls"] == pytest.approx(3.0)
    assert out["share"] == pytest.approx(0.040 / 0.4)
    assert "all_gather_bytes" not in out
    with pytest.raises(ValueError):
        comms.summarize(raw, seconds, steps=0)


def test_comms_sections_switches_logger_and_dtype():
    out, notes = comms.comms_sections({"train_batch_size": 8}, True, "bf16", "zero2.json")
    assert out["comms_logger"] == {"enabled": True, "prof_all": True, "verbose": False}
    assert out["communication_data_type"] == "bf16"
    assert any("bf16" in n for n in notes) and any("comm/" in n for n in notes)
    same, notes = comms.comms_sections({"a": 1}, False, "auto", "x.json")
    assert same == {"a": 1} and notes == []
    # a user's own logger block is kept (its verbose choice too) and reported
    kept, notes = comms.comms_sections({"comms_logger": {"enabled": True, "verbose": True}}, False, "auto", "x")
    assert kept["comms_logger"]["verbose"] is True and notes


def test_comms_sections_refuses_a_disagreeing_file_and_bad_dtype():
    with pytest.raises(DSConfigError, match="communication_data_type is 'fp16'.*comm_dtype=bf16"):
        comms.comms_sections({"communication_data_type": "fp16"}, False, "bf16", "my.json")
    with pytest.raises(DSConfigError, match="comm_dtype must be one of"):
        comms.comms_sections({}, False, "int8", "my.json")


class _Timer:
    def __init__(self, ms):
        self.ms = ms

    def elapsed(self, reset=True):
        value = self.ms
        if reset:
            self.ms = 0.0
        return value


class _Logger:
    enabled = True

    def __init__(self, data):
        self.comms_dict = data

    def get_raw_data(self):
        return dict(self.comms_dict)

    def reset_data(self):
        self.comms_dict = {}


class _FakeComm:
    def __init__(self, data, ms):
        self.comms_logger = _Logger(data)
        self.timers = type("T", (), {"timers": {k: _Timer(v) for k, v in ms.items()}})()


def test_meter_reads_timers_resets_and_divides_by_steps(monkeypatch):
    fake = _FakeComm({"all_reduce": {1000: [4, [9.0, 9.0, 9.0, 9.0], [], []]}}, {"all_reduce": 8.0})
    monkeypatch.setitem(__import__("sys").modules, "deepspeed.comm.comm", fake)
    meter = comms.CommsMeter(start_step=10)
    out = meter.read(14)  # 4 steps since the start step
    # the timer's 8 ms over 4 steps, not the logger's (cumulative) latencies
    assert out["all_reduce_ms"] == pytest.approx(2.0)
    assert out["all_reduce_bytes"] == pytest.approx(1000.0)
    assert fake.comms_logger.comms_dict == {} and fake.timers.timers["all_reduce"].ms == 0.0
    assert meter.read(16) == {}  # nothing ran since


def test_meter_is_silent_without_deepspeed_logger(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "deepspeed.comm.comm", raising=False)
    assert comms.CommsMeter().read(5) == {}


def test_comm_dtype_benchmark_medians_survive_a_short_run():
    """benchmarks/comm_dtype.py --steps 3 (a smoke run) crashed with "no median for empty data"."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "comm_dtype.py"
    spec = importlib.util.spec_from_file_location("comm_dtype_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.later_steps(list(range(1, 201))) == list(range(21, 201))
    assert bench.later_steps([1, 2, 3]) == [2, 3]
    assert bench.later_steps([1]) == [1]
