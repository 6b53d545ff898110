"""Round 14 of real-world DeepSpeed JSONs: where DeepSpeed's monitors write when ``job_name`` is a path, and an
enabled ``torch_autocast`` beside DeepSpeed's own 16-bit modes or without a ``dtype``.

Fixed in the round (each passed dstrain's checks before it, or was trained otherwise than it reported):
a ``tensorboard`` / ``csv_monitor`` ``job_name`` written as a path. DeepSpeed 0.19.8 logs to
``os.path.join(output_path, job_name)``: an absolute job_name drops ``output_path`` (dstrain's note said the events
went to ``<run>/logs/tensorboard``; now a note says output_path is unused and names where they go), and a job_name
with ``..`` that climbs out of a relative output_path (which dstrain keeps inside the run's folder) wrote beside the
run folder, neither inside it nor where DeepSpeed alone would (now refused, with the fix), as is a leading ``~``.
``torch_autocast`` beside ``fp16.enabled`` (DeepSpeed runs torch's GradScaler and its own fp16 loss scaler on the
same loss when the autocast dtype is float16; a bfloat16 autocast casts the fp16 weights down), a float16 autocast
over ``bf16`` weights, and an autocast with no ``dtype``: DeepSpeed hands None to ``torch.autocast``, float16 on
CUDA, with no loss scaling (its scaler starts only for a dtype written as float16), where dstrain filled in
bfloat16; each is refused on GPUs (on the CPU fp16 is refused anyway and torch's default is bfloat16, what dstrain
fills in). ``"dtype": "fp32"``: torch turns CPU autocast off for it and casts nothing down on GPUs, while dstrain
reported and summarised the run as bf16 autocast; now the run is fp32 and a note says why. A quoted
``checkpoint.parallel_write.pipeline_stage`` (DeepSpeed's parser stops on anything but true / false: dstrain showed
its bare line, and only once every other problem was fixed; now named with the fix beside the others). Keys DeepSpeed
reads only inside a section, written at the top level: ``gradient_accumulation_dtype`` as generated files write it
(refused as unknown with "did you mean 'gradient_accumulation_steps'?"; now pointed at
``data_types.grad_accum_dtype``) and ZeRO keys flattened out of ``zero_optimization`` (``overlap_comm``, bucket sizes:
now named with their section). An enabled ``comms_logger`` with ``prof_all`` false and no ``prof_ops`` (DeepSpeed times
only the listed ops: it logs nothing, and dstrain's note said communication was logged per step): now a note says
so. New checks in dstrain.engine.ds_paths and dstrain.engine.ds_autocast (called by
ds_scalars), ds_scalars and ds_files.
Pinned by tests/configs and trained 3 steps on 2 CPU ranks with a checkpoint at step 2 by hand, as written:
``bf16`` enabled together with a bfloat16 ``torch_autocast`` (DeepSpeed keeps bf16 weights and autocasts on top;
dstrain passes both sections on unchanged), ``torch_autocast`` without a dtype on the CPU (bfloat16), the fp32
autocast file, the absolute-job_name file (with its job_name pointed at a writable folder) and the comms-logger
file (no comm/* metric at any step; with prof_all true they are there).
"""
from __future__ import annotations

import json

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_scalars import scalar_checks

from tests.unit.ds_rounds import CONFIGS, RECIPE, ROOT  # noqa: E402,F401
from tests.unit.ds_rounds import deepspeed_config as _deepspeed_config  # noqa: E402,F401
from tests.unit.ds_rounds import refusals as _refusals  # noqa: E402,F401
from tests.unit.ds_rounds import dry_run as _dry_run  # noqa: E402,F401

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


# --------------------------------------------------------------------------- monitor job_name written as a path


def test_deepspeeds_csv_monitor_drops_output_path_before_an_absolute_job_name(monkeypatch, tmp_path):
    from deepspeed.monitor import csv_monitor
    from deepspeed.monitor.config import CSVConfig
    monkeypatch.setattr(csv_monitor.dist, "get_rank", lambda: 0)
    monitor = csv_monitor.csvMonitor(CSVConfig(enabled=True, output_path=str(tmp_path / "run" / "csv"),
                                               job_name=str(tmp_path / "elsewhere")))
    assert monitor.log_dir == str(tmp_path / "elsewhere") and not (tmp_path / "run").exists()


