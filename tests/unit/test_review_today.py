"""Second review of five changes of one day: GRPO/HRM logged rates, DeepSpeed configs round 20, Hugging Face
checkpoints round 6 (mixtures of experts, ``models/policy/moe.py``), faults round 7 (``run_files.py``, the
precision refusal on resume, the run lock's 20 s watch) and sandbox red team 26 (``_rewrite._fresh_strings``).
Every test runs in this process (no rank is launched).

Wrong, and fixed (each test below failed before its fix):

* **FLOPs/MFU of a ZeRO-3 mixture of experts left the experts out.** ``moe.expert_modules`` judged a weight by its
  own tensor's shape, and a ZeRO-3 partitioned weight's is an empty shard, so ``expert_params`` (and the experts'
  share of ``num_matmul_params``) was 0 on every ZeRO-3 run, while its docstring said partitioned weights count by
  their full size. Now the full shape (``ds_shape``) decides.
* **A test's own docstrings were lost.** ``_fresh_strings`` turned the docstring of a function or class the test
  defines into a ``b'...'.decode()`` call, which is no docstring: ``h.__doc__`` was None and an honest test reading
  it scored 0 in both modes. Docstrings stay constants (interned, like a ``match`` pattern's strings; README).
* **The run records changed permissions at every resume.** ``run_config.json``, ``ds_config.json``, ``plan.txt``
  and ``summary.json``, now written beside the file and renamed, took the umask's mode (a folder's records made
  group-writable, or private, became 0644); the old ``write_text`` kept the file's mode. Now an existing file's mode
  is kept (their contents are byte for byte what ``save_run_config`` and ``write_text`` wrote: checked, pinned).
* **``latest`` that a full disk (or an I/O error) stopped was removed without a word.** ``mark_complete`` caught
  every ``OSError`` there and said nothing: DeepSpeed's tools then found no ``latest``, and a disk error went
  unseen. Now a warning names the error, the complete checkpoint and the tag to give ``zero_to_fp32.py``.
* **README accuracy.** "A full disk ... when a run starts (the folder's lock, ...): one line naming the file, the
  free space and the fix": the lock's line named no free space. Now it does.

Checked and found right (pinned where cheap):

* rates: ``window_stats`` forms each rate from the steps holding its count and seconds keys; a step without them (an
  older record, a step that logged no counts) adds to neither side, the count keys are not logged; SCoRe's empty
  ``RATES`` gives ``window_mean``; HRM's window start moves past eval/save time only.
* precision refusal: an explicit ``--deepspeed.precision`` spelled otherwise than the checkpoint's (``bfloat16``
  for ``bf16``) cannot happen: the run config accepts only auto/fp32/bf16/fp16, and every ``plan.precision`` that
  trainer_state records is canonical (``choose_precision``, ``_file_precision``, ``pinned_weights``); checkpoints
  without a ``precision`` field (older) are never refused (pinned); ``auto`` takes the checkpoint's (``pin_plan``);
  HRM, GRPO and SCoRe save ``plan.precision`` through ``CheckpointSaver``; SCoRe now also refuses another ZeRO stage
  (it failed in DeepSpeed's load before).
* the run lock's 20 s watch is only for a lock naming another host whose heartbeat looks stale: a same-host
  takeover (and a requeue on the same node) goes on at once; a requeue on another node waits 20 s once (README).
* dense models: ``no_router_logits`` is ``{}`` for GPT-2/Llama/Qwen2 configs, so their forwards and ``generate``
  get no new keyword (checked on transformers 5.24; not imported here, for time); ``expert_params`` of a dense
  model is (0, 0); the experts module's ``config`` (``num_experts_per_tok``) is there on a real Mixtral; ``set_dropout``
  changes only dropout and jitter floats.
* OSError handling: ``write_summary`` (warning: the run is over), ``latest`` (the checkpoint is complete),
  ``cache_space_problem`` (ENOSPC/EDQUOT only, others re-raised: pinned in test_faults7) are as narrow as they say.
* the sandbox rewrite on honest tests, both modes: strings in decorators, default arguments, lambda bodies, nested
  f-strings with format specs (``{x:x}``, ``{x:0{w}d}``, ``{x!r:>6}``, ``{x=}``), ``global``, ``__slots__``, string
  annotations, bytes vs str, ``**`` in dict displays, assert messages, keyword names, ``%``/``format``, very long
  and non-ASCII strings score 1. Left as they are: a test comparing a string with ``is`` (``f(x) is 'word'``, which
  interning made pass) now fails (README says so); a test's own class, ``namedtuple`` and ``match`` class patterns
  with arguments failed before this change too.
* README sentences of the five commits (lock watch, precision, full disk, MoE, DeepSpeed files) match the code.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dstrain import checkpoint as ckpt
from dstrain import run_lock
from dstrain.cli import _output_problem
from dstrain.config import ConfigError, load_run_config
from dstrain.trainers import common
from dstrain.trainers.rl_loop import window_stats
from dstrain.trainers.run_files import write_run_records, write_summary
from tests.unit.conftest import RECIPE, tiny_checkpoint
from tests.unit.redteam_rounds import round_pool  # noqa: F401 (the pool fixture, both sandbox modes)


def _cfg(out: Path, *overrides: str):
    return load_run_config(RECIPE, [f"--output.dir={out}", "--deepspeed.profile=zero0", *overrides])


# ---------------------------------------------------------------- precision on resume (pinned)

def test_a_checkpoint_that_recorded_no_precision_is_not_refused_and_aliases_never_reach_the_check(tmp_path, one_rank):
    out = tmp_path / "run"
    tiny_checkpoint(out, 2, profile="zero0")  # written before trainer_state held a precision
    cfg = _cfg(out, "--deepspeed.precision=bf16", "--checkpoint.resume=true")
    assert _output_problem(cfg, resume=True) is None
    assert common.precision_problem(out / "checkpoints", ckpt.tag_for(2), "bf16") is None
    with pytest.raises(ConfigError, match="must be auto, fp32, bf16 or fp16, got 'bfloat16'"):
        _cfg(out, "--deepspeed.precision=bfloat16")  # so an explicit precision is spelled as trainer_state spells it


# ---------------------------------------------------------------- mixture of experts under ZeRO-3

class _Experts(nn.Module):
    """transformers 5's experts module (``MixtralExperts``): one module, 3-D weights, the config's top-k."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.config = 4, SimpleNamespace(num_experts_per_tok=2)
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 16))
        self.down_proj = nn.Parameter(torch.zeros(4, 16, 32))


