"""Red team, round 9: programs a hostile policy could write, run through the sandbox in both modes.

Same rules as ``test_sandbox_redteam.py`` (whose helpers this file uses): the task is ``f(x) = 2x + 1``
unless an attack brings its own tests (and setup), no attack computes it, each must get reward 0 (also with
partial credit), leave nothing outside its folder, and the same pool must afterwards still score a correct
program 1. The holes this round closed: names the task's setup binds (``from math import isclose``) rebound by
the program, its ``__builtins__`` (whose ``__import__`` the setup's imports and a test's ``class`` statement
used), a key of the program's globals whose ``__eq__`` answers for a name, a global of the program's hidden while
the judge decided that the test names none (so that the program's ``set`` or ``abs`` judged it), two builtin
names the program defines at once, a test's own imports (of what the program left in ``sys.modules`` or patched
in a module), and entries planted in ``re``'s pattern cache.
"""
from __future__ import annotations

import os
import sys
import textwrap

import pytest

from tests.unit.test_sandbox_redteam import GOOD, TESTS, still_works
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

ISCLOSE = ["assert isclose(f(1), 3)", "assert isclose(f(2), 5)", "assert isclose(f(3), 7)"]
# a key of the program's globals with the hash of ``name``: a lookup of ``name`` calls its __eq__, which stores
# ``value`` under the key and says yes, so the lookup answers ``value``
KEY = ("G = globals()\nBUSY = []\nclass K:\n    def __init__(self, name, value):\n"
       "        self.h, self.name, self.value = hash(name), name, value\n    def __hash__(self):\n        return self.h\n"
       "    def __eq__(self, other):\n        if type(other) is str and other == self.name and not BUSY:\n"
       "            BUSY.append(1)\n            try:\n                dict.__setitem__(G, self, self.value)\n"
       "            finally:\n                BUSY.pop()\n            return True\n        return False\n")
# ``f`` leaves the globals while the judge looks at them, and comes back when the test looks it up
LAZY = ("H = hash('f')\nst = {'busy': False, 'armed': False}\nG = globals()\nclass K:\n    def __hash__(self):\n"
        "        return H\n    def __eq__(self, other):\n"
        "        if st['armed'] and not st['busy'] and type(other) is str and other == 'f':\n"
        "            st['busy'] = True\n            try:\n                if dict.__contains__(G, 'f'):\n"
        "                    st['f'] = dict.pop(G, 'f')\n                else:\n"
        "                    dict.__setitem__(G, 'f', st['f'])\n            finally:\n                st['busy'] = False\n"
        "        return False\nG[K()] = 0\ndef f(x):\n    return 0\ndef set(*a):\n    return 0\ndef abs(x):\n"
        "    return 0\nst['armed'] = True\n")
# the judge's own sys.setprofile calls are let through for its thread: a RecursionError must not leave it so
QUIET = ("import sys\nst = {'n': 0}\ndef room():\n    n = [0]\n    def r():\n        n[0] += 1\n        r()\n"
         "    try:\n        r()\n    except RecursionError:\n        pass\n    return n[0]\n"
         "def cb(frame, event, arg):\n    g = frame.f_globals\n    if '_make_guards' in g:\n"
         "        g['_make_guards'] = lambda *a: (lambda v: True, lambda fn, *x, **k: fn(*x, **k),\n"
         "                                        lambda n, m=False: 0, getattr, lambda op, x, y: True)\n"
         "def f(x):\n    st['n'] += 1\n    if st['n'] == 1:\n"
         "        sys.setrecursionlimit(sys.getrecursionlimit() - room() + DEPTH)\n        return 0\n"
         "    sys.setrecursionlimit(1000)\n    if st['n'] == 2:\n        sys.setprofile(cb)\n    return 0\n")
QUIET_TESTS = ["assert f(1) == 3", "assert f(2) == 5", "assert f(3) == 7", "assert f(4) == 9"]

