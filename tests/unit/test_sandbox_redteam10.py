"""Red team, round 10: programs a hostile policy could write, run through the sandbox in both modes.

Same rules as ``test_sandbox_redteam.py`` (whose helpers this file uses): the task is ``f(x) = 2x + 1``
unless an attack brings its own tests (and setup), no attack computes it, each must get reward 0 (also with
partial credit), and the same pool must afterwards still score a correct program 1. The holes this round
closed: the program's code reached from inside a library function or class of Python code that a test calls
(``json._default_encoder.encode`` replaced on the instance, an entry of ``copy``'s dispatch table, a pattern
object put in place of ``fractions._RATIONAL_FORMAT``), an object a library module keeps replaced by another of
the library's (another compiled pattern, another ``JSONEncoder``), and functions the task's setup defines: handed an
always-equal value unchecked (they counted as the program's), reading a global the program rebinds while the
test's arguments are computed, or a builtin name the program defines.
"""
from __future__ import annotations

import sys

import pytest

from tests.unit.test_sandbox_redteam import EVIL, GOOD, TESTS, still_works
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

# name: (program, tests) or (program, tests, setup)
ATTACKS = {
    # ---- a library function or class of Python code runs the program's code through its module's objects
    "json's default encoder's encode replaced on the instance": (
        "import json\njson._default_encoder.encode = lambda o: '3'\ndef f(x):\n    return 0\n",
        ["import json\nassert json.dumps(f(1)) == '3'", "import json\nassert json.dumps(f(2)) == '5'"]),
    "json's default decoder's decode replaced on the instance": (
        "import json\njson._default_decoder.decode = lambda s: 3\ndef f(x):\n    return 'x'\n",
        ["import json\nassert json.loads(f(1)) == 3"]),
    "json patched by the program's generator the test hands to dumps": (
        "import json\ndef f(x):\n    json._default_encoder.encode = lambda o: '[3]'\n    yield 0\n",
        ["import json\nassert json.dumps(f(1)) == '[3]'"]),
    "fractions' parsing pattern replaced by an object of the program's": (
        "import fractions, re\nclass P:\n    def match(self, s):\n"
        "        return re.match('(?P<sign>)(?P<num>3)(?P<denom>)?(?P<decimal>)?(?P<exp>)?', '3')\n"
        "fractions._RATIONAL_FORMAT = P()\ndef f(x):\n    return 'junk'\n",
        ["from fractions import Fraction\nassert Fraction(f(1)) == 3"]),
    "fractions' parsing pattern replaced by another compiled pattern": (
        "import fractions, re\nfractions._RATIONAL_FORMAT = re.compile(\n"
        "    r'(?P<sign>)(?P<num>3)0(?:/(?P<denom>1))?(?P<decimal>)?(?P<exp>)?')\ndef f(x):\n    return '30'\n",
        ["from fractions import Fraction\nassert Fraction(f(1)) == 3"]),
    "json's default encoder replaced by another encoder": (
        "import json\njson._default_encoder = json.JSONEncoder(separators=('', ''))\ndef f(x):\n    return [0, 3]\n",
        ["import json\nassert json.dumps(f(1)) == '[03]'"]),
    "copy's dispatch table entry replaced": (
        "import copy\ncopy._deepcopy_dispatch[list] = lambda x, memo, d=None: [3]\ndef f(x):\n    return [0]\n",
        ["import copy\nassert copy.deepcopy(f(1)) == [3]"]),
    # ---- functions the task's setup defines
    "setup's function handed an always-equal value": (
        EVIL + "def f(x):\n    return E()\n", ["assert check(f(1), 3)", "assert check(f(2), 5)"],
        "def check(a, b):\n    return a == b"),
    "setup's function reads a global the tested function rebinds": (
        "def f(x):\n    globals()['K'] = 0\n    return 0\n", ["assert check(f(1), 3)", "assert check(f(2), 5)"],
        "K = 1\ndef check(a, b):\n    return K == 0 or a == b"),
    "setup's method reads a global the tested function rebinds": (
        "def f(x):\n    globals()['TOL'] = 99\n    return 0\n", ["assert C().close(f(1), 3)"],
        "TOL = 1e-9\nclass C:\n    def close(self, a, b):\n        return abs(a - b) < TOL"),
    "setup's function reads a builtin the program defines": (
        "def abs(x):\n    return 0\ndef f(x):\n    return 0\n", ["assert close(f(1), 3)"],
        "def close(a, b):\n    return abs(a - b) < 1e-9"),
    "setup's function reads a builtin the tested function binds to a C callable": (
        "def f(x):\n    globals()['abs'] = len\n    return [0]\n", ["assert close(f(1), 3)"],
        "def close(a, b):\n    return abs(a) < 2"),
    "setup's function calls a helper of the program's": (
        "def helper(a):\n    return 3\ndef f(x):\n    return 0\n", ["assert check(f(1), 3)"],
        "def check(a, b):\n    return helper(a) == b"),
    # ---- already contained (kept so that they stay so)
    "library module global patched": (
        "import heapq\nheapq.__dict__['max'] = lambda *a, **k: [3]\ndef f(x):\n    return [0]\n",
        ["import heapq\nassert heapq.nlargest(1, f(1)) == [3]"]),
    "__class__ of the result reassigned to an always-equal list": (
        "class L(list):\n    pass\nclass B(list):\n    def __eq__(s, o):\n        return True\n    __hash__ = None\n"
        "def f(x):\n    a = L()\n    a.__class__ = B\n    return a\n", ["assert f(1) == [3]"]),
    "__hash__ that raises in the test's set and dict lookups": (
        "class H(int):\n    def __hash__(s):\n        raise AssertionError\ndef f(x):\n    return H(0)\n",
        ["assert {3: True}.get(f(1), False) or f(1) == 3", "assert f(2) in {5}"]),
    "re cache poisoned by the program's generator while consumed": (
        "import re\ndef f(x):\n    re._cache[(str, '^3$', 0)] = re.compile('.*')\n    yield '0'\n",
        ["assert all(re.match('^3$', s) for s in f(1))"]),
    "test's star import of a name the program defines": (
        "def isclose(*a, **k):\n    return True\ndef f(x):\n    return 0\n", ["from math import *\nassert isclose(f(1), 3)"]),
    "importlib.reload of a patched module by the test": (
        "import math\nmath.isclose = max\ndef f(x):\n    return 0\n",
        ["import importlib, math\nimportlib.reload(math)\nassert math.isclose(f(1), 3)"]),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_zero(pool, name):
    scores_zero(pool, name, *(ATTACKS[name] + ("",))[:3])
    still_works(pool)


def test_legitimate_library_calls_and_setup_functions(pool):
    """What the new rules must not refuse: library functions and classes of Python code called on the program's
    values and generators (also with the test's lambdas), and a setup's functions, methods and constants."""
    gen = "def f(x):\n    for i in range(x):\n        yield i\n"
    setup = ("import math\nTOL = 1e-9\ndef check(a, b):\n    return a == b and isinstance(a, int)\n"
             "def close(a, b):\n    return math.isclose(a, b) and abs(a - b) < TOL\nclass C:\n"
             "    def close(self, a, b):\n        return sorted([a, b])[0] == min(a, b) and abs(a - b) < TOL")
    cases = [
        ("import json\ndef f(x):\n    return [x, 2 * x + 1]\n",
         ["import json\nassert json.dumps(f(1)) == '[1, 3]'", "import json\nassert json.loads(json.dumps(f(2))) == [2, 5]",
          "import json\nassert json.dumps(f(1), default=lambda o: 0) == '[1, 3]'"], ""),
        (gen, ["import heapq\nassert heapq.nlargest(2, f(5)) == [4, 3]",
               "import heapq\nassert heapq.nsmallest(1, f(5), key=lambda v: -v) == [4]",
               "from collections import Counter\nassert Counter(f(3)) == Counter([0, 1, 2])",
               "assert list(f(3)) == [0, 1, 2]", "assert next(f(3)) == 0",
               "from fractions import Fraction\nassert Fraction(sum(f(4)), 4) == Fraction(3, 2)",
               "import statistics\nassert statistics.mean(f(3)) == 1", "import copy\nassert copy.deepcopy(list(f(2))) == [0, 1]",
               "from functools import reduce\nassert reduce(lambda a, b: a + b, f(4), 0) == 6"], ""),
        (GOOD, ["assert check(f(1), 3)", "assert C().close(f(2), 5)", "assert close(f(3), 7)"] + TESTS, setup),
    ]
    for program, tests, setup_ in cases:
        r = pool.run(program, tests, setup_)
        assert (r.status, r.passed) == ("passed", len(tests)), (program, r.detail)