def test_an_absolute_job_name_is_noted_with_where_the_events_go(capsys, monkeypatch, tmp_path):
    summary = check_ds_file(CONFIGS / "tensorboard_csv_job_name_absolute.json", "cpu", 2)
    for section, folder in (("tensorboard", "tensorboard"), ("csv_monitor", "csv")):
        assert (f"{section}.output_path: unused: job_name '/mnt/shared/{folder}/gpt_tiny_zero1' is an absolute path, "
                f"so DeepSpeed's os.path.join(output_path, job_name) drops output_path and writes the events to "
                f"/mnt/shared/{folder}/gpt_tiny_zero1, outside the run's folder") in summary
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "tensorboard_csv_job_name_absolute.json")
    assert code == 0 and any(line.startswith("dstrain: note: tensorboard.output_path: unused: job_name") for line in
                             lines), lines


def test_a_job_name_climbing_out_of_the_run_folder_is_refused(capsys, monkeypatch, tmp_path):
    expected = ("tensorboard.job_name: '../../tensorboard_runs/gpt_tiny_zero2' climbs out of output_path "
                "('tensorboard'): dstrain keeps a relative output_path inside the run's folder, so DeepSpeed's "
                "os.path.join(output_path, job_name) would write the events to <run folder>/../tensorboard_runs/"
                "gpt_tiny_zero2, outside the run (and not where DeepSpeed alone would, relative to the working "
                "directory); write a name without '..', or an absolute output_path")
    assert _refusals(CONFIGS / "tensorboard_job_name_dotdot.json") == [expected]
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "tensorboard_job_name_dotdot.json")
    assert code == 2 and not (tmp_path / "tensorboard_runs").exists()
    inside = {"tensorboard": {"enabled": True, "output_path": "logs/tb", "job_name": "../exp1"}}  # stays inside
    assert scalar_checks(inside, "cpu") == ([], [])
    absolute = {"csv_monitor": {"enabled": True, "output_path": "/data/csv/run1", "job_name": "../run2"}}
    assert scalar_checks(absolute, "cpu") == ([], [])  # DeepSpeed and dstrain both write to /data/csv/run2
    default = {"csv_monitor": {"enabled": True, "job_name": "../x"}}  # output_path not set: ds_csv_monitor/../x
    assert scalar_checks(default, "cpu") == ([], [])
    home = {"csv_monitor": {"enabled": True, "job_name": "~/csv/run1"}}
    assert scalar_checks(home, "cpu")[0] == [
        "csv_monitor.job_name: '~/csv/run1' starts with '~', which DeepSpeed does not expand (os.path.join(output_path, "
        "job_name) would make a folder named '~'); write a plain name, and the folder as output_path"]
    off = {"tensorboard": {"enabled": False, "job_name": "/abs"}}
    assert scalar_checks(off, "cpu") == ([], [])


# --------------------------------------------------------------------------- torch_autocast beside bf16 / fp16


