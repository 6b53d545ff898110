"""One BiLevel SCoRe step on already-built models: the episode, then every model's update.

Kept apart from start-up (``score.py``) so it runs on any objects with the narrow engine
interface (``__call__``, ``module``, ``device``, ``backward``, ``step``): DeepSpeed engines in
a run, plain optimisers in the unit tests.

Episode (per rank, ``n = micro_batch x grad_accum`` episodes): turn 1 (policy, on
``episode.turn1_prompt``) -> hint (guidance, on ``episode.hint_prompt``; one line) -> turn 2
(policy, on ``episode.turn2_prompt``), both turns scored by the task's verifier. Rewards are
gathered from every rank (groups of ``num_generations`` may straddle ranks).

Updates, in order, all from the same episodes:

1. advantages, before any update: ``critic`` -> ``Q(s_k, a_k) - V(s_k)`` per turn (the critic
   reads prompt + answer, the value function the prompt alone: the same rows with the answer
   masked out); ``group`` -> shaped rewards normalised per prompt group, turn 1 on
   ``R1 + gamma R2``;
2. policy: ``score_math.score_objective`` per micro-batch (stage from the step), KL per turn
   against the frozen reference on log-probs that carry gradient; a mixture of experts whose
   router load-balancing coefficient is above 0 adds ``coef x`` the mean of the two turns'
   forwards' load-balancing losses (logged: ``router_aux_loss``, and inside ``loss``);
3. critic: MSE to ``(R1 + gamma V(s2), R2)``, then the target critic is Polyak-averaged
   toward it in chunks (``polyak_update_``);
4. value: MSE to the target critic's ``Q_target(s, a_taken)`` (computed in step 1);
5. guidance, every ``guidance_every`` steps unless frozen: REINFORCE on the hint tokens with
   reward ``r2 - r1``, normalised within each prompt's group as GRPO does (a hint whose
   turn 2 improved more than its siblings' is reinforced; a group where every hint did
   the same gets no gradient), per-sequence token mean; plus its own router load-balancing
   term where it has one (``guidance_router_aux_loss``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dstrain.rl import episode as ep
from dstrain.rl import score_math as sm
from dstrain.rl.polyak import polyak_update_
from dstrain.runtime import all_gather_1d, all_reduce
from dstrain.trainers import policy_rl as prl
from dstrain.trainers.score_warm import HINT_STOP, NO_HINT, answer_key, leaks_answer


@dataclass
class FixedHint:
    """The hint of a run without a guidance model (``task.guidance: none``): no tokens generated."""

    text: str = NO_HINT
    completion_ids: tuple = ()


@dataclass
class ScoreModels:
    """Every model of the run; absent ones are None."""

    policy: Any
    """Trained engine of the policy."""
    guidance: Any
    """What generates hints (the engine, or a frozen module / inference engine)."""
    guidance_engine: Any = None
    """The guidance model's trained engine (None when frozen)."""
    reference: Any = None
    """Frozen reference: ``token_logprobs(ids, mask, temperature)`` (None without KL terms)."""
    critic: Any = None
    value: Any = None
    critic_target: torch.nn.Module | None = None


@dataclass
class Episodes:
    """One rank's episodes of a step, and every rank's rewards."""

    tasks: list
    turn1: prl.Rollout
    hints: list
    turn2: prl.Rollout
    r1: torch.Tensor
    """Turn-1 rewards of every episode of the step (all ranks, in order)."""
    r2: torch.Tensor
    seconds: dict = field(default_factory=dict)
    leaks: torch.Tensor | None = None
    """1 where the hint states the maths answer (every rank's episodes, in order)."""


