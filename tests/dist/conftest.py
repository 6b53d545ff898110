import os

import pytest


# Every test in this folder starts real processes; mark them so `-m "not dist"` skips them.
def pytest_collection_modifyitems(items):
    for item in items:
        if os.sep + "dist" + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.dist)


@pytest.fixture(scope="session", autouse=True)
def deepspeed_cpu_ops():
    """Compile DeepSpeed's CPU kernels once before any timed subprocess needs them."""
    from dstrain.runtime import prebuild_cpu_ops
    return prebuild_cpu_ops()


@pytest.fixture(scope="session")
def rank_killed_after_step_3(tmp_path_factory):
    """One 2-rank job (4 steps, a checkpoint every 2) whose rank 0 dies with no clean-up of its own after step 3,
    launched without ``--max-restarts``: ``(master port, completed process)``. Two files read it
    (test_launch_failures: what the survivor says and the shared memory left; test_restart: no restart
    without ``--max-restarts``, although a checkpoint to restart from exists): one launch for both."""
    from dstrain.launcher import find_free_port
    from tests.dist.harness import launch, overrides
    port = find_free_port()
    out = tmp_path_factory.mktemp("killed_after_3") / "run"
    proc = launch([*overrides(out, 4, "--checkpoint.every=2"), "--master-port", str(port)],
                  env={"DSTRAIN_FAULT_AFTER_STEP": "3"}, check=False, timeout=600)
    return port, proc


@pytest.fixture(scope="session")
def gpt_reference(tmp_path_factory):
    """``profile -> run folder``: the uninterrupted 2-rank reference run of the tiny GPT recipe
    (``harness.reference_overrides``: 8 steps, a checkpoint every 2, all kept) with that ZeRO profile, launched
    the first time a test asks for it and shared by the rest (test_reshard and test_restart compare with the
    zero2 one, test_resume_export with the zero3 one, test_zero_equivalence with every profile): one launch where
    there were four. Read-only: a test that writes into a run copies it first (``shutil.copytree``).

    ``gpt_reference(profile, *next_ones)``: also launches the first of ``next_ones`` not yet run beside it
    (independent jobs: on 2 cores their start-ups overlap), for a test that knows the next tests' profiles."""
    from tests.dist.harness import Background, launch_command, reference_overrides
    runs = {}

    def run(profile: str, *next_ones: str):
        missing = list(dict.fromkeys(p for p in (profile, *next_ones) if p not in runs))[:2]
        jobs = {}
        try:
            for name in missing:
                out = tmp_path_factory.mktemp(f"reference_{name}") / "run"
                jobs[name] = out, Background(*launch_command(reference_overrides(out, name), None, 2))
            for name, (out, job) in jobs.items():
                job.result()
                runs[name] = out
        finally:
            for _, job in jobs.values():
                job.stop()
        return runs[profile]
    return run
