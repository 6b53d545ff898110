"""The batch a GRPO step trains on: sampled, scored, shaped, filtered, and (with
``task.dynamic_sampling``) refilled until every group in it teaches something.

:func:`plain_batch` is GRPO as before: sample ``s`` of the step answers prompt ``s // G``,
rank ``r`` holds samples ``[r n, (r + 1) n)`` (a group may span two ranks, so rewards
are gathered before the advantages).

:func:`dynamic_batch` is DAPO's dynamic sampling. Decision: **each rank fills its own
share** with whole groups (``n`` must be a multiple of ``G``), and **all ranks run the
same number of rounds** (an all-reduce of "still short" after each round). Why: groups
never span ranks, so no completion or token tensor has to move between ranks and the
advantages need no gather; and generation is a collective under ZeRO-3 (parameters are
gathered around each call), so a rank that is already full still calls ``generate``,
with no prompts, while the others refill. Round 0 samples the step's regular prompts;
refill round ``k`` samples ``dapo.refill_prompts(seed, step, k, rank)`` (pure, resume-exact).
Rounds are sized so that one batched generation call usually fills the share
(:func:`round_size`): from a running estimate of the informative fraction (all ranks' counts,
a moving average over steps, kept in checkpoints), round 0 adds fresh groups (drawn as
"round 0" refills) and every refill samples groups for the whole deficit at once, as many as
give the least expected sampling time (``task.dynamic_sampling_sizing``). Every round costs a
generation call (its decoding steps are sequential whatever the batch), a sandbox pass and a
cross-rank synchronisation; fewer, larger rounds are what keeps the overhead down.
With ``task.dynamic_sampling_rest_steps`` (:class:`dapo.PromptRest`), prompts whose latest group
agreed rest: resting regular prompts are swapped for fresh ones (drawn as "round -1"), and round-0
extras and refills leave out resting prompts and those this rank dropped earlier in the step; every
rank's (prompt, informative) outcomes are gathered after the step, so the rest is the same everywhere.
With ``task.dynamic_sampling_carry`` a rank keeps its informative groups beyond the share (up to
one share, with each completion's log-probabilities under the policy that sampled it: one forward
without gradient) and uses them in the next step where round 0 falls short, before any refill; round 0
is then sized to the share less the kept groups over the estimated informative fraction (at least the
regular prompts), so that the kept groups, not
refill rounds, absorb the step-to-step spread, and no informative group is generated only to be
thrown away. A kept group is one update old: the trainer's clipped ratio is taken against its stored
log-probabilities. The kept groups go into checkpoints, one file per rank (:func:`save_reserve`).
When the cap of rounds is reached with a share still short, that rank trains on the
groups it kept, padded to its ``n`` rows with dropped samples of weight 0 (their loss
mask is zero), and the loss is normalised over the kept samples of the whole batch
(``grpo_math`` ``sequence_normaliser``): the step then equals training on the kept
samples alone. With nothing kept anywhere the step's gradient is zero.

Both paths apply the overlong switches: ``overlong_buffer`` adds DAPO's soft punishment
to the reward before advantages (and before the zero-variance test);
``overlong_filter`` gives weight 0 to completions that ``max_new_tokens`` cut.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from dstrain import runtime
from dstrain.rl import dapo
from dstrain.rl import grpo_math as gm
from dstrain.rl.rollout import LocalRollout
from dstrain.trainers import policy_rl as prl


@dataclass
class StepBatch:
    """This rank's rows of one step and what the log needs."""

    batch: dict
    """Packed rows (``input_ids``, ``attention_mask``, ``completion_mask``), ``n`` of them."""
    advantages: torch.Tensor
    """``[n]``: 0 on rows of weight 0."""
    weights: torch.Tensor
    """``[n]`` float: 1 for trained rows, 0 for padding and overlong-filtered rows."""
    log: dict = field(default_factory=dict)
    """reward_mean/std (verifier rewards of the step's regular prompts, every rank), etc."""
    times: dict = field(default_factory=dict)
    """Seconds: ``generation`` (weight gathering under ZeRO-3 included), ``reward``."""
    gen_tokens: int = 0
    old_logprobs: torch.Tensor | None = None
    """``[n, T-1]`` log-probabilities of carried rows' completion tokens under the policy that sampled
    them (``task.dynamic_sampling_carry``), NaN elsewhere; None when no row was carried."""


