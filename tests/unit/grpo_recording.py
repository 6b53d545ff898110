"""A stand-in for the DeepSpeed engine the GRPO trainer drives, recording the logits of every forward, and the
float64 next-token log-probabilities and entropies computed from them: shared by the reference rounds that
recompute GRPO's logged KL, clip fraction and entropy by hand (test_reference_round13.py, round14)."""
from __future__ import annotations

import torch


class RecordingSGD:
    """DeepSpeed's contract as the GRPO trainer uses it (backward divides by grad_accum, the update comes at the
    accumulation boundary: plain SGD here, so a second pass over the batch sees a moved policy), recording the
    logits of every forward with and without a graph."""

    def __init__(self, module, grad_accum, lr):
        self.module, self.grad_accum, self.lr, self.device = module, grad_accum, lr, torch.device("cpu")
        self.micro, self.trained, self.scored = 0, [], []

    def __call__(self, ids, attention_mask=None):
        logits = self.module(ids, attention_mask=attention_mask)
        (self.trained if torch.is_grad_enabled() else self.scored).append(logits.detach().double())
        return logits

    def backward(self, loss):
        (loss / self.grad_accum).backward()

    def step(self):
        self.micro += 1
        if self.micro % self.grad_accum == 0:
            with torch.no_grad():
                for p in self.module.parameters():
                    p -= self.lr * p.grad
                    p.grad = None

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


def next_token(logits, ids, temperature):
    """float64 ``log softmax(logits / T)`` at each next token and the entropy of that softmax, ``[B, T-1]``."""
    logp_all = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)
