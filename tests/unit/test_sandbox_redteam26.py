"""Red team, round 26: the judge's own machinery as a target (its audit events, frames, classes and modules, the
import system's caches), the values it checks and the methods it may call on them, the process state it needs to
write its verdict (limits, descriptors, signals), what a fork server's child could leave for the next one, and
what a program could read of other programs' tests.

Same rules as ``test_sandbox_redteam.py``: no attack computes the answer, each must get reward 0 (also with partial
credit), and the same pool must afterwards still score a correct program 1, in time. The holes this round closed
were both in what the tests leave in the interpreter before the program runs: each test is compiled then (``_rewrite.
_prepare_test``), and its code's constants are objects the whole interpreter shares:

- the reference counts of the small ints (and of ``True``, ``False`` and ``None``). A constant ``200`` of the
  test's code is one more reference to the one ``int`` 200 there is, so a program that knew the counts of a run
  whose test expected ``1000`` (no small int), read at its top level with ``sys.getrefcount``, found the expected
  answer as the one count that had grown, and returned it: ``assert f(1) == 200`` passed, reward 1 in both modes
  (the counts are alike from one run to the next, in a fork server from its second job on). ``sys.getrefcount`` is
  now removed (``_child._UNAUDITED``; a reload of ``sys`` does not bring it back, and ``gc.get_referrers``
  is refused);
- the interpreter's table of interned strings. The compiler interns every string constant made only of ASCII
  letters, digits and ``_``, so a program that asked, for each word of its input, whether it was interned already
  (``sys.intern(w) is not w``, or whether ``setattr`` left the table's object as the key of an instance's
  ``__dict__``) found the test's expected word: ``assert f('kiwi mango fig') == 'mango'`` passed, reward 1 in both
  modes. Such a constant of a test is now a ``b'...'.decode()`` run as the test runs (``_rewrite._fresh_strings``):
  the string it makes is never interned (a ``match`` pattern's value stays a constant).

What did not get past the sandbox, pinned here:

- the audit hook as a target: a hook of the program's own (``sys.addaudithook``, also one meant to raise on the
  judge's events) is a violation, and so is an event the program raises itself that the hook refuses (a spoofed
  ``sys.setprofile``); a spoofed ``object.__getattr__`` of ``__defaults__`` only turns a costlier check on;
- frames: ``gi_frame``, ``cr_frame``, ``ag_frame`` and a caught exception's ``__traceback__.tb_frame`` are refused
  by the hook (``f_back``, which no event covers, needs a frame first); ``gc.get_referents`` of a function's
  ``__globals__`` is a violation; ``warnings.warn`` with a ``stacklevel`` reaching the judge's frames gives the
  program's ``showwarning`` a file name and a line number, nothing it could use;
- a walk of ``object.__subclasses__()`` and ``type.__subclasses__`` finds no function with the judge's globals (the
  judge defines no class); ``sys.modules`` entries replaced with look-alikes, ``sys.path_importer_cache`` emptied,
  a finder that finds nothing and ``importlib.invalidate_caches``: every module a test reads was bound before;
- ``__init_subclass__`` and ``__set_name__`` that put an always-equal ``__eq__`` on a subclass of ``int``: the class
  is the program's, so its ``__eq__`` makes it untrusted;
- a callable value whose ``__class__`` property claims ``type``, so that the judge takes it for a class of the
  program's (``isinstance`` reads ``__class__``) and calls it unchecked: what the call gives is judged where it is
  used, and is untrusted;
- values whose ``__len__``, ``__iter__``, ``__bool__``, ``__index__``, ``__float__`` and ``__hash__`` lie, raise
  ``GeneratorExit``, ``KeyboardInterrupt`` or ``SystemExit``, or sleep only when called: untrusted before any of them
  runs; an exception whose ``__str__`` (which the judge runs to describe a failed test) changes the builtins
  between tests: they are put back before the next one;
- the verdict's process state: ``RLIMIT_FSIZE`` and ``RLIMIT_NOFILE`` at 0 and ``RLIMIT_AS`` lowered in the tested
  function (the verdict still comes: the result descriptor is open, and the judge opens nothing more), the result
  descriptor closed or replaced by ``dup2`` (no verdict: a crash, reward 0), the result pipe reopened to read through
  ``/proc/self/fd/3`` or ``/dev/fd/3`` (refused: ``/proc`` is not readable), every signal blocked with
  ``pthread_sigmask`` and ``siginterrupt`` (the wall clock kills with ``SIGKILL``), ``SIGSTOP`` sent to itself (a
  stopped child is killed at the wall limit; in spawn mode the program is its PID namespace's init, which ignores
  it), a thread writing to the result pipe without end (threads left running: a violation);
- a fork server's next child: ``os.register_at_fork``, a shared anonymous mapping, a replaced
  ``threading.excepthook``, ``flock`` held on library files, the folder's inodes used up and a deep chain of
  folders (removed before the next job, which is on time), a recursion limit of 10**8 with a 300000-deep value;
- other programs' tests: ``/proc``, ``/tmp``, the server's folder (``..``), ``/dev/shm`` and ``/run`` cannot be
  listed or read, and a descriptor on a folder inside the program's own, used as ``dir_fd`` with ``..`` to write
  outside, is refused (the hook resolves against the working folder, always a shallower base than any folder inside
  it); ``os.fchdir`` raises the refused ``os.chdir`` event.

Not closed: a string of a ``match`` pattern in a test, and the names a test reads (``obj.mango``), are still interned
before the program runs. The setup is compiled then too, but a task's setup runs in the program's namespace anyway,
so the program's code reads what the setup bound while a test runs (``globals()['cases'][x]`` for ``assert f(1) ==
cases[1]`` with ``cases = {1: 3, 2: 5}`` scores 1 in both modes): only a task that puts expected answers in its
setup hands them over; MBPP's setups build inputs only (two of 974, ``root = Node(1)``...), and its asserts are in
the tests.
"""
from __future__ import annotations

