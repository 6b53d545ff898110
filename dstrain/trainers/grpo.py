"""GRPO: group-relative policy optimisation of a causal-LM policy, rewarded by verifiers.

Each optimizer step takes ``P = micro_batch x grad_accum x ranks / num_generations``
prompts (a pure function of the step, so a resumed run continues the same order).
Sample ``s`` of the step answers prompt ``s // G``; rank ``r`` samples and scores
``s`` in ``[r n, (r + 1) n)`` with ``n`` its share, so one prompt's group may sit on
two ranks: every rank gathers all rewards before normalising, then keeps its
slice of the advantages. The sampling seed of a step depends on (seed, step, rank).

Per micro-batch the loss is ``dstrain.rl.grpo_math.grpo_loss``. DeepSpeed divides
by grad_accum and averages over ranks; ``dapo`` (the global token mean) is scaled
to undo that. Several passes (``num_iterations``) reuse the sampling policy's
stored log-probabilities. A mixture of experts whose router load-balancing coefficient is
above 0 (``model.args.router_aux_loss_coef``, by default its config's) adds ``coef x aux`` to
each micro-batch's loss (aux over the micro-batch's real tokens, as transformers computes it);
the logged ``loss`` includes it and ``router_aux_loss`` is aux's mean.

``task.dynamic_sampling`` (DAPO) and the overlong switches change only which rows a
step trains on and with what weight: see ``grpo_sampling``. A step whose batch holds
rows of weight 0 (padding of a short dynamic batch, overlong-filtered completions)
normalises its loss over the weighted rows of the whole batch, for every loss type.
Each step logs its time split: ``time/generation`` (under ZeRO-3 this includes
gathering the weights, which generation does once per call), ``time/reward`` (the
verifiers), ``time/reference`` (the frozen reference's forward), ``time/training``
(old log-probabilities, forwards, backwards, optimizer steps) and ``time/step``.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from dstrain import runtime
from dstrain.config import ConfigError, RunConfig
from dstrain.engine.factory import create_engine
from dstrain.rl import grpo_math as gm
from dstrain.rl.rollout import make_rollout
from dstrain.trainers import policy_rl as prl
from dstrain.trainers import task_config
from dstrain.resilience import torch_timeout_s
from dstrain.trainers.common import (CheckpointSaver, RunGuards, StopFlag, decide_resume, load_checkpoint, pin_plan,
                                     plan_and_record, warn_batch_change)
from dstrain.trainers.grpo_config import PolicyTaskConfig
from dstrain.trainers.grpo_sampling import (StepBatch, load_reserve, save_reserve, step_batch, sum_over_ranks,
                                            with_stored)
from dstrain.trainers.prompt_limit import drop_long_prompts
from dstrain.trainers.rl_loop import RLLoop, batch_layout, sandbox_pool, window_state


def _sum_all(value: float) -> float:
    return sum_over_ranks([value])[0]


class GRPOTrainer(RLLoop):
    RATE_KEYS = ("gen_tokens_per_s", "train_tokens_per_s")  # every rank generates and trains its share
    RATES = {"gen_tokens_per_s": ("gen_tokens", "time/generation"),  # tokens over seconds of the log window
             "train_tokens_per_s": ("train_tokens", "time/training")}

    def __init__(self, cfg: RunConfig):
        self.world = runtime.init_distributed(timeout_s=torch_timeout_s(cfg.train.collective_timeout_s))
        self.task: PolicyTaskConfig = task_config(cfg)
        t, ws = cfg.train, self.world.world_size
        self.samples_per_step, self.prompts_per_step = batch_layout(t, self.task.num_generations, ws)
        self.local_samples = t.micro_batch * t.grad_accum
        if self.task.dynamic_sampling and self.local_samples % self.task.num_generations:
            raise ConfigError("run config", "task.dynamic_sampling",
                              f"dynamic sampling fills each rank's share with whole groups: micro_batch x "
                              f"grad_accum = {self.local_samples} must be a multiple of task.num_generations = "
                              f"{self.task.num_generations}")
        self.out = Path(cfg.output.dir)
        self.ckpt_root = self.out / "checkpoints"
        resume_tag = decide_resume(cfg, self.world, self.out, self.ckpt_root)
        self.spec, _, self.rl = prl.policy_toolkit(cfg)
        self.train_tasks, self.eval_tasks = prl.load_task_sets(self.task, cfg.data.seed)
        self.train_tasks, self.eval_tasks = drop_long_prompts(cfg, self.task, self.train_tasks, self.eval_tasks,
                                                              log=self._print)
        if not self.train_tasks:
            raise ConfigError("run config", "task", "the task source gave no training tasks")
        source_cfg = cfg  # the user's checkpoint, before a warm start replaces model.args.path
        warm = prl.warm_start(cfg, self.task, self.train_tasks, self.world, self.out, log=self._print)
        if warm is not None:
            cfg = prl.with_model_path(cfg, warm)
        self.cfg = cfg
        from models import registry
        self.model_cfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
        if resume_tag is not None:
            pin_plan(cfg, self.ckpt_root, resume_tag)
        self.plan = plan_and_record(cfg, self.world, self.out, resume=(self.ckpt_root, resume_tag))
        for note in prl.plan_notes(source_cfg, self.plan):
            prl.append_plan_note(self.out, self.world, note)

        runtime.seed_everything(cfg.train.seed)
        stage3 = self.plan.zero["stage"] == 3
        ds_for_load = self.plan.ds_config if stage3 else None
        self.plan.shard_at_build = False  # the policy shards itself at load under ZeRO-3 (HfDeepSpeedConfig)
        # The schedule counts optimizer steps: num_iterations per generated batch.
        steps = dataclasses.replace(cfg.train, steps=cfg.train.steps * self.task.num_iterations)
        self.engine = create_engine(lambda: self.rl.build(self.model_cfg, ds_config=ds_for_load),
                                    self.spec.parallelize, self.plan, steps)
        self.guards = RunGuards(cfg, self.world, {"": self.engine})
        self.saver = CheckpointSaver(self.engine, self.ckpt_root, self.world, cfg, self.plan)
        self.tokenizer = prl.task_tokenizer(self.rl, self.model_cfg, self.task)
        self.reference = None
        if self.task.beta > 0:
            self.reference = self.rl.reference(self.model_cfg, self.task.reference,
                                               train_ds_config=self.plan.ds_config, seed=cfg.train.seed)
            prl.append_plan_note(self.out, self.world, prl.frozen_model_note(
                "reference", self.reference, f"task.reference={self.task.reference}"))
        self.pool = sandbox_pool(self.task)
        self.rollouts = None  # set once the engine exists (a Ray actor copies the policy's dtype)
        self.loss_cfg = gm.GRPOLossConfig(eps_low=self.task.epsilon, eps_high=self.task.clip_high,
                                          beta=self.task.beta, loss_type=self.task.loss_type,
                                          max_completion_length=self.task.max_new_tokens)
        self.start_step = 0
        self.keep_rate = None  # dynamic sampling's estimate of the informative fraction (grpo_sampling)
        self.prompt_rest = None  # dynamic sampling's resting prompts (task.dynamic_sampling_rest_steps)
        # dynamic sampling's informative groups kept for the next step (task.dynamic_sampling_carry)
        self.dynamic_reserve = [] if self.task.dynamic_sampling_carry else None
        if resume_tag is not None:
            state = load_checkpoint(self.engine, self.ckpt_root, resume_tag, self.world)
            self.start_step, self.guards.skipped = int(state["step"]), int(state.get("skipped_steps", 0))
            self.take_log_window(state)
            warn_batch_change(self.world, self.ckpt_root / resume_tag, self.start_step, t.steps,
                              state.get("samples_per_step"), self.samples_per_step)
            from dstrain.rl.dapo import KeepRate, PromptRest
            if "dynamic_keep_rate" in state:  # dynamic sampling's running estimate: a resumed run sizes rounds alike
                self.keep_rate = KeepRate(rate=float(state["dynamic_keep_rate"]))
            if "dynamic_prompt_rest" in state and self.task.dynamic_sampling_rest_steps:
                self.prompt_rest = PromptRest.from_state(self.task.dynamic_sampling_rest_steps,
                                                         state["dynamic_prompt_rest"])
            if self.dynamic_reserve is not None:
                self.dynamic_reserve, note = load_reserve(self.ckpt_root / resume_tag, self.world.rank, ws)
                if note:
                    self._print(f"dstrain: {note}")
        self.stop = StopFlag()
        self.rollouts = make_rollout(self, cfg.rollout)

    def _print(self, msg: str) -> None:
        if self.world.is_main:
            print(msg, flush=True)

    @property
    def policy(self):
        return self.engine.module

    # ---------------------------------------------------------------- one step
    def sample(self, step: int) -> StepBatch:
        """This rank's rows of ``step`` with their advantages (see ``grpo_sampling``)."""
        return step_batch(self, step)

    def _logits_logp(self, model, ids, attn):
        logits = model(ids, attention_mask=attn)
        return logits, self.rl.token_logprobs(logits, ids, temperature=self.task.temperature)

    def token_logprobs_now(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """``[B, T-1]`` next-token log-probabilities under the policy as it is (no gradient), on the CPU."""
        dev = self.engine.device
        with torch.no_grad():
            self.engine.eval()
            try:
                return self._logits_logp(self.engine, ids.to(dev), attn.to(dev))[1].float().cpu()
            finally:
                self.engine.train()

    def train_step(self, step: int) -> dict[str, float]:
        t, dev = self.cfg.train, self.engine.device
        step_start = time.perf_counter()
        sb = self.sample(step)
        b = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in sb.batch.items()}
        ids, attn = b["input_ids"], b["attention_mask"]
        weights = sb.weights.to(dev)
        mask = b["completion_mask"][:, 1:].float() * weights[:, None]
        adv = sb.advantages.to(dev)
        stored = sb.old_logprobs.to(dev) if sb.old_logprobs is not None else None  # carried rows; NaN elsewhere
        micro = [slice(i * t.micro_batch, (i + 1) * t.micro_batch) for i in range(t.grad_accum)]
        old = ref = None
        start = time.perf_counter()
        with torch.no_grad():
            if self.reference is not None:
                ref = self.reference.token_logprobs(ids, attn, temperature=self.task.temperature)
        reference_s = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():
            if self.task.num_iterations > 1:
                self.engine.eval()
                old = torch.cat([self._logits_logp(self.engine, ids[m], attn[m])[1] for m in micro])
                self.engine.train()
                old = with_stored(old, stored)
        tokens_global = _sum_all(mask.sum().item())
        rows_global = _sum_all(weights.sum().item())
        short = rows_global < self.samples_per_step  # padding or filtered rows: normalise over the rest
        scale = gm.backward_scale(self.task.loss_type, short, t.grad_accum, self.world.world_size)
        sums = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0}
        ent_sum, count, counted, aux_sum = 0.0, 0, 0, None
        for _ in range(self.task.num_iterations):
            for m in micro:
                logits, logp = self._logits_logp(self.engine, ids[m], attn[m])
                # a carried row's ratio is taken against the policy that sampled it
                old_m = old[m] if old is not None else with_stored(logp.detach(), None if stored is None else stored[m])
                loss, stats = gm.grpo_loss(logp, old_m, None if ref is None else ref[m], adv[m], mask[m],
                                           self.loss_cfg, token_normaliser=tokens_global,
                                           sequence_normaliser=rows_global if short else None)
                total, aux_term = loss * scale, 0.0
                aux, coef = prl.router_aux(self.rl, self.policy)  # a mixture of experts' load-balancing loss
                if aux is not None:  # per micro-batch, over its real tokens: DeepSpeed's mean averages it
                    total = total + coef * aux.float()
                    aux_term, aux_sum = coef * aux.item(), (aux_sum or 0.0) + aux.item()
                self.engine.backward(total)
                self.engine.step()
                with torch.no_grad():
                    ent = self.rl.token_entropy(logits.detach(), temperature=self.task.temperature)
                    ent_sum += (ent * mask[m]).sum().item()
                # the mean over micro-batches and ranks is the step's loss
                sums["loss"] += loss.item() * scale + aux_term
                count += 1
                if mask[m].sum() > 0:  # token means of a micro-batch of padding alone say nothing
                    sums["kl"] += stats.get("kl", 0.0)
                    sums["clip_fraction"] += stats["clip_fraction"]
                    counted += 1
        train_seconds = time.perf_counter() - start
        # over every rank's micro-batch passes and tokens (a rank whose rows all weigh 0, as dynamic sampling can
        # leave one, trains no token: it logged 0 for each before, pulling the mean over ranks down)
        kl_sum, clip_sum, counted, ent_sum = sum_over_ranks([sums["kl"], sums["clip_fraction"], counted, ent_sum])
        out = {"loss": sums["loss"] / count, "kl": kl_sum / max(counted, 1),
               "clip_fraction": clip_sum / max(counted, 1),
               "entropy": ent_sum / max(tokens_global * self.task.num_iterations, 1.0)}
        if self.reference is None:
            out.pop("kl")
        if aux_sum is not None:  # train/router_aux_loss: the mean over micro-batches, without its coefficient
            out["router_aux_loss"] = aux_sum / count
        out.update(sb.log)
        train_tokens = attn.sum().item() * self.task.num_iterations  # tokens of the rows, not their padding
        out.update(gen_tokens=float(sb.gen_tokens), train_tokens=float(train_tokens),
                   gen_tokens_per_s=sb.gen_tokens / max(sb.times["generation"], 1e-9),
                   train_tokens_per_s=train_tokens / max(train_seconds, 1e-9))
        rollouts, sync = getattr(self, "rollouts", None), {}
        if rollouts is not None:
            sync, rollouts.last_sync = rollouts.last_sync, {}
        if sync:  # ray: the weights pushed to the actor before this step's generation
            out.update({"time/weight_sync": sync["weight_sync_s"], "weight_sync_mb": sync["weight_sync_bytes"] / 1e6})
        out.update({"time/generation": sb.times["generation"], "time/reward": sb.times["reward"],
                    "time/reference": reference_s, "time/training": train_seconds,
                    "time/step": time.perf_counter() - step_start})
        return out

    # ---------------------------------------------------------------- loop
    def save(self, step: int) -> None:
        state = {"samples_per_step": self.samples_per_step, "skipped_steps": self.guards.skipped,
                 "log_window": window_state(self.window)}  # the steps since the last log
        if self.keep_rate is not None:
            state["dynamic_keep_rate"] = self.keep_rate.rate
        if self.prompt_rest is not None:
            state["dynamic_prompt_rest"] = self.prompt_rest.state()
        reserve = getattr(self, "dynamic_reserve", None)
        if reserve is None:
            self.saver.save(step, state)
        else:
            rank = self.world.rank
            self.saver.save(step, state, write_extra=lambda tag_dir: save_reserve(tag_dir, rank, list(reserve)))

    def evaluate(self, step: int) -> dict[str, float]:
        stats = prl.evaluate_pass_at_k(self.policy, self.tokenizer, self.rl, self.eval_tasks, self.task,
                                       self.pool, self.world, seed=self.cfg.train.seed + 31 * step)
        self.engine.train()
        return stats

    def one_step(self, step: int) -> dict[str, float]:
        return self.train_step(step)

    def log_extras(self) -> dict[str, float]:
        norm = self.engine.grad_norm
        return {"lr": self.engine.lr, **({"grad_norm": norm} if norm is not None else {})}

    def summary_extras(self) -> dict:
        return {}


plan_notes = prl.plan_notes  # ``dstrain plan``'s hook: notes on the checkpoint's weights


def train(cfg: RunConfig) -> dict:
    return GRPOTrainer(cfg).run()
