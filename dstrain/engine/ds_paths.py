"""Where DeepSpeed's tensorboard and csv monitors write: ``os.path.join(output_path, job_name)``.

DeepSpeed 0.19.8 (monitor/tensorboard.py, monitor/csv_monitor.py) joins the two as written, so a ``job_name``
that is itself a path decides the folder: an absolute one makes ``os.path.join`` drop ``output_path`` (the events go
to that path, wherever output_path points, dstrain's run folder included), ``..`` climbs out of it, and a leading
``~`` is not expanded (a folder named ``~``). dstrain keeps a relative ``output_path`` (or none) inside the run's
folder (factory.user_sections), so a ``job_name`` that climbs out of it writes beside the run folder instead:
neither where DeepSpeed alone would write (relative to the working directory) nor inside the run. wandb and comet
take no folder from the file.

:func:`monitor_path_checks` returns ``(problems, notes)`` for enabled monitors; pure.
"""
from __future__ import annotations

import os

#: The monitors whose log folder is ``os.path.join(output_path, job_name)``, and dstrain's folder for an empty path.
JOINED_MONITORS = {"tensorboard": "ds_tensorboard", "csv_monitor": "ds_csv_monitor"}


def _climbs_out(relative: str) -> bool:
    return os.path.normpath(relative).split(os.sep)[0] == ".."


def monitor_path_checks(cfg: dict) -> tuple[list[str], list[str]]:
    problems: list[str] = []
    notes: list[str] = []
    for section, default in JOINED_MONITORS.items():
        block = cfg.get(section)
        if not isinstance(block, dict) or block.get("enabled") is not True:
            continue
        job, out = block.get("job_name"), block.get("output_path") or ""
        if not isinstance(job, str) or not job or not isinstance(out, str):
            continue  # a job_name that is not text is named by DeepSpeed's pydantic model
        if job.startswith("~"):
            problems.append(f"{section}.job_name: {job!r} starts with '~', which DeepSpeed does not expand "
                            "(os.path.join(output_path, job_name) would make a folder named '~'); write a plain "
                            "name, and the folder as output_path")
        elif os.path.isabs(job):
            notes.append(f"{section}.output_path: unused: job_name {job!r} is an absolute path, so DeepSpeed's "
                         f"os.path.join(output_path, job_name) drops output_path and writes the events to "
                         f"{os.path.normpath(job)}, outside the run's folder")
        elif not os.path.isabs(out) and _climbs_out(os.path.join(out or default, job)):
            where = os.path.normpath(os.path.join(out or default, job))
            problems.append(f"{section}.job_name: {job!r} climbs out of output_path "
                            f"({repr(out) if out else 'not set'}): dstrain keeps a relative output_path inside the "
                            f"run's folder, so DeepSpeed's os.path.join(output_path, job_name) would write the events "
                            f"to <run folder>/{where}, outside the run (and not where DeepSpeed alone would, relative "
                            "to the working directory); write a name without '..', or an absolute output_path")
    return problems, notes
