"""BiLevel SCoRe: two-turn self-correction RL with a guidance model, critics and a value function.

Start-up (this module): tasks, warm start (``score_warm``), the engine plan of the policy
and of every trained model, the placement memory check (``score_models``; the same table
``dstrain plan`` prints), then the models: the policy, the guidance model, the critic and
the value function are DeepSpeed engines (``create_engine``, one per model, each with its
own plan and learning rate); the reference and the target critic are plain frozen modules
on their placement device (CPU by default), or frozen inference engines where the
placement asks for them. The step itself is ``score_step.ScoreStep``.

Layout as GRPO: a step has ``micro_batch x grad_accum x ranks`` episodes,
``num_generations`` per prompt, prompts a pure function of the step (resume-exact).

Checkpoints: the policy engine under the step's tag (``common.CheckpointSaver``; with
``checkpoint.async_write`` its files are written in the background, the others' during the
save), every other trained engine under ``<tag>/<role>/``, the target critic as
``<tag>/critic_target.pt``. ``train.nonfinite`` watches every trained engine (``RunGuards``).
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from dstrain import runtime
from dstrain.rl.rollout import make_rollout
from dstrain.config import ConfigError, RunConfig, RunFolderError
from dstrain.engine.factory import create_engine, plan_engine
from dstrain.engine.profiles import PlanError
from dstrain.trainers import policy_rl as prl
from dstrain.trainers import score_models as sc
from dstrain.trainers import score_warm, task_config
from dstrain.resilience import torch_timeout_s
from dstrain.trainers.common import (CheckpointSaver, RunGuards, StopFlag, decide_resume, load_checkpoint, pin_plan,
                                     resume_plan_problem, warn_batch_change)
from dstrain.trainers.run_files import write_run_records
from dstrain.trainers.prompt_limit import drop_long_prompts
from dstrain.trainers.rl_loop import RLLoop, batch_layout, sandbox_pool, window_state
from dstrain.trainers.score_config import ScoreTaskConfig
from dstrain.trainers.score_step import ScoreModels, ScoreStep

plan_notes = prl.plan_notes  # ``dstrain plan``'s notes on the checkpoint's weights
plan_report = sc.plan_report  # ``dstrain plan``'s hook: the placement table, and why it does not fit


class ScoreTrainer(RLLoop):
    def __init__(self, cfg: RunConfig):
        self.world = w = runtime.init_distributed(timeout_s=torch_timeout_s(cfg.train.collective_timeout_s))
        self.task: ScoreTaskConfig = task_config(cfg)
        t = cfg.train
        self.samples_per_step, self.prompts_per_step = batch_layout(t, self.task.num_generations, w.world_size,
                                                                    "episodes")
        self.out = Path(cfg.output.dir)
        self.ckpt_root = self.out / "checkpoints"
        resume_tag = decide_resume(cfg, w, self.out, self.ckpt_root)
        self.spec, _, self.rl = prl.policy_toolkit(cfg)
        self.cuda_count = torch.cuda.device_count() if w.device.type == "cuda" else 0
        self.placement = sc.resolve_placement(cfg, self.task, self.cuda_count, w.local_world_size)
        cfg = self._policy_profile(cfg)
        self.train_tasks, self.eval_tasks = prl.load_task_sets(self.task, cfg.data.seed)
        self.train_tasks, self.eval_tasks = drop_long_prompts(cfg, self.task, self.train_tasks,
                                                              self.eval_tasks, log=self._print)
        if not self.train_tasks:
            raise ConfigError("run config", "task", "the task source gave no training tasks")
        source_cfg = cfg  # the user's checkpoint, before a warm start replaces model.args.path
        warm, guidance_warm = self._warm_start(cfg)
        if warm is not None:
            cfg = prl.with_model_path(cfg, warm)
        self.cfg = cfg
        from models import registry
        self.model_cfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
        self.guidance_cfg = self.model_cfg if guidance_warm is None else registry.make_model_config(
            cfg.model.name, cfg.model.size, {**cfg.model.args, "path": guidance_warm})
        if resume_tag is not None:
            pin_plan(cfg, self.ckpt_root, resume_tag)
        decided = None
        if w.is_main:
            plan = plan_engine(cfg, w.world_size, ranks_per_node=w.local_world_size, device_type=w.device.type)
            decided = (plan, sc.plan_report(cfg, plan, w.world_size, w.local_world_size, w.device.type,
                                            max(self.cuda_count, 1)))
        self.plan, (table, problem) = runtime.broadcast_object(decided)
        if problem:
            raise PlanError(problem)
        refused = None
        if w.is_main:
            refused = resume_plan_problem(self.ckpt_root, resume_tag, self.plan) if resume_tag else None
            try:
                if refused is None:
                    write_run_records(self.out, cfg, self.plan.ds_config, self.plan.explanation + "\n" + table)
                    print(self.plan.explanation + "\n" + table, flush=True)
            except RunFolderError as err:
                refused = str(err)
        refused = runtime.broadcast_object(refused)
        if refused:
            raise RunFolderError(refused)
        for note in prl.plan_notes(source_cfg, self.plan):
            prl.append_plan_note(self.out, w, note)

        runtime.seed_everything(cfg.train.seed)
        self.models, self.devices, self.profiles = self._build_models()
        self._note_frozen()
        self.guards = RunGuards(cfg, w, {"policy": self.models.policy, **self._extra_engines()})
        self.saver = CheckpointSaver(self.models.policy, self.ckpt_root, w, cfg, self.plan)
        self.tokenizer = prl.task_tokenizer(self.rl, self.model_cfg, self.task)
        self.pool = sandbox_pool(self.task)
        # the policy's turns (and their rewards) run where rollout.backend says; the guidance model stays here
        self.rollouts = make_rollout(SimpleNamespace(
            cfg=cfg, policy=self.models.policy.module, engine=self.models.policy, tokenizer=self.tokenizer,
            rl=self.rl, task=self.task, pool=self.pool, world=w), cfg.rollout)
        self.runner = ScoreStep(self.models, self.rl, self.tokenizer, self.task, self.pool, w.rank,
                                t.micro_batch, t.grad_accum, cfg.train.seed, rollouts=self.rollouts)
        self.start_step = 0
        if resume_tag is not None:
            state = load_checkpoint(self.models.policy, self.ckpt_root, resume_tag, w)
            self.start_step, self.guards.skipped = int(state["step"]), int(state.get("skipped_steps", 0))
            self.take_log_window(state)
            warn_batch_change(w, self.ckpt_root / resume_tag, self.start_step, cfg.train.steps,
                              state.get("samples_per_step"), self.samples_per_step)
            sc.load_extra(self.ckpt_root / resume_tag, self._extra_engines(), self.models.critic_target)
        self.stop = StopFlag()

    def _print(self, msg: str) -> None:
        if self.world.is_main:
            print(msg, flush=True)

    def _policy_profile(self, cfg: RunConfig) -> RunConfig:
        """``placement.policy.profile`` (when named) is the policy's ZeRO profile."""
        named = self.placement.policy.profile
        if named == "auto":
            return cfg
        if cfg.deepspeed.profile not in ("auto", named):
            raise ConfigError("run config", "placement.policy.profile",
                              f"{named} contradicts deepspeed.profile {cfg.deepspeed.profile}; name one of them")
        return dataclasses.replace(cfg, deepspeed=dataclasses.replace(cfg.deepspeed, profile=named))

    def _warm_start(self, cfg: RunConfig) -> tuple[str | None, str | None]:
        """Warm-start folders of the policy and of the guidance model (None: no warm start)."""
        if not self.task.warm_start_steps:
            return None, None
        seed = cfg.data.seed
        task = self.task
        policy = prl.warm_start(cfg, task, score_warm.policy_examples(self.train_tasks, seed, task.warm_turn2),
                                self.world, self.out, log=lambda m: self._print(f"policy {m}"))
        if task.guidance == "none":
            return policy, None
        gtask = dataclasses.replace(task, warm_start_steps=math.ceil(task.guidance_warm_start * task.warm_start_steps),
                                    warm_start_lr=task.guidance_warm_start_lr or task.warm_start_lr)
        gcfg = prl.with_model_path(cfg, policy) if task.guidance_from_policy else cfg
        guidance = prl.warm_start(gcfg, gtask, score_warm.guidance_examples(self.train_tasks, seed, task.guidance_key),
                                  self.world, self.out / "guidance", log=lambda m: self._print(f"guidance {m}"))
        return policy, guidance

    # ---------------------------------------------------------------- models
    def _frozen(self, model_cfg, role: str):
        """(token_logprobs provider, what generate takes) of a frozen policy-family model."""
        r = self.placement.role(role)
        seed = None if model_cfg.path else self.cfg.train.seed
        if r.engine:
            ref = self.rl.reference(model_cfg, "engine", seed=seed,
                                    train_ds_config=sc.frozen_engine_ds(self.plan.ds_config, r.profile))
            return ref, ref.engine
        ref = self.rl.reference(model_cfg, "cpu", seed=seed)
        device = sc.torch_device(r.device, self.world)
        if device.type != "cpu":
            ref = sc.PlacedFrozen(ref.module, device, self.rl)
        return ref, ref.module

    def _engine(self, build, parallelize, plan, train):
        zero3 = plan.zero["stage"] == 3
        return create_engine(lambda: build(plan.ds_config if zero3 else None), parallelize, plan, train)

    def _build_models(self) -> tuple[ScoreModels, dict, dict]:
        cfg, task, p, w = self.cfg, self.task, self.placement, self.world
        present = sc.present_roles(task)
        profiles = sc.role_profiles(p, task, self.plan.profile)
        self.plan.shard_at_build = False  # policies shard themselves at load under ZeRO-3
        build = lambda c: (lambda ds: self.rl.build(c, ds_config=ds))  # noqa: E731
        policy = self._engine(build(self.model_cfg), self.spec.parallelize, self.plan, cfg.train)
        m = ScoreModels(policy=policy, guidance=None)
        if "reference" in present:
            m.reference, _ = self._frozen(self.model_cfg, "reference")
        if "guidance" in profiles:
            gplan = sc.role_plan(self.plan, cfg, w, profiles["guidance"], task.guidance_lr)
            gtrain = dataclasses.replace(cfg.train, steps=max(1, math.ceil(cfg.train.steps / task.guidance_every)))
            sc.role_horizon(gplan.ds_config, cfg.train.steps, gtrain.steps)  # a file's schedule, in its updates
            m.guidance_engine = self._engine(build(self.guidance_cfg), self.spec.parallelize, gplan, gtrain)
            m.guidance = m.guidance_engine.module
        elif "guidance" in present:
            _, m.guidance = self._frozen(self.guidance_cfg, "guidance")
        if task.advantage == "critic":
            head = lambda ds: sc.build_value_model(self.spec, self.model_cfg, ds)  # noqa: E731
            for role in ("critic", "value"):
                rplan = sc.role_plan(self.plan, cfg, w, profiles[role], getattr(task, sc.LR_FIELD[role]))
                setattr(m, role, self._engine(head, sc.value_parallelize, rplan, cfg.train))
            state = self.rl.full_state_dict(m.critic.module)  # collective under ZeRO-3
            m.critic_target = sc.frozen_copy(head(None), state, sc.torch_device(p.critic_target.device, w))
        devices = {"policy": str(policy.device)}
        for role, obj in (("guidance", m.guidance), ("reference", getattr(m.reference, "module", None)),
                          ("critic", m.critic), ("value", m.value), ("critic_target", m.critic_target)):
            if obj is not None:
                dev = obj.device if hasattr(obj, "ds") else next(obj.parameters()).device
                devices[role] = str(dev)
        return m, devices, profiles

    def _note_frozen(self) -> None:
        """plan.txt: what each frozen model got of the run's DeepSpeed JSON (the table gives the trained ones')."""
        m = self.models
        frozen = [("reference", m.reference), ("critic_target", m.critic_target)]
        if m.guidance_engine is None and m.guidance is not None:
            frozen.append(("guidance", m.guidance))
        for role, obj in frozen:
            if obj is not None:
                r = self.placement.role(role)
                how = f"placement.{role}: engine {str(r.engine).lower()}, device {r.device}"
                prl.append_plan_note(self.out, self.world, prl.frozen_model_note(role, obj, how))

    def _extra_engines(self) -> dict:
        m = self.models
        return {k: v for k, v in (("guidance", m.guidance_engine), ("critic", m.critic), ("value", m.value))
                if v is not None}

    # ---------------------------------------------------------------- loop
    def step_tasks(self, step: int) -> list:
        """This rank's tasks of ``step`` (episode ``s`` of the step answers prompt ``s // G``)."""
        G, n, r = self.task.num_generations, self.runner.n, self.world.rank
        prompts = prl.step_prompts(len(self.train_tasks), step, self.prompts_per_step, self.cfg.data.seed)
        return [self.train_tasks[prompts[s // G]] for s in range(r * n, (r + 1) * n)]

    def save(self, step: int) -> None:
        engines = self._extra_engines()
        self.saver.save(step, {"samples_per_step": self.samples_per_step, "engines": sorted(engines),
                               "skipped_steps": self.guards.skipped,
                               "log_window": window_state(self.window)},
                        write_extra=lambda d: sc.save_extra(d, engines, self.models.critic_target,
                                                            self.world.is_main))

    def evaluate(self, step: int) -> dict[str, float]:
        stats = self.runner.evaluate(self.eval_tasks, self.world)
        for engine in (self.models.policy, *self._extra_engines().values()):
            engine.train()
        return stats

    def one_step(self, step: int) -> dict[str, float]:
        return self.runner.train_step(step, self.step_tasks(step))

    def log_extras(self) -> dict[str, float]:
        return {"lr": self.models.policy.lr}

    def summary_extras(self) -> dict:
        return {"devices": self.devices, "engine_profiles": self.profiles}


def train(cfg: RunConfig) -> dict:
    return ScoreTrainer(cfg).run()
