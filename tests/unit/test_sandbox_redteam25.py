"""Red team, round 25: what round 24's fixed string hash (``-s -P`` and ``PYTHONHASHSEED=0`` instead of ``-I``) lets
a program reach, hash collisions against the judge's own work, and the judge's checks that go by ``id()``.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1, in time. The hole this round closed was
in the judge's trust walk (``_judge.trusted``), which skipped what it had seen by ``id()`` without keeping it alive:
iterating a dict's items view makes a fresh ``(key, value)`` pair per item, the walk let go of a pair once it had
read it, and the next view's pair, made at the freed address (the tuple free list hands it straight back), counted
as seen, so what it held was never looked at. A wrong program returned ``[{'e': E(2**61 + 2)}.items(),
{'z': 0}.items()]`` with ``class E(int): __eq__ = int.__ne__`` (C code: no Python frame for the profile guard) and
scored 1.0 on ``assert f(1) == [{('e', 3)}, {('z', 0)}]`` in both modes. The walk now holds every object it has
seen until it ends.

What did not get past the sandbox, pinned here: start-up files a program plants for a later judging interpreter
(a ``.pth`` or ``sitecustomize.py`` in site-packages or the standard library's folder: refused, and the file
system is read-only where namespaces exist; a ``usercustomize.py`` in the user site lands under HOME, the
program's own folder, which ``-s`` never reads and which goes with it); environment variables a running
interpreter still reads now that ``-E`` is gone (``PYTHONINSPECT`` at exit: every judge leaves with
``os._exit``; ``PYTHONBREAKPOINT``: ``breakpoint()`` imports through the same audited import and calls through
the same hooks); its environment is the launcher's four variables (a program changes only its own
process's); ``sys.path`` has no working folder and no user site. Hash collisions: no dict or set of the judge's,
the fork server's or the trainer's is keyed by what a program chooses (the server reads back bytes and a header
it writes itself), and integers collide whatever the seed (``n * (2**61 - 1)``), so a quadratic dict costs only
the program's own time. Not closed: ``id()``'s high bits differ between runs in spawn mode (ASLR), and a fork
server's jobs after its first get alike addresses (each forks from the same image), so a program that branches
on an address is judged by the luck of the run or of the server's start (the judge's other checks by ``id()``
keep the object or confirm it with ``is``). Disabling ASLR would make addresses alike but weaken the sandbox.
"""
from __future__ import annotations

import os
import site
import sys
import sysconfig
import time

import pytest

from tests.unit.test_sandbox_redteam import GOOD, TESTS, still_works  # noqa: F401
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

C_LEVEL_LIAR = "class E(int):\n    __eq__ = int.__ne__\n    __hash__ = int.__hash__\n"
VIEW_TESTS = ["assert f(1) == [{('e', 3)}, {('z', 0)}]"]


def test_an_items_view_pair_cannot_hide_at_a_freed_address(pool):
    """Before the fix: reward 1.0 in both modes (the second view's pair reused the first's address)."""
    wrong = C_LEVEL_LIAR + "def f(x):\n    return [{'e': E(2**61 + 2)}.items(), {'z': 0}.items()]\n"
    r = scores_zero(pool, "items-view pair at a reused address", wrong, VIEW_TESTS)
    assert "untrusted" in r.detail, r.detail
    many = "def f(x):\n    return [{'e': E(2**61 + 2)}.items()] + [{'z': 0}.items()] * 50\n"
    scores_zero(pool, "after fifty views", C_LEVEL_LIAR + many, ["assert f(1) == [{('e', 3)}] + [{('z', 0)}] * 50"])
    right = "def f(x):\n    return [{'e': 3}.items(), {'z': 0}.items()]\n"  # views of plain values are still trusted
    assert pool.run(right, VIEW_TESTS).reward() == 1.0
    still_works(pool)


MARK = "r25_planted"
PLANT = ("import os, site, sys, sysconfig\n"
         "where = {{'pth': (site.getsitepackages()[0], 'zz_r25.pth'),\n"
         "         'sitecustomize': (site.getsitepackages()[0], 'sitecustomize.py'),\n"
         "         'stdlib pth': (sysconfig.get_paths()['stdlib'], 'zz_r25.pth'),\n"
         "         'usercustomize': (site.getusersitepackages(), 'usercustomize.py')}}\n"
         "folder, name = where[{kind!r}]\n"
         "text = 'import sys; sys.{mark} = 1\\n'\n"
         "try:\n    os.makedirs(folder, exist_ok=True)\nexcept OSError:\n    pass\n"
         "with open(os.path.join(folder, name), 'w') as fh:\n    fh.write(text)\n"
         "def f(x):\n    return 0\n")
