"""Rollout backends: a Ray actor samples and scores exactly what the training process would.

The Ray test starts a real local cluster (CPU) and skips when ray is not installed.
"""
from __future__ import annotations

import types

import pytest
import torch

from dstrain.config import load_run_config
from dstrain.rl.rollout import LocalRollout, RayRollout, changed_tensors
from dstrain.trainers import policy_rl as prl, task_config
from dstrain.trainers.rl_loop import sandbox_pool

RECIPE = "models/policy/recipes/grpo_debug.json"


def test_changed_tensors_sends_only_what_moved():
    a, b = torch.ones(3), torch.zeros(2)
    pushed = {"a": a.clone(), "b": b.clone()}
    assert changed_tensors({"a": a, "b": b}, pushed) == {}
    moved = changed_tensors({"a": a + 1, "b": b, "c": torch.ones(1)}, pushed)
    assert sorted(moved) == ["a", "c"]
    assert sorted(changed_tensors({"b": b.double()}, pushed)) == ["b"]  # a dtype change counts


class _World:
    rank, world_size, is_main = 0, 1, True


def _trainer_like(tmp_path, **extra):
    """What a rollout backend reads from a trainer: policy, tokenizer, toolkit, task, pool, config, world."""
    cfg = load_run_config(RECIPE, [f"--output.dir={tmp_path}", "--task.n_train=8", "--task.max_new_tokens=12",
                                   "--task.sandbox_workers=1", *[f"--{k}={v}" for k, v in extra.items()]])
    spec, model_cfg, rl = prl.policy_toolkit(cfg)
    torch.manual_seed(0)
    policy = rl.build(model_cfg)
    with torch.no_grad():  # not the initial weights, so the push is checked for real
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    task = task_config(cfg)
    train, _ = prl.load_task_sets(task, cfg.data.seed)
    engine = types.SimpleNamespace(module=policy, ds=types.SimpleNamespace(global_steps=0))
    tr = types.SimpleNamespace(cfg=cfg, policy=policy, engine=engine, tokenizer=rl.load_tokenizer(model_cfg),
                               rl=rl, task=task, world=_World(), pool=sandbox_pool(task))
    return tr, train


def test_ray_actor_rollout_equals_local_and_tracks_weight_updates(tmp_path):
    pytest.importorskip("ray")
    tr, tasks = _trainer_like(tmp_path)
    tasks = [t for t in tasks[:4] for _ in range(2)]
    local = LocalRollout(tr)
    remote = RayRollout(tr, tr.cfg.rollout.__class__(backend="ray", num_cpus=2, threads_per_worker=1))
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the actor runs one thread: same kernels, same sums
        try:
            want = local.run(tasks, seed=1234)
            got = remote.run(tasks, seed=1234)
        finally:
            torch.set_num_threads(threads)
        assert remote.last_sync["weight_sync_tensors"] == len(tr.policy.state_dict())
        assert [c.completion_ids for c in got.completions] == [c.completion_ids for c in want.completions]
        assert torch.equal(got.rewards, want.rewards)
        assert got.statuses == want.statuses
        for key in want.batch:
            assert torch.equal(got.batch[key], want.batch[key]), key

        # an optimizer step changes one tensor: the next run pushes that tensor alone
        name, param = next(iter(tr.policy.named_parameters()))
        with torch.no_grad():
            param.mul_(0.5)
        tr.engine.ds.global_steps = 1
        torch.set_num_threads(1)
        try:
            want = local.run(tasks, seed=99)
            got = remote.run(tasks, seed=99)
        finally:
            torch.set_num_threads(threads)
        assert remote.last_sync["weight_sync_tensors"] == 1
        assert remote.last_sync["weight_sync_bytes"] == param.numel() * param.element_size()
        assert [c.completion_ids for c in got.completions] == [c.completion_ids for c in want.completions]
        assert remote.run([], seed=1) is None  # no tasks: nothing asked of the actor
    finally:
        remote.close()
        tr.pool.close()
