"""BiLevel SCoRe trainer: episode prompts, stage I/II wiring against hand computation, KL gradients,
Polyak target, guidance schedule, placement on CPU and ``dstrain plan``'s placement table.

The step runs the trainer's own code (``ScoreStep``) on tiny policies with plain SGD
"engines" and a scripted generator; DeepSpeed engines are covered by the 2-rank dist test.
"""
import copy
import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dstrain import cli, trainers
from dstrain.config import ConfigError, load_run_config, run_config_from_dict
from dstrain.data.tasks import make_arithmetic_tasks
from dstrain.rl import episode as ep
from dstrain.runtime import World
from dstrain.trainers import score_models as sc
from dstrain.trainers import score_warm
from dstrain.trainers.score_config import ScoreTaskConfig
from dstrain.trainers.score_step import ScoreModels, ScoreStep
from models import registry

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "models" / "policy" / "recipes" / "score_debug.json"
SPEC = registry.get_spec("policy")
MCFG = registry.make_model_config("policy", "tiny", {})
TOK = SPEC.rl.load_tokenizer(MCFG)


class SGDEngine:
    """The narrow engine interface on a plain module with SGD; records each step's gradient norm."""

    def __init__(self, module, lr=1e-2):
        self.module, self.device = module, torch.device("cpu")
        self.opt = torch.optim.SGD(module.parameters(), lr=lr)
        self.grad_norms = []

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        grads = [p.grad.norm() for p in self.module.parameters() if p.grad is not None]
        self.grad_norms.append(float(torch.stack(grads).norm()) if grads else 0.0)
        self.last_grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                           for n, p in self.module.named_parameters()}
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def train(self):
        self.module.train()


class ScriptedGenerate:
    """``rl.generate`` returning scripted texts (turn 1, hint, turn 2 in turn) and recording every call."""

    def __init__(self, turn1, hints, turn2):
        self.script, self.calls = [turn1, hints, turn2], []

    def __call__(self, model, tokenizer, prompts, **kw):
        texts = self.script[len(self.calls) % 3]
        self.calls.append(SimpleNamespace(model=model, prompts=list(prompts), kw=kw))
        out = []
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            done = tokenizer(text + "\n", add_special_tokens=False)["input_ids"]
            out.append(_completion(i, ids, done, text))
        return out


def _completion(i, ids, done, text):
    from models.policy import Completion
    return Completion(index=i, sample=0, prompt_ids=ids, completion_ids=done, text=text, finished=True, stop="\n")


TASKS = [t for t in make_arithmetic_tasks(40, seed=3) if t.answer not in ("1", "2", "3")][:2]
A0, A1 = TASKS[0].answer, TASKS[1].answer
EPISODE_TASKS = [TASKS[0], TASKS[0], TASKS[1], TASKS[1]]  # 2 prompts x num_generations 2
TURN1 = [f"#### {A0}", "#### 1", f"#### {A1}", "#### 2"]          # r1 = 1 0 1 0
HINTS = ["looks right", "too small", "fine", "check it"]
TURN2 = [f"#### {A0}", f"#### {A0}", "#### 3", f"#### {A1}"]     # r2 = 1 1 0 1
R1, R2 = [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]


def _task(**kw):
    base = dict(source="arithmetic", num_generations=2, beta1=0.03, beta2=0.7, alpha=10.0, gamma=0.5,
                advantage="critic", tau=0.25, stage_one_steps=1, max_new_tokens=8, hint_max_new_tokens=8)
    return ScoreTaskConfig(**{**base, **kw})


def _perturbed(module, seed, scale=0.05):
    out = copy.deepcopy(module)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return out


def _setup(task, generate=None, frozen_guidance=False):
    torch.manual_seed(0)
    policy = SPEC.rl.build(MCFG)
    guidance = SPEC.rl.build(MCFG)
    rl = SimpleNamespace(**vars(SPEC.rl))
    rl.generate = generate or ScriptedGenerate(TURN1, HINTS, TURN2)
    m = ScoreModels(policy=SGDEngine(policy), guidance=guidance)
    if not frozen_guidance:
        m.guidance_engine = SGDEngine(guidance)
    if task.beta1 > 0 or task.beta2 > 0:
        m.reference = sc.PlacedFrozen(_perturbed(policy, 1), torch.device("cpu"), rl)
    if task.advantage == "critic":
        critic, value = sc.build_value_model(SPEC, MCFG), sc.build_value_model(SPEC, MCFG)
        with torch.no_grad():  # heads start at zero in a run; give them values so Q - V differs per turn
            critic.head.weight.normal_(0, 0.5), value.head.weight.normal_(0, 0.5)
        m.critic, m.value = SGDEngine(critic), SGDEngine(value)
        m.critic_target = _perturbed(critic, 2, scale=0.2).requires_grad_(False)
    runner = ScoreStep(m, rl, TOK, task, pool=None, rank=0, micro_batch=4, grad_accum=1, seed=0)
    return runner, m, rl


