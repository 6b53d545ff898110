"""Dilated against dense causal attention: forward+backward time and peak memory as N grows.

    python benchmarks/attention.py                        # CPU: 1k..16k tokens
    python benchmarks/attention.py --lengths 1024,2048 --repeats 2 --out /tmp/att

Every (method, N) point runs in a fresh subprocess so that its memory high-water
mark is its own. Per point: one warm-up forward+backward, then the median of
``--repeats`` timed ones. Memory is reported two ways, both without tracemalloc:
``peak_rss_bytes`` - the process's RSS high-water mark (``ru_maxrss``) minus the
mark measured just before the inputs were made (so it includes q, k, v, their
gradients and every temporary of forward and backward); ``saved_bytes`` - the bytes
autograd keeps for backward (saved-tensor hooks; distinct storages). Dense is
``scaled_dot_product_attention(is_causal=True)`` (PyTorch's fused CPU flash kernel,
O(N) memory, O(N^2) time); dilated is ``dstrain.ops.dilated.dilated_attention``
with the given branches. Results go to ``<out>/attention_<device>.json`` and a log-log PNG.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _point(method: str, n: int, heads: int, dim: int, segments, rates, repeats: int, threads: int) -> dict:
    """Measure one (method, N) in this process; returns a JSON-able dict."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    sys.path.insert(0, str(ROOT))
    from dstrain.ops.dilated import dilated_attention, make_branches

    branches = make_branches(segments, rates)
    torch.randn(64, 64) @ torch.randn(64, 64)  # load kernels before the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g).requires_grad_() for _ in range(3))

    def step(count_saved: bool = False) -> int:
        saved: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            saved[s._cdata] = s.nbytes()
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else _null()
        with ctx:
            if method == "dense":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = dilated_attention(q, k, v, branches, causal=True)
        out.sum().backward()
        for t in (q, k, v):
            t.grad = None
        inputs = {t.untyped_storage()._cdata for t in (q, k, v)}
        return sum(b for key, b in saved.items() if key not in inputs)

    saved_bytes = step(count_saved=True)  # also the warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"method": method, "n": n, "seconds": statistics.median(times), "all_seconds": times,
            "peak_rss_bytes": peak, "saved_bytes": saved_bytes}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_point(args, method: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--point", method, str(n), "--heads", str(args.heads), "--dim", str(args.dim),
           "--segments", args.segments, "--rates", args.rates, "--repeats", str(args.repeats),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"point {method} {n} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _slope(points: list[dict], key: str) -> float:
    """Least-squares slope of log(key) against log(n) (1: linear, 2: quadratic)."""
    xs = [math.log(p["n"]) for p in points]
    ys = [math.log(max(p[key], 1e-12)) for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for method, style in (("dense", "o-"), ("dilated", "s-")):
        pts = [p for p in result["points"] if p["method"] == method]
        ns = [p["n"] for p in pts]
        axes[0].loglog(ns, [p["seconds"] for p in pts], style, label=method, base=2)
        axes[1].loglog(ns, [p["peak_rss_bytes"] / 2**20 for p in pts], style, label=method, base=2)
        axes[2].loglog(ns, [p["saved_bytes"] / 2**20 for p in pts], style, label=method, base=2)
    for ax, title in zip(axes, ("forward+backward seconds", "peak RSS increase (MiB)", "autograd saved (MiB)")):
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    cfg = result["config"]
    fig.suptitle(f"causal attention on {result['device']}: {cfg['heads']} heads x {cfg['dim']}, fp32; dilated "
                 f"w={cfg['segments']} r={cfg['rates']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--segments", default="512,1024,2048,4096")
    p.add_argument("--rates", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--point", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    segments = [int(x) for x in args.segments.split(",")]
    rates = [int(x) for x in args.rates.split(",")]
    if args.point:
        print(json.dumps(_point(args.point[0], int(args.point[1]), args.heads, args.dim, segments, rates,
                                args.repeats, args.threads)))
        return 0
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        print("note: this script measures CPU kernels only; GPU points are not implemented", file=sys.stderr)
        device = "cpu"
    points = []
    for n in [int(x) for x in args.lengths.split(",")]:
        for method in ("dense", "dilated"):
            pt = _run_point(args, method, n)
            points.append(pt)
            print(f"{method:8s} N={n:6d}  {pt['seconds']:8.3f} s  peak RSS +{pt['peak_rss_bytes'] / 2**20:8.1f} MiB"
                  f"  saved {pt['saved_bytes'] / 2**20:8.1f} MiB", flush=True)
    by = {m: [p for p in points if p["method"] == m] for m in ("dense", "dilated")}
    longest = max(p["n"] for p in points)
    t = {m: next(p["seconds"] for p in by[m] if p["n"] == longest) for m in by}
    summary = {
        "speedup_at_longest": t["dense"] / t["dilated"], "longest": longest,
        "time_slope": {m: _slope(by[m], "seconds") for m in by},
        "time_slope_upper_half": {m: _slope([p for p in by[m] if p["n"] >= longest // 4], "seconds") for m in by},
        "saved_bytes_slope": {m: _slope(by[m], "saved_bytes") for m in by},
        "peak_rss_slope": {m: _slope(by[m], "peak_rss_bytes") for m in by},
    }
    import platform
    result = {"device": f"cpu ({platform.processor() or platform.machine()}, {args.threads} threads, "
                        f"{os.cpu_count()} cores visible, shared with other jobs)",
              "torch": torch.__version__,
              "config": {"heads": args.heads, "dim": args.dim, "segments": segments, "rates": rates,
                         "dtype": "float32", "causal": True, "batch": 1, "repeats": args.repeats},
              "memory_methods": {"peak_rss_bytes": "ru_maxrss of a fresh subprocess minus its mark before the "
                                                   "inputs were made",
                                 "saved_bytes": "bytes of distinct storages autograd saves for backward"},
              "points": points, "summary": summary}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / "attention_cpu.png")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
