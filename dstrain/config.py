"""Run configuration: JSON file -> typed dataclasses, dotted command-line overrides.

A run config has eight sections (``model``, ``data``, ``train``, ``deepspeed``,
``parallel``, ``checkpoint``, ``output``, ``rollout``) plus two free-form ones typed by the trainer
(``task``, and ``placement`` for trainers with several models); every field has a default,
so a recipe names only what it changes. ``load_run_config(path, ["--train.lr=3e-4"])`` reads the file,
applies the overrides (they win over the file), checks types and values, and
raises :class:`ConfigError` with one line naming the file and the dotted key.

Nothing here touches the disk except reading the recipe, so a bad config fails before any output is written.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from dstrain.config_text import folder_problem, invalid_json_problem, section_error_key  # one-line messages

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile modes ``train.compile_mode`` accepts."""
COMPILE_SCOPES = ("auto", "model", "regions")
"""What ``train.compile_scope`` may name (see dstrain.engine.compiling)."""
ATTENTION_BACKENDS = ("auto", "cudnn")
"""``train.attention_backend`` values: PyTorch's own SDPA order, or cuDNN's kernels first."""


INT64_MAX = 2**63 - 1
"""Largest integer a run config takes (JSON's integers are exact and unbounded in Python)."""


class ConfigError(ValueError):
    """A run config problem; ``str(err)`` is one line naming the source and the key."""

    def __init__(self, source: str, key: str, problem: str):
        self.source, self.key, self.problem = source, key, problem
        where = f"{key}: " if key else ""
        super().__init__(f"{source}: {where}{problem}")


class RunFolderError(RuntimeError):
    """The output folder is in a state a run must not overwrite (or cannot resume from)."""


class LaunchError(RuntimeError):
    """The job cannot start as launched (its master port taken by another process); one line, exit 2."""


@dataclass
class ModelConfig:
    """Which model to build."""

    name: str = "gpt"
    """Registered model name (see ``models.registry.available()``)."""
    size: str = "tiny"
    """A size profile of that model (e.g. tiny, small, medium)."""
    args: dict = field(default_factory=dict)
    """Per-field changes to the size profile, e.g. ``{"n_layer": 2}``."""


@dataclass
class DataConfig:
    """Where the tokens come from and how they are cut."""

    corpus: str = "stdlib"
    """``stdlib`` (the installed Python standard library's sources) or a local path."""
    seq_len: int = 128
    """Tokens per training sample."""
    max_bytes: int = 4_000_000
    """Upper bound on corpus bytes read."""
    val_every: int = 20
    """Every n-th document goes to the validation stream."""
    seed: int = 1234
    """Seed of the data order (a pure function of seed and step)."""


@dataclass
class TrainConfig:
    """Optimisation schedule."""

    steps: int = 300
    micro_batch: int = 8
    """Samples per rank per forward pass."""
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of ``lr``."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    """Global gradient-norm clipping; 0 turns it off."""
    seed: int = 0
    """Seed of model initialisation and of every rank's random state."""
    log_every: int = 10
    eval_every: int = 0
    """Evaluate every n steps (0: only at the end)."""
    eval_batches: int = 4
    compile: Any = "auto"
    """torch.compile the model inside the DeepSpeed engine: auto (on for CUDA, off on CPU) | true | false."""
    compile_mode: str = "default"
    """torch.compile's mode when compiling: default | reduce-overhead (CUDA graphs: fewer launches, for
    small or recurrent steps) | max-autotune | max-autotune-no-cudagraphs (slower compiles, tuned kernels)."""
    compile_scope: str = "auto"
    """What is compiled: auto | model (the whole module) | regions (the submodules the model names, e.g.
    HRM's H and L modules: far less to compile; see dstrain.engine.compiling). auto: regions where the
    model names them and compile_mode records no CUDA graphs, else model."""
    attention_backend: str = "auto"
    """Kernel order of the models' ``F.scaled_dot_product_attention``: auto (PyTorch's own) | cudnn (cuDNN's
    fused attention first, then PyTorch's order; see dstrain.ops.attention.sdpa_priority)."""
    optimizer: str = "auto"
    """Optimizer implementation: auto | torch_fused | torch_foreach | deepspeed. auto: PyTorch's fused AdamW
    on CUDA, its foreach AdamW on CPU, DeepSpeed's CPU Adam under optimizer offload (see dstrain.engine.optim)."""
    optimizer_type: str = "adamw"
    """The update rule: adamw | adam_atan2 (dstrain.optim.adam_atan2: epsilon-free Adam with atan2, the HRM
    reference's optimizer; train.eps is then unused). Applies where the DeepSpeed JSON has no optimizer block
    or one that pins nothing (the shipped profiles); a block with numbers of its own keeps its type."""
    nonfinite: str = "stop"
    """What a NaN/Inf loss or gradient on any rank does (every rank agrees through one small all-reduce per
    optimizer step, of every trained model): stop (leave the step's update undone, save the last good state
    as a checkpoint and exit non-zero naming the step, rank and model) | skip (drop that update on every
    rank, count it as ``train/skipped_steps``) | off (no check: saves that all-reduce and host sync).
    Gradients are not checked under fp16, whose loss scaler skips overflowing steps itself."""
    nonfinite_check: str = "auto"
    """How that check waits: auto (deferred on CUDA where it can be, else sync) | sync (the host reads each
    step's verdict before the optimizer step: one wait for the device per step) | deferred (the optimizer
    skips a bad update on the device through ``found_inf`` and the host reads the verdict one step later;
    ZeRO-0 without DeepSpeed's 16-bit wrappers, fused AdamW or AdamATan2, in the trainers that support it (LM,
    HRM, the benchmark): elsewhere sync, with a note). See dstrain.engine.deferred_check."""
    max_consecutive_skips: int = 5
    """Under nonfinite=skip, this many skipped steps in a row end the run with an error."""
    collective_timeout_s: float = 1800.0
    """Hang timeout: a watchdog thread ends a rank whose step phase (forward, backward, allreduce, step,
    save, eval) lasts longer, naming rank, step and phase (exit 124, so ``dstrain launch --max-restarts``
    restarts the job); torch.distributed's collective timeout is set 10% (at least 5 s) later."""


