"""Red team, round 29: the known limitations rounds 24 to 28 left (a name a test binds, a batch of programs that sleep
until just under the wall limit, honest tests reading a class's ``__name__`` or comparing strings with ``is``), and
attacks through what Python does around a test rather than in its comparison: exceptions that are not
``Exception``, loops and ``try``/``finally`` in a test, the builtins, the recursion limit, huge integers, lying
``__hash__``/``__eq__``, NaN and infinities, threads, exit and finalizer hooks.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1. Found and closed:

- a variable the test binds at its top level or in a comprehension: ``mango = f('kiwi mango fig')`` then ``assert
  mango == 'mango'``, ``for guava in [f(...)]``, ``[fig for fig in ...]``. The compiled test keeps its variables'
  names interned while the program runs, and the program that returned the word of its input already interned
  (``sys.intern(w) is not w``) scored 1 in both modes. Such a variable is now renamed ``_sbx_l<n>`` before the test
  is compiled (``_rewrite._fresh_locals``), where no function, lambda or class of the test binds it nor a
  ``global``/``nonlocal`` names it; the names of the test's functions, classes and parameters, its ``except ... as``
  and ``match`` captures and a walrus inside a comprehension stay (their ``__name__``, keyword arguments);
- a batch of programs that sleep until just under the wall limit: each held its worker that long, so a batch cost
  ``wall_seconds`` per ``workers`` programs (64 of them at a 1.5 s limit, 2 workers, fork server: 44.1 s; at the
  trainer's 5 s: 156.9 s). ``SandboxPool.run_many`` now gives a batch ``batch_seconds`` (two wall limits) plus
  ``late_wall_seconds`` (0.5 s with the fork server) per round of ``workers`` jobs; a job that starts with less than
  its wall limit left of that gets what is left, at least ``late_wall_seconds``: 28.2 s and 39.3 s, and an honest
  program late in such a batch still scores 1 (a batch of honest ones never meets its budget);
- an honest test reading ``__name__`` or ``__doc__`` of a class it defines, or of ``type(f(x))``: the guard took the
  class's own namespace for an instance attribute hiding ``type``'s, ``type.__name__ is the program's``, reward 0. A
  C data descriptor of library classes (``type.__name__``, ``object.__class__``) is answered by no instance
  attribute, and is read as it is when every class of the value's type is the library's;
- an assert inside a test's ``with`` block (``with f(1) as v: assert v == 3``): the program's context manager
  (``__exit__`` returning True, ``contextlib.suppress(BaseException)``, an ``ExitStack`` callback, a generator
  context manager that catches) swallowed the test's ``AssertionError``, or raised another exception the test
  caught (``except ValueError``), and the test passed: reward 1 in both modes. Each of the test's own asserts now
  notes its failure before it raises, and a test that had one fails at its end whoever caught it
  (``_rewrite._failed_asserts``; a test that catches its own failed assert fails too);
- an honest ``assert f(x) is 'word'`` (CPython's interning made it pass): the test's string is made as it runs since
  round 26, so ``is`` said no. ``is``/``is not`` with a string constant of the test now compare as ``==`` for an exact
  ``str`` (``_rewrite._op_name``): a ``str`` subclass of the program's is still no answer.

Checked and contained, reward 0 in both modes (pinned below): ``SystemExit``, ``KeyboardInterrupt``,
``GeneratorExit`` and a ``BaseException`` subclass raised by the tested function, also under a test's ``except
Exception``, loop or ``try``/``finally`` (the judge catches ``BaseException`` around each test, and a test counts only
when its body ends normally); ``StopIteration`` under ``all()`` of a generator or ``map`` (``RuntimeError``);
``__builtins__`` replaced by a dict in the program's module, at the top or from the tested function, and the builtins
module patched (a test's function is made with the real builtins, and reads every name through the guards);
the recursion limit lowered before a nested always-equal value is judged (the trust walk needs no recursion); a
100 000-digit integer (never turned into text); ``__hash__`` raising ``SystemExit``, ``__eq__`` returning
``NotImplemented`` (the program's classes are untrusted); NaN and infinities under ``math.isclose``; a thread
alive while a result is judged; ``atexit`` (the child leaves with ``os._exit``); ``__del__`` of a cycle the program
left, ``gc.callbacks`` and ``weakref.finalize`` changing what it returned (checked after the change, or held);
``sys.settrace`` in a thread and ``threading.settrace`` (refused).

Not the sandbox's to close (native Python passes them too, any sandbox would): a test that is true of an empty
iterable (``all(v == 3 for v in f(1))`` passes for an iterator that ends at once, as for ``[]``) or of NaN
(``not abs(f(1) - 3.0) > 1e-9``). Left open: a name a test's function, class or parameter has stays interned; a
test's class has the qualified name ``_sbx_test_.<locals>.C`` (a test is the body of a function); with no batch
(``SandboxPool.run``) a program still holds its worker up to the wall limit.
"""
from __future__ import annotations

