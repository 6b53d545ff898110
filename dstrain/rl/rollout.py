"""Where RL rollouts run: on the training ranks (``local``) or on Ray actors beside them (``ray``).

A rollout is generation plus reward: ``run(tasks, seed)`` returns the same
:class:`~dstrain.trainers.policy_rl.Rollout` either way, so trainers do not branch
on the backend.

``ray`` (``rollout.backend = "ray"``): rank 0 starts a local Ray cluster (or joins
``rollout.address``, e.g. ``auto`` after ``ray start`` on every machine) and the
other ranks join it (with the cluster's auth mode; its token is in the user's
``~/.ray``, so ranks on other machines join a cluster started there with ``ray start``); each rank owns one actor holding a copy of the policy (same
architecture and dtype) and its own sandbox pool, so generation and the verifiers
run in the actor's process, on whatever node Ray placed it. After every optimizer
step the next ``run`` first pushes the policy's weights: the full state is read
once (under ZeRO-3 inside one ``GatheredParameters``, a collective every rank
joins), only the tensors that changed since the last push are sent (one
``ray.put`` shared by the call), and the push is timed (``time/weight_sync``).
With one actor per rank and the same seed, the actor samples exactly what the
rank would have (tests/dist/test_rollout_ray.py).
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from dstrain import runtime

BACKENDS = ("local", "ray")


class LocalRollout:
    """Generation and rewards in the training process (the default)."""

    def __init__(self, tr):
        self.tr = tr

    @property
    def last_sync(self) -> dict:
        """The last weight copy into a colocated generator (``rollout.generator=vllm``), else {}."""
        return getattr(self.tr.rl, "last_sync", None) or {}

    @last_sync.setter
    def last_sync(self, value: dict) -> None:
        if isinstance(getattr(self.tr, "rl", None), _vllm_toolkit_class()):
            self.tr.rl.last_sync = value

    def run(self, tasks: list, seed: int, prompts: list[str] | None = None):
        from dstrain.trainers import policy_rl as prl
        tr = self.tr
        return prl.rollout(tr.policy, tr.tokenizer, tr.rl, tasks, tr.task, tr.pool, seed, prompts=prompts)

    def close(self, clean: bool = True) -> None:
        pass


def _vllm_toolkit_class():
    from dstrain.rl.vllm_generation import VLLMToolkit
    return VLLMToolkit


def _import_ray():
    try:
        import ray
    except ImportError as err:
        raise RuntimeError("rollout.backend=ray needs the ray package (pip install ray); "
                           "or use rollout.backend=local") from err
    return ray


class RolloutWorker:
    """The Ray actor's body: a policy copy, its tokenizer and a sandbox pool (plain class; wrapped by ray)."""

    def __init__(self, model_name: str, model_size: str, model_args: dict, task_class: str, task_fields: dict,
                 dtype: str, threads: int):
        torch.set_num_threads(max(1, threads))
        from models import registry
        import importlib
        from dstrain.trainers.rl_loop import sandbox_pool
        spec = registry.get_spec(model_name)
        self.rl = spec.rl
        self.model_cfg = registry.make_model_config(model_name, model_size, model_args)
        self.model = self.rl.build(self.model_cfg).to(getattr(torch, dtype)).eval()
        module, name = task_class.rsplit(".", 1)  # the trainer's own task dataclass (GRPO's, SCoRe's)
        self.task = getattr(importlib.import_module(module), name)(**task_fields)
        from dstrain.trainers.policy_rl import task_tokenizer
        self.tokenizer = task_tokenizer(self.rl, self.model_cfg, self.task)
        self.pool = sandbox_pool(self.task)

    def load(self, tensors: dict) -> int:
        """Copy the pushed tensors into the policy; returns how many."""
        missing = set(tensors) - set(self.model.state_dict())
        if missing:
            raise KeyError(f"pushed weights the actor's policy does not have: {sorted(missing)[:3]}")
        self.model.load_state_dict(tensors, strict=False)
        return len(tensors)

    def rollout(self, tasks: list, seed: int, prompts: list[str] | None = None) -> dict:
        from dstrain.trainers import policy_rl as prl
        roll = prl.rollout(self.model, self.tokenizer, self.rl, tasks, self.task, self.pool, seed, prompts=prompts)
        return {"completions": roll.completions, "rewards": roll.rewards, "statuses": roll.statuses,
                "gen_seconds": roll.gen_seconds, "score_seconds": roll.score_seconds}

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.pool.close()


def policy_version(engine) -> int:
    """The policy's optimizer-step count: a copy of its weights made at another count is stale."""
    ds = getattr(engine, "ds", engine)
    return int(getattr(ds, "global_steps", 0))


