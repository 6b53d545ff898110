"""Newcomer audit, round 5: the README's commands given bad paths, files and signals, each ended in one line.

Found and fixed (what a first user typed; what happened before):

* ``dstrain export RUN x/y.safetensors`` where ``x`` is a file, or into ``/proc``: a FileExistsError or
  SafetensorError traceback, after the weights were gathered. Now one line naming the path, checked first.
* ``dstrain hostfile node1 -o missing/dir/hostfile`` (or ``-o`` a folder): a FileNotFoundError traceback.
* Ctrl-C to ``dstrain launch``: rank 0 said ``stopped ... by SIGTERM (exit 143, ...)`` (the signal the
  launcher passes on), and ``echo $?`` said 130. Now ``by SIGINT to dstrain launch (exit 130, ...)``.
* ``--task.path=DIR`` (MBPP recipes) or ``--task.train_file=DIR`` (HRM): passed the launch check; the ranks
  then died with IsADirectoryError (MBPP) or "no such puzzle file" (HRM). Now refused before any rank starts.
* ``--data.corpus=typo``: passed the launch check and failed in every rank. Now refused before.
* ``--output.dir=afile/run``: "afile is not writable (read-only, or not yours)"; ``--output.dir=/proc/run``
  as root: accepted, and the ranks failed. Now "afile is a file, not a folder" and "nothing can be created".
* A run config with ``//`` comments (as DeepSpeed's JSONs may have): ``check-config`` called it a DeepSpeed
  JSON with "unknown top-level key 'model'"; ``plan`` gave the parser's bare position. An empty run config:
  "invalid JSON at line 2 column 1: Expecting value". Now each says what it is.
* ``dstrain launch ds_configs/zero3.json``: "train_batch_size: unknown key (valid: trainer, model, ...)". Now it
  says the file is a DeepSpeed JSON and how a run config names it.
* ``--task.path=`` (empty) on ``grpo_mbpp_cpu.json``: blamed the recipe file ("grpo_mbpp_cpu.json: task: ...").
  Now ``command line: task.path: ...``, as audit 3 did for ``model.args``.
* ``dstrain plan RUN/checkpoints/step_*/mp_rank_00_model_states.pt`` (a binary file): "'utf-8' codec can't
  decode byte 0x80 in position 128", naming no file. Now "FILE: cannot read: not UTF-8 text".
* ``dstrain plan tiny.json --device-memory=0``: "Hardware needs positive device_memory, host_memory and
  ranks_per_node", naming no flag; ``--gpus-per-node 0`` planned as if 1. Now the flag is named.
* ``dstrain launch --nproc 2 tiny.json --parallel.sp=2`` (the README's ``parallel`` section): passed every check,
  then each rank died with "TypeError: parallelize_gpt() got an unexpected keyword argument 'state'" (HRM the
  same; policies NotImplementedError). tp and sp are the dilated LM's only: the others now refuse them at load.
* ``dstrain launch --nproc 1 sudoku_debug.json --resume`` on a 2-rank HRM run: the ranks started, rank 0 refused
  the ACT carry's layout, DeepSpeed added its [ERROR] line. Now refused in one line before any rank starts.
* ``--output.dir=~/runs/tiny`` (the shell leaves ``~`` after ``=``): the run went to a folder named ``~`` inside
  the current one; ``--task.train_file=~/x.txt`` passed the launch check (which expanded it) and failed in the
  ranks (whose puzzle reader did not). Both now read ``~`` as the home folder, as the other paths already did.
* ``--resume`` of a run already at ``train.steps``: exit 0, nothing trained, not a word. Now a note says so.
* Ctrl-C while ``dstrain launch`` still planned (its first seconds): a KeyboardInterrupt traceback from wherever
  it was (an import, the bf16 matmul probe); in its first half second, a Ctrl-C that an import swallowed, after
  which the launch trained all 300 steps and exited 0. Now one line and exit 130, and no job is started.
"""
import json
import signal
from pathlib import Path

import pytest

from dstrain import cli, cli_checks, rank_exit
from dstrain.config import ConfigError, load_run_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"
MBPP = ROOT / "models" / "policy" / "recipes" / "grpo_mbpp_cpu.json"
SUDOKU = ROOT / "models" / "hrm" / "recipes" / "sudoku_extreme.json"


def one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in out + err, err
    return err


@pytest.fixture
def weights(monkeypatch):
    """``dstrain export`` with the gathering of the weights stubbed: the writing of them is what is checked."""
    import torch

    from dstrain import checkpoint
    monkeypatch.setattr(checkpoint, "consolidated_state_dict",
                        lambda ckpt: ({"w": torch.zeros(2)}, {"model": {"name": "gpt"}}))


