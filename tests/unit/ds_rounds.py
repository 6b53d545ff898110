"""What the real-world DeepSpeed-config rounds from 13 on share: where the files are, the refusals of one file,
a dry-run launch with a file as the profile, and DeepSpeed's own parse of a block (to pin what DeepSpeed does)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dstrain import cli
from dstrain.engine.ds_check import check_ds_file
from dstrain.engine.ds_config import DSConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ROOT = CONFIGS.parents[1]
RECIPE = str(ROOT / "models" / "gpt" / "recipes" / "tiny.json")


def refusals(path, device_type: str = "cpu") -> list[str]:
    """The problems ``check_ds_file`` refuses ``path`` with (it must refuse it), for 2 ranks on ``device_type``."""
    with pytest.raises(DSConfigError) as err:
        check_ds_file(path, device_type=device_type, world_size=2)
    return err.value.problems


def dry_run(capsys, monkeypatch, tmp_path, profile, *extra, values_from_file: bool = True) -> tuple[int, list[str]]:
    """``dstrain launch --dry-run`` of tiny.json on 2 CPU ranks with ``profile`` (a file): exit status, stderr lines."""
    monkeypatch.chdir(tmp_path)
    own = ["--deepspeed.values_from_file=true"] if values_from_file else []
    code = cli.main(["launch", "--dry-run", "--nproc", "2", "--accelerator", "cpu", RECIPE,
                     f"--deepspeed.profile={profile}", "--train.steps=3", *own, f"--output.dir={tmp_path / 'run'}",
                     *extra])
    return code, capsys.readouterr().err.strip().splitlines()


def deepspeed_config(cfg: dict):
    """DeepSpeed's own parse of ``cfg`` beside a minimal batch (what DeepSpeed itself makes of a block)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    return DeepSpeedConfig({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, **cfg})
