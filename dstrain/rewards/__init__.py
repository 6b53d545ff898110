"""Verifiable rewards for RL: sandboxed code execution and maths answer checking.

See :mod:`dstrain.rewards.sandbox` for what the sandbox protects against, and
:mod:`dstrain.rewards.code` for scoring tasks of :mod:`dstrain.data.tasks`.
"""
from dstrain.rewards.code import evaluate_tasks, extract_code, score_tasks, summarize
from dstrain.rewards.maths import extract_final_answer, maths_reward, normalize_number
from dstrain.rewards.sandbox import ExecResult, SandboxLimits, SandboxPool, run_program

__all__ = [
    "ExecResult", "SandboxLimits", "SandboxPool", "run_program", "extract_code", "evaluate_tasks",
    "score_tasks", "summarize", "extract_final_answer", "normalize_number", "maths_reward",
]
