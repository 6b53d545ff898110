"""Newcomer audit, round 12: README.md read from the top on a CPU machine, every command it shows run (shortened with
--train.steps), every ``dstrain`` subcommand's and benchmark's ``--help`` read against what it does, every shipped
recipe planned (``dstrain plan RECIPE``), and a first user's usual mistakes made on purpose.

Found and fixed (what a first user typed; what happened before; what happens now):

* ``dstrain plan models/dilated_lm/recipes/debug.json`` (README's model table; the recipe has ``parallel.sp`` 2):
  "world size 1 is not divisible by tp x sp = 1 x 2 = 2": ``plan`` planned for 1 rank unless told, where
  ``check-config`` already took the fewest ranks the layout needs. Now both take tp x sp x pp, and ``plan`` says so
  in a note; its ``--world-size`` help said "data-parallel ranks" where it is every rank (tp x sp x pp x dp).
* ``dstrain launch --nproc 2 tiny.json`` (or ``gpt/tiny.json``, ``models/gpt/tiny.json``, ``tiny``): "cannot read:
  No such file or directory", nothing more. Now the shipped recipe of that (or a close) name is named.
* ``deepspeed --num_gpus 2 --module dstrain.cli launch --nproc 2 RECIPE``: every rank started a job of its own on
  one run folder; one was refused by the folder's lock, and the outer launcher then stopped the other mid-run
  ("stopped at step 1 of 2 by SIGTERM"). Now ``dstrain launch`` inside a deepspeed or torchrun rank is one line
  naming the command to give that launcher instead (``--module dstrain.cli train RECIPE``).
* A clone used without ``pip install -e .`` in a Python that lacks a requirement (``python -m dstrain.cli launch``
  with no deepspeed): a traceback ending in ``ModuleNotFoundError``. Now one line naming the package, the Python
  and ``pip install -e .``.
* ``dstrain launch --nproc 1 --accelerator cuda RECIPE`` on a machine without a GPU: the ranks took the CPU without
  a word. Now refused in one line with the fix (a note under ``--dry-run``, which may prepare a GPU node's command).
* ``dstrain launch --nproc 2 tiny.json --deepspeed.profile=zero3_offload`` (README, Everyday use): four torch
  FutureWarnings a rank (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` "is deprecated", DeepSpeed's calls).
  Now left out of a rank's output.
* ``DSTRAIN_DATA_DIR=DIR dstrain launch ... grpo_mbpp_cpu.json``: "name the file with --task.path=FILE" where DIR
  holds it; now the flag with the file. ``benchmarks/grpo_learning.py`` on the same refusal now says that its
  overrides go through ``--extra=``.

Not fixable in dstrain (README says so now): ``deepspeed --num_gpus 2 models/gpt/recipes/tiny.json`` hands the JSON
to Python as a script: nothing trains and it exits 0 (a recipe with ``true`` in it: a NameError).
"""
from pathlib import Path

import pytest

from dstrain import cli, launch_check, launcher
from dstrain.config_text import missing_file_problem

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "models/gpt/recipes/tiny.json"


