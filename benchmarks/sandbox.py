"""Sandbox throughput and latency: MBPP reference solutions, trivial programs and an adversarial set.

    python benchmarks/sandbox.py                                 # ../shared/data/mbpp.jsonl, 1/2/4 workers, both modes
    python benchmarks/sandbox.py --data DIR --workers 1 2 --modes fork_server --limit 200

For each mode (``fork_server``, ``spawn``) and worker count it runs, through one
:class:`~dstrain.rewards.SandboxPool` (its servers started and warmed before timing):

* ``mbpp``: every MBPP reference solution (all 974 tasks of ``mbpp.jsonl``, or
  ``--limit``) with its tests and setup code; programs/s, p50/p99 latency and the
  fraction that pass;
* ``trivial``: ``x = 1`` with one test (500 of them, ``--trivial``), to show the sandbox's own
  per-program overhead;
* ``adversarial``: the ten attacks of the issue (infinite loop, fork bomb, memory bomb,
  huge output, writes outside, sockets, killing the parent, reading the trainer's
  secrets, early ``exit(0)``, detached spawns) three times each; containment is 100% when
  every run has reward 0, the sentinel file outside was never written, the victim
  process lives, and no spawned marker process exists.

Latency is :attr:`ExecResult.seconds` (from handing the job over to the verdict); every program's is kept
(``latencies_ms``, in the order run), p50/p99 interpolated linearly between them (numpy's default).
The MBPP file is found under ``--data``, else ``$DSTRAIN_DATA_DIR``, else
``../shared/data`` next to the repository; without it the MBPP set is skipped. Writes
``benchmarks/results/sandbox_<device>.json`` and a PNG, with the ``uptime`` load
before and after each run (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.bench_args import check_out, count  # noqa: E402
from dstrain.rewards import SandboxLimits, SandboxPool, extract_code  # noqa: E402
from dstrain.rewards.sandbox import MODES  # noqa: E402

LIMITS = dict(cpu_seconds=2, wall_seconds=2.0, memory_bytes=512 << 20)


def data_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("DSTRAIN_DATA_DIR"):
        return Path(os.environ["DSTRAIN_DATA_DIR"])
    return ROOT.parent / "shared" / "data"


def mbpp_jobs(folder: Path, limit: int) -> list[tuple[str, list[str], str]]:
    from dstrain.data.tasks import MBPP_SPLITS, load_mbpp
    path = folder / "mbpp.jsonl"
    if not path.is_file():
        return []
    tasks = [t for split in MBPP_SPLITS for t in load_mbpp(str(path), split)]
    tasks.sort(key=lambda t: int(t.task_id.split("/")[1]))
    jobs = [(t.code_prefix + extract_code(t.reference), list(t.tests), t.setup) for t in tasks]
    return jobs[:limit] if limit else jobs


def adversarial_jobs(sentinel: str, victim: int, port: int, marker: str) -> list[tuple[str, str]]:
    """(name, program) of the ten attacks; each must score 0 and leave no trace."""
    return [
        ("infinite loop", "while True:\n    pass\n"),
        ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n"),
        ("memory bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))\n"),
        ("huge output", "import sys\nwhile True:\n    sys.stdout.write('x' * 100000)\n"),
        ("write outside", f"open({sentinel!r}, 'w').write('owned')\n"),
        ("socket", f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n"),
        ("kill the parent", f"import os\nos.kill(os.getppid(), 9)\nos.kill({victim}, 9)\n"),
        ("read the trainer's secrets", f"print(open('/proc/{os.getpid()}/environ', 'rb').read())\n"),
        ("early exit(0)", "import sys\nsys.exit(0)\n"),
        ("detached spawn", f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"),
    ]


def processes_with(marker: str) -> int:
    found = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found += marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                pass
    return found


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed(pool: SandboxPool, jobs: list) -> dict:
    start = time.perf_counter()
    results = pool.run_many(jobs)
    elapsed = time.perf_counter() - start
    lat = [1e3 * r.seconds for r in results]
    return {"programs": len(jobs), "seconds": elapsed, "programs_per_s": len(jobs) / elapsed,
            "p50_ms": quantile(lat, 0.5), "p99_ms": quantile(lat, 0.99),
            "passed": sum(r.status == "passed" for r in results), "latencies_ms": lat, "results": results}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile, interpolated linearly between order statistics (numpy's default). Before, p99 took
    the order statistic at ``int(0.99 n)``: the largest latency of 100 programs, one rank above the 99th of 500."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bench(mode: str, workers: int, mbpp: list, repeats: int, trivial_count: int = 500) -> dict:
    limits = SandboxLimits(mode=mode, **LIMITS)
    out: dict = {"mode": mode, "workers": workers, "load_before": load()}
    start = time.perf_counter()
    with SandboxPool(workers=workers, limits=limits) as pool:
        pool.run_many([("x = 1\n", ["assert x == 1"], "")] * workers)  # start and warm the servers
        out["startup_s"] = time.perf_counter() - start
        trivial = timed(pool, [("x = 1\n", ["assert x == 1"], "")] * trivial_count)
        trivial.pop("results")
        out["trivial"] = trivial
        if mbpp:
            m = timed(pool, mbpp)
            failing = [r.detail for r in m.pop("results") if r.status != "passed"]
            m["pass_fraction"] = m["passed"] / m["programs"]
            m["not_passed_examples"] = failing[:5]
            out["mbpp"] = m
        out["adversarial"] = adversarial(pool, repeats)
    out["load_after"] = load()
    return out


def adversarial(pool: SandboxPool, repeats: int) -> dict:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    marker = f"{uuid.uuid4().int % 10 ** 6}.75"
    with tempfile.TemporaryDirectory() as d:
        sentinel = os.path.join(d, "sentinel")
        attacks = adversarial_jobs(sentinel, victim.pid, server.getsockname()[1], marker) * repeats
        try:
            t = timed(pool, [(program, ["assert True"], "") for _, program in attacks])
            results = t.pop("results")
            time.sleep(0.2)
            try:
                server.accept()
                connected = True
            except BlockingIOError:
                connected = False
            breaches = [name for (name, _), r in zip(attacks, results) if r.reward(partial_credit=True) != 0.0]
            traces = {"sentinel_written": os.path.exists(sentinel), "victim_killed": victim.poll() is not None,
                      "spawned_processes": processes_with(marker), "socket_connected": connected}
        finally:
            victim.kill()
            victim.wait()
            server.close()
    contained = sum(r.reward(partial_credit=True) == 0.0 for r in results)
    clean = not any(traces.values())
    t.update(contained=contained, containment=contained / len(results) if clean else 0.0, traces=traces,
             breaches=breaches, statuses={name: r.status for (name, _), r in zip(attacks, results)})
    return t


def plot(result: dict, path: Path) -> None:
    import matplotlib.pyplot as plt
    fig = figure(result)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(result: dict):
    """Programs/s and p99 latency against the worker count, each beside its goal; ticks at the counts run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("fork_server", "-o"), ("spawn", "--s")):
        runs = [r for r in result["runs"] if r["mode"] == mode]
        if not runs:
            continue
        w = [r["workers"] for r in runs]
        for key in ("mbpp", "trivial"):
            if all(key in r for r in runs):
                axes[0].plot(w, [r[key]["programs_per_s"] for r in runs], style, label=f"{mode}: {key}")
                axes[1].plot(w, [r[key]["p99_ms"] for r in runs], style, label=f"{mode}: {key} p99")
    axes[0].axhline(40, color="grey", lw=0.8, ls=":", label="goal: 40 MBPP programs/s")
    axes[0].set(xlabel="workers", ylabel="programs / s", title=f"sandbox throughput ({result['device']})")
    axes[1].axhline(50, color="grey", lw=0.8, ls=":", label="goal: p99 <= 50 ms")
    axes[1].set(xlabel="workers", ylabel="latency p99 (ms)", yscale="log", title="per-program latency, p99")
    counts = sorted({r["workers"] for r in result["runs"]})
    for ax in axes:
        ax.set_xticks(counts)  # whole workers (one run drew 0.96 ... 1.04)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", help="folder holding mbpp.jsonl (default: $DSTRAIN_DATA_DIR or ../shared/data)")
    p.add_argument("--workers", type=count(1), nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--limit", type=count(0), default=0, help="MBPP programs to run (0: all)")
    p.add_argument("--repeats", type=count(1), default=3, help="times the adversarial set is run")
    p.add_argument("--trivial", type=count(1), default=500, help="trivial programs timed (p99 is their 1%% tail)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="folder of sandbox_<device>[_TAG].json and .png (default: benchmarks/results, over the "
                        "committed figures)")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    args = p.parse_args(argv)
    check_out(p, args.out, "folder")
    mbpp = mbpp_jobs(data_dir(args.data), args.limit)
    if not mbpp:
        print(f"no mbpp.jsonl under {data_dir(args.data)}: MBPP set skipped", flush=True)
    device = "cpu"
    result = {"command": "python benchmarks/sandbox.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": device, "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or
                                             platform.machine(), "python": platform.python_version()},
              "limits": LIMITS, "mbpp_programs": len(mbpp), "runs": []}
    for mode in args.modes:
        for workers in args.workers:
            run = bench(mode, workers, mbpp, args.repeats, args.trivial)
            result["runs"].append(run)
            line = f"{mode:11s} workers={workers}: trivial {run['trivial']['programs_per_s']:.1f}/s " \
                   f"p50 {run['trivial']['p50_ms']:.1f} ms p99 {run['trivial']['p99_ms']:.1f} ms"
            if "mbpp" in run:
                m = run["mbpp"]
                line += f"; mbpp {m['programs_per_s']:.1f}/s p50 {m['p50_ms']:.1f} ms p99 {m['p99_ms']:.1f} ms " \
                        f"pass {m['pass_fraction']:.3f}"
            a = run["adversarial"]
            line += f"; adversarial contained {a['contained']}/{a['programs']} ({a['seconds']:.1f} s) " \
                    f"load {run['load_before']}->{run['load_after']}"
            print(line, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"sandbox_{device}{'_' + args.tag if args.tag else ''}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png", flush=True)
    return result


if __name__ == "__main__":
    main()