def test_export_under_a_file_is_one_line(tmp_path, weights, capsys):
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "w.safetensors"
    assert cli.main(["export", str(tmp_path), str(out)]) == cli.EXIT_CONFIG
    assert one_line(capsys) == f"dstrain: error: export to {out}: {tmp_path / 'afile'} is a file, not a folder\n"
    assert cli.main(["export", str(tmp_path), str(tmp_path / "afile")]) == cli.EXIT_CONFIG
    assert "is a file and not a .safetensors one" in one_line(capsys)
    assert cli.main(["export", str(tmp_path), str(tmp_path / "new" / "w.safetensors")]) == 0  # still writes
    assert (tmp_path / "new" / "w.safetensors").is_file()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_nothing_can_be_created_in_is_refused_even_for_root(tmp_path, weights, capsys):
    # os.access says yes to root for /proc; the probe asks the file system itself
    assert cli.main(["export", str(tmp_path), "/proc/w.safetensors"]) == cli.EXIT_CONFIG
    assert "export to /proc/w.safetensors: nothing can be created in /proc" in one_line(capsys)
    cfg = load_run_config(TINY, ["--output.dir=/proc/dstrain_run"])
    assert cli._output_problem(cfg).startswith("output.dir /proc/dstrain_run: nothing can be created in /proc (")


def test_an_output_dir_under_a_file_says_so(tmp_path):
    (tmp_path / "afile").write_text("")
    cfg = load_run_config(TINY, [f"--output.dir={tmp_path / 'afile' / 'run'}"])
    assert cli._output_problem(cfg) == f"output.dir {tmp_path / 'afile' / 'run'}: {tmp_path / 'afile'} is a file, " \
                                       "not a folder"
    assert cli_checks.writable_problem(tmp_path / "new" / "run", "output.dir") is None
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]  # the probe leaves nothing behind


@pytest.mark.parametrize("where", ["missing/dir/hostfile", "."])
def test_hostfile_output_that_cannot_be_written_is_one_line(tmp_path, where, capsys):
    target = tmp_path / where
    assert cli.main(["hostfile", "node1", "-o", str(target)]) == cli.EXIT_CONFIG
    assert one_line(capsys).startswith(f"dstrain: error: -o {target}: cannot write it: ")


def test_ctrl_c_to_launch_is_named_in_the_stop_line_with_launchs_own_status(tmp_path, monkeypatch):
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    summary = {"stopped": True, "step": 29}
    code = 128 + signal.SIGTERM  # what the ranks exit with: launch passes SIGTERM on
    assert "by SIGTERM (exit 143, not a finished run)" in rank_exit.stop_line(summary, 300, tmp_path, code)
    rank_exit.note_forwarded(tmp_path, signal.SIGINT)
    rank_exit.note_forwarded(tmp_path, signal.SIGINT)  # a second Ctrl-C: the first is what is named
    line = rank_exit.stop_line(summary, 300, tmp_path, code)
    assert line.startswith("dstrain: stopped at step 29 of 300 by SIGINT to dstrain launch (exit 130, not a "
                           "finished run): no checkpoint was written"), line


@pytest.mark.parametrize("recipe, key", [(MBPP, "path"), (SUDOKU, "train_file")])
def test_a_task_file_that_is_a_folder_is_refused_before_any_rank_starts(recipe, key, tmp_path, capsys):
    argv = ["launch", "--nproc", "1", "--accelerator", "cpu", str(recipe), f"--task.{key}={tmp_path}", "--dry-run"]
    assert cli.main(argv) == cli.EXIT_CONFIG
    assert one_line(capsys) == (f"dstrain: error: run config: task.{key}: {tmp_path} is a folder; name the file "
                                f"itself with --task.{key}=FILE\n")


def test_the_task_readers_name_a_folder_in_one_line(tmp_path):
    from dstrain.data import sudoku, tasks
    with pytest.raises(ValueError, match="is a folder"):  # was IsADirectoryError, a traceback in every rank
        tasks.load_mbpp(str(tmp_path), "train")
    with pytest.raises(ValueError, match="is a folder, not a puzzle file"):  # was "no such puzzle file"
        sudoku.read_puzzle_file(tmp_path)


def test_a_missing_corpus_is_refused_before_any_rank_starts(capsys):
    argv = ["launch", "--nproc", "1", "--accelerator", "cpu", str(TINY), "--data.corpus=nosuch_corpus", "--dry-run"]
    assert cli.main(argv) == cli.EXIT_CONFIG
    err = one_line(capsys)
    assert err.startswith("dstrain: error: run config: data.corpus: nosuch_corpus does not exist (relative paths")
    cfg = load_run_config(TINY, [f"--data.corpus={TINY}"])
    assert "unsupported file type" in str(cli_checks.corpus_problem(cfg))


