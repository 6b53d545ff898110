"""Memory plan: choose the ZeRO profile, offload, precision and activation checkpointing.

Pure arithmetic over the table in DESIGN.md ("The engine factory"); no torch, no deepspeed.
With P parameters, L parameters in the largest module, N data-parallel ranks and Adam:

    profile                   device bytes per rank      host bytes per node
    zero0                     (w+g+12)P                  -
    zero1                     (w+g)P + 12P/N             -
    zero2                     wP + (g+12)P/N             -
    zero3                     (w+g+12)P/N + (w+g)L       -
    zero2_offload             (w+g)P                     12P
    zero3_offload_optimizer   wP/N + (w+g)L              (12+g)P
    zero3_offload             (w+g)L                     (12+w+g)P

w = g = 2 bytes in bf16/fp16 and 4 in fp32 (fp32 doubles the 2-byte terms); 12 bytes are
the fp32 master weights and Adam moments. The 16-bit table is the ZeRO paper's, except that ZeRO-3 with the
optimizer offloaded keeps its gradient partition on the host (DeepSpeed allocates its flat gradient buffer on the
optimizer's device: ``estimate_zero3_model_states_mem_needs`` counts 4L + 2P/N on the GPU).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

PROFILE_ORDER = ("zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload_optimizer", "zero3_offload")
OPTIMIZER_BYTES = 12  # fp32 master weights + two Adam moments
_PRECISION_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                      "fp32": "fp32", "float32": "fp32", "float": "fp32"}


@dataclass(frozen=True)
class ModelStats:
    """Size of the model: P parameters, L in the largest module, hidden size and layer count."""

    params: int
    largest_module_params: int
    hidden_size: int
    num_layers: int

    def __post_init__(self):
        if self.params < 1 or not 0 <= self.largest_module_params <= self.params:
            raise ValueError(f"ModelStats needs params >= 1 and 0 <= largest_module_params <= params, "
                             f"got {self.params} and {self.largest_module_params}")


@dataclass(frozen=True)
class Hardware:
    """What one rank runs on; ``device_memory`` is the bytes one rank may use, ``host_memory`` per node."""

    device_type: str  # "cuda" | "cpu"
    device_memory: int
    host_memory: int
    ranks_per_node: int
    bf16_supported_fast: bool
    fp16_supported: bool
    name: str = ""

    def __post_init__(self):
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"Hardware.device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        for name, value, where in (("device_memory", self.device_memory, "--device-memory, deepspeed.device_memory"),
                                    ("host_memory", self.host_memory, "deepspeed.host_memory"),
                                    ("ranks_per_node", self.ranks_per_node, "--gpus-per-node")):
            if value <= 0:  # a 0 given on the command line or in the run config: named where it is set
                raise ValueError(f"{name} must be positive, got {value} ({where})")


@dataclass(frozen=True)
class Activations:
    """Activation bytes at micro-batch 1 measured in fp32, without and with activation checkpointing.

    ``autocast`` (when traced): ``(per_sample, fixed)`` bytes under bf16 autocast over fp32 weights,
    without and with checkpointing (indexed by the checkpointing flag). Autocast keeps fp32 where it
    computes in fp32 (the residual stream, norms, the loss), so it is not half of the fp32 trace;
    ``fixed`` is what does not grow with the batch: the bf16 copies of the weights the matmuls save.
    """

    per_sample: int
    per_sample_checkpointed: int
    autocast: tuple[tuple[int, int], tuple[int, int]] | None = None


def autocast_runs(profile: str, precision: str, device_type: str, mixed_precision: str = "auto") -> bool:
    """Whether a run of ``profile`` trains with torch.autocast over fp32 weights (the factory's
    ``mixed_precision`` rule for a profile that leaves bf16 to it): bf16 at ZeRO-0 on CUDA, or
    wherever ``deepspeed.mixed_precision=autocast`` asks for it."""
    if _PRECISION_ALIASES.get(precision, precision) != "bf16" or mixed_precision == "deepspeed":
        return False
    return mixed_precision == "autocast" or (profile == "zero0" and device_type == "cuda")


@dataclass(frozen=True)
class ProfileEstimate:
    """One (profile, checkpointing) candidate: bytes needed and whether it fits the budgets."""

    profile: str
    activation_checkpointing: bool
    model_states: int
    activations: int
    device_total: int
    host_total: int
    fits: bool
    why_not: str


@dataclass(frozen=True)
class Plan:
    """The chosen profile, precision and checkpointing, with every candidate tried before it."""

    profile: str
    precision: str
    activation_checkpointing: bool
    estimates: tuple[ProfileEstimate, ...]
    reason: str
    precision_reason: str
    margin: float


class PlanError(ValueError):
    """No profile fits; the message gives the smallest requirement and the budget."""

    def __init__(self, message: str, estimates: tuple[ProfileEstimate, ...] = ()):
        super().__init__(message)
        self.estimates = estimates


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "p": 10**15, "pb": 10**15, "kib": 2**10, "ki": 2**10, "mib": 2**20,
          "mi": 2**20, "gib": 2**30, "gi": 2**30, "tib": 2**40, "ti": 2**40, "pib": 2**50, "pi": 2**50}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e([+-]?[0-9]+))?\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Parse a size: ``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512MB"``, ``"1.5TB"`` or a plain int."""
    if isinstance(text, bool):
        raise ValueError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"byte size must not be negative: {text!r}")
        return text
    match = _BYTES_RE.match(str(text))
    unit = match.group(3).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (expected e.g. 80GB, 80GiB, 512MB, 1.5TB or bytes)")
    number = float(match.group(1) + (f"e{match.group(2)}" if match.group(2) else ""))
    return int(round(number * _UNITS[unit]))