@pytest.fixture
def no_child(monkeypatch):
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_plan_takes_the_ranks_a_sequence_parallel_recipe_needs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["plan", "models/dilated_lm/recipes/debug.json", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "dp 1 x tp 1 x sp 2 = 2 ranks" in out and "choice:" in out
    assert "planning for 2 ranks, the fewest the recipe's parallel layout takes" in err
    assert cli.main(["plan", RECIPE, "--device", "cpu"]) == 0  # one rank: no note
    assert "planning for" not in capsys.readouterr().err
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["plan"].format_help()
    assert "data-parallel ranks to plan for" not in help_text and "default: the recipe's tp x sp x pp" in help_text


@pytest.mark.parametrize("typed, meant", [("tiny.json", RECIPE), ("gpt/tiny.json", RECIPE),
                                         ("models/gpt/tiny.json", RECIPE), ("tiny", RECIPE),
                                         ("sudoku_debg.json", "models/hrm/recipes/sudoku_debug.json")])
def test_a_recipe_named_without_its_folder_names_the_shipped_one(typed, meant, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert missing_file_problem(typed) == f"cannot read: No such file or directory (did you mean {meant}?)"


def test_the_shipped_recipe_is_named_from_elsewhere_by_its_whole_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["launch", "--nproc", "2", "tiny.json"]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err == ("dstrain: error: tiny.json: cannot read: No such file or directory "
                                       f"(did you mean {ROOT / RECIPE}?)\n")
    assert missing_file_problem("nothing_like_any.json") == "cannot read: No such file or directory"


@pytest.mark.parametrize("env, outer", [({"LOCAL_RANK": "0", "LOCAL_SIZE": "2", "RANK": "0"}, "deepspeed"),
                                        ({"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "none", "RANK": "0"},
                                         "torchrun")])
def test_dstrain_launch_inside_a_launched_rank_is_one_line(env, outer, tmp_path, capsys, monkeypatch, no_child):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["launch", "--nproc", "2", str(ROOT / RECIPE), f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CONFIG and err.count("\n") == 1
    assert err.startswith(f"dstrain: error: dstrain launch is running inside rank 0 of a job that {outer} started")
    assert f"give {outer} `--module dstrain.cli train RECIPE`" in err
    assert not (tmp_path / "run").exists()


def test_a_plain_rank_in_this_process_is_not_taken_for_a_launched_one():
    from dstrain.cli_checks import nested_launch_problem
    # dstrain.runtime fills RANK / LOCAL_RANK for `python -m dstrain.cli train` run by hand (and in tests)
    assert nested_launch_problem({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None
    assert nested_launch_problem({"RANK": "3", "WORLD_SIZE": "8"}) is None  # a Kubernetes PyTorchJob's pod


def test_a_missing_requirement_is_one_line_naming_pip_install(capsys, monkeypatch, tmp_path):
    from dstrain import cli_tools

    def lacks(name):
        def cmd(args, overrides):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return cmd

    monkeypatch.setattr(cli_tools, "cmd_export", lacks("deepspeed.comm"))
    assert cli.main(["export", str(tmp_path), str(tmp_path / "w.safetensors")]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dstrain: error: the deepspeed package is not installed for ")
    assert "`pip install -e .` from the repository's root" in err
    monkeypatch.setattr(cli_tools, "cmd_export", lacks("some_plugin"))  # not a requirement: as it was
    with pytest.raises(ModuleNotFoundError):
        cli.main(["export", str(tmp_path), str(tmp_path / "w.safetensors")])


def test_accelerator_cuda_without_a_gpu_is_refused_and_a_dry_run_notes_it(tmp_path, capsys, monkeypatch, no_child):
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launcher, "detect_accelerator", lambda: "cpu")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    argv = ["launch", "--nproc", "1", "--accelerator", "cuda", str(ROOT / RECIPE), f"--output.dir={tmp_path / 'r'}"]
    assert cli.main(argv) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dstrain: error: GPU ranks were asked for (--accelerator cuda")
    assert "torch sees no GPU here" in err and "--accelerator cpu for CPU ranks" in err
    assert cli.main([*argv, "--dry-run"]) == 0
    assert "dstrain: note: GPU ranks were asked for (--accelerator cuda" in capsys.readouterr().err
    assert launch_check.no_gpu_problem("cuda", False, gpu_count=lambda: 1) is None
    assert launch_check.no_gpu_problem("auto", False, gpu_count=lambda: 0) is None
    assert launch_check.no_gpu_problem("cuda", True, gpu_count=lambda: 0) is None  # ranks elsewhere


def test_torchs_renamed_collective_warnings_are_left_out_of_a_ranks_output():
    # `dstrain launch --nproc 2 tiny.json --deepspeed.profile=zero3_offload` (README, Everyday use): each rank printed
    # "FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated. Please use ..." and its source line,
    # and the same for reduce_scatter_tensor, from DeepSpeed's ZeRO-3 calls
    import warnings

    from dstrain import runtime
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runtime.quiet_renamed_collectives()
        for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            warnings.warn(f"`torch.distributed.{name}` is deprecated. Please use `torch.distributed.x` instead.",
                          FutureWarning)
        warnings.warn("`torch.distributed.something_else` is deprecated.", FutureWarning)  # others still shown
    assert [str(w.message) for w in seen] == ["`torch.distributed.something_else` is deprecated."]


def test_a_missing_task_file_that_dstrain_data_dir_holds_is_named_with_its_flag(tmp_path, monkeypatch):
    # `DSTRAIN_DATA_DIR=DIR dstrain launch --nproc 2 models/policy/recipes/grpo_mbpp_cpu.json` from the clone's root
    # (README: the tests read that folder, the recipes do not): "name the file with --task.path=FILE", with the
    # file one variable away
    from dstrain.data.tasks import missing_task_file
    (tmp_path / "mbpp.jsonl").write_text("{}\n")
    monkeypatch.setenv("DSTRAIN_DATA_DIR", str(tmp_path))
    assert missing_task_file("../shared/data/mbpp.jsonl").endswith(
        f"; name the file with --task.path={tmp_path / 'mbpp.jsonl'} (recipes do not read DSTRAIN_DATA_DIR)")
    assert missing_task_file("/abs/other.jsonl") == ("task file not found: /abs/other.jsonl; name the file with "
                                                     "--task.path=FILE")  # not there either: as before


def test_grpo_learnings_refused_run_says_how_its_overrides_are_given(tmp_path, monkeypatch, capsys):
    # `python benchmarks/grpo_learning.py --recipe models/policy/recipes/grpo_mbpp_cpu.json --out runs/grpo_mbpp` from
    # the clone's root without ../shared/data: the launch's line says "name the file with --task.path=FILE", a flag
    # this script does not take (it passes overrides as --extra=...)
    import importlib.util
    import subprocess
    spec = importlib.util.spec_from_file_location("grpo_learning_bench12", ROOT / "benchmarks" / "grpo_learning.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for code, said in ((2, True), (1, False)):  # a refusal names the way; a failed run has nothing to override
        monkeypatch.setattr(bench.subprocess, "run",
                            lambda cmd, code=code, **kw: subprocess.CompletedProcess(cmd, code))
        with pytest.raises(SystemExit):
            bench.run("models/policy/recipes/grpo_mbpp_cpu.json", tmp_path / "grpo", None, 2, 2, [])
        err = capsys.readouterr().err
        assert ("goes to every run of this script as --extra=--section.key=value" in err) == said
        assert err.count("\n") == 1
