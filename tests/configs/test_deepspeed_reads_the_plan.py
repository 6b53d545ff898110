"""Cross-check: every file dstrain accepts, resolved as a launch resolves it, read back by DeepSpeed's own parser.

For each accepted file in this folder, on 1 and 2 CPU ranks and on a CPU with and without fast bf16, the run is
resolved as ``dstrain launch`` and rank 0 resolve it (the run config with ``deepspeed.values_from_file=true``,
:func:`adopt_file_values`, :func:`check_run`, :func:`plan_engine`), and the JSON DeepSpeed gets is parsed by
``deepspeed.runtime.config.DeepSpeedConfig`` with that data-parallel world size. What dstrain's plan says it runs
(batch sizes, ZeRO stage, offload devices, precision, gradient clipping, optimizer type and numbers, scheduler) must
be what DeepSpeed reads from it, and what DeepSpeed reads from the user's own file (loaded as DeepSpeed loads it,
hjson, each "auto" replaced by the value dstrain filled in) must be the same: the file trains as DeepSpeed reads it.
Nothing is launched; the model is measured once for the whole module.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from dstrain.config import load_run_config
from dstrain.engine import factory, hardware
from dstrain.engine.ds_check import accelerator_untouched
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_preflight import adopt_file_values, check_run
from dstrain.engine.profiles import Hardware
from tests.configs.expectations import EXPECT

HERE = Path(__file__).resolve().parent
RECIPE = str(HERE.parents[1] / "models" / "gpt" / "recipes" / "tiny.json")
ACCEPTED = sorted(name for name, expected in EXPECT.items() if expected is None)
ARGS = ["--train.steps=3", "--data.seq_len=64", "--deepspeed.values_from_file=true"]
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # FusedAdam's / CPU Adam's

#: Files DeepSpeed's own parser cannot read as written, and why dstrain trains them anyway.
DEEPSPEED_STOPS = {
    # the legacy flops_profiler parser keeps "enabled": "true" as text, and `wall_clock_breakdown | "true"` raises
    # TypeError in DeepSpeedConfig; dstrain reads the quoted boolean as true (as the pydantic sections do)
    "monitors_enabled_as_strings.json": TypeError,
}


@pytest.fixture(scope="module")
def measured():
    """The tiny GPT's parameter count and activation trace, measured once (they do not depend on the file)."""
    cache = {}

    def once(key, real):
        def call(*args):
            if key not in cache:
                cache[key] = real(*args)
            return cache[key]
        return call
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hardware, "model_stats", once("stats", hardware.model_stats))
        mp.setattr(hardware, "trace_activations", once("acts", hardware.trace_activations))
        yield


