"""Review of sandbox red team 31: the room the audit hook gives a program's folder when there is no tmpfs (no mount
namespace) counted every file the program ever made, removed or not. A tmpfs gives a removed file's room back, so
an honest program that made and removed temporary files (``tempfile.mkstemp`` then ``os.remove``, 40 per call over
three tests: one file at a time) scored 1 with namespaces and 0 without ("OSError: [Errno 28] ... no room left",
at its 65th file). The hook now counts what the folder holds when its count reaches the room; a program that keeps
its files still gets ENOSPC at 64, also when it renames the folder holding them (the walk finds them there). (No room
comes back while a thread of the program's runs, or when a folder cannot be listed: the count stays an upper bound.)
"""
from __future__ import annotations

import dataclasses
import sys

import pytest

from dstrain.rewards.sandbox import MODES, SandboxPool
from tests.unit.test_sandbox_redteam import GOOD, LIMITS, TESTS, still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

TEMPORARY = ("import os, tempfile\ndef f(x):\n    for _ in range(40):\n        fd, p = tempfile.mkstemp()\n"
             "        os.write(fd, b'x')\n        os.close(fd)\n        os.remove(p)\n    return 2 * x + 1\n")
HOARD = ("import errno, os\nblob, n = b'x' * (1 << 20), 0\ntry:\n    while n < 100:\n        os.makedirs('d', "
         "exist_ok=True)\n        with open(f'd/f{n}', 'wb') as fh:\n            fh.write(blob)\n        n += 1\n"
         "        if n % 10 == 0:\n            os.rename('d', f'kept{n}')\nexcept OSError as e:\n"
         "    print('refused', errno.errorcode[e.errno])\nprint('written', n, flush=True)\n" + GOOD)


@pytest.mark.parametrize("mode", MODES)
def test_removed_files_give_their_room_back_without_namespaces(mode):
    limits = dataclasses.replace(LIMITS, mode=mode, namespaces=False, wall_seconds=5.0)
    with SandboxPool(workers=1, limits=limits) as pool:
        r = pool.run(TEMPORARY, [*TESTS, "assert f(3) == 7"])
        assert r.reward() == 1.0, (r.status, r.detail)  # (before: failed, Errno 28, in the second test)
        r = pool.run(HOARD, TESTS)  # files kept, their folder renamed every 10: still 64 at most
        written = int(r.stdout.split("written ")[-1].split()[0])
        assert written == (64 << 20) // limits.file_size_bytes and "refused ENOSPC" in r.stdout, r.stdout[-300:]
        assert r.reward() == 1.0, (r.status, r.detail)
        still_works(pool)
