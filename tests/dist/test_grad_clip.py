"""ZeRO-0 without DeepSpeed's 16-bit wrappers (fp32, and bf16 as torch.autocast: the factory's choice on a GPU):
dstrain replaces DeepSpeed's per-parameter clipping with multi-tensor kernels. Training is what DeepSpeed's
own clipping gives, the clipping really acts, and the gradient norm is kept for the log (DeepSpeed drops it:
under autocast no norm was logged at all).

One process without ZeRO: DeepSpeed's gradient all-reduce is off, and training is bit-for-bit what it was with it
on (an all-reduce of one rank with itself changes nothing but costs two passes and a buffer); two processes keep it.

Every check of this module runs in one spawned process and one spawned pair (module fixtures ``one_process`` and
``two_processes``): each builds its own engines from seed 0, one after the other."""
import pytest

from tests.dist import spawn

MICRO = 2


def _train(rank, world, mixed: str, clip: float, deepspeeds_clip: bool, steps: int = 3):
    import torch

    from tests.dist.harness import tiny_engine
    precision = "fp32" if mixed == "fp32" else "bf16"
    engine, plan = tiny_engine(world, [
        "--train.micro_batch=2", f"--train.grad_accum={MICRO}", "--data.seq_len=32", f"--deepspeed.precision={precision}",
        "--deepspeed.profile=zero0", "--deepspeed.mixed_precision=autocast", "--train.warmup_steps=1",
        f"--train.steps={steps}", f"--train.grad_clip={clip}"])
    replaced = "clip_fp32_gradients" in vars(engine.ds)
    if deepspeeds_clip and replaced:
        del engine.ds.clip_fp32_gradients  # DeepSpeed's own method again
    gen = torch.Generator().manual_seed(1)
    norms, refs = [], []
    for _ in range(steps):
        for k in range(MICRO):
            x = torch.randint(0, 256, (2, 32), generator=gen)
            engine.backward(engine(x, torch.roll(x, -1, 1)))
            if k == MICRO - 1:  # the norm of the gradients the step sees, computed here independently
                grads = [p.grad.double().flatten() for p in engine.module.parameters() if p.grad is not None]
                refs.append(float(torch.linalg.vector_norm(torch.cat(grads))))
            engine.step()
        norms.append(engine.grad_norm)
    return {"replaced": replaced, "precision": plan.precision, "norms": norms, "refs": refs,
            "params": [p.detach().clone() for p in engine.module.parameters()]}


def _train_each(rank, world, runs):
    """``_train`` once per argument tuple of ``runs``, one after the other in this process (each run builds its
    own engine from seed 0): one process start instead of one per run."""
    return [_train(rank, world, *args) for args in runs]


def _runs_of(mixed: str) -> dict:
    """``name -> args of _train``: the one-process runs of ``mixed`` the tests below read: clipped for 3 steps;
    1 step clipped by dstrain, by DeepSpeed's own method, unclipped; and (fp32) 3 steps unclipped."""
    runs = {"ours": (mixed, 0.05, False), "ours_1": (mixed, 0.05, False, 1), "theirs_1": (mixed, 0.05, True, 1),
            "unclipped_1": (mixed, 0.0, False, 1)}
    if mixed == "fp32":
        runs["unclipped"] = (mixed, 0.0, False)
    return runs


def _one_process(rank, world):
    """Every one-process check of this module, one after the other in the same process (each builds its own
    engine from seed 0): ``_train`` for each run of ``_runs_of`` (fp32 and autocast), and ``_guarded`` with a NaN
    at step 2. One process start instead of three."""
    runs = {mixed: dict(zip(_runs_of(mixed), _train_each(rank, world, list(_runs_of(mixed).values()))))
            for mixed in ("fp32", "autocast")}
    return {"runs": runs, "guarded": _guarded(rank, world, 2), "allreduce": _off_then_on(rank, world)}


def _two_processes(rank, world):
    """Every 2-process check of this module in the same 2 processes (one start instead of three):
    ``_zero_steps`` for ZeRO-1 bf16 and ZeRO-2 fp32, ``_guarded`` without a NaN (its hooks), and
    ``_train_allreduce`` as the factory leaves the all-reduce (its default)."""
    return {"zero": {stage: _zero_steps(rank, world, stage, precision) for stage, precision in ZERO_CASES},
            "guarded_hooks": _guarded(rank, world, 0)["hooks"],
            "allreduce_default": _train_allreduce(rank, world, True)[0]}


@pytest.fixture(scope="module")
def one_process():
    return spawn.run(_one_process, 1)


@pytest.fixture(scope="module")
def two_processes():
    return spawn.run(_two_processes, 2)


def _runs(one_process, mixed: str) -> dict:
    return one_process["runs"][mixed]


@pytest.mark.parametrize("mixed", ["fp32", "autocast"])
def test_clipping_trains_as_deepspeeds_and_keeps_the_norm(mixed, one_process):
    import torch
    ours = _runs(one_process, mixed)["ours"]
    assert ours["replaced"] and ours["precision"] == ("fp32" if mixed == "fp32" else "bf16")
    assert min(ours["refs"]) > 0.05 * 2  # the clipping acts at every step
    assert ours["norms"] == pytest.approx(ours["refs"], rel=1e-5)
    # The weights after one step equal those DeepSpeed's own clipping gives, and differ without clipping.
    # (One step: under bf16 autocast a 1e-10 difference can round a weight to the neighbouring bf16 value
    # at the next step, and Adam turns that into lr-sized differences.)
    ours, theirs, unclipped = (_runs(one_process, mixed)[name] for name in ("ours_1", "theirs_1", "unclipped_1"))
    assert ours["replaced"] and theirs["replaced"]  # (theirs: replaced, then DeepSpeed's own method put back)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours["params"], theirs["params"]))
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ours["params"], unclipped["params"]))