def _full_state(engine) -> dict[str, torch.Tensor]:
    """The policy's whole state on the CPU (gathered once under ZeRO-3: every rank must call this)."""
    module = engine.module
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    ctx = contextlib.nullcontext()
    if params:
        import deepspeed
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    with ctx, torch.no_grad():
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def changed_tensors(state: dict[str, torch.Tensor], pushed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The entries of ``state`` that are new or differ from what was pushed last."""
    return {k: v for k, v in state.items()
            if k not in pushed or pushed[k].shape != v.shape or pushed[k].dtype != v.dtype
            or not torch.equal(pushed[k], v)}


class RayRollout:
    """One Ray actor per rank; weights pushed after each optimizer step, changed tensors only."""

    def __init__(self, tr, rollout_cfg):
        self.tr, self.cfg = tr, rollout_cfg
        self.started_cluster = False
        shared = None
        if tr.world.is_main:
            self.ray = ray = _import_ray()
            if not ray.is_initialized():
                if rollout_cfg.address:
                    ray.init(address=rollout_cfg.address, log_to_driver=False)
                else:
                    ray.init(num_cpus=rollout_cfg.num_cpus, include_dashboard=False, log_to_driver=False,
                             configure_logging=False)
                    self.started_cluster = True
            # joiners need the cluster's auth mode (the token itself is in the user's ~/.ray)
            shared = (ray.get_runtime_context().gcs_address, os.environ.get("RAY_AUTH_MODE"))
        address, auth_mode = runtime.broadcast_object(shared)
        if not tr.world.is_main:
            if auth_mode:  # before ray is imported: it reads the mode once
                os.environ["RAY_AUTH_MODE"] = auth_mode
            self.ray = ray = _import_ray()
            if not ray.is_initialized():
                ray.init(address=address, log_to_driver=False)
        dtype = str(next(tr.policy.parameters()).dtype).replace("torch.", "")
        from dataclasses import asdict
        cfg = tr.cfg
        actor = ray.remote(num_cpus=rollout_cfg.cpus_per_worker)(RolloutWorker)
        task_class = f"{type(tr.task).__module__}.{type(tr.task).__qualname__}"
        threads = rollout_cfg.threads_per_worker or torch.get_num_threads()
        self.worker = actor.remote(cfg.model.name, cfg.model.size, dict(cfg.model.args), task_class,
                                   asdict(tr.task), dtype, threads)
        start = time.perf_counter()
        ray.get(self.worker.pid.remote())  # the actor is built (imports, policy, sandbox pool) before step 1
        self.startup_s = time.perf_counter() - start
        self.pushed: dict[str, torch.Tensor] = {}
        self.version = None
        self.last_sync = {}

    def sync(self) -> dict:
        """Push the weights if the policy stepped since the last push; returns what was pushed."""
        version = policy_version(self.tr.engine)
        if version == self.version:
            return {}
        start = time.perf_counter()
        changed = changed_tensors(_full_state(self.tr.engine), self.pushed)
        if changed:
            self.ray.get(self.worker.load.remote(self.ray.put(changed)))
            self.pushed.update(changed)
        self.version = version
        self.last_sync = {"weight_sync_s": time.perf_counter() - start, "weight_sync_tensors": len(changed),
                          "weight_sync_bytes": sum(v.numel() * v.element_size() for v in changed.values())}
        return self.last_sync

    def run(self, tasks: list, seed: int, prompts: list[str] | None = None):
        from dstrain.trainers import policy_rl as prl
        self.sync()
        if not tasks:
            return None
        out = self.ray.get(self.worker.rollout.remote(tasks, seed, prompts))
        comps = out["completions"]
        return prl.Rollout(comps, self.tr.rl.pack(comps, self.tr.tokenizer.pad_token_id), out["rewards"],
                           out["statuses"], out["gen_seconds"], sum(len(c.completion_ids) for c in comps),
                           out["score_seconds"])

    def close(self, clean: bool = True) -> None:
        """End this rank's actor and leave the cluster; rank 0 ends a cluster it started after the
        others left (``clean``: every rank is here; after a crash nobody waits for the others)."""
        with contextlib.suppress(Exception):
            self.ray.get(self.worker.close.remote(), timeout=30)
            self.ray.kill(self.worker)
        if not self.tr.world.is_main:  # leave the cluster before rank 0 ends it
            with contextlib.suppress(Exception):
                self.ray.shutdown()
        if clean:
            runtime.barrier()
        if self.tr.world.is_main:
            with contextlib.suppress(Exception):
                self.ray.shutdown()


def make_rollout(tr, rollout_cfg):
    """The backend ``rollout.backend`` names. With ``rollout.generator=vllm`` the trainer's toolkit
    ``tr.rl`` is first wrapped so that its ``generate`` runs on a colocated vLLM engine
    (``dstrain.rl.vllm_generation``); its weight copies are logged like the Ray pushes."""
    if getattr(rollout_cfg, "generator", "hf") != "hf":
        from dstrain.rl.vllm_generation import make_toolkit
        tr.rl = make_toolkit(tr.rl, tr, rollout_cfg)
    if rollout_cfg.backend == "ray":
        return RayRollout(tr, rollout_cfg)
    return LocalRollout(tr)
