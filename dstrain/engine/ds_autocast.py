"""An enabled ``torch_autocast`` section beside DeepSpeed's own 16-bit modes, and its ``dtype``.

DeepSpeed 0.19.8 (runtime/engine.py, runtime/torch_autocast.py, runtime/zero/stage_1_and_2.py) puts no check
between them: with ``bf16`` or ``fp16`` enabled it keeps 16-bit weights and its own bf16 / fp16 machinery and
runs every forward under ``torch.autocast(dtype=torch_autocast.dtype)`` on top. What that gives:

* ``bf16`` weights with ``bfloat16`` autocast: autocast in the weights' own dtype; trains as written (dstrain
  passes both sections on, as DeepSpeed runs them).
* ``fp16`` enabled: DeepSpeed's fp16 loss scaler runs, and for a ``float16`` autocast torch's ``GradScaler`` too
  (the ZeRO optimizers and the stage-0 engine start one whenever the autocast dtype is float16): the loss is
  scaled by the GradScaler and the gradients unscaled by both, so every step's gradients come out divided by the
  fp16 loss scale; a ``bfloat16`` autocast casts the fp16 weights down to bfloat16 in every matmul. Refused on
  GPUs (fp16 itself is refused on the CPU).
* no ``dtype``: DeepSpeed hands ``None`` to ``torch.autocast``, which takes the device's default: float16 on CUDA,
  bfloat16 on the CPU. On CUDA that is fp16 compute without any loss scaling (DeepSpeed starts its GradScaler only
  for a dtype written as float16), or float16 over bf16 weights; dstrain would have filled in bfloat16 and trained
  otherwise than DeepSpeed. On the CPU torch's default is the bfloat16 dstrain fills in.
* ``fp32``: not a lower precision; torch turns CPU autocast off for it ("the target dtype is not supported"), and
  on GPUs it casts nothing down: the run trains in fp32 (dstrain reported it as bf16 autocast before).

:func:`autocast_mix_checks` returns ``(problems, notes)``; pure.
"""
from __future__ import annotations

#: DeepSpeed's DtypeEnum names for the autocast dtype (``torch.`` prefixes removed first), as fp16 / bf16 / fp32.
_CANONICAL = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
              "bf16": "bf16", "bfloat16": "bf16"}


def autocast_dtype(block) -> str | None:
    """fp16 / bf16 / fp32 for a ``torch_autocast`` block's ``dtype`` as DeepSpeed reads it; None when it is not
    written or not one of its names (ds_sections names those)."""
    written = block.get("dtype") if isinstance(block, dict) else None
    if not isinstance(written, str):
        return None
    return _CANONICAL.get(written.strip().removeprefix("torch.").lower())


def autocast_precision(cfg: dict) -> str | None:
    """The precision an enabled ``torch_autocast`` section gives the run where the file's bf16 / fp16 sections leave
    it to the section (neither enabled nor "auto") and ``data_types`` pins no weights' dtype: "bf16" for a bfloat16
    ``dtype`` or none written (torch's CPU default; refused on GPUs), "fp32" for fp32 (autocast is off for it).
    DeepSpeed runs the section as written whatever the run would pick, so the plan must not choose another (it
    said fp32 on a CPU without fast bf16, and chose fp16 weights under the bfloat16 autocast on GPUs without bf16).
    None otherwise (fp16 autocast, or no such section)."""
    from dstrain.engine.ds_reading import pinned_weights_dtype, precision_left_open
    block = cfg.get("torch_autocast")
    if not isinstance(block, dict) or block.get("enabled") is not True or precision_left_open(cfg):
        return None
    if _on(cfg, "bf16") or _on(cfg, "fp16"):
        return None
    dtype = autocast_dtype(block)
    if dtype == "fp32":
        return "fp32"
    if (dtype == "bf16" or block.get("dtype") is None) and pinned_weights_dtype(cfg) is None:
        return "bf16"
    return None


