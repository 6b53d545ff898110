"""Test hooks that make a rank fail on purpose, driven by environment variables.

The fault tests (tests/dist, tests/multinode, benchmarks/checkpoint_stall.py) set them on
``dstrain launch``; a run without them is untouched. ``DSTRAIN_FAULT_RANK`` picks the
rank (default 0); with ``DSTRAIN_FAULT_ONCE=PATH`` a hook fires only while PATH does not
exist, and creates it, so a restarted job runs through.
"""
from __future__ import annotations

import os


def _fires(name: str, step: int) -> bool:
    """Whether test hook ``$name`` fires at ``step`` on this rank (see :func:`fault`)."""
    if os.environ.get(name) != str(step) or int(os.environ.get("RANK", 0)) != int(
            os.environ.get("DSTRAIN_FAULT_RANK", 0)):
        return False
    once = os.environ.get("DSTRAIN_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
    return True


def fault(name: str, step: int) -> None:
    """Test hook: a rank dies (``os._exit(17)``, as abruptly as kill -9) when ``$name`` equals ``step``.

    ``DSTRAIN_FAULT_RANK`` picks the rank (default 0). With ``DSTRAIN_FAULT_ONCE=PATH`` the
    fault fires only while PATH does not exist, and creates it: a restarted job then runs through.
    After a step, ``DSTRAIN_FAULT_SIGTERM_STEP=n`` sends SIGTERM to the fault rank itself instead.
    """
    if _fires(name, step):
        os._exit(17)
    if name == "DSTRAIN_FAULT_AFTER_STEP" and _fires("DSTRAIN_FAULT_SIGTERM_STEP", step):
        import signal  # a stop signal to this rank alone (a scheduler's SIGTERM reaching the ranks, not their launcher)
        os.kill(os.getpid(), signal.SIGTERM)


def _nan_gradient(loss):
    """``loss`` unchanged, with a backward that turns every gradient into NaN."""
    import torch

    class NaNBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    return NaNBackward.apply(loss)


def fault_nan(loss, step: int, model: str = ""):
    """Test hooks on the fault rank's loss of optimizer step n of one model (``DSTRAIN_FAULT_MODEL``,
    default the run's main model, named "" or "policy"): ``DSTRAIN_FAULT_NAN_STEP=n`` makes it NaN,
    ``DSTRAIN_FAULT_NAN_GRAD_STEP=n`` keeps it finite and makes its gradients NaN."""
    if model not in ((os.environ["DSTRAIN_FAULT_MODEL"],) if "DSTRAIN_FAULT_MODEL" in os.environ
                     else ("", "policy")):
        return loss
    if _fires("DSTRAIN_FAULT_NAN_STEP", step):
        return loss * float("nan")
    if _fires("DSTRAIN_FAULT_NAN_GRAD_STEP", step):
        return _nan_gradient(loss)
    return loss


def fault_hang(step: int) -> None:
    """Test hook: ``DSTRAIN_FAULT_HANG_STEP=n`` makes the fault rank sleep in step n's forward
    (``DSTRAIN_FAULT_HANG_S`` seconds, default an hour): its peers wait in a collective."""
    if _fires("DSTRAIN_FAULT_HANG_STEP", step):
        import time
        time.sleep(float(os.environ.get("DSTRAIN_FAULT_HANG_S", 3600)))


def fault_raise(step: int) -> None:
    """Test hook: ``DSTRAIN_FAULT_RAISE_STEP=n`` makes the fault rank raise a RuntimeError after step n:
    an unexpected error inside a running job (a traceback), where :func:`fault` kills the process."""
    if _fires("DSTRAIN_FAULT_RAISE_STEP", step):
        raise RuntimeError(f"dstrain test fault: DSTRAIN_FAULT_RAISE_STEP={step}")