def format_bytes(n) -> str:
    """Human-readable decimal size, e.g. ``18.2 GB``."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{int(n)} B"


def choose_precision(hw: Hardware, requested: str = "auto") -> tuple[str, str]:
    """Pick ``(precision, reason)``: bf16 where it is fast, fp16 on older GPUs, fp32 on CPUs without bf16.

    An explicit request is honoured unless DeepSpeed would refuse it (fp16 where the
    accelerator reports no fp16 support, which includes most CPUs): then ValueError.
    """
    req = str(requested).lower()
    if req != "auto":
        if req not in _PRECISION_ALIASES:
            raise ValueError(f"unknown precision {requested!r}; use auto, bf16, fp16 or fp32")
        req = _PRECISION_ALIASES[req]
        where = hw.name or hw.device_type
        if req == "fp16" and not hw.fp16_supported:
            raise ValueError(f"fp16 requested but {where} has no fp16 support (DeepSpeed raises "
                             "'Type fp16 is not supported on your device'); use bf16 or fp32")
        if req == "bf16" and not hw.bf16_supported_fast:
            return req, f"bf16 as requested (note: {where} has no fast bf16; expect it to be slow)"
        return req, f"{req} as requested"
    if hw.bf16_supported_fast:
        return "bf16", f"bf16: {hw.name or hw.device_type} has fast bf16"
    if hw.device_type == "cuda" and hw.fp16_supported:
        return "fp16", f"fp16 with dynamic loss scaling: {hw.name or 'this GPU'} has no fast bf16"
    return "fp32", f"fp32: bf16 is not fast on {hw.name or hw.device_type} (the hardware line says what was measured)"


def _is_offload(profile: str) -> bool:
    return "offload" in profile


def model_state_bytes(profile: str, stats: ModelStats, world_size: int, precision: str,
                      ranks_per_node: int) -> tuple[int, int]:
    """Model-state bytes ``(device bytes per rank, host bytes per node)`` for Adam (module table).

    Host bytes of the offload profiles are 12P (ZeRO-2's optimizer offload), (12+g)P (ZeRO-3's, which
    keeps the gradient partition on the host too) or (12+w+g)P = 16P in
    16-bit (parameter and optimizer offload) for the whole model; each rank holds only its
    1/N partition, so a node holding ``ranks_per_node`` of the N ranks holds
    ``min(1, ranks_per_node / N)`` of that.
    """
    if profile not in PROFILE_ORDER:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILE_ORDER)}")
    if world_size < 1 or ranks_per_node < 1:
        raise ValueError("world_size and ranks_per_node must be >= 1")
    precision = _PRECISION_ALIASES.get(str(precision).lower(), precision)
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"unknown precision {precision!r}")
    w = g = 4 if precision == "fp32" else 2
    p, big, n, opt = stats.params, stats.largest_module_params, world_size, OPTIMIZER_BYTES
    node_share = min(1.0, ranks_per_node / n)
    device, host = {
        "zero0": ((w + g + opt) * p, 0),
        "zero1": ((w + g) * p + opt * p / n, 0),
        "zero2": (w * p + (g + opt) * p / n, 0),
        "zero3": ((w + g + opt) * p / n + (w + g) * big, 0),
        "zero2_offload": ((w + g) * p, opt * p * node_share),
        "zero3_offload_optimizer": (w * p / n + (w + g) * big, (opt + g) * p * node_share),
        "zero3_offload": ((w + g) * big, (opt + w + g) * p * node_share),
    }[profile]
    return int(round(device)), int(round(host))


def states_precision(profile: str, precision: str, autocast: bool) -> str:
    """The precision whose row of the table counts ``profile``'s model states: ``precision``, except under
    torch.autocast, which keeps fp32 weights and gradients. Above ZeRO-0 DeepSpeed's fp32 ZeRO optimizer then holds
    them beside its own fp32 master partition and the Adam moments (and gathers fp32 modules at ZeRO-3): the fp32
    row. At ZeRO-0 an optimizer without a master copy updates the fp32 weights in place: 4 + 4 + 8 bytes, the
    16-bit row's 16P."""
    return "fp32" if autocast and profile != "zero0" else precision


