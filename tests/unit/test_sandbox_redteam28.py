"""Red team, round 28: the test rewrite of rounds 26 and 27 (``_rewrite.py``) as a target, for what it changes of an
honest test's meaning and for what of a test's values it still lets the program see.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1. Found and closed:

- a ``match`` pattern naming a class, a dotted name or a negative or complex number (``case int(n)``, ``case
  math.pi``, ``case -1``, ``case {math.e: v}``): the rewrite put a guarded read (a call) where a pattern admits only a
  name, and the test did not compile (``ValueError: MatchClass cls field can only contain Name or Attribute
  nodes``): an honest program failed, reward 0 in both modes. The subject and then each such expression are now read
  through the guards into the holder the test makes as it starts, and the pattern reads the holder
  (``_rewrite._guard_match``); the same comparisons, the class's ``isinstance`` check, the captures and guards alike;
- ``super()`` with no arguments in a method a test defines: ``super`` read through the ``name`` guard is no name the
  compiler sees, it made no ``__class__`` cell, and the call raised ``RuntimeError``. It is now ``super(__class__,
  <first parameter>)`` (``_rewrite._super_explicit``), what the bare call means;
- a method of a class the test defines, called by the test: the guards took it for a library method and its code for
  the program's (``the program's code (g) ran inside the test's call of g``), and the test failed. Its code is the
  test's, guarded, and it is now called as the test's own functions are (``_guards.call``);
- the exception a test is handling when it calls the program (``try: {}['mango'] except KeyError: assert f(...) ==
  'mango'``): the program's code read it with ``sys.exc_info()``, or as the ``__context__`` of one it raised, and
  returned the key it carried; reward 1 in both modes. The program's function (and a generator of its that a
  library call drains) now runs with a blank ``Exception`` being handled, no context, no traceback
  (``_guards.unhandled``).

Checked and unchanged, honest tests scoring 1 in both modes as before: keyword arguments evaluated in source order
with ``*args`` and ``**`` mixed in, a keyword named like a positional-only parameter (it goes to ``**kw``), a duplicate
keyword refused (``TypeError``), keywords to C functions that take them (``int(base=)``, ``str.split(sep=)``) and
those that refuse them (``len(obj=)`` still a ``TypeError``), ``class A(B, metaclass=M, tag=...)``,
``__init_subclass__`` keywords, decorators with keywords, ``nonlocal`` and ``global`` in a test's functions,
comprehensions and generator expressions with strings, f-strings, docstrings, walrus.

What did not leak a test's answer:

- a test's own functions' defaults and annotations, and its values as arguments: the program sees only what the test
  hands it (a function of the test passed to it is handed over); frames are refused (``sys.settrace``, ``f_back``
  needs a frame first), so no default or local of a test is reached otherwise;
- the holder of ``match`` strings: a local of the test, never handed to the program; the subject it compares is
  trusted (a value of the program's class is refused before any pattern runs, so no ``__eq__`` or ``__match_args__``
  of the program's sees a pattern's value);
- an assertion message: evaluated only when the assertion fails, when the test is over; a message of a test's earlier
  ``assert`` caught in the test itself is the handled exception above;
- warnings a test triggers: a ``showwarning`` of the program's is a change of module ``warnings``, the test fails.

Not closed: a name the test binds itself stays interned (round 27); a test that iterates a generator of the
program's with its own ``for`` statement inside an ``except`` block runs it natively, the test's exception handled;
a test reading ``__name__`` or ``__doc__`` of a class it defines fails (``type.__name__ is the program's``; MBPP
defines no class in its tests); ``asyncio.run`` in a test is refused (its event loop opens a socket pair).
"""
from __future__ import annotations

import builtins
import operator
import sys
import types

import pytest

from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)
from tests.unit.test_sandbox_redteam import still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

HANDLED = ("import sys\ndef f(x):\n    e = sys.exc_info()[1]\n    return e.args[0] if e is not None and e.args else 0\n")
CONTEXT = ("def f(x):\n    try:\n        raise ValueError\n    except ValueError as e:\n        c = e.__context__\n"
           "    return c.args[0] if c is not None and c.args else 0\n")
CAUGHT = {  # name -> (program, tests)
    "sys.exc_info in a test's except block": (HANDLED, [("try:\n    {}['mango']\nexcept KeyError:\n"
                                                        "    assert f('kiwi mango') == 'mango'")]),
    "the __context__ of the program's own exception": (CONTEXT, [("try:\n    {}['mango']\nexcept KeyError:\n"
                                                                 "    assert f('kiwi mango') == 'mango'")]),
    "a caught assertion's message": (HANDLED, [("try:\n    assert False, 7\nexcept AssertionError:\n"
                                               "    assert f(1) == 7")]),
    "a generator drained by the test's list()": (HANDLED.replace("return e", "yield e"),
                                                  [("try:\n    {}['mango']\nexcept KeyError:\n"
                                                   "    assert list(f('kiwi mango')) == ['mango']")]),
}


@pytest.mark.parametrize("name", list(CAUGHT))
def test_the_exception_a_test_handles_is_not_the_programs_to_read(pool, name):
    """Before the fix: reward 1.0 in both modes (see the module docstring); now the test fails."""
    program, tests = CAUGHT[name]
    r = scores_zero(pool, name, program, tests)
    assert r.status == "failed", (r.status, r.detail)
    still_works(pool)


