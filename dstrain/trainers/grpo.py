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
stored log-probabilities.
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
from dstrain.trainers import policy_rl as prl
from dstrain.trainers import task_config
from dstrain.trainers.common import (StopFlag, decide_resume, load_checkpoint, pin_plan, plan_and_record,
                                     save_checkpoint)
from dstrain.trainers.grpo_config import PolicyTaskConfig
from dstrain.trainers.rl_loop import RLLoop, batch_layout, sandbox_pool


def _sum_all(value: float) -> float:
    import torch.distributed as dist
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.item()


class GRPOTrainer(RLLoop):
    RATE_KEYS = ("gen_tokens_per_s", "train_tokens_per_s")  # every rank generates and trains its share

    def __init__(self, cfg: RunConfig):
        self.world = runtime.init_distributed()
        self.task: PolicyTaskConfig = task_config(cfg)
        t, ws = cfg.train, self.world.world_size
        self.samples_per_step, self.prompts_per_step = batch_layout(t, self.task.num_generations, ws)
        self.local_samples = t.micro_batch * t.grad_accum
        self.out = Path(cfg.output.dir)
        self.ckpt_root = self.out / "checkpoints"
        resume_tag = decide_resume(cfg, self.world, self.out, self.ckpt_root)
        self.spec, _, self.rl = prl.policy_toolkit(cfg)
        self.train_tasks, self.eval_tasks = prl.load_task_sets(self.task, cfg.data.seed)
        if not self.train_tasks:
            raise ConfigError("run config", "task", "the task source gave no training tasks")
        warm = prl.warm_start(cfg, self.task, self.train_tasks, self.world, self.out, log=self._print)
        if warm is not None:
            cfg = prl.with_model_path(cfg, warm)
        self.cfg = cfg
        from models import registry
        self.model_cfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
        if resume_tag is not None:
            pin_plan(cfg, self.ckpt_root, resume_tag)
        self.plan = plan_and_record(cfg, self.world, self.out)

        runtime.seed_everything(cfg.train.seed)
        stage3 = self.plan.zero["stage"] == 3
        ds_for_load = self.plan.ds_config if stage3 else None
        self.plan.shard_at_build = False  # the policy shards itself at load under ZeRO-3 (HfDeepSpeedConfig)
        # The schedule counts optimizer steps: num_iterations per generated batch.
        steps = dataclasses.replace(cfg.train, steps=cfg.train.steps * self.task.num_iterations)
        self.engine = create_engine(lambda: self.rl.build(self.model_cfg, ds_config=ds_for_load),
                                    self.spec.parallelize, self.plan, steps)
        self.tokenizer = self.rl.load_tokenizer(self.model_cfg)
        self.reference = None
        if self.task.beta > 0:
            self.reference = self.rl.reference(self.model_cfg, self.task.reference,
                                               train_ds_config=self.plan.ds_config, seed=cfg.train.seed)
        self.pool = sandbox_pool(self.task)
        self.loss_cfg = gm.GRPOLossConfig(eps_low=self.task.epsilon, eps_high=self.task.clip_high,
                                          beta=self.task.beta, loss_type=self.task.loss_type,
                                          max_completion_length=self.task.max_new_tokens)
        self.start_step = 0
        if resume_tag is not None:
            self.start_step = int(load_checkpoint(self.engine, self.ckpt_root, resume_tag, self.world)["step"])
        self.stop = StopFlag()

    def _print(self, msg: str) -> None:
        if self.world.is_main:
            print(msg, flush=True)

    @property
    def policy(self):
        return self.engine.module

    # ---------------------------------------------------------------- one step
    def sample(self, step: int) -> tuple[prl.Rollout, torch.Tensor, list]:
        """This rank's rollout of ``step``, and its slice of the step's advantages."""
        G, n, r = self.task.num_generations, self.local_samples, self.world.rank
        prompts = prl.step_prompts(len(self.train_tasks), step, self.prompts_per_step, self.cfg.data.seed)
        mine = [self.train_tasks[prompts[s // G]] for s in range(r * n, (r + 1) * n)]
        seed = (self.cfg.train.seed * 1_000_003 + step) * 4099 + r
        roll = prl.rollout(self.policy, self.tokenizer, self.rl, mine, self.task, self.pool, seed)
        rewards = runtime.all_gather_1d(roll.rewards)
        adv = gm.group_advantages(rewards, G, scale=self.task.scale_rewards)
        return roll, adv[r * n:(r + 1) * n], rewards

    def _logits_logp(self, model, ids, attn):
        logits = model(ids, attention_mask=attn)
        return logits, self.rl.token_logprobs(logits, ids, temperature=self.task.temperature)

    def train_step(self, step: int) -> dict[str, float]:
        t, dev = self.cfg.train, self.engine.device
        roll, adv, all_rewards = self.sample(step)
        b = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in roll.batch.items()}
        ids, attn = b["input_ids"], b["attention_mask"]
        mask = b["completion_mask"][:, 1:].float()
        adv = adv.to(dev)
        micro = [slice(i * t.micro_batch, (i + 1) * t.micro_batch) for i in range(t.grad_accum)]
        old = ref = None
        with torch.no_grad():
            if self.task.num_iterations > 1:
                self.engine.eval()
                old = torch.cat([self._logits_logp(self.engine, ids[m], attn[m])[1] for m in micro])
                self.engine.train()
            if self.reference is not None:
                ref = self.reference.token_logprobs(ids, attn, temperature=self.task.temperature)
        tokens_global = _sum_all(mask.sum().item())
        scale = t.grad_accum * self.world.world_size if self.task.loss_type == "dapo" else 1.0
        start = time.perf_counter()
        sums = {"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "entropy": 0.0}
        count = 0
        for _ in range(self.task.num_iterations):
            for m in micro:
                logits, logp = self._logits_logp(self.engine, ids[m], attn[m])
                old_m = old[m] if old is not None else logp.detach()
                loss, stats = gm.grpo_loss(logp, old_m, None if ref is None else ref[m], adv[m], mask[m],
                                           self.loss_cfg, token_normaliser=tokens_global)
                self.engine.backward(loss * scale)
                self.engine.step()
                with torch.no_grad():
                    ent = self.rl.token_entropy(logits.detach(), temperature=self.task.temperature)
                    sums["entropy"] += ((ent * mask[m]).sum() / mask[m].sum().clamp(min=1)).item()
                sums["loss"] += loss.item()
                sums["kl"] += stats.get("kl", 0.0)
                sums["clip_fraction"] += stats["clip_fraction"]
                count += 1
        train_seconds = time.perf_counter() - start
        out = {k: v / count for k, v in sums.items()}
        if self.reference is None:
            out.pop("kl")
        statuses = roll.statuses
        out.update(
            reward_mean=all_rewards.mean().item(),
            reward_std=all_rewards.std().item() if all_rewards.numel() > 1 else 0.0,
            zero_variance_groups=gm.zero_variance_fraction(all_rewards, self.task.num_generations),
            completion_length=roll.gen_tokens / max(len(roll.completions), 1),
            timeout_fraction=sum(s == "timeout" for s in statuses) / max(len(statuses), 1),
            gen_tokens_per_s=roll.gen_tokens / max(roll.gen_seconds, 1e-9),
            train_tokens_per_s=attn.sum().item() * self.task.num_iterations / max(train_seconds, 1e-9))
        return out

    # ---------------------------------------------------------------- loop
    def save(self, step: int) -> None:
        save_checkpoint(self.engine, self.ckpt_root, step, self.world, self.cfg, self.plan,
                        {"samples_per_step": self.samples_per_step})

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


def train(cfg: RunConfig) -> dict:
    return GRPOTrainer(cfg).run()