@dataclass
class DeepSpeedConfig:
    """How the engine factory builds the DeepSpeed engine."""

    profile: str = "auto"
    """``auto`` (the factory chooses), a name from ds_configs/ or a path to a DeepSpeed JSON."""
    precision: str = "auto"
    """auto | fp32 | bf16 | fp16."""
    activation_checkpointing: Any = "auto"
    """auto | true | false."""
    device_memory: Any = None
    """Memory one rank may use, e.g. "80GB"; default: the GPU's, or RAM / local ranks."""
    host_memory: Any = None
    """Host RAM per node for offload; default: the machine's."""
    margin: float = 0.85
    """Fraction of device memory the plan may fill."""
    mixed_precision: str = "auto"
    """How bf16 runs: deepspeed (16-bit weights, fp32 master copy in DeepSpeed's optimizer wrapper) |
    autocast (fp32 weights, ``torch.autocast`` in the forward, DeepSpeed's ``torch_autocast``) | auto
    (autocast on GPUs without ZeRO partitioning when the profile leaves bf16 to the factory, else deepspeed)."""
    values_from_file: bool = False
    """A named DeepSpeed JSON's explicit batch sizes, lr (and Adam numbers), gradient clipping, warm-up and
    precision replace the run config's (each adopted value is reported); false: a disagreement is refused
    before launch with the overrides that would make them agree."""
    comm_dtype: str = "auto"
    """auto | fp32 | bf16 | fp16: the dtype gradients are reduced in (DeepSpeed's ``communication_data_type``);
    auto leaves it to the DeepSpeed JSON (DeepSpeed's default: the training precision)."""
    zero_init: Any = "auto"
    """ZeRO-3: build the model already sharded (``deepspeed.zero.Init``): auto | true | false.
    auto does so when a full fp32 copy per local rank would take over half the RAM."""


@dataclass
class ParallelConfig:
    """Model parallelism inside each data-parallel replica (dp = world / (tp * sp * pp))."""

    tp: int = 1
    """Tensor-parallel degree (fairscale layers; the model's parallelize.py says which)."""
    sp: int = 1
    """Sequence-parallel degree: each sample's tokens are split over sp ranks."""
    sp_mode: str = "auto"
    """auto | exchange | ulysses: how sequence-parallel attention communicates (see dstrain.parallel.sequence)."""
    pp: Any = 1
    """Pipeline-parallel degree: the model is cut into pp stages (DeepSpeed's pipeline engine, 1F1B
    over train.grad_accum micro-batches); dp = world / pp. Data parallelism only besides it. "auto":
    the factory picks pp when ZeRO without parameter partitioning (ZeRO-0/1/2) does not fit the model
    but ZeRO-0/1 fits every stage of some pp (preferred over ZeRO-3's gathering), else 1."""
    pp_partition: str = "parameters"
    """parameters | uniform | cost: how layers are split into stages (balanced parameter counts, equal
    layer counts, or measured forward + backward time per layer kind)."""


