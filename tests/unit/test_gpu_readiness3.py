"""GPU readiness, round 3: the commits since the second GPU session (dstrain bench's tp/sp layout, LM validation's
per-window sums, GRPO's pooled statistics, per-length generation, PhiMoE routing, the router-loss rules, the run
lock released by ``exit_rank``, plain progress lines, the warm start's stop check, ``--max-restarts`` on the same
error, the planner's states precision under autocast), read for what only a GPU machine would show.

Found and fixed (checked here with stand-ins; passes on a GPU machine too):

* ``--max-restarts`` stops when two attempts in a row fail with the same error at the same step
  (``rank_exit.error_signature``: the error's first line). A CUDA out-of-memory error, the usual deterministic
  failure on a GPU, is one line that goes on with that moment's numbers: ``GPU 3 has a total capacity of 79.19 GiB
  of which 1.21 GiB is free. Process 81234 has 77.96 GiB memory in use...``, another process id (and free memory,
  and GPU index where another rank failed first) on every attempt. The same OOM at the same step never compared
  equal, so it was restarted ``--max-restarts`` times, each a start-up and a resume (on the CPU an out-of-memory
  rank is killed by the kernel and leaves no error, so tests saw nothing). Now the signature keeps what the same
  OOM repeats, the request (``CUDA out of memory. Tried to allocate 2.00 GiB.``), and the launch stops at the
  second attempt; OOMs of another size still differ.

* ``runtime.exit_rank`` released the run lock before ending the rank's helper processes (DeepSpeed ZenFlow's
  optimizer process, a CUDA-only feature), which it waits for up to 5 s: the output folder was free to another run
  while this rank still ran, its threads (a failed rank's asynchronous checkpoint writer) still writing there. Now
  the lock goes last, just before ``os._exit``.

* ``LMTrainer.evaluate`` (validation evaluated once per window): a data-parallel rank left with no window in the
  last batch ran one window at weight 0, a ``[1, seq_len]`` batch. A CUDA run compiles the model (``train.compile``
  auto) with static shapes, so that forward was a shape of its own and compiled again (tens of seconds for a large
  model; another CUDA graph under ``reduce-overhead``) while the other ranks waited in the next collective; on the
  CPU nothing is compiled and tests saw nothing. Now it runs a whole micro-batch, the shape already compiled (its
  weight still 0). A ragged last batch of a short validation stream (fewer than ``micro_batch`` windows on one
  rank) is still a shape of its own: the model's mean loss cannot weigh filler rows out.

Read and found fine (no change): the bench worker's plain loop (DDP over the replica group, ``device_ids`` the
rank's GPU, pinned below; batches moved to the device once, before timing; a tp/sp model compiled as the engine
compiles it; peak memory the CUDA allocator's on the rank's own device, max over ranks; losses averaged over every
rank); ``LMTrainer.evaluate`` (host float64 sums, ``runtime.all_reduce`` moves them to the GPU under NCCL; one
``.item()`` per eval batch, none in the training step; the pipeline's ``eval_batch`` loss is fp32); GRPO's
``sum_over_ranks`` (host floats, one collective per step, on every rank alike); per-length generation groups (inputs moved
to the model's device per group, one ``fork_rng`` over the CUDA device around all groups, seeded once); PhiMoE's
pre-hook (its ``training`` flag written before it is read, so a compiled forward sees the same value every step:
at most one extra compilation for the flag's value on entry, not one per step; activation checkpointing recomputes
the same routing); the router-loss rules (no device dependence); ``LineProgress`` (host floats at log steps);
the warm-start stop check (rank 0's host flag, passed on by the broadcast that already followed it); the planner's
``states_precision`` (``dstrain plan --device-memory 80GB`` for a GPU: the fp32 row above ZeRO-0 under autocast,
ZeRO-0 on CUDA as autocast, as ``factory.mixed_precision`` runs it); ``tests/gpu`` (untouched since; all skip with
"needs CUDA" here).
"""
from __future__ import annotations

import types

import pytest
import torch

from dstrain import rank_exit, run_lock, runtime, supervise

_OOM = ("CUDA out of memory. Tried to allocate {req}. GPU {gpu} has a total capacity of 79.19 GiB of which {free} is "
        "free. Process {pid} has 77.96 GiB memory in use. Of the allocated memory 75.10 GiB is allocated by PyTorch, "
        "and 1.31 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
        "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


def _oom(req="2.00 GiB", gpu=0, free="1.21 GiB", pid=81234):
    return torch.OutOfMemoryError(_OOM.format(req=req, gpu=gpu, free=free, pid=pid))


def test_the_same_cuda_oom_at_the_same_step_has_one_signature_in_every_process():
    first = rank_exit.error_signature(_oom(pid=81234, free="1.21 GiB", gpu=0), ("forward", 150))
    again = rank_exit.error_signature(_oom(pid=90417, free="1.19 GiB", gpu=3), ("forward", 150))
    assert first == again == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. (in forward of step 150)"
    assert rank_exit.error_signature(_oom(req="4.00 GiB"), ("forward", 150)) != first  # another request
    assert rank_exit.error_signature(_oom(), ("backward", 150)) != first  # another phase
    assert rank_exit.error_signature(_oom(), ("forward", 151)) != first  # another step
    other = rank_exit.error_signature(RuntimeError("shape mismatch: 12 vs 13"), ("forward", 150))
    assert other == "RuntimeError: shape mismatch: 12 vs 13 (in forward of step 150)"  # other errors as they were


def test_max_restarts_stops_at_the_second_identical_cuda_oom():
    attempts, left = [], []
    pids = iter(range(1000, 1010))

    def attempt(resume):
        attempts.append(resume)
        left.append(rank_exit.error_signature(_oom(pid=next(pids), free=f"{len(attempts)}.2 GiB"), ("forward", 150)))
        return 1

    lines = []
    code = supervise.run_with_restarts(attempt, 5, lines.append, pause=0.0, error=lambda: left[-1])
    assert code == 1 and attempts == [False, True]
    assert "same error at the same point" in lines[-1] and "Tried to allocate 2.00 GiB" in lines[-1]


@pytest.fixture
def held_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "_HELD", [])
    monkeypatch.setattr(run_lock, "_WARNED", set())
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    assert run_lock.take(out) is None
    yield out
    run_lock.release()


