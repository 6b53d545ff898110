"""Where pp, tp and gradient compression start to pay: modelled step time at 8, 64 and 512 GPUs.

    python benchmarks/scaling_model.py [--measured benchmarks/results/throughput_gpu_gpt_large.json]
        [--inter-gbps 400] [--intra-gbs 450] [--overlap 1.0] [--out benchmarks/results/scaling_model.json]

Inputs: the measured one-GPU step (dstrain's own engine, from a throughput-benchmark
result), the model's parameter count and shape, and link figures (flags; defaults are
H100 SXM NVLink and one 400 Gb/s InfiniBand port per GPU). The bytes per step follow
what ``output.comms`` measured (tests/dist/test_comms.py: one all-reduce of P x dtype
bytes per step under ZeRO-0). A second workload scales the measured compute to a
7B-parameter GPT at the same MFU, where communication weighs more. The arithmetic is
dstrain/perf_model.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.bench_args import check_out, count, number  # noqa: E402
from dstrain.perf_model import Links, Workload, scenarios  # noqa: E402


def read_measured(path: str, profile: str) -> tuple[dict | None, str | None]:
    """The throughput result at ``path`` and None, or None and the one line that says why it cannot feed the
    model: missing, not JSON, another benchmark's result (or an older form of this one), a profile it lacks."""
    try:
        measured = json.loads(Path(path).expanduser().read_text())
    except OSError as err:
        return None, f"--measured {path}: cannot read it ({err.strerror or err})"
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return None, f"--measured {path}: not JSON ({err})"
    kind = measured.get("benchmark") if isinstance(measured, dict) else None
    if kind != "throughput":
        what = f"a {kind} result" if isinstance(kind, str) else "not a throughput-benchmark result"
        return None, (f"--measured {path}: {what}; name the JSON of `python benchmarks/throughput.py` (dstrain "
                      "bench), e.g. benchmarks/results/throughput_gpu_gpt_large.json")
    try:
        model, batch = measured["model"], measured["batch"]
        _ = (model["name"], model["size"], model["params"], batch["tokens_per_step_global"], batch["seq_len"],
             batch["micro_batch"])
        profiles = {n: p["dstrain"]["step_time_s"]["median"] for n, p in measured["profiles"].items()}
    except (KeyError, TypeError) as err:
        return None, (f"--measured {path}: a throughput result without {err} (an older form of it?): measure "
                      "again with benchmarks/throughput.py")
    if profile not in profiles:
        return None, (f"--profile {profile}: not measured in {path}, which has "
                      f"{', '.join(profiles) or 'no profile'}")
    try:
        model_shape(model)
    except (ImportError, KeyError) as err:
        return None, f"--measured {path}: no layer shape for model {model['name']!r} size {model['size']!r} ({err})"
    return measured, None


def model_shape(model: dict) -> dict:
    """Layers and width of the measured model: its own family's size table, with the run's model.args."""
    import importlib
    sizes = importlib.import_module(f"models.{model['name']}.sizes").SIZES
    shape = {**sizes[model["size"]], **(model.get("args") or {})}
    return {"n_layer": int(shape["n_layer"]), "n_embd": int(shape["n_embd"])}


def workloads(measured: dict, profile: str) -> dict[str, Workload]:
    model, batch = measured["model"], measured["batch"]
    shape = model_shape(model)
    step = measured["profiles"][profile]["dstrain"]["step_time_s"]["median"]
    base = Workload(params=model["params"], compute_s=step, tokens_per_gpu=batch["tokens_per_step_global"],
                    n_layer=shape["n_layer"], hidden=shape["n_embd"], seq_len=batch["seq_len"],
                    micro_batch=batch["micro_batch"])
    # 7B / 70B: LLaMA-like shapes; compute scaled with the parameter count (6 P per token) at the measured MFU
    big_params = 6_700_000_000
    big = Workload(params=big_params, compute_s=step * big_params / model["params"],
                   tokens_per_gpu=batch["tokens_per_step_global"], n_layer=32, hidden=4096,
                   seq_len=batch["seq_len"], micro_batch=batch["micro_batch"])
    huge_params = 70_000_000_000
    huge = Workload(params=huge_params, compute_s=step * huge_params / model["params"],
                    tokens_per_gpu=batch["tokens_per_step_global"], n_layer=80, hidden=8192,
                    seq_len=batch["seq_len"], micro_batch=1)
    return {f"gpt-{model['size']} ({model['params'] / 1e6:.0f}M, measured)": base,
            "7B GPT (compute scaled at the same MFU)": big,
            "70B GPT (compute scaled at the same MFU, micro-batch 1)": huge}