def test_deepspeed_reads_bf16_and_autocast_together_and_no_dtype_as_none():
    import torch
    both = _deepspeed_config({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    assert both.bfloat16_config.enabled and both.torch_autocast_enabled and both.torch_autocast_dtype == torch.bfloat16
    assert _deepspeed_config({"torch_autocast": {"enabled": True}}).torch_autocast_dtype is None
    assert torch.get_autocast_dtype("cuda") == torch.float16  # what torch.autocast takes for None on CUDA
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_bf16_with_bf16_autocast_is_passed_on_as_written():
    from dstrain.engine.factory import mixed_precision
    template = json.loads((CONFIGS / "torch_autocast_bf16_both_enabled.json").read_text())
    resolved = {**template, "bf16": {"enabled": True}}
    assert mixed_precision(resolved, template, "auto", "cpu") == (resolved, "")  # both on, as DeepSpeed runs them
    for device in ("cpu", "cuda"):
        assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "torch_autocast_bf16_both_enabled.json", device, 2)


def test_autocast_beside_fp16_is_refused_on_gpus():
    assert _refusals(CONFIGS / "torch_autocast_fp16_enabled.json", "cuda") == [
        "torch_autocast: enabled beside fp16.enabled, and DeepSpeed runs both on the same model: torch's GradScaler "
        "scales the loss beside DeepSpeed's fp16 loss scaler and the gradients are unscaled by both (divided by the "
        "loss scale once too often at every step); use one of them: fp16 alone, or torch_autocast with fp16 off (fp32 "
        "weights)"]
    cfg = json.loads((CONFIGS / "torch_autocast_fp16_enabled.json").read_text())
    cfg["torch_autocast"]["dtype"] = "bfloat16"
    assert "every matmul casts the fp16 weights down to bfloat16" in scalar_checks(cfg, "cuda")[0][0]
    cpu = _refusals(CONFIGS / "torch_autocast_fp16_enabled.json")  # fp16 itself, named as before
    assert not any(p.startswith("torch_autocast: enabled beside fp16") for p in cpu)


def test_float16_autocast_over_bf16_weights_is_refused_on_gpus():
    assert _refusals(CONFIGS / "torch_autocast_fp16_over_bf16.json", "cuda") == [
        "torch_autocast.dtype: 'torch.float16' beside bf16.enabled: DeepSpeed keeps bf16 weights and autocasts them "
        "to float16 (a narrower range than the weights' bf16) in every matmul; write \"bfloat16\", or turn bf16 off "
        "for float16 autocast over fp32 weights"]


def test_autocast_without_a_dtype_is_refused_on_gpus_and_bfloat16_on_the_cpu():
    assert _refusals(CONFIGS / "torch_autocast_no_dtype.json", "cuda") == [
        "torch_autocast.dtype: not set, and DeepSpeed hands None to torch.autocast, which takes float16 on CUDA: fp16 "
        "compute over the fp32 weights without loss scaling (DeepSpeed starts its gradient scaler only for a dtype "
        "written as float16); write \"dtype\": \"bfloat16\" (or \"float16\", which starts the scaler)"]
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "torch_autocast_no_dtype.json", "cpu", 2)
    with_bf16 = {"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}
    assert "over DeepSpeed's bf16 weights" in scalar_checks(with_bf16, "cuda")[0][0]
    written = {"torch_autocast": {"enabled": True, "dtype": "float16"}}  # fp32 weights, the scaler starts: valid
    assert scalar_checks(written, "cuda") == ([], [])


def test_fp32_autocast_trains_and_is_reported_as_fp32(capsys, monkeypatch, tmp_path):
    from dstrain.engine.factory import _file_precision
    template = json.loads((CONFIGS / "torch_autocast_dtype_fp32.json").read_text())
    assert _file_precision(template) == "fp32"
    # round 16: the section's own precision, as DeepSpeed runs it (was None, the factory's choice: fp32 in the plan
    # on a CPU without fast bf16 while DeepSpeed autocast in bfloat16; see tests/unit/test_ds_realworld16.py)
    assert _file_precision({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}) == "bf16"
    assert _file_precision({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}, "bf16": {"enabled": "auto"}}) \
        is None  # bf16 "auto" beside it: the run's choice
    note = ("torch_autocast.dtype: 'fp32' is not a lower precision: torch turns autocast off for it on the CPU ('the "
            "target dtype is not supported') and casts nothing down on GPUs, so the run trains in fp32; write "
            "\"bfloat16\" for mixed precision")
    assert note in check_ds_file(CONFIGS / "torch_autocast_dtype_fp32.json", "cpu", 2)
    code, lines = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "torch_autocast_dtype_fp32.json")
    assert code == 0 and f"dstrain: note: {note}" in lines
    assert "--deepspeed.precision=bf16" not in " ".join(lines)


# --------------------------------------------------------------------------- checkpoint.parallel_write


