"""Run a function on N CPU processes with a gloo process group (no DeepSpeed launcher).

``run(fn, world, *args)`` spawns ``world`` processes, each calling ``fn(rank, world, *args)``
after ``torch.distributed`` is up; whatever rank 0 returns comes back (pickled through a
file). A failure on any rank raises here with that rank's traceback.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, out_dir: str, fn, args):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # Done and flushed: skip the interpreter's native teardown, which now and then aborts a
    # finished gloo process ("terminate called without an active exception"), as dstrain's
    # own ranks do (dstrain.runtime.exit_rank).
    os._exit(0)


def run(fn, world: int, *args, timeout: float = 240):
    from dstrain.launcher import find_free_port
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(_worker, args=(world, find_free_port(), out, fn, args), nprocs=world, join=False)
        try:
            while not ctx.join(timeout=timeout):
                pass
        except Exception as err:
            errors = [open(os.path.join(out, f)).read() for f in sorted(os.listdir(out)) if f.endswith(".err")]
            raise AssertionError("\n".join(errors) or str(err)) from None
        with open(os.path.join(out, "rank0.pkl"), "rb") as f:
            return pickle.load(f)