CHECK = f"import sys\ndef f(x):\n    return 0 if hasattr(sys, {MARK!r}) else 2 * x + 1\n"


@pytest.mark.parametrize("kind", ["pth", "sitecustomize", "stdlib pth", "usercustomize"])
def test_a_program_cannot_plant_a_start_up_file(pool, kind):
    r = scores_zero(pool, kind, PLANT.format(kind=kind, mark=MARK), TESTS)
    # refused, except the user site: under HOME, the program's own folder (removed after it; ``-s`` never reads it)
    assert r.status == "error" or kind == "usercustomize", (r.status, r.detail)
    # the next judge (the fork server's next child; a fresh interpreter in spawn mode) starts without it
    assert pool.run(CHECK, TESTS).reward() == 1.0
    for folder, name in ((site.getsitepackages()[0], "zz_r25.pth"), (site.getsitepackages()[0], "sitecustomize.py"),
                         (sysconfig.get_paths()["stdlib"], "zz_r25.pth"), (site.getusersitepackages(),
                                                                            "usercustomize.py")):
        path = os.path.join(folder, name)
        assert not (os.path.exists(path) and MARK in open(path, errors="replace").read()), path
    still_works(pool)


START_UP = ("import os, sys\n"
            "def f(x):\n"
            "    return (sys.flags.no_user_site, sys.flags.safe_path, '' in sys.path, os.getcwd() in sys.path,\n"
            "            sorted(os.environ))\n")


def test_the_judging_interpreter_reads_no_folder_or_variable_of_the_program(pool):
    if sys.version_info < (3, 11):
        pytest.skip("before Python 3.11 the judging interpreter keeps -I")
    r = pool.run(START_UP, ["assert f(1) == (1, True, False, False, ['HOME', 'LANG', 'PATH', 'TMPDIR'])"])
    assert r.reward() == 1.0, (r.status, r.detail)


LATE_VARIABLES = {
    "PYTHONINSPECT at exit": "import os\nos.environ['PYTHONINSPECT'] = '1'\ndef f(x):\n    return 0\n",
    "PYTHONINSPECT, then a crash": ("import os\nos.environ['PYTHONINSPECT'] = '1'\ndef f(x):\n"
                                    "    raise SystemExit(0)\n"),
    "PYTHONBREAKPOINT to print": ("import os\nos.environ['PYTHONBREAKPOINT'] = 'builtins.print'\nbreakpoint('x')\n"
                                  "def f(x):\n    return 0\n"),
    "PYTHONBREAKPOINT to os.system": ("import os\nos.environ['PYTHONBREAKPOINT'] = 'os.system'\n"
                                      "breakpoint('true')\ndef f(x):\n    return 2 * x + 1\n"),
    "PYTHONBREAKPOINT to ctypes": ("import os\nos.environ['PYTHONBREAKPOINT'] = 'ctypes.CDLL'\nbreakpoint(None)\n"
                                   "def f(x):\n    return 2 * x + 1\n"),
}


@pytest.mark.parametrize("name", list(LATE_VARIABLES))
def test_variables_read_after_start_up_change_nothing(pool, name):
    start = time.monotonic()
    scores_zero(pool, name, LATE_VARIABLES[name], TESTS)
    assert time.monotonic() - start < 1.5  # no interactive prompt waiting at exit
    r = pool.run("import os\ndef f(x):\n    return 2 * x + 1 if 'PYTHONINSPECT' not in os.environ and "
                 "'PYTHONBREAKPOINT' not in os.environ else 0\n", TESTS)
    assert r.reward() == 1.0, (r.status, r.detail)
    still_works(pool)


def test_colliding_keys_cost_only_the_program_its_time(pool):
    """Integers collide whatever the seed: a quadratic dict runs into the program's own limits, not the next job's."""
    collide = ("def f(x):\n    return 0\nd = {}\nfor i in range(200000):\n    d[i * (2**61 - 1)] = i\n")
    r = scores_zero(pool, "colliding keys", collide, TESTS)
    assert r.status == "timeout", (r.status, r.detail)
    still_works(pool)
