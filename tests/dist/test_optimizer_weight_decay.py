"""The weight decay the engine's optimizer really applies: the parameter groups carry it and override the
optimizer's own, so they must hold the optimizer's number, not ``train.weight_decay``, when DeepSpeed
builds an optimizer from a block that sets none."""
import json

import pytest

from tests.dist import spawn


def _group_decays(rank, world, profile: str, overrides: list[str]):
    from tests.dist.harness import tiny_engine
    engine, plan = tiny_engine(world, [
        "--train.micro_batch=2", "--data.seq_len=16", "--deepspeed.precision=fp32",
        f"--deepspeed.profile={profile}", "--train.steps=2", *overrides])
    opt = engine.ds.optimizer
    return type(opt).__name__, [g["weight_decay"] for g in opt.param_groups], plan.optimizer.description


def _each(rank, world, calls):
    """``_group_decays`` for each (profile, overrides) of ``calls`` in this one process (one start for all)."""
    return [_group_decays(rank, world, *call) for call in calls]


SGD = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
       "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": 0.9}}}


CASES = [
    # no weight_decay in the block: SGD's own default (0), although the run config says 0.1
    ({}, [], [0.0, 0.0]),
    # the block's number (agreeing with the run, as the checks require) reaches the decayed group only
    ({"weight_decay": 5e-4}, ["--train.weight_decay=0.0005"], [5e-4, 0.0]),
]
ADAMW = ("zero0", ["--train.weight_decay=0.05"])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """What ``_group_decays`` returned for each case of this module (by index: the SGD cases of ``CASES``, from
    JSON files written here, then dstrain's AdamW), all built in one spawned process."""
    calls = []
    for i, (params, overrides, _) in enumerate(CASES):
        ds = json.loads(json.dumps(SGD))
        ds["optimizer"]["params"].update(params)
        path = tmp_path_factory.mktemp(f"sgd{i}") / "sgd.json"
        path.write_text(json.dumps(ds))
        calls.append((str(path), overrides))
    calls.append(ADAMW)
    results = spawn.run(_each, 1, calls)
    return {i: r for i, r in enumerate(results)}


@pytest.mark.parametrize("case", range(len(CASES)))
def test_deepspeed_built_optimizer_keeps_its_own_weight_decay(built, case):
    params, _, expected = CASES[case]
    name, decays, description = built[case]
    assert name == "SGD"
    assert decays == pytest.approx(expected)
    assert ("the optimizer's own default" in description) == ("weight_decay" not in params)


def test_dstrain_built_adamw_takes_the_run_weight_decay(built):
    name, decays, _ = built[len(CASES)]
    assert name == "AdamW" and decays == pytest.approx([0.05, 0.0])
