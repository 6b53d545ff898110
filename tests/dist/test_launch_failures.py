"""Failed launches leave nothing behind: refused before launch, or crashed and killed after the ranks started.

A refusal is one message naming every problem, exit 2, nothing started or written. After the ranks started, the
first rank to fail reports once (the others' collateral gloo errors stay quiet; a rank killed outright reports
nothing, and its survivor says in one line that it lost contact with the job), and the
ranks' shared-memory allreduce buffers in /dev/shm are gone when ``dstrain launch`` returns.
"""
from __future__ import annotations

import contextlib
import glob
import os
from pathlib import Path

import pytest

from dstrain.launcher import find_free_port
from tests.dist.harness import beside, launch, overrides

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


@pytest.fixture(scope="module")
def failed_after_start(tmp_path_factory):
    """``name -> (master port, completed process)`` of the two jobs below that fail once their ranks run, launched
    side by side (independent jobs, each on its own port: on 2 cores their start-ups overlap): ``crash``, where
    rank 0 raises an unexpected error after step 1 while rank 1 waits in a collective, and ``bad_corpus``, a
    corpus rank 0 cannot read (JSON lines without a 'text' field)."""
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    corpus.write_text("".join('{"content": "def f(x):\\n    return x"}\n' for _ in range(50)))
    jobs = {}
    with contextlib.ExitStack() as stack:
        for name, extra, env in (("crash", (), {"DSTRAIN_FAULT_RAISE_STEP": "1"}),
                                 ("bad_corpus", (f"--data.corpus={corpus}",), None)):
            port = find_free_port()
            out = tmp_path_factory.mktemp(name) / "run"
            jobs[name] = port, stack.enter_context(beside([*overrides(out, 3), *extra, "--master-port", str(port)],
                                                          env=env))
    return {name: (port, job.result(timeout=600, check=False)) for name, (port, job) in jobs.items()}


def test_crash_inside_ranks_is_reported_once_and_releases_shared_memory(failed_after_start):
    port, proc = failed_after_start["crash"]  # rank 0 raised after step 1, rank 1 waited in a collective
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


def test_bad_corpus_after_start_is_one_line_from_every_rank(failed_after_start):
    """A corpus rank 0 cannot read (found once the ranks run): its verdict is shared, every rank stops
    with the same config error, one line is printed, and no traceback. (A missing file or another file type is
    refused before the launch; JSON lines without a 'text' field are found only when rank 0 reads them.)"""
    port, proc = failed_after_start["bad_corpus"]
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in text, text[-6000:]
    errors = [line for line in text.splitlines() if line.startswith("dstrain: error:")]
    assert len(errors) == 1 and "data.corpus: corpus file" in errors[0] and "has no 'text' field" in errors[0], errors
    assert shm_buffers(port) == []
