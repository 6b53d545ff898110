"""Fixtures shared by the unit tests."""
import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture
def sandbox_tmp():
    """An empty folder that sandboxed programs can reach: run as root with an interpreter ``nobody``
    may execute, they run as ``nobody``, and pytest's ``tmp_path`` lies under a folder only root enters."""
    path = tempfile.mkdtemp(prefix="dstrain-test-", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.chmod(path, 0o711)
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)
