"""Newcomer audit, round 9: the benchmarks as README.md and benchmarks/README.md show them, run at their smallest
CPU sizes, their figures recomputed by hand, and given the mistakes a first user makes.

Found and fixed (what a first user typed; what happened before):

* ``python benchmarks/throughput.py models/gpt/recipes/tiny.json --profiles zero0,zero2 ... --plot``: the chart's
  legend sat in the lower right, over the last profile's dstrain bar and its ratio label (a bar starts at 0, so it
  always did). Now the legend sits below the axes, with headroom for the labels.
* The same run's table: nothing said that tok/s, GFLOP/s and MFU are dstrain's, what peak MFU divides by, or that
  "mem est." (the planner's model states + activations, 51 MiB) and "mem dstrain" (peak RSS with the imports,
  521 MiB) measure different things. Now three lines under the table say so, with the peak per rank in GFLOP/s.
* ``dstrain bench RECIPE --out afile/r.json`` (or ``--out`` a folder, or under ``/proc``): every job ran, minutes
  of them, then a traceback on writing. Now one line before any job (exit 2).
* ``dstrain bench RECIPE --scaling 1,a``: "invalid <lambda> value"; ``--timeout 0``: every job launched and
  killed at once, twice, then "every job failed". Now one line naming the flag.
* ``python benchmarks/scaling_model.py --measured X``, X missing, not JSON, another benchmark's result
  (``step_ops_cpu.json``) or a throughput result of an older form; ``--profile zero9``: a KeyError or
  FileNotFoundError traceback. ``--gpus-per-node 0``, ``--inter-gbps 0``: a ValueError or ZeroDivisionError
  traceback; ``--overlap 2``, ``--global-batch-tokens 0``: accepted, figures out of any range. Now one line
  each, exit 2. The measured model's layers and width came from GPT's size table whatever the model was, and
  ignored its ``model.args`` (a GPT run with ``--model.args.n_layer=6``); now the model's own table and args.
* ``python benchmarks/pipeline.py --steps 0`` (statistics' traceback after the first m was run), ``--pp 0``,
  ``--micro-batches 0,2``, ``--size huge``, ``--model hrm``, ``--pp 9`` on 8 layers, ``--model-args n_layer=x``:
  tracebacks from the spawned ranks. ``hrm_speed.py --sizes typo``, ``--batch -3``, ``--device cuda`` without a
  GPU, ``--grid 4`` with the default 40 blanks, ``--recipe missing.json`` (read after the first size was
  timed), a recipe outside the repository (its path made relative after all the timing): tracebacks.
  ``attention.py --lengths 0`` (ZeroDivisionError), ``--lengths abc``, ``--repeats 0`` (a run with no timing),
  ``--segments`` and ``--rates`` of different lengths; ``sandbox.py --workers 0``; ``comm_dtype.py``,
  ``rollout_backends.py``, ``checkpoint_stall.py`` ``--steps/--nproc/--every 0``. Now one line under the
  script's usage (exit 2), before any measurement.
* Every benchmark's ``--out`` (a file or a folder, as its ``--help`` says) is judged before the measurement as
  ``dstrain launch`` judges ``output.dir``: before, a folder given for a file, a file in the path or ``/proc``
  failed with a traceback at the end (``hrm_speed`` also printed no ``wrote`` line at all).
* ``attention.py`` with fewer than two lengths from ``--slope-from`` printed ``dilated time slope: None``; now
  it says why there is none.
* ``python benchmarks/sandbox.py --modes fork_server --workers 1 --repeats 1 --trivial 200 --out DIR``
  (benchmarks/README.md): p99 was the latency at index ``int(0.99 n)`` (of 100 programs, the slowest), and no
  latency was kept to check it by. Now numpy's default (linear) quantile, every latency in ``latencies_ms``.
  Its chart's x axis read "0.96 ... 1.04 workers" and the latency panel lacked its 50 ms goal; now ticks at the
  worker counts run and both goals drawn.
* ``python benchmarks/comm_dtype.py models/gpt/recipes/tiny.json --steps 30``: "bf16: step 0.4413 s, comm
  25.8 ms (7.7%)" (25.8 / 441.3 is 5.8%: the share was a third, separate median). Now the share is the printed
  comm time over the printed step time. Its chart drew the bf16 loss curve exactly over the fp32 one (one curve
  seen) and ms and MB as bars on one unlabelled axis; now a dashed curve over a solid one, one unit a panel.
  ``--dtypes fp32,fp8`` ran the fp32 job for minutes before the launch refused fp8; now refused first.
"""
import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from dstrain import bench, bench_args, bench_report
from tests.unit.test_bench import _fake_result

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "models" / "gpt" / "recipes" / "tiny.json")


