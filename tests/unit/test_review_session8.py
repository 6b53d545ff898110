"""Second review of twelve changes (faults rounds 9/10, reference rounds 13-15, DeepSpeed config rounds 22/23,
newcomer audit 10, bench tp/sp layout, HF round 7, sandbox round 29, GPU readiness 3).

Wrong, and fixed:

- ``--max-restarts`` stopping on a repeated error (faults round 9, ``supervise.run_with_restarts``): two attempts
  that ended with the same error line at the same step stopped the restarts, also for an error of the job's
  environment that prints the same line every time: a full disk the user is clearing (``OSError: [Errno 28] No
  space left on device`` while writing a log or a cache, torch's ``file write failed``), a collective or store
  timeout with a fixed text, a dropped connection, an NCCL/gloo communicator error. The restart that would have
  succeeded was refused ("a deterministic error"). Such an error (``supervise.TRANSIENT``) is now restarted as
  before the change; a deterministic one (a shape mismatch, a CUDA OOM's request) still stops at the second.
- the unshared-output.dir refusal (faults round 10, ``shared_folder.problem``) for ranks on rank 0's own host (a
  1-host job whose ranks started in different working directories with a relative output.dir): the refusal is
  right (they would write two folders), but it told the user to use a file system every host mounts (NFS,
  Lustre). It now adds that those ranks resolve output.dir to another folder, says when output.dir is relative,
  and to start every rank in one directory or give an absolute path.

Left as it is, for the lead: ``SandboxPool.run_many``'s batch budget (round 29) is ``2 x wall`` plus 0.5 s per
round of ``workers`` jobs; an honest program slower than about that per round (a CPU-heavy test on a loaded
machine: 64 jobs on 4 workers at 5 s wall get 18 s, so jobs of 1.2 s each run out in the last round) starts late
with 0.5 s and times out, reward 0 by its place in the batch. Telling sleepers from slow honest programs needs
their CPU time, which the pool does not report.

Checked and found fine (no change):

- sandbox round 29's renaming of a test's locals (``_rewrite._fresh_locals``): ``f'{x=}'``/``f'{x = }'`` keep
  the name's text (the parser splits the ``x=`` into a constant before renaming); ``del``, a class body reading a
  renamed name, a nested function closing over one, ``[x for x in x]`` and a for/augmented-assign loop compile to
  the same behaviour; ``global``/``nonlocal``, keyword arguments, a class body's own binding and an ``except ...
  as`` keep their names; ``eval``/``exec``/``locals()``/``vars()`` of a name were refused by the sandbox before
  the change (PermissionError), so renaming changes no honest test's result there; the failed-assert flag
  (``_failed_asserts``) leaves a test raising another exception as it was;
- the shared-folder check (``shared_folder.problem``): ranks of one host see rank 0's marker at the first look
  (no wait), a symlinked output.dir is followed, a marker rank 0 cannot write skips the check on every rank (the
  broadcast name is None), and an ``error``/``stopped`` decision never reaches the collective on any rank;
- ``LineProgress``: its first line (``train: 0/N steps``) is written at construction as tqdm's was, so
  ``tests/dist/test_main_job.py``'s wait for ``train:`` still holds; nothing else parses the bar;
- GRPO's horizon is stretched only in ``plan_engine``, which a resume re-plans from the profile's template (not
  from the saved, stretched ds_config), so never twice; ``updates_per_step`` is 1 for SCoRe and the others;
- LM evaluation: every rank of a replica (tp/sp) takes the windows of its dp rank; the world all-reduce of
  (loss x windows, windows) counts each replica's copies in both sums, so the mean is unchanged;
- modules touched stay under 600 lines.
"""
from __future__ import annotations

import pytest

from dstrain import supervise


def _run(errors, monkeypatch, restarts=3):
    monkeypatch.setattr(supervise.time, "sleep", lambda s: None)
    calls, logs = [], []

    def attempt(resume):
        calls.append(resume)
        return 1

    code = supervise.run_with_restarts(attempt, restarts, logs.append, error=lambda: errors[len(calls) - 1])
    return code, calls, logs


@pytest.mark.parametrize("line", [
    "OSError: [Errno 28] No space left on device: 'run/metrics.jsonl' (in log of step 40)",
    "RuntimeError: [enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file data/3: "
    "file write failed (in save of step 100)",
    "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (in backward of step 7)",
    "RuntimeError: Timed out waiting for the store (in forward of step 12)",
    "ConnectionResetError: [Errno 104] Connection reset by peer (in data of step 3)",
])
def test_an_environment_error_repeated_at_the_same_step_is_still_restarted(monkeypatch, line):
    code, calls, logs = _run([line] * 4, monkeypatch)
    assert code == 1 and calls == [False, True, True, True]
    assert logs[-1].endswith("after 3 restart(s); giving up") and not any("same error" in x for x in logs)


@pytest.mark.parametrize("line", [
    "RuntimeError: shape mismatch (in forward of step 150)",
    "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. (in backward of step 9)",
])
def test_a_deterministic_error_still_stops_at_the_second_attempt(monkeypatch, line):
    code, calls, logs = _run([line] * 4, monkeypatch)
    assert code == 1 and calls == [False, True]
    assert "failed again with the same error at the same point" in logs[-1]


def test_an_unshared_output_dir_on_rank_0s_own_host_names_the_working_directory(tmp_path, monkeypatch):
    """A 1-host job whose rank 1 started in another working directory, output.dir relative: the refusal told the
    user to put output.dir on a file system every host mounts (NFS, Lustre), which a single host already has; it
    now says the ranks resolve it to another folder and to start them in one directory or give an absolute path."""
    from pathlib import Path

    from dstrain import shared_folder
    monkeypatch.setattr(shared_folder, "_host", lambda: "node1")
    monkeypatch.chdir(tmp_path)
    Path("run").mkdir()
    name = shared_folder.write_marker(Path("run"))
    every = [("node1", True), ("node1", False)]  # rank 1, same host, looked in another folder
    text = shared_folder.problem(Path("run"), name, True, gather=lambda mine: every, wait_s=0.0)
    assert text is not None and "(rank 1)" in text and not (tmp_path / "run" / name).exists()
    assert "rank 0's own host" in text and "run is relative" in text and "absolute path" in text
    # hosts that do not share it: no such note
    other = shared_folder.problem(Path("run"), shared_folder.write_marker(Path("run")), True,
                                  gather=lambda mine: [("node1", True), ("node2", False)], wait_s=0.0)
    assert other is not None and "node2" in other and "own host" not in other
