"""Pipeline parallelism through DeepSpeed's ``PipelineModule``: stage split, weights in and out.

A model that can be pipelined describes itself as :class:`PipelineParts` (its
``models/<m>/pipeline.py``): a sequence of ``LayerSpec``s (embedding, blocks, final
norm + head), the prefix each layer's parameters carry in the plain model's state
dict (``""`` for the embedding and the head, ``"blocks.3."`` for block 3), and a
loss function equal to the plain model's. From that this module

* splits the layers into ``pp`` contiguous stages (:func:`partition`): by
  parameters, uniformly, or by a measured cost (forward + backward time of one
  layer of each kind, :func:`measure_costs`);
* builds the :class:`StagedPipelineModule` with exactly that split (the plan and
  the engine cannot disagree) and copies a plain model's initial weights into
  the layers this stage owns (:func:`load_plain_weights`), so a pipelined run
  starts from the same weights as a plain one;
* maps a pipeline checkpoint's ``layer_XX-model_states.pt`` files back to the
  plain model's names (:func:`plain_state_dict`), which ``dstrain export`` uses.

Tied layers (``TiedLayerSpec``) are refused: neither dstrain LM ties its embedding
to its output layer, and the export mapping would need DeepSpeed's tied-key rules.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dstrain.engine.engine import Engine

PARTITION_METHODS = ("parameters", "uniform", "cost")
_LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$|^layer_(\d+)-model_states\.pt$")


@dataclass
class PipelineParts:
    """A model as a sequence of layers DeepSpeed can cut into stages."""

    layers: list
    """``deepspeed.pipe.LayerSpec`` per layer; layer i's output is layer i+1's input."""
    prefixes: list[str]
    """Plain state-dict prefix of each layer's parameters."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(last layer's output, labels)``: the plain model's loss."""
    kinds: list[str] = field(default_factory=list)
    """A name per layer; layers of the same kind cost the same (for ``cost`` partitioning)."""
    example_input: Callable[[int, int], torch.Tensor] | None = None
    """``(micro_batch, seq_len) -> first layer's input`` for measuring costs."""

    def __post_init__(self):
        from deepspeed.pipe import TiedLayerSpec
        if len(self.layers) != len(self.prefixes):
            raise ValueError(f"{len(self.layers)} layers but {len(self.prefixes)} name prefixes")
        if any(isinstance(spec, TiedLayerSpec) for spec in self.layers):
            raise ValueError("tied layers (TiedLayerSpec) are not supported by dstrain's pipeline export; "
                             "untie the embedding and the output layer")
        if not self.kinds:
            self.kinds = [spec.typename.__name__ for spec in self.layers]

    def param_counts(self) -> list[int]:
        """Parameters of each layer, built on the meta device (no memory)."""
        with torch.device("meta"):
            return [sum(p.numel() for p in spec.build().parameters()) for spec in self.layers]


def partition(weights: Sequence[float], stages: int, method: str = "parameters") -> list[int]:
    """Stage boundaries ``[0, b1, ..., len(weights)]`` (stage s owns layers ``b_s .. b_{s+1} - 1``).

    ``uniform``: equal numbers of layers; ``parameters`` / ``cost``: the contiguous split
    whose heaviest stage is lightest (``weights``: parameter counts or measured costs).
    """
    from dstrain.engine.profiles import balanced_split, uniform_split
    if method not in PARTITION_METHODS:
        raise ValueError(f"unknown pipeline partition method {method!r}; use one of {', '.join(PARTITION_METHODS)}")
    if method == "uniform":
        return uniform_split(len(weights), stages)
    return balanced_split(weights, stages)