WORK = {"pipeline": "measure", "hrm_speed": "time_size", "attention": "_run_point", "sandbox": "bench",
        "comm_dtype": "run", "rollout_backends": "run", "checkpoint_stall": "stall_run", "step_ops": "measure"}
"""The function of each script that starts measuring: here it fails the test instead."""


def _script(name, monkeypatch=None):
    spec = importlib.util.spec_from_file_location(f"{name}_audit9", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if monkeypatch is not None:
        def started(*a, **k):
            raise AssertionError(f"{name} started measuring")
        if name in WORK:
            monkeypatch.setattr(mod, WORK[name], started)
        if name == "step_ops":  # its main joins a process group before the first measurement
            import torch.distributed
            monkeypatch.setattr(torch.distributed, "init_process_group", started)
    return mod


def _refused(capsys, call) -> str:
    """The one line argparse printed as ``call`` was refused (exit 2)."""
    with pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


# ---------------------------------------------------------------- dstrain bench / benchmarks/throughput.py

def test_bench_out_that_cannot_be_written_is_refused_before_any_job(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "_launch", lambda *a, **k: pytest.fail("a job was launched"))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # CPU ranks (with one GPU visible, 2 ranks are refused first)
    (tmp_path / "afile").write_text("")
    assert bench.main([RECIPE, "--out", str(tmp_path / "afile" / "r.json")]) == 2
    assert capsys.readouterr().err.strip() == (f"dstrain bench: error: --out {tmp_path / 'afile' / 'r.json'}: "
                                               f"{tmp_path / 'afile'} is a file, not a folder")
    assert bench.main([RECIPE, "--out", str(tmp_path)]) == 2
    assert "is a folder; name the result file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--scaling", "1,a"], "argument --scaling: 'a' in '1,a': expected a whole number, got 'a'"),
    (["--timeout", "0"], "argument --timeout: must be at least 1, got 0"),
])
def test_bench_names_a_bad_number_instead_of_its_parser(argv, says, monkeypatch, capsys):
    """``dstrain bench RECIPE --scaling 1,a``: "invalid <lambda> value: '1,a'"; ``--timeout 0``: every job started
    and was killed at once, twice, then "every job failed"."""
    monkeypatch.setattr(bench, "_launch", lambda *a, **k: pytest.fail("a job was launched"))
    assert _refused(capsys, lambda: bench.main([RECIPE, *argv])) == f"dstrain bench: error: {says}"


def test_bench_table_says_what_its_columns_measure_and_the_peak_mfu_divides_by(tmp_path, monkeypatch):
    result = _fake_result(tmp_path, monkeypatch)
    lines = bench.format_table(result).splitlines()
    d = result["profiles"]["zero1"]["dstrain"]
    row = next(line for line in lines if line.strip().startswith("zero1")).split()
    # the figures the row shows, recomputed from the raw step times the JSON keeps
    median = sorted(d["step_times_s"])[1:3]
    step = sum(median) / 2
    assert float(row[2]) == pytest.approx(step, abs=1e-4)
    tokens = result["batch"]["tokens_per_step_global"]
    assert float(row[8]) == pytest.approx(tokens / step, abs=0.5)
    flops = tokens / step * result["model"]["flops_per_token"]
    assert float(row[9]) == pytest.approx(flops / 1e9, abs=0.005)
    assert float(row[10].rstrip("%")) == pytest.approx(100 * flops / result["world_size"] / 6e10, abs=0.05)
    notes = "\n".join(lines[-3:])
    assert "tok/s, GFLOP/s, MFU: dstrain's" in notes
    assert "MFU = GFLOP/s / world size / 60.0 GFLOP/s peak per rank" in notes
    assert "peak RSS of a rank" in notes and "mem est.: the planner's" in notes
    assert bench.format_table({"profiles": result["profiles"]}).count("\n") == len(result["profiles"])