def _estimate(profile, ckpt, stats, hw, acts, world_size, micro_batch, precision, margin,
              mixed_precision: str = "auto", grad_accum: int = 1) -> ProfileEstimate:
    autocast = autocast_runs(profile, precision, hw.device_type, mixed_precision)
    device, host = model_state_bytes(profile, stats, world_size, states_precision(profile, precision, autocast),
                                     hw.ranks_per_node)
    device_total = None
    if acts.autocast is not None and autocast:
        per_sample, fixed = acts.autocast[ckpt]
        act = per_sample * micro_batch + fixed
        if profile == "zero0" and grad_accum == 1:
            # torch's optimizer frees the fp32 gradients (4P) at each step: they are made in the backward
            # as the activations are freed, so the peak is the larger of the two moments
            device_total = max(device, device - 4 * stats.params + act)
    else:
        per_sample = acts.per_sample_checkpointed if ckpt else acts.per_sample
        act = int(round(per_sample * micro_batch * (1.0 if precision == "fp32" else 0.5)))
    device_total = device + act if device_total is None else device_total
    if hw.device_type == "cpu" and host:
        # device and host are the same RAM: this rank's share of the offloaded states counts too
        device_total += int(round(host / min(hw.ranks_per_node, world_size)))
    dev_budget, host_budget = margin * hw.device_memory, margin * hw.host_memory
    why = []
    if device_total > dev_budget:
        why.append(f"needs {format_bytes(device_total)} > {format_bytes(dev_budget)} budget")
    if host > host_budget:
        why.append(f"host needs {format_bytes(host)} > {format_bytes(host_budget)} host budget")
    return ProfileEstimate(profile, ckpt, device, act, device_total, host, not why, "; ".join(why))


def _label(e: ProfileEstimate) -> str:
    return f"{e.profile}{' + checkpointing' if e.activation_checkpointing else ''}"