# ---------------------------------------------------------------- the episode

def test_episode_builds_each_turns_prompt_from_the_previous_turns():
    runner, m, rl = _setup(_task())
    eps = runner.episodes(0, EPISODE_TASKS)
    t1, hint, t2 = rl.generate.calls
    assert t1.model is m.policy.module and t2.model is m.policy.module and hint.model is m.guidance
    assert t1.prompts == [ep.turn1_prompt(t.prompt) for t in EPISODE_TASKS]
    assert hint.prompts == [ep.hint_prompt(t.prompt, a) for t, a in zip(EPISODE_TASKS, TURN1)]
    assert t2.prompts == [ep.turn2_prompt(t.prompt, a, h) for t, a, h in zip(EPISODE_TASKS, TURN1, HINTS)]
    assert hint.kw["stop"] == ("\n",) and hint.kw["max_new_tokens"] == 8
    assert t1.kw["seed"] != hint.kw["seed"] != t2.kw["seed"]
    assert eps.r1.tolist() == R1 and eps.r2.tolist() == R2  # both turns scored by the maths verifier
    assert [h.text for h in eps.hints] == HINTS


# ---------------------------------------------------------------- stage I / II by hand

def _logp(module, batch):
    logits = module(batch["input_ids"], attention_mask=batch["attention_mask"]).float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def _kl(policy, reference, batch):
    mask = batch["completion_mask"][:, 1:].float()
    d = _logp(reference, batch).detach() - _logp(policy, batch)
    k3 = torch.exp(d) - d - 1
    return ((k3 * mask).sum(1) / mask.sum(1)).mean()


def _packed(call, texts):
    comps = [_completion(i, TOK(p, add_special_tokens=False)["input_ids"],
                         TOK(x + "\n", add_special_tokens=False)["input_ids"], x)
             for i, (p, x) in enumerate(zip(call.prompts, texts))]
    return SPEC.rl.pack(comps, TOK.pad_token_id)


