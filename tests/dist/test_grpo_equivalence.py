"""A 2-rank GRPO step whose prompt groups span ranks equals a plain single-process step.

Generation is replaced by a fixed table (completion text and reward per global sample
index) so that both sides see the same samples; everything after it is the trainer's
own code on 2 gloo ranks with DeepSpeed (reward gather, group advantages, k3 KL
against the CPU reference, loss aggregation over micro-batches and ranks, clipping,
AdamW). The reference side is written out here with plain PyTorch: advantages with
numpy, log-probabilities with log_softmax, torch.optim.AdamW.
"""
import math

import numpy as np
import pytest
import torch

from tests.dist import spawn

G, MICRO, ACCUM, WORLD = 4, 3, 2, 2          # 12 samples per step: 3 prompts x 4, group 1 on both ranks
TEXTS = ["x + 1", "x * 2", "x - 3", "-x", "x ** 2", "x % 3", "x + x", "2 - x", "x", "3 * x", "x // 2", "1"]
REWARDS = [1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1]
# Adam's first step is lr * g / (|g| + eps): with a tiny eps, gradients at rounding-noise level
# (1e-9) turn into full-size updates of either sign. eps = 1 makes the step about lr * g, so the
# weights compare the gradients themselves.
BETA, LR, EPS = 0.05, 1.0, 1.0


def overrides(out, loss_type):
    return [f"--output.dir={out}", "--task.warm_start_steps=0", "--task.n_train=16", "--task.n_eval=4",
            f"--task.num_generations={G}", f"--task.beta={BETA}", f"--task.loss_type={loss_type}",
            f"--train.micro_batch={MICRO}", f"--train.grad_accum={ACCUM}", f"--train.lr={LR}", f"--train.eps={EPS}",
            "--train.warmup_steps=0", "--train.weight_decay=0.0", "--train.grad_clip=1.0",
            "--train.steps=1", "--train.eval_every=0", "--deepspeed.profile=zero0",
            "--deepspeed.precision=fp32", "--output.tensorboard=false", "--output.progress=false"]


def fake_rollout(rank, n):
    from dstrain.trainers import policy_rl as prl
    from models.policy import Completion

    def rollout(model, tokenizer, rl, tasks, task, pool, seed, prompts=None):
        comps, rewards = [], []
        for j, t in enumerate(tasks):
            g = rank * n + j
            p_ids = tokenizer(t.prompt, add_special_tokens=False)["input_ids"]
            c_ids = tokenizer(TEXTS[g] + "\n", add_special_tokens=False)["input_ids"]
            comps.append(Completion(j, 0, p_ids, c_ids, TEXTS[g], True, "\n"))
            rewards.append(float(REWARDS[g]))
        return prl.Rollout(comps, rl.pack(comps, tokenizer.pad_token_id), torch.tensor(rewards),
                           ["passed"] * len(comps), 1.0, sum(len(c.completion_ids) for c in comps))
    return rollout


def _train_one_step(rank, world, out, loss_type, recipe):
    from dstrain.config import load_run_config
    from dstrain.trainers import grpo, policy_rl
    cfg = load_run_config(recipe, overrides(out, loss_type))
    policy_rl.rollout = fake_rollout(rank, MICRO * ACCUM)
    trainer = grpo.GRPOTrainer(cfg)
    prompts = policy_rl.step_prompts(len(trainer.train_tasks), 0, trainer.prompts_per_step, cfg.data.seed)
    stats = trainer.train_step(0)
    state = trainer.rl.full_state_dict(trainer.policy)
    trainer.pool.close()
    return {"state": state, "prompts": [trainer.train_tasks[i].prompt for i in prompts], "stats": stats}


def plain_step(recipe, out, prompts, loss_type):
    """One GRPO step on all 12 samples in one process, written out independently."""
    from dstrain.config import load_run_config
    from models import registry
    from models.policy import build_policy, load_tokenizer
    cfg = load_run_config(recipe, overrides(out, loss_type))
    mcfg = registry.make_model_config("policy", cfg.model.size, cfg.model.args)
    torch.manual_seed(cfg.train.seed)
    model = build_policy(mcfg)
    torch.manual_seed(cfg.train.seed)
    ref = build_policy(mcfg).eval()
    tok = load_tokenizer(mcfg)
    rows, masks = [], []
    for g in range(len(TEXTS)):
        p = tok(prompts[g // G], add_special_tokens=False)["input_ids"]
        c = tok(TEXTS[g] + "\n", add_special_tokens=False)["input_ids"]
        rows.append(p + c)
        masks.append([0] * len(p) + [1] * len(c))
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])[:, 1:].float()
    r = np.array(REWARDS, dtype=np.float64).reshape(-1, G)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-4)
    adv = torch.tensor(adv.reshape(-1), dtype=torch.float32)

    def logp_of(m):
        logits = m.hf(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    with torch.no_grad():
        ref_logp = logp_of(ref)
    logp = logp_of(model)
    ratio = torch.exp(logp - logp.detach())
    delta = ref_logp - logp
    per_token = -ratio * adv[:, None] + BETA * (torch.exp(delta) - delta - 1)
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1)).mean()
    else:  # dapo: one token mean over the whole global batch
        loss = (per_token * mask).sum() / mask.sum()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=tuple(cfg.train.betas),
                            eps=cfg.train.eps)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


LOSS_TYPES = ["grpo", "dapo"]


def _train_one_step_each(rank, world, out, recipe):
    """``_train_one_step`` for every loss type, one trainer after the other in the same 2 processes."""
    return {t: _train_one_step(rank, world, f"{out}_{t}", t, recipe) for t in LOSS_TYPES}


@pytest.fixture(scope="module")
def two_rank_steps(tmp_path_factory):
    """loss type -> what rank 0's ``_train_one_step`` returned: one spawn of 2 ranks for both loss types."""
    from tests.dist.harness import ROOT
    recipe = ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"
    return spawn.run(_train_one_step_each, WORLD, str(tmp_path_factory.mktemp("grpo_steps") / "run"), str(recipe),
                     timeout=600)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_rank_step_with_split_groups_equals_plain_step(loss_type, two_rank_steps, tmp_path):
    from tests.dist.harness import ROOT
    recipe = ROOT / "models" / "policy" / "recipes" / "grpo_debug.json"
    got = two_rank_steps[loss_type]
    expect = plain_step(recipe, tmp_path / "plain", got["prompts"], loss_type)
    torch.manual_seed(0)
    from dstrain.config import load_run_config
    from models.policy import build_policy
    from models import registry
    cfg = load_run_config(recipe, overrides(tmp_path, loss_type))
    torch.manual_seed(cfg.train.seed)
    start = build_policy(registry.make_model_config("policy", cfg.model.size, cfg.model.args)).state_dict()
    moved = max((expect[k] - start[k]).abs().max().item() for k in expect)
    assert moved > 1e-4, "the plain step did not change the weights: the comparison would prove nothing"
    worst = max((got["state"][k] - expect[k]).abs().max().item() for k in expect)
    assert worst < 1e-5, f"2-rank GRPO step differs from the plain step by {worst:.2e} (weights moved {moved:.2e})"
    assert got["stats"]["reward_mean"] == pytest.approx(np.mean(REWARDS))
    assert got["stats"]["zero_variance_groups"] == pytest.approx(0.0)
    assert math.isfinite(got["stats"]["kl"])