def choose_plan(stats: ModelStats, hw: Hardware, acts: Activations, world_size: int, micro_batch: int,
                precision: str = "auto", activation_checkpointing: str | bool = "auto", margin: float = 0.85,
                profiles=PROFILE_ORDER, mixed_precision: str = "auto", grad_accum: int = 1) -> Plan:
    """Walk the profiles in order and take the first that fits ``margin`` x the memory budgets.

    Fits means model states + activations x micro_batch <= margin x device_memory, and host
    bytes <= margin x host_memory. With checkpointing "auto": (1) the non-offload profiles
    without checkpointing, (2) the same with checkpointing, (3) the offload profiles without,
    then with checkpointing, because offload's CPU optimizer step usually costs more than
    recomputation. True/False forces checkpointing on/off for every profile. On a CPU
    device the offloaded states live in the same RAM and count against the device budget.
    Raises PlanError when nothing fits.
    """
    if world_size < 1 or micro_batch < 1:
        raise ValueError("world_size and micro_batch must be >= 1")
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}")
    unknown = [p for p in profiles if p not in PROFILE_ORDER]
    if unknown or not profiles:
        raise ValueError(f"unknown profiles {unknown}; known: {', '.join(PROFILE_ORDER)}")
    prec, prec_reason = choose_precision(hw, precision)
    plain = [p for p in PROFILE_ORDER if p in profiles and not _is_offload(p)]
    offload = [p for p in PROFILE_ORDER if p in profiles and _is_offload(p)]
    ordered = plain + offload
    if activation_checkpointing == "auto":
        passes = [(plain, False), (plain, True), (offload, False), (offload, True)]
    elif isinstance(activation_checkpointing, bool):
        passes = [(ordered, activation_checkpointing)]
    else:
        raise ValueError(f"activation_checkpointing must be 'auto', True or False, got {activation_checkpointing!r}")

    tried: list[ProfileEstimate] = []
    for names, ckpt in passes:
        for name in names:
            est = _estimate(name, ckpt, stats, hw, acts, world_size, micro_batch, prec, margin, mixed_precision,
                            grad_accum)
            tried.append(est)
            if est.fits:
                return Plan(name, prec, ckpt, tuple(tried), _reason(est, tried[:-1], activation_checkpointing, hw),
                            prec_reason, margin)
    ways = _what_would_fit(tried, stats, hw, acts, world_size, micro_batch, prec, margin, mixed_precision,
                           grad_accum)
    raise PlanError(_nothing_fits(tried, hw, margin, ways), tuple(tried))


def _what_would_fit(tried, stats, hw, acts, world_size, micro_batch, prec, margin, mixed_precision,
                    grad_accum) -> list[str]:
    """What would fit where nothing does, with numbers: more ranks (the fewest, by doubling), micro-batch 1,
    and more host memory per node, each re-estimated with the profiles and checkpointing just tried."""
    def first_fit(world, micro, hw_=hw):
        for e in tried:
            est = _estimate(e.profile, e.activation_checkpointing, stats, hw_, acts, world, micro, prec, margin,
                            mixed_precision, grad_accum)
            if est.fits:
                return est
        return None

    ways = []
    world = world_size * 2
    while world <= max(2 ** 24, world_size * 2):
        if est := first_fit(world, micro_batch):
            ways.append(f"{world} ranks at {min(hw.ranks_per_node, world)} a node ({_label(est)}: "
                        f"{format_bytes(est.device_total)} per rank)")
            break
        world *= 2
    if micro_batch > 1 and (est := first_fit(world_size, 1)):
        ways.append(f"--train.micro_batch=1 with a larger grad_accum ({_label(est)}: "
                    f"{format_bytes(est.device_total)} per rank)")
    dev_ok = [e for e in tried if e.device_total <= margin * hw.device_memory and hw.device_type != "cpu"]
    if dev_ok:
        need = min(dev_ok, key=lambda e: e.host_total)
        host = need.host_total / margin
        ways.append(f"{format_bytes(host)} host memory per node ({_label(need)}; planned with "
                    f"{format_bytes(hw.host_memory)}: --deepspeed.host_memory={math.ceil(host / 1e9)}GB)")
    return ways


