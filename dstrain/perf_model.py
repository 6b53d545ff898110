"""A step-time model for data, tensor and pipeline parallelism at scale (pure arithmetic).

Inputs are things one can measure on one GPU or read off a datasheet: the compute
time of one optimizer step at a per-GPU batch (the throughput benchmark), the
parameter count, the bytes per gradient element the run communicates (measured by
``output.comms``: one all-reduce of P x dtype bytes per step under ZeRO-0/1/2),
and the links (bandwidth per GPU and latency inside a node and between nodes).

Collectives use the textbook ring costs (Thakur et al.; the NCCL-tests "bus
bandwidth" convention): an all-reduce of D bytes over n ranks moves 2 (n-1)/n D per
rank and takes 2 (n-1) latency hops; across nodes the reduction is hierarchical
(reduce-scatter inside the node, all-reduce of each GPU's 1/G share between nodes,
all-gather inside the node). Gradient communication can hide behind the backward
pass (taken as 2/3 of compute) up to ``overlap`` of it; tensor-parallel all-reduces
(2 per layer forward, 2 backward, of one micro-batch's activations) and pipeline
sends sit on the critical path, and a 1F1B pipeline adds the bubble (p-1)/(m+p-1).
It is a model: it ignores kernel efficiency lost to smaller per-GPU shapes, network
congestion and stragglers, so it shows where a layout starts to pay, not exact times.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Links:
    gpus_per_node: int = 8
    intra_bw: float = 450e9
    """Bytes/s per GPU inside a node (H100 SXM NVLink 4: 900 GB/s both directions)."""
    inter_bw: float = 50e9
    """Bytes/s per GPU between nodes (one 400 Gb/s NDR InfiniBand port per GPU)."""
    intra_latency: float = 3e-6
    inter_latency: float = 10e-6
    device_memory: float = 80e9


@dataclass(frozen=True)
class Workload:
    params: int
    compute_s: float
    """One optimizer step's compute on one GPU at ``tokens_per_gpu`` (measured)."""
    tokens_per_gpu: int
    n_layer: int
    hidden: int
    seq_len: int
    micro_batch: int
    grad_bytes: float = 2.0
    """Bytes per gradient element communicated (4 fp32, 2 bf16; a compressed optimizer less)."""
    act_bytes: float = 2.0


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    overlap: float = 0.5
    """Fraction of the backward pass that gradient communication may hide behind (the last buckets and
    the optimizer step cannot overlap, so 1.0 is optimistic)."""


def ring_allreduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks, each with ``bw`` bytes/s."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def ring_half_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Reduce-scatter (or all-gather) of ``nbytes`` in total over ``n`` ranks: half an all-reduce."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * latency


