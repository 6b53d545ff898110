"""Dynamic sampling with informative groups kept for the next step (``task.dynamic_sampling_carry``):
the filler's spare groups by hand, the fake policy of test_grpo_dapo (fewer groups generated per
group trained, no zero-variance group trained, each kept group used once and one step late, its
stored log-probabilities placed on its completion tokens), the ratio against the sampling policy,
and the kept groups through a checkpoint folder."""
from __future__ import annotations

import types

import pytest
import torch

from dstrain.rl import dapo
from dstrain.rl import grpo_math as gm
from dstrain.trainers import grpo_sampling as gs
from dstrain.trainers.grpo_config import PolicyTaskConfig
from tests.unit.test_grpo_dapo import fake_trainer


def test_spare_groups_and_carried_groups_by_hand():
    f = dapo.GroupFiller(needed=2, group_size=2, carry_limit=1)
    f.add(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.0]), list("abcdefghij"))
    # ab kept, cd dropped, ef kept (full), gh spare (the limit: one group), ij surplus and not kept
    assert f.kept_items == list("abef") and f.spare_items == list("gh") and f.spare_rewards == [1.0, 0.0]
    assert (f.surplus, f.dropped, f.generated, f.carried) == (2, 1, 5, 0)
    assert f.stats()["spare_groups"] == 1.0 and f.stats()["carried_groups"] == 0.0
    g = dapo.GroupFiller(needed=2, group_size=2)
    g.add(torch.tensor([1.0, 1.0, 0.0, 1.0]), list("abcd"))
    g.add_carried([0.0, 1.0], ["x", "y"])
    assert g.kept_items == list("cdxy") and (g.kept, g.carried, g.generated) == (2, 1, 2)
    assert "carried_groups" in g.stats() and "carried_groups" not in dapo.GroupFiller(1, 2).stats()
    with pytest.raises(ValueError, match="already full"):
        g.add_carried([0.0, 1.0], ["x", "y"])
    with pytest.raises(ValueError, match="one group of 2"):
        dapo.GroupFiller(needed=2, group_size=2).add_carried([0.0, 1.0, 1.0], ["x", "y", "z"])


def test_carry_needs_dynamic_sampling():
    with pytest.raises(ValueError, match="dynamic_sampling_carry needs task.dynamic_sampling"):
        PolicyTaskConfig(dynamic_sampling_carry=True)


def test_round0_with_carry_is_the_share_over_the_rate():
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_carry=True,
                            dynamic_sampling_max_oversample=2.0)
    assert gs.carry_round0(task, fresh=2, share=2, estimate=0.68, regular=2) == 3  # 2 / 0.68 = 2.94
    assert gs.carry_round0(task, fresh=1, share=2, estimate=0.68, regular=2) == 2  # one kept: the regular ones
    assert gs.carry_round0(task, fresh=4, share=4, estimate=1.0, regular=4) == 4
    assert gs.carry_round0(task, fresh=3, share=4, estimate=0.5, regular=4) == 6
    assert gs.carry_round0(task, fresh=-1, share=4, estimate=0.5, regular=4) == 4
    assert gs.carry_round0(task, fresh=4, share=4, estimate=0.05, regular=4) == 12  # (1 + 2) x 4 at most


def _logp_now(ids, attn):
    """Stand-in for the policy: token t's log-probability is -(t + 1) / 100 - id / 1000."""
    B, T = ids.shape
    return -(torch.arange(1, T, dtype=torch.float32)[None, :] / 100 + ids[:, 1:].float() / 1000).expand(B, T - 1)


def _carry_trainer(monkeypatch, carry: bool, kinds=("easy", "hard", "mixed"), local_samples=16):
    task = PolicyTaskConfig(num_generations=4, dynamic_sampling=True, dynamic_sampling_max_rounds=6,
                            dynamic_sampling_carry=carry)
    tr = fake_trainer(list(kinds) * 40, task, local_samples=local_samples, monkeypatch=monkeypatch)
    tr.cfg.train.micro_batch = 4
    tr.token_logprobs_now = _logp_now
    tr.dynamic_reserve = [] if carry else None
    return tr


def test_kept_groups_cut_the_groups_generated_per_group_trained(monkeypatch):
    """Two prompts in three give informative groups, two groups a share (the CPU recipe's shape).
    Without carry the informative groups beyond the share are thrown away; with it the next step
    uses them, so after the first steps (the running estimate settling) fewer groups are generated
    per group trained and fewer generation rounds run; no trained group is zero-variance."""
    out = {}
    for carry in (False, True):
        tr = _carry_trainer(monkeypatch, carry, kinds=("mixed", "mixed", "hard"), local_samples=8)
        generated = trained = carried = 0.0
        for step in range(40):
            if step == 8:
                calls = len(tr.rl.calls)
            sb = gs.dynamic_batch(tr, step)
            assert sb.log["trained_zero_variance_groups"] == 0.0
            assert (sb.old_logprobs is not None) == (sb.log.get("dynamic/carried_groups", 0) > 0)
            if step >= 8:
                generated += sb.log["dynamic/generated_groups"]
                trained += 2 * sb.log["dynamic/filled_fraction"]
                carried += sb.log.get("dynamic/carried_groups", 0)
        out[carry] = (generated / trained, len(tr.rl.calls) - calls, carried)
    (plain, plain_calls, _), (kept, kept_calls, carried) = out[False], out[True]
    assert kept < 0.95 * plain and carried > 0 and kept_calls < plain_calls, out
    assert kept >= 1.5 - 1e-9  # two in three informative: at least 1.5 groups per group trained


