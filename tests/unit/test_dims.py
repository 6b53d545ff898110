"""dp x tp x sp layout: validation, coordinates and the groups' rank lists (pure, no processes)."""
import pytest

from dstrain.parallel.dims import ParallelDims
from dstrain.parallel.sequence import choose_mode, exchange_plan
from dstrain.ops.dilated import make_branches


def test_from_world_derives_dp():
    d = ParallelDims.from_world(8, tp=2, sp=2)
    assert (d.dp, d.tp, d.sp, d.world_size, d.replica_size) == (2, 2, 2, 8, 4)


@pytest.mark.parametrize("world,tp,sp,match", [(6, 4, 1, "6 is not divisible by tp x sp = 4 x 1 = 4"),
                                               (4, 0, 1, "tp must be a positive integer"),
                                               (4, 1, 3, "4 is not divisible")])
def test_bad_degrees_name_the_numbers(world, tp, sp, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_world(world, tp=tp, sp=sp)


def test_check_world():
    with pytest.raises(ValueError, match="2 x 2 x 1 = 4 does not match the world size 8"):
        ParallelDims(dp=2, tp=2, sp=1).check_world(8)


def test_layout_tp_innermost():
    d = ParallelDims(dp=2, tp=2, sp=2)
    assert d.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.sp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert d.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert d.replica_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for r in range(8):
        assert d.rank_of(*d.coords(r)) == r


def test_every_rank_in_exactly_one_group_of_each_kind():
    d = ParallelDims(dp=3, tp=2, sp=2)
    for groups in (d.tp_groups(), d.sp_groups(), d.dp_groups(), d.replica_groups()):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(12))


def test_exchange_traffic_and_auto_mode():
    br = make_branches([8, 32], [1, 4])
    ok, traffic, _ = exchange_plan(br, n=32, sp=2)          # segment 32 spans 2 ranks: 2 * 1 / 4
    assert ok and traffic == pytest.approx(0.5)
    assert choose_mode("auto", br, 32, 2, heads=4, sparse=False) == "exchange"
    wide = make_branches([64], [1])                          # one dense segment over 8 ranks: 14 > 4 * 7 / 8
    assert choose_mode("auto", wide, 64, 8, heads=8, sparse=False) == "ulysses"
    assert choose_mode("auto", wide, 64, 8, heads=4, sparse=False) == "exchange"  # ulysses needs heads % sp
    with pytest.raises(ValueError, match="ulysses impossible"):
        choose_mode("ulysses", br, 32, 2, heads=3, sparse=False)
    with pytest.raises(ValueError, match="block-sparse"):
        choose_mode("exchange", br, 32, 2, heads=4, sparse=True)


def test_pp_joins_the_product_and_names_the_numbers():
    d = ParallelDims.from_world(8, pp=2)
    assert (d.dp, d.pp, d.world_size, d.stage_size) == (4, 2, 8, 4)
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp x sp x pp = 1 x 1 x 4 = 4"):
        ParallelDims.from_world(6, pp=4)
    with pytest.raises(ValueError, match="pp must be a positive integer, got 0"):
        ParallelDims.from_world(4, pp=0)
    with pytest.raises(ValueError, match="1 x 1 x 1 x 2 = 2 does not match the world size 4"):
        ParallelDims(dp=1, pp=2).check_world(4)


@pytest.mark.parametrize("tp,sp", [(2, 1), (1, 2)])
def test_pp_with_tp_or_sp_is_refused_in_one_line(tp, sp):
    with pytest.raises(ValueError, match=r"pipeline parallelism \(pp = 2\) is supported with data parallelism "
                                         "only") as err:
        ParallelDims.from_world(8, tp=tp, sp=sp, pp=2)
    assert "\n" not in str(err.value)


def test_pp_layout_stages_outermost():
    d = ParallelDims(dp=2, pp=3)
    assert d.pipe_groups() == [[0, 2, 4], [1, 3, 5]]
    assert d.dp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert [d.stage_of(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [d.coords(r)[0] for r in range(6)] == [0, 1, 0, 1, 0, 1]
    for r in range(6):
        assert d.rank_of(*d.coords(r), d.stage_of(r)) == r


@pytest.mark.parametrize("dp,pp,tp", [(2, 2, 1), (1, 4, 1), (3, 2, 1), (2, 1, 2)])
def test_groups_agree_with_deepspeed_topology(dp, pp, tp):
    d = ParallelDims(dp=dp, pp=pp, tp=tp)
    topo = d.topology()
    assert topo.world_size() == d.world_size
    for r in range(d.world_size):
        coord = topo.get_coord(r)
        assert (coord.pipe, coord.data) == (d.stage_of(r), d.coords(r)[0])
    assert sorted(topo.get_axis_comm_lists("pipe")) == sorted(d.pipe_groups())
    assert sorted(topo.get_axis_comm_lists("data")) == sorted(d.dp_groups())


def test_sub_groups_take_the_runs_collective_timeout(monkeypatch):
    """Groups made after the default one get train.collective_timeout_s (the timeout init_distributed started
    the default group with), not torch's default (10 minutes under NCCL)."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from dstrain import runtime
    from dstrain.parallel import dims
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or SimpleNamespace(ranks=ranks))
    started = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: "pg" in started)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    import deepspeed
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: started.update(pg=kw))
    monkeypatch.setattr(runtime, "_TIMEOUT", None)
    monkeypatch.setattr(runtime.os, "environ", {**runtime.os.environ, "DS_ACCELERATOR": "cpu"})  # RANK etc. stay here
    monkeypatch.setattr(runtime.torch, "set_num_threads", lambda n: None)
    runtime.init_distributed(timeout_s=1234)
    assert started["pg"]["timeout"] == timedelta(seconds=1234) == runtime.group_timeout()
    mine = dims._new_groups([[0], [1]], 1)
    assert mine.ranks == [1] and [kw["timeout"] for _, kw in made] == [timedelta(seconds=1234)] * 2
