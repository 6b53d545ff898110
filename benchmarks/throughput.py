"""Throughput benchmark: dstrain against a plain PyTorch loop (see benchmarks/README.md).

    python benchmarks/throughput.py RECIPE [--section.key=value ...] [--profiles zero0,zero1]
        [--steps 20] [--warmup 3] [--nproc 2] [--out benchmarks/results/NAME.json] [--plot]
"""
import sys

from dstrain.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
