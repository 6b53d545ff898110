"""Which GPU a rank runs on, from LOCAL_RANK and the GPUs this rank sees.

A rank that sees all its node's GPUs runs on ``cuda:LOCAL_RANK``. A rank that sees exactly one
GPU (``srun --gpus-per-task=1`` or ``--gpu-bind=single:1``, a site prolog or a container runtime
setting CUDA_VISIBLE_DEVICES per task) runs on that one, ``cuda:0``, whatever its LOCAL_RANK:
before, every task but local rank 0 stopped with "invalid device ordinal". LOCAL_RANK itself is
left as it is (it says which rank of its node this is: node-local caches and files go by it).

DeepSpeed 0.19 turns ``os.environ["LOCAL_RANK"]`` into a device in many places of its own: the
engine (``_set_distributed_vars``, AutoTP), ``deepspeed.comm``'s ``device_id`` at process-group
start, ``zero.Init`` (the ZeRO-3 build and every gather after it), the ZeRO-3 trace checks run at
the end of the first steps (``zero/utils.py``), ``PipelineModule`` and the inference engines. All
of them go through its accelerator (``device_name`` / ``device`` / ``set_device``), so
:func:`bind_accelerator` makes that one object map LOCAL_RANK to the rank's device, and only in
the one-visible-GPU case (where LOCAL_RANK is no device at all), not touching any other index. Every
other method of it that takes a ``device_index`` (``synchronize``, ``memory_allocated``,
``current_stream``, ``get_rng_state``, ``total_memory``...) maps it too: a caller that passes LOCAL_RANK
there (none in DeepSpeed 0.19.8; a model's own code or a later DeepSpeed) gets the rank's GPU, not
"invalid device ordinal".
vLLM (``rollout.generator=vllm``) reads LOCAL_RANK as its device while it starts:
:func:`local_rank_as_device`.
"""
from __future__ import annotations

import contextlib
import inspect
import os

import torch

FIX = ("give each rank one GPU (srun --gpus-per-task=1 or --gpu-bind=single:1) or let every rank see all of its "
       "node's GPUs (unset CUDA_VISIBLE_DEVICES, or list them all in it)")


def _visible_setting(environ=None) -> str:
    """``CUDA_VISIBLE_DEVICES`` as a message shows it: its value, or that it is unset."""
    shown = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    return f"CUDA_VISIBLE_DEVICES={shown!r}" if shown is not None else "CUDA_VISIBLE_DEVICES unset"


def device_index(local_rank: int, visible: int, environ=None) -> int:
    """The CUDA device index of a rank: ``local_rank`` when it is below the GPUs this rank sees
    (``visible``, torch's count: CUDA_VISIBLE_DEVICES applied), 0 when it sees exactly one GPU (its own),
    else a ``LaunchError`` in one line naming CUDA_VISIBLE_DEVICES and the fix."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    from dstrain.config import LaunchError
    where = _visible_setting(environ)
    raise LaunchError(f"LOCAL_RANK={local_rank} but this rank sees {visible} GPU(s) ({where}): it is neither one of "
                      f"them (cuda:0 to cuda:{visible - 1}) nor the one GPU of its own; {FIX}")


def _indexed_methods(cls) -> dict[str, int]:
    """The public methods of accelerator class ``cls`` that take a ``device_index``, with its position among the
    arguments after ``self`` (DeepSpeed 0.19.8's CUDA one: device_name, device, set_device, synchronize, the rng
    state, stream and memory methods)."""
    found = {}
    for name in dir(cls):
        fn = inspect.getattr_static(cls, name, None)
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        params = list(inspect.signature(fn).parameters)
        if "device_index" in params:
            found[name] = params.index("device_index") - 1
    return found


def bind_accelerator(accelerator, local_rank: int, index: int) -> bool:
    """Make DeepSpeed's CUDA ``accelerator`` answer ``index`` where it is asked for ``local_rank`` (an int, the
    text of LOCAL_RANK, or a ``torch.device`` built from it), in every method of it taking a ``device_index``
    (:func:`_indexed_methods`). Only where they differ (the rank sees one GPU and is not local rank 0) and only on
    CUDA; every other index passes unchanged. Returns whether it bound."""
    if getattr(accelerator, "_name", None) != "cuda":
        return False
    cls = type(accelerator)
    methods = _indexed_methods(cls)
    if index == local_rank:  # (an earlier binding of this process, if any, undone)
        for name in (*methods, "dstrain_bound"):
            accelerator.__dict__.pop(name, None)
        return False

    def mapped(value):
        if isinstance(value, torch.device):
            return torch.device("cuda", index) if value.type == "cuda" and value.index == local_rank else value
        if isinstance(value, (int, str)) and str(value).strip().isdigit() and int(value) == local_rank:
            return index
        return value

    def bound(method, at: int):
        def call(*args, **kwargs):
            if "device_index" in kwargs:
                kwargs["device_index"] = mapped(kwargs["device_index"])
            elif len(args) > at:
                args = (*args[:at], mapped(args[at]), *args[at + 1:])
            return method(accelerator, *args, **kwargs)
        call.__name__ = method.__name__
        return call

    for name, at in methods.items():
        setattr(accelerator, name, bound(getattr(cls, name), at))
    accelerator.dstrain_bound = (local_rank, index)
    return True


def shared_gpu_error(err: BaseException, environ=None):
    """A ``LaunchError`` when NCCL found two ranks of one node on the same GPU ("Duplicate GPU detected": ranks that
    each see one GPU, the same one, e.g. torchrun --nproc 2 under CUDA_VISIBLE_DEVICES=0), else None."""
    if "Duplicate GPU detected" not in str(err):
        return None
    from dstrain.config import LaunchError
    environ = os.environ if environ is None else environ
    where = _visible_setting(environ)
    return LaunchError(f"two ranks of this node run on the same GPU ({where} here, LOCAL_RANK="
                       f"{environ.get('LOCAL_RANK', '?')}): each sees one GPU and it is the same one; start no more "
                       f"ranks per node than it has GPUs and {FIX}")


@contextlib.contextmanager
def local_rank_as_device(world):
    """Within: LOCAL_RANK shown as this rank's CUDA device index where the two differ (a rank that sees one GPU),
    restored after. For libraries whose "local rank" is a device and nothing else: vLLM's external launcher
    (``distributed_executor_backend="external_launcher"``) reads LOCAL_RANK and runs on ``cuda:LOCAL_RANK``."""
    device, local = getattr(world, "device", None), getattr(world, "local_rank", None)
    if device is None or device.type != "cuda" or device.index is None or device.index == local:
        yield
        return
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(device.index)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