def _expected(snap, calls, task, stage):
    """Loss terms computed by hand from the models as they were before the step."""
    policy, ref, critic, value, target = snap
    turns = [_packed(calls[0], TURN1), _packed(calls[2], TURN2)]
    with torch.no_grad():
        q = [critic(b["input_ids"], b["attention_mask"]) for b in turns]
        v = [value(b["input_ids"], b["attention_mask"] * (1 - b["completion_mask"])) for b in turns]
        tq = [target(b["input_ids"], b["attention_mask"]) for b in turns]
        kl = [_kl(policy, ref, b).item() for b in turns]
    adv = [(q[k] - v[k]).mean().item() for k in range(2)]
    r1, r2 = torch.tensor(R1), torch.tensor(R2)
    big_r1, big_r2 = (torch.zeros(4), r2) if stage == 1 else (r1, r2 + task.alpha * (r2 - r1))
    critic_targets = torch.cat([big_r1 + task.gamma * v[1], big_r2])
    out = {"kl_turn1": kl[0], "kl_turn2": kl[1], "pg_loss_turn2": -adv[1],
           "critic_loss": ((torch.cat(q) - critic_targets) ** 2).mean().item(),
           "value_loss": ((torch.cat(v) - torch.cat(tq)) ** 2).mean().item()}
    if stage == 1:
        out.update(pg_loss_turn1=0.0, loss=-adv[1] + task.beta2 * kl[0] + task.beta1 * kl[1])
    else:
        out.update(pg_loss_turn1=-adv[0], loss=-adv[0] - adv[1] + task.beta1 * (kl[0] + kl[1]))
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_losses_match_hand_computation(stage):
    task = _task()
    runner, m, rl = _setup(task)
    step = 0 if stage == 1 else 5
    snap = tuple(copy.deepcopy(x) for x in (m.policy.module, m.reference.module, m.critic.module,
                                             m.value.module, m.critic_target))
    stats = runner.train_step(step, EPISODE_TASKS)
    want = _expected(snap, rl.generate.calls, task, stage)
    assert stats["stage"] == stage
    for key, value in want.items():
        assert stats[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert abs(want["kl_turn1"] - want["kl_turn2"]) > 1e-3 and abs(want["pg_loss_turn1"] - want["pg_loss_turn2"]) > 1e-3
    assert stats["kl_coef_turn1"] == (task.beta2 if stage == 1 else task.beta1)
    assert stats["accuracy@t1"] == 0.5 and stats["accuracy@t2"] == 0.75 and stats["delta(t1,t2)"] == 0.25
    assert stats["incorrect_to_correct"] == 0.5 and stats["correct_to_incorrect"] == 0.25
    assert stats["guidance_reward"] == pytest.approx(0.25)


def test_group_advantages_use_each_prompts_group():
    task = _task(advantage="group", gamma=0.0, beta1=0.0, beta2=0.0)
    runner, m, _ = _setup(task)
    stats = runner.train_step(5, EPISODE_TASKS)  # stage II
    big_r1 = R1
    big_r2 = [b + 10 * (b - a) for a, b in zip(R1, R2)]  # 1, 11, -10, 11

    def group_abs_mean(xs):
        out = []
        for g in (xs[:2], xs[2:]):
            mu, sd = statistics.mean(g), statistics.stdev(g)
            out += [abs(x - mu) / (sd + 1e-4) if sd > 0 else 0.0 for x in g]
        return statistics.mean(out)
    assert stats["advantage_turn1"] == pytest.approx(group_abs_mean(big_r1), rel=1e-5)
    assert stats["advantage_turn2"] == pytest.approx(group_abs_mean(big_r2), rel=1e-5)
    assert m.critic is None and "critic_loss" not in stats


# ---------------------------------------------------------------- gradients, Polyak, guidance

@pytest.mark.parametrize("beta1, beta2", [(0.0, 0.0), (0.02, 0.5)])
def test_kl_gradient_reaches_the_policy_with_zero_advantages(beta1, beta2):
    """Stage I with every advantage 0: the policy's gradient is exactly that of beta2 KL1 + beta1 KL2."""
    same = ["#### 1"] * 4  # every reward 0: group advantages are all 0
    task = _task(advantage="group", beta1=beta1, beta2=beta2)
    runner, m, rl = _setup(task, ScriptedGenerate(same, HINTS, same))
    policy = copy.deepcopy(m.policy.module)
    stats = runner.train_step(0, EPISODE_TASKS)
    assert stats["advantage_turn1"] == 0 and stats["advantage_turn2"] == 0
    if not beta2:
        assert m.policy.grad_norms[-1] == 0.0
        return
    calls, ref = rl.generate.calls, m.reference.module
    loss = beta2 * _kl(policy, ref, _packed(calls[0], same)) + beta1 * _kl(policy, ref, _packed(calls[2], same))
    loss.backward()
    assert stats["kl_turn1"] > 0 and m.policy.grad_norms[-1] > 1e-4
    for name, p in policy.named_parameters():
        torch.testing.assert_close(m.policy.last_grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_target_critic_moves_toward_critic_by_tau():
    task = _task(tau=0.25)
    runner, m, _ = _setup(task)
    before = {k: v.clone() for k, v in m.critic_target.state_dict().items()}
    runner.train_step(0, EPISODE_TASKS)
    critic = m.critic.module.state_dict()
    moved = False
    for name, p in m.critic_target.named_parameters():
        want = 0.75 * before[name] + 0.25 * critic[name]
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
        moved |= not torch.equal(p.detach(), before[name])
    assert moved


def test_guidance_trains_on_its_own_schedule_and_not_when_frozen():
    runner, m, _ = _setup(_task(guidance_every=2))
    for step in range(3):
        runner.train_step(step, EPISODE_TASKS)
    assert len(m.guidance_engine.grad_norms) == 2 and m.guidance_engine.grad_norms[0] > 0  # steps 0 and 2
    runner, m, _ = _setup(_task(), frozen_guidance=True)
    before = copy.deepcopy(m.guidance.state_dict())
    stats = runner.train_step(0, EPISODE_TASKS)
    assert "guidance_loss" not in stats
    assert all(torch.equal(before[k], v) for k, v in m.guidance.state_dict().items())


# ---------------------------------------------------------------- config, warm start, placement

def test_registered_and_recipe_validates():
    assert trainers.task_config_class("score") is ScoreTaskConfig
    cfg = load_run_config(RECIPE)
    task = trainers.task_config(cfg)
    assert isinstance(task, ScoreTaskConfig) and task.stage(task.stage_one_steps - 1) == 1
    assert task.stage(task.stage_one_steps) == 2


@pytest.mark.parametrize("override, key, message", [
    ("--task.advantage=td", "task.advantage", "task.advantage must be one of critic, group"),
    ("--task.gamma=1.5", "task.gamma", "task.gamma must be within"),
    ("--task.tau=0", "task.tau", "task.tau must be within"),
    ("--task.beta=0.1", "task.beta", "task.beta is GRPO's"),
    ("--task.guidance_every=0", "task.guidance_every", "task.guidance_every must be at least 1"),
    ("--task.critic_lr=0", "task.critic_lr", "task.critic_lr must be positive"),
    ("--placement.critic.device=gpu", "placement.critic.device", "cuda:N"),
])
def test_bad_settings_name_the_key(override, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config(RECIPE, [override])
    assert err.value.key == key


def test_other_trainers_refuse_a_placement_section():
    data = json.loads((ROOT / "models" / "policy" / "recipes" / "grpo_debug.json").read_text())
    data["placement"] = {"policy": {"device": "cpu"}}
    with pytest.raises(ConfigError, match="takes no placement section"):
        run_config_from_dict(data, "recipe")


def test_warm_start_examples_and_verdicts():
    t = TASKS[0]
    assert score_warm.verdict(t, t.reference) == score_warm.CORRECT
    high = f"#### {int(t.answer) + 5}"
    assert score_warm.verdict(t, high) == score_warm.TOO_HIGH
    assert score_warm.verdict(t, f"#### {int(t.answer) - 5}") == score_warm.TOO_LOW
    pol = score_warm.policy_examples(TASKS, 0)
    assert pol[0].prompt == ep.turn1_prompt(t.prompt) and pol[0].reference == t.reference
    assert pol[1].prompt.startswith(ep.turn2_prompt(t.prompt, "", "").split("Previous")[0])
    guid = score_warm.guidance_examples(TASKS, 0)
    assert all(g.prompt.endswith("Hint:\n") and g.reference in (score_warm.CORRECT, score_warm.TOO_HIGH,
                                                                   score_warm.TOO_LOW) for g in guid)
    import random
    assert score_warm.corrupt("#### 42", random.Random(0)) != "#### 42"


def test_default_placement_on_a_cpu_machine_puts_every_model_on_cpu():
    cfg = load_run_config(RECIPE)
    p = sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=0, local_ranks=2)
    world = World(0, 2, 0, 2, torch.device("cpu"))
    assert {sc.torch_device(p.role(r).device, world).type for r in sc.pl.ROLES} == {"cpu"}


def test_impossible_placements_are_refused():
    cfg = load_run_config(RECIPE, ["--placement.policy.device=cuda:3"])
    with pytest.raises(ConfigError, match="cuda:3 but this machine has no GPU") as err:
        sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=0, local_ranks=1)
    assert err.value.key == "placement.policy.device"
    cfg = load_run_config(RECIPE, ["--placement.critic.device=cuda:1"])
    with pytest.raises(ConfigError, match="engine runs on its rank's own GPU"):
        sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=2, local_ranks=1)
    cfg = load_run_config(RECIPE, ["--placement.reference.device=cuda:1"])  # a plain module may go there
    p = sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=2, local_ranks=1)
    assert sc.torch_device(p.reference.device, World(0, 1, 0, 1, torch.device("cuda", 0))) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="each rank owns 1 GPU"):
        sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=2, local_ranks=2)