def test_bench_chart_keeps_its_legend_clear_of_the_bars_and_their_ratios(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    result = _fake_result(tmp_path, monkeypatch)
    fig = bench_report.figure(result)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    box = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches]
    ratios = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(bars) == 4 and len(ratios) == 2
    assert not [b for b in bars + ratios if box.overlaps(b)]
    axes_top = ax.get_window_extent(renderer).y1
    assert all(t.y1 <= axes_top for t in ratios)  # the ratio of the tallest bar stays inside the axes
    import matplotlib.pyplot as plt
    plt.close(fig)


# ---------------------------------------------------------------- benchmarks/scaling_model.py

def _measured(tmp_path, drop=None):
    """The committed GPT large result, less the field ``drop`` (as an older form of the result may lack it)."""
    src = json.loads((ROOT / "benchmarks" / "results" / "throughput_gpu_gpt_large.json").read_text())
    src.pop(drop, None)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(src))
    return str(path)


@pytest.mark.parametrize("argv, says", [
    (["--measured", "MISSING"], "cannot read it (No such file or directory)"),
    (["--measured", "NOTJSON"], "not JSON"),
    (["--measured", str(ROOT / "benchmarks" / "results" / "step_ops_cpu.json")], "not a throughput-benchmark result"),
    (["--measured", "OLD"], "a throughput result without 'profiles' (an older form of it?)"),
    (["--profile", "zero9"], "--profile zero9: not measured in"),
    (["--gpus-per-node", "0"], "argument --gpus-per-node: must be at least 8, got 0"),
    (["--inter-gbps", "0"], "argument --inter-gbps: must be above 0, got 0"),
    (["--overlap", "2"], "argument --overlap: must be at least 0 and at most 1, got 2"),
    (["--global-batch-tokens", "0"], "argument --global-batch-tokens: must be at least 1, got 0"),
    (["--out", "FOLDER"], "is a folder; name the result file"),
])
def test_scaling_model_names_a_bad_input_in_one_line(argv, says, tmp_path, capsys):
    mod = _script("scaling_model")
    (tmp_path / "notjson.json").write_text("not json")
    swap = {"MISSING": str(tmp_path / "missing.json"), "NOTJSON": str(tmp_path / "notjson.json"),
            "OLD": _measured(tmp_path, drop="profiles"), "FOLDER": str(tmp_path)}
    argv = [swap.get(a, a) for a in argv]
    line = _refused(capsys, lambda: mod.main([*argv, "--out", str(tmp_path / "o.json")] if "--out" not in argv
                                             else argv))
    assert says in line, line
    assert not (tmp_path / "o.json").exists()


def test_scaling_model_takes_the_measured_models_own_shape(tmp_path, capsys):
    mod = _script("scaling_model")
    src = json.loads(Path(_measured(tmp_path)).read_text())
    src["model"]["args"] = {"n_layer": 6}
    (tmp_path / "m.json").write_text(json.dumps(src))
    measured, problem = mod.read_measured(str(tmp_path / "m.json"), "zero0")
    assert problem is None
    base = next(iter(mod.workloads(measured, "zero0").values()))
    assert base.n_layer == 6 and base.hidden == 1280  # large's width, the run's layers
    assert mod.model_shape({"name": "gpt", "size": "small", "args": {"n_embd": 512}}) == \
        {"n_layer": 12, "n_embd": 512}


# ---------------------------------------------------------------- the other benchmark scripts