class _Exited(Exception):
    pass


def test_exit_rank_keeps_the_lock_until_its_helper_processes_ended(held_lock, monkeypatch):
    seen = []
    monkeypatch.setattr(runtime, "_end_helper_processes",
                        lambda: seen.append(("helpers", bool(run_lock._HELD), (held_lock / run_lock.NAME).read_text())))

    def exit_(code):
        seen.append(("exit", bool(run_lock._HELD), (held_lock / run_lock.NAME).read_text()))
        raise _Exited(code)
    monkeypatch.setattr(runtime.os, "_exit", exit_)
    with pytest.raises(_Exited):
        runtime.exit_rank(0)
    (_, held, record), (_, held_at_exit, record_at_exit) = seen
    assert held and record.strip()  # still this run's folder while a helper process may go on
    assert not held_at_exit and record_at_exit == ""  # free once nothing but os._exit is left


@pytest.fixture(scope="module")
def optimizer_imports():
    """torch's first optimizer imports torch._dynamo (seconds, once per process: paid by any earlier test)."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def test_bench_plain_loop_runs_ddp_over_the_replica_group_on_the_ranks_gpu(monkeypatch, optimizer_imports):
    """Pinned (found fine): on CUDA the plain baseline's DDP gets the rank's GPU as ``device_ids`` and, under tp/sp,
    the replica group (dp x sp ranks of one tensor shard), as the engine averages gradients; none without DDP."""
    from dstrain import bench_worker
    from dstrain.config import load_run_config

    made = []

    class _DDP(torch.nn.Module):
        def __init__(self, module, device_ids=None, process_group=None):
            super().__init__()
            self.module = module
            made.append((device_ids, process_group))

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", _DDP)
    cfg = load_run_config("models/gpt/recipes/tiny.json", [])
    gpu = types.SimpleNamespace(type="cuda", index=3)
    bench_worker._plain_step_fn(torch.nn.Linear(4, 4), cfg, "fp32", gpu, 4,
                                parallel=types.SimpleNamespace(replica_group="replicas",
                                                               dims=types.SimpleNamespace(replica_size=2)))
    assert made == [([3], "replicas")]
    made.clear()
    bench_worker._plain_step_fn(torch.nn.Linear(4, 4), cfg, "fp32", torch.device("cpu"), 2,
                                parallel=types.SimpleNamespace(replica_group="replicas",
                                                               dims=types.SimpleNamespace(replica_size=1)))
    assert made == []  # tp over the whole world: one replica, no DDP



class _ShapeEngine:
    """The engine's eval forward as a compiled one sees it: the shapes it is called with (static shapes: one
    compilation each), and a loss that depends on the batch."""

    device = torch.device("cpu")

    def __init__(self):
        self.shapes = []

    def __call__(self, x, y):
        self.shapes.append(tuple(x.shape))
        return (x.float().mean() + y.float().mean()) / 100

    def eval(self):
        pass

    def train(self):
        pass


def test_a_rank_with_no_validation_window_left_runs_the_micro_batch_shape():
    """8 validation windows, 3 data-parallel ranks x micro-batch 2, 2 eval batches: the second batch holds 2, for
    rank 0; ranks 1 and 2 run theirs at weight 0. Before, with one window (shape [1, seq]): a shape of its own,
    compiled again on CUDA (train.compile auto, static shapes) while rank 0 waited. Now a whole micro-batch."""
    from types import SimpleNamespace

    from dstrain.trainers import lm
    seq, micro, tokens = 5, 2, 41
    losses = []
    for dp_rank in range(3):
        tr = lm.LMTrainer.__new__(lm.LMTrainer)
        tr.cfg = SimpleNamespace(train=SimpleNamespace(eval_batches=2, micro_batch=micro),
                                 data=SimpleNamespace(seq_len=seq, seed=11), parallel=SimpleNamespace(sp=1))
        tr.val_tokens = torch.arange(tokens, dtype=torch.int16) % 13
        tr.engine, tr.pipelined = _ShapeEngine(), False
        tr.dp_rank, tr.dp_world, tr.parallel = dp_rank, 3, None
        losses.append(tr.evaluate())
        assert tr.engine.shapes == [(micro, seq)] * 2, dp_rank
    # (each rank alone: its own windows' mean; the weight-0 batch counts for nothing)
    first_only = []
    for dp_rank in (1, 2):
        tr.engine, tr.dp_rank = _ShapeEngine(), dp_rank
        tr.cfg.train.eval_batches = 1
        first_only.append(tr.evaluate())
    assert losses[1:] == pytest.approx(first_only, rel=1e-12)
