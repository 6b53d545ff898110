"""The engine trainers use: a narrow interface over DeepSpeed's (forward, backward, step, save, load), with dstrain's
non-finite guard (synchronous or deferred, see :mod:`dstrain.engine.deferred_check`), hang watchdog phases, the kept
gradient norm and the attention-kernel context. Built by :func:`dstrain.engine.factory.create_engine`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dstrain.engine import compiling
from dstrain.engine.grad_norm import NormKeeper
from dstrain.ops.attention import sdpa_priority

if TYPE_CHECKING:
    from dstrain.engine.factory import EnginePlan


class Engine:
    """The narrow interface trainers use: forward, backward, step, save, load."""

    def __init__(self, ds_engine, plan: EnginePlan, param_group_names: list[list[str]] | None = None,
                 parallel=None, norm: NormKeeper | None = None):
        self.ds = ds_engine
        self.plan = plan
        self.parallel = parallel
        """dstrain.parallel.dims.ParallelState when tp or sp > 1, else None."""
        self.param_group_names = param_group_names
        """Parameter names of each optimizer group, in order (saved beside checkpoints)."""
        self._keeper = norm  # without ZeRO or DeepSpeed's 16-bit wrappers: dstrain clips and keeps the norm
        self.guard = self.watchdog = self._grads = None
        self.name = ""
        self._losses: list[torch.Tensor] = []
        self.updates = 0
        """Optimizer updates taken (skipped ones not counted; under the deferred check every step counts: its
        state moved on, and a bad step's update was left out on the device)."""
        self._last_step_taken = True
        self._update_lr: float | None = None  # the lr of the last optimizer update (read before DeepSpeed's step)
        self.settings_changed: list[str] = []
        """After ``load``: the optimizer settings the checkpoint had otherwise, put back to this run's."""
        self._deferred = None  # deferred_check.DeferredCheck where the non-finite check is deferred (watch)
        self.nonfinite_check = "off"
        """How the non-finite guard runs: off | sync | deferred (see dstrain.engine.deferred_check)."""
        self.nonfinite_check_note = ""
        """Why a requested deferred check runs synchronously ("" where it does not)."""
        self.step_ok: torch.Tensor | None = None
        """Under the deferred check: the last step's verdict on the device (1.0 taken, 0.0 skipped), for a
        trainer's own updates that must follow it; None under the synchronous one (``step``'s return says)."""
        self._graphs = plan.compile and compiling.records_cuda_graphs(plan.compile_mode)
        self._norm_guard = False  # the non-finite guard reads the kept norm (set by watch)
        self._attention = lambda: sdpa_priority(plan.attention_backend)  # noqa: E731 - a fresh context per forward

    def watch(self, guard=None, watchdog=None, name: str = "", check: str = "sync") -> None:
        """Attach the run's non-finite policy (``resilience.NonFiniteGuard``: checked in every ``step`` at a
        gradient-accumulation boundary, over the losses given to ``backward`` and the gradients) and its
        hang ``Watchdog`` (told the phase: forward, backward, allreduce, step). ``name``: in messages.
        ``check``: ``train.nonfinite_check`` (auto | sync | deferred) where the trainer follows ``step_ok``
        with its own per-step updates, else sync (see :mod:`dstrain.engine.deferred_check`)."""
        from dstrain.engine.deferred_check import DeferredCheck, deferral_refusal
        from dstrain.resilience import GradWatch
        self.guard, self.watchdog, self.name = guard, watchdog, name
        # fp16: DeepSpeed's loss scaler owns overflows. One process alone, where dstrain measures the norm
        # (ZeRO-0 without DeepSpeed's 16-bit wrappers), the norm's finiteness is the check: no hook and no
        # extra pass per gradient. With peers the hooks stay: they see each rank's gradients before the
        # all-reduce, so the message names the rank that produced the NaN.
        alone = not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1
        self._norm_guard = guard is not None and self.plan.precision != "fp16" and alone and \
            self._keeper is not None and self._keeper.guards_gradients
        if guard is not None and self._grads is None and self.plan.precision != "fp16" and not self._norm_guard:
            self._grads = GradWatch(self.ds.module)
        self._deferred, self.nonfinite_check, self.nonfinite_check_note = None, "off" if guard is None else "sync", ""
        if guard is not None and check != "sync":
            why = deferral_refusal(self, check)
            if why is None:
                self._deferred, self.nonfinite_check = DeferredCheck(guard, name), "deferred"
            elif check == "deferred":
                self.nonfinite_check_note = f"train.nonfinite_check=deferred runs synchronously here: {why}"

    @property
    def last_step_taken(self) -> bool:
        """Whether the last optimizer step's update was taken (False: skipped under train.nonfinite=skip).
        Under the deferred check, reading it waits for that step's verdict."""
        if self._deferred is not None:
            self.settle()
            return self._deferred.last_taken
        return self._last_step_taken

    @last_step_taken.setter
    def last_step_taken(self, value: bool) -> None:
        self._last_step_taken = value

    def settle(self) -> None:
        """Under the deferred check: read the last step's verdict now and apply the policy (may raise
        ``NonFiniteError``: call it where a step's outcome must be known, before logging or saving)."""
        if self._deferred is not None:
            from dstrain.resilience import base_optimizer
            self._deferred.settle(base_optimizer(self.ds))

    def _phase(self, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(phase + (f" ({self.name})" if self.name else ""))

    def __call__(self, *args, **kwargs):
        self._phase("forward")
        with self._attention():
            out = self.ds(*args, **kwargs)
        # CUDA graphs: the next replay overwrites these (a recurrent carry, a loss logged later)
        return compiling.copy_graph_outputs(out) if self._graphs else out

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    def backward(self, loss: torch.Tensor) -> None:
        from dstrain.faults import fault_nan
        loss = fault_nan(loss, self.ds.global_steps + 1, self.name)
        if self.guard is not None:
            self._losses.append(loss.detach())
        self._phase("backward")
        self.ds.backward(loss)

    def step(self) -> bool:
        """The optimizer step at an accumulation boundary (else DeepSpeed only counts the micro-step).
        Returns whether an update was taken: False off the boundary, when the guard skipped it and when
        DeepSpeed's fp16 loss scaler did (callers with their own updates, e.g. HRM's puzzle embeddings
        and EMA, follow this). Under the deferred check it is True at every boundary: a bad step's update is
        left out on the device, the callers' own updates follow ``step_ok``, and the host learns of it at the
        next step (``settle``)."""
        ds = self.ds
        if getattr(ds, "zenflow", False):  # DeepSpeed's boundary is ZenFlow's full update (it sets its accumulation
            boundary = True  # to update_interval); every step updates the selected rows (refused unless grad_accum 1)
        else:
            boundary = ds.is_gradient_accumulation_boundary()
        if boundary:  # DeepSpeed steps its scheduler right after the update: the lr it used is the one now
            self._update_lr = self._scheduled_lr()
        if boundary and self._deferred is not None:
            self.step_ok = self._deferred.step(self)
            self.updates += 1
            return True
        if self._keeper is not None and boundary:
            self._keeper.before_step(for_guard=self._norm_guard)
        skip = False
        if boundary and self.guard is not None:
            self._phase("allreduce")
            losses, self._losses = self._losses, []
            grads_bad = self._grads.take() if self._grads is not None else \
                self._norm_guard and self._keeper.nonfinite()
            skip = self.guard.check(losses, self.ds.global_steps + 1, grads_bad, self.name)
        self._phase("step")
        overflows = getattr(self.ds, "skipped_steps", 0)
        if skip:
            from dstrain.resilience import update_skipped
            with update_skipped(self.ds):
                self.ds.step()
        else:
            self.ds.step()
        # fp16: DeepSpeed's loss scaler skips an update whose gradients overflowed (and counts it)
        skip = skip or getattr(self.ds, "skipped_steps", 0) > overflows
        if boundary:
            self.last_step_taken = not skip
            self.updates += not skip
        return boundary and not skip

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def _scheduled_lr(self) -> float | None:
        """The lr the next update will take (None for a stand-in without ``get_lr``)."""
        get_lr = getattr(self.ds, "get_lr", None)
        return None if get_lr is None else float(get_lr()[0])

    @property
    def lr(self) -> float:
        """The learning rate of the last optimizer update (before the first one: the lr it will take).

        Not ``get_lr()`` after the step: DeepSpeed steps the scheduler right after each update, so that is
        the next update's lr, one schedule step ahead of the update a log line reports."""
        return self.next_lr if self._update_lr is None else self._update_lr

    @property
    def next_lr(self) -> float:
        """The learning rate the next optimizer update will take (for updates of a trainer's own that follow it)."""
        return float(self.ds.get_lr()[0])

    @property
    def grad_norm(self) -> float | None:
        """Global gradient 2-norm of the last optimizer step, before clipping."""
        if self._keeper is not None:
            return self._keeper.read()
        norm = self.ds.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    def save(self, save_dir: str, tag: str, client_state: dict | None = None) -> None:
        self.settle()
        self.ds.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False)

    def load(self, load_dir: str, tag: str) -> dict:
        """DeepSpeed's state from ``tag``, with this run's optimizer settings kept (``resume_settings``:
        what the checkpoint had differently is left in ``settings_changed``)."""
        from dstrain.engine import resume_settings
        self.settings_changed = []
        with resume_settings.kept(self.ds, self.settings_changed):
            path, client_state = self.ds.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load checkpoint {tag} from {load_dir}")
        return client_state or {}