@pytest.mark.parametrize("name, argv, says", [
    ("pipeline", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("pipeline", ["--pp", "0"], "argument --pp: must be at least 1, got 0"),
    ("pipeline", ["--micro-batches", "0,2"], "'0' in '0,2': must be at least 1, got 0"),
    ("pipeline", ["--size", "huge"], "unknown size 'huge' for model 'gpt'"),
    ("pipeline", ["--model", "hrm", "--size", "debug", "--model-args", ""], "--model hrm: has no pipeline stages"),
    ("pipeline", ["--pp", "9"], "--pp 9: more stages than the model's 8 layers"),
    ("pipeline", ["--model-args", "n_layer=x"], "'n_layer=x' is not key=whole number"),
    ("hrm_speed", ["--sizes", "typo"], "--sizes typo: not an HRM size; the sizes are tiny, debug, sudoku"),
    ("hrm_speed", ["--batch", "-3"], "argument --batch: must be at least 0, got -3"),
    ("hrm_speed", ["--device", "gpu"], "--device gpu: not a device"),
    ("hrm_speed", ["--grid", "4"], "--blanks 40: a 4x4 puzzle with one solution has at most 12 blanks"),
    ("hrm_speed", ["--recipe", "MISSING"], "cannot read it (No such file or directory)"),
    ("hrm_speed", ["--recipe", str(ROOT / "ds_configs" / "zero2.json")], "not an HRM recipe"),
    ("attention", ["--lengths", "0"], "argument --lengths: must be at least 1, got 0"),
    ("attention", ["--lengths", "abc"], "argument --lengths: expected a whole number, got 'abc'"),
    ("attention", ["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    ("attention", ["--segments", "128,256", "--rates", "1"], "2 segment lengths against 1 rates"),
    ("sandbox", ["--workers", "0"], "argument --workers: must be at least 1, got 0"),
    ("comm_dtype", ["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    ("comm_dtype", ["--dtypes", "fp32,fp8"], "argument --dtypes: fp8: not a comm dtype; the dtypes are auto, fp32"),
    ("rollout_backends", ["--nproc", "0"], "argument --nproc: must be at least 1, got 0"),
    ("checkpoint_stall", ["--every", "0"], "argument --every: must be at least 1, got 0"),
])
def test_a_benchmark_refuses_a_bad_value_before_measuring(name, argv, says, tmp_path, monkeypatch, capsys):
    mod = _script(name, monkeypatch)
    argv = [str(tmp_path / "missing.json") if a == "MISSING" else a for a in argv]
    out = tmp_path / ("o" if name in ("attention", "sandbox") else "o.json")
    argv = [*argv, "--out", str(out)]
    monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])  # checkpoint_stall's main reads sys.argv
    line = _refused(capsys, (lambda: mod.main()) if name == "checkpoint_stall" else (lambda: mod.main(argv)))
    assert says in line, line
    assert not out.exists()


@pytest.mark.parametrize("name, kind", [
    ("pipeline", "file"), ("hrm_speed", "file"), ("step_ops", "file"), ("comm_dtype", "file"),
    ("rollout_backends", "file"), ("checkpoint_stall", "file"), ("attention", "folder"), ("sandbox", "folder"),
])
def test_a_benchmarks_out_is_judged_before_it_measures(name, kind, tmp_path, monkeypatch, capsys):
    mod = _script(name, monkeypatch)
    (tmp_path / "afile").write_text("")
    for out, says in ((tmp_path / "afile" / "r.json", f"{tmp_path / 'afile'} is a file, not a folder"),
                      (tmp_path if kind == "file" else tmp_path / "afile",
                       "is a folder; name the result file" if kind == "file" else "is a file; name a folder")):
        argv = ["--out", str(out)]
        monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
        line = _refused(capsys, mod.main if name == "checkpoint_stall" else lambda a=argv: mod.main(a))
        assert says in line, line


def test_the_shared_checks_read_numbers_and_lists_as_the_help_says():
    assert bench_args.count(0)("0") == 0 and bench_args.counts(1)("1, 2,4") == [1, 2, 4]
    assert bench_args.number(0.0, 1.0)("1") == 1.0
    for parse, text in ((bench_args.count(1), "1.5"), (bench_args.counts(1), ","), (bench_args.number(above=True), "0"),
                        (bench_args.number(), "nan")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    assert bench_args.out_problem("results/new/r.json") is None  # a folder still to be made is fine


# ---------------------------------------------------------------- benchmarks/sandbox.py: p50/p99 and the chart

def test_sandbox_p99_is_the_interpolated_quantile_of_the_latencies_it_keeps():
    """Before: p99 was the latency at index int(0.99 n): of 100 programs the slowest one, and the latencies
    were not kept, so nobody could recompute it. Now numpy's default (linear) quantile, and every latency kept."""
    mod = _script("sandbox")

    class Result:
        def __init__(self, ms):
            self.seconds, self.status = ms / 1e3, "passed"

    class Pool:
        def run_many(self, jobs):
            return [Result(ms) for ms in range(len(jobs), 0, -1)]  # 100 ms ... 1 ms

    t = mod.timed(Pool(), [None] * 100)
    assert t["latencies_ms"] == pytest.approx(list(range(100, 0, -1)))
    assert t["p50_ms"] == pytest.approx(50.5) and t["p99_ms"] == pytest.approx(99.01)
    assert mod.quantile([3.0], 0.99) == 3.0


def test_sandbox_chart_ticks_the_worker_counts_run_and_draws_both_goals():
    """``sandbox.py --workers 1 ...`` (README): the x axis read 0.96, 0.98, 1.00 ... workers; the latency panel
    had no 50 ms goal line beside the throughput panel's 40 programs/s."""
    pytest.importorskip("matplotlib")
    mod = _script("sandbox")
    run = {"mode": "fork_server", "workers": 1, "trivial": {"programs_per_s": 26.0, "p99_ms": 65.0}}
    fig = mod.figure({"device": "cpu", "runs": [run, {**run, "workers": 4}]})
    import matplotlib.pyplot as plt
    try:
        assert [list(ax.get_xticks()) for ax in fig.axes] == [[1, 4], [1, 4]]
        labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
        assert "goal: 40 MBPP programs/s" in labels and "goal: p99 <= 50 ms" in labels
    finally:
        plt.close(fig)


# ---------------------------------------------------------------- benchmarks/comm_dtype.py

def _comm_run(tmp_path, monkeypatch):
    """``comm_dtype.run`` on a launch stood in for: 8 logged steps whose step times vary, as on a loaded CPU."""
    mod = _script("comm_dtype")
    out = tmp_path / "fp32"
    step_s = [2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5]  # steps 4-8 are timed (start-up left out)
    comm_ms = [100.0, 50.0, 40.0, 60.0, 50.0, 45.0, 55.0, 50.0]

    def launch(cmd, **kw):
        out.mkdir()
        (out / "metrics.jsonl").write_text("".join(
            json.dumps({"step": i, "train/loss": 5.0 - i / 10, "train/tokens_per_s": 1024 / s, "comm/total_ms": c,
                        "comm/total_bytes": 4e6, "comm/share": c / 1e3 / s}) + "\n"
            for i, (s, c) in enumerate(zip(step_s, comm_ms), 1)))
        (out / "run_config.json").write_text(json.dumps({"train": {"micro_batch": 4, "grad_accum": 2},
                                                         "data": {"seq_len": 64}}))
        return argparse.Namespace(returncode=0, stderr="")

    monkeypatch.setattr(mod.subprocess, "run", launch)
    args = argparse.Namespace(nproc=2, steps=8, profile="zero2")
    return mod, mod.run("models/gpt/recipes/tiny.json", "fp32", args, [], out)


def test_comm_dtype_share_is_the_printed_comm_time_over_the_printed_step_time(tmp_path, monkeypatch):
    """``comm_dtype.py ... --steps 30``: "bf16: step 0.4413 s, comm 25.8 ms (7.7%)", where 25.8 / 441.3 is 5.8%:
    the share was the median of every step's own share, a third median beside those of the step and comm times.
    Now the printed share is the printed comm time over the printed step time (the other stays in the JSON)."""
    _, r = _comm_run(tmp_path, monkeypatch)
    assert r["step_time_s"] == pytest.approx(1.0) and r["comm_ms_per_step"] == pytest.approx(50.0)
    assert r["comm_share"] == pytest.approx(50.0 / 1000.0)
    assert r["comm_share_median_of_steps"] == pytest.approx(0.06)  # of 0.06, 0.05, 0.045, 0.11, 0.10


def test_comm_dtype_chart_shows_both_loss_curves_and_one_unit_per_panel(tmp_path, monkeypatch):
    """The chart drew the bf16 loss over the fp32 one in the same style (only one curve visible when they agree)
    and milliseconds and megabytes as bars on one unlabelled axis."""
    pytest.importorskip("matplotlib")
    mod, r = _comm_run(tmp_path, monkeypatch)
    result = {"recipe": "tiny.json", "nproc": 2, "profile": "zero2", "load_average": {"before": [1.0]},
              "runs": [r, {**r, "comm_dtype": "bf16", "comm_bytes_per_step": 2e6}]}
    fig = mod.figure(result)
    import matplotlib.pyplot as plt
    try:
        loss, time_ax, bytes_ax = fig.axes
        assert len({line.get_linestyle() for line in loss.get_lines()}) == 2
        assert "ms" in time_ax.get_ylabel() and "MB" in bytes_ax.get_ylabel()
        assert [p.get_height() for p in bytes_ax.patches] == pytest.approx([4.0, 2.0])
    finally:
        plt.close(fig)