def test_norm_is_kept_without_clipping_too(one_process):
    out = _runs(one_process, "fp32")["unclipped"]
    assert not out["replaced"]  # DeepSpeed does not clip: nothing to replace
    assert out["norms"] == pytest.approx(out["refs"], rel=1e-5)


def _zero_step(rank, world, stage: int, precision: str, deepspeeds: bool):
    import torch

    from tests.dist.harness import tiny_engine
    engine, plan = tiny_engine(world, [
        "--train.micro_batch=2", "--train.grad_accum=1", "--data.seq_len=32", f"--deepspeed.precision={precision}",
        f"--deepspeed.profile=zero{stage}", "--deepspeed.mixed_precision=deepspeed", "--train.warmup_steps=1",
        "--train.steps=2", "--train.grad_clip=0.05"])
    replaced = "get_grad_norm_direct" in vars(engine.ds.optimizer)
    if deepspeeds and replaced:
        del engine.ds.optimizer.get_grad_norm_direct
    gen = torch.Generator().manual_seed(1 + rank)
    norms = []
    for _ in range(1):
        x = torch.randint(0, 256, (2, 32), generator=gen)
        engine.backward(engine(x, torch.roll(x, -1, 1)))
        engine.step()
        norms.append(engine.grad_norm)
    return {"replaced": replaced, "norms": norms, "params": [p.detach().float().clone() for p in engine.module.parameters()]}


def _zero_steps(rank, world, stage: int, precision: str):
    """``_zero_step`` with dstrain's norm, then with DeepSpeed's, in the same 2 processes (one start for both)."""
    return [_zero_step(rank, world, stage, precision, deepspeeds) for deepspeeds in (False, True)]


ZERO_CASES = [(1, "bf16"), (2, "fp32")]


@pytest.mark.parametrize("stage, precision", ZERO_CASES)
def test_zero_norm_is_deepspeeds(stage, precision, two_processes):
    """ZeRO-1/2 on 2 ranks: dstrain's multi-tensor norm (fp32 accumulation) gives DeepSpeed's norm (fp64
    accumulation) and the same clipped first update (bf16: within one rounding of a bf16 weight)."""
    import torch
    ours, theirs = two_processes["zero"][stage]
    assert theirs["replaced"]  # (then DeepSpeed's own method put back)
    assert ours["replaced"] and all(n is not None and n > 0.05 * 2 for n in ours["norms"])
    assert ours["norms"][0] == pytest.approx(theirs["norms"][0], rel=1e-5)
    tol = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=2 ** -7, atol=1e-3)
    assert all(torch.allclose(a, b, **tol) for a, b in zip(ours["params"], theirs["params"]))


def _guarded(rank, world, nan_step: int):
    import torch

    from dstrain.faults import _nan_gradient
    from dstrain.resilience import NonFiniteGuard
    from tests.dist.harness import tiny_engine
    engine, _ = tiny_engine(world, ["--train.micro_batch=2", "--data.seq_len=32", "--deepspeed.precision=fp32",
                                    "--deepspeed.profile=zero0", "--train.warmup_steps=1", "--train.steps=3",
                                    "--train.grad_clip=0.05"])
    engine.watch(NonFiniteGuard("skip", 3, rank, world))
    gen = torch.Generator().manual_seed(1)
    taken, changed, norms, refs = [], [], [], []
    for step in (1, 2, 3):
        x = torch.randint(0, 256, (2, 32), generator=gen)
        loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(_nan_gradient(loss) if step == nan_step else loss)
        grads = [p.grad.double().flatten() for p in engine.module.parameters() if p.grad is not None]
        refs.append(float(torch.linalg.vector_norm(torch.cat(grads))))
        before = [p.detach().clone() for p in engine.module.parameters()]
        taken.append(engine.step())
        norms.append(engine.grad_norm)
        changed.append(any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters())))
    return {"hooks": engine._grads is not None, "taken": taken, "changed": changed, "norms": norms, "refs": refs}


def test_one_process_guards_gradients_by_the_kept_norm(one_process, two_processes):
    """One process at ZeRO-0: the non-finite guard reads the norm dstrain measures for clipping (no hook and
    no extra pass per gradient), clipping reuses that norm, and a NaN gradient skips exactly its update.
    With a peer the per-gradient hooks stay (they name the rank whose gradients were NaN)."""
    import math
    out = one_process["guarded"]
    assert not out["hooks"]
    assert out["taken"] == [True, False, True] and out["changed"] == [True, False, True]
    assert math.isnan(out["norms"][1]) and math.isnan(out["refs"][1])
    assert [out["norms"][i] for i in (0, 2)] == pytest.approx([out["refs"][i] for i in (0, 2)], rel=1e-5)
    assert two_processes["guarded_hooks"]


def _train_allreduce(rank, world, allreduce_on: bool):
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
    """``_train_allreduce`` with the all-reduce as the factory left it (off), then forced on, in one process."""
    return _train_allreduce(rank, world, False), _train_allreduce(rank, world, True)


def test_one_process_trains_identically_without_the_all_reduce(one_process):
    import torch
    (default, off), (_, on) = one_process["allreduce"]
    assert default is False  # the factory turned it off
    assert len(off) == len(on) and all(torch.equal(a, b) for a, b in zip(off, on))


def test_two_processes_keep_the_all_reduce(two_processes):
    assert two_processes["allreduce_default"] is True
