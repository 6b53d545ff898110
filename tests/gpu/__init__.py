import os


def child_env(extra: dict | None = None) -> dict:
    """The environment of a run a GPU test launches: this process's without ``DS_ACCELERATOR`` (a
    CPU-only setting would send the run to the CPU, gloo and a CPU plan), output unbuffered."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    return {**env, "PYTHONUNBUFFERED": "1", **(extra or {})}
