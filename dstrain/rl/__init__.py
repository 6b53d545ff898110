"""Reinforcement-learning maths shared by the GRPO and SCoRe trainers (pure torch, no DeepSpeed)."""
