"""polyak_update_ under ZeRO-3 partitioning (2 CPU ranks, gloo): shard, gathered-source and plain-source paths."""
import torch
from torch import nn

from tests.dist import spawn

TAU = 0.3


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 35 and 15 elements split unevenly over 2 ranks; the 1-element tensors leave rank 1 pure padding
    return nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3), nn.Linear(1, 1))


def _partitioned(seed: int) -> nn.Module:
    import deepspeed
    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        return _net(seed)


def _full(module: nn.Module) -> dict:
    """Every parameter's full value (gathered one at a time when partitioned)."""
    import deepspeed
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                out[name] = p.data.detach().clone()
        else:
            out[name] = p.detach().clone()
    return out


def _check(rank, world):
    import deepspeed
    from dstrain.rl.polyak import polyak_update_
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    cases = {
        "shards": (lambda: _partitioned(0), lambda: _partitioned(1)),
        "plain_target_partitioned_source": (lambda: _net(0), lambda: _partitioned(1)),
        "partitioned_target_plain_source": (lambda: _partitioned(0), lambda: _net(1)),
    }
    for case, (make_target, make_source) in cases.items():
        target, source = make_target(), make_source()
        part = [hasattr(p, "ds_id") for p in (next(target.parameters()), next(source.parameters()))]
        t0, s0 = _full(target), _full(source)
        assert set(t0) == set(s0) and all(t0[n].shape == s0[n].shape for n in t0)
        polyak_update_(target, source, TAU, chunk_numel=4)
        got, s1 = _full(target), _full(source)
        errors = {}
        for name in t0:
            expected = (1 - TAU) * t0[name] + TAU * s0[name]
            assert not torch.equal(expected, t0[name])
            errors[name] = (got[name] - expected).abs().max().item()
            assert torch.equal(s1[name], s0[name]), (case, name)  # the source is untouched
        assert max(errors.values()) < 1e-6, (case, rank, errors)
        # the update persists in the shard, not in a gathered copy: a second update compounds
        polyak_update_(target, source, TAU, chunk_numel=4)
        again = _full(target)
        for name in t0:
            expected = (1 - TAU) ** 2 * t0[name] + (1 - (1 - TAU) ** 2) * s0[name]
            assert torch.allclose(again[name], expected, atol=1e-6), (case, name)
        results[case] = (part, max(errors.values()))
    torch.distributed.barrier()  # no rank tears the group down while the other still gathers
    return results


def test_polyak_zero3_two_ranks():
    results = spawn.run(_check, 2)
    assert results["shards"][0] == [True, True]
    assert results["plain_target_partitioned_source"][0] == [False, True]
    assert results["partitioned_target_plain_source"][0] == [True, False]
    assert all(err < 1e-6 for _, err in results.values())