@pytest.fixture
def quick_hardware(monkeypatch):
    from dstrain.engine import hardware
    monkeypatch.setattr(hardware, "cpu_bf16_is_fast", lambda *a, **k: (False, "bf16 not measured (test)"))


def test_plan_prints_the_placement_table(capsys, quick_hardware):
    assert cli.main(["plan", str(RECIPE), "--device", "cpu"]) == 0  # the same table on a GPU machine
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()
            and line.split()[0] in sc.pl.ROLES}
    assert set(rows) == set(sc.pl.ROLES)
    assert all(row[1] == "cpu" for row in rows.values())
    assert rows["reference"][2:4] == ["module", "(frozen)"] and rows["critic"][2:5] == ["engine", "zero0", "(trained)"]
    assert "activations:" in out and "(fits)" in out


def _between_policy_alone_and_all_six():
    """A CPU budget (bytes) in which the policy's engine plan fits but the six models do not."""
    from dstrain.engine.factory import plan_engine
    cfg = load_run_config(RECIPE)
    plan = plan_engine(cfg, 1, ranks_per_node=1, device_type="cpu")
    alone = next(e.device_total for e in plan.plan.estimates if e.profile == plan.profile)
    task = trainers.task_config(cfg)
    p = sc.with_profiles(sc.resolve_placement(cfg, task, 0, 1), sc.role_profiles(sc.resolve_placement(
        cfg, task, 0, 1), task, plan.profile), False)
    counts, largest = sc.param_counts(SPEC, MCFG, task)
    total = sc.pl.placement_memory(p, counts, "fp32", 1, 1, largest)["cpu"] + sc.policy_activations(plan)
    assert total > alone * 1.1
    return int((alone + total) / 2 / cfg.deepspeed.margin)