@dataclass
class CarriedGroup:
    """An informative group kept for the next step (``task.dynamic_sampling_carry``)."""

    rewards: list
    """The group's ``G`` shaped rewards."""
    items: list
    """Its ``G`` completions."""
    old: list
    """Per completion, a 1-D fp32 tensor: each completion token's log-probability under the policy
    that sampled it."""


RESERVE_FILE, RESERVE_GLOB = "dynamic_reserve_rank{:05d}.pt", "dynamic_reserve_rank*.pt"


def save_reserve(tag_dir, rank: int, reserve: list[CarriedGroup]) -> None:
    """This rank's kept groups into checkpoint folder ``tag_dir``."""
    from pathlib import Path
    torch.save([(g.rewards, g.items, g.old) for g in reserve], Path(tag_dir) / RESERVE_FILE.format(rank))


def load_reserve(tag_dir, rank: int, world_size: int) -> tuple[list[CarriedGroup], str]:
    """(This rank's kept groups of checkpoint ``tag_dir``, a note when they cannot be used): none when
    the checkpoint holds none or was written by another number of ranks (each rank's groups are its own)."""
    from pathlib import Path
    files = sorted(Path(tag_dir).glob(RESERVE_GLOB))
    if not files:
        return [], ""
    if len(files) != world_size:
        return [], (f"the checkpoint's dynamic-sampling groups kept for the next step were written by {len(files)} "
                    f"ranks, not {world_size}: the resumed run starts without them")
    saved = torch.load(Path(tag_dir) / RESERVE_FILE.format(rank), weights_only=False)  # our own file
    return [CarriedGroup(list(r), list(i), list(o)) for r, i, o in saved], ""


def _max_all(value: float) -> float:
    return runtime.all_reduce(torch.tensor([value], dtype=torch.float64), "max").item()


def shaped_rewards(raw: torch.Tensor, completions: list, task) -> torch.Tensor:
    """Verifier rewards plus DAPO's soft overlong punishment when ``task.overlong_buffer`` > 0."""
    if not task.overlong_buffer or not completions:
        return raw.clone()
    lengths = torch.tensor([len(c.completion_ids) for c in completions])
    return raw + dapo.overlong_penalty(lengths, task.max_new_tokens, task.overlong_buffer, task.overlong_penalty)


def row_weights(completions: list, task) -> torch.Tensor:
    """1 per row, 0 where ``task.overlong_filter`` drops a completion that was cut."""
    return torch.tensor([0.0 if task.overlong_filter and not c.finished else 1.0 for c in completions])


def generate_and_score(tr, tasks: list, seed: int) -> tuple:
    """(completions, verifier rewards, shaped rewards, statuses, generation s, reward s) through the
    trainer's rollout backend (``dstrain.rl.rollout``); every rank must call it together (``tasks`` may be empty: the rank
    still takes part in the collective generation of ZeRO-3)."""
    task, rollouts = tr.task, getattr(tr, "rollouts", None)
    if not tasks:
        start = time.perf_counter()
        if rollouts is not None and not isinstance(rollouts, LocalRollout):
            rollouts.run([], seed)  # joins the (collective) weight push; the actor has nothing to do
        else:
            tr.rl.generate(tr.policy, tr.tokenizer, [], num_samples=1, temperature=task.temperature,
                           top_p=task.top_p, max_new_tokens=task.max_new_tokens, stop=(), seed=seed)
        empty = torch.zeros(0)
        return [], empty, empty, [], time.perf_counter() - start, 0.0
    roll = (rollouts.run(tasks, seed) if rollouts is not None
            else prl.rollout(tr.policy, tr.tokenizer, tr.rl, tasks, task, tr.pool, seed))
    raw = roll.rewards.float()
    return (roll.completions, raw, shaped_rewards(raw, roll.completions, task), roll.statuses, roll.gen_seconds,
            roll.score_seconds)


