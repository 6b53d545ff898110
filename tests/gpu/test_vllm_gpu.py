"""rollout.generator=vllm on a GPU: vLLM's greedy completions of the tiny policy equal the hf
generator's, and a GRPO run generates through it. Skipped without CUDA or without vllm."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dstrain.rl import vllm_generation as vg
from tests.gpu import child_env

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(bool(vg.vllm_missing()), reason="needs the vllm package (not installed)")]
ROOT = Path(__file__).resolve().parents[2]


def test_vllm_greedy_equals_hf_greedy(tmp_path):
    from models.policy import SPEC
    from models.policy.config import PolicyConfig
    torch.manual_seed(0)
    mcfg = PolicyConfig()
    policy = SPEC.rl.build(mcfg).cuda()
    with torch.no_grad():  # peaked logits: greedy choices no kernel's rounding can flip
        policy.hf.lm_head.weight.mul_(100.0)
    tok = SPEC.rl.load_tokenizer(mcfg)
    tr = types.SimpleNamespace(out=tmp_path, policy=policy, tokenizer=tok, rl=SPEC.rl, model_cfg=mcfg,
                               engine=types.SimpleNamespace(module=policy, global_steps=0),
                               world=types.SimpleNamespace(rank=0, world_size=1),
                               cfg=types.SimpleNamespace(train=types.SimpleNamespace(seed=0)))
    toolkit = vg.VLLMToolkit(SPEC.rl, tr, types.SimpleNamespace(vllm_gpu_memory_utilization=0.2))
    prompts = ["def f(x):\n    return ", "# x plus 3\n", "abc"]
    ours = SPEC.rl.generate(policy, tok, prompts, greedy=True, max_new_tokens=16, stop=("\n",))
    theirs = toolkit.generate(policy, tok, prompts, greedy=True, max_new_tokens=16, stop=("\n",))
    assert [c.completion_ids for c in theirs] == [c.completion_ids for c in ours]
    assert [c.text for c in theirs] == [c.text for c in ours]


def test_grpo_runs_with_vllm_generation(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "1", "models/policy/recipes/grpo_debug.json",
         "--rollout.generator=vllm", "--train.steps=4", "--train.log_every=1", "--train.eval_every=0",
         "--task.warm_start_steps=10", "--task.eval_k=0", "--task.n_eval=4", "--checkpoint.every=0",
         f"--output.dir={tmp_path}", "--output.progress=false"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("time/weight_sync" in x for x in lines)  # weights copied into vLLM after steps
