"""Bring-your-own DeepSpeed JSONs: each trains 3 steps on 2 CPU ranks or is refused before launch in one line.

The JSON files beside this test are written in the styles users copy from (HF Trainer's
zero2/zero3 with "auto" and offload, Accelerate's, Megatron-DeepSpeed's, DeepSpeedExamples'
bing_bert and GPT scripts; with and without optimizer and scheduler blocks; fp16 loss
scaling, bf16, monitors, profilers). Every file goes through ``dstrain launch --dry-run``
here (the checks a real launch runs before it starts any rank); real 2-rank runs cover a
representative subset by default and every trainable file with ``-m slow``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain import cli
from dstrain.engine.ds_files import load_ds_json
from tests.ahead import runs_ahead
from tests.configs.expectations import CHECKED_ONLY, EXPECT  # the tables, by round

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECIPE = str(ROOT / "models" / "gpt" / "recipes" / "tiny.json")
FILES = sorted(p.name for p in HERE.glob("*.json"))

# Real 2-rank runs by default: the two crashes (no optimizer block, with a profiler / a monitor),
# a Megatron-style batch (grad-accum derived, bf16 adopted) and DeepSpeedExamples' Adam + WarmupLR.
DEFAULT_RUNS = {"zero3_tensorboard_no_optimizer.json", "megatron_gpt_bf16_zero1.json"}
"""The two-rank runs of the default suite (about 16 s each); the rest run with ``-m slow``."""

QUICK = ["--train.steps=3", "--data.seq_len=64", "--data.max_bytes=1000000", "--train.log_every=1",
         "--train.eval_batches=1", "--output.tensorboard=false", "--output.progress=false",
         "--deepspeed.values_from_file=true"]


def test_the_suite_has_twenty_files_each_with_an_expectation():
    assert len(FILES) >= 20
    assert sorted(EXPECT) == FILES
    trains = [f for f, e in EXPECT.items() if e is None]
    assert len(trains) >= 10 and len(FILES) - len(trains) >= 5


@pytest.fixture
def no_child(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)


@pytest.mark.parametrize("name", FILES)
def test_checked_before_launch(name, capsys, no_child, tmp_path):
    out_dir = tmp_path / "run"
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE,
                     f"--deepspeed.profile={HERE / name}", *QUICK, f"--output.dir={out_dir}"])
    out, err = capsys.readouterr()
    expected = EXPECT[name]
    if expected is None:
        assert code == 0, err
        command = out.strip().splitlines()
        assert len(command) == 1 and "--module dstrain.cli train" in command[0]
        assert "error" not in err
    else:
        assert code == 2 and out == ""
        lines = err.strip().splitlines()
        assert lines[0].startswith(f"dstrain: error: {HERE / name}: "), err  # naming the file and the key
        if len(lines) > 1:  # every problem at once: a count, then one line each (none said twice)
            assert lines[0].endswith(f"{len(lines) - 1} problems:") or lines[-1].startswith("  - use --"), err
            assert all(line.startswith("  - ") for line in lines[1:]) and len(set(lines)) == len(lines), err
        assert any(expected in line for line in lines), err
        assert "values_from_file" not in lines[0]  # the switch is on: no point suggesting it
    assert not out_dir.exists() and not any(tmp_path.iterdir())  # nothing written either way


def test_disagreeing_values_refused_without_the_switch(capsys, no_child):
    args = [a for a in QUICK if "values_from_file" not in a]
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE,
                     f"--deepspeed.profile={HERE / 'megatron_gpt_bf16_zero1.json'}", *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "gradient_accumulation_steps: file implies 2 (train_batch_size 16, train_micro_batch_size_per_gpu 4 " \
           "on 2 data-parallel ranks), run gives 1" in err
    assert "use --train.micro_batch=4 --train.grad_accum=2, or set them to \"auto\" in the file" in err
    # the same file with the switch: each adopted value reported, and passed to the ranks
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE,
                     f"--deepspeed.profile={HERE / 'megatron_gpt_bf16_zero1.json'}", *QUICK])
    out, err = capsys.readouterr()
    assert code == 0
    assert "dstrain: train.micro_batch=4 adopted from train_micro_batch_size_per_gpu" in err
    assert "dstrain: train.grad_accum=2 adopted from gradient_accumulation_steps" in err
    assert "dstrain: deepspeed.precision=bf16 adopted from bf16.enabled" in err
    assert out.split()[-3:] == ["--train.micro_batch=4", "--train.grad_accum=2", "--deepspeed.precision=bf16"]


# --------------------------------------------------------------------------- real 2-rank runs


def _command(name: str, out: Path, nproc: int) -> tuple[list[str], dict]:
    """The command of a real run of ``name`` and its ``subprocess.run`` keywords (run from ``out``'s parent)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    head = ["launch", "--nproc", str(nproc)] if nproc > 1 else ["train"]  # one process: as a user types it
    cmd = [sys.executable, "-m", "dstrain.cli", *head, RECIPE,
           f"--deepspeed.profile={HERE / name}", *QUICK, f"--output.dir={out}", "--checkpoint.every=0"]
    return cmd, {"env": env, "cwd": out.parent, "timeout": 600}


def _launch(name: str, out: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd, kwargs = _command(name, out, nproc)
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


RUN_TESTS = {"test_trains_three_steps_on_two_cpu_ranks": 2, "test_trains_three_steps_in_one_process": 1}


@pytest.fixture(scope="module")
def ahead(request, tmp_path_factory):
    """``nodeid -> (future of the completed process, run folder)``: the real runs of this module's two run tests
    below, two at a time ahead of the tests (tests/ahead.py)."""
    def plan(item):
        nproc = RUN_TESTS.get(item.originalname)
        if nproc is None:
            return None
        out = tmp_path_factory.mktemp("run") / "run"
        cmd, kwargs = _command(item.callspec.params["name"], out, nproc)
        return cmd, kwargs, out

    with runs_ahead(request, plan) as runs:
        yield runs


def _autos(node, path="") -> list[str]:
    """Dotted paths of every "auto" value left in a config."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _autos(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _autos(v, f"{path}[{i}]")]
    return [path] if node == "auto" else []


def _run_params():
    for name in FILES:
        if EXPECT[name] is not None or name in CHECKED_ONLY:
            continue
        marks = [pytest.mark.dist] + ([] if name in DEFAULT_RUNS else [pytest.mark.slow])
        yield pytest.param(name, marks=marks, id=name)


def _trained_three_steps(name: str, out, nproc: int = 2, ahead=None, nodeid=None) -> tuple[str, dict, Path]:
    """Run ``name`` for 3 steps, or take its run started ahead (``ahead[nodeid]``); (its output, the resolved
    DeepSpeed JSON, the run folder) once it trained them cleanly."""
    if ahead is not None and nodeid in ahead:
        future, out = ahead[nodeid]
        proc = future.result()
    else:
        proc = _launch(name, out, nproc=nproc)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "Traceback" not in text
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == [1, 2, 3]
    resolved = json.loads((out / "ds_config.json").read_text())  # what DeepSpeed got
    assert _autos(resolved) == []
    return text, resolved, out


@pytest.mark.parametrize("name", list(_run_params()))
def test_trains_three_steps_on_two_cpu_ranks(name, tmp_path, ahead, request):
    text, resolved, out = _trained_three_steps(name, tmp_path / "run", ahead=ahead, nodeid=request.node.nodeid)
    user = load_ds_json(HERE / name)  # as DeepSpeed reads it (hjson, legacy spellings)
    assert resolved.get("zero_optimization", {}).get("stage", 0) == user.get("zero_optimization", {}).get("stage", 0)
    for section, key in (("tensorboard", "output_path"), ("csv_monitor", "output_path"),
                         ("flops_profiler", "output_file")):
        if user.get(section, {}).get("enabled") is True:  # relative paths land inside the run folder
            path = Path(resolved[section][key])
            assert path.is_relative_to(out.resolve()), path
            assert path.exists() and (path.is_file() or any(path.rglob("*"))), path
    assert not (out.parent / "tb_logs").exists() and not (out.parent / "csv").exists()  # (its working folder)
    plan = (out / "plan.txt").read_text()
    if "optimizer" not in user:  # the trainer's own optimizer, from the run config's numbers
        line = next(x for x in plan.splitlines() if x.startswith("optimizer:"))
        assert "from the run config" in line or "the JSON has no optimizer block" in line, line


# --------------------------------------------------------------------------- one-process runs

#: file -> (dotted keys of the config DeepSpeed got -> value, text plan.txt or the output must contain).
#: One process shows each point: what DeepSpeed was given and that the run (and its final checkpoint) completes.
ONE_PROCESS = {
    # DeepSpeed's unfused bf16 wrapper left Adagrad's constructor-made state behind: KeyError at the checkpoint
    "cifar_adagrad_optimizer.json": ({"optimizer.type": "Adagrad", "optimizer.params.lr": 0.001, "bf16.enabled": True,
                                      "zero_optimization.stage": 0},
                                     "type 'Adagrad' is not Adam/AdamW, which dstrain builds itself"),
    # the file's torch_autocast is honoured as autocast over fp32 weights, not stacked on DeepSpeed's bf16
    "torch_autocast_bf16_section.json": ({"bf16.enabled": False, "torch_autocast.enabled": True,
                                          "torch_autocast.dtype": "bfloat16"},
                                         "bf16 as torch.autocast over fp32 weights (the file's torch_autocast section)"),
    # a torch.optim class by name under ZeRO-2, vetted by the file's zero_allow_untested_optimizer
    "torch_optim_sgd_momentum.json": ({"optimizer.type": "SGD", "optimizer.params.momentum": 0.9,
                                       "optimizer.params.nesterov": True, "zero_optimization.stage": 2,
                                       "zero_allow_untested_optimizer": True},
                                      "type 'SGD' is not Adam/AdamW"),
    # DeepSpeed's old "cpu_offload": true is optimizer offload: DeepSpeed's CPU Adam, not a client AdamW it refuses
    "legacy_zero2_cpu_offload_flag.json": ({"zero_optimization.cpu_offload": True, "optimizer.type": "AdamW",
                                            "zero_optimization.stage": 2},
                                           "optimizer offload: DeepSpeed builds its CPU Adam"),
    # bf16 "enabled": "true" (a string) is bf16, as DeepSpeed reads it; the optimizer's "auto" lr is the warm-up peak
    "bf16_string_true_warmupdecay.json": ({"bf16.enabled": True, "scheduler.params.warmup_max_lr": 2e-05,
                                           "zero_optimization.stage": 3}, "precision: bf16"),
    # an unused key is named, not dropped in silence (dstrain train prints the notes itself)
    "seq_parallel_comm_dtype_bf16.json": ({"seq_parallel_communication_data_type": "bf16", "bf16.enabled": True},
                                          "dstrain: note: seq_parallel_communication_data_type: unused"),
    # a torch.optim.lr_scheduler class by name: DeepSpeed builds it on the client optimizer itself (stage 0, fp32)
    "torch_steplr_zero0_fp32.json": ({"scheduler.type": "StepLR", "scheduler.params.step_size": 2,
                                      "zero_optimization.stage": 0}, "learning-rate schedule: the DeepSpeed JSON's"),
}


def _at(node, dotted: str):
    for part in dotted.split("."):
        node = node[part]
    return node


def test_one_process_files_are_trainable_ones():
    assert set(ONE_PROCESS) <= {f for f, e in EXPECT.items() if e is None}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_trains_three_steps_in_one_process(name, tmp_path, ahead, request):
    text, resolved, out = _trained_three_steps(name, tmp_path / "run", nproc=1, ahead=ahead,
                                               nodeid=request.node.nodeid)
    assert (out / "checkpoints" / "step_00000003").is_dir()  # the final save went through
    wanted, said = ONE_PROCESS[name]
    assert {k: _at(resolved, k) for k in wanted} == wanted
    assert said in (out / "plan.txt").read_text() + text