@dataclass
class CheckpointConfig:
    """When to save and what to keep."""

    every: int = 100
    """Save every n steps (and always at the end); 0: only at the end."""
    keep: int = 2
    """Complete checkpoints kept on disk (older ones are deleted)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in the output folder."""
    async_write: bool = False
    """Copy the state to host memory, then write it in a background thread while training goes on (the
    next save waits for the previous one; COMPLETE is written after every rank's files are on disk)."""


@dataclass
class OutputConfig:
    """Where results go."""

    dir: str = "runs/default"
    tensorboard: bool = True
    progress: bool = True
    comms: bool = False
    """Log every collective's bytes and time per step (``comm/*`` records; DeepSpeed's comms logger,
    which synchronises each op to time it)."""


@dataclass
class RolloutConfig:
    """Where RL rollouts (generation and rewards) run; see ``dstrain.rl.rollout``."""

    backend: str = "local"
    """local (in the training ranks) | ray (one Ray actor per rank, weights pushed after each step)."""
    address: Any = None
    """ray: a running cluster to join (``auto`` after ``ray start``); default: rank 0 starts a local one."""
    num_cpus: Any = None
    """ray: CPUs of the local cluster rank 0 starts (default: the machine's)."""
    cpus_per_worker: float = 1.0
    """ray: CPUs reserved per actor."""
    threads_per_worker: int = 0
    """ray: torch threads in each actor (0: the training rank's)."""
    generator: str = "hf"
    """What samples completions: hf (the policy's own ``generate``, KV cache, batched) | vllm (a vLLM
    engine colocated in each training rank on its GPU, weights copied from the engine after every
    optimizer step; GRPO with ``backend=local`` only; needs the vllm package and CUDA)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm: share of the GPU's memory vLLM may take (weights and KV cache); training keeps the rest."""


@dataclass
class RunConfig:
    """A whole run; see the section classes for the fields."""

    trainer: str = "lm"
    """Which loop runs (see ``dstrain.trainers.available()``)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: dict = field(default_factory=dict)
    """Trainer-specific settings, typed and checked by the trainer's task config class."""
    placement: dict = field(default_factory=dict)
    """Where each model of a multi-model trainer lives (``dstrain.rl.placement``); only
    trainers whose task config sets ``uses_placement`` take it."""

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step on one data-parallel rank."""
        return self.train.micro_batch * self.train.grad_accum * self.data.seq_len

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["train"]["betas"] = list(self.train.betas)
        return out


# ---------------------------------------------------------------- conversion

def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(source: str, key: str, valid: Sequence[str]) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(valid)})"
    return ConfigError(source, key, f"unknown key{hint}")


def _convert(value: Any, typ: Any, source: str, key: str) -> Any:
    """Check ``value`` against the annotation ``typ``; return the typed value."""
    def bad(expected: str) -> ConfigError:
        return ConfigError(source, key, f"expected {expected}, got {json.dumps(value)}")

    if typ is Any:
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        if abs(value) > INT64_MAX:  # (torch sizes, seeds and step counters are 64-bit: 1e30 as an exact integer)
            raise bad(f"an integer of at most {INT64_MAX} (64 bits)")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        if not math.isfinite(value):
            raise bad("a finite number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ is dict:
        if not isinstance(value, dict):
            raise bad("an object")
        return dict(value)
    if typ is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        return tuple(_convert(v, float, source, key) for v in value)
    if isinstance(typ, types.UnionType):  # pragma: no cover - not used yet
        raise TypeError(typ)
    raise TypeError(f"unsupported config type {typ!r} for {key}")


def _build(cls, data: Mapping[str, Any], source: str, prefix: str):
    if not isinstance(data, Mapping):
        raise ConfigError(source, prefix.rstrip(".") or "(top level)", "expected an object")
    kinds = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in kinds:
            raise _unknown_key(source, dotted, list(kinds))
        typ = kinds[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value, source, dotted + ".")
        else:
            kwargs[key] = _convert(value, typ, source, dotted)
    return cls(**kwargs)


def build_section(cls, data: Mapping[str, Any], source: str, prefix: str):
    """Typed dataclass ``cls`` from a raw mapping; errors name ``prefix`` + key (e.g. "task.lr")."""
    try:
        section = _build(cls, data, source, prefix)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(source, section_error_key(prefix, str(err)), str(err)) from None
    return section


def _parse_override(text: str) -> tuple[str, Any]:
    """``--train.lr=3e-4`` -> ("train.lr", 0.0003); values are JSON, else plain strings."""
    if not text.startswith("--") or "=" not in text:
        raise ConfigError("command line", text, "overrides look like --section.key=value")
    key, raw = text[2:].split("=", 1)
    from dstrain.config_text import DuplicateKeyError, duplicate_key_problem, no_duplicate_keys
    try:
        value = json.loads(raw, object_pairs_hook=no_duplicate_keys)
    except DuplicateKeyError as err:
        raise ConfigError("command line", err.key, duplicate_key_problem(raw, err.key)) from None
    except json.JSONDecodeError:
        value = raw
    return key, value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Return a copy of the raw config dict with dotted overrides set."""
    data = json.loads(json.dumps(data))
    for text in overrides:
        key, value = _parse_override(text)
        parts = key.split(".")
        top = _field_types(RunConfig)
        if len(parts) < 2 and (key not in top or dataclasses.is_dataclass(top[key])):
            plain = [k for k in top if not dataclasses.is_dataclass(top[k])]  # --tranier=lm: --trainer
            if key not in top and difflib.get_close_matches(key, plain, n=1):
                raise _unknown_key("command line", key, plain)
            owners = [f"--{k}.{text.lstrip('-')}" for k, t in top.items()  # --steps=5: --train.steps=5
                      if dataclasses.is_dataclass(t) and key in _field_types(t)]
            raise ConfigError("command line", key, "name a section and a key, e.g. "
                              + (" or ".join(owners) or "--train.lr=3e-4"))
        node = data
        cls: Any = RunConfig
        for i, part in enumerate(parts[:-1]):
            dotted = ".".join(parts[: i + 1])
            if cls is not None:
                kinds = _field_types(cls)
                if part not in kinds:
                    raise _unknown_key("command line", dotted, list(kinds))
                cls = kinds[part] if dataclasses.is_dataclass(kinds[part]) else None
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError("command line", dotted, "is not a section")
            node = child
        if cls is not None and parts[-1] not in _field_types(cls):
            raise _unknown_key("command line", key, list(_field_types(cls)))
        node[parts[-1]] = value
    return data