@pytest.mark.parametrize("args, message", [
    (["--placement.policy.device=cuda:3"], "placement.policy.device: cuda:3 but this machine has no GPU"),
    (["--deepspeed.device_memory=1MB"], "no profile fits"),  # the policy alone does not fit
    ("between", "placement does not fit: cpu needs"),  # the policy does, all six do not
    (["--device", "cuda", "--device-memory", "80GB", "--deepspeed.host_memory=100KB"],
     "placement does not fit: cpu needs"),  # on GPUs: the CPU-placed reference and target critic
])
def test_plan_refuses_a_placement_that_does_not_fit(capsys, quick_hardware, args, message):
    if args == "between":
        args = [f"--deepspeed.device_memory={_between_policy_alone_and_all_six()}"]
    if "--device" not in args:
        args = [*args, "--device", "cpu"]  # plan for a CPU machine even where a GPU is visible
    assert cli.main(["plan", str(RECIPE), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_task_guidance_frozen_implies_a_frozen_guidance_placement():
    cfg = load_run_config(RECIPE, ["--task.guidance_frozen=true", "--placement.guidance.engine=false"])
    p = sc.resolve_placement(cfg, trainers.task_config(cfg), cuda_count=0, local_ranks=1)
    assert p.guidance.frozen and p.kind("guidance") == "module (frozen)"
    with pytest.raises(ConfigError, match="guidance is trained, so it needs a DeepSpeed engine"):
        load_run_config(RECIPE, ["--placement.guidance.engine=false"])


@pytest.mark.parametrize("optimizer", ["auto", "deepspeed"])
def test_role_plans_carry_their_own_learning_rate(quick_hardware, optimizer):
    """critic_lr / value_lr / guidance_lr reach the optimizer whether dstrain builds torch's AdamW
    (the JSON's optimizer block is consumed into the plan) or DeepSpeed builds it from the JSON."""
    from dstrain.engine.factory import plan_engine
    from dstrain.optim.lazy_state import client_optimizer
    cfg = load_run_config(RECIPE, [f"--train.optimizer={optimizer}"])
    plan = plan_engine(cfg, 1, ranks_per_node=1, device_type="cpu")
    world = SimpleNamespace(is_main=True, world_size=1, local_world_size=1, device=torch.device("cpu"))
    role = sc.role_plan(plan, cfg, world, plan.profile, 3e-3)
    if optimizer == "deepspeed":
        assert client_optimizer(role.optimizer, role.ds_config) is None
        assert role.ds_config["optimizer"]["params"]["lr"] == 3e-3
    else:
        opt = client_optimizer(role.optimizer, role.ds_config)([torch.nn.Parameter(torch.zeros(2))])
        assert [g["lr"] for g in opt.param_groups] == [3e-3]
    assert client_optimizer(plan.optimizer, plan.ds_config) is None or plan.optimizer.params["lr"] == cfg.train.lr
