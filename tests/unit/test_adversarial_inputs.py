"""Adversarial run-config input: a fuzz round over the recipe loader and ``dstrain check-config``, in one process.

Inputs tried (through ``load_run_config`` with one override each, and recipe files through ``check-config``):
ints as floats (steps 10.0, 10.5, 1e30), bools as counts (``true`` as micro_batch, steps, tp, pp, seed,
num_generations, max_new_tokens, model.args.n_layer, halt_max_steps), NaN / Infinity / -Infinity / 1e309 for
lr, margin, timeouts, task rates; null for numbers, bools, strings, sections, betas, model.args; ``{}`` and
``[]`` for sections; 0/1/"yes" for bools; ``--train.lr.x=1``, ``--train.steps`` without a value,
``--train.steps==1``, unknown sections; empty strings for output.dir, profile, model name/size; boundaries
(micro_batch 0, steps -0, lr -1, eps 0, checkpoint.every -1, betas of one or zero numbers, GRPO
num_generations 0/1, temperature 0/-1, top_p 0/1.5, max_new_tokens 0, epsilon -1, eval_k > eval_samples,
sandbox_wall_s 0, HRM halt_max_steps 0, H_cycles 0, halt_exploration_prob 2, blanks -1, dilated rates 0 or
not dividing their segment); files that are a JSON array, a string, null, empty, with comments or trailing
commas, NaN, 1e309, a list or null section, an unknown top-level section, Latin-1, a symlink loop, a folder
named x.json. All of those were already refused with one line naming the key (exit 2 from the CLI).

Accepted as meant (by design): lr 0 and -0, warmup_steps > steps (a short debug run of a longer recipe),
eval_every 0 (only at the end), seq_len 1, a huge grad_accum or steps (exact Python ints), negative train.seed,
HRM task.global_batch 0 / GRPO n_train 0 (documented "derive it"), a dilated segment length 32.0 (== 32),
segment lengths not dividing seq_len (the model pads), CRLF line ends.

Found and fixed here (before -> now):
* a key written twice in one recipe object: Python's json kept the last silently (``"train"`` twice dropped
  the first whole section) -> refused, naming the key and both lines (DeepSpeed JSONs were already refused).
* a UTF-8 byte-order mark: refused as "comments or trailing commas" -> read as the JSON it is.
* UTF-16 files (PowerShell ``>``): "invalid JSON at line 1 column 2" or "not UTF-8" -> "UTF-16 text, not UTF-8;
  save the file as UTF-8".
* ``train.compile``, ``deepspeed.zero_init``, ``deepspeed.activation_checkpointing`` = 1 or 0: accepted as
  true/false (``1 in ("auto", True, False)`` holds in Python) -> refused: auto, true or false.
* ``data.corpus=""``: accepted, and training read the current folder's files as the corpus -> refused.
* integers past 64 bits (``--train.steps=10**30`` written out, seeds, counts, tp; model.args.n_embd): accepted,
  then torch's TypeError traceback (n_embd) or a rank's failure at its seed -> refused: at most 2**63 - 1.
* a layer count of 10**30 (or 20000): ``dstrain plan`` hung building the layers on the meta device -> refused
  above 10000 layers (any model field named ``*layer``/``*layers``).
* a key written twice in an override's JSON (``--model.args={"n_layer": 2, "n_layer": 3}``) -> refused.
* ``rollout.num_cpus`` -1 / true / 1.5 and ``rollout.address`` 1 / "": accepted (Ray failed later, or took
  True as one CPU) -> refused with what they take.
"""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from dstrain import cli
from dstrain.config import ConfigError, load_run_config

GPT = "models/gpt/recipes/tiny.json"
GRPO = "models/policy/recipes/grpo_debug.json"


