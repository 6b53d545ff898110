"""The models of a BiLevel SCoRe run: where they live, what they cost, how they are built and saved.

Roles (``dstrain.rl.placement``): policy, guidance, reference, critic, critic_target, value.
Which are present depends on the task: the reference only with a KL term (beta1 or beta2 >
0), the critic, its target and the value function only with ``advantage: critic``. The
critic and value function are a ``ValueHead`` on the policy family's backbone (output
head removed), initialised from the (warm-started) policy weights.

Devices: ``resolve_placement`` maps ``auto``/``cuda`` to the rank's GPU and everything to
the CPU on a machine without one; an explicit ``cuda:N`` is checked against the GPUs a
rank owns (all of them when one rank runs per node, else just its own, which is
``cuda:0`` in placement terms). DeepSpeed engines always live on their rank's own
device; plain frozen modules (reference, critic_target, a frozen guidance) may sit
on any other GPU the rank owns, or on the CPU.
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from dstrain.config import ConfigError, RunConfig
from dstrain.engine.profiles import format_bytes
from dstrain.rl import placement as pl

TRAINED_ENGINE_ROLES = ("guidance", "critic", "value")
LR_FIELD = {"guidance": "guidance_lr", "critic": "critic_lr", "value": "value_lr"}


def present_roles(task) -> set[str]:
    """Roles this task builds (the others count 0 parameters in the memory plan)."""
    roles = {"policy"} | ({"guidance"} if getattr(task, "guidance", "model") == "model" else set())
    if task.beta1 > 0 or task.beta2 > 0:
        roles.add("reference")
    if task.advantage == "critic":
        roles |= {"critic", "critic_target", "value"}
    return roles


# ---------------------------------------------------------------- placement

def _gpus_per_rank(cuda_count: int, local_ranks: int) -> int:
    """GPUs one rank may place models on: all of them with one rank per node, else its own (``cuda_count`` is what
    this rank sees: 1 where CUDA_VISIBLE_DEVICES gives each rank its own GPU, ``dstrain.gpu_binding``)."""
    return cuda_count if local_ranks <= 1 else min(1, cuda_count)


def resolve_placement(cfg: RunConfig, task, cuda_count: int, local_ranks: int) -> pl.PlacementConfig:
    """The run's placement with concrete devices (``cpu`` or rank-relative ``cuda:N``); ConfigError
    naming ``placement.<role>.<key>`` for a device this machine does not have or an engine
    placed off its rank's device."""
    p = pl.placement_from_dict(type(task).placement_section(cfg.task, cfg.placement))
    per_rank = _gpus_per_rank(cuda_count, local_ranks)
    for role in pl.ROLES:
        dev = p.role(role).device
        if dev.startswith("cuda:") and int(dev[5:]) >= per_rank:
            have = ("this machine has no GPU" if cuda_count == 0 else
                    "each rank sees one GPU here, its own (CUDA_VISIBLE_DEVICES set per rank): cuda:0"
                    if cuda_count < local_ranks else
                    f"each rank owns {per_rank} GPU(s) here (cuda:0 to cuda:{per_rank - 1}; "
                    f"{local_ranks} rank(s) per node on {cuda_count} GPU(s))")
            raise ConfigError("run config", f"placement.{role}.device", f"{dev} but {have}")
    if p.critic_target.engine:
        raise ConfigError("run config", "placement.critic_target.engine",
                          "the target critic is a plain module (it is Polyak-averaged in place); set engine: false")
    p = pl.resolve_devices(p, cuda_count)
    if cuda_count:
        for role in pl.ROLES:
            r = p.role(role)
            if r.engine and r.device != "cuda:0":
                raise ConfigError("run config", f"placement.{role}.device",
                                  f"{r.device}: a DeepSpeed engine runs on its rank's own GPU (cuda:0 in placement "
                                  f"terms); use an offload profile to hold states in host memory, or engine: false "
                                  f"for a frozen model")
    return p


def torch_device(device: str, world) -> torch.device:
    """The physical device of a resolved placement device on this rank (``cuda:N`` is rank-relative)."""
    if device == "cpu":
        return torch.device("cpu")
    base = world.device.index if world.device.type == "cuda" else 0
    return torch.device("cuda", base + int(device.split(":")[1]))