def _resolve(name: str, world: int, fast_bf16: bool, tmp_path):
    """(run config, EnginePlan, the filled JSON before dstrain takes the optimizer over), as rank 0 resolves them."""
    cfg = load_run_config(RECIPE, [*ARGS, f"--deepspeed.profile={HERE / name}", f"--output.dir={tmp_path / 'run'}"])
    adopt_file_values(cfg, world)
    check_run(cfg, world, "cpu")
    seen = {}
    real = factory.choose_optimizer

    def spy(resolved, *args, **kwargs):
        seen["filled"] = copy.deepcopy(resolved)
        return real(resolved, *args, **kwargs)
    hw = Hardware("cpu", 16 * 10**9, 32 * 10**9, 2, fast_bf16, False, "test cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(factory, "choose_optimizer", spy)
        plan = factory.plan_engine(cfg, world, hw=hw, device_type="cpu")
    return cfg, plan, seen["filled"]


def _deepspeed_reads(config: dict, world: int):
    """DeepSpeed's DeepSpeedConfig of ``config`` on ``world`` data-parallel ranks (its dist calls answered)."""
    import deepspeed.comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger
    level = logger.level
    with accelerator_untouched(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "get_rank", lambda *a, **k: 0)
        mp.setattr(dist, "get_world_size", lambda *a, **k: world)
        logger.setLevel("ERROR")
        try:
            return DeepSpeedConfig(copy.deepcopy(config))
        finally:
            logger.setLevel(level)


def _as_deepspeed_loads(name: str) -> dict:
    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    with open(HERE / name, encoding="utf-8") as f:  # DeepSpeed's own loader (runtime/config.py)
        return hjson.load(f, object_pairs_hook=dict_raise_error_on_duplicate_keys)


def _at(node, path):
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _autos_filled(node, filled, path=()):
    """``node`` with each "auto" replaced by the value at the same place in ``filled`` (dropped if it has none)."""
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if isinstance(value, str) and value.strip().lower() == "auto":
            if (got := _at(filled, (*path, key))) is not None:
                out[key] = got
        else:
            out[key] = _autos_filled(value, filled, (*path, key))
    return out


def _users_file(raw: dict, filled: dict) -> dict:
    """The user's file as DeepSpeed would get it with the run's values where it says "auto"."""
    view = _autos_filled(raw, filled)
    if "train_batch_size" not in view and "train_micro_batch_size_per_gpu" not in view:
        view["train_micro_batch_size_per_gpu"] = filled["train_micro_batch_size_per_gpu"]  # the run's, as filled
    if any(isinstance(raw.get(k), dict) and str(raw[k].get("enabled")).lower() == "auto" for k in ("bf16", "fp16")):
        for key in ("bf16", "fp16"):  # the precision left to the run: the sections as dstrain filled them
            if key in filled:
                view[key] = filled[key]
    return view


def _precision(ds) -> str:
    import torch
    if ds.bfloat16_config.enabled:
        return "bf16"
    if ds.float16_config.enabled:
        return "fp16"
    if ds.torch_autocast_enabled:  # None: torch's CPU default, bfloat16
        return {None: "bf16", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(ds.torch_autocast_dtype, "fp32")
    return "fp32"


def _device(offload) -> str:
    return "none" if offload is None else str(getattr(offload.device, "value", offload.device))


def _optimizer(ds, run_numbers: dict | None = None) -> tuple[str | None, dict]:
    """(type as it trains, its params) of what DeepSpeed reads; ``run_numbers``: dstrain's AdamW when it has none."""
    if ds.optimizer_name is None:
        return ("adamw", dict(run_numbers)) if run_numbers is not None else (None, {})
    params = dict(ds.optimizer_params or {})
    kind = ds.optimizer_name
    if kind in ("adam", "adamw"):  # DeepSpeed's Adam is AdamW unless adam_w_mode is false; AdamW always is
        kind = "adamw" if kind == "adamw" or params.get("adam_w_mode", True) else "adam"
        for key, value in _ADAM_DEFAULTS.items():
            params.setdefault(key, 0.01 if key == "weight_decay" and params.get("torch_adam") and kind == "adamw"
                              else value)
        for key in ("adam_w_mode", "torch_adam"):
            params.pop(key, None)
    return kind, params


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return a == pytest.approx(b, rel=1e-9)
    return a == b


def _what_runs(cfg, plan, ds, world: int) -> dict:
    t = cfg.train
    zero = plan.zero
    if plan.optimizer.implementation == "deepspeed":
        kind, params = _optimizer(ds)
    else:  # dstrain builds torch's AdamW / Adam from the block's numbers: DeepSpeed gets no optimizer block
        assert ds.optimizer_name is None
        kind, params = ("adamw" if plan.optimizer.decoupled else "adam"), dict(plan.optimizer.params)
    return {"batch": (t.micro_batch * t.grad_accum * world, t.micro_batch, t.grad_accum),
            "stage": zero["stage"], "precision": plan.precision, "clipping": t.grad_clip,
            "offload_optimizer": zero["offload_optimizer"], "offload_param": zero["offload_param"],
            "optimizer": kind, "optimizer_params": params,
            "scheduler": "the DeepSpeed JSON's" in plan.explanation.split("learning-rate schedule: ")[1]}


def _as_read(ds) -> dict:
    z = ds.zero_config
    kind, params = _optimizer(ds)
    return {"batch": (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps),
            "stage": ds.zero_optimization_stage, "precision": _precision(ds), "clipping": ds.gradient_clipping,
            "offload_optimizer": _device(z.offload_optimizer) in ("cpu", "nvme"),
            "offload_param": _device(z.offload_param) in ("cpu", "nvme"),
            "optimizer": kind, "optimizer_params": params, "scheduler": ds.scheduler_name is not None}


def _check(name: str, world: int, fast_bf16: bool, tmp_path) -> None:
    cfg, plan, filled = _resolve(name, world, fast_bf16, tmp_path)
    ds = _deepspeed_reads(plan.ds_config, world)
    runs, read = _what_runs(cfg, plan, ds, world), _as_read(ds)
    optimizer_params = runs.pop("optimizer_params"), read.pop("optimizer_params")
    if plan.optimizer.implementation == "deepspeed":
        assert optimizer_params[0] == optimizer_params[1]
    else:  # the client optimizer dstrain hands DeepSpeed in the block's place (checked against the file below)
        read["optimizer"] = runs["optimizer"]
    assert runs == read, (name, world)  # the plan is what DeepSpeed reads
    assert f"precision {plan.precision}," in plan.explanation
    raw = _as_deepspeed_loads(name)
    if name in DEEPSPEED_STOPS:
        with pytest.raises(DEEPSPEED_STOPS[name]):
            _deepspeed_reads(_users_file(raw, filled), world)
        return
    users = _deepspeed_reads(_users_file(raw, filled), world)
    theirs = _as_read(users)
    if "optimizer" not in raw:  # dstrain's AdamW from the run config (plan.txt says so)
        theirs["optimizer"] = "adamw"
        theirs["optimizer_params"] = {"lr": cfg.train.lr, "betas": list(cfg.train.betas), "eps": cfg.train.eps,
                                      "weight_decay": cfg.train.weight_decay}
    wanted = theirs.pop("optimizer_params")
    assert theirs == read, (name, world)  # the user's file, as DeepSpeed reads it, is what trains
    got = optimizer_params[0]  # every number the user's block gives (or DeepSpeed's Adam defaults) is the one used
    assert all(k in got and _same(got[k], v) for k, v in wanted.items()), (name, world, got, wanted)
    if users.scheduler_params:  # the scheduler's numbers as the user wrote them (or the run's for "auto")
        assert all(_same(ds.scheduler_params.get(k), v) for k, v in users.scheduler_params.items()), name


@pytest.mark.parametrize("name", ACCEPTED)
def test_deepspeed_reads_what_the_plan_says(name, measured, tmp_path):
    for fast_bf16 in (False, True):
        try:
            _check(name, 1, fast_bf16, tmp_path)
        except DSConfigError as err:  # a file written for more ranks: DeepSpeed's batch assertion fails too
            assert "batch keys disagree among themselves" in str(err), err
            *_, filled = _resolve(name, 2, fast_bf16, tmp_path)
            with pytest.raises(AssertionError, match="Check batch related parameters"):
                _deepspeed_reads(_users_file(_as_deepspeed_loads(name), filled), 1)
        _check(name, 2, fast_bf16, tmp_path)


def test_the_cross_check_sees_an_autocast_file_trained_in_bf16(measured, tmp_path):
    """A file's enabled bfloat16 torch_autocast on a CPU without fast bf16: DeepSpeed autocasts, and the plan says
    bf16 (it said fp32, the factory's own choice, while DeepSpeed ran the section as written)."""
    cfg, plan, _ = _resolve("torch_autocast_bf16_section.json", 2, False, tmp_path)
    ds = _deepspeed_reads(plan.ds_config, 2)
    assert _precision(ds) == plan.precision == "bf16"
    assert "bf16 as torch.autocast over fp32 weights (the file's torch_autocast section)" in plan.explanation