def _refused(path, overrides=()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_run_config(path, list(overrides))
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("override, key, words", [
    ("--train.compile=1", "train.compile", "auto, true or false"),
    ("--train.compile=0", "train.compile", "auto, true or false"),
    ("--deepspeed.zero_init=1", "deepspeed.zero_init", "auto, true or false"),
    ("--deepspeed.activation_checkpointing=0", "deepspeed.activation_checkpointing", "auto, true or false"),
    ("--data.corpus=", "data.corpus", "must not be empty"),
    ("--data.corpus= ", "data.corpus", "must not be empty"),
    ("--rollout.num_cpus=-1", "rollout.num_cpus", "positive integer"),
    ("--rollout.num_cpus=true", "rollout.num_cpus", "positive integer"),
    ("--rollout.num_cpus=1.5", "rollout.num_cpus", "positive integer"),
    ("--rollout.address=1", "rollout.address", "Ray address"),
    ("--rollout.address=", "rollout.address", "Ray address"),
])
def test_silently_accepted_values_are_refused(override, key, words):
    err = _refused(GPT, [override])
    assert (err.source, err.key) == ("command line", key) and words in err.problem


@pytest.mark.parametrize("override", ["--train.compile=true", "--train.compile=auto", "--deepspeed.zero_init=false",
                                      "--rollout.num_cpus=4", "--rollout.address=auto", "--rollout.num_cpus=null"])
def test_the_values_meant_still_load(override):
    load_run_config(GPT, [override])


@pytest.mark.parametrize("text, key, lines", [
    ('{"train": {"steps": 5,\n "steps": 7}}', "steps", "lines 1, 2"),
    ('{"train": {"steps": 5},\n"model": {"name": "gpt"},\n"train": {"lr": 0.1}}', "train", "lines 1, 3"),
    ('{"model": {"args": {"n_layer": 2, "n_layer": 3}}}', "n_layer", ""),
])
def test_a_key_written_twice_is_refused(tmp_path, text, key, lines):
    path = tmp_path / "dup.json"
    path.write_text(text)
    err = _refused(path)
    assert err.key == key and "written twice" in err.problem and lines in err.problem
    with contextlib.redirect_stderr(io.StringIO()) as out, contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["check-config", str(path)]) == 2
    assert "Traceback" not in out.getvalue()


def test_a_byte_order_mark_is_read_as_json(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + open(GPT, "rb").read().replace(b"\n", b"\r\n"))
    cfg = load_run_config(path)
    assert cfg.train.steps == json.load(open(GPT))["train"]["steps"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_utf16_recipes_are_named(tmp_path, encoding):
    path = tmp_path / "u16.json"
    path.write_bytes(open(GPT).read().encode(encoding))
    err = _refused(path)
    assert "UTF-16" in err.problem and "save the file as UTF-8" in err.problem


@pytest.mark.parametrize("override, key", [  # already handled: pinned so that they stay one-line refusals
    ("--train.steps=10.5", "train.steps"), ("--train.steps=10.0", "train.steps"),
    ("--train.micro_batch=true", "train.micro_batch"), ("--train.lr=NaN", "train.lr"),
    ("--train.lr=1e309", "train.lr"), ("--output.tensorboard=1", "output.tensorboard"),
    ("--train.lr.x=1", "train.lr"), ("--train.steps==1", "train.steps"),
])
def test_already_refused(override, key):
    assert _refused(GPT, [override]).key == key


@pytest.mark.parametrize("override", ["--task.num_generations=1", "--task.top_p=1.5", "--task.max_new_tokens=0",
                                      "--task.temperature=0"])
def test_grpo_boundaries_already_refused(override):
    assert _refused(GRPO, [override]).key == override[2:].split("=")[0]


BIG = "1" + "0" * 30  # 10**30, an exact JSON integer


@pytest.mark.parametrize("override, key", [
    (f"--train.steps={BIG}", "train.steps"), (f"--train.seed={BIG}", "train.seed"),
    (f"--data.seed={BIG}", "data.seed"), (f"--parallel.tp={BIG}", "parallel.tp"),
    (f"--model.args.n_embd={BIG}", "model.args.n_embd"), (f"--checkpoint.keep=-{BIG}", "checkpoint.keep"),
])
def test_integers_past_64_bits_are_refused(override, key):
    err = _refused(GPT, [override])
    assert err.key == key and "64 bits" in err.problem


@pytest.mark.parametrize("recipe, override, key", [
    (GPT, f"--model.args.n_layer={BIG}", "model.args.n_layer"), (GPT, "--model.args.n_layer=20000", "model.args.n_layer"),
    ("models/hrm/recipes/sudoku_debug.json", "--model.args.H_layers=20000", "model.args.H_layers"),
])
def test_layer_counts_no_plan_could_build_are_refused(recipe, override, key):
    assert _refused(recipe, [override]).key == key


def test_a_key_written_twice_in_an_override_is_refused():
    err = _refused(GPT, ['--model.args={"n_layer": 2, "n_layer": 3}'])
    assert err.source == "command line" and "written twice" in err.problem and "lines" not in err.problem


def test_plan_refuses_a_huge_layer_count_at_once(capsys):
    assert cli.main(["plan", GPT, f"--model.args.n_layer={BIG}"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