def _nothing_fits(tried: list[ProfileEstimate], hw: Hardware, margin: float, ways=()) -> str:
    dev_budget, host_budget = margin * hw.device_memory, margin * hw.host_memory
    best = min(tried, key=lambda e: (e.device_total, e.host_total))
    msg = (f"no profile fits: the smallest per-rank need is {_label(best)} with {format_bytes(best.device_total)} "
           f"against a budget of {format_bytes(dev_budget)} ({margin:g} x {format_bytes(hw.device_memory)})")
    if best.host_total > host_budget:
        msg += (f", but it also needs {format_bytes(best.host_total)} host per node against "
                f"{format_bytes(host_budget)} ({margin:g} x {format_bytes(hw.host_memory)})")
        host_ok = [e for e in tried if e.host_total <= host_budget]
        if host_ok:
            alt = min(host_ok, key=lambda e: e.device_total)
            msg += f"; within the host budget the smallest is {_label(alt)} with {format_bytes(alt.device_total)}"
    if ways:
        return msg + "; what would fit: " + "; or ".join(ways)
    return msg + "; use more ranks, a smaller micro-batch or a machine with more memory"


def _closest(estimates, hw: Hardware) -> ProfileEstimate:
    return min(estimates, key=lambda e: max(e.device_total / hw.device_memory, e.host_total / hw.host_memory))


def _reason(win: ProfileEstimate, losers: list[ProfileEstimate], ckpt_mode, hw: Hardware) -> str:
    fits = (f"{_label(win)} fits: {format_bytes(win.model_states)} model states + "
            f"{format_bytes(win.activations)} activations")
    if win.host_total:
        fits += f" ({format_bytes(win.host_total)} offloaded to host per node)"
    same_pass = [e for e in losers if (ckpt_mode != "auto" or (_is_offload(e.profile) == _is_offload(win.profile)
                                                                and e.activation_checkpointing
                                                                == win.activation_checkpointing))]
    earlier = [e for e in losers if e not in same_pass]
    parts = []
    plain = [e for e in earlier if not _is_offload(e.profile)]
    if plain:
        best = _closest(plain, hw)
        where = ("nothing fits without activation checkpointing" if not _is_offload(win.profile)
                 else "no non-offload profile fits, even with activation checkpointing")
        parts.append(f"{where} (closest: {_label(best)} {best.why_not})")
    offl = [e for e in earlier if _is_offload(e.profile)]
    if offl:
        best = _closest(offl, hw)
        parts.append(f"no offload profile fits without it (closest: {_label(best)} {best.why_not})")
    parts += [f"{_label(e)} {e.why_not}" for e in same_pass]
    text = "; ".join(parts + [fits]) + "."
    if ckpt_mode == "auto" and _is_offload(win.profile):
        text += (" Offload was tried only after activation checkpointing because its CPU optimizer step "
                 "usually costs more than recomputation.")
    return text