import sys
import time

import pytest

from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)
from tests.unit.test_sandbox_redteam import GOOD, TESTS, still_works  # noqa: F401

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

WRONG = "def f(x):\n    return 0\n"
JUDGE_WALK = ("hits = []\nfor c in object.__subclasses__() + type.__subclasses__(type):\n    try:\n"
              "        d = vars(c)\n"
              "    except TypeError:\n        continue\n    for v in list(d.values()):\n"
              "        g = getattr(v, '__globals__', None)\n        if type(g) is dict and '_make_guards' in g:\n"
              "            hits.append(g)\n")

ATTACKS = {
    "an audit hook of its own": ("import sys\ntry:\n    sys.addaudithook(lambda e, a: None)\nexcept Exception:\n"
                                 "    pass\n" + WRONG),
    "an audit hook that raises on the judge's events": (
        "import sys\ndef h(e, a):\n    if e in ('open', 'sys.setprofile', 'sys._getframe'):\n        raise SystemExit\n"
        "try:\n    sys.addaudithook(h)\nexcept BaseException:\n    pass\n" + WRONG),
    "spoofed audit events": (
        "import sys\nfor e, a in [('object.__getattr__', (None, '__defaults__')), ('sys.setprofile', ()),\n"
        "             ('sys._getframe', (None,)), ('import', ('x', None, None, None, None)), ('open', (3, 'w', 0))]:\n"
        "    try:\n        sys.audit(e, *a)\n    except BaseException:\n        pass\n" + WRONG),
    "frames of generators, coroutines and tracebacks": (
        "out = []\ndef g():\n    yield 1\nasync def c():\n    pass\nasync def ag():\n    yield 1\n"
        "for o, n in ((g(), 'gi_frame'), (c(), 'cr_frame'), (ag(), 'ag_frame')):\n    try:\n"
        "        out.append(getattr(o, n).f_back)\n    except BaseException:\n        pass\n"
        "def f(x):\n    try:\n        1 / 0\n    except ZeroDivisionError as e:\n        try:\n"
        "            return e.__traceback__.tb_frame.f_back.f_locals\n        except BaseException:\n"
        "            return 0\n"),
    "referents of a function's globals": (
        "import gc\ndef f(x):\n    try:\n"
        "        return [r for r in gc.get_referents(f.__globals__) if type(r) is dict][0]\n"
        "    except BaseException:\n        return 0\n"),
    "subclasses walked to the judge's code": (
        JUDGE_WALK + "if hits:\n    hits[0]['_make_guards'] = lambda *a: ()\n" + WRONG),
    "sys.modules look-alikes": (
        "import sys, types\nfor n in ('json', 'math', 'operator', 'copy', 'builtins', '_thread', 'gc', 'os', 'time',\n"
        "          'decimal', 're', 'itertools'):\n    m = types.ModuleType(n)\n"
        "    m.__getattr__ = lambda a: (lambda *x, **k: True)\n    sys.modules[n] = m\n" + WRONG),
    "the import caches emptied": (
        "import sys, importlib\nclass F:\n    @staticmethod\n    def find_spec(name, path=None, target=None):\n"
        "        return None\nsys.path_importer_cache.clear()\nfor p in list(sys.path):\n"
        "    sys.path_importer_cache[p] = None\nsys.meta_path.insert(0, F)\nimportlib.invalidate_caches()\n" + WRONG),
    "__init_subclass__ and __set_name__": (
        "class Base:\n    def __init_subclass__(cls, **k):\n        cls.__eq__ = lambda s, o: True\n"
        "class D(int, Base):\n    pass\nclass N:\n    def __set_name__(self, owner, name):\n"
        "        owner.__eq__ = lambda s, o: True\nclass E(int):\n    x = N()\n"
        "def f(x):\n    return [D(0), E(0)][x % 2]\n"),
    "an exception's text changes the builtins between tests": (
        ("import builtins\nclass X(Exception):\n    def __str__(self):\n        builtins.abs = lambda v: 0\n"
         "        builtins.all = builtins.bool = lambda *v: True\n        return 'x'\nn = []\n"
         "def f(x):\n    n.append(x)\n    if len(n) == 1:\n        raise X\n    return 0\n"),
        ["assert f(1) == 3", "assert abs(f(2) - 5) < 1", "assert all([f(3) == 7])", "assert bool(f(4) == 9)"]),
    "a __class__ that claims to be type": (  # (``own`` asks ``isinstance(fn, type)``, which reads ``__class__``)
        ("class O:\n    @property\n    def __class__(self):\n        return type\n    def __call__(self, *a):\n"
         "        return O()\n    def __eq__(self, o):\n        return True\n    __hash__ = object.__hash__\n"
         "def f(x):\n    return O()\n"), ["assert f(1)(2) == 5", "assert f(1)(2)(3) == [3]"]),
    "the verdict's limits lowered": (
        "import resource as r\ndef f(x):\n    r.setrlimit(r.RLIMIT_FSIZE, (0, 0))\n"
        "    r.setrlimit(r.RLIMIT_NOFILE, (0, 0))\n"
        "    try:\n        r.setrlimit(r.RLIMIT_AS, (1 << 22, 1 << 22))\n    except BaseException:\n        pass\n"
        "    return 0\n"),
    "every low descriptor closed": ("import os\ndef f(x):\n    for fd in range(10):\n        try:\n"
                                    "            os.close(fd)\n        except OSError:\n            pass\n"
                                    "    return 0\n"),
    "stdout put on the result descriptor": ("import os\ndef f(x):\n    os.dup2(1, 3)\n"
                                            "    print('\\nX 2 2 ok 0 none\\tx')\n    return 0\n"),
    "the result pipe reopened to read": (
        "import os\ngot = []\nfor p in ('/proc/self/fd/3', '/dev/fd/3', '/proc/thread-self/fd/3', '/dev/stdout'):\n"
        "    try:\n        got.append(os.open(p, os.O_RDONLY | os.O_NONBLOCK))\n    except OSError:\n        pass\n"
        "def f(x):\n    return len(got)\n"),
    "every signal blocked": (
        "import signal\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP})\n"
        "try:\n    signal.siginterrupt(signal.SIGTERM, False)\nexcept BaseException:\n    pass\n"
        "def f(x):\n    while True:\n        pass\n"),
    "SIGSTOP to itself": "import signal\ndef f(x):\n    signal.raise_signal(signal.SIGSTOP)\n    return 0\n",
    "a thread writing to the result pipe": (
        "import threading, os\ndef spin():\n    while True:\n        try:\n            os.write(3, b'x' * 65536)\n"
        "        except OSError:\n            pass\nthreading.Thread(target=spin, daemon=True).start()\n" + WRONG),
    "fork hooks, a shared mapping, an excepthook": (
        "import os, threading, mmap\nline = b'\\nX 2 2 ok 0 none\\tx\\n'\n"
        "os.register_at_fork(before=lambda: os.write(3, line), after_in_child=lambda: os.write(3, line))\n"
        "threading.excepthook = lambda a: None\nm = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED)\nm.write(b'r26')\n"
        + WRONG),
    "locks held on library files": (
        "import fcntl, os, json\nfor p in (os.__file__, json.__file__):\n    fd = os.open(p, os.O_RDONLY)\n"
        "    fcntl.flock(fd, fcntl.LOCK_EX)\n" + WRONG),
    "inodes used up, folders nested": (
        "import os\nos.makedirs('/'.join(['a'] * 200), exist_ok=True)\nn = 0\ntry:\n    while True:\n"
        "        os.mkdir(('a/' * 3 if n % 2 else '') + 'd' * 40 + str(n))\n        n += 1\nexcept OSError:\n    pass\n"
        + WRONG),
    "a huge recursion limit and a deep value": (
        "import sys\nsys.setrecursionlimit(10 ** 8)\nv = []\nfor _ in range(300000):\n    v = [v]\ndef f(x):\n"
        "    return v\n"),
    "other programs' folders and tests": (
        "import os, glob\nfound = []\nfor p in ['/proc', '/tmp', '..', '../..', '/dev/shm', '/run']:\n    try:\n"
        "        found += os.listdir(p)\n    except OSError:\n        pass\n"
        "for p in glob.glob('/proc/[0-9]*/cmdline') + glob.glob('../*/*'):\n    try:\n"
        "        found.append(open(p, 'rb').read())\n    except OSError:\n        pass\n" + WRONG),
    "a folder's descriptor as dir_fd, with ..": (
        "import os\nos.makedirs('a/b')\nfd = os.open('a/b', os.O_RDONLY)\n"
        "for p in ('../../../r26_out', '../../r26_in'):\n"
        "    try:\n        os.close(os.open(p, os.O_WRONLY | os.O_CREAT, dir_fd=fd))\n    except OSError:\n"
        "        pass\n" + WRONG),
    "fchdir into a folder of its own": (
        "import os\nos.makedirs('a/b')\ntry:\n    os.fchdir(os.open('a/b', os.O_RDONLY))\nexcept OSError:\n    pass\n"
        "open('../../../r26_fchdir', 'w').write('x')\n" + WRONG),
}
VALUES = {
    "lying protocol methods": (
        "class L(list):\n    def __len__(self): return 2\n    def __iter__(self): return iter([3, 5])\n"
        "    def __bool__(self): return True\n    def __index__(self): return 3\n    def __float__(self): return 3.0\n"
        "    def __hash__(self): return hash(3)\n"),
    "BaseException from protocol methods": (
        "class L(list):\n    def __iter__(self): raise GeneratorExit\n    def __len__(self): raise KeyboardInterrupt\n"
        "    def __eq__(self, o): raise SystemExit(0)\n"),
    "slow only when judged": ("import time\nclass L(list):\n    def __eq__(self, o):\n        time.sleep(10)\n"
                              "        return True\n"),
}
VALUE_TESTS = ["assert list(f(1)) == [3, 5]", "assert len(f(1)) == 2", "assert f(1) == [3, 5]", "assert f(1)",
               "assert float(f(1)) == 3.0", "assert hash(f(1)) == hash(3)"]