def _round0_log(raw: torch.Tensor, shaped: torch.Tensor, completions: list, statuses: list, G: int) -> dict:
    all_raw, all_shaped = runtime.all_gather_1d(raw), runtime.all_gather_1d(shaped)
    out = {"reward_mean": all_raw.mean().item(),
           "reward_std": all_raw.std().item() if all_raw.numel() > 1 else 0.0,
           "zero_variance_groups": gm.zero_variance_fraction(all_shaped, G),
           "completion_length": sum(len(c.completion_ids) for c in completions) / max(len(completions), 1),
           "timeout_fraction": sum(s == "timeout" for s in statuses) / max(len(statuses), 1)}
    return out, all_shaped


def plain_batch(tr, step: int) -> StepBatch:
    G, n, r = tr.task.num_generations, tr.local_samples, tr.world.rank
    prompts = prl.step_prompts(len(tr.train_tasks), step, tr.prompts_per_step, tr.cfg.data.seed)
    mine = [tr.train_tasks[prompts[s // G]] for s in range(r * n, (r + 1) * n)]
    seed = (tr.cfg.train.seed * 1_000_003 + step) * 4099 + r
    completions, raw, shaped, statuses, gen_s, score_s = generate_and_score(tr, mine, seed)
    log, all_shaped = _round0_log(raw, shaped, completions, statuses, G)
    adv = gm.group_advantages(all_shaped, G, scale=tr.task.scale_rewards)[r * n:(r + 1) * n]
    weights = row_weights(completions, tr.task)
    if tr.task.overlong_filter:
        log["overlong_filtered"] = 1.0 - weights.mean().item()
    return StepBatch(tr.rl.pack(completions, tr.tokenizer.pad_token_id), adv * weights, weights, log,
                     {"generation": gen_s, "reward": score_s}, sum(len(c.completion_ids) for c in completions))


def keep_rate(tr) -> dapo.KeepRate:
    """The trainer's running estimate of the informative fraction (created on first use from
    ``task.dynamic_sampling_oversample``; a resumed trainer sets it from its checkpoint)."""
    if getattr(tr, "keep_rate", None) is None:
        tr.keep_rate = dapo.KeepRate(rate=1.0 / (1.0 + tr.task.dynamic_sampling_oversample))
    return tr.keep_rate


PRIOR_GROUPS = 4
"""Weight, in groups, of the running estimate against the groups already seen in this step when a
refill round is sized."""


def round_size(task, filler: dapo.GroupFiller, estimate: float) -> int:
    """Groups the next round samples (round 0 included: the regular ones plus fresh ones).

    The informative fraction is the running ``estimate`` shrunk toward what this step has seen so
    far; a round samples at most ``(1 + max_oversample) x`` the share. ``cost`` sizing: the size of
    least expected sampling time for ``filler.deficit`` (:func:`dapo.groups_for_cost`); ``target``:
    the fewest groups that cover the deficit with that probability; ``fixed``: round 0 samples
    ``ceil(oversample x share)`` extra, refills ``filler.next_count()``."""
    needed, sizing = filler.needed, task.dynamic_sampling_sizing
    if sizing == "fixed":
        if filler.rounds == 0:
            return needed + math.ceil(task.dynamic_sampling_oversample * needed)
        return filler.next_count()
    informative = filler.generated - filler.dropped
    p = (PRIOR_GROUPS * estimate + informative) / (PRIOR_GROUPS + filler.generated)
    cap = max(filler.deficit, math.floor((1.0 + task.dynamic_sampling_max_oversample) * needed))
    if sizing == "target":
        return dapo.groups_for_target(filler.deficit, p, task.dynamic_sampling_target, cap)
    return dapo.groups_for_cost(filler.deficit, p, task.dynamic_sampling_round_cost, cap)


def carry_round0(task, fresh: int, share: int, estimate: float, regular: int) -> int:
    """Round 0's groups under ``task.dynamic_sampling_carry``: as many as are expected to give ``fresh``
    informative groups (the share less the groups kept from the last step: ``fresh / estimate``), so
    that the kept groups are used before they age out; at least the ``regular`` prompts, at most
    ``(1 + max_oversample) x`` the ``share``."""
    cap = max(regular, math.floor((1.0 + task.dynamic_sampling_max_oversample) * share))
    return min(cap, max(regular, math.ceil(max(fresh, 0) / max(estimate, 1e-6) - 1e-9)))


def behaviour_logprobs(tr, items: list) -> list[torch.Tensor]:
    """Each completion's token log-probabilities under the policy now (before the step's update): one 1-D
    fp32 tensor per item. Every rank calls it together and runs as many forwards as the rank with the
    most rows (ZeRO-3 gathers parameters in each); a rank with none left forwards a one-token stand-in."""
    import types
    mb = max(int(tr.cfg.train.micro_batch), 1)
    pad = tr.tokenizer.pad_token_id
    out: list[torch.Tensor] = []
    for c in range(int(_max_all(float(math.ceil(len(items) / mb))))):
        part = items[c * mb:(c + 1) * mb]
        rows = part or [types.SimpleNamespace(prompt_ids=[pad], completion_ids=[pad])]
        batch = tr.rl.pack(rows, pad)
        logp = tr.token_logprobs_now(batch["input_ids"], batch["attention_mask"])
        for i, comp in enumerate(part):
            p, length = len(comp.prompt_ids), len(comp.completion_ids)
            out.append(logp[i, p - 1:p - 1 + length].detach().float().cpu().clone())
    return out


def with_stored(old: torch.Tensor, stored: torch.Tensor | None) -> torch.Tensor:
    """``old`` log-probabilities with the carried rows' stored ones (non-NaN entries of ``stored``) in place."""
    if stored is None:
        return old
    return torch.where(torch.isnan(stored), old, stored.to(old.dtype))


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each of ``values`` summed over every rank (one all-reduce of host float64s)."""
    return runtime.all_reduce(torch.tensor(values, dtype=torch.float64)).tolist()


def prompt_rest(tr) -> dapo.PromptRest | None:
    """The trainer's resting prompts (``task.dynamic_sampling_rest_steps``; None when off; a resumed
    trainer sets it from its checkpoint)."""
    if not tr.task.dynamic_sampling_rest_steps:
        return None
    if getattr(tr, "prompt_rest", None) is None:
        tr.prompt_rest = dapo.PromptRest(tr.task.dynamic_sampling_rest_steps)
    return tr.prompt_rest


def _record_outcomes(rest: dapo.PromptRest, step: int, outcomes: list[tuple[int, bool]]) -> None:
    """Feed every rank's (prompt, informative) groups of the step, in rank order, to ``rest``."""
    rest.record(step, [o for part in runtime.all_gather_object(outcomes) for o in part])


def dynamic_batch(tr, step: int) -> StepBatch:
    task, G, n, r = tr.task, tr.task.num_generations, tr.local_samples, tr.world.rank
    n_tasks, seed = len(tr.train_tasks), tr.cfg.data.seed
    carry = task.dynamic_sampling_carry
    filler = dapo.GroupFiller(needed=n // G, group_size=G, carry_limit=n // G if carry else 0)
    reserve = list(getattr(tr, "dynamic_reserve", None) or []) if carry else []
    carried_old: dict[int, torch.Tensor] = {}  # kept row -> its log-probabilities under the sampling policy
    estimate, rest = keep_rate(tr), prompt_rest(tr)
    prompts = prl.step_prompts(n_tasks, step, tr.prompts_per_step, seed)
    groups = [prompts[s // G] for s in range(r * n, (r + 1) * n, G)]
    skip = rest.resting(step) if rest is not None else frozenset()
    swapped = [i for i, g in enumerate(groups) if g in skip]
    if swapped:  # resting regular prompts: fresh ones in their place
        fresh = iter(dapo.refill_prompts(n_tasks, step, -1, r, len(swapped), seed, skip | set(groups)))
        for i in swapped:
            groups[i] = next(fresh)
    round0 = (carry_round0(task, filler.needed - len(reserve), filler.needed, estimate.rate, len(groups)) if carry
              else round_size(task, filler, estimate.rate))
    log_estimate = estimate.rate
    if round0 > len(groups):  # round 0 also samples fresh prompts, so that one round usually fills the share
        taken = skip | set(groups) if rest is not None else frozenset()
        groups += dapo.refill_prompts(n_tasks, step, 0, r, round0 - len(groups), seed, taken)
    base = (tr.cfg.train.seed * 1_000_003 + step) * 4099 + r
    times, tokens, log, refill_s, outcomes = {"generation": 0.0, "reward": 0.0}, 0, {}, 0.0, []
    while True:
        tasks = [tr.train_tasks[i] for i in groups for _ in range(G)]
        completions, raw, shaped, statuses, gen_s, score_s = generate_and_score(tr, tasks, base + 7919 * filler.rounds)
        times["generation"] += gen_s
        times["reward"] += score_s
        if filler.rounds > 0:
            refill_s += gen_s + score_s
        tokens += sum(len(c.completion_ids) for c in completions)
        if filler.rounds == 0:  # the step's regular prompts: comparable with plain GRPO's log
            log, _ = _round0_log(raw[:n], shaped[:n], completions[:n], statuses[:n], G)
        informative = filler.add(shaped, completions)
        if rest is not None and groups:
            outcomes += zip(groups, informative)
            skip = skip | {g for g, ok in outcomes if not ok}  # dropped in this step: not drawn again
        if filler.rounds == 1:  # the last step's kept groups make up round 0's shortfall
            for group in reserve:
                if filler.deficit <= 0:
                    break
                carried_old.update({len(filler.kept_items) + j: lp for j, lp in enumerate(group.old)})
                filler.add_carried(group.rewards, group.items)
        if _max_all(float(filler.deficit > 0)) == 0 or filler.rounds >= task.dynamic_sampling_max_rounds:
            break
        groups = dapo.refill_prompts(n_tasks, step, filler.rounds, r, round_size(task, filler, estimate.rate),
                                     seed, skip)
    informative, generated = sum_over_ranks([filler.generated - filler.dropped, filler.generated])
    estimate.update(informative, generated)  # the same on every rank: global counts
    if rest is not None:
        _record_outcomes(rest, step, outcomes)
        log.update({"dynamic/resting_prompts": float(len(rest.resting(step + 1))),
                    "dynamic/swapped_regular": float(len(swapped))})
    if carry:  # this step's spare groups, with their log-probabilities under the policy that sampled them
        spare = filler.spare_items
        old_lp = behaviour_logprobs(tr, spare)
        tr.dynamic_reserve = [CarriedGroup(filler.spare_rewards[i:i + G], spare[i:i + G], old_lp[i:i + G])
                              for i in range(0, len(spare), G)]
    kept = filler.kept_items
    rows = kept + filler.filler_items[:n - len(kept)]
    weights = torch.cat([row_weights(kept, task), torch.zeros(len(rows) - len(kept))])
    adv = torch.zeros(n)
    flat_groups = 0.0
    if kept:
        kept_rewards = torch.tensor(filler.kept_rewards)
        adv[:len(kept)] = gm.group_advantages(kept_rewards, G, scale=task.scale_rewards)
        flat_groups = gm.zero_variance_fraction(kept_rewards, G) * (len(kept) // G)
    # over every rank's trained rows (ranks keep different numbers of them; one keeping none logged 0 before)
    flat_groups, groups, cut, trained = sum_over_ranks(
        [flat_groups, float(len(kept) // G), float(len(kept)) - weights[:len(kept)].sum().item(), float(len(kept))])
    log["trained_zero_variance_groups"] = flat_groups / groups if groups else 0.0
    log.update({f"dynamic/{k}": v for k, v in filler.stats().items()})
    log.update({"dynamic/round0_groups": float(round0), "dynamic/keep_rate_estimate": log_estimate,
                "dynamic/generated_per_trained": filler.generated / filler.needed,
                "dynamic/refill_seconds": refill_s})  # generation + verifiers of the rounds after the first
    if task.overlong_filter:
        log["overlong_filtered"] = cut / trained if trained else 0.0
    packed = tr.rl.pack(rows, tr.tokenizer.pad_token_id)
    old = None
    if carried_old:
        old = torch.full((len(rows), packed["input_ids"].shape[1] - 1), float("nan"))
        for i, lp in carried_old.items():
            p = len(rows[i].prompt_ids)
            old[i, p - 1:p - 1 + lp.numel()] = lp
    return StepBatch(packed, adv * weights, weights, log, times, tokens, old)


def step_batch(tr, step: int) -> StepBatch:
    return dynamic_batch(tr, step) if tr.task.dynamic_sampling else plain_batch(tr, step)
