"""Failed launches leave nothing behind: refused before launch, or crashed and killed after the ranks started.

A refusal is one message naming every problem, exit 2, nothing started or written. After the ranks started, the
first rank to fail reports once (the others' collateral gloo errors stay quiet; a rank killed outright reports
nothing, and its survivor says in one line that it lost contact with the job), and the
ranks' shared-memory allreduce buffers in /dev/shm are gone when ``dstrain launch`` returns.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from dstrain.launcher import find_free_port
from tests.dist.harness import launch, overrides

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def shm_buffers(port: int) -> list[str]:
    """This user's DeepSpeed CPU allreduce buffers of the job on ``port``."""
    return glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")


def test_refused_before_launch_starts_and_writes_nothing(tmp_path):
    port = find_free_port()
    before = shm_buffers(port)
    out = tmp_path / "run"
    proc = launch([*overrides(out, 3), f"--deepspeed.profile={CONFIGS / 'megatron_gpt_fp16_zero1.json'}",
                   "--master-port", str(port)], check=False, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()  # every problem at once: the fp16 one and the run's disagreements
    assert lines[0].startswith("dstrain: error: ") and "megatron_gpt_fp16_zero1.json: " in lines[0]
    assert any(line.startswith("  - fp16.enabled: fp16 does not run on the CPU") for line in lines[1:]), lines
    assert not out.exists()
    assert shm_buffers(port) == before == []


def test_crash_inside_ranks_is_reported_once_and_releases_shared_memory(tmp_path):
    port = find_free_port()  # rank 0 raises an unexpected error after step 1, rank 1 waits in a collective
    proc = launch([*overrides(tmp_path / "run", 3), "--master-port", str(port)],
                  env={"DSTRAIN_FAULT_RAISE_STEP": "1"}, check=False, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "deepspeed_shm_comm_op built successfully" in text  # the buffers existed
    assert text.count("Traceback") == 1, text[-6000:]  # rank 0's, not rank 1's collateral gloo error
    assert "DSTRAIN_FAULT_RAISE_STEP=1" in text
    assert "Connection closed" not in text and "Connection reset" not in text
    assert shm_buffers(port) == []


def test_killed_rank_releases_shared_memory(rank_killed_after_step_3):
    port, proc = rank_killed_after_step_3  # (tests/dist/conftest.py: one job, also read by test_restart.py)
    assert proc.returncode != 0  # rank 0 died without any clean-up of its own (os._exit)
    text = proc.stdout + proc.stderr
    assert "deepspeed_shm_comm_op built successfully" in text
    # its survivor says so in one line, not with gloo's "Connection closed by peer" traceback
    assert "Traceback" not in text and "dstrain: rank 1 lost contact with the job" in text, text[-4000:]
    assert shm_buffers(port) == []


def test_bad_corpus_after_start_is_one_line_from_every_rank(tmp_path):
    """A corpus rank 0 cannot read (found once the ranks run): its verdict is shared, every rank stops
    with the same config error, one line is printed, and no traceback. (A missing file or another file type is
    refused before the launch; JSON lines without a 'text' field are found only when rank 0 reads them.)"""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join('{"content": "def f(x):\\n    return x"}\n' for _ in range(50)))
    port = find_free_port()
    proc = launch([*overrides(tmp_path / "run", 3), f"--data.corpus={corpus}", "--master-port", str(port)],
                  check=False, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in text, text[-6000:]
    errors = [line for line in text.splitlines() if line.startswith("dstrain: error:")]
    assert len(errors) == 1 and "data.corpus: corpus file" in errors[0] and "has no 'text' field" in errors[0], errors
    assert shm_buffers(port) == []