def table(rows: list[dict]) -> str:
    lines = ["| scaling | GPUs | layout | step s | compute | exposed dp comm | tp comm | pp bubble + sends "
             "| efficiency | ZeRO-2 states / GPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scaling']} | {r['gpus']} | {r['layout']} | {r['step_s']:.3f} | {r['compute_s']:.3f} "
                     f"| {r['dp_exposed_s']:.3f} (of {r['dp_comm_s']:.3f}) | {r['tp_comm_s']:.3f} "
                     f"| {r['bubble_s'] + r['pp_comm_s']:.3f} | {100 * r['efficiency']:.0f}% "
                     f"| {r['model_states_bytes'] / 1e9:.0f} GB{'' if r['fits'] else ' (does not fit)'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", default=str(ROOT / "benchmarks/results/throughput_gpu_gpt_large.json"))
    p.add_argument("--profile", default="zero0", help="which measured dstrain profile gives the compute time")
    p.add_argument("--inter-gbps", type=number(above=True), default=400.0,
                   help="network per GPU between nodes, Gbit/s")
    p.add_argument("--intra-gbs", type=number(above=True), default=450.0, help="NVLink per GPU inside a node, GB/s")
    p.add_argument("--gpus-per-node", type=count(8), default=8, help="GPUs per node (at least 8: the tp 8 layouts)")
    p.add_argument("--device-gb", type=number(above=True), default=80.0,
                   help="memory per GPU (for the fits column)")
    p.add_argument("--overlap", type=number(0.0, 1.0), default=0.5,
                   help="fraction of the backward pass gradient communication may hide behind (0: none, 1: all)")
    p.add_argument("--global-batch-tokens", type=count(1), default=1024 * 1024,
                   help="strong scaling keeps this many tokens per step (default 1M: 1024 sequences of 1024)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/scaling_model.json"),
                   help="result JSON file (default: benchmarks/results/scaling_model.json)")
    args = p.parse_args(argv)
    check_out(p, args.out)
    measured, problem = read_measured(args.measured, args.profile)
    if problem:
        p.error(problem)
    links = Links(gpus_per_node=args.gpus_per_node, intra_bw=args.intra_gbs * 1e9,
                  inter_bw=args.inter_gbps * 1e9 / 8, device_memory=args.device_gb * 1e9)
    from dstrain.perf_model import Layout
    layouts = {
        "dp, fp32 grads": (Layout(overlap=args.overlap), 4.0),
        "dp, bf16 grads": (Layout(overlap=args.overlap), 2.0),
        "dp, 1-bit compressed": (Layout(overlap=args.overlap), 2.0 / 16),
        "tp 8 x dp, bf16": (Layout(tp=8, overlap=args.overlap), 2.0),
        "pp 4 x tp 8 x dp, bf16": (Layout(tp=8, pp=4, overlap=args.overlap), 2.0),
    }
    out = {"benchmark": "scaling_model", "command": "python benchmarks/scaling_model.py " + " ".join(argv or sys.argv[1:]),
           "measured_input": {"file": str(Path(args.measured).resolve().relative_to(ROOT))
                              if Path(args.measured).resolve().is_relative_to(ROOT) else Path(args.measured).name,
                              "device": measured["device"], "profile": args.profile,
                              "git_commit": measured.get("git_commit")},
           "links": asdict(links), "overlap": args.overlap, "global_batch_tokens": args.global_batch_tokens,
           "workloads": {}}
    for name, w in workloads(measured, args.profile).items():
        rows = scenarios(w, (8, 64, 512), links, global_tokens=args.global_batch_tokens, layouts=layouts)
        out["workloads"][name] = {"workload": asdict(w), "rows": rows}
        print(f"\n### {name}: {w.params / 1e9:.2f}B parameters, {w.compute_s:.3f} s compute per "
              f"{w.tokens_per_gpu} tokens per GPU\n")
        print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {Path(args.out).resolve().relative_to(ROOT) if Path(args.out).resolve().is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