def test_a_run_config_with_comments_or_empty_says_what_it_is(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text('{\n  // my run\n  "model": {"name": "gpt", "size": "tiny"},\n}\n')
    for command in ("plan", "check-config"):
        assert cli.main([command, str(path)]) == cli.EXIT_CONFIG
        err = one_line(capsys)
        assert "run configs are plain JSON, without the comments or trailing commas" in err
        assert "top-level key" not in err  # not checked as a DeepSpeed JSON
    path.write_text("\n")
    assert cli.main(["plan", str(path)]) == cli.EXIT_CONFIG
    assert one_line(capsys) == f"dstrain: error: {path}: the file is empty; a run config is a JSON object such as " \
                               "models/gpt/recipes/tiny.json\n"


def test_a_binary_file_given_as_the_recipe_is_named(tmp_path, capsys):
    path = tmp_path / "mp_rank_00_model_states.pt"
    path.write_bytes(b"PK\x03\x04" + bytes(range(128, 256)))
    assert cli.main(["plan", str(path)]) == cli.EXIT_CONFIG
    assert one_line(capsys) == f"dstrain: error: {path}: cannot read: not UTF-8 text\n"


@pytest.mark.parametrize("flags, words", [
    (["--device-memory=0"], "device_memory must be positive, got 0 (--device-memory, deepspeed.device_memory)"),
    (["--gpus-per-node", "0", "--device-memory", "80GB"], "command line: --gpus-per-node: must be at least 1, got 0"),
])
def test_a_zero_size_given_to_plan_names_the_flag(flags, words, capsys):
    assert cli.main(["plan", str(TINY), *flags]) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert words in err and err.count("\n") == 1


@pytest.mark.parametrize("recipe, override, model", [
    (TINY, "--parallel.sp=2", "gpt"),
    (ROOT / "models" / "hrm" / "recipes" / "sudoku_debug.json", "--parallel.tp=2", "hrm"),
    (ROOT / "models" / "policy" / "recipes" / "grpo_debug.json", "--parallel.sp=2", "policy"),
])
def test_tp_or_sp_on_a_model_without_them_is_refused_when_the_config_loads(recipe, override, model):
    with pytest.raises(ConfigError) as err:
        load_run_config(recipe, [override])
    key = override[2:].split("=")[0]
    assert str(err.value).startswith(f"command line: {key}: model '{model}' has no tensor or sequence parallelism")
    assert "models that have: dilated_lm" in str(err.value)


def test_the_dilated_lm_keeps_its_sequence_parallelism():
    cfg = load_run_config(ROOT / "models" / "dilated_lm" / "recipes" / "debug.json", ["--parallel.tp=2"])
    assert (cfg.parallel.tp, cfg.parallel.sp) == (2, 2)


def test_a_deepspeed_json_given_as_the_recipe_says_how_to_name_it(capsys):
    zero3 = str(ROOT / "ds_configs" / "zero3.json")
    assert cli.main(["launch", "--nproc", "1", zero3, "--dry-run"]) == cli.EXIT_CONFIG
    err = one_line(capsys)
    assert "a DeepSpeed JSON ('train_batch_size' is one of its keys), not a run config" in err
    assert f"--deepspeed.profile={zero3}" in err


def test_a_run_config_with_a_stray_deepspeed_key_still_names_the_key(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": {"name": "gpt"}, "optimizer": {}}))
    with pytest.raises(ConfigError) as err:
        cli._load(str(path), [])
    assert str(err.value).startswith(f"{path}: optimizer: unknown key")


def test_an_empty_task_path_on_the_command_line_is_blamed_on_it():
    with pytest.raises(ConfigError) as err:
        load_run_config(MBPP, ["--task.path="])
    assert str(err.value) == "command line: task.path: task.path must name the mbpp file (or hub name) for source mbpp"


def test_resuming_a_finished_run_says_nothing_is_left_to_train(tmp_path, capsys):
    tag = tmp_path / "checkpoints" / "step_00000300"
    tag.mkdir(parents=True)
    (tag / "trainer_state.json").write_text(json.dumps({"step": 300}))
    (tag / "run_config.json").write_text(json.dumps(load_run_config(TINY).to_dict()))
    (tag / "COMPLETE").write_text("")
    argv = ["launch", "--nproc", "1", "--accelerator", "cpu", str(TINY), f"--output.dir={tmp_path}", "--dry-run",
            "--resume"]
    assert cli.main(argv) == 0
    assert (f"dstrain: note: checkpoint {tag} is at step 300, train.steps is 300: nothing is left to train; pass "
            "--train.steps=N with N above 300 to train on") in capsys.readouterr().err
    assert cli.main([*argv, "--train.steps=301"]) == 0
    assert "nothing is left to train" not in capsys.readouterr().err


@pytest.fixture
def sigint_restored():
    """SIGINT as a fresh ``dstrain`` process has it (Python's default handler), whatever an earlier test in this
    process left; put back afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
    cli_checks.INTERRUPTED.clear()


def test_ctrl_c_while_launch_plans_is_one_line_and_exit_130(monkeypatch, sigint_restored, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_checks, "check_before_launch", interrupted)
    assert cli.main(["launch", "--nproc", "1", "--accelerator", "cpu", str(TINY), "--dry-run"]) == 130
    assert one_line(capsys) == "dstrain: launch interrupted (Ctrl-C) before any rank started\n"


def test_a_ctrl_c_swallowed_while_importing_still_stops_the_launch_before_its_job(tmp_path, monkeypatch,
                                                                                 sigint_restored, capsys):
    from dstrain import job_guard

    def started(*args):
        raise AssertionError("the job was started")

    monkeypatch.setattr(job_guard, "start_job", started)
    monkeypatch.setattr(cli_checks, "check_before_launch", lambda *args: None)
    cli_checks.catch_ctrl_c()
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # (a library's bare except: would have taken this one)
    argv = ["launch", "--nproc", "1", "--accelerator", "cpu", str(TINY), f"--output.dir={tmp_path / 'run'}"]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.endswith("dstrain: launch interrupted (Ctrl-C) before any rank started\n")


def test_a_sigint_the_shell_ignores_stays_ignored(sigint_restored):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # `dstrain launch ... &` in a script
    cli_checks.catch_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_hrm_resume_on_another_number_of_ranks_is_refused_before_any_rank_starts(tmp_path, capsys):
    recipe = ROOT / "models" / "hrm" / "recipes" / "sudoku_debug.json"
    tag = tmp_path / "checkpoints" / "step_00000003"
    (tag / "rng").mkdir(parents=True)
    for rank in (0, 1):
        (tag / "rng" / f"rank_{rank}.pt").write_bytes(b"\x80")  # (a legacy pickle: not opened by the check)
    (tag / "trainer_state.json").write_text(json.dumps({"step": 3, "global_batch": 64, "world_size": 2}))
    (tag / "run_config.json").write_text(json.dumps(load_run_config(recipe).to_dict()))
    (tag / "COMPLETE").write_text("")
    argv = ["launch", "--accelerator", "cpu", str(recipe), f"--output.dir={tmp_path}", "--resume", "--dry-run"]
    assert cli.main([argv[0], "--nproc", "1", *argv[1:]]) == 2
    assert one_line(capsys) == (f"dstrain: error: checkpoint {tag} holds the ACT carry of 64 puzzles over 2 rank(s) "
                                "(each row mid-puzzle); this run has 64 over 1: resume with task.global_batch=64 on "
                                "2 rank(s), or start a new run from exported weights\n")
    assert cli.main([argv[0], "--nproc", "2", *argv[1:]]) == 0  # the checkpoint's own layout: the dry run goes on


def test_a_tilde_in_output_dir_or_a_puzzle_file_is_the_home_folder(tmp_path, monkeypatch):
    from dstrain.data import sudoku
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli._load(str(TINY), ["--output.dir=~/runs/tiny"]).output.dir == str(tmp_path / "runs" / "tiny")
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'puzzles.txt'}: no such puzzle file"):
        sudoku.read_puzzle_file("~/puzzles.txt")


def test_export_gets_the_usual_file_mode_and_replaces_a_file_only_when_complete(tmp_path, weights, monkeypatch):
    """safetensors creates its file 0600 (others on a shared machine could not load an export), and wrote straight
    into OUT: an export stopped halfway left a truncated file where a good one had been."""
    import os

    from safetensors.torch import load_file

    from dstrain import checkpoint
    out = tmp_path / "w.safetensors"
    old = os.umask(0o022)
    try:
        assert cli.main(["export", str(tmp_path), str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644
    before = out.read_bytes()

    def dies_halfway(state, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    import safetensors.torch
    monkeypatch.setattr(safetensors.torch, "save_file", dies_halfway)
    with pytest.raises(OSError):
        checkpoint.export_safetensors(tmp_path, out)
    assert out.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]
    assert load_file(str(out))["w"].shape == (2,)
