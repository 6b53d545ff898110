"""Greedy pass@1 of finished GRPO runs on MBPP problems they never trained on.

    python benchmarks/grpo_mbpp_heldout.py runs/grpo_mbpp/grpo runs/grpo_mbpp/lr0 \
        --into benchmarks/results/grpo_learning_mbpp_cpu.json

For each run folder (a ``grpo_learning.py`` run of ``grpo_mbpp_cpu.json``) the last
checkpoint's consolidated weights are loaded into the policy its run config names, and
greedy completions are scored in the sandbox on two sets shaped like the recipe's
tasks (``mbpp_max_reference_chars``, ``mbpp_signature``): the MBPP validation and test
splits (held out: never seen in warm start or RL) and the train split (the problems the
run trained on). ``--into`` adds the figures to a ``grpo_learning.py`` result JSON under
``"mbpp_splits"``; they are printed either way. MBPP comes from the run's ``task.path``
(relative to the repository), ``--data`` or ``$DSTRAIN_DATA_DIR``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def mbpp_file(task: dict, data: str | None) -> str:
    if data:
        return str(Path(data) / "mbpp.jsonl")
    if os.environ.get("DSTRAIN_DATA_DIR"):
        return str(Path(os.environ["DSTRAIN_DATA_DIR"]) / "mbpp.jsonl")
    path = Path(task["path"])
    return str(path if path.is_absolute() else ROOT / path)


def evaluate(run: Path, data: str | None) -> dict:
    import torch

    from dstrain.checkpoint import consolidated_state_dict
    from dstrain.data.tasks import load_mbpp
    from dstrain.rewards import SandboxLimits, SandboxPool
    from dstrain.rewards.code import score_tasks
    from models import registry
    cfg = json.loads((run / "run_config.json").read_text())
    task = cfg["task"]
    shape = dict(max_reference_chars=int(task.get("mbpp_max_reference_chars", 0)),
                 signature=bool(task.get("mbpp_signature", False)))
    path = mbpp_file(task, data)
    sets = {"heldout (validation + test)": [t for s in ("validation", "test") for t in load_mbpp(path, s, **shape)],
            "train": load_mbpp(path, "train", **shape)}
    spec = registry.get_spec(cfg["model"]["name"])
    args = {k: v for k, v in cfg["model"].get("args", {}).items() if k != "path"}
    mcfg = registry.make_model_config(cfg["model"]["name"], cfg["model"]["size"], args)
    torch.manual_seed(0)
    model = spec.rl.build(mcfg)
    state, _ = consolidated_state_dict(run / "checkpoints")
    model.load_state_dict(state)
    tok = spec.rl.load_tokenizer(mcfg)
    max_new = int(task.get("max_new_tokens", 96))
    out = {}
    with SandboxPool(2, SandboxLimits(wall_seconds=5.0, memory_bytes=512 << 20)) as pool:
        for name, tasks in sets.items():
            stops = tuple(dict.fromkeys(s for t in tasks for s in t.stop))
            greedy = spec.rl.generate(model, tok, [t.prompt for t in tasks], greedy=True, max_new_tokens=max_new,
                                      stop=stops)
            rewards = score_tasks(tasks, [c.text for c in greedy], pool)
            passed = [t.task_id for t, r in zip(tasks, rewards) if r == 1.0]
            out[name] = {"tasks": len(tasks), "greedy_pass@1": len(passed) / max(len(tasks), 1), "passed": passed}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (each with run_config.json and checkpoints/)")
    ap.add_argument("--data", help="folder holding mbpp.jsonl (default: the run's task.path)")
    ap.add_argument("--into", help="a grpo_learning.py result JSON to add the figures to")
    args = ap.parse_args(argv)
    result = {}
    for run in map(Path, args.runs):
        result[run.name] = evaluate(run, args.data)
        print(run.name, {k: f"{v['greedy_pass@1']:.3f} of {v['tasks']}" for k, v in result[run.name].items()},
              flush=True)
    if args.into:
        target = Path(args.into)
        doc = json.loads(target.read_text())
        doc["mbpp_splits"] = {"command": "python benchmarks/grpo_mbpp_heldout.py " + " ".join(argv or sys.argv[1:]),
                              "runs": result}
        target.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