# ---------------------------------------------------------------- memory plan

def value_head_class(spec):
    """The model family's value head (``spec.rl.value_head``), used for the critic and the value function."""
    cls = getattr(spec.rl, "value_head", None)
    if cls is None:
        raise ConfigError("run config", "model.name", f"model {spec.name!r} has no value head for the critics "
                                                      f"(its SPEC.rl lacks value_head)")
    return cls


def build_value_model(spec, model_cfg, ds_config=None) -> torch.nn.Module:
    """Critic / value function: ValueHead on the policy's backbone, without its output head.

    The head starts at zero, so Q - V is exactly 0 until the critics have learnt something:
    no policy step follows an untrained critic's noise (the head's own gradient moves it
    on the first step, the backbone's follows).
    """
    policy = spec.rl.build(model_cfg, ds_config=ds_config)
    hf = getattr(policy, "hf", policy)
    if hasattr(hf, "set_output_embeddings") and hf.get_output_embeddings() is not None:
        hf.set_output_embeddings(torch.nn.Identity())  # the base model's hidden states are read
    return value_head_class(spec)(hf, init="zero")


def param_counts(spec, model_cfg, task) -> tuple[dict[str, int], dict[str, int]]:
    """(parameters, parameters of the largest module) of every role, 0 for absent ones."""
    from dstrain.engine.hardware import model_stats
    lm = model_stats(lambda: spec.build(model_cfg))
    head = model_stats(lambda: build_value_model(spec, model_cfg))
    present = present_roles(task)
    stats = {"policy": lm, "guidance": lm, "reference": lm, "critic": head, "critic_target": head, "value": head}
    counts = {r: stats[r].params if r in present else 0 for r in pl.ROLES}
    largest = {r: stats[r].largest_module_params if r in present else 0 for r in pl.ROLES}
    return counts, largest


def with_profiles(p: pl.PlacementConfig, profiles: dict[str, str], policy_zero3: bool) -> pl.PlacementConfig:
    """``p`` with each engine's ``auto`` profile replaced by the one it will run (for the table)."""
    changes = {}
    for role in pl.ROLES:
        r = p.role(role)
        if not r.engine or r.profile != "auto":
            continue
        if role in profiles:
            prof = profiles[role]
        else:  # frozen engines follow the reference's rule (models.policy reference_ds_config)
            prof = "zero3_offload" if policy_zero3 else "zero0"
        changes[role] = dataclasses.replace(r, profile=prof)
    return dataclasses.replace(p, **changes)


def policy_activations(plan) -> int:
    """Activation bytes per rank of the policy at its micro-batch, as the planner traced them (they
    depend on activation checkpointing, not on the ZeRO profile)."""
    estimates = list(getattr(plan.plan, "estimates", ()))
    same = [e for e in estimates if e.activation_checkpointing == plan.activation_checkpointing]
    return int((same or estimates)[0].activations) if estimates else 0


def memory_report(p, counts, largest, precision: str, world_size: int, ranks_per_node: int,
                  capacities: dict, margin: float, activations: int = 0) -> tuple[str, str | None]:
    """(placement table, None) or (table, one line naming the device, need and capacity).

    Needs are the models' states (``placement_memory``) plus ``activations`` (bytes per rank;
    the policy's, the largest graph alive at once) on the policy's device.
    """
    usable = {k: int(v * margin) for k, v in capacities.items()}
    memory = pl.placement_memory(p, counts, precision, world_size, ranks_per_node, largest)
    dev = p.policy.device
    acts = activations * (ranks_per_node if dev == "cpu" else 1)
    table = pl.format_placement_plan(p, counts, precision, world_size, usable, ranks_per_node, largest)
    lines = [f"placement memory (capacity = memory x deepspeed.margin {margin:g})",
             table.split("\ntotals")[0],
             f"activations: {format_bytes(acts)} on {dev} (the policy's at micro_batch x data.seq_len tokens: "
             f"set data.seq_len to the turn-2 episode length, or task.max_prompt_tokens to plan that episode's bound)",
             "totals (cuda: per GPU; cpu: per node):"]
    need = dict(memory)
    need[dev] = need.get(dev, 0) + acts
    problems = []
    for device in sorted(need):
        cap = usable.get(device, usable.get(device.split(":")[0]))
        verdict = "capacity unknown" if cap is None else "fits" if need[device] <= cap else "DOES NOT FIT"
        shown = f" of {format_bytes(cap)}" if cap is not None else ""
        lines.append(f"  {device}: {format_bytes(need[device])}{shown} ({verdict})")
        if cap is not None and need[device] > cap:
            models = memory.get(device, 0)
            problems.append(f"{device} needs {format_bytes(need[device])} ({need[device]:,} bytes: models "
                            f"{format_bytes(models)} + activations {format_bytes(need[device] - models)}) but has "
                            f"a capacity of {format_bytes(cap)} ({cap:,} bytes = {margin:g} x its memory)")
    problem = None
    if problems:
        problem = ("placement does not fit: " + "; ".join(problems)
                   + " (raise deepspeed.device_memory / host_memory, or move models with placement)")
    return "\n".join(lines), problem


