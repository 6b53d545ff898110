"""Adversarial inputs, round 2: data files, checkpoints and the environment, as a user hands them to ``dstrain``.

Inputs tried by hand through ``dstrain train`` / ``launch`` / ``export`` (one rank): a corpus that is empty, one byte,
binary (NUL bytes, invalid UTF-8), one 20 MB line, a folder with no .txt/.py/.md file, a folder holding a symlink
to itself, a symlink loop, an unreadable file; Sudoku files with short rows, non-digits, repeated puzzles, fewer
puzzles than the batch, binary bytes; MBPP/GSM8K files with a malformed line, a missing field, wrong types, an
empty or huge test list; checkpoints with a zero-byte shard, no ``latest``, a ``latest`` naming a missing tag or
garbage, another model shape; output.dir a file, under a file, under /proc; WORLD_SIZE / LOCAL_RANK / MASTER_PORT
set by hand; CUDA_VISIBLE_DEVICES="" with GPU-only options.

Already refused in one line (exit 2), or harmless: empty and one-byte corpora, a one-line corpus, a folder with
no matching files, a folder with a symlink to itself (``rglob`` does not follow it); short rows and non-digits
in a puzzle file; a malformed MBPP line or a missing field; a checkpoint whose ``latest`` is gone, names a
missing tag or holds garbage (``COMPLETE`` markers decide, ``latest`` is for DeepSpeed's tools), a zero-byte
shard or another model shape for ``--resume``; output.dir a file or under one; MASTER_PORT=abc; fp16 on CPU.

Found and fixed here (before -> now):
* a binary corpus file (NUL bytes) or one mostly not UTF-8 (Latin-1): trained on as U+FFFD-ridden text, or
  ``datasets``' SchemaInferenceError traceback (all NUL) -> refused naming the file and offset, by ``dstrain
  launch`` before any rank starts too; an unreadable file: ``datasets``' PermissionError traceback -> named.
* a corpus whose training or validation stream holds no window of ``data.seq_len + 1`` tokens: the sampler's
  ValueError traceback (for a short validation stream, only after the whole run, at the final evaluation) ->
  refused at start naming both numbers; a symlink loop as data.corpus: "does not exist" -> says what it is.
* a Sudoku file that repeats a puzzle: trained on twice, or held out and trained on (every puzzle of a file of
  repeats) -> refused naming both lines; an eval_file sharing puzzles with train_file -> refused; fewer
  puzzles x (augmentations + 1) than task.global_batch: each batch repeated one sample -> refused; a binary
  file: "task.eval_file: 'utf-8' codec can't decode byte 0xff" (no file, wrong key) -> the file and line.
* an unreadable puzzle or MBPP/GSM8K file: PermissionError traceback -> named, with the fix.
* MBPP ``test_list`` a string: each character became a test, in silence; a list of numbers / ``code`` null:
  AttributeError traceback; GSM8K ``answer`` a number: TypeError traceback -> refused naming record and field.
* ``dstrain export`` of a checkpoint with a zero-byte (or cut) shard: EOFError traceback; a garbled
  run_config.json: json's message without the file -> the damage named, and the checkpoint before to export.
* WORLD_SIZE=abc: ValueError traceback; WORLD_SIZE=0, or WORLD_SIZE=2 without RANK: one rank trained in silence;
  LOCAL_RANK at or past LOCAL_WORLD_SIZE (or past the GPUs seen) -> refused naming the variable.
* ``--accelerator cuda`` (or DS_ACCELERATOR=cuda) where torch sees no GPU (``CUDA_VISIBLE_DEVICES=""``): the ranks
  trained on the CPU without a word -> refused before launch.

Left as it is: an MBPP test list so long that the prompt runs far past the model's positions still reaches
generation (it ran out of memory there); see the round's report.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dstrain import cli
from dstrain.config import ConfigError, LaunchError, load_run_config

GPT = "models/gpt/recipes/tiny.json"


def _launch_refusal(capsys, *args) -> str:
    """``dstrain launch --dry-run`` refuses with exit 2 and one line, before it prints any command."""
    code = cli.main(["launch", "--nproc", "1", "--dry-run", "--no-ssh-check", *args])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("dstrain: error:")]
    assert code == cli.EXIT_CONFIG and out == "" and len(lines) == 1, (code, out, err)
    return lines[0]


# ---------------------------------------------------------------- corpora

@pytest.mark.parametrize("content, words", [
    (b"\x00\xff\xfeabc\x00\n\n" * 60, "is binary (a NUL byte at offset 0)"),
    (b"caf\xe9 au lait\n\n" * 40, "is not UTF-8 text (40 undecodable bytes"),
])
def test_a_binary_or_non_utf8_corpus_is_refused_before_any_rank(tmp_path, capsys, content, words):
    from dstrain.data.corpus import load_documents
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(content)
    line = _launch_refusal(capsys, GPT, f"--data.corpus={corpus}", f"--output.dir={tmp_path / 'run'}")
    assert "data.corpus" in line and str(corpus) in line and words in line
    with pytest.raises(ValueError, match="is binary|is not UTF-8"):  # the rank's own reader says the same
        load_documents(str(corpus))
    folder = tmp_path / "docs"  # one bad file in a folder of good ones
    folder.mkdir()
    for i in range(3):
        (folder / f"{i}.md").write_text("text " * 50)
    (folder / "z.txt").write_bytes(content)
    with pytest.raises(ValueError, match="z.txt"):
        load_documents(str(folder))
    assert not (tmp_path / "run").exists()
    corpus.write_bytes(("plain text " * 100 + "\n\n").encode() * 30 + b"one stray byte \xe9\n")  # a few: read
    docs = load_documents(str(corpus), cache_dir=str(tmp_path / "cache"))
    assert len(docs) == 31 and "\ufffd" in docs[-1]


def test_an_unreadable_corpus_file_is_named(tmp_path, capsys, monkeypatch):
    from dstrain.data import corpus as corpus_mod
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n\n" * 40)
    corpus.chmod(0)
    if os.geteuid() == 0:  # root reads a mode-000 file: the refusal open() gives anyone else, by hand
        real_open = open

        def refusing_open(path, *args, **kwargs):
            if str(path) == str(corpus):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr(corpus_mod, "open", refusing_open, raising=False)
    try:
        with pytest.raises(ValueError, match=r"cannot be read \(Permission denied\); make it readable"):
            corpus_mod.load_documents(str(corpus))
        line = _launch_refusal(capsys, GPT, f"--data.corpus={corpus}", f"--output.dir={tmp_path / 'run'}")
        assert "cannot be read" in line and str(corpus) in line
    finally:
        corpus.chmod(0o644)


def test_a_symlink_loop_as_the_corpus_says_what_it_is(tmp_path, capsys):
    loop = tmp_path / "a"
    loop.symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(loop)
    line = _launch_refusal(capsys, GPT, f"--data.corpus={loop}", f"--output.dir={tmp_path / 'run'}")
    assert "is a symbolic link to nothing (a loop, or its target is gone)" in line


@pytest.mark.parametrize("paragraph, stream", [
    ("short para {i:02d}", "validation stream (every 20th document) holds 28 tokens"),  # the train stream: 532
    ("p", "training stream (the documents) holds 76 tokens"),
])
def test_a_corpus_too_short_for_one_window_is_refused_at_start(tmp_path, one_rank, paragraph, stream):
    """Before, the sampler's traceback: at the start for the training stream, after the whole run (the final
    evaluation) for the validation stream."""
    from dstrain.trainers.lm import load_token_streams
    corpus = tmp_path / "short.txt"
    corpus.write_text("".join(paragraph.format(i=i) + "\n\n" for i in range(40)))
    seq_len = 128
    cfg = load_run_config(GPT, [f"--data.corpus={corpus}", f"--output.dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as info:
        load_token_streams(cfg, one_rank)
    assert info.value.key == "data.corpus" and stream in str(info.value)
    assert f"fewer than data.seq_len + 1 = {seq_len + 1}" in str(info.value) and "\n" not in str(info.value)
    cfg.data.seq_len = 3
    train, val = load_token_streams(cfg, one_rank)
    assert len(train) >= 4 and len(val) >= 4


# ---------------------------------------------------------------- Sudoku files

def _puzzle_lines(n: int, seed: int = 0) -> list[str]:
    from dstrain.data import sudoku
    puzzles, _ = sudoku.generate_many(n, 30, seed=seed)
    return ["".join(map(str, p)) for p in puzzles]


def _sudoku_task(train, **kw):
    from dstrain.trainers.hrm_config import HRMTaskConfig
    return HRMTaskConfig(source="file", train_file=str(train), train_puzzles=20, eval_puzzles=2, **kw)


def test_a_puzzle_file_that_repeats_a_puzzle_is_refused(tmp_path):
    """30 copies of one puzzle held out 2 and trained on 28: the held-out puzzle was the trained one."""
    from dstrain.trainers.hrm import load_sudoku
    lines = _puzzle_lines(6)
    path = tmp_path / "puzzles.txt"
    path.write_text("\n".join([*lines[:4], "# a comment", lines[1], *lines[4:]]) + "\n")
    with pytest.raises(ConfigError) as info:
        load_sudoku(_sudoku_task(path), seed=0)
    assert info.value.key == "task.train_file"
    assert f"{path}:6: repeats the puzzle of line 2" in str(info.value)
    path.write_text("\n".join(lines) + "\n")
    assert [len(a) for a in load_sudoku(_sudoku_task(path), seed=0)] == [4, 4, 2, 2]


def test_an_eval_file_sharing_puzzles_with_the_train_file_is_refused(tmp_path):
    from dstrain.trainers.hrm import load_sudoku
    lines = _puzzle_lines(12)
    train, held = tmp_path / "train.txt", tmp_path / "eval.txt"
    train.write_text("\n".join(lines[:10]) + "\n")
    held.write_text("\n".join([lines[3], lines[11]]) + "\n")
    with pytest.raises(ConfigError) as info:
        load_sudoku(_sudoku_task(train, eval_file=str(held)), seed=0)
    assert info.value.key == "task.eval_file" and "shares 1 puzzle(s) with task.train_file" in str(info.value)


def test_fewer_training_samples_than_the_batch_are_refused(tmp_path):
    from dstrain.trainers.hrm import load_sudoku
    path = tmp_path / "puzzles.txt"
    path.write_text("\n".join(_puzzle_lines(5)) + "\n")  # 2 held out, 3 to train on
    with pytest.raises(ConfigError) as info:
        load_sudoku(_sudoku_task(path), seed=0, global_batch=8)
    assert info.value.key == "task.train_file"
    assert "3 training puzzle(s) x 1 (task.augmentations + 1) = 3 samples, fewer than task.global_batch=8" \
        in str(info.value)
    assert len(load_sudoku(_sudoku_task(path, augmentations=2), seed=0, global_batch=8)[0]) == 3  # 9 samples
    from dstrain.trainers.hrm_config import HRMTaskConfig
    with pytest.raises(ConfigError, match="task.train_puzzles"):
        load_sudoku(HRMTaskConfig(source="generate", grid=4, blanks=4, train_puzzles=4, eval_puzzles=2),
                    seed=0, global_batch=8)


def test_a_binary_puzzle_file_names_the_file_and_line(tmp_path):
    from dstrain.data import sudoku
    from dstrain.trainers.hrm import load_sudoku
    path = tmp_path / "puzzles.txt"
    path.write_bytes(("\n".join(_puzzle_lines(3)) + "\n").encode() + b"\xff\xfe\x00bin\n")
    with pytest.raises(ConfigError) as info:
        load_sudoku(_sudoku_task(path), seed=0)
    assert info.value.key == "task.train_file"
    assert f"{path}:4: not UTF-8 text (byte 0xff at column 1)" in str(info.value)
    line = _puzzle_lines(1)[0]  # the reader decodes the bytes itself now: ids, ratings, '.', comments, CRLF read
    path.write_bytes(f"# header\r\nid1 {line.replace('0', '.')}  7.2\r\n\r\n".encode())
    puzzles, solutions = sudoku.read_puzzle_file(path)
    assert puzzles.shape == (1, 81) and np.array_equal(puzzles[0], np.array([int(c) for c in line]))
    assert sudoku.is_solution(solutions[0])


# ---------------------------------------------------------------- MBPP and GSM8K files

def _mbpp_row(task_id=601, **changes) -> dict:
    row = {"task_id": task_id, "text": "Write a function that adds one.", "code": "def f(x):\n    return x + 1",
           "test_list": ["assert f(1) == 2", "assert f(2) == 3"], "test_setup_code": "", "challenge_test_list": []}
    return {**row, **changes}


@pytest.mark.parametrize("changes, words", [
    ({"test_list": "assert f(1) == 2"}, "field 'test_list' must be a list of strings, got str"),
    ({"test_list": [1, 2]}, "field 'test_list' must be a list of strings, got a list holding int"),
    ({"code": None}, "field 'code' must be a string, got NoneType"),
    ({"text": ["a", "list"]}, "field 'text' must be a string, got list"),
    ({"test_list": []}, "field 'test_list' is empty; a code task needs at least one test"),
])
def test_an_mbpp_record_of_the_wrong_types_is_named(tmp_path, changes, words):
    from dstrain.data.tasks import load_mbpp
    from dstrain.trainers.policy_rl import load_task_sets
    from dstrain.trainers.grpo_config import PolicyTaskConfig
    path = tmp_path / "mbpp.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (_mbpp_row(), _mbpp_row(602, **changes))) + "\n")
    with pytest.raises(ValueError, match="MBPP record '602': " + words.replace("(", r"\(").replace(")", r"\)")):
        load_mbpp(str(path), "train")
    with pytest.raises(ConfigError) as info:  # what a rank prints: one line naming task.path
        load_task_sets(PolicyTaskConfig(source="mbpp", path=str(path), n_eval=1), seed=0)
    assert info.value.key == "task.path" and words in str(info.value)
    path.write_text(json.dumps(_mbpp_row()) + "\n")
    assert load_mbpp(str(path), "train")[0].tests == ("assert f(1) == 2", "assert f(2) == 3")


def test_a_gsm8k_record_of_the_wrong_types_is_named(tmp_path):
    from dstrain.data.tasks import load_gsm8k
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}, {"question": "And 2 + 2?", "answer": 4}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match=r"row 1:.*field 'answer' must be a string, got int"):
        load_gsm8k(str(path))
    rows[1] = {"question": None, "answer": "#### 4"}
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(ValueError, match="field 'question' must be a string, got NoneType"):
        load_gsm8k(str(path))


def _unreadable(monkeypatch, path, module=None):
    """``path`` made unreadable: mode 000, and for root (who reads it anyway) the refusal its reader would get."""
    path.chmod(0)
    if os.geteuid() != 0:
        return

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    if module is not None:  # the module's own open()
        real_open = open
        monkeypatch.setattr(module, "open", lambda p, *a, **k: refuse() if str(p) == str(path) else
                            real_open(p, *a, **k), raising=False)
    else:  # Path.read_text
        import pathlib
        real = pathlib.Path.read_text
        monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: refuse() if str(self) == str(path)
                            else real(self, *a, **k))


def test_unreadable_puzzle_and_task_files_are_one_line(tmp_path, monkeypatch):
    """Before, PermissionError tracebacks (the readers caught only a missing or malformed file)."""
    from dstrain.data import sudoku
    from dstrain.trainers.grpo_config import PolicyTaskConfig
    from dstrain.trainers.hrm import load_sudoku
    from dstrain.trainers.policy_rl import load_task_sets
    puzzles, mbpp = tmp_path / "puzzles.txt", tmp_path / "mbpp.jsonl"
    puzzles.write_text("\n".join(_puzzle_lines(4)) + "\n")
    mbpp.write_text(json.dumps(_mbpp_row()) + "\n")
    _unreadable(monkeypatch, puzzles, sudoku)
    _unreadable(monkeypatch, mbpp)
    try:
        with pytest.raises(ConfigError) as info:
            load_sudoku(_sudoku_task(puzzles), seed=0)
        assert info.value.key == "task.train_file"
        assert f"{puzzles}: cannot be read (Permission denied); make it readable" in str(info.value)
        with pytest.raises(ConfigError) as info:
            load_task_sets(PolicyTaskConfig(source="mbpp", path=str(mbpp), n_eval=1), seed=0)
        assert info.value.key == "task.path"
        assert f"{mbpp}: cannot be read (Permission denied); make it readable" in str(info.value)
    finally:
        puzzles.chmod(0o644)
        mbpp.chmod(0o644)


# ---------------------------------------------------------------- checkpoints for export

def _zero0_checkpoint(out):
    import torch

    from tests.unit.conftest import tiny_checkpoint
    tag_dir = tiny_checkpoint(out, 2)
    (tag_dir / "ds_config.json").write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    torch.save({"module": {"w": torch.ones(2)}}, tag_dir / "mp_rank_00_model_states.pt")
    return tag_dir


def test_export_of_a_damaged_checkpoint_is_one_line(tmp_path, capsys):
    tag_dir = _zero0_checkpoint(tmp_path / "run")
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "good.safetensors")]) == 0
    capsys.readouterr()
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"")  # a disk that filled, a copy cut short
    target = tmp_path / "w.safetensors"
    target.write_bytes(b"the user's earlier export")
    assert cli.main(["export", str(tmp_path / "run"), str(target)]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dstrain: error: checkpoint {tag_dir} is damaged (mp_rank_00_model_states.pt")
    assert "\n" not in err and target.read_bytes() == b"the user's earlier export"
    _zero0_checkpoint(tmp_path / "run2")
    (tmp_path / "run2" / "checkpoints" / "step_00000002" / "run_config.json").write_text("{")
    assert cli.main(["export", str(tmp_path / "run2"), str(target)]) == cli.EXIT_CONFIG
    assert "is damaged (run_config.json: JSONDecodeError" in capsys.readouterr().err


# ---------------------------------------------------------------- the environment

@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 in this rank's environment: a job has at least one rank"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
    ({"LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=5 with 2 rank(s) on this node"),
    ({"LOCAL_SIZE": "abc"}, "LOCAL_SIZE='abc' in this rank's environment is not a whole number"),
])
def test_launcher_variables_set_by_hand_are_checked(env, words):
    from dstrain.runtime import check_given_rank_env
    with pytest.raises(LaunchError) as info:
        check_given_rank_env(env)
    assert words in str(info.value)
    with pytest.raises(LaunchError, match="LOCAL_RANK=3 but this rank sees 2 GPU"):
        check_given_rank_env({"LOCAL_RANK": "3"}, gpus=2)
    check_given_rank_env({"LOCAL_RANK": "1"}, gpus=1)  # one GPU seen: its own (tests/unit/test_gpu_binding.py)
    check_given_rank_env({})  # nothing set: one rank, as before
    check_given_rank_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, gpus=2)


def test_world_size_that_is_not_a_number_is_one_line_from_dstrain_train(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    for var in ("RANK", "LOCAL_RANK", "DSTRAIN_FAILURE_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["train", GPT, f"--output.dir={tmp_path / 'run'}"]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err.strip()
    assert err == ("dstrain: error: WORLD_SIZE='abc' in this rank's environment is not a whole number; unset it "
                   "(dstrain launch and the launchers set it) or set it to one")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("how", [["--accelerator", "cuda"], []])
def test_gpu_ranks_asked_for_where_no_gpu_is_seen_are_refused(tmp_path, capsys, monkeypatch, how):
    import torch
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if not how:
        monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    import subprocess

    def no_launch(*args, **kwargs):
        raise AssertionError("refused before any rank starts")
    monkeypatch.setattr(subprocess, "Popen", no_launch)  # (not --dry-run: there it is a note, for a login node)
    code = cli.main(["launch", "--nproc", "1", "--no-ssh-check", *how, GPT, f"--output.dir={tmp_path / 'run'}"])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("dstrain: error:")]
    assert code == cli.EXIT_CONFIG and out == "" and len(lines) == 1, (code, out, err)
    line = lines[0]
    assert "torch sees no GPU here (CUDA_VISIBLE_DEVICES='')" in line and "--accelerator cpu" in line
    from dstrain import launch_check
    assert launch_check.no_gpu_problem("cuda", False, gpu_count=lambda: 1) is None
    assert launch_check.no_gpu_problem("cpu", False, gpu_count=lambda: 0) is None
    assert launch_check.no_gpu_problem("cuda", True, gpu_count=lambda: 0) is None  # the ranks run elsewhere

