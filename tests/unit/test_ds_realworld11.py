"""Round 11 of real-world DeepSpeed JSONs: what the classes DeepSpeed 0.19.8 builds from the optimizer and scheduler
blocks accept, and what they change without a word. DeepSpeed's parser never looks inside ``optimizer.params``; it
hands them to the class it picks. Each passed dstrain's checks before this round: an ``Adagrad`` block with Adam's
``betas`` copied in (DeepSpeed builds torch.optim.Adagrad without offload: TypeError in initialize, on every rank),
torch's Adagrad keys ``lr_decay`` / ``initial_accumulator_value`` under optimizer offload (DeepSpeed's CPU Adagrad
takes lr, eps, weight_decay, amsgrad only: TypeError), Adam's ``eps`` in a ``Lion`` block under offload (DeepSpeed's
CPU Lion: TypeError), ``"amsgrad": true`` for AdamW under offload (DeepSpeed's CPU Adam raises RuntimeError on it in
initialize), torch's SGD with ``nesterov`` and no momentum (SGD's constructor raises ValueError; torch.optim classes
are now built once on a stand-in parameter before launch), a ``Muon`` block with ``nesterov`` / ``ns_steps`` (other
Muon implementations' keys: DeepSpeed splits the block into its Muon and Adam halves by a fixed list of keys and
drops the rest, so the run trained without them), torch's
``CyclicLR`` beside an ``Adagrad`` block (it cycles momentum by default and raises on an optimizer without any, in
initialize; torch schedulers were tried on a stand-in AdamW, now on the file's class), ``LRRangeTest`` from
``lr_range_test_min_lr`` 0 (its lr is that minimum times a growing factor: 0 for the whole run; a
``lr_range_test_step_rate`` of 0 never moves it), a ``flops_profiler.profile_step`` past the run's length (DeepSpeed
profiles the step begun after ``profile_step`` finished steps: by hand, a 3-step run with ``profile_step`` 10 wrote
no profile, exit 0), ``checkpoint.writer.type`` "mock" (FastPersist's benchmark writer counts the bytes and writes
none: by hand, 3 steps, exit 0, and every model and optimizer state file of both checkpoints was 0 bytes, beside a
COMPLETE marker), a ``checkpoint.writer`` block without ``data_parallel`` below ZeRO stage 3 (DeepSpeed's one-writer
set-up reads a ``dp_rank`` its parallel info does not have: by hand, the run stopped in initialize with
AttributeError; round 7's fix for the fast writer, ``"type": "python"``, led there when the block had no
``data_parallel``), ``"decoupled": true`` in the writer on the CPU (by hand at ZeRO-2: 2 steps trained, then the run
stopped at its first checkpoint: the writer process's queue cannot carry the ZeRO state), and
``comms_logger.prof_ops`` names no op is logged under (``"allreduce"``; the wrapper ``"reduce_scatter_fn"``, which
DeepSpeed logs as ``reduce_scatter_tensor``, in a file pinned as trained before this round): with ``prof_all`` false
they were never profiled. Each is now refused before launch naming the key and the fix (dstrain.engine.ds_classes;
the writer in ds_sections, the op names in ds_unread).
Noted now, and trained as DeepSpeed trains them (3 steps on 2 CPU ranks with a checkpoint at step 2, by hand; each
passed in silence before): ``OneCycle`` momentum cycling (on by default) with an Adam beta2 other than 0.99
(DeepSpeed's OneCycle writes ``(cycled momentum, 0.99)`` into the betas at every step: DeepSpeedExamples' OneCycle
file, Adam betas [0.9, 0.95], trains with beta2 0.99; the note offers ``"cycle_momentum": false`` or beta2 0.99, and is
checked against the run's ``train.betas`` where the file leaves them to the run), and momentum cycling asked of SGD or
Adagrad (no betas: DeepSpeed logs a warning and does not cycle). These are DeepSpeed's OneCycle working as built, so a
note, not a refusal.
Refused before, now with the key to remove and the one to keep (was DeepSpeed's assertion text alone): a deprecated
ZeRO key beside its replacement (``cpu_offload`` with ``offload_optimizer``, ``cpu_offload_param`` with
``offload_param``, ``stage3_gather_fp16_weights_on_model_save`` with ``stage3_gather_16bit_weights_on_model_save``).
Noted now (DeepSpeed ignores them): ``nvme_path`` / ``pipeline_read`` / ``pipeline_write`` / ``fast_init`` under an
offload to "cpu" (ZeRO-Infinity templates switched to the CPU).
Also in the round, handled before it and pinned by tests/configs: fp16's ``"loss_scale": "dynamic"`` and
comms_logger's ``"prof_ops": "all_reduce"`` (refused by DeepSpeed's parser, named by key), and, trained 3 steps on 2
CPU ranks with a checkpoint at step 2 by hand: Muon with ``muon_lr`` / ``adam_lr`` / ``ns_method``, OneCycle with
``cycle_momentum`` false beside betas [0.9, 0.95], the ZeRO-Infinity template set to "cpu", and a batch written in
scientific notation (``"train_batch_size": 3.2e1``).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError
from dstrain.engine.ds_sections import section_problems

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROOT = CONFIGS.parents[1]
RECIPE = str(ROOT / "models" / "gpt" / "recipes" / "tiny.json")

from tests.unit.test_ds_realworld6 import _cpu_accelerator  # noqa: F401,E402 (the fixture is autouse here too)


def _refusals(name: str) -> list[str]:
    with pytest.raises(DSConfigError) as err:
        check_ds_file(CONFIGS / name, device_type="cpu", world_size=2)
    return err.value.problems


def _dry_run(capsys, monkeypatch, tmp_path, profile, *extra) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE,
                     f"--deepspeed.profile={profile}", "--train.steps=3", f"--output.dir={tmp_path / 'run'}", *extra])
    return code, capsys.readouterr().err


def _weight():
    return [torch.nn.Parameter(torch.zeros(2))]


# --------------------------------------------------------------------------- optimizer params the class refuses


def test_adam_betas_copied_into_an_adagrad_block_are_refused():
    with pytest.raises(TypeError, match="betas"):  # what DeepSpeed builds without offload
        torch.optim.Adagrad(_weight(), lr=0.01, betas=(0.9, 0.999))
    assert _refusals("adagrad_adam_betas_copied.json") == [
        "optimizer.params.betas: torch.optim.Adagrad (DeepSpeed's class for Adagrad without offload) does not take it "
        "(it takes differentiable, eps, foreach, fused, initial_accumulator_value, lr, lr_decay, maximize, "
        "weight_decay) and DeepSpeed would stop at start-up, on every rank; remove it"]


def test_torch_adagrad_keys_under_offload_are_refused_and_pass_without_it():
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    taken = set(inspect.signature(DeepSpeedCPUAdagrad.__init__).parameters)
    assert "lr_decay" not in taken and "initial_accumulator_value" not in taken  # TypeError in initialize
    assert _refusals("adagrad_offload_lr_decay.json") == [
        "optimizer.params.initial_accumulator_value, lr_decay: DeepSpeed's CPU Adagrad (its class under optimizer "
        "offload) does not take them (it takes amsgrad, eps, fp32_optimizer_states, lr, weight_decay) and DeepSpeed "
        "would stop at start-up, on every rank; remove them"]
    plain = {"optimizer": {"type": "Adagrad", "params": {"lr": 0.01, "lr_decay": 0.0}},
             "zero_optimization": {"stage": 2}}
    assert section_problems(plain, "cpu")[0] == []  # torch's Adagrad takes them


def test_adam_eps_in_a_lion_block_under_offload_is_refused():
    from deepspeed.ops.lion import DeepSpeedCPULion
    assert "eps" not in inspect.signature(DeepSpeedCPULion.__init__).parameters
    assert _refusals("lion_offload_adam_eps.json") == [
        "optimizer.params.eps: DeepSpeed's CPU Lion (its class under optimizer offload) does not take it (it takes "
        "betas, fp32_optimizer_states, lr, weight_decay) and DeepSpeed would stop at start-up, on every rank; "
        "remove it"]
    fused = {"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "eps": 1e-8}}}  # on GPUs without offload
    assert section_problems(fused, "cuda")[0][0].startswith("optimizer.params.eps: DeepSpeed's FusedLion does not "
                                                            "take it")


def test_amsgrad_under_offload_is_refused_where_deepspeeds_cpu_adam_raises_on_it():
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        DeepSpeedCPUAdam(_weight(), lr=1e-3, amsgrad=True)
    assert _refusals("adamw_amsgrad_cpu_offload.json") == [
        "optimizer.params.amsgrad: true under optimizer offload, where DeepSpeed builds its CPU Adam, which refuses it "
        "('DeepSpeedCPUAdam does not support the AMSGrad variant' in initialize, on every rank); remove it, or drop "
        "the offload (the AdamW dstrain builds itself takes amsgrad)"]
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "adamw_amsgrad_true.json", "cpu", 2)  # no offload


def test_values_a_torch_optimizer_refuses_are_found_by_building_it_once():
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum"):
        torch.optim.SGD(_weight(), lr=0.1, nesterov=True)
    assert _refusals("torch_sgd_nesterov_without_momentum.json") == [
        "optimizer.params.nesterov: torch.optim.SGD refuses the file's values (Nesterov momentum requires a momentum "
        "and zero dampening); DeepSpeed builds it from this block and would stop at start-up, on every rank; change it "
        "as the message says"]
    fine = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}}
    assert section_problems(fine, "cpu")[0] == []
    negative = {"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3, "alpha": -0.5}}}
    assert section_problems(negative, "cpu")[0][0].startswith("optimizer.params.alpha: torch.optim.RMSprop refuses")


def test_muon_keys_deepspeed_never_reads_are_refused():
    from deepspeed.runtime.engine import DeepSpeedEngine
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    weight.use_muon = True
    groups = DeepSpeedEngine._muon_param_groups([weight], {"lr": 0.02, "momentum": 0.95, "nesterov": False,
                                                           "ns_steps": 3})
    assert [sorted(g) for g in groups] == [["lr", "momentum", "name", "params", "use_muon"]]  # dropped, silently
    assert _refusals("muon_nesterov_ns_steps.json") == [
        "optimizer.params.nesterov, ns_steps: DeepSpeed's Muon never reads them (it takes adam_lr, adam_w_mode, betas, "
        "eps, fp32_optimizer_states, lr, momentum, muon_lr, ns_method, torch_adam, weight_decay; its Newton-Schulz "
        "steps and Nesterov momentum are fixed inside it), so the run would train without them, not as the file "
        "says; remove them"]
    assert "valid DeepSpeed config" in check_ds_file(CONFIGS / "muon_lr_adam_lr_split.json", "cpu", 2)


# --------------------------------------------------------------------------- schedulers that change what they are given


def _summary(name: str) -> str:
    return check_ds_file(CONFIGS / name, device_type="cpu", world_size=2)


def test_onecycle_momentum_cycling_replaces_beta2_and_says_so_unless_it_is_099():
    from deepspeed.runtime.lr_schedules import OneCycle
    optimizer = torch.optim.AdamW(_weight(), lr=1e-3, betas=(0.9, 0.95))
    OneCycle(optimizer, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=2)
    assert optimizer.param_groups[0]["betas"][1] == 0.99  # the file's 0.95, replaced
    note = ("scheduler.params.cycle_momentum: OneCycle's momentum cycling (it is on by default) sets the optimizer's "
            "betas to (cycled momentum, 0.99) at every step, so the file's beta2 0.95 (optimizer.params.betas) is "
            "replaced by 0.99 (DeepSpeed says nothing); set \"cycle_momentum\": false to keep the betas, or write "
            "\"betas\": [0.9, 0.99]")
    for name in ("onecycle_adamw_beta2_095.json", "examples_onecycle_scheduler.json"):  # DeepSpeed trains them so
        assert _summary(name).endswith("; " + note)
    for name in ("onecycle_momentum_off_adamw_beta2_095.json", "onecycle_cycle_momentum_adamw.json"):
        assert "cycle_momentum:" not in _summary(name)  # off, or beta2 0.99: nothing to say


def test_onecycle_beta2_is_checked_against_the_runs_betas_where_the_file_leaves_them(capsys, monkeypatch, tmp_path):
    profile = tmp_path / "cycle.json"
    profile.write_text('{"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": '
                       '{"lr": "auto", "betas": "auto"}}, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": '
                       '1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 2}}}')
    code, err = _dry_run(capsys, monkeypatch, tmp_path, profile, "--train.betas=[0.9,0.95]")
    assert code == 0, err
    assert "note: scheduler.params.cycle_momentum:" in err
    assert "the run's beta2 0.95 (train.betas) is replaced by 0.99" in err and "use --train.betas=[0.9,0.99]" in err
    code, err = _dry_run(capsys, monkeypatch, tmp_path, profile, "--train.betas=[0.9,0.99]")
    assert code == 0 and "cycle_momentum" not in err, err


def test_onecycle_momentum_asked_of_an_optimizer_without_betas_is_a_note():
    from deepspeed.runtime.lr_schedules import OneCycle
    sgd = torch.optim.SGD(_weight(), lr=0.1, momentum=0.9)
    cycle = OneCycle(sgd, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=2, cycle_momentum=True)
    assert cycle.cycle_momentum is False  # a warning only
    assert _summary("onecycle_sgd_cycle_momentum.json").endswith(
        "; scheduler.params.cycle_momentum: OneCycle cycles momentum through the optimizer's betas, and SGD has none "
        "(DeepSpeed turns the cycling off with only a warning: the run does not cycle momentum); set "
        "\"cycle_momentum\": false to say so, or use an optimizer with betas (AdamW) to cycle it")
    adagrad = {"optimizer": {"type": "Adagrad", "params": {"lr": 0.01}},
               "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
                                                            "cycle_min_mom": 0.8}}}
    problems, notes = section_problems(adagrad, "cpu")
    lr_note = ("optimizer.params.lr: unused (0.01): OneCycle sets the learning rate from the first step, starting at "
               "cycle_min_lr 0.001")  # round 17: OneCycle overwrites the optimizer's lr
    assert problems == [] and notes[0] == lr_note
    assert notes[1].startswith("scheduler.params.cycle_min_mom: OneCycle cycles momentum through the optimizer's "
                               "betas, and Adagrad")
    unasked = {**adagrad, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2}}}
    assert section_problems(unasked, "cpu") == ([], [lr_note])  # no momentum note: DeepSpeed's default, not the file's


def test_a_torch_scheduler_is_tried_on_the_files_optimizer_class():
    weight = _weight()
    with pytest.raises(ValueError, match="must support momentum or beta1"):  # in initialize, on every rank
        torch.optim.lr_scheduler.CyclicLR(torch.optim.Adagrad(weight, lr=0.01), base_lr=1e-3, max_lr=1e-2)
    torch.optim.lr_scheduler.CyclicLR(torch.optim.AdamW(weight, lr=0.01), base_lr=1e-3, max_lr=1e-2)  # the stand-in
    assert _refusals("torch_cycliclr_adagrad_stage0.json") == [
        "scheduler.params: torch's CyclicLR refuses the file's params (optimizer must support momentum or beta1 with "
        "`cycle_momentum` option enabled); DeepSpeed builds it when the engine starts and would stop there on every "
        "rank; fix the value torch names"]
    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}},
           "scheduler": {"type": "CyclicLR", "params": {"base_lr": 1e-3, "max_lr": 1e-2}}}
    assert section_problems(sgd, "cpu")[0] == []
    off = {"optimizer": {"type": "Adagrad", "params": {"lr": 0.01}},
           "scheduler": {"type": "CyclicLR", "params": {"base_lr": 1e-3, "max_lr": 1e-2, "cycle_momentum": False}}}
    assert section_problems(off, "cpu")[0] == []


def test_a_range_test_from_zero_keeps_the_lr_at_zero_and_is_refused():
    from deepspeed.runtime.lr_schedules import LRRangeTest
    optimizer = torch.optim.AdamW(_weight(), lr=1e-3)
    schedule = LRRangeTest(optimizer, lr_range_test_min_lr=0.0, lr_range_test_step_size=1, lr_range_test_step_rate=5)
    for _ in range(3):
        optimizer.step()
        schedule.step()
    assert optimizer.param_groups[0]["lr"] == 0.0
    assert _refusals("lr_range_test_min_lr_zero.json") == [
        "scheduler.params.lr_range_test_min_lr: file says 0; LRRangeTest multiplies it by (1 + lr_range_test_step_rate "
        "x interval), so the lr would stay at 0 (or below) for the whole run, and DeepSpeed says nothing; set the "
        "smallest lr to test, above 0 (1e-5, say)"]


def test_a_range_test_rate_of_zero_or_less_is_refused():
    assert _refusals("lr_range_test_step_rate_zero.json") == [
        "scheduler.params.lr_range_test_step_rate: file says 0; LRRangeTest's lr is lr_range_test_min_lr x (1 + "
        "step_rate x interval), so it would never move from lr_range_test_min_lr, and DeepSpeed says nothing; set a "
        "rate above 0 (DeepSpeed's default is 1.0)"]
    falling = {"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3,
                                                               "lr_range_test_step_rate": -0.5}}}
    assert "so it would fall, and go below 0 (training uphill)" in section_problems(falling, "cpu")[0][0]
    rising = {"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-5,
                                                              "lr_range_test_step_rate": 2.0}}}
    assert section_problems(rising, "cpu")[0] == []


# --------------------------------------------------------------------------- comms logger


def test_comms_logger_op_names_no_op_logs_under_are_refused():
    import re

    from deepspeed.comm import comm
    source = inspect.getsource(comm)
    assert not re.search(r"@timed_op\s*\ndef reduce_scatter_fn", source)  # a wrapper: it calls ...
    assert "log_name='reduce_scatter_tensor'" in source  # ... reduce_scatter_tensor, logged under that name
    assert _refusals("comms_logger_prof_ops_typo_allreduce.json") == [
        "comms_logger.prof_ops: 'allreduce', 'allgather' are not names of ops DeepSpeed's comms logger logs (with "
        "prof_all false it profiles only the names listed, so they would never be profiled, without a word); write "
        "the logged names ('allreduce' -> 'all_reduce'; 'allgather' -> 'all_gather')"]
    assert _refusals("comms_logger_prof_ops_zero2.json") == [  # pinned as trained before this round
        "comms_logger.prof_ops: 'reduce_scatter_fn' is not the name of an op DeepSpeed's comms logger logs (with "
        "prof_all false it profiles only the names listed, so it would never be profiled, without a word); write the "
        "logged names ('reduce_scatter_fn' -> 'reduce_scatter_tensor')"]
    every = {"comms_logger": {"enabled": True, "prof_all": True, "prof_ops": ["allreduce"]}}  # prof_ops unread
    assert section_problems(every, "cpu")[0] == []
    listed = {"comms_logger": {"enabled": True, "prof_all": False,
                               "prof_ops": ["all_reduce", "all_gather_into_tensor"]}}
    assert section_problems(listed, "cpu")[0] == []


# --------------------------------------------------------------------------- checkpoints


def test_the_mock_checkpoint_writer_writes_nothing_and_is_refused_on_any_device(tmp_path):
    from deepspeed.io.mock_file_writer import MockFileWriter
    writer = MockFileWriter(str(tmp_path / "state.pt"))
    assert writer.write(b"x" * 100) == 100  # counted ...
    writer.close()
    assert (tmp_path / "state.pt").stat().st_size == 0  # ... and not written
    refusal = ("checkpoint.writer.type: DeepSpeed's mock writer opens each checkpoint file and counts the bytes "
               "without writing them (a benchmark setting: every checkpoint would be empty and no resume could read "
               "it); set \"type\": \"python\" (or \"fast\" on GPUs) or remove checkpoint.writer")
    assert _refusals("checkpoint_mock_writer.json") == [refusal]
    mock = {"checkpoint": {"writer": {"type": "MOCK", "data_parallel": "replica"}}}  # DeepSpeed upper-cases the type
    assert section_problems(mock, "cuda")[0] == [refusal]
    fast = {"checkpoint": {"writer": {"type": "fast", "data_parallel": "replica"}}}
    assert section_problems(fast, "cuda")[0] == []


def test_a_writer_without_data_parallel_is_refused_below_stage_3():
    from deepspeed.runtime.model_checkpointing import data_parallel_writer_factory as factory
    from deepspeed.runtime.model_checkpointing.utils import UniversalParallelInfo
    source = inspect.getsource(factory.DataParallelWriterFactory._get_data_parallel_config)
    assert "self._uni_parallel_info.dp_rank if mpu_info is None" in source  # a field UniversalParallelInfo lacks
    assert "dp_rank" not in UniversalParallelInfo.__dataclass_fields__
    assert _refusals("checkpoint_python_writer_no_data_parallel.json") == [
        "checkpoint.writer.data_parallel: absent, which DeepSpeed 0.19.8 reads as one writer (rank 0) and fails to set "
        "up at ZeRO stage 2 without a model-parallel unit (deepspeed.initialize fails: 'UniversalParallelInfo' "
        "object has no attribute 'dp_rank'); add \"data_parallel\": \"replica\" to the writer, or remove "
        "checkpoint.writer"]
    zero3 = {"zero_optimization": {"stage": 3}, "checkpoint": {"writer": {"type": "python"}}}
    assert section_problems(zero3, "cpu")[0] == []  # stage 3 takes the one-writer path before the lookup


def test_the_decoupled_writer_is_refused_on_the_cpu_under_zero():
    assert _refusals("checkpoint_decoupled_python_writer.json") == [
        "checkpoint.writer.decoupled: true hands each checkpoint to a writer process through a queue, and torch "
        "refuses to send the ZeRO optimizer's state across it (by hand on 2 CPU ranks: the run stopped at its first "
        "checkpoint, 'Cowardly refusing to serialize non-leaf tensor which requires_grad'); set it to false"]
    plain = {"zero_optimization": {"stage": 2},
             "checkpoint": {"writer": {"type": "python", "decoupled": False, "data_parallel": "replica"}}}
    assert section_problems(plain, "cpu")[0] == []


# --------------------------------------------------------------------------- the run's length


def test_a_profile_step_the_run_never_reaches_is_refused_before_launch(capsys, monkeypatch, tmp_path):
    from deepspeed.runtime import engine
    assert "self.global_steps == self.flops_profiler_profile_step()" in inspect.getsource(engine)  # equality only
    code, err = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "flops_profiler_profile_step_past_run.json")
    assert code == 2 and err.strip().splitlines()[0].endswith(
        "flops_profiler.profile_step: 10, and the run takes 3 steps (DeepSpeed profiles the step started after "
        "profile_step finished steps, 0 to 2 here), so nothing would be profiled; set it to a number from 0 to 2 (1: "
        "the second step), or run --train.steps=11")
    code, err = _dry_run(capsys, monkeypatch, tmp_path, CONFIGS / "flops_profiler_profile_step_past_run.json",
                         "--train.steps=11")
    assert code == 0, err


# --------------------------------------------------------------------------- deprecated keys, NVMe-only keys


@pytest.mark.parametrize("name, old, keep", [
    ("zero2_cpu_offload_with_offload_block.json", "cpu_offload", "offload_optimizer"),
    ("zero3_cpu_offload_param_with_block.json", "cpu_offload_param", "offload_param"),
    ("zero3_gather_fp16_and_16bit_both.json", "stage3_gather_fp16_weights_on_model_save",
     "stage3_gather_16bit_weights_on_model_save")])
def test_a_deprecated_zero_key_beside_its_replacement_names_the_one_to_remove(name, old, keep):
    import json

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    with pytest.raises(AssertionError, match="Cannot provide deprecated parameter"):
        DeepSpeedZeroConfig(**json.loads((CONFIGS / name).read_text())["zero_optimization"])
    assert _refusals(name) == [
        f"zero_optimization.{old}: the deprecated spelling of {keep}, and the file has both (DeepSpeed rejects them "
        f"together: 'Cannot provide deprecated parameter ... together'); remove {old} and keep {keep}"]


def test_nvme_only_offload_keys_under_cpu_offload_get_a_note():
    summary = check_ds_file(CONFIGS / "zero3_offload_cpu_with_nvme_keys.json", "cpu", 2)
    assert "zero_optimization.offload_optimizer: device \"cpu\" does not use nvme_path (NVMe-only keys" in summary
    assert "zero_optimization.offload_param: device \"cpu\" does not use nvme_path (NVMe-only keys" in summary
    piped = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pipeline_read": True,
                                                                     "pipeline_write": True}}}
    assert section_problems(piped, "cpu")[1][-1] == ("zero_optimization.offload_optimizer: device \"cpu\" does not use "
                                                     "pipeline_read, pipeline_write (NVMe-only keys; DeepSpeed ignores "
                                                     "them)")
