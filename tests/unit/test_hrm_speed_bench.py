"""benchmarks/hrm_speed.py: the record it writes, and the option combinations it refuses."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("hrm_speed", ROOT / "benchmarks" / "hrm_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eager_run_writes_a_record(tmp_path):
    out = tmp_path / "hrm.json"
    assert _bench().main(["--sizes", "tiny", "--batch", "4", "--steps", "2", "--warmup", "1", "--device", "cpu",
                          "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    (r,) = record["results"]
    assert r["size"] == "tiny" and r["batch"] == 4 and r["steps"] == 2
    assert r["s_per_step"] > 0 and r["warmup_seconds"] > 0
    assert r["segments_per_s"] == pytest.approx(4 / r["s_per_step"])
    assert record["options"]["compile_scope"] == "auto" and record["machine"]["device"] == "cpu"
    assert str(tmp_path) not in out.read_text()


def test_regions_under_cuda_graphs_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _bench().main(["--sizes", "tiny", "--compile", "--compile-scope", "regions", "--compile-mode", "reduce-overhead"])
    assert e.value.code == 2 and "cannot run under --compile-mode reduce-overhead" in capsys.readouterr().err
