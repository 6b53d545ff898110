"""Named GPT sizes: GPT-2 family shapes plus a debug size that trains on a CPU.

Parameter counts below were measured by building each size on the meta device
(``with torch.device("meta"): GPT(cfg)``; ``num_params()``) with the default
byte vocabulary (257), untied lm_head and no biases. Counts in parentheses are
the matmul parameters used by ``flops_per_token``.
"""

SIZES = {
    # 0.89M params (0.82M matmul); trains in seconds on 2 CPU cores
    "tiny": dict(n_layer=4, n_embd=128, n_head=4, block_size=256),
    # 86.1M params (85.1M matmul)
    "small": dict(n_layer=12, n_embd=768, n_head=12, block_size=1024),
    # 303.6M params (302.3M matmul)
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, block_size=1024),
    # 709.9M params (708.1M matmul)
    "large": dict(n_layer=36, n_embd=1280, n_head=20, block_size=1024),
    # 1477.2M params (1475.0M matmul)
    "xl": dict(n_layer=48, n_embd=1600, n_head=25, block_size=1024),
}
