"""SparseEmbedding / SparseSignSGD in one process: only touched rows move, by sign-SGD with decay."""
import pytest
import torch

from dstrain.optim.sparse_sign_sgd import SparseEmbedding, SparseSignSGD


def test_update_matches_a_dense_reference():
    torch.manual_seed(0)
    emb = SparseEmbedding(6, 4, init_std=1.0)
    before = emb.weight.clone()
    ids = torch.tensor([4, 1, 4, 0])
    grads = torch.randn(4, 4)
    touched = SparseSignSGD(emb, lr=0.1, weight_decay=0.5).update(ids, grads)
    assert touched.tolist() == [0, 1, 4, 4]  # sorted, once per use
    dense = torch.zeros(6, 4).index_add_(0, ids, grads)  # gradient of equal ids summed
    expected = before.clone()
    for row in (0, 1, 4):  # decayed once, then a signed step
        expected[row] = before[row] * (1 - 0.1 * 0.5) - 0.1 * torch.sign(dense[row])
    assert torch.equal(emb.weight, expected)
    assert torch.equal(emb.weight[[2, 3, 5]], before[[2, 3, 5]])  # untouched rows: no decay either


def test_lookup_grad_and_step():
    emb = SparseEmbedding(3, 2)
    opt = SparseSignSGD(emb, lr=0.5, weight_decay=0.0)
    rows = emb.lookup(torch.tensor([2, 2, 0]))
    assert rows.requires_grad and rows.is_leaf
    (rows * torch.tensor([[1.0, -1.0], [1.0, 2.0], [-3.0, 0.0]])).sum().backward()
    opt.step(lr=0.25)  # the schedule's learning rate wins over the default
    # id 2: grad (2, 1) -> -0.25 * (1, 1); id 0: grad (-3, 0) -> (+0.25, 0); sign(0) = 0
    assert emb.weight.tolist() == [[0.25, 0.0], [0.0, 0.0], [-0.25, -0.25]]
    with pytest.raises(RuntimeError, match="before SparseEmbedding.lookup"):
        opt.step()


def test_errors_and_state():
    emb = SparseEmbedding(3, 2)
    with pytest.raises(IndexError, match=r"puzzle ids must be in \[0, 3\)"):
        emb.lookup(torch.tensor([3]))
    with pytest.raises(ValueError, match="grads must be"):
        SparseSignSGD(emb, 0.1).update(torch.tensor([0]), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="num_ids >= 1"):
        SparseEmbedding(0, 2)
    other = SparseEmbedding(3, 2, init_std=1.0)
    emb.load_state_dict(other.state_dict())
    assert torch.equal(emb.weight, other.weight)
    with pytest.raises(ValueError, match="does not match"):
        emb.load_state_dict(SparseEmbedding(4, 2).state_dict())


def test_update_matches_the_unique_based_computation_on_many_repeats():
    """Sort + searchsorted summing equals torch.unique + index_add over random repeated ids."""
    g = torch.Generator().manual_seed(1)
    emb = SparseEmbedding(50, 8, init_std=1.0, generator=g)
    before = emb.weight.clone()
    ids = torch.randint(0, 20, (300,), generator=g)
    grads = torch.randn(300, 8, generator=g)
    SparseSignSGD(emb, lr=0.03, weight_decay=0.7).update(ids, grads)
    touched, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(len(touched), 8).index_add_(0, inverse, grads)
    expected = before.clone()
    expected[touched] = before[touched] * (1 - 0.03 * 0.7) - 0.03 * torch.sign(summed)
    assert torch.equal(emb.weight, expected)


def test_lookup_rejects_non_flat_ids():
    emb = SparseEmbedding(3, 2)
    assert emb.lookup(torch.tensor([0, 2])).shape == (2, 2)
    with pytest.raises(ValueError, match="1-D"):
        emb.lookup(torch.zeros(2, 2, dtype=torch.long))
