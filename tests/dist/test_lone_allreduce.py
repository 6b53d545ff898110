"""One process without ZeRO: DeepSpeed's gradient all-reduce is off, and training is bit-for-bit what it
was with it on (an all-reduce of one rank with itself changes nothing but costs two passes and a buffer)."""
from tests.dist import spawn


def _train(rank, world, allreduce_on: bool):
    import torch

    from tests.dist.harness import tiny_engine
    engine, plan = tiny_engine(world, [
        "--train.micro_batch=2", "--train.grad_accum=2", "--data.seq_len=32", "--deepspeed.precision=fp32",
        "--deepspeed.profile=zero0", "--train.warmup_steps=1", "--train.steps=3"])
    default = engine.ds.enable_backward_allreduce
    engine.ds.enable_backward_allreduce = allreduce_on
    gen = torch.Generator().manual_seed(1)
    for _ in range(3 * 2):  # 3 optimizer steps of 2 micro-batches
        x = torch.randint(0, 256, (2, 32), generator=gen)
        engine.backward(engine(x, torch.roll(x, -1, 1)))
        engine.step()
    return default, [p.detach().clone() for p in engine.module.parameters()]


def _off_then_on(rank, world):
    """``_train`` with the all-reduce as the factory left it (off), then forced on, in one process."""
    return _train(rank, world, False), _train(rank, world, True)


def test_one_process_trains_identically_without_the_all_reduce():
    (default, off), (_, on) = spawn.run(_off_then_on, 1)
    assert default is False  # the factory turned it off
    assert len(off) == len(on) and all(torch_equal(a, b) for a, b in zip(off, on))


def test_two_processes_keep_it():
    default, _ = spawn.run(_train, 2, True)
    assert default is True


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)
