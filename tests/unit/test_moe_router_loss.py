"""The router load-balancing (auxiliary) loss of mixture-of-experts policies (Mixtral, Qwen2/3-MoE, OLMoE).

What users expect: a MoE checkpoint whose ``config.json`` has ``output_router_logits: true`` is fine-tuned with
``router_aux_loss_coef x aux_loss`` added to its loss, as transformers' models add it (``load_balancing_loss_func``:
per expert, the fraction of top-k assignments times the mean router probability, over the real tokens of every
layer, times the number of experts) when HF Trainer or TRL train them.

What dstrain did: every forward asked for no router logits (``output_router_logits=False``), so SFT, GRPO and SCoRe
trained on their own losses alone and ``dstrain plan`` only said that the loss was not added.

What it does now: ``model.args.router_aux_loss_coef`` (default: the config's where ``output_router_logits`` is true,
else 0) weighs that loss, computed by the training forward (no KV cache) over the attention mask's tokens and added
to the loss of SFT (the LM trainer and the warm start), GRPO (each micro-batch) and SCoRe (the policy: the mean of
its two turns' forwards; the guidance model: its own); ``train/router_aux_loss`` logs it without its coefficient and
the plan says which coefficient is used. Generation, scoring-only forwards and dense models are as they were.
"""

from __future__ import annotations

import copy
import json
import shutil
import types

import pytest
import torch
import torch.nn.functional as F

from dstrain.config import ConfigError, load_run_config
from dstrain.data.tasks import make_arithmetic_tasks
from dstrain.rewards import code as _verifiers  # noqa: F401  (imported here, not inside a timed test)
from dstrain.rl import episode as ep
from dstrain.rl import grpo_math as gm
from dstrain.trainers import grpo_sampling as gs
from dstrain.trainers import lm
from dstrain.trainers import policy_rl as prl
from dstrain.trainers.grpo import GRPOTrainer
from dstrain.trainers.grpo_config import PolicyTaskConfig
from dstrain.trainers.score_config import ScoreTaskConfig
from dstrain.trainers.score_step import ScoreModels, ScoreStep
from models.policy import RL
from models.policy.config import PolicyConfig
from models.policy.model import build_policy, positions_from_mask, token_logprobs
from models.policy.tokenizer import load_tokenizer
from tests.hf_checkpoints import build_checkpoint
from tests.unit.test_grpo_dapo import FakeEngine

RECIPE = "models/policy/recipes/grpo_debug.json"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Tiny Mixtral checkpoints (4 experts, top-2, 2 layers) with the router loss asked for and not (same weights),
    and a dense Llama."""
    root = tmp_path_factory.mktemp("moe")
    on = build_checkpoint("mixtral", str(root / "on"), config=dict(output_router_logits=True))
    shutil.copytree(on, root / "off")
    conf = json.loads((root / "off" / "config.json").read_text())
    (root / "off" / "config.json").write_text(json.dumps({**conf, "output_router_logits": False}))
    return {"on": on, "off": str(root / "off"), "dense": build_checkpoint("llama", str(root / "dense"))}


def policy(path, **kw):
    return build_policy(PolicyConfig(path=path, **kw))


def left_padded(seed=0, rows=(0, 3, 5, 1), width=9):
    """A left-padded batch: row i has ``rows[i]`` pads, then random tokens (ids 3..40)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (len(rows), width), generator=g)
    attn = (torch.arange(width)[None, :] >= torch.tensor(rows)[:, None]).long()
    return ids * attn, attn


class Routers:
    """Records each layer's router logits ([tokens, experts], with their graph) during forwards."""

    def __init__(self, model):
        self.logits = []
        self.hooks = [m.register_forward_hook(lambda mod, inp, out: self.logits.append(out[0]))
                      for m in model.hf.modules() if type(m).__name__.endswith("TopKRouter")]
        assert len(self.hooks) == model.hf.config.num_hidden_layers

    def take(self):
        out, self.logits = self.logits, []
        return out

    def remove(self):
        for h in self.hooks:
            h.remove()


