"""Newcomer audit, round 7: README's commands not exercised before (benchmarks, plan, export, RL, HRM, launch/),
run as written.

Found and fixed (what a first user typed; what happened before):

* ``dstrain export runs/policy_grpo_debug hf/my-coder-grpo`` (README's RL section): the folder's
  ``model.safetensors`` was 0600 (safetensors creates its files so), so nobody else on a shared machine could load
  the export with ``--model.args.path`` or ``from_pretrained``; the GRPO/SCoRe warm start's folder the same. Round 5
  had fixed this for the one-file export only. Now the mode any new file gets (0644 under umask 022).
* ``python benchmarks/grpo_learning.py --out runs`` (or ``--out benchmarks/results``, as the other benchmarks take
  a results folder): the folder was deleted whole, with every run or committed result in it, before the first
  run started. Now a folder holding anything this benchmark did not write is refused in one line, untouched.
* README: "give your own runs ``--out`` elsewhere (a file or a folder, as each script's ``--help`` says)": the
  ``--help`` of step_ops, attention, sandbox, comm_dtype, pipeline, rollout_backends, checkpoint_stall, hrm_speed
  and scaling_model said nothing of ``--out``; ``score_selfcorrect.py`` writes its figures over the committed ones
  through ``--results``, not ``--out``. Now each says what it takes and what it writes by default.
* ``python benchmarks/hrm_speed.py --sizes sudoku --batch 4 --steps 3 --compile`` (README's compile figures) on a
  CPU: "9634.5 ms/step, 0 segments/s" (0.42 rounded to a whole number). Now three figures below 100.
"""
import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_a_hugging_face_export_gets_the_usual_file_mode(tmp_path, umask_022):
    """``save_pretrained`` as ``dstrain export`` and the warm start call it. The stand-in for transformers' model
    writes its weights as transformers does, through safetensors (building a real policy takes seconds)."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from models.policy.reference import save_pretrained

    class Hf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(2, 2)
            self.config = SimpleNamespace(to_dict=dict)

        def save_pretrained(self, directory, state_dict):
            os.makedirs(directory, exist_ok=True)
            save_file(state_dict, os.path.join(directory, "model.safetensors"))
            with open(os.path.join(directory, "config.json"), "w") as f:
                f.write("{}")

    model = torch.nn.Module()
    model.hf, model.config = Hf(), SimpleNamespace(path=None)
    save_pretrained(model, str(tmp_path / "hf"))
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644}


def _bench(name):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grpo_learning_refuses_to_empty_a_folder_it_did_not_write(tmp_path, monkeypatch, capsys):
    bench = _bench("grpo_learning")
    started = []
    monkeypatch.setattr(bench, "run", lambda *a, **k: started.append(a) or 0.0)
    (tmp_path / "gpt_tiny").mkdir()
    (tmp_path / "gpt_tiny" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        bench.main(["--out", str(tmp_path)])
    assert "holds what this benchmark did not write (gpt_tiny)" in str(stop.value.code)
    assert (tmp_path / "gpt_tiny" / "summary.json").exists() and not started
    # a folder an earlier check wrote is emptied for the new one, as before
    earlier = tmp_path / "earlier"
    (earlier / "grpo").mkdir(parents=True)
    (earlier / "grpo_learning_cpu.json").write_text("{}")
    monkeypatch.setattr(bench, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("first run")))
    with pytest.raises(RuntimeError, match="first run"):
        bench.main(["--out", str(earlier)])
    assert not earlier.exists()


@pytest.mark.parametrize("name,flag", [
    ("step_ops", "--out"), ("attention", "--out"), ("sandbox", "--out"), ("comm_dtype", "--out"),
    ("scaling_model", "--out"), ("pipeline", "--out"), ("rollout_backends", "--out"),
    ("checkpoint_stall", "--out"), ("hrm_speed", "--out"), ("grpo_learning", "--out"),
    ("score_selfcorrect", "--results")])
def test_each_benchmarks_help_says_whether_its_output_is_a_file_or_a_folder(name, flag, monkeypatch, capsys):
    bench = _bench(name)
    monkeypatch.setattr("sys.argv", [f"{name}.py", "--help"])  # checkpoint_stall's main reads sys.argv
    with pytest.raises(SystemExit) as stop:
        bench.main() if name == "checkpoint_stall" else bench.main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    after = text.split(f"{flag} {flag.lstrip('-').upper()} ", 1)[1]
    described = "" if after.startswith("-") else after.split(" --", 1)[0]  # no text: the next option follows
    assert re.search(r"\b(file|folder)\b", described), described


def test_hrm_speed_prints_a_slow_rate_with_its_figures():
    rate = _bench("hrm_speed").rate
    assert rate(0.4151) == "0.415" and rate(37.26) == "37.3" and rate(7345.4) == "7,345"