def capacities_for(hw) -> dict[str, int]:
    """Bytes per device type: a GPU's memory; the CPU's per node (a CPU rank's budget x local ranks)."""
    if hw.device_type == "cuda":
        return {"cuda": hw.device_memory, "cpu": hw.host_memory}
    return {"cpu": hw.device_memory * hw.ranks_per_node}


def role_profiles(p: pl.PlacementConfig, task, policy_profile: str) -> dict[str, str]:
    """ZeRO profile of each trained engine present: its placement profile, or the policy's for auto."""
    out = {"policy": policy_profile}
    for role in TRAINED_ENGINE_ROLES:  # placement_section already froze a task.guidance_frozen guidance
        if role in present_roles(task) and p.trainable(role):
            prof = p.role(role).profile
            out[role] = policy_profile if prof == "auto" else prof
    return out


def builtin_equivalent(ds_config: dict) -> str:
    """The ds_configs/ profile whose memory terms match a resolved DeepSpeed JSON (a user's file):
    its ZeRO stage and what it offloads. The placement table counts a user's file this way."""
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, dict) else 0

    def offloads(key: str) -> bool:
        block = zero.get(key) if isinstance(zero, dict) else None
        return isinstance(block, dict) and str(block.get("device", "none")).lower() in ("cpu", "nvme")
    if stage >= 3:
        return "zero3_offload" if offloads("offload_param") else \
            "zero3_offload_optimizer" if offloads("offload_optimizer") else "zero3"
    if offloads("offload_optimizer"):
        return "zero2_offload"  # ZeRO-1 with optimizer offload keeps the same device / host split
    return ("zero0", "zero1", "zero2")[max(0, stage)]


def table_profiles(profiles: dict[str, str], plan) -> dict[str, str]:
    """``profiles`` with the policy's user file (a path, not a ds_configs/ name) as its built-in equivalent."""
    from dstrain.engine.profiles import PROFILE_ORDER
    same = builtin_equivalent(plan.ds_config)
    return {role: same if prof == plan.profile and prof not in PROFILE_ORDER else prof
            for role, prof in profiles.items()}