def test_expert_params_count_zero3_partitioned_experts_by_their_full_size():
    from models.policy.moe import expert_params
    hf = nn.Sequential(nn.Linear(16, 16), _Experts())
    whole = expert_params(hf)
    assert whole == (6144, 3072)  # 2 of 4 experts per token
    for p in hf.parameters():  # what deepspeed.zero.Init leaves on a rank: an empty shard, the full size aside
        p.ds_shape, p.ds_numel = p.shape, p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    assert expert_params(hf) == whole
    assert expert_params(nn.Sequential(nn.Linear(16, 16))) == (0, 0)  # a dense model


# ---------------------------------------------------------------- the sandbox's fresh strings

def _code_named(code, name: str):
    for const in code.co_consts:
        if type(const) is type(code):
            if const.co_name == name:
                return const
            if (found := _code_named(const, name)) is not None:
                return found
    return None


def test_a_tests_docstrings_stay_docstrings_and_its_other_strings_stay_fresh():
    from dstrain.rewards._rewrite import _prepare_test
    code, _ = _prepare_test("def h():\n    'hdoc'\n    return 'word_one'\nclass T:\n    'tdoc'\n"
                            "assert h.__doc__ == 'hdoc' and T.__doc__ == 'tdoc'")
    h, t = _code_named(code, "h"), _code_named(code, "T")
    assert h.co_consts[0] == "hdoc" and "tdoc" in t.co_consts
    assert "word_one" not in h.co_consts and b"word_one" in h.co_consts  # (red team 26: made as the test runs)
    assert "hdoc" not in code.co_consts and b"hdoc" in code.co_consts  # the assert's own strings stay fresh