def autocast_precision_problem(cfg: dict, precision: str) -> str | None:
    """The run's ``precision`` other than the one an enabled ``torch_autocast`` section gives (:func:`autocast_precision`):
    DeepSpeed would autocast as written beside it (bf16 autocast in an "fp32" run, or over fp16 weights). None if
    they agree or the section decides nothing."""
    decided = autocast_precision(cfg)
    if decided is None or decided == precision:
        return None
    written = cfg["torch_autocast"].get("dtype")
    what = f"dtype {written!r}" if written is not None else "no dtype (bfloat16 on the CPU)"
    return (f"torch_autocast.enabled: file says true with {what}, a {decided} run as DeepSpeed runs it, run precision "
            f"is {precision} (DeepSpeed autocasts as the section says whatever the run's precision; remove the section "
            "for a run in the run's precision)")


def planned_mixed_precision(template: dict, mode: str) -> str:
    """The ``deepspeed.mixed_precision`` the memory plan assumes for a run of the DeepSpeed JSON ``template``: "autocast"
    where the file turns ``torch_autocast`` on itself (its bf16 not enabled), as :func:`dstrain.engine.factory.mixed_precision`
    then runs bf16: torch.autocast over fp32 weights, whose model states above ZeRO-0 take the fp32 row (DeepSpeed's
    ZeRO optimizer keeps fp32 weights, fp32 gradients and its own fp32 partition; ``profiles.states_precision``).
    Before, a file's own section left ``mixed_precision`` auto planned the 16-bit row. ``mode`` otherwise."""
    block = template.get("torch_autocast")
    if not isinstance(block, dict) or block.get("enabled") is not True or _on(template, "bf16"):
        return mode
    if mode == "auto" or autocast_precision(template) == "bf16":  # the section is the run's bf16 in every mode
        return "autocast"
    return mode


def _on(cfg: dict, key: str) -> bool:
    return isinstance(cfg.get(key), dict) and cfg[key].get("enabled") is True


def autocast_mix_checks(cfg: dict, device_type: str) -> tuple[list[str], list[str]]:
    block = cfg.get("torch_autocast")
    if not isinstance(block, dict) or block.get("enabled") is not True:
        return [], []
    written, dtype = block.get("dtype"), autocast_dtype(block)
    if written is not None and dtype is None:
        return [], []  # not a dtype DeepSpeed knows: named by ds_sections
    fp16, bf16 = _on(cfg, "fp16"), _on(cfg, "bf16")
    if dtype == "fp32" and not (fp16 or bf16):
        return [], [f"torch_autocast.dtype: {written!r} is not a lower precision: torch turns autocast off for it on "
                    "the CPU ('the target dtype is not supported') and casts nothing down on GPUs, so the run trains "
                    "in fp32; write \"bfloat16\" for mixed precision"]
    if device_type == "cpu":
        return [], []  # fp16 is refused on the CPU (ds_sections); torch's CPU default is bfloat16, as dstrain fills
    if fp16:
        what = {"fp16": "torch's GradScaler scales the loss beside DeepSpeed's fp16 loss scaler and the gradients "
                         "are unscaled by both (divided by the loss scale once too often at every step)",
                "bf16": "every matmul casts the fp16 weights down to bfloat16",
                "fp32": "every matmul casts the fp16 weights up to fp32",
                None: "autocast with no dtype (torch's CUDA default, float16) over the fp16 weights, beside "
                      "DeepSpeed's fp16 loss scaler"}[dtype]
        return [f"torch_autocast: enabled beside fp16.enabled, and DeepSpeed runs both on the same model: {what}; use "
                "one of them: fp16 alone, or torch_autocast with fp16 off (fp32 weights)"], []
    if written is None:
        over = "DeepSpeed's bf16 weights" if bf16 else "the fp32 weights"
        return [f"torch_autocast.dtype: not set, and DeepSpeed hands None to torch.autocast, which takes float16 on "
                f"CUDA: fp16 compute over {over} without loss scaling (DeepSpeed starts its gradient scaler only for "
                "a dtype written as float16); write \"dtype\": \"bfloat16\" (or \"float16\", which starts the "
                "scaler)"], []
    if bf16 and dtype == "fp16":
        return [f"torch_autocast.dtype: {written!r} beside bf16.enabled: DeepSpeed keeps bf16 weights and autocasts "
                "them to float16 (a narrower range than the weights' bf16) in every matmul; write \"bfloat16\", or "
                "turn bf16 off for float16 autocast over fp32 weights"], []
    return [], []
