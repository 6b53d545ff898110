"""Newcomer audit, round 6: README's sections from "Models" on, their commands mistyped, each ended in one line.

Found and fixed (what a first user typed; what happened before):

* A mistyped flag of a subcommand (``dstrain launch --nprocs 2``, ``--max-restart 3``, ``--dryrun``,
  ``dstrain plan --world_size 4``, ``dstrain hostfile --slot 2``, ``dstrain bench --step 1``,
  ``launch/deepspeed.sh --nprocs 2``): "unrecognized arguments" under the usage of ``dstrain`` itself, naming no
  flag. Now under the subcommand's usage, with the flag meant (``did you mean --nproc?``).
* The same flags written with ``=`` (``--nprocs=2``, ``--world_size=4``) were read as run config overrides:
  "nprocs: name a section and a key, e.g. --train.lr=3e-4". ``--tranier=lm`` said the same. ``--steps=5``
  gave ``--train.lr=3e-4`` as its example. Now the flag, the key (``trainer``), or ``--train.steps=5``.
* ``--model.args.dilation_rates=[1,2]`` (the recipe has three segment lengths), or a segment length of 0 or one
  its rate does not divide, given on the command line: blamed on the recipe file
  (``models/dilated_lm/recipes/debug.json: model.args: ...``), which is valid. Likewise ``--task.x=1`` on a
  trainer without a task. Now ``command line: ...``.
* ``dstrain launch models/gpt/recipes`` (the folder): "cannot read: Is a directory"; ``check-config ds_configs``
  the same. Now "is a folder, not a JSON file: name a file, e.g. models/gpt/recipes/tiny.json".
* ``dstrain bench --help`` showed ``recipe bench_args`` and none of the benchmark's options
  (``--profiles``, ``--steps``, ``--nproc``...), and ``dstrain bench --steps 3 RECIPE`` was refused. Now
  ``dstrain bench`` hands everything to the benchmark's own parser, as ``benchmarks/throughput.py`` does.
* ``dstrain train models/hrm/recipes/sudoku6_cpu.json`` (and ``sudoku4_cpu.json``), 15-20 minutes on a CPU: no progress
  bar (the recipes turned it off), nothing printed between the plan and the summary. Now the bar, as elsewhere.
* ``--data.seq_len=200 --parallel.sp_mode=exchange`` on the dilated LM (README: exchange needs segments that tile),
  a non-causal length the segments do not tile, or ``--parallel.tp=3`` with 4 heads: every check passed, then
  each rank died at its first forward with a ValueError traceback. Now refused when the config loads.
* ``dstrain check-config tiny.json --parallel.pp=2 --deepspeed.profile=zero3 --world-size 2``: "valid" (a launch
  refuses ZeRO-3 with pp); without ``--world-size``: "pp 2 = 2 does not divide the 1 ranks". Now refused as the
  launch refuses it, and checked on tp x sp x pp ranks by default.
* ``kill -9`` of one rank of ``dstrain launch --nproc 2``: the survivor's exit 1 could reach DeepSpeed's launcher
  (which polls its ranks in no fixed order) before the killed rank's status: no line naming SIGKILL, exit 1, not
  137 (README: "a rank killed outright is named with its signal"). The survivor now outlives one poll.
"""
from pathlib import Path

import pytest

from dstrain import bench, cli, launcher
from dstrain.config import ConfigError, load_run_config
from models import registry

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"
DILATED = ROOT / "models" / "dilated_lm" / "recipes" / "debug.json"
registry.get_spec("dilated_lm")  # (the models' imports at collection, not in the first test's time)