import sys
import time

import pytest

from dstrain.rewards.sandbox import SandboxPool
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)
from tests.unit.test_sandbox_redteam import LIMITS, still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

INTERNED = ("import sys\ndef f(s):\n    for w in s.split():\n        w = ''.join(list(w))\n"
            "        if sys.intern(w) is not w:\n            return w\n    return ''\n")
BOUND = {
    "a top-level variable": "mango = f('kiwi mango fig')\nassert mango == 'mango'",
    "a for target": "for guava in [f('kiwi guava fig')]:\n    assert guava == 'guava'",
    "a walrus target": "assert (lychee := f('kiwi lychee fig')) == 'lychee' and lychee",
    "a comprehension variable": "assert [fig for fig in [f('kiwi fig mango')]] == ['fig']",
}


@pytest.mark.parametrize("name", list(BOUND))
def test_a_variable_the_test_binds_does_not_tell_the_answer(pool, name):
    """Before the fix: reward 1.0 in both modes (the variable's name was interned); now the test fails."""
    r = scores_zero(pool, name, INTERNED, [BOUND[name]])
    assert r.status == "failed", (r.status, r.detail)
    still_works(pool)


def test_renamed_variables_keep_an_honest_tests_meaning(pool):
    """The renaming leaves what a test means: closures, comprehensions, walrus, ``del``, a function's and a class's
    own names and parameters, ``except ... as``, ``match`` captures. Unit check: no bound name left in the code."""
    from dstrain.rewards._rewrite import _prepare_test

    code, _ = _prepare_test("mango = 1\nfor guava in [2]:\n    pass\nassert mango and guava and [fig for fig in 'a']")
    names = set(code.co_varnames) | {n for c in code.co_consts if hasattr(c, "co_varnames") for n in c.co_varnames}
    assert not {"mango", "guava", "fig"} & names, names
    program = "def f(s):\n    return s.split()[1]\n"
    tests = ["mango = f('kiwi mango fig')\nassert mango == 'mango'",
             "n = 0\nfor w in 'a b'.split():\n    n += len(f('x ' + w))\nassert n == 2 and [w for w in 'ab'] == ['a', 'b']",
             "x = [f('a bc')]\ng = lambda: x[0]\nassert g() == 'bc' and (y := len(x)) == 1 and y == 1\ndel y",
             "def pick(s, k=1):\n    v = s.split()[k]\n    return v\nassert pick('a b', k=0) == 'a' and pick.__name__ == 'pick'",
             "try:\n    z = f('a')\nexcept IndexError as e:\n    z = type(e).__name__\nassert z == 'IndexError'",
             "match f('a b').upper():\n    case 'B' as got:\n        assert got == 'B'\n    case _:\n        assert False",
             "class Box:\n    size = f('a bc')\n    def grow(self):\n        return self.size * 2\nassert Box().grow() == 'bcbc'",
             "k = 'a'\nassert {k: v for k, v in [('b', f('x y'))]} == {'b': 'y'} and k == 'a' and [k for k in k] == ['a']"]
    r = pool.run(program, tests)
    assert r.reward() == 1.0, (r.status, r.detail)


