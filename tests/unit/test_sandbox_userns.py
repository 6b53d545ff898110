"""An unprivileged trainer's sandbox: the user namespace it falls back to must map the
trainer's own ids, or the program's folder (a tmpfs mounted inside) takes no files and
every program fails (EOVERFLOW). Checked in a child process, as the launch stage does it."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import ctypes, os, sys, tempfile
    sys.path.insert(0, sys.argv[1])
    from dstrain.rewards import _child
    folder = tempfile.mkdtemp()
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_child.CLONE_NEWUSER) != 0:
        print("no user namespaces"); sys.exit(0)
    if sys.argv[2] == "map":
        _child._map_own_ids(uid, gid)
    print("ids", os.geteuid() == uid and os.getegid() == gid)
    if libc.unshare(_child.CLONE_NEWNS) != 0 or libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"size=1M") != 0:
        print("no mount namespace"); sys.exit(0)
    try:
        os.mkdir(os.path.join(folder, "job1"))
        print("mkdir ok")
    except OSError as e:
        print("mkdir", e.errno)
""")


def _run(how: str) -> str:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), how], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux namespaces")
def test_the_user_namespace_maps_the_trainer_ids_so_the_program_folder_takes_files():
    out = _run("map")
    if "no user namespaces" in out or "no mount namespace" in out:
        pytest.skip(f"this kernel or container allows no {out.strip()[3:]}")
    assert "ids True" in out and "mkdir ok" in out, out
    assert "mkdir ok" not in _run("unmapped")  # what the launch stage hit before the mapping
