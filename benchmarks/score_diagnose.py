"""Can turn 2 use the hint? A few-minute diagnostic of SCoRe's supervised warm start, no RL.

    python benchmarks/score_diagnose.py --steps 400 --batch 32 --lr 3e-3 --size tiny

Warm-starts the policy on ``score_warm.policy_examples`` of the choice tasks (plain AdamW, as the
trainer's warm start does), then runs greedy episodes on the held-out tasks and prints, as fractions:
``offered`` (turn-1 answers that are one of the two offered numbers), ``acc@t1``, and ``acc@t2``
with the previous attempt = the policy's own turn 1 and the hint = an oracle verdict
(``score_warm.verdict`` against the key), or the fixed no-guidance hint (``score_warm.NO_HINT``).
With ``--json`` the figures are also written there, with the command and the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch


def offered_fraction(tasks, texts) -> float:
    from dstrain.data.choice_tasks import choices
    from dstrain.rewards.maths import extract_final_answer
    hits = [extract_final_answer(x) in (choices(t.prompt) or ()) for t, x in zip(tasks, texts)]
    return sum(hits) / max(len(hits), 1)


def evaluate(model, tok, rl, tasks, max_new_tokens: int = 10) -> dict[str, float]:
    """Greedy held-out figures of a warm-started policy (see the module docstring)."""
    from dstrain.rl import episode as ep
    from dstrain.trainers import policy_rl as prl
    from dstrain.trainers import score_warm as sw
    kw = dict(greedy=True, max_new_tokens=max_new_tokens, stop=("\n",))
    t1 = [c.text for c in rl.generate(model, tok, [ep.turn1_prompt(t.prompt) for t in tasks], **kw)]
    r1, _ = prl.score(tasks, t1, None, False)
    out = {"tasks": len(tasks), "offered": offered_fraction(tasks, t1), "acc@t1": sum(r1) / len(tasks)}
    for name, hint in (("oracle", lambda t, a: sw.verdict(t, a)), ("fixed", lambda t, a: sw.NO_HINT)):
        prompts = [ep.turn2_prompt(t.prompt, a, hint(t, a)) for t, a in zip(tasks, t1)]
        t2 = [c.text for c in rl.generate(model, tok, prompts, **kw)]
        r2, _ = prl.score(tasks, t2, None, False)
        fixed = sum(1 for a, b in zip(r1, r2) if a < 1 <= b)
        broken = sum(1 for a, b in zip(r1, r2) if b < 1 <= a)
        wrong1 = max(1, sum(1 for a in r1 if a < 1))
        right1 = max(1, sum(1 for a in r1 if a >= 1))
        out.update({f"acc@t2_{name}": sum(r2) / len(tasks), f"fixes_{name}": fixed / wrong1,
                    f"keeps_{name}": 1 - broken / right1, f"offered_t2_{name}": offered_fraction(tasks, t2)})
    return out


def train(rl, mcfg, tok, examples, args, report, init=None):
    """Plain AdamW on ``examples``' references (as the trainer's warm start), from ``init``'s weights
    when given; ``report(model, step, s)`` every ``args.eval_every`` steps and at the end, outside the
    training time."""
    import copy

    from dstrain.trainers import policy_rl as prl
    torch.manual_seed(0)
    model = rl.build(mcfg) if init is None else copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed + 17)
    train_s, losses = 0.0, []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        model.train()
        batch = [examples[rng.randrange(len(examples))] for _ in range(args.batch)]
        losses.append(prl.supervised_step(model, opt, tok, batch))
        train_s += time.perf_counter() - start
        if step % max(1, args.steps // 10) == 0:
            print(f"step {step}: loss {sum(losses) / len(losses):.3f} ({train_s:.0f} s)", flush=True)
            losses = []
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            report(model, step, train_s)
    return model


def verdict_accuracy(policy, guidance, tok, rl, tasks) -> dict[str, float]:
    """How often the guidance model's greedy hint on the policy's greedy turn 1 is the true verdict."""
    from dstrain.rl import episode as ep
    from dstrain.trainers import score_warm as sw
    t1 = [c.text for c in rl.generate(policy, tok, [ep.turn1_prompt(t.prompt) for t in tasks], greedy=True,
                                      max_new_tokens=10, stop=("\n",))]
    prompts = [ep.hint_prompt(t.prompt, a, sw.answer_key(t)) for t, a in zip(tasks, t1)]
    hints = [c.text.strip() for c in rl.generate(guidance, tok, prompts, greedy=True, max_new_tokens=10,
                                                 stop=sw.HINT_STOP)]
    truth = [sw.verdict(t, a) for t, a in zip(tasks, t1)]
    return {"verdict_right": sum(h == v for h, v in zip(hints, truth)) / len(tasks),
            "says_wrong_when_right": sum(h != sw.CORRECT and v == sw.CORRECT for h, v in zip(hints, truth)) / len(tasks),
            "says_right_when_wrong": sum(h == sw.CORRECT and v != sw.CORRECT for h, v in zip(hints, truth)) / len(tasks)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--n-train", type=int, default=3000)
    ap.add_argument("--n-eval", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eval-every", type=int, default=0, help="also evaluate every k steps (0: at the end)")
    ap.add_argument("--turn2", default="verdict", help="warm-start mode after a verdict hint (task.warm_turn2)")
    ap.add_argument("--guidance-steps", type=int, default=0,
                    help="also warm-start a guidance model (shown the key) and score its verdicts")
    ap.add_argument("--guidance-lr", type=float, default=0.0, help="(0: --lr)")
    ap.add_argument("--guidance-from-policy", action="store_true",
                    help="start the guidance model's warm start from the policy's weights")
    ap.add_argument("--policy", default="", help="load this warm-started policy instead of training one")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from dstrain.data.choice_tasks import make_choice_tasks
    from dstrain.trainers import score_warm as sw
    from models import registry
    spec = registry.get_spec("policy")
    mcfg = registry.make_model_config("policy", args.size, {})
    rl = spec.rl
    tasks = make_choice_tasks(args.n_train + args.n_eval, args.seed)
    train_tasks, held = tasks[:args.n_train], tasks[args.n_train:]
    examples = sw.policy_examples(train_tasks, args.seed, args.turn2)
    tok = rl.load_tokenizer(mcfg)
    curve = []

    def report(model, step, train_s):
        figures = {"step": step, "train_s": round(train_s, 1), **evaluate(model, tok, rl, held)}
        curve.append(figures)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}), flush=True)

    if args.policy:  # a warm-started policy from a run folder (``<output.dir>/warm_start``)
        policy = rl.build(registry.make_model_config("policy", args.size, {"path": args.policy}))
        report(policy, 0, 0.0)
    else:
        policy = train(rl, mcfg, tok, examples, args, report)

    def report_guidance(guidance, step, train_s):
        figures = {"guidance_step": step, "train_s": round(train_s, 1),
                   **verdict_accuracy(policy, guidance, tok, rl, held)}
        curve.append(figures)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}), flush=True)

    if args.guidance_steps:
        gex = sw.guidance_examples(train_tasks, args.seed, key=True)
        gargs = argparse.Namespace(**{**vars(args), "steps": args.guidance_steps,
                                      "lr": args.guidance_lr or args.lr})
        train(rl, mcfg, tok, gex, gargs, report_guidance, init=policy if args.guidance_from_policy else None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "load": list(os.getloadavg()),
                       "cpus": os.cpu_count(), "curve": curve}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