SUPPRESS = "class C:\n    def __enter__(self):\n        return 0\n    def __exit__(self, *a):\n        return True\n"
WITH = "with f(1) as v:\n    assert v == 3"
SWALLOWED = {  # name -> (program, test): the program's code catches the test's own failed assert
    "__exit__ says True": (SUPPRESS + "def f(x):\n    return C()\n", WITH),
    "contextlib.suppress": ("import contextlib\ndef f(x):\n    return contextlib.suppress(BaseException)\n", WITH),
    "an ExitStack callback": ("import contextlib\ndef f(x):\n    s = contextlib.ExitStack()\n    s.push(lambda *a: True)\n"
                              "    return s\n", WITH),
    "a generator context manager": ("import contextlib\n@contextlib.contextmanager\ndef f(x):\n    try:\n"
                                    "        yield 0\n    except BaseException:\n        pass\n", WITH),
    "__exit__ raising what the test catches": (SUPPRESS.replace("return True", "raise ValueError") + "def f(x):\n"
                                               "    return C()\n", "try:\n    " + WITH.replace("\n", "\n    ")
                                               + "\nexcept ValueError:\n    pass"),
}


@pytest.mark.parametrize("name", list(SWALLOWED))
def test_a_failed_assert_the_program_catches_fails_the_test(pool, name):
    """Before the fix: reward 1.0 in both modes (the context manager the program handed to the test's ``with``
    swallowed the test's ``AssertionError``, or put another exception the test catches in its place); now the test
    fails."""
    program, test = SWALLOWED[name]
    r = scores_zero(pool, name, program, [test])
    assert "did not end it" in r.detail, r.detail
    still_works(pool)


def test_asserts_in_a_tests_functions_loops_and_blocks_still_score_one(pool):
    """Pins the honest side of the fix above: asserts in a test's functions, generators, methods, loops, ``with``
    and ``try``/``finally`` blocks, and an ``AssertionError`` of the program's that the test expects."""
    program = ("class C:\n    def __init__(self, v):\n        self.v = v\n    def __enter__(self):\n"
               "        return 2 * self.v + 1\n    def __exit__(self, *a):\n        return False\n"
               "def f(x):\n    assert x >= 0\n    return C(x)\n")
    tests = ["with f(1) as v:\n    assert v == 3",
             "def check(v):\n    with f(v) as got:\n        assert got == 2 * v + 1\n    return True\n"
             "assert all(check(v) for v in range(3))",
             "def gen():\n    for v in range(3):\n        with f(v) as got:\n            assert got > v\n        yield v\n"
             "assert list(gen()) == [0, 1, 2]",
             "for i in range(3):\n    with f(i) as got:\n        assert got == 2 * i + 1\nelse:\n    pass",
             "try:\n    with f(1) as v:\n        assert v == 3\nfinally:\n    x = 1\nassert x == 1",
             "try:\n    f(-1)\n    raise ValueError\nexcept AssertionError:\n    pass"]
    r = pool.run(program, tests)
    assert r.reward() == 1.0, (r.status, r.detail)


EQ = "class S(str):\n    def __eq__(s, o):\n        return True\n    __hash__ = str.__hash__\n"
WORD = "def f(x):\n    return 'word' if x else 'other'\n"


def test_is_with_a_tests_string_scores_one(pool):
    """Before the fix: reward 0 in both modes (``is`` with a string made as the test runs: no test passed); now 1.
    A ``str`` subclass of the program's is still no answer to ``is``."""
    tests = ["assert f(1) is 'word' and 'word' is f(1) and f(0) is not 'word'", "assert 'a' < f(1) is 'word'"]
    r = pool.run(WORD.replace("'word' if", "'wo' + 'rd' if"), tests)
    assert r.reward() == 1.0, (r.status, r.detail)
    scores_zero(pool, "is, a str subclass", EQ + "def f(x):\n    return S('zz')\n",
                ["assert f(1) is 'word'", "assert 'word' is f(1)"])
    still_works(pool)


