"""Named HRM sizes.

``sudoku`` is the paper's Sudoku-Extreme setup (hidden 512, 8 heads, expansion 4, 4 H
and 4 L layers, 2 H and 2 L cycles, up to 16 ACT steps, exploration 0.1): about 27.3M
parameters without the puzzle-embedding table. ``debug`` trains on a 2-core CPU;
``tiny`` is for tests and two-step recipe checks.
"""

SIZES = {
    # 27K params; tests only
    "tiny": dict(hidden_size=32, num_heads=2, H_layers=1, L_layers=1, H_cycles=2, L_cycles=2,
                 halt_max_steps=2, mlp_multiple_of=32),
    # 0.21M params; the CPU learning run
    "debug": dict(hidden_size=64, num_heads=4, H_layers=2, L_layers=2, H_cycles=2, L_cycles=2,
                  halt_max_steps=4, mlp_multiple_of=64),
    # 27.3M params; the paper's Sudoku model
    "sudoku": dict(hidden_size=512, num_heads=8, H_layers=4, L_layers=4, H_cycles=2, L_cycles=2,
                   halt_max_steps=16, expansion=4.0, halt_exploration_prob=0.1),
}