def hand_aux(layer_logits, attention_mask, top_k, experts):
    """The load-balancing loss by its definition, in float64: over every layer's unpadded tokens, the fraction of
    top-k assignments each expert gets times its mean router probability, summed, times the number of experts."""
    keep = attention_mask.reshape(-1).double()[:, None]
    assigned = prob = 0.0
    for logits in layer_logits:
        p = torch.softmax(logits.double(), dim=-1)
        chosen = torch.zeros_like(p).scatter_(-1, p.topk(top_k, dim=-1).indices, 1.0)
        assigned, prob = assigned + (chosen * keep).sum(0), prob + (p * keep).sum(0)
    rows = keep.sum() * len(layer_logits)
    return experts * ((assigned / rows) * (prob / rows)).sum()


def test_aux_loss_is_the_load_balancing_loss_of_the_unpadded_tokens(ckpt):
    model = policy(ckpt["on"])
    c = model.hf.config
    assert model.router_aux_coef == pytest.approx(0.001)  # the config's router_aux_loss_coef
    ids, attn = left_padded()
    routers = Routers(model)
    model.train()
    logits = model(ids, attention_mask=attn)
    layers = routers.take()
    got = model.router_aux_loss
    expect = hand_aux(layers, attn, c.num_experts_per_tok, c.num_local_experts)
    assert got is not None and got.requires_grad
    assert got.item() == pytest.approx(expect.item(), rel=1e-6)
    with_pads = hand_aux(layers, torch.ones_like(attn), c.num_experts_per_tok, c.num_local_experts)
    assert abs(with_pads.item() - expect.item()) > 1e-3  # the padding is left out, and that shows
    # the loss-returning forward adds coef x aux to the cross-entropy, as transformers does with labels
    targets = torch.where(attn.bool(), ids.roll(-1, 1), torch.full_like(ids, -100))
    loss = model(ids, targets, attention_mask=attn)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
    assert loss.item() == pytest.approx(ce.item() + 0.001 * expect.item(), rel=1e-6)
    # scoring-only forwards (eval, no gradient) ask for no router logits: nothing computed
    with torch.no_grad():
        model(ids, attention_mask=attn)
    assert model.router_aux_loss is None
    model.eval()
    model(ids, attention_mask=attn)
    assert model.router_aux_loss is None
    routers.remove()


