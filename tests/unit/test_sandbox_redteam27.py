"""Red team, round 27: what compiling and preparing a task's tests (and its setup, and the judge's imports for them)
leaves in state the whole interpreter shares before the program runs, and what of it Python code can observe.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1. Round 26 kept a test's identifier-like
string constants out of the interned-string table (``_rewrite._fresh_strings``), but three other ways a test's
words stayed there while the program ran, and each gave reward 1 in both modes to a program that returned the word
of its input that was interned already (``sys.intern(w) is not w``):

- a keyword argument's name: ``assert f('kiwi mango fig') == dict(mango=1)``. The compiled call keeps its keyword
  names as a tuple of interned constants. Such an argument is now ``**{b'mango'.decode(): 1}``, its key made as the
  test runs (an argument of any callable, in the same order, the same duplicates refused);
- a name the test reads: ``assert f('kiwi guava fig') == 'guava' or guava``. The read itself went through the
  ``name`` guard with a fresh string, but the names the prepared test lists (``_prepare_test``'s second item) were
  the parser's own objects, interned, and kept for the whole run. They are now copies;
- a ``match`` pattern's string (``case 'lychee':``, a mapping pattern's key), left a constant in round 26. It is now a
  value pattern, ``case _sbx_strs.v0:``, the attribute of a function object the test makes as it starts, set to the
  string made then (``_rewrite._fresh_patterns``): the same comparison (``==``), no interned constant.

What did not leak a test's answer, and why (no attack built on it got past the sandbox, or could):

- the parser's and compiler's own interning of a test's identifiers: the interned table holds its strings weakly
  (mortal in 3.11), so a word is found there only while an object keeps it; once the tree is gone, only what the
  test's code and the judge keep is (the three above, the names a test binds itself, ``x = f(1)``: no answer);
- a test's other constants (ints above 256, floats, bytes, tuples, non-identifier strings): held by the test's code
  only, which no program reaches (``gc.get_objects``, ``get_referrers`` and ``get_referents`` are refused,
  ``sys.getrefcount`` is removed, ``ctypes`` is refused); a freed float's or tuple's memory that a free list hands to
  the program again is overwritten by the new value, its address tells nothing of the old one;
- counters and allocator state (``gc.get_count``, ``gc.get_stats``, ``sys.getallocatedblocks``,
  ``sys._debugmallocstats``): how many objects were allocated, not what they hold. Measured in both modes: with the
  fork server they drift from job to job with the server's own work; per program, ``sys.getallocatedblocks`` is one
  block lower for ``== 200`` than for ``== 1000``, ``== 2.5`` or ``== 'mango'`` (alike), since a small int (-5 to 256)
  needs no object of its own: at most whether a constant is a small int, never which value. ``tracemalloc`` sees only
  what is allocated after it starts, in the program;
- caches the judge fills for the tests: the modules a test imports are loaded before (which modules, not what a test
  expects); ``re``'s, ``fnmatch``'s and ``functools``' caches, ``linecache`` (a test is compiled as ``<test>``, never
  registered there), the codecs lookup and the warnings registries (a test's ``SyntaxWarning`` goes to the judge's
  globals and to stderr, before the program runs) hold nothing of a test's values; a type's attribute cache and
  dict key-sharing are filled by the program's own objects only. A timing side channel needs a cache the test
  filled with its answer; of those, only the interned table was one, and lookups in it now find nothing of a test's.

Not closed: a name the test binds itself (a variable, a function's parameter, a class's attribute, ``case
Point(x=0)``'s attribute) is interned while the test's code lives; a test whose expected answer is such a name
(``mango = 1`` to assert ``f(...) == 'mango'`` through ``vars()``) would still hand it over.
"""
from __future__ import annotations

import sys

import pytest

from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)
from tests.unit.test_sandbox_redteam import still_works

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

INTERNED = ("import sys\ndef f(x):\n    for w in x.split():\n        if sys.intern(w) is not w:\n"
            "            return {shape}\n    return None\n")
LEAKS = {  # name -> (what the found word ``w`` is returned as, the tests)
    "a keyword argument's name": ("dict(**{w: 1})", ["assert f('kiwi mango fig') == dict(mango=1)",
                                                     "assert f('plum grapefruit') == dict(grapefruit=2)"]),
    "a name the test reads": ("w", ["assert f('kiwi guava fig') == 'guava' or guava"]),
    "a match pattern's string": ("w", [("match f('kiwi lychee fig'):\n    case 'lychee':\n        pass\n"
                                       "    case _:\n        assert False")]),
    "a mapping pattern's key": ("{w: 1}", [("match f('kiwi quince fig'):\n    case {'quince': 1}:\n        pass\n"
                                           "    case _:\n        assert False")]),
}


@pytest.mark.parametrize("name", list(LEAKS))
def test_a_test_word_cannot_be_found_among_the_interned(pool, name):
    """Before the fix: reward 1.0 in both modes (see the module docstring); now the test fails."""
    shape, tests = LEAKS[name]
    r = scores_zero(pool, name, INTERNED.format(shape=shape), tests)
    assert r.status == "failed", (r.status, r.detail)
    still_works(pool)


def test_keyword_arguments_and_match_patterns_still_work(pool):
    """An honest program against tests that pass keyword arguments (to the program's function, to builtins, with
    ``**`` mixed in, one a duplicate) and match strings, mapping keys and class patterns."""
    program = ("def f(x, sep=' ', *, upper=False):\n    w = x.split(sep)\n    return [s.upper() if upper else s for s in w]\n"
               "def g(**kw):\n    return sorted(kw)\n")
    tests = ["assert f('a-b', sep='-') == ['a', 'b'] and f('a b', upper=True) == ['A', 'B']",
             "assert sorted(f('b a'), key=str.lower, reverse=True) == ['b', 'a'] and round(2.345, ndigits=1) == 2.3",
             "assert g(b=1, **{'a': 2}, c=3) == ['a', 'b', 'c'] and dict(mango=1) == {'mango': 1}",
             "try:\n    g(a=1, **{'a': 2})\n    assert False\nexcept TypeError:\n    pass",
             ("match f('x y'):\n    case ['x', 'z']:\n        assert False\n    case ['x', 'y']:\n        pass\n"
             "    case _:\n        assert False"),
             ("match {'k': f('x')}:\n    case {'k': ['x'], 'z': 1}:\n        assert False\n    case {'k': ['x']}:\n"
             "        pass\n    case _:\n        assert False"),
             ("def h(v):\n    match v:\n        case 'on' | 'yes':\n            return 1\n    return 0\n"
             "assert [h(s) for s in f('on no yes')] == [1, 0, 1]")]
    r = pool.run(program, tests)
    assert r.reward() == 1.0, (r.status, r.detail)


def test_mbpp_references_still_score_one(pool):
    """The honest-program check: MBPP's own solutions (five of the short ones) pass their tests in both modes."""
    from dstrain.data.tasks import load_mbpp
    from dstrain.rewards import score_tasks
    from tests.unit.test_tasks import data_file

    tasks = load_mbpp(str(data_file("mbpp.jsonl")), "train", max_reference_chars=100)[:5]
    assert score_tasks(tasks, [t.reference for t in tasks], pool) == [1.0] * len(tasks)