def allreduce_s(nbytes: float, ranks: int, links: Links, ranks_per_node: int | None = None) -> float:
    """All-reduce over ``ranks`` GPUs laid out ``ranks_per_node`` to a node (hierarchical across nodes).

    Ranks that do not fill the last node leave it ``ranks - (nodes - 1) x per_node`` GPUs, each of which
    carries a ``1 / that`` share of the data between nodes, the slowest part of the inter-node ring."""
    local = min(ranks, ranks_per_node or links.gpus_per_node)
    nodes = max(1, -(-ranks // local))  # a partly filled node still takes part
    if nodes == 1:
        return ring_allreduce_s(nbytes, local, links.intra_bw, links.intra_latency)
    last = ranks - (nodes - 1) * local
    return (2 * ring_half_s(nbytes, local, links.intra_bw, links.intra_latency)
            + ring_allreduce_s(nbytes / last, nodes, links.inter_bw, links.inter_latency))


def step_time(w: Workload, gpus: int, layout: Layout, links: Links, tokens_per_gpu: int | None = None) -> dict:
    """Modelled step time on ``gpus`` GPUs; ``tokens_per_gpu``: the data-parallel rank's tokens per step
    (default the measured workload's). Returns the parts in seconds and the efficiency against one GPU
    doing the same tokens per GPU: compute time / step time, 1.0 for perfect linear scaling)."""
    tp, pp = layout.tp, layout.pp
    if gpus % (tp * pp):
        raise ValueError(f"{gpus} GPUs do not split into tp {tp} x pp {pp}")
    if tp > links.gpus_per_node:
        raise ValueError(f"tp {tp} exceeds the {links.gpus_per_node} GPUs of a node")
    dp = gpus // (tp * pp)
    tokens = tokens_per_gpu or w.tokens_per_gpu
    # compute: the replica's tokens split over tp x pp GPUs, linear in tokens
    replica_compute = w.compute_s * tokens / w.tokens_per_gpu
    compute = replica_compute / (tp * pp)
    # micro-batches per step of one replica (the pipeline's m); fewer sequences than a micro-batch
    # make one smaller micro-batch
    seqs = max(1.0, tokens / w.seq_len)
    mb = min(w.micro_batch, seqs)
    micro = max(1, round(seqs / mb))
    bubble = compute * (pp - 1) / micro if pp > 1 else 0.0  # (p-1)/(m+p-1) of the step = (p-1)/m of compute
    # tensor parallel: 4 activation all-reduces per layer per micro-batch, inside the node
    act = mb * w.seq_len * w.hidden * w.act_bytes
    tp_s = (4 * (w.n_layer / pp) * micro * ring_allreduce_s(act, tp, links.intra_bw, links.intra_latency)
            if tp > 1 else 0.0)
    # pipeline: one activation send forward and one gradient send back per micro-batch and boundary;
    # stages sit on different nodes when tp x pp exceeds a node
    cross = tp * pp > links.gpus_per_node
    bw, lat = (links.inter_bw, links.inter_latency) if cross else (links.intra_bw, links.intra_latency)
    pp_s = 2 * micro * (act / tp / bw + lat) if pp > 1 else 0.0
    # data parallel gradients: this GPU's shard of the parameters, over the dp ranks
    grad = w.params / (tp * pp) * w.grad_bytes
    per_node = max(1, links.gpus_per_node // (tp * pp)) if tp * pp <= links.gpus_per_node else 1
    dp_s = allreduce_s(grad, dp, links, ranks_per_node=per_node) if dp > 1 else 0.0
    exposed = max(0.0, dp_s - layout.overlap * (2 / 3) * compute)
    total = compute + bubble + tp_s + pp_s + exposed
    ideal = replica_compute / (tp * pp)
    # ZeRO-2 model states per GPU: 16-bit weights whole, 16-bit gradients and fp32 master + Adam partitioned
    states = w.params / (tp * pp) * (2 + 14 / dp)
    return {"gpus": gpus, "dp": dp, "tp": tp, "pp": pp, "compute_s": compute, "bubble_s": bubble,
            "model_states_bytes": states, "fits": states <= 0.85 * links.device_memory,
            "tp_comm_s": tp_s, "pp_comm_s": pp_s, "dp_comm_s": dp_s, "dp_exposed_s": exposed,
            "step_s": total, "efficiency": ideal / total,
            "tokens_per_s": tokens * dp / total}


def scenarios(w: Workload, gpu_counts=(8, 64, 512), links: Links = Links(), global_tokens: int | None = None,
              layouts: dict[str, tuple[Layout, float]] | None = None) -> list[dict]:
    """Weak scaling (each GPU's batch kept) and, with ``global_tokens``, strong scaling, for each layout.

    ``layouts``: name -> (layout, bytes per gradient element); default: data parallel with fp32,
    bf16 and 1-bit-compressed gradients, tp 8 inside a node, and pp 4 x tp 8.
    """
    layouts = layouts or {
        "dp, fp32 grads": (Layout(), 4.0),
        "dp, bf16 grads": (Layout(), 2.0),
        "dp, 1-bit compressed": (Layout(), 2.0 / 16),
        "tp 8 x dp, bf16": (Layout(tp=8), 2.0),
        "pp 4 x tp 8 x dp, bf16": (Layout(tp=8, pp=4), 2.0),
    }
    rows = []
    for n in gpu_counts:
        for name, (layout, grad_bytes) in layouts.items():
            if n % (layout.tp * layout.pp):
                continue
            wl = replace(w, grad_bytes=grad_bytes)
            # weak: each data-parallel replica keeps the measured per-GPU batch x its tp*pp GPUs
            weak = step_time(wl, n, layout, links, tokens_per_gpu=w.tokens_per_gpu * layout.tp * layout.pp)
            rows.append({"scaling": "weak", "layout": name, **weak})
            if global_tokens:
                dp = n // (layout.tp * layout.pp)
                per_replica = global_tokens / dp
                if per_replica < w.seq_len:
                    continue  # less than one sequence per replica: not a real configuration
                strong = step_time(wl, n, layout, links, tokens_per_gpu=int(per_replica))
                rows.append({"scaling": "strong", "layout": name, **strong})
    return rows