def refused(capsys, argv, main=cli.main) -> str:
    """The last line of what ``main(argv)`` printed as argparse refused it (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return err


@pytest.mark.parametrize("argv, usage, hint", [
    (["launch", "--nprocs", "2", str(TINY)], "usage: dstrain launch", "--nprocs: did you mean --nproc?"),
    (["launch", str(TINY), "--max-restart", "3"], "usage: dstrain launch", "did you mean --max-restarts?"),
    (["launch", str(TINY), "--dryrun"], "usage: dstrain launch", "--dryrun: did you mean --dry-run?"),
    (["launch", str(TINY), "--nprocs=2"], "usage: dstrain launch", "--nprocs: did you mean --nproc?"),
    (["plan", str(TINY), "--world_size", "4"], "usage: dstrain plan", "did you mean --world-size?"),
    (["plan", str(TINY), "--world_size=4"], "usage: dstrain plan", "did you mean --world-size?"),
    (["hostfile", "node1", "--slot", "2"], "usage: dstrain hostfile", "--slot: did you mean --slots?"),
    (["train", str(TINY), "--resum"], "usage: dstrain train", "--resum: did you mean --resume?"),
])
def test_a_mistyped_flag_names_the_flag_meant_under_its_subcommands_usage(argv, usage, hint, capsys):
    err = refused(capsys, argv)
    assert err.startswith(usage) and hint in err.splitlines()[-1]


def test_a_flag_nothing_is_close_to_is_still_refused_without_a_guess(capsys):
    err = refused(capsys, ["launch", str(TINY), "--foo"])
    assert err.splitlines()[-1] == "dstrain launch: error: unrecognized arguments: --foo"


def test_the_shell_wrappers_and_bench_name_the_flag_meant(capsys):
    err = refused(capsys, ["--nprocs", "2", str(TINY)], launcher.main)  # launch/deepspeed.sh, torchrun.sh
    assert err.splitlines()[-1].endswith("unrecognized arguments: --nprocs (--nprocs: did you mean --nproc?)")
    err = refused(capsys, [str(TINY), "--step", "1"], bench.main)
    assert err.splitlines()[-1] == "dstrain bench: error: unrecognized argument '--step' (did you mean --steps?)"


@pytest.mark.parametrize("override, words", [
    ("--tranier=lm", "command line: tranier: unknown key (did you mean 'trainer'?)"),
    ("--steps=5", "command line: steps: name a section and a key, e.g. --train.steps=5"),
    ("--seed=3", "e.g. --data.seed=3 or --train.seed=3"),
    ("--train=5", "command line: train: name a section and a key, e.g. --train.lr=3e-4"),
])
def test_an_undotted_override_names_the_key_meant(override, words):
    with pytest.raises(ConfigError) as err:
        load_run_config(TINY, [override])
    assert words in str(err.value)


@pytest.mark.parametrize("override, words", [
    ("--model.args.dilation_rates=[1,2]", "segment_lengths [32, 64, 128] and dilation_rates [1, 2] must be"),
    ("--model.args.segment_lengths=[0,64,128]", "must be positive integers, got (0, 1)"),
    ("--model.args.segment_lengths=[32,64,126]", "segment length 126 must be a multiple of its dilation rate 4"),
    ("--task.num_generations=4", "trainer 'lm' takes no task settings"),
])
def test_an_override_that_clashes_with_a_valid_recipe_is_blamed_on_the_command_line(override, words):
    with pytest.raises(ConfigError) as err:
        load_run_config(DILATED, [override])
    assert str(err.value).startswith("command line: ") and words in str(err.value)


def test_a_recipe_whose_own_values_clash_is_still_blamed_on_the_file(tmp_path):
    recipe = tmp_path / "mine.json"
    recipe.write_text(DILATED.read_text().replace('"size": "debug"}', '"size": "debug", '
                                                  '"args": {"dilation_rates": [1, 2]}}'))
    with pytest.raises(ConfigError) as err:
        load_run_config(recipe, ["--train.steps=5"])  # an unrelated override does not take the blame
    assert str(err.value).startswith(f"{recipe}: model.args")


@pytest.mark.parametrize("argv, named", [
    (["launch", "--nproc", "1", "--dry-run", "models/gpt/recipes"], "models/gpt/recipes/tiny.json"),
    (["plan", "models/gpt"], "models/gpt/recipes/tiny.json"),
    (["check-config", "ds_configs"], "ds_configs/zero0.json"),
])
def test_a_folder_named_as_the_recipe_says_so_and_names_a_file_in_it(argv, named, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == cli.EXIT_CONFIG
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "Traceback" not in out + err
    assert f"{argv[-1]}: is a folder, not a JSON file: name a file, e.g. {named}" in err


def test_bench_help_shows_the_benchmarks_options_and_takes_them_before_the_recipe(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dstrain bench") and "--profiles" in out and "--steps" in out
    assert "--section.key=value" in " ".join(out.split())  # the run-config overrides it also takes
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--steps", "3", str(TINY), "--model.size=tiny"]) == 0
    assert seen == [["--steps", "3", str(TINY), "--model.size=tiny"]]


@pytest.mark.parametrize("recipe", sorted(ROOT.glob("models/*/recipes/*.json")), ids=lambda p: p.name)
def test_every_shipped_recipe_shows_its_progress(recipe):
    # the HRM CPU recipes (README: 15-20 minutes) had the bar off: nothing on the terminal between the plan and the end
    assert load_run_config(recipe).output.progress


def _fail_in_a_rank(err: BaseException, monkeypatch, tmp_path) -> list[float]:
    """``cli._rank_failed`` as a started rank calls it while ``err`` is raised; the sleeps it took."""
    import time
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(cli, "_TRAIN_STARTED", True)
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    try:
        raise err
    except RuntimeError:
        assert cli._rank_failed() == 1
    return slept


def test_a_rank_that_lost_its_peer_outlives_the_launchers_poll(tmp_path, monkeypatch, capsys):
    # kill -9 of one rank: DeepSpeed's launcher polls its ranks once a second in no fixed order and returns the first
    # failed status it finds; the survivor's exit 1, found first, hid the SIGKILL (no line, launch exit 1, not 137)
    err = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11655: "
                       "Connection reset by peer")
    slept = _fail_in_a_rank(err, monkeypatch, tmp_path)
    assert sum(slept) > 2 * 1.0  # DeepSpeed's launcher: time.sleep(1) between polls
    assert "lost contact with the job" in capsys.readouterr().err
    assert _fail_in_a_rank(RuntimeError("a bug of its own"), monkeypatch, tmp_path / "x") == []  # no wait


@pytest.mark.parametrize("overrides, key, words", [
    (["--data.seq_len=200", "--parallel.sp_mode=exchange"], "parallel.sp_mode",
     "sequence-parallel mode exchange impossible: the segments do not tile a sequence of 200 tokens"),
    (["--data.seq_len=200", "--model.args.causal=false"], "data.seq_len",
     "branch (segment 32, dilation 1) does not tile a sequence of 200 tokens"),
    (["--data.seq_len=200", "--parallel.sp=1", "--model.args.causal=false"], "data.seq_len", "does not tile"),
    (["--parallel.tp=3", "--parallel.sp=1"], "parallel.tp", "n_head 4 is not divisible by tp = 3"),
])
def test_a_dilated_layout_the_layers_would_refuse_is_refused_when_the_config_loads(overrides, key, words):
    # README (Long sequences): "the exchange mode needs segments that tile"; such a run passed every check and each
    # rank died at its first forward with a ValueError traceback from dstrain/parallel/sequence.py
    with pytest.raises(ConfigError) as err:
        load_run_config(DILATED, overrides)
    assert str(err.value).startswith(f"command line: {key}: ") and words in str(err.value)


@pytest.mark.parametrize("overrides", [[], ["--data.seq_len=200"], ["--data.seq_len=200", "--parallel.sp=1"],
                                       ["--parallel.tp=2", "--parallel.sp_mode=ulysses"]])
def test_the_dilated_layouts_that_run_still_load(overrides):
    # a causal length the segments do not tile is padded (ulysses under sp), as the README says
    assert load_run_config(DILATED, overrides).data.seq_len in (128, 200)


@pytest.mark.parametrize("profile, ok", [("zero3", False), ("zero2", False), ("zero1", True)])
def test_check_config_refuses_what_a_pipelined_launch_refuses(profile, ok, capsys):
    # it called pp 2 with zero3 "valid" (a launch refuses it), and without --world-size checked pp 2 on 1 rank
    code = cli.main(["check-config", str(TINY), "--parallel.pp=2", f"--deepspeed.profile={profile}"])
    out, err = capsys.readouterr()
    if ok:
        assert code == 0 and out == f"{TINY}: valid run config with zero1 on 2 rank(s)\n", err
    else:
        assert code == cli.EXIT_CONFIG and f"ZeRO stage {profile[-1]} cannot run with pipeline parallelism" in err