def read_json(path: str | Path) -> dict:
    """Read a JSON object; errors name the file, line and column."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(str(path), "", folder_problem(path))
    try:
        raw = path.read_bytes()
    except FileNotFoundError:  # a typo in the path: the file meant, where one is close
        from dstrain.config_text import missing_file_problem
        raise ConfigError(str(path), "", missing_file_problem(path)) from None
    except (OSError, UnicodeDecodeError) as err:  # UnicodeDecodeError: a binary file (a checkpoint's .pt)
        raise ConfigError(str(path), "", f"cannot read: {getattr(err, 'strerror', None) or 'not UTF-8 text'}") from None
    from dstrain.config_text import DuplicateKeyError, decode_recipe, duplicate_key_problem, no_duplicate_keys
    text = decode_recipe(raw, str(path))  # (a UTF-8 BOM is dropped; UTF-16 and binary files are named)
    try:
        data = json.loads(text, object_pairs_hook=no_duplicate_keys)
    except DuplicateKeyError as err:
        raise ConfigError(str(path), err.key, duplicate_key_problem(text, err.key)) from None
    except json.JSONDecodeError as err:
        raise ConfigError(str(path), "", invalid_json_problem(text, err)) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", "the top level must be a JSON object")
    return data


def run_config_from_dict(data: Mapping[str, Any], source: str = "<dict>",
                         overrides: Sequence[str] = ()) -> RunConfig:
    """Build and validate a RunConfig from a raw dict plus dotted overrides."""
    merged = apply_overrides(dict(data), overrides)
    # Errors in override values name the command line, errors in the file name the file.
    override_keys = {_parse_override(o)[0] for o in overrides}
    from dstrain.config_checks import validate
    try:
        cfg = _build(RunConfig, merged, source, "")
        validate(cfg, source)
    except ConfigError as err:
        if err.key in override_keys or (overrides and _file_alone_is_valid(data, source)):
            # (an override that clashes with the file, --model.args.dilation_rates=[1,2] beside its three
            # segment lengths, is the command line's doing too)
            raise ConfigError("command line", err.key, err.problem) from None
        raise
    return cfg


def _file_alone_is_valid(data: Mapping[str, Any], source: str) -> bool:
    from dstrain.config_checks import validate
    try:
        validate(_build(RunConfig, json.loads(json.dumps(data)), source, ""), source)
    except Exception:  # noqa: BLE001 - the file has problems of its own: the error stays the file's
        return False
    return True


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a recipe file, apply overrides, validate; raise ConfigError on any problem."""
    return run_config_from_dict(read_json(path), str(path), overrides)


def save_run_config(cfg: RunConfig, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
