"""Dilated against dense causal attention: forward+backward time and peak memory as N grows, CPU or GPU.

    python benchmarks/attention.py                              # this machine's device, its default lengths
    python benchmarks/attention.py --lengths 8192,32768 --repeats 3 --out /tmp/att
    python benchmarks/attention.py --device cuda --lengths 8192,32768,131072,524288,1048576
    python benchmarks/attention.py --device cuda --profile 131072   # where one dilated step's time goes

Each (method, N) point runs in a fresh subprocess, so that its memory high-water mark is
its own. Per point: one warm-up forward+backward, then the median of ``--repeats`` timed
ones (CUDA: events around each call; CPU: ``perf_counter``). Inputs ``[1, heads, N, dim]``
(laid out ``[1, N, heads, dim]`` in memory as a model produces them, ``--layout``), causal;
bf16 on CUDA, fp32 on CPU (``--dtype``). Dense is
``F.scaled_dot_product_attention(is_causal=True)`` (flash kernels on both devices);
dilated is ``dstrain.ops.dilated.dilated_attention`` with the given branches; ``--dilated-backend cudnn``
runs its branches on cuDNN's fused attention instead of FlashAttention-2 (as ``train.attention_backend``
does in training; the dense baseline keeps PyTorch's default).

Memory: on CUDA ``extra_bytes`` = ``torch.cuda.max_memory_allocated`` during the step
minus the bytes allocated before it (q, k, v); on CPU the RSS high-water mark
(``ru_maxrss``) minus the mark before the inputs were made. ``saved_bytes`` = what
autograd keeps for backward (saved-tensor hooks; distinct storages, inputs excluded).

The summary gives, per N, the speed-up of dilated over dense and the ideal speed-up
``N / sum(w_i / r_i^2)`` (dense computes about ``N^2 / 2`` scores per head, branch
``(w, r)`` about ``N w / (2 r^2)``), the fraction of it achieved, and the fitted
log-log slope of time against N. Dense points above ``--dense-max`` are skipped (and
listed as such); a point that runs out of memory is recorded as such. Results:
``<out>/attention_<cpu|gpu>.json`` (device, versions, command) and a PNG of time and memory.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dstrain.bench_args import check_out, count, counts  # noqa: E402

DEFAULT_LENGTHS = {"cpu": "16384,32768,65536,131072", "cuda": "8192,32768,131072,262144,524288,1048576"}
DEFAULT_DENSE_MAX = {"cpu": 32768, "cuda": 262144}


def _point(method: str, n: int, a) -> dict:
    """Measure one (method, N) in this process; returns a JSON-able dict."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from dstrain.ops.attention import sdpa_priority
    from dstrain.ops.dilated import dilated_attention, make_branches

    cuda = a.device == "cuda"
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    backend = a.dilated_backend if method == "dilated" else "auto"
    branches = make_branches(a.segments, a.rates)
    dev = torch.device(a.device)
    torch.randn(64, 64, device=dev) @ torch.randn(64, 64, device=dev)  # load kernels before the baseline
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (_input(a, n, dev, dtype, g).requires_grad_() for _ in range(3))
    grad = _input(a, n, dev, dtype, g)

    def step(count_saved: bool = False) -> int:
        saved: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            saved[s._cdata] = s.nbytes()
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else _Null()
        with ctx, sdpa_priority(backend):
            if method == "dense":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = dilated_attention(q, k, v, branches, causal=True)
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None
        inputs = {t.untyped_storage()._cdata for t in (q, k, v)}
        return sum(b for key, b in saved.items() if key not in inputs)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        saved_bytes = step(count_saved=True)  # also the warm-up
        sync()
        times = []
        repeats = a.repeats if not (method == "dense" and n > a.slow_dense) else 1
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        extra = (torch.cuda.max_memory_allocated() - before if cuda
                 else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss)
    except torch.cuda.OutOfMemoryError:
        return {"method": method, "n": n, "error": "out of memory"}
    return {"method": method, "n": n, "seconds": statistics.median(times), "all_seconds": times,
            "extra_bytes": int(extra), "saved_bytes": int(saved_bytes)}