def plan_report(cfg: RunConfig, plan, world_size: int, ranks_per_node: int, device_type: str | None,
                gpus_per_node: int) -> tuple[str, str | None]:
    """``dstrain plan``'s hook: the placement table and, if it does not fit, why (one line)."""
    from dstrain.engine.hardware import detect_hardware
    from dstrain.trainers import task_config
    from models import registry
    task = task_config(cfg)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cuda_count = (torch.cuda.device_count() or gpus_per_node) if device_type == "cuda" else 0
    p = resolve_placement(cfg, task, cuda_count, ranks_per_node)
    spec = registry.get_spec(cfg.model.name)
    mcfg = registry.make_model_config(cfg.model.name, cfg.model.size, cfg.model.args)
    counts, largest = param_counts(spec, mcfg, task)
    hw, _ = detect_hardware(cfg.deepspeed.device_memory, cfg.deepspeed.host_memory, ranks_per_node, device_type)
    profiles = table_profiles(role_profiles(p, task, plan.profile), plan)
    placed = with_profiles(p, profiles, plan.zero["stage"] == 3)
    table, problem = memory_report(placed, counts, largest, plan.precision, world_size, ranks_per_node,
                         capacities_for(hw), cfg.deepspeed.margin, policy_activations(plan))
    trained = [r for r in TRAINED_ENGINE_ROLES if r in profiles]
    sched = plan.ds_config.get("scheduler")
    rates = f"policy {cfg.train.lr:g}, " + ", ".join(f"{r} {getattr(task, LR_FIELD[r]):g}" for r in trained)
    if trained and isinstance(sched, dict) and not sched.get("type"):  # ("scheduler": {}: DeepSpeed builds none)
        table += (f"\nlearning rates: {rates}, each constant (the DeepSpeed JSON's scheduler block is empty, and "
                  "DeepSpeed builds no scheduler from it)")
    elif trained and isinstance(sched, dict):
        scaled = rescale_schedule(copy.deepcopy(plan.ds_config), 1.0) is not None
        table += (f"\nlearning rates: {rates}"
                  + f"; each engine runs the DeepSpeed JSON's {sched.get('type')} scheduler"
                  + (" with its learning rates scaled to the engine's" if scaled else " on its own lr")
                  + (f" (guidance: over its own {-(-cfg.train.steps // task.guidance_every)} update(s))"
                     if "guidance" in trained and getattr(task, "guidance_every", 1) > 1
                     and {"total_num_steps", "total_steps"} & set(sched.get("params") or {}) else ""))
    if plan.profile not in profiles.values():
        table += (f"\nengines on {plan.profile} (the run's DeepSpeed JSON) are counted as its built-in "
                  f"equivalent {builtin_equivalent(plan.ds_config)}")
    return table, problem


# ---------------------------------------------------------------- engines

def role_plan(policy_plan, cfg: RunConfig, world, profile: str, lr: float):
    """The EnginePlan of a trained role: the policy's (same backbone) or one planned for ``profile``
    (rank 0 plans, every rank receives it: all ranks call this); the optimizer's lr set to ``lr``."""
    from dstrain import runtime
    from dstrain.engine.factory import plan_engine
    plan = policy_plan
    if profile != policy_plan.profile:
        other = None
        if world.is_main:
            # the policy's precision (a user's file may have set it): one backbone, one dtype in every engine
            c = dataclasses.replace(cfg, deepspeed=dataclasses.replace(cfg.deepspeed, profile=profile,
                                                                       precision=policy_plan.precision))
            other = plan_engine(c, world.world_size, ranks_per_node=world.local_world_size,
                                device_type=world.device.type)
        plan = runtime.broadcast_object(other)
    ds = copy.deepcopy(plan.ds_config)
    if "optimizer" in ds:  # DeepSpeed builds the optimizer from the file
        ds["optimizer"].setdefault("params", {})["lr"] = lr
    rescale_schedule(ds, lr)
    optimizer = plan.optimizer  # dstrain builds torch's AdamW from these numbers (the block is gone)
    if optimizer is not None:
        optimizer = dataclasses.replace(optimizer, params={**optimizer.params, "lr": lr})
    return dataclasses.replace(plan, ds_config=ds, optimizer=optimizer, shard_at_build=False)


#: scheduler params that are learning rates, not ratios (DeepSpeed's schedulers and torch's): with one
#: of them the schedule, not the optimizer's lr, decides the rate an engine trains at.
_SCHEDULE_LRS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "lr_range_test_min_lr",
                 "base_lr", "max_lr", "eta_min", "min_lr")