STATUS = {"an audit hook of its own": "error", "an audit hook that raises on the judge's events": "error",
          "spoofed audit events": "error", "referents of a function's globals": "error",
          "the result pipe reopened to read": "error", "other programs' folders and tests": "error",
          "a folder's descriptor as dir_fd, with ..": "error", "fchdir into a folder of its own": "error",
          "the verdict's limits lowered": "failed", "every signal blocked": "timeout"}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_zero(pool, name):
    program, tests = ATTACKS[name] if type(ATTACKS[name]) is tuple else (ATTACKS[name], TESTS)
    r = scores_zero(pool, name, program, tests)
    if name in STATUS:  # refused as a violation, judged with a verdict, or stopped by the wall clock
        assert r.status == STATUS[name], (r.status, r.detail)
    still_works(pool)


@pytest.mark.parametrize("name", list(VALUES))
def test_a_lying_value_is_untrusted_before_its_methods_run(pool, name):
    start = time.monotonic()
    r = scores_zero(pool, name, VALUES[name] + "def f(x):\n    return L()\n", VALUE_TESTS)
    assert "untrusted value of type L" in r.detail, r.detail
    assert time.monotonic() - start < 1.0  # nothing of L's ran: no sleep
    still_works(pool)


def test_no_function_of_the_judge_is_found_among_the_classes(pool):
    """The walk of ``ATTACKS``' ``subclasses`` attack, counted: a correct program that finds nothing scores 1."""
    r = pool.run(JUDGE_WALK + "def f(x):\n    return 2 * x + 1 + len(hits)\n", TESTS)
    assert r.reward() == 1.0, (r.status, r.detail)


