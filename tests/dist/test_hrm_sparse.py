"""The sparse puzzle-embedding optimizer on 2 gloo ranks equals one process over the union of the batches."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dstrain.optim.sparse_sign_sgd import SparseEmbedding, SparseSignSGD
from models import registry

IDS = [torch.tensor([1, 5, 5, 2]), torch.tensor([5, 7, 0, 1, 3])]  # uneven counts; ids shared across ranks
STEPS = 3


def _grads(rank: int, step: int, dim: int) -> torch.Tensor:
    return torch.randn(len(IDS[rank]), dim, generator=torch.Generator().manual_seed(100 * step + rank))


def _model_and_batch(rank_rows: slice | None):
    """A tiny HRM and 6 puzzles with ids; ``rank_rows`` picks this rank's rows."""
    cfg = registry.make_model_config("hrm", "tiny", {"halt_max_steps": 1})
    torch.manual_seed(0)
    model = registry.get_spec("hrm").build(cfg).eval()
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(1, 11, (6, 81), generator=g)
    labels = torch.randint(2, 11, (6, 81), generator=g)
    ids = torch.tensor([0, 3, 3, 1, 2, 0])
    rows = rank_rows or slice(None)
    return model, inputs[rows], labels[rows], ids[rows], cfg.hidden_size


def _train_embedding(model, inputs, labels, ids, hidden, steps=2) -> torch.Tensor:
    emb = SparseEmbedding(5, hidden, init_std=0.1, generator=torch.Generator().manual_seed(2))
    opt = SparseSignSGD(emb, lr=0.01, weight_decay=0.3)
    for _ in range(steps):
        loss, _ = model(inputs, labels, emb.lookup(ids))
        loss.backward()  # the per-rank mean: a different scale than the union's mean, same signs
        opt.step()
    return emb.weight


def _worker(rank: int, init_file: str, queue) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        emb = SparseEmbedding(8, 3, init_std=1.0, generator=torch.Generator().manual_seed(0))
        opt = SparseSignSGD(emb, lr=0.1, weight_decay=0.2)
        for step in range(STEPS):
            opt.update(IDS[rank], _grads(rank, step, 3))
        model, inputs, labels, ids, hidden = _model_and_batch(slice(3 * rank, 3 * rank + 3))
        through_model = _train_embedding(model, inputs, labels, ids, hidden)
        queue.put((rank, emb.weight.tolist(), through_model.tolist()))  # plain lists: no shared memory
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process_over_the_union(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "init"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, weight, model_weight = queue.get(timeout=300)
        results[rank] = (torch.tensor(weight), torch.tensor(model_weight))
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0

    # Reference: one process, the union of both ranks' rows each step.
    ref = SparseEmbedding(8, 3, init_std=1.0, generator=torch.Generator().manual_seed(0))
    before = ref.weight.clone()
    opt = SparseSignSGD(ref, lr=0.1, weight_decay=0.2)
    for step in range(STEPS):
        opt.update(torch.cat(IDS), torch.cat([_grads(r, step, 3) for r in range(2)]))
    assert torch.equal(results[0][0], results[1][0])  # the ranks' copies agree
    assert torch.allclose(results[0][0], ref.weight, atol=1e-6)
    assert torch.equal(ref.weight[[4, 6]], before[[4, 6]]) and not torch.equal(ref.weight, before)

    union = _train_embedding(*_model_and_batch(None))
    assert torch.equal(results[0][1], results[1][1])
    assert torch.allclose(results[0][1], union, atol=1e-6)
