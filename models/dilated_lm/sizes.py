"""Named sizes of the dilated-attention LM (LongNet-style branch ladders: w doubles, r doubles).

Parameter counts (byte vocabulary padded to 320, untied output layer, no biases) were
measured by building each size on the meta device; ``block_size`` is the longest
sequence (learned positions), equal to the longest segment.
"""

SIZES = {
    # 2.3M params (mostly 32k learned positions): the long recipes' shapes at toy width,
    # for smoke runs on a CPU (tests/recipes run every recipe with --model.size=tiny)
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, block_size=32768,
                 segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 8, 16]),
    # 0.90M params; trains on 2 CPU cores; 128-token samples, 3 branches
    "debug": dict(n_layer=4, n_embd=128, n_head=4, block_size=256,
                  segment_lengths=[32, 64, 128], dilation_rates=[1, 2, 4]),
    # 91.7M params
    "small": dict(n_layer=12, n_embd=768, n_head=12, block_size=8192,
                  segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4]),
    # 319.5M params
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, block_size=16384,
                   segment_lengths=[2048, 4096, 8192, 16384], dilation_rates=[1, 2, 4, 8]),
    # 1276.5M params
    "large": dict(n_layer=24, n_embd=2048, n_head=32, block_size=32768,
                  segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 8, 16]),
}