def test_a_class_name_and_doc_score_one(pool):
    """Before the fix: reward 0 in both modes (``type.__name__ is the program's``); now 1. A ``str`` subclass of the
    program's as a class's ``__name__``, or a metaclass's property, is still no answer."""
    tests = ["class Pair:\n    '''A pair.'''\nassert (Pair.__name__, Pair.__doc__) == ('Pair', 'A pair.') and f(1)",
             "class B:\n    pass\nclass C(B):\n    pass\nassert [k.__name__ for k in type(C()).__mro__] == ['C', 'B', 'object']",
             "assert type(f(1)).__name__ == 'str' and f(1).__class__ is str"]
    r = pool.run(WORD, tests)
    assert r.reward() == 1.0, (r.status, r.detail)
    scores_zero(pool, "__name__, a str subclass", EQ + "class P:\n    pass\nP.__name__ = S('zz')\ndef f(x):\n"
                "    return P()\n", ["assert type(f(1)).__name__ == 'Answer'"])
    scores_zero(pool, "__name__, a metaclass property", ("class E:\n    def __eq__(s, o):\n        return True\n"
                "    __hash__ = None\nclass M(type):\n    @property\n    def __name__(c):\n        return E()\n"
                "class P(metaclass=M):\n    pass\ndef f(x):\n    return P\n"), ["assert f(1).__name__ == 'Answer'"])
    still_works(pool)


def test_a_batch_keeps_to_its_budget_and_still_runs_a_late_job(monkeypatch):
    """Unit level (the runs faked, sleeping up to their wall limit): before the fix each of 6 sleepers held a worker
    its full 1.5 s limit (``batch_seconds`` did not exist); now the batch's budget (0.05 s plus 0.1 s per round of 2
    workers) cuts their limits to what is left, at least 0.1 s, and the job at the end still gets 0.1 s."""
    from dstrain.rewards import sandbox

    walls = {}

    def fake_run(program, tests, setup, limits, servers):
        walls[program] = limits.wall_seconds
        time.sleep(min(limits.wall_seconds, 0.3) if program.startswith("sleep") else 0.0)
        return sandbox.ExecResult("passed", 1, 1, 0.0, "")

    monkeypatch.setattr(sandbox, "run_program", fake_run)
    jobs = [(f"sleep {i}", ["assert True"], "") for i in range(6)] + [("honest", ["assert True"], "")]
    with SandboxPool(workers=2, limits=LIMITS, mode="spawn", batch_seconds=0.05, late_wall_seconds=0.1) as pool:
        start = time.monotonic()
        pool.run_many(jobs)
        elapsed = time.monotonic() - start
    assert max(walls.values()) <= 0.45 and walls["honest"] == 0.1, walls
    assert elapsed < 1.0, elapsed  # (3 rounds of 0.3 s before)
    with pytest.raises(ValueError, match="batch_seconds"):
        SandboxPool(workers=1, limits=LIMITS, batch_seconds=0)
    with SandboxPool(workers=1, limits=LIMITS, mode="spawn") as pool:  # the defaults: two wall limits, 1.5 s capped
        assert (pool.batch_seconds, pool.late_wall_seconds) == (2 * LIMITS.wall_seconds, LIMITS.wall_seconds)


@pytest.mark.slow
def test_a_batch_of_sleeping_programs_is_bounded_and_a_late_honest_one_scores():
    """The same with real runs, fork server: 4 sleepers held a worker ~1.4 s each before (about 2.9 s for the batch);
    now about 1.1 s, and the honest program at its end, with 0.25 s, scores 1."""
    sleeper = "import time\ntime.sleep(1.4)\ndef f(x):\n    return 0\n"
    jobs = [(sleeper + f"# {i}\n", ["assert f(1) == 3"], "") for i in range(4)]
    jobs.append(("def f(x):\n    return 2 * x + 1\n", ["assert f(1) == 3"], ""))
    with SandboxPool(workers=2, limits=LIMITS, batch_seconds=0.05, late_wall_seconds=0.25,
                     mode="fork_server") as pool:
        pool.run_many([("x = 1\n", ["assert x == 1"], "")] * 2)  # (the servers started)
        start = time.monotonic()
        results = pool.run_many(jobs)
        elapsed = time.monotonic() - start
    assert [r.reward(partial_credit=True) for r in results] == [0.0] * 4 + [1.0], [r.detail for r in results]
    assert elapsed < 2.2, elapsed