def _input(a, n: int, dev, dtype, g=None):
    """``[1, heads, N, dim]``; ``--layout bnhd``: laid out ``[1, N, heads, dim]`` in memory, as the
    transposed output of a model's q/k/v projections."""
    import torch
    if a.layout == "bnhd":
        return torch.randn(1, n, a.heads, a.dim, generator=g, device=dev, dtype=dtype).transpose(1, 2)
    return torch.randn(1, a.heads, n, a.dim, generator=g, device=dev, dtype=dtype)


def _profile(n: int, a) -> None:
    """One dilated forward+backward at N under the profiler (after a warm-up); prints the top ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT))
    from dstrain.ops.dilated import dilated_attention, make_branches

    cuda = a.device == "cuda"
    torch.set_num_threads(a.threads)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    q, k, v = (_input(a, n, dev, dtype).requires_grad_() for _ in range(3))
    grad = _input(a, n, dev, dtype)
    branches = make_branches(a.segments, a.rates)
    for record in (False, True):
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) if record else _Null() as prof:
            dilated_attention(q, k, v, branches, causal=True).backward(grad)
            if cuda:
                torch.cuda.synchronize()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=30))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _run_point(a, method: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--point", method, str(n), "--device", a.device, "--dtype", a.dtype,
           "--heads", str(a.heads), "--dim", str(a.dim), "--segments", ",".join(map(str, a.segments)),
           "--rates", ",".join(map(str, a.rates)), "--repeats", str(a.repeats), "--threads", str(a.threads),
           "--slow-dense", str(a.slow_dense), "--layout", a.layout, "--dilated-backend", a.dilated_backend]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"method": method, "n": n, "error": proc.stderr.strip().splitlines()[-1][-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ideal_speedup(n: int, segments, rates) -> float:
    """Dense causal scores over dilated ones: ``N / sum(w_i / r_i^2)`` (segments capped at N)."""
    return n / sum(min(w, n) / r ** 2 for w, r in zip(segments, rates))


def slope(points: list[dict]) -> float | None:
    """Least-squares slope of log(seconds) against log(N) (1: linear, 2: quadratic)."""
    pts = [p for p in points if "seconds" in p]
    if len(pts) < 2:
        return None
    xs = [math.log(p["n"]) for p in pts]
    ys = [math.log(p["seconds"]) for p in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def summarize(points: list[dict], segments, rates, slope_from: int) -> dict:
    by = {m: {p["n"]: p for p in points if p["method"] == m} for m in ("dense", "dilated")}
    rows = []
    for n in sorted(by["dilated"]):
        d, s = by["dense"].get(n, {}), by["dilated"][n]
        row = {"n": n, "ideal_speedup": ideal_speedup(n, segments, rates)}
        if "seconds" in d and "seconds" in s:
            row["speedup"] = d["seconds"] / s["seconds"]
            row["fraction_of_ideal"] = row["speedup"] / row["ideal_speedup"]
        rows.append(row)
    dil = [p for p in by["dilated"].values() if p["n"] >= slope_from]
    return {"per_n": rows, "dilated_time_slope": slope(dil), "slope_range": [slope_from, max(by["dilated"])],
            "dense_time_slope": slope(list(by["dense"].values()))}


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for method, style in (("dense", "o-"), ("dilated", "s-")):
        pts = [p for p in result["points"] if p["method"] == method and "seconds" in p]
        ns = [p["n"] for p in pts]
        axes[0].loglog(ns, [p["seconds"] * 1e3 for p in pts], style, label=method, base=2)
        axes[1].loglog(ns, [max(p["extra_bytes"], 1) / 2**20 for p in pts], style, label=method, base=2)
    for ax, title in zip(axes, ("forward+backward (ms)", "peak extra memory (MiB)")):
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    c = result["config"]
    fig.suptitle(f"causal attention on {result['device']['name']}: {c['heads']} heads x {c['dim']}, {c['dtype']}; "
                 f"dilated w={c['segments']} r={c['rates']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _device_info(device: str, threads: int) -> dict:
    import torch
    if device == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name()}
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"type": "cpu", "name": name, "threads": threads, "cores_visible": os.cpu_count()}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when visible")
    p.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--lengths", type=counts(1), help="comma-separated N (default per device)")
    p.add_argument("--heads", type=count(1), default=12)
    p.add_argument("--dim", type=count(1), default=64)
    p.add_argument("--layout", choices=("bnhd", "bhnd"), default="bnhd",
                   help="memory layout of q, k, v and the output gradient (default: bnhd, as a model's)")
    p.add_argument("--dilated-backend", choices=("auto", "cudnn"), default="auto",
                   help="fused kernels of the dilated branches on CUDA: auto (FlashAttention-2) or cudnn")
    p.add_argument("--segments", type=counts(1), default="2048,4096,8192")
    p.add_argument("--rates", type=counts(1), default="1,2,4")
    p.add_argument("--repeats", type=count(1), help="timed runs per point (default: 5 on cuda, 3 on cpu)")
    p.add_argument("--threads", type=count(1), default=os.cpu_count() or 1)
    p.add_argument("--dense-max", type=count(0), help="skip dense above this N (default per device)")
    p.add_argument("--slow-dense", type=count(1), default=1 << 62, help="time dense once (no repeats) above this N")
    p.add_argument("--slope-from", type=count(1), help="fit the slope from this N up (default: second length)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="folder of attention_<cpu|gpu>.json and .png (default: benchmarks/results, over the "
                        "committed figures)")
    p.add_argument("--profile", type=count(1), metavar="N", help="profile one dilated step at N and exit")
    p.add_argument("--point", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    a.repeats = a.repeats or (5 if a.device == "cuda" else 3)
    if len(a.segments) != len(a.rates):
        p.error(f"--segments and --rates name one branch each: {len(a.segments)} segment lengths against "
                f"{len(a.rates)} rates")
    if not a.point:
        check_out(p, a.out, "folder")
    if a.point:
        print(json.dumps(_point(a.point[0], int(a.point[1]), a)))
        return 0
    if a.profile:
        _profile(a.profile, a)
        return 0
    import torch
    lengths = a.lengths or [int(x) for x in DEFAULT_LENGTHS[a.device].split(",")]
    dense_max = a.dense_max if a.dense_max is not None else DEFAULT_DENSE_MAX[a.device]
    points = []
    for n in lengths:
        for method in ("dense", "dilated"):
            if method == "dense" and n > dense_max:
                pt = {"method": method, "n": n, "skipped": f"dense above --dense-max {dense_max}"}
            else:
                pt = _run_point(a, method, n)
            points.append(pt)
            if "seconds" in pt:
                print(f"{method:8s} N={n:8d}  {pt['seconds'] * 1e3:10.2f} ms  extra {pt['extra_bytes'] / 2**20:9.1f} MiB"
                      f"  saved {pt['saved_bytes'] / 2**20:9.1f} MiB", flush=True)
            else:
                print(f"{method:8s} N={n:8d}  {pt.get('error') or pt.get('skipped')}", flush=True)
    summary = summarize(points, a.segments, a.rates, a.slope_from or lengths[min(1, len(lengths) - 1)])
    result = {"benchmark": "attention", "device": _device_info(a.device, a.threads),
              "command": "python benchmarks/attention.py " + shlex.join("OUT" if x.startswith("/") else x for x in argv),
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "config": {"heads": a.heads, "dim": a.dim, "layout": a.layout, "segments": a.segments,
                         "rates": a.rates, "dilated_backend": a.dilated_backend,
                         "dtype": a.dtype, "causal": True, "batch": 1, "repeats": a.repeats},
              "memory_methods": {"extra_bytes": ("cuda: max_memory_allocated during the step minus the bytes "
                                                 "allocated before it (the inputs)" if a.device == "cuda" else
                                                 "cpu: ru_maxrss of a fresh subprocess minus its mark before the "
                                                 "inputs were made"),
                                 "saved_bytes": "bytes of distinct storages autograd saves for backward"},
              "points": points, "summary": summary}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu" if a.device == "cuda" else "cpu"
    name += "" if a.dilated_backend == "auto" else f"_{a.dilated_backend}"
    (out / f"attention_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / f"attention_{name}.png")
    for row in summary["per_n"]:
        print(f"N={row['n']:8d}  ideal {row['ideal_speedup']:6.2f}x  achieved "
              + (f"{row['speedup']:6.2f}x ({100 * row['fraction_of_ideal']:.0f}% of ideal)" if "speedup" in row
                 else "-"))
    slope = summary["dilated_time_slope"]
    print(f"dilated time slope (N >= {summary['slope_range'][0]}): "
          + (f"{slope:.2f}" if isinstance(slope, (int, float)) else "none (it needs two timed lengths from there; "
                                                                     "--slope-from a smaller N)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