class ScoreStep:
    """Runs episodes and updates on ``models`` (see the module docstring)."""

    def __init__(self, models: ScoreModels, rl, tokenizer, task, pool, rank: int, micro_batch: int,
                 grad_accum: int, seed: int, rollouts=None):
        self.m, self.rl, self.tok, self.task, self.pool = models, rl, tokenizer, task, pool
        self.rollouts = rollouts  # dstrain.rl.rollout backend for the policy's turns (None: in this process)
        self.rank, self.micro_batch, self.grad_accum, self.seed = rank, micro_batch, grad_accum, seed
        self.n = micro_batch * grad_accum

    # ---------------------------------------------------------------- episode
    def hints(self, tasks: list, turn1_texts: list[str], seed: int | None, greedy: bool = False) -> list:
        if self.task.guidance == "none":
            return [FixedHint() for _ in tasks]
        key = self.task.guidance_key
        prompts = [ep.hint_prompt(t.prompt, a, answer_key(t) if key else None) for t, a in zip(tasks, turn1_texts)]
        kw = {"greedy": True} if greedy else dict(temperature=self.task.temperature, top_p=self.task.top_p,
                                                  seed=seed)
        return self.rl.generate(self.m.guidance, self.tok, prompts, max_new_tokens=self.task.hint_max_new_tokens,
                                stop=HINT_STOP, **kw)

    def episodes(self, step: int, tasks: list) -> Episodes:
        """Sample this rank's two-turn episodes of ``step`` for ``tasks`` and score both turns."""
        base = ((self.seed * 1_000_003 + step) * 4099 + self.rank) * 3
        seconds = {}
        start = time.perf_counter()
        turn1 = self._rollout(tasks, base, [ep.turn1_prompt(t.prompt) for t in tasks])
        t1_texts = [c.text for c in turn1.completions]
        mid = time.perf_counter()
        hints = self.hints(tasks, t1_texts, base + 1)
        seconds["generate_guidance"] = time.perf_counter() - mid
        prompts2 = [ep.turn2_prompt(t.prompt, a, h.text) for t, a, h in zip(tasks, t1_texts, hints)]
        turn2 = self._rollout(tasks, base + 2, prompts2)
        seconds["generate_policy"] = time.perf_counter() - start - seconds["generate_guidance"]
        leaks = all_gather_1d(torch.tensor([float(leaks_answer(t, h.text)) for t, h in zip(tasks, hints)]))
        return Episodes(tasks, turn1, hints, turn2, all_gather_1d(turn1.rewards), all_gather_1d(turn2.rewards), seconds,
                        leaks)

    # ---------------------------------------------------------------- helpers
    def _rollout(self, tasks: list, seed: int, prompts: list[str]):
        if self.rollouts is not None:
            return self.rollouts.run(tasks, seed, prompts=prompts)
        return prl.rollout(self.m.policy.module, self.tok, self.rl, tasks, self.task, self.pool, seed,
                           prompts=prompts)

    def _micro(self) -> list[slice]:
        return [slice(i * self.micro_batch, (i + 1) * self.micro_batch) for i in range(self.grad_accum)]

    def _mine(self, values: torch.Tensor) -> torch.Tensor:
        return values[self.rank * self.n:(self.rank + 1) * self.n]

    @staticmethod
    def _to(batch: dict, dev) -> dict:
        return {k: v.to(dev) for k, v in batch.items()}

    def _logp(self, engine, ids, attn):
        return self.rl.token_logprobs(engine(ids, attention_mask=attn), ids, temperature=self.task.temperature)

    def _logp_aux(self, engine, ids, attn):
        """(log-probs, (router load-balancing loss, its coefficient) of that forward, or None for a model with no
        such loss: ``policy_rl.router_aux``)."""
        logp = self._logp(engine, ids, attn)
        aux, coef = prl.router_aux(self.rl, engine.module)
        return logp, None if aux is None else (aux.float(), coef)

    @torch.no_grad()
    def _target_q(self, ids, attn, dev):
        target = self.m.critic_target
        tdev = next(target.parameters()).device
        return target(ids.to(tdev), attn.to(tdev)).float().to(dev)

    # ---------------------------------------------------------------- step
    def train_step(self, step: int, tasks: list) -> dict[str, float]:
        """Episodes of ``step`` and one update of every trained model; local statistics."""
        task, m = self.task, self.m
        eps = self.episodes(step, tasks)
        seconds = dict(eps.seconds)
        stage = task.stage(step)
        R1_all, R2_all = sm.shaped_rewards(eps.r1, eps.r2, stage, task.alpha)
        dev = m.policy.device
        b1, b2 = self._to(eps.turn1.batch, dev), self._to(eps.turn2.batch, dev)
        ids1, attn1, ids2, attn2 = b1["input_ids"], b1["attention_mask"], b2["input_ids"], b2["attention_mask"]
        mask1, mask2 = b1["completion_mask"][:, 1:].float(), b2["completion_mask"][:, 1:].float()
        start = time.perf_counter()
        if m.reference is not None:
            ref1 = m.reference.token_logprobs(ids1, attn1, temperature=task.temperature)
            ref2 = m.reference.token_logprobs(ids2, attn2, temperature=task.temperature)
        seconds["reference"] = time.perf_counter() - start
        out: dict[str, float] = {}

        # 1. advantages (and the value function's targets), before any update
        if task.advantage == "critic":
            start = time.perf_counter()
            with torch.no_grad():
                s1, s2 = attn1 * (1 - b1["completion_mask"]), attn2 * (1 - b2["completion_mask"])
                q1, q2 = m.critic(ids1, attention_mask=attn1).float(), m.critic(ids2, attention_mask=attn2).float()
                v1, v2 = m.value(ids1, attention_mask=s1).float(), m.value(ids2, attention_mask=s2).float()
                adv1, adv2 = sm.critic_advantages(q1, v1), sm.critic_advantages(q2, v2)
                tq1, tq2 = self._target_q(ids1, attn1, dev), self._target_q(ids2, attn2, dev)
            seconds["advantages"] = time.perf_counter() - start
            out.update(q_turn1=q1.mean().item(), q_turn2=q2.mean().item(), v_turn1=v1.mean().item(),
                       v_turn2=v2.mean().item())
        else:
            G, scale = task.num_generations, task.scale_rewards
            adv1 = self._mine(sm.group_advantages(R1_all + task.gamma * R2_all, G, scale)).to(dev)
            adv2 = self._mine(sm.group_advantages(R2_all, G, scale)).to(dev)
        out.update(advantage_turn1=adv1.abs().mean().item(), advantage_turn2=adv2.abs().mean().item())

        # 2. policy
        start = time.perf_counter()
        sums: dict[str, float] = {}
        for s in self._micro():
            (logp1, aux1), (logp2, aux2) = self._logp_aux(m.policy, ids1[s], attn1[s]), \
                self._logp_aux(m.policy, ids2[s], attn2[s])
            turn1 = sm.TurnBatch(logp1, logp1.detach(), ref1[s] if m.reference is not None else logp1.detach(),
                                 mask1[s])
            turn2 = sm.TurnBatch(logp2, logp2.detach(), ref2[s] if m.reference is not None else logp2.detach(),
                                 mask2[s])
            loss, stats = sm.score_objective(turn1, turn2, adv1[s], adv2[s], stage, task.beta1, task.beta2)
            if aux1 is not None:  # a mixture of experts: the two turns' mean load-balancing loss, weighted
                aux, coef = (aux1[0] + aux2[0]) / 2, aux1[1]
                loss = loss + coef * aux
                stats = {**stats, "loss": stats["loss"] + coef * aux.item(), "router_aux_loss": aux.item()}
            m.policy.backward(loss)
            m.policy.step()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v / self.grad_accum
        out.update(sums)
        seconds["policy"] = time.perf_counter() - start

        if task.advantage == "critic":
            self._train_critics(R1_all, R2_all, v2, tq1, tq2, ids1, attn1, ids2, attn2, s1, s2, out, seconds)
        if m.guidance_engine is not None and step % task.guidance_every == 0:
            self._train_guidance(eps, out, seconds)
        out.update(self._episode_stats(eps, stage))
        out.update({f"time/{k}": v for k, v in seconds.items()})
        return out

    def _train_critics(self, R1_all, R2_all, v2, tq1, tq2, ids1, attn1, ids2, attn2, s1, s2, out, seconds):
        m, task = self.m, self.task
        dev = m.policy.device
        t1, t2 = sm.episode_critic_targets(self._mine(R1_all).to(dev), self._mine(R2_all).to(dev), v2, task.gamma)
        start = time.perf_counter()
        total = self._regress(m.critic, sm.critic_loss, ids1, attn1, ids2, attn2, t1, t2)
        seconds["critic"] = time.perf_counter() - start
        start = time.perf_counter()
        polyak_update_(m.critic_target, m.critic.module, task.tau)
        seconds["critic_target"] = time.perf_counter() - start
        start = time.perf_counter()
        vtotal = self._regress(m.value, sm.value_loss, ids1, s1, ids2, s2, tq1, tq2)
        seconds["value"] = time.perf_counter() - start
        out.update(critic_loss=total, value_loss=vtotal)

    def _regress(self, engine, loss_fn, ids1, mask1, ids2, mask2, target1, target2) -> float:
        """One optimizer step of a scalar head on both turns' inputs; returns the mean loss."""
        total = 0.0
        for s in self._micro():
            pred = torch.cat([engine(ids1[s], attention_mask=mask1[s]), engine(ids2[s], attention_mask=mask2[s])])
            loss = loss_fn(pred, torch.cat([target1[s], target2[s]]))
            engine.backward(loss)
            engine.step()
            total += loss.item() / self.grad_accum
        return total

    def _train_guidance(self, eps: Episodes, out: dict, seconds: dict) -> None:
        engine, task = self.m.guidance_engine, self.task
        start = time.perf_counter()
        reward = sm.guidance_rewards(eps.r1, eps.r2, eps.leaks)
        adv = self._mine(sm.group_advantages(reward, task.num_generations, task.scale_rewards))
        b = self._to(self.rl.pack(eps.hints, self.tok.pad_token_id), engine.device)
        ids, attn, mask = b["input_ids"], b["attention_mask"], b["completion_mask"][:, 1:].float()
        adv = adv.to(engine.device)
        total = 0.0
        aux_total = None
        for s in self._micro():
            logp, aux = self._logp_aux(engine, ids[s], attn[s])
            loss = sm.masked_sequence_mean(-adv[s, None] * logp, mask[s]).mean()
            if aux is not None:  # the guidance model's own load-balancing loss (a mixture of experts)
                loss = loss + aux[1] * aux[0]
                aux_total = (aux_total or 0.0) + aux[0].item() / self.grad_accum
            engine.backward(loss)
            engine.step()
            total += loss.item() / self.grad_accum
        seconds["guidance"] = time.perf_counter() - start
        out["guidance_loss"] = total
        if aux_total is not None:
            out["guidance_router_aux_loss"] = aux_total

    def _episode_stats(self, eps: Episodes, stage: int) -> dict[str, float]:
        # correct = every test passed (reward 1), as the held-out evaluation counts it: with partial credit a
        # reward of 2/3 is not a solved task
        stats = ep.transition_stats((eps.r1 == 1.0).float().tolist(), (eps.r2 == 1.0).float().tolist())
        stats.pop("episodes")
        n = max(len(eps.hints), 1)
        return {**stats, "stage": float(stage), "reward_t1": eps.r1.mean().item(), "reward_t2": eps.r2.mean().item(),
                "guidance_reward": sm.guidance_rewards(eps.r1, eps.r2).mean().item(),
                "hint_length": sum(len(h.completion_ids) for h in eps.hints) / n,
                "hint_leak": eps.leaks.mean().item() if eps.leaks is not None else 0.0,
                "completion_length_t1": eps.turn1.gen_tokens / n, "completion_length_t2": eps.turn2.gen_tokens / n}

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, tasks: list, world) -> dict[str, float]:
        """Greedy two-turn episodes on held-out ``tasks`` (split over ranks): accuracy per turn, transitions,
        and ``pass@1``, the greedy final (turn-2) answer's pass rate."""
        mine = tasks[world.rank::world.world_size]
        stops = tuple(dict.fromkeys(s for t in tasks for s in t.stop))
        kw = dict(greedy=True, max_new_tokens=self.task.max_new_tokens, stop=stops)
        pol = self.m.policy.module
        t1 = self.rl.generate(pol, self.tok, [ep.turn1_prompt(t.prompt) for t in mine], **kw)
        hints = self.hints(mine, [c.text for c in t1], None, greedy=True)
        t2 = self.rl.generate(pol, self.tok, [ep.turn2_prompt(t.prompt, a.text, h.text)
                                              for t, a, h in zip(mine, t1, hints)], **kw)
        sums = torch.zeros(6, dtype=torch.float64)  # tasks, t1 correct, t2 correct, i->c, c->i, hint leaks
        if mine:
            r1, _ = prl.score(mine, [c.text for c in t1], self.pool, False)
            r2, _ = prl.score(mine, [c.text for c in t2], self.pool, False)
            c1, c2 = [x == 1.0 for x in r1], [x == 1.0 for x in r2]
            sums += torch.tensor([len(mine), sum(c1), sum(c2), sum(not a and b for a, b in zip(c1, c2)),
                                  sum(a and not b for a, b in zip(c1, c2)),
                                  sum(leaks_answer(t, h.text) for t, h in zip(mine, hints))], dtype=torch.float64)
        return eval_stats(*all_reduce(sums).tolist())


def eval_stats(tasks: float, t1_correct: float, t2_correct: float, i2c: float, c2i: float,
               leaks: float = 0.0) -> dict[str, float]:
    """Held-out statistics from the summed counts: accuracies, transitions, and the 95% interval of
    ``delta(t1,t2)`` (Newcombe's paired score interval over the ``tasks`` pairs)."""
    n = max(tasks, 1.0)
    acc1, acc2 = t1_correct / n, t2_correct / n
    out = {"pass@1": acc2, "accuracy@t1": acc1, "accuracy@t2": acc2, "delta(t1,t2)": acc2 - acc1,
           "incorrect_to_correct": i2c / n, "correct_to_incorrect": c2i / n, "hint_leak": leaks / n, "tasks": tasks}
    if tasks > 0:
        both = t1_correct - c2i
        _, low, high = sm.paired_difference_interval(both, c2i, i2c, tasks - both - c2i - i2c)
        out.update({"delta_ci95_low": low, "delta_ci95_high": high})
    return out