def test_each_kept_group_is_used_once_in_the_next_step_with_its_stored_logprobs(monkeypatch):
    tr = _carry_trainer(monkeypatch, True)
    tr.packed, pack = [], tr.rl.pack

    def recording_pack(rows, pad):
        out = pack(rows, pad)
        tr.packed.append({"rows": list(rows), "input_ids": out["input_ids"]})
        return out
    tr.rl.pack = recording_pack
    used_before: set[int] = set()
    for step in range(12):
        reserve = list(tr.dynamic_reserve)
        assert len(reserve) <= 4  # at most one share
        sb = gs.dynamic_batch(tr, step)
        carried = int(sb.log.get("dynamic/carried_groups", 0))
        assert carried <= len(reserve)
        rows = [id(c) for g in reserve[:carried] for c in g.items]
        trained = {id(c): i for i, c in enumerate(_rows(sb, tr))}
        assert all(r in trained for r in rows)  # the kept groups, in order, are the ones trained
        assert not set(rows) & used_before  # never twice
        used_before |= set(rows)
        for g in reserve[:carried]:
            for c, lp in zip(g.items, g.old):
                i, p, n = trained[id(c)], len(c.prompt_ids), len(c.completion_ids)
                assert torch.equal(sb.old_logprobs[i, p - 1:p - 1 + n], lp)
                assert torch.isnan(sb.old_logprobs[i, :p - 1]).all() and torch.isnan(sb.old_logprobs[i, p - 1 + n:]).all()
        if sb.old_logprobs is not None:  # rows sampled this step have no stored log-probabilities
            fresh = [i for c, i in trained.items() if c not in set(rows)]
            assert torch.isnan(sb.old_logprobs[fresh]).all()
        for g in tr.dynamic_reserve:  # this step's spare groups: informative, log-probs of the policy now
            assert len(set(g.rewards)) > 1
            for c, lp in zip(g.items, g.old):
                packed = pack([c], 0)
                p, n = len(c.prompt_ids), len(c.completion_ids)
                assert torch.allclose(lp, _logp_now(packed["input_ids"], packed["attention_mask"])[0, p - 1:p - 1 + n])
    assert used_before  # the run did carry groups


def _rows(sb, tr):
    """The completions of a step batch's rows: the last call of the recording ``pack``."""
    assert tr.packed[-1]["input_ids"] is sb.batch["input_ids"]
    return tr.packed[-1]["rows"]


def test_ratio_of_a_carried_row_is_against_its_sampling_policy():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], requires_grad=True)
    stored = torch.tensor([[float("nan"), -2.5, -0.25], [float("nan")] * 3])
    old = gs.with_stored(logp.detach(), stored)
    assert old.tolist() == [[-1.0, -2.5, -0.25], [-1.0, -1.0, -1.0]]
    assert gs.with_stored(logp.detach(), None) is not None and torch.equal(gs.with_stored(logp.detach(), None), logp.detach())
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    cfg = gm.GRPOLossConfig(eps_low=0.2, eps_high=0.2, beta=0.0, loss_type="grpo", max_completion_length=3)
    loss, stats = gm.grpo_loss(logp, old, None, adv, mask, cfg)
    # row 0: ratios e^{0.5} (clipped to 1.2, advantage 1) and e^{-0.25}; row 1: ratio 1
    assert stats["clip_fraction"] > 0
    fresh, _ = gm.grpo_loss(logp, logp.detach(), None, adv, mask, cfg)
    assert not torch.allclose(loss, fresh)


def test_kept_groups_through_a_checkpoint_folder(tmp_path):
    from models.policy import Completion
    reserve = [gs.CarriedGroup([1.0, 0.0], [Completion(0, 0, [1, 2], [3, 4], "a", True),
                                            Completion(0, 1, [1, 2], [5], "b", False)],
                               [torch.tensor([-0.1, -0.2]), torch.tensor([-0.3])])]
    gs.save_reserve(tmp_path, 0, reserve)
    gs.save_reserve(tmp_path, 1, [])
    back, note = gs.load_reserve(tmp_path, 0, world_size=2)
    assert note == "" and back[0].rewards == [1.0, 0.0] and back[0].items == reserve[0].items
    assert all(torch.equal(a, b) for a, b in zip(back[0].old, reserve[0].old))
    assert gs.load_reserve(tmp_path, 1, world_size=2) == ([], "")
    none, note = gs.load_reserve(tmp_path, 0, world_size=4)
    assert none == [] and "written by 2 ranks, not 4" in note
    assert gs.load_reserve(tmp_path / "missing", 0, world_size=2) == ([], "")


def test_kept_groups_go_into_the_checkpoint_through_write_extra(tmp_path):
    from dstrain.trainers.grpo import GRPOTrainer
    calls = {}

    def save(step, state, write_extra=None):
        calls.update(step=step, state=state)
        if write_extra is not None:
            write_extra(tmp_path)
    fake = types.SimpleNamespace(samples_per_step=32, guards=types.SimpleNamespace(skipped=0), keep_rate=None,
                                 window=[],
                                 prompt_rest=None, dynamic_reserve=[], world=types.SimpleNamespace(rank=1),
                                 saver=types.SimpleNamespace(save=save))
    GRPOTrainer.save(fake, 4)
    assert calls["step"] == 4 and (tmp_path / gs.RESERVE_FILE.format(1)).is_file()