HONEST = "def f(x):\n    'the doc'\n    return 2 * x + 1\n"
HONEST_TESTS = [
    "def deco(fn):\n    fn.tag = 'tag_x'\n    return fn\n@deco\ndef g(s='abc'):\n    'gdoc'\n    return s + str(f(1))\n"
    "assert g() == 'abc3' and g.tag == 'tag_x' and g.__doc__ == 'gdoc' and f.__doc__ == 'the doc'",
    "assert list(map(lambda s: s + 'ab', ['x', 'y'])) == ['xab', 'yab'] and (lambda: 'q' + str(f(1)))() == 'q3'",
    "w = 5\nassert f'{f(127):x}' == 'ff' and f'{f(1):0{w}d}' == '00003' and f'{\"ab\"!r:>6}' == \"  'ab'\" "
    "and f\"{f'{f(1):03d}'}_z\" == '003_z' and f'{f(1)=}' == 'f(1)=3'",
    "global G\nG = f(1)\nassert G == 3",
    "class P:\n    __slots__ = ('a', 'b')\n    def __init__(self):\n        self.a = f(1)\nassert P().a == 3",
    "def g(x: 'int') -> 'str':\n    return str(x)\nassert g(f(1)) == '3' and g.__annotations__ == {'x': 'int', "
    "'return': 'str'}",
    "assert str(f(1)).encode() == b'3' and b'3' != '3' and {**{'a': 1}, 'b': f(1)} == {'a': 1, 'b': 3}, 'msg_x'",
    "assert ('a' * 30000 + str(f(1))) == '" + "a" * 30000 + "3' and 'é' + str(f(1)) == 'é3'",
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")
def test_honest_tests_with_strings_everywhere_score_one(pool):
    r = pool.run(HONEST, HONEST_TESTS)
    assert r.reward() == 1.0, (r.status, r.detail)


# ---------------------------------------------------------------- run records

def test_run_records_keep_their_mode_and_contents(tmp_path, one_rank):
    out = tmp_path / "run"
    cfg = _cfg(out)
    old = os.umask(0o022)
    try:
        write_run_records(out, cfg, {"train_batch_size": 8}, "the plan")
        assert stat.S_IMODE((out / "plan.txt").stat().st_mode) == 0o644  # a new file: the umask's
        for name in ("run_config.json", "plan.txt"):
            (out / name).chmod(0o664)  # a team's folder
        write_summary(out, {"step": 3})
        (out / "summary.json").chmod(0o600)
        write_run_records(out, cfg, {"train_batch_size": 8}, "the plan, again")
        write_summary(out, {"step": 4})
    finally:
        os.umask(old)
    assert stat.S_IMODE((out / "run_config.json").stat().st_mode) == 0o664
    assert stat.S_IMODE((out / "plan.txt").stat().st_mode) == 0o664
    assert stat.S_IMODE((out / "summary.json").stat().st_mode) == 0o600
    assert (out / "run_config.json").read_text() == json.dumps(cfg.to_dict(), indent=2) + "\n"  # save_run_config's
    assert (out / "plan.txt").read_text() == "the plan, again\n"
    assert (out / "summary.json").read_text() == json.dumps({"step": 4}, indent=2) + "\n"
    assert sorted(p.name for p in out.iterdir()) == ["ds_config.json", "plan.txt", "run_config.json", "summary.json"]


def test_a_lock_file_the_full_disk_cannot_take_names_the_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "_HELD", [])

    def full(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run_lock.os, "pwrite", full)
    problem = run_lock.take(tmp_path / "run")
    assert problem is not None and " free there); free space, then start again" in problem
    assert run_lock._HELD == []


# ---------------------------------------------------------------- rates over a log window

def test_a_window_rate_leaves_out_steps_without_its_counts():
    rates = {"gen_tokens_per_s": ("gen_tokens", "time/generation")}
    window = [{"gen_tokens": 100.0, "time/generation": 1.0, "gen_tokens_per_s": 100.0, "loss": 1.0},
              {"gen_tokens": 300.0, "time/generation": 2.0, "gen_tokens_per_s": 150.0, "loss": 3.0},
              {"time/generation": 7.0, "gen_tokens_per_s": 1.0, "loss": 2.0}]  # no count: in neither sum
    stats = window_stats(window, rates)
    assert stats["gen_tokens_per_s"] == pytest.approx(400.0 / 3.0) and stats["loss"] == pytest.approx(2.0)
    assert "gen_tokens" not in stats and stats["time/generation"] == pytest.approx(10.0 / 3.0)
    assert window_stats(window[2:], rates)["gen_tokens_per_s"] == 1.0  # none with counts: the steps' mean


# ---------------------------------------------------------------- ``latest`` on a full disk

def test_a_latest_pointer_that_cannot_be_written_is_said(tmp_path, monkeypatch, capsys):
    root = tmp_path / "checkpoints"
    real = ckpt._atomic_write

    def full_at_latest(path, text):
        if path.name == ckpt.LATEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text)
    monkeypatch.setattr(ckpt, "_atomic_write", full_at_latest)
    (root / ckpt.tag_for(3)).mkdir(parents=True)
    ckpt.mark_complete(root, ckpt.tag_for(3), {}, {}, {"step": 3}, keep=2)
    assert ckpt.find_latest(root) == ckpt.tag_for(3) and not (root / ckpt.LATEST).exists()
    err = capsys.readouterr().err
    assert f"dstrain: warning: {root / ckpt.LATEST} could not be written (No space left on device)" in err
    assert f"checkpoint {ckpt.tag_for(3)} is complete" in err
