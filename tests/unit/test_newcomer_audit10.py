"""Newcomer audit, round 10: the first hour, verbatim. README.md read top to bottom and each command of it run as
printed on a 2-core CPU machine (quick start, plan, check-config, export, resume, launch on 1 and 2 ranks, with a
hostfile, through torchrun and through launch/slurm.sbatch, the model recipes at their debug sizes), TensorBoard's
event files read back with its EventAccumulator, and the mistakes a first user makes on the way.

Found and fixed (what a first user typed; what happened before; what happens now):

* ``nohup dstrain launch --nproc 2 models/gpt/recipes/tiny.json > train.log 2>&1`` (or the same under SLURM, whose
  ``--output`` is a file, or piped to ``tee``): README promises a progress bar on rank 0. tqdm redrew its bar with
  a carriage return at every step, which the log file keeps: the 300-step quick start left one 34 KB line of 300
  bars (``sudoku_extreme``'s 52,000 steps: megabytes), unreadable with ``less`` or ``tail``. Now, where stderr is
  not a terminal, the bar is plain lines: one when training starts, at most one every 30 s, and one at the end
  with the last loss (``train: 120/300 steps (40%), 5.51 step/s, 0:00:33 left, loss=2.2467``). On a terminal
  the bar is tqdm's, as before. README's TensorBoard list said tokens/s and FLOP/s were "averaged over ranks"
  (they are the whole job's: 14,600 tokens/s at 7 steps/s of 2 x 8 x 128 tokens) and named no tag; now it says
  which figures are averaged and which are the job's, with the tags EventAccumulator reads back.
  HRM's ``sudoku_debug.json`` stops at ``task.time_limit_s`` (840 s) but its line said "1:51:13 left"
  (5000 steps at 1.35 s): now the time left is the limit's where that comes first, and says so.
* ``dstrain launch --nproc 2 models/policy/recipes/grpo_debug.json``: transformers' own bars, "Writing model
  shards" (rank 0's warm-start folder) and "Loading weights" (policy and reference, on each rank: four), drawn
  between the plan and dstrain's progress, carriage returns and all. Now off for dstrain's loads and saves (the
  user's transformers setting is put back after each).
* Ctrl-C to ``dstrain launch --nproc 2 models/policy/recipes/score_debug.json`` during "policy warm start
  120/300" (rank 0's supervised phase, before the RL steps): nothing happened. The signal was kept for the first
  RL step, after both warm starts (over 3 minutes on 2 loaded cores; ``score_selfcorrect_cpu.json``'s 2400 + 3600
  steps far longer), so a user pressed Ctrl-C again, which kills the job. Likewise the SIGTERM of a scheduler, or
  of the job's guard when the launch was killed outright: the warm start trained on, unattended (README: "no rank
  trains on unattended"). Now it ends at the next warm-start step: every rank exits 128 + N, rank 0 with one line
  (``dstrain: stopped in the warm start at step 3 of 150 by SIGINT to dstrain launch (exit 130, not a finished
  run): the warm start is not saved; a launch into runs/... (--resume too) starts it again``).
* ``dstrain launch --nproc 2 models/gpt/recipes/tine.json`` (a typo in the recipe path): "cannot read: No such
  file or directory". Now ``(did you mean models/gpt/recipes/tiny.json?)`` where each missing part of the path
  is close to one name beside it (``models/gpt/recipe/tiny.json`` too); nothing added where nothing is close.
* ``dstrain launch --nproc 3 models/gpt/recipes/tiny.json`` on a 2-core machine: three ranks started without a
  word (one OpenMP thread each, taking turns on two cores), every step slower than with ``--nproc 2``. Allowed
  still (README's resume example runs 4 CPU ranks), but now one note line says so before the command.
* ``SLURM_JOB_ID=1 ... bash launch/slurm.sbatch models/gpt/recipes/tiny.json`` (the script run by hand with the
  allocation's variables set, on a machine without SLURM): bash's ``line 70: srun: command not found``, exit 127.
  Now one line saying to submit it with sbatch, or to use ``dstrain launch`` on one machine, exit 2.
* README's checkpoint-stall figures (3.9 s / 1.1 s a save) named the script but not the command, the result file or
  the machine; now all three, read from ``benchmarks/results/checkpoint_stall_cpu.json`` (no figure changed).

Run as README prints them and found as it says (no change): ``dstrain plan ... --model.size=xl --world-size 64
--device-memory 80GB``, ``check-config ds_configs/zero3.json``, ``export``, ``--resume`` on a finished run (the
note), ``--nproc 1``, ``--launcher torchrun``, a hostfile naming localhost (no ssh needed), mistyped overrides
(``--train.stpes``, ``--trian.steps``, ``--train.steps 500``), wrong types (``--train.steps=1.5``,
``--train.micro_batch=abc``, ``--nproc two``), an unresolvable or unreachable host in a hostfile, Ctrl-C (SIGINT
to the launch: checkpoint, exit 130) on the HRM, dilated, GRPO and SCoRe debug recipes, whose TensorBoard tags are
the ones their READMEs list.
"""
import io
import os
import subprocess
from pathlib import Path