HANDLED = "try:\n    assert f(1) == 3\nexcept Exception:\n    assert False"
CONTAINED = {  # name -> (program, tests): what the module docstring lists as contained
    "SystemExit under except Exception": ("def f(x):\n    raise SystemExit(0)\n", [HANDLED]),
    "KeyboardInterrupt in a loop": ("def f(x):\n    raise KeyboardInterrupt\n",
                                    ["for i in range(3):\n    assert f(i) == 2 * i + 1"]),
    "GeneratorExit under try/finally": ("def f(x):\n    raise GeneratorExit\n",
                                        ["try:\n    r = f(1)\nfinally:\n    pass\nassert r == 3"]),
    "a BaseException subclass": ("class B(BaseException):\n    pass\ndef f(x):\n    raise B\n", [HANDLED]),
    "StopIteration under all()": ("def f(x):\n    raise StopIteration\n",
                                  ["assert all(f(i) == 2 * i + 1 for i in range(3))",
                                   "assert all(map(lambda i: f(i) == 2 * i + 1, range(3)))"]),
    "__builtins__ a dict of the program's": (
        "__builtins__ = dict(vars(__builtins__))\n__builtins__['len'] = lambda x: 3\ndef f(x):\n    return [9]\n",
        ["assert len(f(1)) == 3"]),
    "the recursion limit lowered": (
        "import sys\nclass E:\n    def __eq__(s, o):\n        return True\n    __hash__ = None\ndef f(x):\n    v = E()\n"
        "    for _ in range(200):\n        v = [v]\n    sys.setrecursionlimit(60)\n    return v\n",
        ["assert f(1) == " + "[" * 200 + "3" + "]" * 200]),
    "a huge int": ("def f(x):\n    return 10 ** 100000\n", ["assert f(1) == 3"]),
    "__hash__ raising SystemExit": ("class H(int):\n    def __hash__(s):\n        raise SystemExit\n"
                                    "def f(x):\n    return H(3)\n", ["assert f(1) in {3}"]),
    "__eq__ NotImplemented": ("class N:\n    def __eq__(s, o):\n        return NotImplemented\n"
                              "    __ne__ = __eq__\n    __hash__ = None\ndef f(x):\n    return N()\n",
                              ["assert not (f(1) != 3)"]),
    "NaN and inf under isclose": ("def f(x):\n    return float('nan') if x else float('inf')\n",
                                  ["import math\nassert math.isclose(f(1), 3.0)",
                                   "import math\nassert math.isclose(f(0), 3.0, rel_tol=1e-9)"]),
    "a thread alive when judged": ("import threading, time\ndef f(x):\n"
                                   "    threading.Thread(target=time.sleep, args=(0.3,)).start()\n    return 2 * x + 1\n",
                                   ["assert f(1) == 3"]),
    "atexit": ("import atexit, os\natexit.register(os.write, 1, b'x')\ndef f(x):\n    return 0\n", ["assert f(1) == 3"]),
    "__del__ of a cycle left": ("class D:\n    def __del__(self):\n        import builtins\n"
                                "        builtins.AssertionError = type('A', (Exception,), {})\nd = D()\nd.me = d\n"
                                "def f(x):\n    return 0\n", ["assert f(1) == 3"]),
    "gc.callbacks": ("import gc\nbox = []\ndef cb(phase, info):\n    for v in box:\n        v[:] = [3]\n"
                     "gc.callbacks.append(cb)\ndef f(x):\n    r = [0]\n    box.append(r)\n    a = []\n    a.append(a)\n"
                     "    return r\n", ["assert f(1) == [3]"]),
    "weakref.finalize": ("import weakref\nclass O:\n    pass\ndef f(x):\n    r = [0]\n    o = O()\n    o.o = o\n"
                         "    weakref.finalize(o, r.__setitem__, 0, 3)\n    return r\n", ["assert f(1) == [3]"]),
    "sys.settrace in a thread": ("import sys, threading\ndef tr(fr, ev, arg):\n    return tr\n"
                                 "threading.Thread(target=sys.settrace, args=(tr,)).start()\ndef f(x):\n    return 0\n",
                                 ["assert f(1) == 3"]),
}


@pytest.mark.parametrize("name", list(CONTAINED))
def test_what_python_does_around_a_test_gives_no_reward(pool, name):
    """Contained before this round too (see the module docstring); pinned."""
    program, tests = CONTAINED[name]
    scores_zero(pool, name, program, tests)
    still_works(pool)