def test_an_honest_program_that_warns_through_the_judges_frames_still_scores(pool):
    program = ("import warnings\nseen = []\nwarnings.showwarning = lambda *a, **k: seen.append(a[2:4])\n"
               "warnings.simplefilter('always')\ndef f(x):\n    for level in range(1, 8):\n"
               "        warnings.warn('w', stacklevel=level)\n    return 2 * x + 1\n")
    r = pool.run(program, TESTS)
    assert r.reward() == 1.0, (r.status, r.detail)


def test_mbpp_references_still_score_one(pool):
    """The honest-program check: MBPP's own solutions (five of the short ones) pass their tests in both modes."""
    from dstrain.data.tasks import load_mbpp
    from dstrain.rewards import score_tasks
    from tests.unit.test_tasks import data_file

    tasks = load_mbpp(str(data_file("mbpp.jsonl")), "train", max_reference_chars=100)[:5]
    assert score_tasks(tasks, [t.reference for t in tasks], pool) == [1.0] * len(tasks)


# What got through (see the module docstring), in both modes: the test's constants read before the test ran.
REFCOUNTS = ("import sys\nrc = getattr(sys, 'getrefcount', None)\n"
             "COUNTS = [rc(i) for i in range(-5, 257)] if rc else []\n"
             "print(','.join(map(str, COUNTS)))\nBASE = {base!r}\n"
             "def f(x):\n    base = [int(t) for t in BASE.split(',')] if BASE and COUNTS else []\n"
             "    up = [i - 5 for i, (a, b) in enumerate(zip(COUNTS, base)) if a > b and i - 5 != x]\n"
             "    return up[0] if len(up) == 1 else -1\n")