# transformers is imported here, as tests/hf_checkpoints.py does (seconds): not inside a test's own time
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from dstrain import cli, launch_check, launcher, metrics
from models.policy.config import PolicyConfig
from models.policy.model import build_policy

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_progress_bar_in_a_log_file_is_a_few_plain_lines():
    # 300 steps over 75 s (the quick start on 2 CPU ranks), a loss every 10 steps, written to a file
    clock, out = _Clock(), io.StringIO()
    bar = metrics.LineProgress(300, 0, out, clock=clock)
    for step in range(1, 301):
        clock.t += 0.25
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{5 - step / 100:.4f}", refresh=False)
    bar.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert lines[0] == "train: 0/300 steps (0%)"
    assert lines[1:] == ["train: 120/300 steps (40%), 4 step/s, 0:00:45 left, loss=3.9000",  # one every 30 s
                         "train: 240/300 steps (80%), 4 step/s, 0:00:15 left, loss=2.7000",
                         "train: 300/300 steps (100%), 4 step/s, 0:00:00 left, loss=2.0000"]  # and the last loss


def test_a_resumed_runs_progress_lines_count_from_the_checkpoint():
    clock, out = _Clock(), io.StringIO()
    bar = metrics.LineProgress(600, 300, out, every_s=30, clock=clock)
    for _ in range(20):
        clock.t += 2.0
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "train: 300/600 steps (50%)"
    assert lines[1] == "train: 315/600 steps (52%), 2 s/step, 0:09:30 left"  # the rate of this run's steps only
    assert lines[-1].startswith("train: 320/600 steps (53%), 2 s/step, ")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_run_logger_draws_tqdm_on_a_terminal_and_lines_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.sys, "stderr", io.StringIO())
    log = metrics.RunLogger(tmp_path, 0, 3, tensorboard=False, progress=True)
    assert isinstance(log.bar, metrics.LineProgress)
    log.advance()
    log.log(1, {"loss": 4.25})
    log.message("dstrain: note: a message between the progress lines")
    log.advance(2)
    log.close()
    text = metrics.sys.stderr.getvalue()
    assert "\r" not in text and text.splitlines()[-1].startswith("train: 3/3 steps (100%)")
    assert text.splitlines()[-1].endswith("loss=4.2500")
    assert "dstrain: note: a message between the progress lines\n" in text
    from tqdm import tqdm
    bar = metrics.progress_bar(3, 0, _Tty())
    assert isinstance(bar, tqdm)
    bar.close()


