"""Look models up by name.

The framework (``dstrain``) never imports a concrete model; it asks this module
for a :class:`ModelSpec` by name. Each registered name maps to a module path that
is imported lazily and must expose a module-level ``SPEC``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

_REGISTRY: dict[str, str] = {
    "gpt": "models.gpt",
    "dilated_lm": "models.dilated_lm",
    "hrm": "models.hrm",
    "policy": "models.policy",
}


@dataclass(frozen=True)
class ModelSpec:
    """Everything the framework needs to know about one model family.

    Attributes:
        name: registry name, e.g. ``"gpt"``.
        config_cls: dataclass of model hyper-parameters; validates itself in
            ``__post_init__`` (raising ``ValueError`` naming the field).
        sizes: size name -> field values for ``config_cls``.
        build: config instance -> ``torch.nn.Module``, created on the current
            default device and initialised from the caller's ``torch.manual_seed``.
        parallelize: ``parallelize(model, activation_checkpointing: bool) -> model``.
        example_inputs: ``example_inputs(config, micro_batch, seq_len) -> tuple`` of
            positional arguments for one training forward that returns the loss; the
            factory traces it to measure activation memory. Default: a language model's
            ``(input_ids, targets)``, both ``LongTensor[micro_batch, seq_len]``.
        rl: policy families only: the toolkit RL trainers use (``build(config, ds_config=None)``,
            ``load_tokenizer``, ``generate``, ``pack``, ``token_logprobs``, ``token_entropy``,
            ``reference(config, placement, train_ds_config=None)``); None for other models.
        pipeline: ``pipeline(config, activation_checkpointing) -> dstrain.parallel.pipeline.PipelineParts``
            for models that can be cut into pipeline stages (``parallel.pp > 1``); None otherwise.
        compile_regions: ``compile_regions(model) -> [nn.Module]``: the submodules
            ``train.compile_scope=regions`` (and ``auto``) compiles one by one instead of the whole
            model, for models that call the same module many times per forward; None otherwise.
        layout_problem: ``layout_problem(config, tp, sp, sp_mode, seq_len) -> (key, why) | None``: why the model
            cannot be split that way (checked when the run config loads, before any rank starts); None: no check.
    """

    name: str
    config_cls: type
    sizes: Mapping[str, Mapping[str, Any]]
    build: Callable[[Any], torch.nn.Module]
    parallelize: Callable[..., torch.nn.Module]
    example_inputs: Callable[[Any, int, int], tuple] | None = None
    rl: Any = None
    pipeline: Callable[..., Any] | None = None
    compile_regions: Callable[[torch.nn.Module], list] | None = None
    layout_problem: Callable[..., tuple[str, str] | None] | None = None

    def inputs_for_trace(self, config: Any, micro_batch: int, seq_len: int) -> tuple:
        """Arguments of one loss-returning forward (see ``example_inputs``)."""
        if self.example_inputs is not None:
            return self.example_inputs(config, micro_batch, seq_len)
        ids = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        return ids, ids


_WEIGHTLESS: contextvars.ContextVar[list | None] = contextvars.ContextVar("dstrain_weightless_plan", default=None)


@contextlib.contextmanager
def planning_without_weights():
    """``dstrain plan`` runs inside it: a model config may name a checkpoint folder whose weights are not there yet
    (a user sizing hardware before downloading them), since the planner builds the architecture on the meta device
    and never reads weights. Yields the list of notes the configs give about it (:func:`weights_optional`)."""
    notes: list[str] = []
    token = _WEIGHTLESS.set(notes)
    try:
        yield notes
    finally:
        _WEIGHTLESS.reset(token)


def weights_optional(note: str) -> bool:
    """Whether a model config may accept a checkpoint folder without its weights: True inside
    :func:`planning_without_weights` (``note``, the one line saying so, is kept once), else False (refuse it)."""
    notes = _WEIGHTLESS.get()
    if notes is None:
        return False
    if note not in notes:
        notes.append(note)
    return True


def available() -> list[str]:
    """Names of the registered models, sorted."""
    return sorted(_REGISTRY)


def get_spec(name: str) -> ModelSpec:
    """Import and return the :class:`ModelSpec` registered under ``name``.

    Raises:
        KeyError: ``name`` is not registered (the message lists what is).
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(available())}")
    module = importlib.import_module(_REGISTRY[name])
    spec = getattr(module, "SPEC", None)
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"module {_REGISTRY[name]!r} must define SPEC as a ModelSpec")
    return spec


def _field_types(config_cls: type) -> dict[str, Any]:
    """Resolved annotation of each dataclass field (handles postponed annotations)."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(config_cls)}


def _coerce(key: str, value: Any, expected: Any) -> Any:
    """Check ``value`` against the annotation ``expected``; return it (int -> float
    widened). ``bool`` is not accepted where an int or float is expected."""
    if expected is Any:
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"config key {key!r}: expected float, got {type(value).__name__} ({value!r})"
            )
        return float(value)
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"config key {key!r}: expected int, got {type(value).__name__} ({value!r})"
            )
        return value
    if isinstance(expected, type) and not isinstance(value, expected):
        raise ValueError(
            f"config key {key!r}: expected {expected.__name__}, got "
            f"{type(value).__name__} ({value!r})"
        )
    return value


def make_model_config(name: str, size: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """Build the config of model ``name`` at ``size``, with ``overrides`` applied.

    Raises:
        KeyError: unknown model name.
        ValueError: unknown size (lists the valid ones), unknown override key
            (lists the valid keys), a value of the wrong type (names the key,
            the expected and the given type), or an impossible value (raised by
            the config class, naming the key).
    """
    spec = get_spec(name)
    if size not in spec.sizes:
        raise ValueError(
            f"unknown size {size!r} for model {name!r}; valid sizes: {', '.join(spec.sizes)}"
        )
    types = _field_types(spec.config_cls)
    values = dict(spec.sizes[size])
    for key, value in dict(overrides or {}).items():
        if key not in types:
            raise ValueError(
                f"unknown config key {key!r} for model {name!r}; valid keys: "
                f"{', '.join(sorted(types))}"
            )
        values[key] = value
    values = {k: _coerce(k, v, types[k]) for k, v in values.items()}
    return spec.config_cls(**values)
