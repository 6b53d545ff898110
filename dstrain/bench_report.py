"""Presentation of throughput-benchmark results: the console table and the bar chart."""
from __future__ import annotations

from pathlib import Path


def format_table(result: dict) -> str:
    head = ("profile", "plain s", "dstrain s", "ratio", "goal", "met", "min ratio", "cpu ratio", "tok/s",
            "GFLOP/s", "MFU",
            "mem plain", "mem dstrain", "mem est.", "vs compiled")
    rows = [head]
    for name, p in result["profiles"].items():
        d, b = p["dstrain"], p["plain"]
        rows.append((name, f"{b['step_time_s']['median']:.4f}", f"{d['step_time_s']['median']:.4f}",
                     f"{p['ratio']:.3f}", "-" if p["goal"] is None else f"{p['goal']:.2f}",
                     {True: "yes", False: "NO", None: "-"}[p["goal_met"]], f"{p['min_ratio']:.3f}",
                     f"{p['cpu_time_ratio']:.3f}",
                     f"{d['tokens_per_s']:.0f}",
                     "-" if d["flops_per_s"] is None else f"{d['flops_per_s'] / 1e9:.2f}",
                     "-" if d["mfu"] is None else f"{100 * d['mfu']:.1f}%",
                     f"{b['peak_memory_bytes'] / 2**20:.0f} MiB", f"{d['peak_memory_bytes'] / 2**20:.0f} MiB",
                     "-" if not p.get("estimated_memory_bytes") else f"{p['estimated_memory_bytes'] / 2**20:.0f} MiB",
                     f"{p['speedup_vs_compiled']:.3f}x" if "speedup_vs_compiled" in p else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join(["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows] + legend(result))


def legend(result: dict) -> list[str]:
    """What the table's columns measure, with the MFU's denominator (a full result only)."""
    peak = (result.get("peak_flops") or {}).get("per_rank")
    if "method" not in result:
        return []
    cpu = (result.get("device") or {}).get("type") == "cpu"
    lines = [("plain s, dstrain s: median step time (one optimizer step, max over ranks); ratio = dstrain/plain; "
              "tok/s, GFLOP/s, MFU: dstrain's, all ranks together"),
             "MFU = GFLOP/s / world size / " + (f"{peak / 1e9:.1f} GFLOP/s peak per rank "
                                                 f"({result['peak_flops'].get('how', '')})" if peak else
                                                 "a peak per rank (none known here: MFU not given)"),
             "mem plain, mem dstrain: " + ("peak RSS of a rank (the Python/torch/DeepSpeed imports included)"
                                           if cpu else "torch.cuda.max_memory_allocated of a rank")
             + "; mem est.: the planner's device-memory estimate (model states + activations)"]
    return lines


def plot(result: dict, path: Path) -> None:
    fig = figure(result)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(fig)


def figure(result: dict):
    """The bar chart of median step times per profile; its legend sits below the axes, clear of the bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(result["profiles"])
    plain = [result["profiles"][n]["plain"]["step_time_s"]["median"] for n in names]
    ds = [result["profiles"][n]["dstrain"]["step_time_s"]["median"] for n in names]
    compiled = [result["profiles"][n].get("plain_compiled", {}).get("step_time_s", {}).get("median") for n in names]
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2.5, 4))
    ax.bar([x - 0.2 for x in xs], plain, 0.4, label="plain PyTorch (DDP)")
    ax.bar([x + 0.2 for x in xs], ds, 0.4, label="dstrain (DeepSpeed)")
    if compiled[0] is not None:
        ax.axhline(compiled[0], color="black", linestyle="--", linewidth=1,
                   label="plain + torch.compile + fused AdamW")
    for x, n, d in zip(xs, names, ds):
        ax.annotate(f"{result['profiles'][n]['ratio']:.2f}x", (x + 0.2, d), ha="center", va="bottom")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("median step time (s)")
    b = result["batch"]
    ax.set_title(f"{result['model']['name']}-{result['model']['size']}, {result['world_size']} rank{'' if result['world_size'] == 1 else 's'}, "
                 f"micro-batch {b['micro_batch']} x seq {b['seq_len']}, {result['precision']}; load average "
                 f"{result['load_average']['before'][0]:.1f} before, {result['load_average']['after'][0]:.1f} after",
                 fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8, frameon=False)
    ax.set_ylim(0, 1.12 * max(v for v in [*plain, *ds, compiled[0] or 0]))  # room for the ratios above the bars
    fig.tight_layout()
    return fig