def test_more_cpu_ranks_than_cores_get_one_note_before_the_launch(tmp_path, capsys, monkeypatch):
    spec = launcher.LaunchSpec(recipe=str(TINY), nproc=3)
    note = launch_check.cpu_cores_note(spec, False, "cpu", cpus=2)
    assert note.startswith("3 CPU ranks on this machine's 2 core(s)") and "--nproc 2" in note
    assert launch_check.cpu_cores_note(launcher.LaunchSpec(recipe=str(TINY), nproc=2), False, "cpu", cpus=2) is None
    assert launch_check.cpu_cores_note(spec, False, "cuda", cpus=2) is None  # GPU ranks: gpu_shortfall's
    assert launch_check.cpu_cores_note(spec, True, "cpu", cpus=2) is None  # ranks on other hosts
    from dstrain import cli_checks
    monkeypatch.setattr(cli_checks, "check_before_launch", lambda *a, **k: None)  # the plan's checks: seconds
    monkeypatch.setattr(launcher, "available_cpus", lambda: 2)
    argv = ["launch", "--nproc", "3", "--accelerator", "cpu", str(TINY), f"--output.dir={tmp_path / 'run'}", "--dry-run"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0
    assert [line for line in err.splitlines() if "core" in line] == [f"dstrain: note: {note}"]
    monkeypatch.setattr(launcher, "available_cpus", lambda: 4)
    assert cli.main(argv) == 0
    assert "core" not in capsys.readouterr().err


def test_the_slurm_script_by_hand_without_srun_says_what_to_do(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_JOB_NODELIST="localhost", PATH=str(tmp_path))
    bash = next(p for p in ("/bin/bash", "/usr/bin/bash") if os.path.exists(p))
    done = subprocess.run([bash, str(ROOT / "launch" / "slurm.sbatch"), "models/gpt/recipes/tiny.json"],
                          env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "command not found" not in done.stderr
    assert done.stderr.startswith("slurm.sbatch: srun is not on PATH: run this script inside a SLURM job")


def test_the_time_left_is_the_time_limits_where_that_comes_first():
    # sudoku_debug.json: 5000 steps at about 1.35 s a step, but task.time_limit_s 840: the run ends after 14 minutes,
    # where the line said "1:51:13 left"
    clock, out = _Clock(), io.StringIO()
    bar = metrics.LineProgress(5000, 0, out, clock=clock, time_limit_s=840)
    for _ in range(24):
        clock.t += 1.25
        bar.update(1)
    assert out.getvalue().splitlines()[-1] == "train: 24/5000 steps (0%), 1.25 s/step, 0:13:30 left (the time limit)"
    clock, out = _Clock(), io.StringIO()
    bar = metrics.LineProgress(100, 0, out, clock=clock, time_limit_s=840)
    for _ in range(24):
        clock.t += 1.25
        bar.update(1)
    assert out.getvalue().splitlines()[-1] == "train: 24/100 steps (24%), 1.25 s/step, 0:01:35 left"


def test_a_mistyped_recipe_path_names_the_file_meant(capsys, monkeypatch):
    # `dstrain launch --nproc 2 models/gpt/recipes/tine.json`: "cannot read: No such file or directory", nothing more
    monkeypatch.chdir(ROOT)
    assert cli.main(["launch", "--nproc", "2", "models/gpt/recipes/tine.json"]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err == ("dstrain: error: models/gpt/recipes/tine.json: cannot read: No such file or "
                                       "directory (did you mean models/gpt/recipes/tiny.json?)\n")
    assert cli.main(["plan", "models/gpt/recipe/tiny.json"]) == cli.EXIT_CONFIG  # a folder mistyped on the way
    assert "(did you mean models/gpt/recipes/tiny.json?)" in capsys.readouterr().err
    assert cli.main(["plan", "models/gpt/recipes/nothing_like_it.json"]) == cli.EXIT_CONFIG  # nothing close: no guess
    assert capsys.readouterr().err.endswith("cannot read: No such file or directory\n")


def test_loading_or_saving_a_hugging_face_policy_draws_no_bar_of_its_own(tmp_path, capfd):
    # `dstrain launch --nproc 2 models/policy/recipes/grpo_debug.json`: rank 0 saved the warm start's folder
    # ("Writing model shards: 100%|...| 1/1"), then each rank loaded the policy and the reference from it
    # ("Loading weights: 100%|...| 21/21" four times), each a carriage-return bar, before dstrain's own progress
    tiny = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(tiny).save_pretrained(tmp_path)
    hf_logging.enable_progress_bar()
    capfd.readouterr()
    policy = build_policy(PolicyConfig(path=str(tmp_path)))
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err
    assert hf_logging.is_progress_bar_enabled()  # the user's own setting is put back
    from models.policy.reference import save_pretrained
    save_pretrained(policy, str(tmp_path / "again"))  # the warm start's folder, rank 0's "Writing model shards"
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err and (tmp_path / "again" / "config.json").is_file()
    assert hf_logging.is_progress_bar_enabled()


def test_a_stop_during_the_warm_start_ends_it_at_the_next_step(tmp_path, monkeypatch, capsys):
    # `dstrain launch --nproc 2 models/policy/recipes/score_debug.json`, Ctrl-C during "policy warm start 120/300":
    # nothing happened; the signal was kept for the first RL step, after both warm starts (minutes on 2 cores;
    # score_selfcorrect_cpu.json's 2400 + 3600 steps: much longer), and the user's second Ctrl-C killed the job.
    from dstrain import rank_exit
    from dstrain.config import load_run_config
    from dstrain.trainers import policy_rl, task_config
    cfg = load_run_config(ROOT / "models" / "policy" / "recipes" / "grpo_debug.json",
                          [f"--output.dir={tmp_path / 'run'}"])
    task = task_config(cfg)
    steps = []

    def step(model, opt, tokenizer, batch):
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            rank_exit.PENDING_STOP[0] = 2  # Ctrl-C reaches rank 0 during its third step
        return 1.0
    monkeypatch.setattr(policy_rl, "supervised_step", step)
    monkeypatch.setattr(rank_exit, "PENDING_STOP", [0])
    monkeypatch.delenv("DSTRAIN_FAILURE_DIR", raising=False)
    world = policy_rl.runtime.World(0, 1, 0, 1, policy_rl.torch.device("cpu"))
    try:
        policy_rl.warm_start(cfg, task, [None], world, tmp_path / "run", log=lambda line: None)
    except rank_exit.StoppedBeforeTraining as err:
        stopped = err
    else:
        raise AssertionError("the warm start ran to its end")
    assert steps == [1, 2, 3] and stopped.exit_code == 130
    assert str(stopped) == (f"stopped in the warm start at step 3 of {task.warm_start_steps} by SIGINT "
                            f"(exit 130, not a finished run): the warm start is not saved; a launch into "
                            f"{tmp_path / 'run'} (--resume too) starts it again")
    assert not (tmp_path / "run" / policy_rl.WARM_START_DIR / policy_rl.WARM_START_DONE).exists()
    assert rank_exit.PENDING_STOP[0] == 2  # (a rank's exit status, 128 + SIGINT, comes from it)


def test_the_warm_start_stop_is_one_line_and_the_stops_status(tmp_path, monkeypatch, capsys):
    from dstrain import rank_exit, trainers

    class Stopped:
        @staticmethod
        def train(cfg):
            raise rank_exit.StoppedBeforeTraining("stopped in the warm start at step 3 of 150 by SIGTERM (exit 143, "
                                                  "not a finished run): ...", 143)
    monkeypatch.setattr(trainers, "get_trainer", lambda name: Stopped)
    monkeypatch.setenv("DSTRAIN_FAILURE_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    code = cli.main(["train", str(ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"),
                     f"--output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 143 and err == "dstrain: stopped in the warm start at step 3 of 150 by SIGTERM (exit 143, not a " \
                                  "finished run): ...\n"
    assert rank_exit.stopped_code(tmp_path) == 143  # what dstrain launch returns