def grpo_trainer(model, loss_type="dapo", grad_accum=2, seed=0):
    """A GRPOTrainer (one rank, no reference) training ``model`` on one left-padded StepBatch."""
    ids, attn = left_padded(seed)
    B, T = ids.shape
    cmask = torch.zeros_like(ids)
    cmask[:, 6:] = 1
    batch = {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask}
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    sb = gs.StepBatch(batch, adv, torch.ones(B), {}, {"generation": 0.0, "reward": 0.0}, 0)
    tr = GRPOTrainer.__new__(GRPOTrainer)
    tr.cfg = types.SimpleNamespace(train=types.SimpleNamespace(micro_batch=B // grad_accum, grad_accum=grad_accum))
    tr.engine = FakeEngine(model, grad_accum)
    tr.task = PolicyTaskConfig(loss_type=loss_type, max_new_tokens=T)
    tr.world = types.SimpleNamespace(world_size=1, rank=0)
    tr.samples_per_step, tr.reference = B, None
    tr.loss_cfg = gm.GRPOLossConfig(loss_type=loss_type, max_completion_length=T)
    tr.rl = RL
    tr.sample = lambda step: sb
    model.train()
    return tr, batch, adv


def test_grpo_gradient_is_the_trainer_loss_plus_coef_times_the_aux_loss_by_hand(ckpt):
    coef, GA = 0.5, 2
    model = policy(ckpt["on"], router_aux_loss_coef=coef)
    start = copy.deepcopy(model)
    tr, batch, adv = grpo_trainer(model, "dapo", GA)
    out = tr.train_step(0)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    c = start.hf.config
    start.train()
    routers = Routers(start)
    ids, attn, cmask = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    mask = cmask[:, 1:].float()
    tokens, scale = mask.sum().item(), gm.backward_scale("dapo", False, GA, 1)
    pg = aux = 0.0
    auxes = []
    for m in (slice(0, 2), slice(2, 4)):
        logp = token_logprobs(start(ids[m], attention_mask=attn[m]), ids[m])
        loss, _ = gm.grpo_loss(logp, logp.detach(), None, adv[m], mask[m], tr.loss_cfg, token_normaliser=tokens)
        a = hand_aux(routers.take(), attn[m], c.num_experts_per_tok, c.num_local_experts)
        auxes.append(a.item())
        pg, aux = pg + loss * scale / GA, aux + a / GA  # DeepSpeed's mean over the micro-batches
    routers.remove()
    names = [n for n, _ in start.named_parameters()]
    g_pg = torch.autograd.grad(pg, list(start.parameters()), retain_graph=True, allow_unused=True)
    g_aux = torch.autograd.grad(aux, list(start.parameters()), allow_unused=True)
    router_seen = False
    for n, gp, ga in zip(names, g_pg, g_aux):
        expect = (gp if gp is not None else 0.0) + coef * (ga.float() if ga is not None else 0.0)
        torch.testing.assert_close(grads[n], torch.as_tensor(expect).expand_as(grads[n]), atol=2e-6, rtol=1e-4)
        if ga is not None and "gate" in n:  # the router weights: the aux term moves them visibly
            router_seen = True
            assert (coef * ga).abs().max() > 1e-3
    assert router_seen
    assert out["router_aux_loss"] == pytest.approx(sum(auxes) / GA, rel=1e-6)
    assert out["loss"] == pytest.approx(pg.item() + coef * aux.item(), rel=1e-5)


def spy(model, what):
    """A list that gets ``what(kwargs)`` of each call of the transformers model."""
    seen = []
    model.hf.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(what(kwargs)), with_kwargs=True)
    return seen


def test_coef_0_trains_exactly_as_before_and_logs_no_router_loss(ckpt):
    """``router_aux_loss_coef=0`` on a config asking for the loss: the same loss and gradients, bit for bit, as the
    same weights whose config does not ask for it (what every MoE got before), and no router logits computed."""
    runs = []
    for path, kw in ((ckpt["on"], dict(router_aux_loss_coef=0)), (ckpt["off"], {})):
        model = policy(path, **kw)
        assert model.router_aux_coef == 0.0
        seen = spy(model, lambda k: k.get("output_router_logits"))
        tr, _, _ = grpo_trainer(model)
        out = tr.train_step(0)
        assert "router_aux_loss" not in out and set(seen) == {False}
        runs.append((out["loss"], [p.grad.clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_a_dense_model_forward_and_loss_are_as_before(ckpt):
    model = policy(ckpt["dense"])
    assert model.router_aux_coef == 0.0
    seen = spy(model, sorted)
    ids, attn = left_padded()
    targets = ids.roll(-1, 1)
    model.train()
    loss = model(ids, targets, attention_mask=attn)
    assert seen == [["attention_mask", "input_ids", "position_ids", "use_cache"]]  # no router switch passed
    with torch.no_grad():
        logits = model.hf(input_ids=ids, attention_mask=attn, use_cache=False,
                         **positions_from_mask(model.hf, attn)).logits
    assert torch.equal(loss.detach(), F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                      targets.reshape(-1), ignore_index=-100))
    assert model.router_aux_loss is None
    tr, _, _ = grpo_trainer(model)
    assert "router_aux_loss" not in tr.train_step(0)


class SFTEngine:
    """The LM trainer's engine contract (``engine(x, y)`` returns the loss; a step is always taken)."""

    def __init__(self, module):
        self.module, self.device, self.step_ok, self.losses, self.inputs = module, torch.device("cpu"), None, [], []

    def __call__(self, x, y):
        self.inputs.append((x, y))
        self.losses.append(self.module(x, y))
        return self.losses[-1]

    def backward(self, loss):
        loss.backward()

    def step(self):
        return True


def ce_plus(model, xy, coef):
    """Cross-entropy of ``model`` on ``xy`` (no router logits asked) plus ``coef`` x its aux loss by hand."""
    x, y = xy
    c = model.hf.config
    routers = Routers(model)
    logits = model.hf(input_ids=x, use_cache=False, output_router_logits=False).logits
    aux = hand_aux(routers.take(), torch.ones_like(x), c.num_experts_per_tok, c.num_local_experts)
    routers.remove()
    return (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) + coef * aux).item()


def test_sft_loss_and_warm_start_add_the_router_loss_over_real_tokens(ckpt):
    """The LM trainer's step (SFT) adds it inside the model's loss and keeps it for ``train/router_aux_loss``; the
    warm start's right-padded batch gives the model its attention mask, so the padding is left out."""
    model = policy(ckpt["on"], router_aux_loss_coef=0.25)
    c = model.hf.config
    tr = lm.LMTrainer.__new__(lm.LMTrainer)
    tokens = torch.randint(3, 40, (400,), generator=torch.Generator().manual_seed(3))
    tr.cfg = types.SimpleNamespace(train=types.SimpleNamespace(micro_batch=2, grad_accum=2),
                                   data=types.SimpleNamespace(seq_len=8), parallel=types.SimpleNamespace(sp=1))
    tr.guards = types.SimpleNamespace(begin=lambda n: None, phase=lambda *a: None)
    tr.sampler = types.SimpleNamespace(local_batch_indices=lambda *a: [torch.tensor([0, 10]), torch.tensor([20, 30])])
    tr.train_tokens, tr.pipelined, tr.router_aux, tr.dp_rank, tr.dp_world = tokens, False, [], 0, 1
    tr.first_sample = lambda step: 0
    tr.engine = SFTEngine(model)
    routers = Routers(model)
    model.train()
    _, ok = tr.train_step(0)
    assert ok is None and tr.engine.losses[0].item() == pytest.approx(ce_plus(model, tr.engine.inputs[0], 0.25))
    layers = routers.take()
    expect = [hand_aux(layers[i:i + 2], torch.ones(2, 8), c.num_experts_per_tok, c.num_local_experts).item()
              for i in (0, 2)]
    assert lm.mean_of_taken(tr.router_aux, "router_aux_loss")["router_aux_loss"] == pytest.approx(
        sum(expect) / 2, rel=1e-6)

    tok = load_tokenizer(PolicyConfig(path=ckpt["on"]))
    task = [types.SimpleNamespace(prompt="def add(a, b):\n", reference="    return a + b", stop=["\n"]),
            types.SimpleNamespace(prompt="x", reference="y", stop=["\n"])]
    *_, attn = prl.supervised_batch(tok, [t.prompt for t in task], [prl.completion_target(t) for t in task],
                                      with_mask=True)
    assert attn[1].sum() < attn.shape[1]  # the short row is padded
    model.zero_grad()
    prl.supervised_step(model, torch.optim.SGD(model.parameters(), lr=0.0), tok, task)
    expect = hand_aux(routers.take(), attn, c.num_experts_per_tok, c.num_local_experts)
    assert model.router_aux_loss.item() == pytest.approx(expect.item(), rel=1e-6)
    routers.remove()


class SGD0:
    """The SCoRe step's engine interface on a plain module; keeps each step's gradients (no update: lr 0)."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.last_grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                           for n, p in self.module.named_parameters()}
        self.module.zero_grad(set_to_none=True)


def scripted(tok):
    """``rl.generate`` giving turn-1 answers, hints, turn-2 answers in turn (a few tokens each)."""
    from models.policy import Completion

    script = [["#### 4", "#### 1", "#### 7", "#### 2"], ["ok", "no", "fine", "hm"], ["#### 4"] * 4]
    calls = []

    def generate(model, tokenizer, prompts, **kw):
        texts, out = script[len(calls) % 3], []
        calls.append(model)
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            out.append(Completion(index=i, sample=0, prompt_ids=tok(prompt, add_special_tokens=False)["input_ids"],
                                  completion_ids=tok(text + "\n", add_special_tokens=False)["input_ids"],
                                  text=text, finished=True, stop="\n"))
        return out
    return generate


def test_score_policy_and_guidance_add_their_router_loss(ckpt, monkeypatch):
    """SCoRe: the policy's gradient with coefficient c less its gradient with 0 is c x the gradient of the mean of
    its two turns' aux losses (by hand); both models log theirs."""
    # short episode prompts (the step's code is what is tested, not its templates): a few tokens per row
    monkeypatch.setattr(ep, "turn1_prompt", lambda prompt: prompt[-6:])
    monkeypatch.setattr(ep, "hint_prompt", lambda prompt, answer, key=None: answer[-4:])
    monkeypatch.setattr(ep, "turn2_prompt", lambda prompt, answer, hint: prompt[-3:] + answer[-3:] + hint[-2:])
    tasks = [t for t in make_arithmetic_tasks(20, seed=3)][:2]
    tasks = [tasks[0], tasks[0], tasks[1], tasks[1]]  # 2 prompts x num_generations 2
    task = ScoreTaskConfig(source="arithmetic", num_generations=2, beta1=0.0, beta2=0.0, advantage="group",
                           stage_one_steps=0, max_new_tokens=8, hint_max_new_tokens=8)
    tok = load_tokenizer(PolicyConfig(path=ckpt["on"]))
    base = policy(ckpt["on"], router_aux_loss_coef=1.0)
    grads, inputs = {}, []
    for coef in (1.0, 0.0):
        pol, guide = copy.deepcopy(base), copy.deepcopy(base)
        pol.router_aux_coef = coef
        if coef:  # the policy's forwards: (ids, attention mask) of each
            pol.register_forward_pre_hook(lambda mod, a, k: inputs.append((a[0], k["attention_mask"])),
                                          with_kwargs=True)
        rl = types.SimpleNamespace(**vars(RL))
        rl.generate = scripted(tok)
        engine = SGD0(pol)
        m = ScoreModels(policy=engine, guidance=guide, guidance_engine=SGD0(guide))
        pol.train(), guide.train()
        out = ScoreStep(m, rl, tok, task, pool=None, rank=0, micro_batch=4, grad_accum=1, seed=0).train_step(0, tasks)
        grads[coef] = engine.last_grads
        assert ("router_aux_loss" in out) == (coef > 0) and "guidance_router_aux_loss" in out
    c = base.hf.config
    start = copy.deepcopy(base).train()
    routers = Routers(start)
    auxes = []
    for ids, attn in inputs:
        start(ids, attention_mask=attn)
        auxes.append(hand_aux(routers.take(), attn, c.num_experts_per_tok, c.num_local_experts))
    routers.remove()
    assert len(auxes) == 2 and inputs[0][1].shape != inputs[1][1].shape  # turn 1, turn 2
    mean = (auxes[0] + auxes[1]) / 2
    g = dict(zip([n for n, _ in start.named_parameters()],
                 torch.autograd.grad(mean, list(start.parameters()), allow_unused=True)))
    moved = 0.0
    for n, with_aux in grads[1.0].items():
        expect = g[n].float() if g[n] is not None else torch.zeros_like(with_aux)
        torch.testing.assert_close(with_aux - grads[0.0][n], expect, atol=2e-6, rtol=1e-4)
        moved = max(moved, expect.abs().max().item())
    assert moved > 1e-3


def test_setting_is_validated_and_the_plan_says_which_coefficient(ckpt, tmp_path):
    def note(path, *extra):
        cfg = load_run_config(RECIPE, [f"--model.args.path={path}", *extra])
        (line,) = [n for n in prl.plan_notes(cfg, types.SimpleNamespace(precision="fp32")) if n.startswith("experts:")]
        return line

    on = note(ckpt["on"])
    assert ("load-balancing loss is added to the training loss with coefficient 0.001 (config.json "
            "output_router_logits=true, router_aux_loss_coef=0.001)") in on and "train/router_aux_loss" in on
    assert "with coefficient 0.05 (model.args.router_aux_loss_coef;" in note(
        ckpt["off"], "--model.args.router_aux_loss_coef=0.05")
    zero = note(ckpt["on"], "--model.args.router_aux_loss_coef=0")
    assert "load-balancing loss is not added (coefficient 0: model.args.router_aux_loss_coef=0)" in zero
    assert "not added (coefficient 0: config.json output_router_logits=false" in note(ckpt["off"])
    assert policy(ckpt["off"], router_aux_loss_coef=0.05).router_aux_coef == 0.05
    sft = "models/policy/recipes/sft_debug.json"  # the LM trainer (SFT) notes it too
    assert lm.plan_notes(load_run_config(sft, [f"--model.args.path={ckpt['on']}"]), None) == [on]
    assert lm.plan_notes(load_run_config(sft, [f"--model.args.path={ckpt['dense']}"]), None) == []
    with pytest.raises(ConfigError, match="router_aux_loss_coef=0.1: the checkpoint at .* is dense"):
        load_run_config(RECIPE, [f"--model.args.path={ckpt['dense']}", "--model.args.router_aux_loss_coef=0.1"])
    with pytest.raises(ConfigError, match="router_aux_loss_coef must be a float >= 0"):
        load_run_config(RECIPE, [f"--model.args.path={ckpt['on']}", "--model.args.router_aux_loss_coef=-1"])
    assert load_run_config(RECIPE, [f"--model.args.path={ckpt['dense']}", "--model.args.router_aux_loss_coef=0"])