def test_match_patterns_naming_classes_and_dotted_names_score_one(pool):
    """Before the fix: reward 0, the test did not compile (a guarded read in a pattern); now 1 in both modes, and the
    program called inside a test's ``except`` block still passes (its own exceptions and captures alike)."""
    program = ("def f(x):\n    if x < 0:\n        raise ValueError(x)\n    try:\n        return int('z')\n"
               "    except ValueError:\n        return [x, str(x)]\n")
    tests = [("match f(5):\n    case [int(n), str(s)] if n > 3:\n        assert (n, s) == (5, '5')\n"
             "    case _:\n        assert False"),
             ("import math\nmatch f(1)[0] * math.pi:\n    case math.e:\n        assert False\n    case math.pi:\n"
             "        pass\n    case _:\n        assert False"),
             ("match -f(1)[0]:\n    case 1 | -2:\n        assert False\n    case -1:\n        pass\n    case _:\n"
             "        assert False"),
             ("import math\nmatch {math.pi: f(2)}:\n    case {math.pi: [2, str() as s]}:\n        assert s == '2'\n"
             "    case _:\n        assert False"),
             ("def h(v):\n    match v:\n        case [int(a), *rest]:\n            return a + h(rest)\n    return 0\n"
             "assert h([1, 2, 3]) == 6 and h(f(4)[:1]) == 4"),
             "try:\n    f(-1)\n    assert False\nexcept ValueError as e:\n    assert f(3) == [3, '3'] and e.args == (-1,)"]
    r = pool.run(program, tests)
    assert r.reward() == 1.0, (r.status, r.detail)


def test_classes_a_test_defines_work(pool):
    """Before the fix: reward 0 in both modes (a test's method taken for the program's code, ``super()`` with no
    ``__class__`` cell); now 1."""
    program = "def f(x):\n    return 2 * x + 1\n"
    tests = [("class A:\n    def g(self, k=0):\n        return f(k)\nclass C(A):\n    def g(self):\n"
             "        return super().g(k=2) + 1\n    h = lambda self: __class__\nassert C().g() == 6 and C().h() is C"),
             ("class P:\n    def __init__(self, v):\n        self.v = v\n    def twice(self):\n        return [f(self.v)] * 2\n"
             "assert P(1).twice() == [3, 3]")]
    r = pool.run(program, tests)
    assert r.reward() == 1.0, (r.status, r.detail)


def _run_rewritten(src: str, ns: dict) -> None:
    """Runs a test as ``_rewrite._prepare_test`` rewrites it, with guards that check nothing: what the rewrite alone
    does to the test's meaning."""
    from dstrain.rewards._rewrite import _prepare_test

    ops = {n: getattr(operator, n) for n in ("eq", "ne", "lt", "le", "gt", "ge", "is_", "is_not", "add", "sub", "mul",
                                             "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and_", "or_",
                                             "xor", "matmul", "getitem")}
    ops.update(in_=lambda a, b: a in b, not_in=lambda a, b: a not in b)

    def op(name, a, b):
        if name != "chain":
            return ops[name](a, b)
        return all(ops[o](x, y) for o, x, y in zip(a, b, b[1:]))

    def name(n, as_module=False):
        return ns[n] if n in ns else sys.modules[n] if as_module or n not in vars(builtins) else vars(builtins)[n]

    code, _ = _prepare_test(src)
    types.FunctionType(code, ns)(lambda v: v, lambda f, *a, **k: f(*a, **k), name, getattr, op)


@pytest.mark.parametrize("src", [
    ("class A:\n    def g(self, k=0):\n        return 1 + k\nclass C(A):\n    def g(self):\n        return super().g(k=2)\n"
    "    h = lambda self: super().g()\nassert C().g() == 3 and C().h() == 1"),
    "class C:\n    def g(self):\n        return __class__\nassert C().g() is C",
    "class C:\n    def g():\n        return super()\ntry:\n    C.g()\n    assert False\nexcept RuntimeError:\n    pass",
    ("class M(type):\n    def __new__(m, n, b, d, tag=None):\n        d['tag'] = tag\n        return super().__new__(m, n, b, d)\n"
    "class A(metaclass=M, tag='t'):\n    pass\nassert A.tag == 't' and type(A) is M"),
    ("log = []\ndef g(v):\n    log.append(v)\n    return v\ndef f(a, /, *args, **kw):\n    return a, args, kw\n"
    "assert f(g(1), *[g(2)], c=g(3), **{'a': g(4)}) == (1, (2,), {'c': 3, 'a': 4}) and log == [1, 2, 3, 4]"),
    ("try:\n    dict(**{'a': 1}, a=2)\n    assert False\nexcept TypeError:\n    pass\ntry:\n    len(obj=[])\n"
    "    assert False\nexcept TypeError:\n    pass\nassert int('ff', base=16) == 255"),
    ("def outer():\n    n = 0\n    def inc():\n        nonlocal n\n        n += 1\n    inc()\n    inc()\n    return n\n"
    "assert outer() == 2 and all(w in ('go', 'n') for w in 'go n'.split()) and {w: 1 for w in 'ab'} == {'a': 1, 'b': 1}"),
    ("match (1, 'a', {'k': -1}):\n    case (int(n), str() as s, {'k': -1}) if n:\n        assert (n, s) == (1, 'a')\n"
    "    case _:\n        assert False"),
])
def test_the_rewrite_keeps_an_honest_tests_meaning(src):
    """Unit level, no sandbox: before the fix the ``super()`` cases raised ``RuntimeError: super(): __class__ cell not
    found`` and the class pattern did not compile; the others pin what passed already."""
    _run_rewritten(src, {})
