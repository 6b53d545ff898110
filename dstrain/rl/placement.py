"""The ``placement`` section of a BiLevel SCoRe run: where each model lives, and whether it fits.

Six roles, each placed on a device as a DeepSpeed engine (with its own ZeRO ``profile``)
or as a plain module:

    role           default                      trained?
    policy         auto device, engine          yes
    guidance       auto device, engine          yes, unless ``frozen: true``
    reference      cpu, plain module            never (the frozen KL reference)
    critic         auto device, engine          yes  (backbone + ValueHead)
    critic_target  cpu, plain module            never (Polyak copy of the critic)
    value          auto device, engine          yes  (backbone + ValueHead)

``device`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; ``resolve_devices`` maps auto and
cuda to cuda:0 when a GPU exists and everything to cpu on a CPU-only machine. A frozen
role may still be an engine (e.g. ZeRO-3 to shard a large reference), but one without an
optimizer: its profile is zero0, zero3 or zero3_offload.

Memory (``placement_memory``), bytes per parameter P with w = 2 (bf16/fp16) or 4 (fp32):
a trained engine counts its model states as ``dstrain.engine.profiles.model_state_bytes``
(16P at ZeRO-0 in 16-bit, split by the profile as DESIGN.md's table says; host terms of
offload profiles go to ``cpu``); a frozen engine holds weights only (wP; zero3: wP/N + wL;
zero3_offload: wL on the device, wP per node on cpu); a plain module holds wP. A
``ValueHead`` adds hidden + 1 parameters, which vanish next to the backbone. Profile
``auto`` is counted as zero0 (the largest), so an unresolved plan errs on the safe side.
Totals are per GPU for ``cuda:N`` (every rank has its own) and per node for ``cpu``
(every local rank keeps its own copy of a cpu-placed module).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from dstrain.config import ConfigError, build_section
from dstrain.engine.profiles import PROFILE_ORDER, ModelStats, format_bytes, model_state_bytes, parse_bytes

ROLES = ("policy", "guidance", "reference", "critic", "critic_target", "value")
NEVER_TRAINED = ("reference", "critic_target")
FROZEN_ENGINE_PROFILES = ("zero0", "zero3", "zero3_offload")
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class RolePlacement:
    """Where one trained model lives."""

    device: str = "auto"
    """auto | cpu | cuda | cuda:N (auto: cuda:0 if there is a GPU, else cpu)."""
    engine: bool = True
    """A DeepSpeed engine (true) or a plain module (false; frozen roles only)."""
    profile: str = "auto"
    """ZeRO profile of the engine: auto (the factory picks) or a name from ds_configs/."""
    optimizer: Any = "auto"
    """auto (trained roles: yes, frozen: no); true on a frozen role is an error."""


@dataclass
class GuidancePlacement(RolePlacement):
    """The guidance model: trained on its own schedule unless ``frozen``."""

    frozen: bool = False
    """Keep the guidance model fixed (then it may be a plain module)."""


@dataclass
class FrozenPlacement(RolePlacement):
    """A model that is never trained (reference, critic_target)."""

    device: str = "cpu"
    engine: bool = False


@dataclass
class PlacementConfig:
    """Placement of every model of a BiLevel SCoRe run (see the module docstring)."""

    policy: RolePlacement = field(default_factory=RolePlacement)
    guidance: GuidancePlacement = field(default_factory=GuidancePlacement)
    reference: FrozenPlacement = field(default_factory=FrozenPlacement)
    critic: RolePlacement = field(default_factory=RolePlacement)
    critic_target: FrozenPlacement = field(default_factory=FrozenPlacement)
    value: RolePlacement = field(default_factory=RolePlacement)

    def role(self, name: str) -> RolePlacement:
        if name not in ROLES:
            raise KeyError(f"unknown role {name!r}; roles: {', '.join(ROLES)}")
        return getattr(self, name)

    def trainable(self, name: str) -> bool:
        """Whether the role gets an optimizer: never reference/critic_target; guidance unless frozen."""
        if name in NEVER_TRAINED:
            return False
        return not (name == "guidance" and self.guidance.frozen)

    def kind(self, name: str) -> str:
        """``engine zero2 (trained)``, ``engine zero3 (frozen)`` or ``module (frozen)``."""
        r = self.role(name)
        state = "trained" if self.trainable(name) else "frozen"
        return f"engine {r.profile} ({state})" if r.engine else f"module ({state})"


def _fail(source: str, key: str, problem: str) -> None:
    raise ConfigError(source, key, problem)


def validate_placement(p: PlacementConfig, cuda_count: int | None = None, source: str = "run config",
                       prefix: str = "placement.") -> None:
    """Reject impossible placements with one line naming ``placement.<role>.<key>``.

    With ``cuda_count`` (GPUs on this machine) a ``cuda:N`` beyond them is refused too
    (0 GPUs: every device falls back to cpu, see ``resolve_devices``).
    """
    for name in ROLES:
        r, key = p.role(name), f"{prefix}{name}."
        trained = p.trainable(name)
        if not _DEVICE_RE.match(str(r.device)):
            _fail(source, key + "device", f"must be auto, cpu, cuda or cuda:N, got {r.device!r}")
        if cuda_count and r.device.startswith("cuda:") and int(r.device[5:]) >= cuda_count:
            _fail(source, key + "device", f"{r.device} but this machine has {cuda_count} GPU(s) "
                                          f"(cuda:0 to cuda:{cuda_count - 1})")
        if r.optimizer not in ("auto", True, False):
            _fail(source, key + "optimizer", f"must be auto, true or false, got {r.optimizer!r}")
        if r.profile != "auto" and r.profile not in PROFILE_ORDER:
            _fail(source, key + "profile", f"unknown profile {r.profile!r}; use auto or one of "
                                           f"{', '.join(PROFILE_ORDER)}")
        if not r.engine and r.profile != "auto":
            _fail(source, key + "profile", f"{name} is a plain module (engine: false); a ZeRO profile "
                                           "needs engine: true")
        if trained:
            if not r.engine:
                why = " (or set frozen: true)" if name == "guidance" else ""
                _fail(source, key + "engine", f"{name} is trained, so it needs a DeepSpeed engine{why}")
            if r.optimizer is False:
                why = "set frozen: true instead" if name == "guidance" else "it is always trained"
                _fail(source, key + "optimizer", f"{name} is trained and needs an optimizer; {why}")
            continue
        what = "is never trained" if name in NEVER_TRAINED else "is frozen"
        if r.optimizer is True:
            _fail(source, key + "optimizer", f"{name} {what}; its engine cannot have an optimizer")
        if r.engine and r.profile not in ("auto",) + FROZEN_ENGINE_PROFILES:
            _fail(source, key + "profile", f"{name} {what} and has no optimizer states or gradients "
                                           f"for {r.profile} to shard; use {', '.join(FROZEN_ENGINE_PROFILES)}")


def placement_from_dict(data: Mapping[str, Any] | None, source: str = "run config", prefix: str = "placement.",
                        cuda_count: int | None = None) -> PlacementConfig:
    """Typed, validated placement from the raw section (missing roles and keys take their defaults)."""
    p = build_section(PlacementConfig, dict(data or {}), source, prefix)
    validate_placement(p, cuda_count, source, prefix)
    return p


def resolve_devices(p: PlacementConfig, cuda_count: int) -> PlacementConfig:
    """A copy with concrete devices: auto/cuda -> cuda:0 with a GPU; everything -> cpu without one."""
    validate_placement(p, cuda_count)
    changes = {}
    for name in ROLES:
        r = p.role(name)
        device = r.device
        if cuda_count <= 0:
            device = "cpu"
        elif device in ("auto", "cuda"):
            device = "cuda:0"
        changes[name] = dataclasses.replace(r, device=device)
    return dataclasses.replace(p, **changes)


# ---------------------------------------------------------------- memory

def _weight_bytes(precision: str) -> int:
    if precision not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    return 4 if precision == "fp32" else 2


def _role_bytes(p: PlacementConfig, name: str, params: int, largest: int, precision: str, world_size: int,
                ranks_per_node: int) -> dict[str, int]:
    """Bytes one role puts on each device: per rank on its device, per node on cpu."""
    r = p.role(name)
    if r.device in ("auto", "cuda"):
        raise ValueError(f"placement.{name}.device is {r.device!r}; call resolve_devices first")
    w = _weight_bytes(precision)
    n, local = world_size, ranks_per_node
    share = min(1.0, local / n)
    profile = "zero0" if r.profile == "auto" else r.profile
    if params == 0:
        device, host = 0.0, 0.0
    elif not r.engine:
        device, host = w * params, 0.0
    elif p.trainable(name):
        stats = ModelStats(params, min(largest, params), 0, 0)
        device, host = model_state_bytes(profile, stats, n, precision, local)
    elif profile == "zero3":
        device, host = w * params / n + w * largest, 0.0
    elif profile == "zero3_offload":
        device, host = w * largest, w * params * share
    else:
        device, host = w * params, 0.0
    out: dict[str, float] = {}
    per_device = device * (local if r.device == "cpu" else 1)  # each local rank keeps its own copy
    out[r.device] = out.get(r.device, 0) + per_device
    if host:
        out["cpu"] = out.get("cpu", 0) + host
    return {k: int(round(v)) for k, v in out.items()}


def _rows(p, param_counts, precision, world_size, ranks_per_node, largest_module):
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    local = world_size if ranks_per_node is None else ranks_per_node
    if local < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
    missing = [r for r in ROLES if r not in param_counts]
    if missing:
        raise ValueError(f"param_counts lacks role(s) {', '.join(missing)} (give 0 for a model that is absent)")
    largest_module = largest_module or {}
    rows = []
    for name in ROLES:
        params = int(param_counts[name])
        if params < 0:
            raise ValueError(f"param_counts[{name!r}] must not be negative, got {params}")
        largest = int(largest_module.get(name, 0))
        rows.append((name, p.role(name).device, p.kind(name), params,
                     _role_bytes(p, name, params, largest, precision, world_size, local)))
    return rows, local


def placement_memory(p: PlacementConfig, param_counts: Mapping[str, int], precision: str, world_size: int = 1,
                     ranks_per_node: int | None = None, largest_module: Mapping[str, int] | None = None
                     ) -> dict[str, int]:
    """Bytes needed on each device: per GPU for ``cuda:N``, per node for ``cpu`` (module docstring).

    ``param_counts`` has every role (0 for an absent model); ``largest_module`` (parameters
    of each model's largest module, for ZeRO-3's gathered term) defaults to 0;
    ``ranks_per_node`` defaults to ``world_size`` (one node).
    """
    rows, _ = _rows(p, param_counts, precision, world_size, ranks_per_node, largest_module)
    total: dict[str, int] = {}
    for *_, per_device in rows:
        for dev, b in per_device.items():
            total[dev] = total.get(dev, 0) + b
    return total


def _capacity(capacities: Mapping[str, Any], device: str) -> int | None:
    for key in (device, device.split(":")[0]):
        if key in capacities:
            return parse_bytes(capacities[key])
    return None


def check_fits(memory: Mapping[str, int], capacities: Mapping[str, Any], margin: float = 1.0) -> None:
    """Raise ValueError naming each device whose need exceeds ``margin`` x its capacity.

    ``capacities`` maps a device (``cuda:1``) or a device type (``cuda``, ``cpu``) to bytes
    or a size string (``"80GB"``).
    """
    problems = []
    for device in sorted(memory):
        need = memory[device]
        if need <= 0:
            continue
        cap = _capacity(capacities, device)
        if cap is None:
            problems.append(f"{device}: no capacity given (needs {format_bytes(need)})")
        elif need > margin * cap:
            budget = f"{margin:g} x {format_bytes(cap)}" if margin != 1.0 else format_bytes(cap)
            problems.append(f"{device} needs {format_bytes(need)} ({need:,} bytes) but has a capacity of "
                            f"{budget} ({int(margin * cap):,} bytes)")
    if problems:
        raise ValueError("placement does not fit: " + "; ".join(problems))


def format_placement_plan(p: PlacementConfig, param_counts: Mapping[str, int], precision: str, world_size: int = 1,
                          capacities: Mapping[str, Any] | None = None, ranks_per_node: int | None = None,
                          largest_module: Mapping[str, int] | None = None) -> str:
    """A table (role, device, kind, params, bytes) and per-device totals against capacities."""
    rows, local = _rows(p, param_counts, precision, world_size, ranks_per_node, largest_module)
    table = [("role", "device", "kind", "params", "bytes")]
    for name, device, kind, params, per_device in rows:
        parts = [format_bytes(per_device.get(device, 0))]
        parts += [f"+ {format_bytes(b)} on {d}" for d, b in per_device.items() if d != device and b]
        table.append((name, device, kind, f"{params:,}", " ".join(parts)))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines = [f"placement: {precision}, {world_size} rank(s), {local} per node"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in table]
    memory = placement_memory(p, param_counts, precision, world_size, ranks_per_node, largest_module)
    lines.append("totals (cuda: per GPU; cpu: per node):")
    for device in sorted(memory):
        need = memory[device]
        cap = _capacity(capacities or {}, device)
        if cap is None:
            lines.append(f"  {device}: {format_bytes(need)} (capacity unknown)")
        else:
            verdict = "fits" if need <= cap else "DOES NOT FIT"
            lines.append(f"  {device}: {format_bytes(need)} of {format_bytes(cap)} ({verdict})")
    return "\n".join(lines)