def test_a_quoted_pipeline_stage_is_named_with_every_other_problem(capsys, monkeypatch, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfigError
    with pytest.raises(DeepSpeedConfigError, match="pipeline_stage value of 'true' is invalid"):
        _deepspeed_config({"checkpoint": {"parallel_write": {"pipeline_stage": "true"}}})
    expected = ("checkpoint.parallel_write.pipeline_stage: file says \"true\", and DeepSpeed's parser accepts only "
                "true or false and stops on anything else (\"value of 'true' is invalid\"); write true without quotes")
    assert _refusals(CONFIGS / "checkpoint_parallel_write_quoted.json") == [expected]
    monkeypatch.chdir(tmp_path)  # the run's batch (8 x 1) disagrees with the file's too: both named at once
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE, "--train.steps=3",
                     f"--deepspeed.profile={CONFIGS / 'checkpoint_parallel_write_quoted.json'}",
                     f"--output.dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and f"  - {expected}" in lines and any("train_micro_batch_size_per_gpu: file says 2" in line
                                                            for line in lines), lines
    assert scalar_checks({"checkpoint": {"parallel_write": True}}, "cpu")[0][0].startswith(
        "checkpoint.parallel_write: true, where DeepSpeed wants a block")
    assert scalar_checks({"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, "cpu") == ([], [])
    assert scalar_checks({"checkpoint": {"parallel_write": {}}}, "cpu") == ([], [])


# --------------------------------------------------------------------------- section keys written at the top level


def test_a_top_level_gradient_accumulation_dtype_names_data_types_not_the_steps():
    ds = _deepspeed_config({"gradient_accumulation_dtype": "fp32"})
    assert ds.grad_accum_dtype is None  # ignored: DeepSpeed's default accumulation dtype
    assert _deepspeed_config({"data_types": {"grad_accum_dtype": "fp32"}}).grad_accum_dtype == "fp32"
    assert _refusals(CONFIGS / "gradient_accumulation_dtype_top_level.json") == [
        "unknown top-level key 'gradient_accumulation_dtype': DeepSpeed reads the gradient-accumulation dtype only as "
        "data_types.grad_accum_dtype and would silently ignore this one (accumulating in its default dtype); write "
        "\"data_types\": {\"grad_accum_dtype\": \"fp32\"}"]


def test_zero_keys_flattened_to_the_top_level_are_named_with_their_section():
    problems = _refusals(CONFIGS / "zero_keys_flattened_top_level.json")
    keys = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size")
    assert problems == [f"unknown top-level key '{key}': a zero_optimization key, which DeepSpeed reads only inside "
                        "the \"zero_optimization\" section and would silently ignore at the top level; move it there"
                        for key in keys]
    from dstrain.engine.ds_files import _top_level_problems
    assert _top_level_problems({"stage3_gather_fp16_weights_on_model_save": True})[0].endswith("move it there")
    assert _top_level_problems({"learning_rate": 1e-4}) == [  # not a section key: as before
        "unknown top-level key 'learning_rate'; DeepSpeed would silently ignore it"]


# --------------------------------------------------------------------------- a comms logger that times nothing


def test_a_comms_logger_with_prof_all_false_and_no_ops_is_noted(monkeypatch):
    from deepspeed.comm import comm
    from deepspeed.utils.comms_logging import CommsLogger
    logger = CommsLogger()
    logger.configure(_deepspeed_config({"comms_logger": {"enabled": True, "prof_all": False}}).comms_config)
    assert logger.enabled and logger.prof_all is False and logger.prof_ops == []  # no op is ever timed
    assert "comms_logger.prof_all or selected_log_name in comms_logger.prof_ops" in " ".join(
        __import__("inspect").getsource(comm.timed_op).split())
    note = ("comms_logger: enabled with prof_all false and no prof_ops, so DeepSpeed's comms logger times no op (only "
            "the listed ones, or all with prof_all true) and logs nothing; set prof_all to true or list the ops in "
            "prof_ops")
    assert note in check_ds_file(CONFIGS / "comms_logger_prof_all_false_no_ops.json", "cpu", 2)
    listed = {"comms_logger": {"enabled": True, "prof_all": False, "prof_ops": ["all_reduce"]}}
    assert scalar_checks(listed, "cpu") == ([], [])
    assert scalar_checks({"comms_logger": {"enabled": True}}, "cpu") == ([], [])  # prof_all defaults to true
