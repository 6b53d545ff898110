"""Checkpoint bookkeeping: only complete checkpoints count; pruning; RNG round trip."""
import json
import random

import pytest
import torch

from dstrain import checkpoint as ckpt


def fake_save(root, step, complete=True, keep=10):
    tag = ckpt.tag_for(step)
    (root / tag).mkdir(parents=True)
    (root / tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
    if complete:
        ckpt.mark_complete(root, tag, {"model": {}}, {"zero_optimization": {"stage": 0}},
                           {"step": step, "world_size": 2}, keep=keep)
    return tag


def test_incomplete_checkpoint_never_latest(tmp_path):
    assert ckpt.find_latest(tmp_path) is None
    fake_save(tmp_path, 100)
    fake_save(tmp_path, 200, complete=False)  # died while writing
    assert ckpt.find_latest(tmp_path) == "step_00000100"
    # even if the `latest` pointer were made to name it
    (tmp_path / "latest").write_text("step_00000200\n")
    assert ckpt.find_latest(tmp_path) == "step_00000100"


def test_prepare_removes_only_incomplete(tmp_path):
    fake_save(tmp_path, 100)
    fake_save(tmp_path, 200, complete=False)
    ckpt.prepare_tag_dir(tmp_path, "step_00000200")
    ckpt.prepare_tag_dir(tmp_path, "step_00000100")
    assert not (tmp_path / "step_00000200").exists()
    assert ckpt.is_complete(tmp_path / "step_00000100")


def test_mark_complete_writes_metadata_and_prunes(tmp_path):
    for step in (1, 2, 3, 4):
        fake_save(tmp_path, step, keep=2)
    assert ckpt.complete_tags(tmp_path) == ["step_00000003", "step_00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000004"
    tag_dir = tmp_path / "step_00000004"
    assert json.loads((tag_dir / "trainer_state.json").read_text())["step"] == 4
    assert (tag_dir / "run_config.json").is_file() and (tag_dir / "ds_config.json").is_file()


def test_resolve_checkpoint_accepts_output_root_or_tag(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    fake_save(root, 5)
    assert ckpt.resolve_checkpoint(tmp_path / "run") == (root, "step_00000005")
    assert ckpt.resolve_checkpoint(root) == (root, "step_00000005")
    assert ckpt.resolve_checkpoint(root / "step_00000005") == (root, "step_00000005")
    fake_save(root, 6, complete=False)
    with pytest.raises(ValueError, match="incomplete"):
        ckpt.resolve_checkpoint(root / "step_00000006")
    with pytest.raises(FileNotFoundError):
        ckpt.resolve_checkpoint(tmp_path / "nothing")


def test_export_cli_reports_missing_checkpoint(tmp_path, capsys):
    from dstrain.cli import main
    assert main(["export", str(tmp_path), str(tmp_path / "w.safetensors")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_rng_round_trip(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    torch.manual_seed(3)
    random.seed(3)
    ckpt.save_rng(tmp_path, "step_00000001", rank=1)
    expected = (torch.rand(3), random.random())
    torch.rand(5)
    ckpt.load_rng(tmp_path, "step_00000001", rank=1)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    with pytest.raises(FileNotFoundError, match="rank 0"):
        ckpt.load_rng(tmp_path, "step_00000001", rank=0)


# ---------------------------------------------------------------- asynchronous writes and resharding

def test_host_snapshot_is_independent_of_live_tensors():
    from dstrain.async_checkpoint import to_host
    live = {"w": torch.ones(3), "groups": [{"step": torch.tensor(2.0), "lr": 0.1}], "pair": (torch.zeros(2), "x")}
    snap = to_host(live)
    live["w"].add_(5)
    live["groups"][0]["step"].add_(1)
    live["pair"][0].fill_(7)
    assert torch.equal(snap["w"], torch.ones(3)) and float(snap["groups"][0]["step"]) == 2.0
    assert torch.equal(snap["pair"][0], torch.zeros(2)) and snap["pair"][1] == "x" and snap["groups"][0]["lr"] == 0.1


def test_write_file_is_all_or_nothing(tmp_path, monkeypatch):
    from dstrain import async_checkpoint
    path = tmp_path / "state.pt"
    async_checkpoint.write_file({"a": torch.arange(4)}, path)
    assert torch.equal(torch.load(path)["a"], torch.arange(4))

    def dies(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(async_checkpoint.torch, "save", dies)
    with pytest.raises(OSError):
        async_checkpoint.write_file({"a": torch.zeros(4)}, path)
    assert torch.equal(torch.load(path)["a"], torch.arange(4))  # the old file is untouched


def test_markers_wait_for_every_rank(tmp_path):
    from dstrain.async_checkpoint import wait_for_markers
    folder = tmp_path / "written"
    folder.mkdir()
    (folder / "rank_00000").touch()
    with pytest.raises(TimeoutError, match="missing rank_00001"):
        wait_for_markers(folder, 2, timeout_s=0.1)
    (folder / "rank_00001").touch()
    wait_for_markers(folder, 2, timeout_s=0.1)


def test_reshard_refuses_a_changed_model_parallel_layout():
    from dstrain.reshard import ReshardError, check_layout
    check_layout({"parallel": {"tp": 1, "sp": 1}}, {"tp": 1, "sp": 1, "pp": 1}, "step_00000002")
    with pytest.raises(ReshardError, match="written with tp=2 sp=1 pp=1, this run has tp=1 sp=1 pp=1"):
        check_layout({"parallel": {"tp": 2}}, {"tp": 1, "sp": 1, "pp": 1}, "step_00000002")


@pytest.mark.parametrize("split", [(2, 4, 1), (2, 2, 2), (2, 1, 4), (1, 1, 8)])
def test_sampler_gives_the_same_global_batch_on_any_world_size(split):
    from dstrain.data.sampler import WindowSampler
    micro, accum, world = split
    sampler = WindowSampler(10_000, 16, seed=3)
    for step in (0, 5, 77):
        taken = torch.cat([sampler.local_batch_indices(step, micro, accum, r, world).flatten()
                           for r in range(world)])
        assert sorted(taken.tolist()) == sorted(sampler.global_indices(step, 8).tolist())


class _FakeCuda:
    """torch.cuda's RNG calls for a rank on ``device`` of a launch that shows ``count`` GPUs."""

    def __init__(self, count: int, device: int):
        self.count, self.device, self.states = count, device, {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # GPU ranks (CPU ranks keep no CUDA generator)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.device)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.device].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [self.states[i].clone() for i in range(self.count)])

        def set_state(state, device="cuda"):
            self.states[self.device] = state.clone()

        def set_all(states):  # torch's: one state per index; an index past the visible devices fails
            for i, state in enumerate(states):
                if i >= self.count:
                    raise IndexError("list index out of range")
                self.states[i] = state.clone()
        monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)


def test_cuda_rng_of_this_rank_only_so_fewer_gpus_can_resume(monkeypatch):
    """Saved on local rank 5 of an 8-GPU launch, restored on local rank 1 of a 4-GPU one (a resharded resume):
    this rank's device state goes to this rank's device; restoring all eight would fail."""
    saver = _FakeCuda(8, 5)
    saver.states[5] = torch.tensor([55], dtype=torch.uint8)
    saver.install(monkeypatch)
    state = ckpt.rng_state()
    assert torch.equal(state["cuda_device"], torch.tensor([55], dtype=torch.uint8)) and "cuda" not in state
    loader = _FakeCuda(4, 1)
    loader.install(monkeypatch)
    ckpt.set_rng_state(state)
    assert torch.equal(loader.states[1], torch.tensor([55], dtype=torch.uint8))
    old = {**state, "cuda": [torch.tensor([i + 100], dtype=torch.uint8) for i in range(8)]}
    del old["cuda_device"]  # a checkpoint written before: every visible device's state
    ckpt.set_rng_state(old)
    assert torch.equal(loader.states[1], torch.tensor([101], dtype=torch.uint8))
    _FakeCuda(1, 3).install(monkeypatch)
    ckpt.set_rng_state({**old, "cuda": old["cuda"][:2]})  # nothing saved for this device: left as it is