def format_plan(plan: Plan, stats: ModelStats, hw: Hardware, world_size: int, micro_batch: int) -> str:
    """A human-readable table of the plan: header with P, L, N, M, precision and reason, one row per estimate."""
    lines = [
        f"model: P={stats.params:,} params, L={stats.largest_module_params:,} (largest module), "
        f"hidden={stats.hidden_size}, layers={stats.num_layers}",
        f"hardware: {hw.name or hw.device_type}, N={world_size} ranks sharing ZeRO's partitions (dp x sp) "
        f"({hw.ranks_per_node} per node), M={format_bytes(hw.device_memory)} per rank "
        f"(budget {format_bytes(plan.margin * hw.device_memory)}), host {format_bytes(hw.host_memory)} per node, "
        f"micro-batch {micro_batch}",
        f"precision: {plan.precision} ({plan.precision_reason})",
        f"choice: {plan.profile}{', activation checkpointing' if plan.activation_checkpointing else ''}",
        f"reason: {plan.reason}",
        "",
    ]
    header = ("", "profile", "ckpt", "model states", "activations", "device total", "host/node", "fits")
    rows = [header]
    for e in plan.estimates:
        chosen = e.profile == plan.profile and e.activation_checkpointing == plan.activation_checkpointing
        rows.append(("*" if chosen else "", e.profile, "yes" if e.activation_checkpointing else "no",
                     format_bytes(e.model_states), format_bytes(e.activations), format_bytes(e.device_total),
                     format_bytes(e.host_total) if e.host_total else "-", "yes" if e.fits else f"no: {e.why_not}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1])
    if any(e.device_total < e.model_states + e.activations for e in plan.estimates):
        lines.append("(device total below model states + activations: bf16 autocast at ZeRO-0 with one micro-batch "
                     "a step frees the fp32 gradients at each step, so they never coexist with the activations)")
    return "\n".join(lines)


# ---------------------------------------------------------------- pipeline stages

PIPELINE_PROFILES = ("zero0", "zero1")  # DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3


def uniform_split(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous runs of ``n`` layers, sizes differing by at most one (larger first)."""
    if not 1 <= parts <= n:
        raise ValueError(f"{n} layers cannot fill {parts} pipeline stages; use pp <= {n}")
    base, extra = divmod(n, parts)
    bounds = [0]
    for s in range(parts):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def balanced_split(weights, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous, non-empty runs of ``weights`` minimising the heaviest run.

    Dynamic programme over (layers, stages); among equally heavy splits the one with the
    earliest boundaries is taken.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{n} layers cannot fill {parts} pipeline stages; use pp <= {n}")
    if any(w < 0 for w in weights):
        raise ValueError("layer weights must not be negative")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = float("inf")
    best = [[inf] * (parts + 1) for _ in range(n + 1)]  # best[i][j]: first i layers in j stages
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for k in range(j - 1, i):
                cost = max(best[k][j - 1], prefix[i] - prefix[k])
                if cost < best[i][j] - 1e-12 * max(1.0, cost):
                    best[i][j], cut[i][j] = cost, k
    bounds, i = [n], n
    for j in range(parts, 0, -1):
        i = cut[i][j]
        bounds.append(i)
    return bounds[::-1]


@dataclass(frozen=True)
class StageEstimate:
    """Memory of one pipeline stage under one profile: its parameters' states and in-flight activations."""

    stage: int
    params: int
    in_flight: int
    model_states: int
    activations: int

    @property
    def total(self) -> int:
        return self.model_states + self.activations


def stage_estimates(profile: str, layer_params, bounds, acts: Activations, dp: int, micro_batch: int,
                    grad_accum: int, precision: str, ckpt: bool, layer_acts=None,
                    autocast: bool = False) -> list[StageEstimate]:
    """Per-stage bytes under 1F1B: stage s holds min(pp - s, grad_accum) micro-batches' activations.

    A stage's model states are the profile's bytes for its own parameters (ZeRO-1 partitions
    them over the dp ranks of the stage). Activations per sample: the stage's layers' traced
    bytes when ``layer_acts`` = (bytes per layer, bytes per layer with checkpointing) is
    given (with checkpointing, plus the largest recomputed layer of the stage, which the backward holds for
    one micro-batch at a time), else the whole-model trace shared equally among the layers. ``autocast``: bf16 runs as
    torch.autocast over fp32 weights (:func:`states_precision`).
    """
    if profile not in PIPELINE_PROFILES:
        raise ValueError(f"{profile} is incompatible with pipeline parallelism (DeepSpeed's pipeline engine "
                         f"takes ZeRO-0 or ZeRO-1 only)")
    pp, layers = len(bounds) - 1, len(layer_params)
    per_sample = acts.per_sample_checkpointed if ckpt else acts.per_sample
    per_layer = (list(layer_acts[1] if ckpt else layer_acts[0]) if layer_acts is not None
                 else [per_sample / layers] * layers)
    scale = 1.0 if _PRECISION_ALIASES.get(precision, precision) == "fp32" else 0.5
    out = []
    for s in range(pp):
        lo, hi = bounds[s], bounds[s + 1]
        params = int(sum(layer_params[lo:hi]))
        states, _ = model_state_bytes(profile, ModelStats(max(params, 1), 0, 0, 0), dp,
                                      states_precision(profile, precision, autocast), 1)
        flight = min(pp - s, grad_accum)
        # checkpointed: the backward holds one recomputed layer of one micro-batch besides the kept inputs
        recompute = 0 if not ckpt or layer_acts is None else max(
            (full for full, kept in zip(layer_acts[0][lo:hi], layer_acts[1][lo:hi]) if full != kept), default=0)
        act = int(round((sum(per_layer[lo:hi]) * flight + recompute) * micro_batch * scale))
        out.append(StageEstimate(s, params, flight, states, act))
    return out


def choose_pipeline_plan(layer_params, bounds, hw: Hardware, acts: Activations, dp: int, micro_batch: int,
                         grad_accum: int, precision: str = "auto", activation_checkpointing: str | bool = "auto",
                         margin: float = 0.85, layer_acts=None,
                         mixed_precision: str = "auto") -> tuple[Plan, list[StageEstimate]]:
    """The profile (ZeRO-0, then ZeRO-1) and checkpointing under which the fullest stage fits.

    Same walk as :func:`choose_plan` over the two profiles the pipeline engine takes; each
    candidate is judged by its largest stage. Returns the plan and the chosen candidate's
    per-stage estimates; PlanError when nothing fits. The pipeline engine runs bf16 as DeepSpeed's own
    16-bit weights unless ``mixed_precision`` is ``autocast``.
    """
    prec, prec_reason = choose_precision(hw, precision)
    autocast = prec == "bf16" and mixed_precision == "autocast"
    if activation_checkpointing == "auto":
        passes = [False, True]
    elif isinstance(activation_checkpointing, bool):
        passes = [activation_checkpointing]
    else:
        raise ValueError(f"activation_checkpointing must be 'auto', True or False, got {activation_checkpointing!r}")
    budget = margin * hw.device_memory
    tried: list[ProfileEstimate] = []
    for ckpt in passes:
        for profile in PIPELINE_PROFILES:
            stages = stage_estimates(profile, layer_params, bounds, acts, dp, micro_batch, grad_accum, prec, ckpt,
                                     layer_acts, autocast)
            worst = max(stages, key=lambda e: e.total)
            why = (f"stage {worst.stage} needs {format_bytes(worst.total)} > {format_bytes(budget)} budget"
                   if worst.total > budget else "")
            est = ProfileEstimate(profile, ckpt, worst.model_states, worst.activations, worst.total, 0, not why, why)
            tried.append(est)
            if est.fits:
                reason = "; ".join([f"{_label(e)} {e.why_not}" for e in tried[:-1]] +
                                   [f"{_label(est)} fits on every stage (largest: stage {worst.stage}, "
                                    f"{format_bytes(worst.model_states)} model states + "
                                    f"{format_bytes(worst.activations)} activations of {worst.in_flight} "
                                    f"in-flight micro-batches)"]) + "."
                return Plan(profile, prec, ckpt, tuple(tried), reason, prec_reason, margin), stages
    raise PlanError(_nothing_fits(tried, hw, margin), tuple(tried))


def suggest_pp(layer_params, hw: Hardware, acts: Activations, world_size: int, micro_batch: int,
               grad_accum: int, precision: str = "auto", margin: float = 0.85, split=None,
               layer_acts=None, mixed_precision: str = "auto") -> int | None:
    """The smallest pipeline degree (dividing the world, at most the layer count) whose plan fits, or None.

    ``split(pp) -> bounds`` cuts the layers (default: balanced parameter counts).
    """
    if split is None:
        split = lambda pp: balanced_split(layer_params, pp)  # noqa: E731
    for pp in range(2, min(world_size, len(layer_params)) + 1):
        if world_size % pp:
            continue
        try:
            choose_pipeline_plan(layer_params, split(pp), hw, acts, world_size // pp, micro_batch, grad_accum,
                                 precision, "auto", margin, layer_acts, mixed_precision)
        except PlanError:
            continue
        return pp
    return None


def format_stages(stages: list[StageEstimate], names: list[str]) -> str:
    """The stage split with each stage's memory under the chosen profile."""
    lines = ["pipeline stages (1F1B; stage s holds min(pp - s, grad_accum) micro-batches in flight):"]
    for e, name in zip(stages, names):
        lines.append(f"  {name}: {format_bytes(e.model_states)} model states + {format_bytes(e.activations)} "
                     f"activations ({e.in_flight} in flight) = {format_bytes(e.total)}")
    return "\n".join(lines)
