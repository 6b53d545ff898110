"""Restart policy of ``dstrain launch --max-restarts``, with scripted attempts."""
import pytest

from dstrain.supervise import run_with_restarts


def _script(codes):
    calls = []

    def attempt(resume):
        calls.append(resume)
        return codes[len(calls) - 1]
    return attempt, calls


@pytest.mark.parametrize("codes, k, final, resumes", [
    ([0], 3, 0, [False]),                          # success: once
    ([17, 0], 3, 0, [False, True]),                # a crash, then a resumed run that finishes
    ([17, 17, 17, 17], 2, 17, [False, True, True]),  # gives up after K restarts
    ([2], 3, 2, [False]),                          # a config refusal fails the same way again
    ([130], 3, 130, [False]),                      # Ctrl-C is the user's wish
    ([138], 3, 138, [False]),                      # a rank stopped on SIGUSR1 (saved): the sender decides
    ([3], 3, 3, [False]),                          # stopped on a non-finite loss: it would meet it again
    ([4], 3, 4, [False]),                          # a checkpoint the disk could not hold: so would a retry
    ([124, 0], 3, 0, [False, True]),               # the hang watchdog ended a rank: restarted
    ([17], 0, 17, [False]),                        # K = 0: no restart
])
def test_restart_policy(codes, k, final, resumes):
    attempt, calls = _script(codes)
    lines = []
    assert run_with_restarts(attempt, k, lines.append, lambda: "step_00000004", pause=0) == final
    assert calls == resumes
    assert sum("restart" in line and "from checkpoint step_00000004" in line for line in lines) == len(resumes) - 1
    with pytest.raises(ValueError):
        run_with_restarts(attempt, -1, lines.append)