_SCHEDULE_PEAKS = ("warmup_max_lr", "cycle_max_lr", "max_lr", "lr_range_test_min_lr", "base_lr")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def rescale_schedule(ds: dict, lr: float) -> float | None:
    """Scale a scheduler block's learning rates (in place) so that its peak is ``lr``; the factor, or
    None when the block has no absolute learning rate (dstrain's schedule, WarmupCosineLR's ratios).

    A role trained beside the policy (SCoRe's guidance, critic and value function) gets the run's
    DeepSpeed JSON with its own lr; WarmupLR, WarmupDecayLR, OneCycle and LRRangeTest would
    otherwise set every role's rate to the policy's ``warmup_max_lr`` / ``cycle_max_lr``."""
    sched = ds.get("scheduler")
    params = sched.get("params") if isinstance(sched, dict) else None
    if not isinstance(params, dict):
        return None
    peak = None
    for key in _SCHEDULE_PEAKS:
        value = params.get(key)
        value = max(value) if isinstance(value, list) and value and all(map(_number, value)) else value
        if _number(value) and value > 0:
            peak = float(value)
            break
    if peak is None:
        return None
    factor = lr / peak
    for key in _SCHEDULE_LRS:
        value = params.get(key)
        if _number(value):
            params[key] = value * factor
        elif isinstance(value, list) and all(map(_number, value)):
            params[key] = [v * factor for v in value]
    return factor


def role_horizon(ds: dict, run_steps: int, role_steps: int) -> None:
    """A role that updates less often than the policy (the guidance model, every task.guidance_every steps)
    gets a scheduler horizon in its own updates: ``total_num_steps`` (filled from, or checked against,
    train.steps) and torch's OneCycleLR ``total_steps`` become ``role_steps``, as dstrain's own schedule does."""
    params = (ds.get("scheduler") or {}).get("params")
    if not isinstance(params, dict) or role_steps == run_steps:
        return
    for key in ("total_num_steps", "total_steps"):
        if params.get(key) == run_steps:
            params[key] = role_steps


def value_parallelize(model, activation_checkpointing: bool = False, **parallel):
    if parallel.get("state") is not None:
        raise NotImplementedError("SCoRe critics support data parallelism (ZeRO) only: set tp = sp = 1")
    if activation_checkpointing:  # transformers >= 5.2x renamed gradient_ to activation_checkpointing_enable
        body = model.backbone
        enable = getattr(body, "activation_checkpointing_enable", None) or body.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    return model


def frozen_engine_ds(policy_ds: dict, profile: str) -> dict:
    """The 'training' DeepSpeed JSON from which a frozen engine of ``profile`` is derived (see
    models.policy reference_ds_config: stage 3 turns into stage 3 with parameter offload)."""
    ds = copy.deepcopy(policy_ds)
    if profile != "auto":
        ds["zero_optimization"] = {"stage": 3 if profile.startswith("zero3") else 0}
    return ds


class PlacedFrozen:
    """A frozen causal LM on a given device: ``token_logprobs(ids, mask, temperature)`` like ReferencePolicy."""

    def __init__(self, module: torch.nn.Module, device: torch.device, rl):
        self.module, self.device, self.rl, self.engine = module.to(device), device, rl, None
        self.module.requires_grad_(False)
        self.module.eval()

    @torch.no_grad()
    def token_logprobs(self, input_ids, attention_mask=None, temperature: float = 1.0):
        ids = input_ids.to(self.device)
        mask = attention_mask.to(self.device) if attention_mask is not None else None
        logits = self.module(ids, attention_mask=mask)
        return self.rl.token_logprobs(logits, ids, temperature=temperature).to(input_ids.device)


def frozen_copy(module: torch.nn.Module, state: dict, device: torch.device) -> torch.nn.Module:
    """A plain module holding ``state`` (a full CPU state dict) on ``device``, no gradients."""
    module.load_state_dict(state)
    module.requires_grad_(False)
    module.eval()
    return module.to(device)


# ---------------------------------------------------------------- checkpoints

TARGET_FILE = "critic_target.pt"


def save_extra(tag_dir: Path, engines: dict, target, is_main: bool) -> None:
    """Every trained engine but the policy under ``tag_dir/<role>/``; the target critic (rank 0)."""
    for role, engine in engines.items():
        engine.save(str(tag_dir), role)
    if target is not None and is_main:
        torch.save({k: v.detach().cpu() for k, v in target.state_dict().items()}, tag_dir / TARGET_FILE)


def load_extra(tag_dir: Path, engines: dict, target) -> None:
    for role, engine in engines.items():
        engine.load(str(tag_dir), role)
    if target is not None:
        state = torch.load(tag_dir / TARGET_FILE, map_location="cpu", weights_only=True)
        target.load_state_dict(state)