def test_a_test_constant_cannot_be_read_through_reference_counts(pool):
    """Before the fix: reward 1.0 in both modes. The program counted the references to each small int at its top
    level, with ``sys.getrefcount``, and compared with the counts of a run of the same program whose test expected
    1000 (no small int): the one count that had grown was the expected answer, a constant of the test's code, which
    is compiled before the program runs. ``sys.getrefcount`` is now removed (``_child._UNAUDITED``)."""
    pool.run(REFCOUNTS.format(base=""), ["assert f(1) == 1000"])  # (a fork server's first job counts apart)
    calibration = pool.run(REFCOUNTS.format(base=""), ["assert f(1) == 1000"])
    base = calibration.stdout.strip().splitlines()[-1] if calibration.stdout.strip() else ""
    scores_zero(pool, "reference counts", REFCOUNTS.format(base=base), ["assert f(1) == 200"])
    gone = "import sys\ndef f(x):\n    return 0 if hasattr(sys, 'getrefcount') else 2 * x + 1\n"
    assert pool.run(gone, TESTS).reward() == 1.0
    still_works(pool)


INTERNED = {
    "sys.intern": ("import sys\ndef f(x):\n    for w in x.split():\n        if sys.intern(w) is not w:\n"
                   "            return w\n"),
    "setattr's key": ("class O:\n    pass\ndef f(x):\n    for w in x.split():\n        o = O()\n"
    "        setattr(o, w, 1)\n"
                      "        if next(iter(vars(o))) is not w:\n            return w\n"),
}
WORD_TESTS = ["assert f('kiwi mango fig') == 'mango'", "assert f('plum grapefruit') == 'grapefruit'"]


@pytest.mark.parametrize("name", list(INTERNED))
def test_a_test_string_cannot_be_found_among_the_interned(pool, name):
    """Before the fix: reward 1.0 in both modes. A string constant of a test made only of letters, digits and ``_``
    was interned when the test was compiled, before the program ran, so the word of its input that the program found
    already interned was the test's expected answer. Such a constant is now made as the test runs
    (``_rewrite._fresh_strings``)."""
    scores_zero(pool, name, INTERNED[name], WORD_TESTS)
    assert pool.run("def f(x):\n    return max(x.split(), key=len)\n", WORD_TESTS).reward() == 1.0
    still_works(pool)


def test_tests_with_string_constants_everywhere_still_pass(pool):
    """An honest program against tests whose strings sit in dict keys, f-strings, tuples, keyword arguments, a
    comparison chain and a ``match`` (whose patterns keep their constants)."""
    tests = ["assert f('ab') == {'key': f'ab_{1}x', 'n': 'ab'}",
             "assert f('ab')['key'] in ('zz', 'ab_1x') and 'a' < f('ab')['n'] <= 'ab'",
             "assert sorted(['b', 'ab'], key=str.lower) == ['ab', 'b'] and max('a', 'b', key=len) == 'a'",
             "match f('ab')['n']:\n    case 'ab':\n        pass\n    case _:\n        assert False",
             "assert isinstance(f('cd'), dict) and f('cd').get('n', 'missing') == 'cd'"]
    r = pool.run("def f(x):\n    return {'key': x + '_1x', 'n': x}\n", tests)
    assert r.reward() == 1.0, (r.status, r.detail)