def measure_costs(parts: PipelineParts, micro_batch: int, seq_len: int, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of one layer of each kind (median of ``repeats``), per layer.

    Layers of one kind are timed once (a block stands for every block); the input of
    each kind is what the layers before it produce from ``parts.example_input``, and the
    last layer is timed with the loss.
    """
    if parts.example_input is None:
        raise ValueError("cost partitioning needs PipelineParts.example_input")
    x = parts.example_input(micro_batch, seq_len)
    labels = parts.example_input(micro_batch, seq_len)
    seen: dict[str, float] = {}
    costs = []
    last = len(parts.layers) - 1
    for i, (spec, kind) in enumerate(zip(parts.layers, parts.kinds)):
        if kind in seen:
            costs.append(seen[kind])
            continue
        layer = spec.build()
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            (parts.loss_fn(out, labels) if i == last else out.float().square().mean()).backward()
            times.append(time.perf_counter() - start)
        seen[kind] = sorted(times)[len(times) // 2]
        costs.append(seen[kind])
        with torch.no_grad():
            x = layer(x)
        del layer
    return costs


def trace_layer_activations(parts: PipelineParts, seq_len: int) -> list[int]:
    """Bytes autograd saves in each layer for one sample of ``seq_len`` tokens (fp32, meta-free trace).

    The layers run in sequence under ``FakeTensorMode`` (nothing allocated), as
    ``hardware.trace_activations`` runs a whole model; a storage saved by several layers
    counts in the first, the loss counts in the last layer. Their sum is the whole
    model's trace.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    if parts.example_input is None:
        raise ValueError("tracing layer activations needs PipelineParts.example_input")
    seen: set[int] = set()
    current: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            current[storage._cdata] = storage.nbytes()
        return t

    out = []
    with FakeTensorMode(allow_non_fake_inputs=False):
        layers = [spec.build() for spec in parts.layers]
        params = {p.untyped_storage()._cdata for layer in layers for p in layer.parameters()}
        x = parts.example_input(1, seq_len)
        labels = parts.example_input(1, seq_len)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for i, layer in enumerate(layers):
                layer.train()
                current.clear()
                x = layer(x)
                if i == len(layers) - 1:
                    x = parts.loss_fn(x, labels)
                out.append(sum(v for k, v in current.items() if k not in params))
        x.backward()
    return out


def stage_split(parts: PipelineParts, stages: int, method: str, micro_batch: int = 1,
                seq_len: int = 0) -> tuple[list[int], list[float]]:
    """``(boundaries, weights)`` for ``method`` (weights: parameter counts, ones, or seconds)."""
    if method == "cost":
        weights = measure_costs(parts, micro_batch, seq_len)
    elif method == "uniform":
        weights = [1.0] * len(parts.layers)
    else:
        weights = [float(n) for n in parts.param_counts()]
    return partition(weights, stages, method), weights


def describe_split(parts: PipelineParts, bounds: list[int], counts: list[int]) -> list[str]:
    """One line per stage: its layers and parameter count."""
    lines = []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        kinds = parts.kinds[lo:hi]
        names = ", ".join(f"{k} x{kinds.count(k)}" if kinds.count(k) > 1 else k for k in dict.fromkeys(kinds))
        lines.append(f"stage {s}: layers {lo}..{hi - 1} ({names}), {sum(counts[lo:hi]):,} params")
    return lines


def _staged_module_class():
    from deepspeed.pipe import PipelineModule

    class StagedPipelineModule(PipelineModule):
        """A ``PipelineModule`` whose stage boundaries are given, not recomputed."""

        def __init__(self, layers, bounds: list[int], **kwargs):
            object.__setattr__(self, "_given_bounds", list(bounds))
            super().__init__(layers=layers, partition_method="uniform", **kwargs)

        def _partition_layers(self, method="uniform"):
            stage = self._topo.get_coord(self.global_rank).pipe
            self.parts = list(self._given_bounds)
            if len(self.parts) != self.num_stages + 1:
                raise ValueError(f"stage split {self.parts} does not have {self.num_stages} stages")
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return StagedPipelineModule


def build_pipeline_module(parts: PipelineParts, bounds: list[int], topology) -> nn.Module:
    """The DeepSpeed ``PipelineModule`` of ``parts`` cut at ``bounds``; only this stage's layers are built.

    Every parameter is tagged ``model_parallel = True``: each stage owns distinct
    parameters, and DeepSpeed's gradient norm (fp32 clipping, ZeRO-1) counts a
    parameter on a rank whose model-parallel rank (= stage) is not 0 only if it carries the tag.
    """
    module = _staged_module_class()(parts.layers, bounds, topology=topology, loss_fn=parts.loss_fn)
    for p in module.parameters():
        p.model_parallel = True
    return module


def local_layers(module) -> dict[int, nn.Module]:
    """Global layer index -> layer, for the layers this stage owns."""
    return {module._local_start + i: layer for i, layer in enumerate(module.forward_funcs)
            if isinstance(layer, nn.Module)}


@torch.no_grad()
def load_plain_weights(module, parts: PipelineParts, plain_state: dict[str, torch.Tensor]) -> None:
    """Copy a plain model's state dict into this stage's layers (names through ``parts.prefixes``)."""
    for idx, layer in local_layers(module).items():
        for name, tensor in layer.state_dict().items():
            key = parts.prefixes[idx] + name
            if key not in plain_state:
                raise KeyError(f"pipeline layer {idx} parameter {name!r}: no {key!r} in the plain model")
            tensor.copy_(plain_state[key])


def stages_in_checkpoint(tag_dir: str | Path) -> int:
    """Pipeline stages a checkpoint was saved with (1 for a checkpoint without layer files).

    The pipeline engine writes one ``layer_XX-model_states.pt`` per layer and one
    ``mp_rank_SS_model_states.pt`` per stage.
    """
    tag_dir = Path(tag_dir)
    if not any(tag_dir.glob("layer_*-model_states.pt")):
        return 1
    return len(list(tag_dir.glob("mp_rank_*_model_states.pt")))


def plain_state_dict(tag_dir: str | Path, prefixes: Sequence[str]) -> dict[str, torch.Tensor]:
    """The plain model's state dict from a pipeline checkpoint's ``layer_XX-model_states.pt`` files."""
    tag_dir = Path(tag_dir)
    files: dict[int, Path] = {}
    for path in tag_dir.iterdir():
        match = _LAYER_FILE.match(path.name)
        if match:
            idx = int(match.group(1) or match.group(3))
            if match.group(2) not in (None, "00"):
                raise ValueError(f"{path}: tensor-parallel pipeline checkpoints are not supported by export")
            files[idx] = path
    if not files:
        raise FileNotFoundError(f"{tag_dir}: no layer_XX-model_states.pt files (not a pipeline checkpoint)")
    if max(files) >= len(prefixes):
        raise ValueError(f"{tag_dir}: layer {max(files)} saved but the model has {len(prefixes)} layers")
    state = {}
    for idx in sorted(files):
        for name, tensor in torch.load(files[idx], map_location="cpu", weights_only=True).items():
            state[prefixes[idx] + name] = tensor
    return state


# ---------------------------------------------------------------- planning and the engine

@dataclass
class PipelineSetup:
    """The stage split decided at plan time (picklable: rank 0 plans, every rank builds)."""

    pp: int
    dp: int
    method: str
    bounds: list[int]
    stage_lines: list[str]


def plan_stages(spec, model_cfg, cfg, dims, hw, acts):
    """``(PipelineSetup, Plan, per-stage text)`` of a run with ``parallel.pp > 1``.

    The split follows ``parallel.pp_partition``; the profile is chosen among ZeRO-0 and
    ZeRO-1 by the fullest stage's memory (``profiles.choose_pipeline_plan``), with each
    stage's activations traced layer by layer (:func:`trace_layer_activations`).
    """
    from dstrain.engine.profiles import choose_pipeline_plan, format_stages
    if spec.pipeline is None:
        raise ValueError(f"model {spec.name!r} cannot be cut into pipeline stages (no pipeline layers); "
                         "use parallel.pp = 1")
    ds, t = cfg.deepspeed, cfg.train
    parts = spec.pipeline(model_cfg, False)
    bounds, _ = stage_split(parts, dims.pp, cfg.parallel.pp_partition, t.micro_batch, cfg.data.seq_len)
    counts = parts.param_counts()
    layer_acts = layer_activations(spec, model_cfg, cfg.data.seq_len)
    plan, stages = choose_pipeline_plan(counts, bounds, hw, acts, dims.dp, t.micro_batch, t.grad_accum,
                                        precision=ds.precision, activation_checkpointing=ds.activation_checkpointing,
                                        margin=ds.margin, layer_acts=layer_acts, mixed_precision=ds.mixed_precision)
    lines = describe_split(parts, bounds, counts)
    setup = PipelineSetup(dims.pp, dims.dp, cfg.parallel.pp_partition, bounds, lines)
    text = (f"pipeline: {dims.pp} stages x dp {dims.dp}, split by {cfg.parallel.pp_partition}, 1F1B over "
            f"{t.grad_accum} micro-batches (bubble (p - 1) / (m + p - 1) = "
            f"{(dims.pp - 1) / (t.grad_accum + dims.pp - 1):.2f})\n" + format_stages(stages, lines))
    return setup, plan, text


def layer_activations(spec, model_cfg, seq_len: int) -> tuple[list[int], list[int]]:
    """Traced activation bytes per layer and sample, without and with activation checkpointing."""
    return (trace_layer_activations(spec.pipeline(model_cfg, False), seq_len),
            trace_layer_activations(spec.pipeline(model_cfg, True), seq_len))


def check_profile(ds_config: dict, source: str) -> None:
    """One line if a DeepSpeed JSON asks for ZeRO-2/3, which the pipeline engine refuses."""
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage >= 2:
        raise ValueError(f"{source}: ZeRO stage {stage} cannot run with pipeline parallelism (DeepSpeed's "
                         "pipeline engine takes ZeRO-0 or ZeRO-1); use profile zero0, zero1 or auto")


def build_engine_module(build_model, pipeline_parts, setup: PipelineSetup, activation_checkpointing: bool):
    """This stage's ``PipelineModule`` holding the plain model's initial weights.

    The plain model is built once in host memory (same seed, same weights as a
    non-pipelined run), its state dict copied into this stage's layers and freed.
    """
    import torch.distributed as dist

    from dstrain.parallel.dims import ParallelDims
    dims = ParallelDims.from_world(dist.get_world_size(), pp=setup.pp)
    with torch.device("cpu"):
        plain = build_model()
    state = plain.state_dict()
    parts = pipeline_parts(activation_checkpointing)
    module = build_pipeline_module(parts, setup.bounds, dims.topology())
    load_plain_weights(module, parts, state)
    del plain, state
    return module


class PipelineEngine(Engine):
    """The trainer-facing side of DeepSpeed's ``PipelineEngine``: whole batches, not micro-batches.

    ``train_batch(iterator)`` runs one optimizer step over ``grad_accum`` micro-batches
    with the 1F1B schedule (the first stage reads inputs from the iterator, the last
    stage labels) and returns the mean loss over the data-parallel group;
    ``eval_batch(iterator)`` the same without gradients. Save/load (the engine's) go
    through DeepSpeed's pipeline checkpoints (one ``layer_XX-model_states.pt`` per layer).
    """

    is_pipeline = True

    def __init__(self, ds_engine, plan, param_group_names=None):
        super().__init__(ds_engine, plan, param_group_names)
        self._norm = None
        # fp32 without ZeRO clips through clip_fp32_gradients, which computes the norm and drops it:
        # the same call, keeping the norm (summed over the stages: every parameter is tagged model_parallel).
        def clip_and_keep():
            from deepspeed.runtime.utils import clip_grad_norm_
            self._norm = clip_grad_norm_(parameters=ds_engine.module.parameters(),
                                         max_norm=ds_engine.gradient_clipping(), mpu=ds_engine.mpu)
        ds_engine.clip_fp32_gradients = clip_and_keep

    def watch(self, guard=None, watchdog=None, name: str = "", check: str = "sync") -> None:
        """As ``Engine.watch``; the check runs inside ``train_batch``, just before DeepSpeed's optimizer step
        (every stage gets there): the last stage gives the step's summed loss, every stage its gradients.
        Always synchronous (``check`` is not used: the stages agree before the step)."""
        super().watch(guard, watchdog, name)
        ds = self.ds
        if guard is None or "_take_model_step" in vars(ds):
            return
        take = ds._take_model_step

        def checked_step(*args, **kwargs):
            from dstrain.faults import fault_nan
            from dstrain.resilience import update_skipped
            n = ds.global_steps + 1
            losses = [ds.total_loss] if ds.is_last_stage() and torch.is_tensor(ds.total_loss) else []
            losses = [fault_nan(loss, n, self.name) for loss in losses]
            self._phase("allreduce")
            skip = self.guard.check(losses, n, self._grads.take() if self._grads is not None else False,
                                    self.name)
            self._phase("step")
            self.last_step_taken = not skip
            self.updates += not skip
            if not skip:
                return take(*args, **kwargs)
            with update_skipped(ds):
                return take(*args, **kwargs)

        ds._take_model_step = checked_step

    @property
    def stage(self) -> int:
        return self.ds.stage_id

    def train_batch(self, data_iter) -> float:
        self._update_lr = self._scheduled_lr()  # the update at the end of the batch runs at it (Engine.lr)
        with self._attention():  # train.attention_backend, as Engine's forward (the backward follows the forward)
            return float(self.ds.train_batch(data_iter))

    def eval_batch(self, data_iter) -> float:
        with self._attention():
            return float(self.ds.eval_batch(data_iter, num_micro_batches=1))

    @property
    def grad_norm(self) -> float | None:
        """The norm kept by the clipping above, else DeepSpeed's (ZeRO-1, 16-bit)."""
        norm = self._norm if self._norm is not None else self.ds.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)