# name: program, (program, tests) or (program, tests, setup); {secret_file} is filled in
ATTACKS = {
    # ---- names the setup binds: the program rebinds them, or hands the setup's imports a fake
    "setup-imported function rebound by the tested function": (
        "def f(x):\n    globals()['isclose'] = max\n    return 0\n", ISCLOSE, "from math import isclose"),
    "__builtins__ replaced so that the setup's import gets a fake": (
        "import builtins, types\nreal = builtins.__import__\ndef fake(name, *a, **k):\n"
        "    return types.SimpleNamespace(isclose=max) if name == 'math' else real(name, *a, **k)\n"
        "__builtins__ = dict(vars(builtins), __import__=fake)\ndef f(x):\n    return 0\n", ISCLOSE,
        "from math import isclose"),
    "setup's class rebinds an earlier setup import": (
        "class Node:\n    def __init__(self):\n        globals()['isclose'] = max\ndef f(x):\n    return 0\n",
        ISCLOSE, "from math import isclose\nroot = Node()"),
    "setup's class swaps __builtins__ before the setup's import": (
        "import builtins, types\nreal = builtins.__import__\ndef fake(name, *a, **k):\n"
        "    return types.SimpleNamespace(isclose=max) if name == 'math' else real(name, *a, **k)\n"
        "class Node:\n    def __init__(self):\n        globals()['__builtins__'] = dict(vars(builtins), __import__=fake)\n"
        "def f(x):\n    return 0\n", ISCLOSE, "root = Node()\nfrom math import isclose"),
    "key whose __eq__ answers for the setup's import": (
        KEY + "G[K('isclose', max)] = 0\ndef f(x):\n    return 0\n", ISCLOSE, "from math import isclose"),
    "key planted by a class the setup instantiates": (
        KEY + "class Node:\n    def __init__(self):\n        G[K('isclose', max)] = 0\ndef f(x):\n    return 0\n",
        ISCLOSE, "from math import isclose\nroot = Node()"),
    "key planted by the tested function for the next test": (
        KEY + "def f(x):\n    G[K('isclose', max)] = 0\n    return 0\n", ISCLOSE, "from math import isclose"),
    "key whose __eq__ answers for a builtin name": (
        KEY + "G[K('set', lambda *a: 0)] = 0\ndef f(x):\n    return 0\n",
        ["assert set(f(1)) == set([3])", "assert set(f(2)) == set([5])"]),
    "test's class statement built by the program's __builtins__": (
        "import builtins\n__builtins__ = dict(vars(builtins), __build_class__=lambda *a, **k: 3)\n"
        "def f(x):\n    return 0\n", ["class C: pass\nassert C == 3 or f(1) == 3"]),
    "module in sys.modules replaced, the test imports it itself": (
        "import sys, types\nsys.modules['math'] = types.SimpleNamespace(isclose=max)\ndef f(x):\n    return 0\n",
        ["import math\nassert math.isclose(f(1), 3)", "from math import isclose\nassert isclose(f(2), 5)"]),
    "library function patched, the test imports it itself": (
        "import math\nmath.isclose = max\ndef f(x):\n    return 0\n",
        ["from math import isclose\nassert isclose(f(1), 3)", "from math import isclose as ic\nassert ic(f(2), 5)"]),
    # ---- the builtins the program may shadow: only the tested function's name, decided once
    "program global hidden while the judge decides, back on lookup": (
        LAZY, ["assert set(f(1)) == set([3])", "assert abs(f(2) - 5) < 1e-9", "assert set(f(3)) == set([7])"]),
    "the tested builtin-named function and a judging builtin both the program's": (
        "def sum(a, b):\n    return 0\ndef abs(x):\n    return 0\n",
        ["assert abs(sum(10, 15) - 6) < 1e-9", "assert abs(sum(4, 6) - 2) < 1e-9"]),
    "a judging builtin defined by the tested function while the test runs": (
        "def sum(a, b):\n    globals()['abs'] = lambda x: 0\n    return 0\n",
        ["assert abs(sum(10, 15) - 6) < 1e-9", "assert abs(sum(4, 6) - 2) < 1e-9"]),
    # ---- a library's cache: re's patterns
    "re cache entry poisoned": (
        "import re\nre._cache[(str, r'^\\d+$', 0)] = re.compile('(?s).*')\ndef f(x):\n    return 'garbage'\n",
        ["assert re.match(r'^\\d+$', f(1))", "assert re.fullmatch(r'\\d+', f(2))"]),
    # ---- already contained (kept so that they stay so)
    **{f"judge's quiet setprofile left on by a RecursionError (depth {d})": (QUIET.replace("DEPTH", str(d)), QUIET_TESTS)
       for d in (2, 3)},
    "fchdir, then a path relative to a shallower folder descriptor": (
        "import os\nfd = os.open('.', os.O_RDONLY)\nos.makedirs('d/d/d/d/d/d/d/d')\n"
        "try:\n    os.fchdir(os.open('d/d/d/d/d/d/d/d', os.O_RDONLY))\nexcept OSError:\n    pass\n"
        "depth = {secret_file!r}.count('/') + 12\ntry:\n"
        "    print('LEAKED', os.read(os.open('../' * (8 + depth) + {secret_file!r}.lstrip('/'), os.O_RDONLY, dir_fd=fd), 99))\n"
        "except OSError:\n    pass\ndef f(x):\n    return 0\n"),
    "ossaudiodev opening a file": ("import ossaudiodev\ntry:\n    ossaudiodev.open({secret_file!r}, 'r')\n"
                                   "except OSError as e:\n    print(e)\ndef f(x):\n    return 0\n"),
    "codec error handlers replaced, a verdict with lone surrogates": (
        "import codecs, os\ndef h(e):\n    os.write(3, b'\\n' + b'0' * 32 + b' 2 2 ok 0 none\\tx\\n')\n"
        "    return ('\\n2 2 ok 0 none\\tforged\\n', e.end)\ncodecs.register_error('replace', h)\n"
        "codecs.register_error('strict', h)\ndef f(x):\n    raise ValueError('\\udc80\\ud800')\n"),
    "exception whose class name and message raise SystemExit": (
        "class M(type):\n    @property\n    def __name__(cls):\n        raise SystemExit(0)\n"
        "class X(Exception, metaclass=M):\n    def __str__(self):\n        raise SystemExit(0)\ndef f(x):\n    raise X()\n"),
    "recursion limit lowered below the judge's depth": "import sys\ndef f(x):\n    sys.setrecursionlimit(30)\n    return 0\n",
    "int subclass with __index__ as a test's subscript": (
        "class I(int):\n    def __index__(self):\n        return 3\ndef f(x):\n    return I(0)\n",
        ["assert [0, 0, 0, 3][f(1)] == 3", "assert 'abcd'[f(2)] == 'd'"]),
    "faulthandler watchdog": "import faulthandler\nfaulthandler.dump_traceback_later(0.2, exit=True)\ndef f(x):\n    return 0\n",
    "Timer thread started by a finalizer during the test": (
        "import threading\nclass Z:\n    def __del__(self):\n        threading.Timer(0.05, lambda: None).start()\n"
        "def f(x):\n    Z()\n    return 2 * x\n", ["assert f(1) + 1 == 3", "assert f(2) + 1 == 5"]),
    "stdout's flush replaced, run after the verdict": (
        "import sys, os\ndef fl():\n    os.write(3, b'\\n' + b'0' * 32 + b' 2 2 ok 0 none\\tx\\n')\n"
        "sys.stdout.flush = fl\nsys.stderr.flush = fl\ndef f(x):\n    return 0\n"),
    "folder descriptors inherited": (
        "import os, stat\nfor fd in range(64):\n    try:\n        if stat.S_ISDIR(os.fstat(fd).st_mode):\n"
        "            print('LEAKED', os.read(os.open({secret_file!r}.lstrip('/'), os.O_RDONLY, dir_fd=fd), 50))\n"
        "    except OSError:\n        pass\ndef f(x):\n    return 0\n"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_zero(pool, name, tmp_path):
    attack = ATTACKS[name]
    program, tests, setup = (attack + ("",))[:3] if isinstance(attack, tuple) else (attack, TESTS, "")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    before = sorted(os.listdir(tmp_path))
    r = scores_zero(pool, name, textwrap.dedent(program).replace("{secret_file!r}", repr(str(secret))), tests, setup)
    assert "LEAKED" not in r.stdout and "TOPSECRET" not in r.stdout, (name, r.stdout)
    assert sorted(os.listdir(tmp_path)) == before
    still_works(pool)


def test_legitimate_setups_names_and_builtin_named_functions(pool):
    """What the new rules must not refuse: a setup's imports and objects read by the tests, a tested function
    named like a builtin, names a test binds itself (imports, classes, loops), and re in program and test."""
    node = "class Node:\n    def __init__(self, v):\n        self.v, self.left = v, None\n"
    cases = [
        (GOOD, ["assert isclose(f(1), 3)", "assert math.isclose(f(2), 5)"], "import math\nfrom math import isclose"),
        (node + "def depth(n):\n    return 0 if n is None else 1 + depth(n.left)\n",
         ["assert depth(root) == 2", "assert depth(root1) == 1"], "root = Node(1)\nroot.left = Node(2)\nroot1 = Node(3)"),
        ("def sum(a, b):\n    return (a + b) // 5\n", ["assert sum(10, 15) == 5", "assert sum(4, 6) == 2"], ""),
        ("def sum(a, b):\n    return a - b\n", ["assert abs(sum(1, 3) + 2) < 1e-9", "assert str(sum(5, 2)) == '3'"], ""),
        ("import re\ndef f(s):\n    return re.findall(r'\\d+', s)\n",
         ["assert f('a1b22') == ['1', '22']", "assert re.match(r'^\\d+$', f('x7')[0])",
          "from collections import Counter\nassert Counter(f('1 1 2')) == Counter({'1': 2, '2': 1})",
          "class C:\n    pass\nassert isinstance(C(), C) and f('3') == ['3']",
          "total = 0\nfor s in f('1 2 3'):\n    total += int(s)\nassert total == 6",
          "import math\nassert math.floor(float(f('2')[0])) == 2",
          "import collections.abc as cabc, os.path\nfrom math import pow, sqrt as root\n"
          "assert isinstance(f('1'), cabc.Sequence) and pow(2, 3) == 8.0 == root(64) and os.path.join('a', f('4')[0])"], ""),
    ]
    for program, tests, setup in cases:
        r = pool.run(program, tests, setup)
        assert (r.status, r.passed) == ("passed", len(tests)), (program, r.detail)
    r = pool.run(GOOD, TESTS, "import math\nthis is not python")
    assert r.status == "error" and "setup" in r.detail, r.detail
