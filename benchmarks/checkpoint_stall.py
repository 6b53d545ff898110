"""How long a checkpoint stalls training (synchronous vs ``checkpoint.async_write``), and whether random
kills during steps and during saves ever lose or corrupt a checkpoint.

    python benchmarks/checkpoint_stall.py                 # 2 CPU ranks, GPT small cut to 4 layers, 20 kills
    python benchmarks/checkpoint_stall.py --kills 0       # stall only

Stall: two runs of the same job (``dstrain launch --nproc 2``), one per mode; each save's stall is the
time ``LMTrainer.save`` blocked the training loop (``summary.json: checkpoint_stalls_s``, rank 0).

Kills: one job with asynchronous saves every ``--every`` steps is started (``--resume`` after the
first), and SIGKILL hits one random rank, alternately at a random moment of a step and while a
checkpoint is being written (a tag folder without ``COMPLETE``). After each kill the newest complete
checkpoint must be at least as new as before the kill (else: lost), every file of it must load and
its weights must consolidate (else: corrupted), and the next round must resume from it.
Writes ``benchmarks/results/checkpoint_stall_cpu.json`` with the command, the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain import checkpoint as ckpt  # noqa: E402
from dstrain.bench_args import check_out, count, number  # noqa: E402

RECIPE = ROOT / "models" / "gpt" / "recipes" / "tiny.json"


def job_args(out: Path, args, steps: int, *extra: str) -> list[str]:
    return [f"--model.size={args.size}", f'--model.args={{"n_layer": {args.layers}}}', "--data.seq_len=64",
            "--data.max_bytes=1000000", "--train.micro_batch=1", "--train.grad_accum=1", f"--train.steps={steps}",
            "--train.log_every=1", "--train.warmup_steps=2", "--train.eval_batches=1",
            "--output.tensorboard=false", "--output.progress=false", "--deepspeed.precision=fp32",
            f"--deepspeed.profile={args.profile}", f"--checkpoint.every={args.every}", "--checkpoint.keep=2",
            f"--output.dir={out}", *extra]


def start(cli_args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dstrain.cli", "launch", "--nproc", "2", str(RECIPE), *cli_args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil  # the job this script started, and only it (deepspeed runs in a session of its own)
        for kid in psutil.Process(proc.pid).children(recursive=True):
            kid.kill()
        proc.kill()
        return proc.wait()


def stall_run(tmp: Path, args, mode: str) -> dict:
    out = tmp / f"stall_{mode}"
    shutil.rmtree(out, ignore_errors=True)
    start_t = time.perf_counter()
    proc = start(job_args(out, args, args.stall_steps, f"--checkpoint.async_write={str(mode == 'async').lower()}"),
                 tmp / f"stall_{mode}.log")
    code = finish(proc, 1800)
    if code != 0:
        raise SystemExit(f"{mode} run failed ({code}); see {tmp / f'stall_{mode}.log'}")
    summary = json.loads((out / "summary.json").read_text())
    stalls = summary["checkpoint_stalls_s"]
    size = sum(f.stat().st_size for f in (out / "checkpoints").rglob("*") if f.is_file()) / 2 / 1e6  # 2 kept
    return {"stalls_s": [round(s, 4) for s in stalls], "mean_stall_s": round(sum(stalls) / len(stalls), 4),
            "async_parts_s": summary.get("checkpoint_async_s", []),
            "wall_s": round(time.perf_counter() - start_t, 1), "checkpoint_mb": round(size, 1)}


def rank_pids(proc: subprocess.Popen) -> list[int]:
    import psutil
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for kid in kids:  # ranks run ``python -u -m dstrain.cli train ...`` (not the deepspeed runner/launcher)
        try:
            cmd = kid.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "-m" in cmd and cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["dstrain.cli", "train"]:
            pids.append(kid.pid)
    return pids


def incomplete_tag(root: Path, since: float) -> str | None:
    """A tag being written now: no COMPLETE, and its folder made or filled after ``since`` (a folder left
    incomplete by an earlier kill is not one; the resumed job replaces it when it saves that step again)."""
    if not root.is_dir():
        return None
    for p in root.iterdir():
        try:
            if p.is_dir() and p.name.startswith("step_") and not ckpt.is_complete(p) and p.stat().st_mtime >= since:
                return p.name
        except FileNotFoundError:
            continue
    return None


def verify(root: Path, tag: str) -> str | None:
    """None if every file of ``tag`` loads and its weights consolidate, else what failed."""
    import torch
    for f in sorted((root / tag).rglob("*.pt")):
        if "universal" in f.parts:
            continue
        try:
            torch.load(f, map_location="cpu", weights_only=False)
        except Exception as err:  # noqa: BLE001 - any failure is a corruption
            return f"{f.name}: {err}"
    try:
        state, _ = ckpt.consolidated_state_dict(root / tag)
        if not state or not all(bool(torch.isfinite(v).all()) for v in state.values()):
            return "consolidated weights empty or not finite"
    except Exception as err:  # noqa: BLE001
        return f"consolidate: {err}"
    return None


def kill_rounds(tmp: Path, args, save_s: float) -> list[dict]:
    out = tmp / "kills"
    shutil.rmtree(out, ignore_errors=True)
    root, rng, rounds = out / "checkpoints", random.Random(args.seed), []
    for i in range(args.kills):
        target = "save" if i % 2 else "step"
        before = ckpt.find_latest(root)
        extra = ["--checkpoint.async_write=true", *(["--resume"] if i else [])]
        proc = start(job_args(out, args, 100_000, *extra), tmp / f"kill_{i}.log")
        record = {"round": i, "target": target, "latest_before": before}
        since = time.time()
        deadline = time.monotonic() + 600
        metrics = out / "metrics.jsonl"
        lines0 = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        while time.monotonic() < deadline and proc.poll() is None:  # training under way
            if metrics.is_file() and len(metrics.read_text().splitlines()) > lines0:
                break
            time.sleep(0.05)
        if target == "step":
            while time.monotonic() < deadline and proc.poll() is None and ckpt.find_latest(root) is None:
                time.sleep(0.05)  # the first round: something to lose first
            time.sleep(rng.uniform(0, args.step_window))  # now and then past a save: the latest moves on
        else:
            while time.monotonic() < deadline and proc.poll() is None and incomplete_tag(root, since) is None:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, save_s))
        record["save_in_progress"] = incomplete_tag(root, since)
        pids = rank_pids(proc)
        if proc.poll() is not None or not pids:
            record["error"] = f"job ended before the kill (exit {proc.poll()})"
        else:
            victim = rng.randrange(len(pids))
            os.kill(pids[victim], signal.SIGKILL)
            record["victim"] = victim
        record["exit"] = finish(proc, 300)
        after = ckpt.find_latest(root)
        record["latest_after"] = after
        record["lost"] = before is not None and (after is None or ckpt.step_of(after) < ckpt.step_of(before))
        problem = verify(root, after) if after else None
        record["corrupted"] = problem is not None
        if problem:
            record["problem"] = problem
        rounds.append(record)
        print(json.dumps(record), flush=True)
    return rounds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--layers", type=count(1), default=4)
    p.add_argument("--profile", default="zero2")
    p.add_argument("--every", type=count(1), default=3, help="save every n steps")
    p.add_argument("--stall-steps", type=count(1), default=9)
    p.add_argument("--kills", type=count(0), default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-window", type=number(above=True), default=15.0,
                   help="a step kill comes at a random moment of this many seconds after training resumed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "checkpoint_stall_cpu.json"),
                   help="result JSON file (default: the committed benchmarks/results/checkpoint_stall_cpu.json)")
    args = p.parse_args()
    check_out(p, args.out)
    import deepspeed
    import torch
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="ckpt_stall_") as tmp_name:
        tmp = Path(tmp_name)
        stall = {mode: stall_run(tmp, args, mode) for mode in ("sync", "async")}
        print(json.dumps(stall, indent=1), flush=True)
        rounds = kill_rounds(tmp, args, save_s=max(0.2, stall["sync"]["mean_stall_s"])) if args.kills else []
    result = {
        "command": "python benchmarks/checkpoint_stall.py " + " ".join(sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "deepspeed": deepspeed.__version__, "device": "cpu (gloo), 2 ranks"},
        "load_avg_before": load_before, "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "job": {"model": f"gpt {args.size}, n_layer={args.layers}", "profile": args.profile, "precision": "fp32",
                "save_every": args.every},
        "stall": stall,
        "kills": rounds,
        "kills_total": len(rounds),
        "kills_during_save": sum(1 for r in rounds if r.get("save_in_progress")),
        "lost": sum(1 for r in rounds if r["lost"]),
        "corrupted": sum(1 for r in rounds if r["corrupted"]),
        "rounds_without_kill": sum(1 for r in rounds if "error" in r),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"stall per save: sync {stall['sync']['mean_stall_s']:.3f}s, async {stall['async']['mean_stall_s']:.3f}s; "
          f"kills {result['kills_total']} ({result['kills_during_save']} during a save): lost {result['lost']}, "
          f"corrupted {result['corrupted']}; wrote {args.out}")
    return 0 if result["lost"] == result["corrupted"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
