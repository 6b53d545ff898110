"""Red team, round 19: programs a hostile policy could write, run through the sandbox in both modes.

Same rules as ``test_sandbox_redteam.py`` (whose helpers this file uses): the task is ``f(x) = 2x + 1``, no attack
computes it, each must get reward 0 (also with partial credit), and the same pool must afterwards still score a
correct program 1. This round looked at what the standard library's C libraries do on their own, with no audit
event. The holes it closed:

- a C library that reads the environment when first used, for what to load. OpenSSL, initialized by the first
  import of ``_hashlib`` (no module the sandbox loaded before the program imports it), reads the configuration file
  that ``OPENSSL_CONF`` names, and loads the shared objects its providers and engines name, from any path: the
  program wrote a shared object into its folder (its bytes in the program's text) and such a file, set
  ``os.environ['OPENSSL_CONF']`` and imported ``hashlib``; the object's constructor, machine code run by the dynamic
  loader, read the process's memory through ``/proc/self/mem`` (C's ``open``, which no audit hook sees), found the
  nonce, wrote the verdict and left with ``_exit(0)``: reward 1 in both modes. OpenSSL is now initialized before the
  program runs, with the trainer's environment (``_unaudited._READ_ENVIRONMENT_ONCE``); and no file of the program's
  can be mapped executable any more: its tmpfs is mounted ``noexec``, and ``os.memfd_create`` (an anonymous file,
  named ``/proc/self/fd/N``, that no mount's ``noexec`` covers: the same attack got reward 1 with the file there) is
  removed;
- ``nis``: its C library (``libnsl``) asks the portmapper on 127.0.0.1 for the NIS server, over TCP, and the DNS
  resolver for ``localhost``, over UDP, with no audit event: without namespaces the network is the trainer's (here
  the program's ``nis.maps`` connected to a socket the test listened on at port 111). It is refused by name.

What did not get past the sandbox, pinned here:

- the result descriptor (3 in a fork server's child, 4 in a spawned one) is the write end of a pipe: the program may
  write to it, duplicate it, send ``faulthandler``'s tracebacks or an exception hook's line to it, but a line without
  the nonce is not a verdict, and a descriptor put in its place (``os.dup2``) is not written to (a crash, reward 0);
  it cannot be read back, sought or mapped, so a thread of the program's cannot catch the nonce as it is written;
- memory a program could read the nonce from: ``/proc/self/mem``, ``code.replace`` (hand-made bytecode), the
  ``_test*`` and ``_xx*`` extension modules (``_testcapi``, sub-interpreters), ``_lsprof`` (a profiler enabled is a
  ``sys.setprofile``), ``_posixshmem`` and ``_multiprocessing`` are all refused;
- the interpreter's limits: a recursion limit lowered just above the tested function's depth, so that the judge's
  own checks of its always-equal result fail, crashes the run or still finds the value untrusted; an interval timer's
  ``SIGALRM`` kills the run; the CPU limit cannot be raised.

Not closed (``README.md``'s known limits): a task whose tests or setup import a third-party package with C code
(``numpy``) hands it to the program, loaded before the program runs. No check in the program's own process can
contain it: ``numpy`` writes any address as well as reading it (``__array_interface__``, ``as_strided``), so the
program could change the judge's state as easily as read the nonce.
"""
from __future__ import annotations

import base64
import dataclasses
import shutil
import socket
import subprocess
import sys

import pytest

from dstrain.rewards.sandbox import MODES, SandboxPool
from tests.unit.test_sandbox_redteam import GOOD, LIMITS, TESTS, still_works
from tests.unit.redteam_rounds import round_pool, scores_zero  # noqa: F401 (round_pool: the pool fixture)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox's isolation is Linux's")

# the result descriptor: 3 in a fork server's child, 4 in a spawned child (``run <fd> ...`` on its command line)
RESULT_FD = "import sys\nR = 4 if sys.argv[2] == 'run' else 3\n"
FORGED = r"b'\nabcd 2 2 ok 0 none\tall passed\n'"

VERDICT_CHANNEL = {
    "write a verdict-shaped line": RESULT_FD + f"import os\nos.write(R, {FORGED})\ndef f(x):\n    return 0\n",
    "put stdout in its place": RESULT_FD + "import os\nos.dup2(1, R)\ndef f(x):\n    return 0\n",
    "faulthandler to it": RESULT_FD + "import faulthandler\nfaulthandler.dump_traceback(R)\nfaulthandler.enable(R)\n"
                                      "def f(x):\n    return 0\n",
    "exception hooks forging": RESULT_FD + f"import os, sys, threading, atexit\nline = {FORGED}\n"
                                           "threading.excepthook = lambda a: os.write(R, line)\n"
                                           "sys.unraisablehook = sys.excepthook = lambda *a: os.write(R, line)\n"
                                           "atexit.register(os.write, R, line)\ndef f(x):\n    return 0\n",
}


@pytest.mark.parametrize("name", sorted(VERDICT_CHANNEL))
def test_the_result_descriptor_gives_nothing(pool, name):
    scores_zero(pool, name, VERDICT_CHANNEL[name], TESTS)
    still_works(pool)


def test_the_result_descriptor_cannot_be_read_back(pool):
    """A thread that could read the pipe (or a mapping of it, read with no system call, so holding the GIL) would
    see the verdict as the judge writes it, nonce included, and write its own after it."""
    program = RESULT_FD + ("import os, mmap\nfor name, a in (('pread', lambda: os.pread(R, 10, 0)),\n"
                           "        ('lseek', lambda: os.lseek(R, 0, 0)),\n"
                           "        ('mmap', lambda: mmap.mmap(R, 4096, mmap.MAP_SHARED, mmap.PROT_READ))):\n"
                           "    try:\n        a()\n        print('READ', name)\n    except OSError as e:\n"
                           "        print('refused', name, e.errno)\ndef f(x):\n    return 0\n")
    r = scores_zero(pool, "reading the result pipe", program, TESTS)
    assert "READ" not in r.stdout and r.stdout.count("refused") == 3, r.stdout
    still_works(pool)


MEMORY = {
    "/proc/self/mem": "open('/proc/self/mem', 'rb')\n",
    "code.replace": "(lambda: 1).__code__.replace(co_consts=(None, 2))\n",
    "_lsprof": "import _lsprof\n_lsprof.Profiler().enable()\n",
    **{m: f"import {m}\n" for m in ("_testcapi", "_testinternalcapi", "_ctypes_test", "_xxsubinterpreters",
                                    "_testbuffer", "_posixshmem", "_multiprocessing")},
}


@pytest.mark.parametrize("name", sorted(MEMORY))
def test_what_reads_memory_is_refused(pool, name):
    program = f"try:\n    {MEMORY[name].strip().replace(chr(10), chr(10) + '    ')}\n    print('GOT')\n" \
              "except (ImportError, PermissionError, ValueError) as e:\n    print('refused', type(e).__name__)\n" \
              "def f(x):\n    return 0\n"
    r = scores_zero(pool, name, program, TESTS)
    assert "GOT" not in r.stdout and "refused" in r.stdout, (r.stdout, r.detail)
    assert r.status == "error" and "violation" in (r.detail or ""), (r.status, r.detail)


# lowers the recursion limit, from inside the tested function, to K frames above the depth it runs at
RECURSION = r"""import sys
class E:
    def __eq__(self, o):
        return True
    __hash__ = object.__hash__
def f(x):
    lo, hi = 1, sys.getrecursionlimit()
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            sys.setrecursionlimit(mid)
            hi = mid
        except RecursionError:
            lo = mid + 1
    sys.setrecursionlimit(lo + K)
    return E()
"""


@pytest.mark.parametrize("k", [1, 3, 5, 20])
def test_a_recursion_limit_just_above_the_test_scores_zero(pool, k):
    r = scores_zero(pool, f"recursion limit {k} above", RECURSION.replace("K", str(k)), TESTS)
    assert r.status in ("crash", "failed", "error"), (r.status, r.detail)
    still_works(pool)


def test_interval_timer_and_limits(pool):
    scores_zero(pool, "SIGALRM", "import signal\nsignal.setitimer(signal.ITIMER_REAL, 0.01)\n"
                "def f(x):\n    return 0\n", TESTS)
    program = ("import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n    print('RAISED')\n"
               "except ValueError:\n    print('refused')\ndef f(x):\n    return 0\n")
    r = scores_zero(pool, "raise the CPU limit", program, TESTS)
    assert "RAISED" not in r.stdout, r.stdout
    still_works(pool)


NIS = ("try:\n    import nis\n    print('IMPORTED')\n    nis.maps('sandbox')\nexcept Exception as e:\n"
       "    print('refused', type(e).__name__)\ndef f(x):\n    return 0\n")


def test_nis_is_refused(pool):
    """``nis``'s C library asks the portmapper on 127.0.0.1 (port 111) and the DNS resolver, with no audit event."""
    r = scores_zero(pool, "nis", NIS, TESTS)
    assert "IMPORTED" not in r.stdout and r.status == "error" and "nis" in (r.detail or ""), (r.stdout, r.detail)
    still_works(pool)


def _portmapper_port():
    """A listening socket on the portmapper's port, 127.0.0.1:111, where one can be bound (root, none running)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 111))
        s.listen(8)
        s.setblocking(False)
        return s
    except OSError:
        s.close()
        return None


@pytest.mark.parametrize("mode", MODES)
def test_without_namespaces_nis_touches_no_network(mode):
    """Without a network namespace the sandbox's network is the trainer's: ``nis.maps`` connected to the host's
    portmapper (seen here where the test may listen on its port) and sent a query to the DNS resolver."""
    listener = _portmapper_port()
    try:
        with SandboxPool(workers=1, limits=dataclasses.replace(LIMITS, mode=mode, namespaces=False,
                                                                 drop_root=False)) as pool:
            r = scores_zero(pool, "nis without namespaces", NIS, TESTS)
            assert "IMPORTED" not in r.stdout and "nis" in (r.detail or ""), (r.stdout, r.detail)
            assert pool.run(GOOD, TESTS).reward() == 1.0
        if listener is not None:
            with pytest.raises(BlockingIOError):
                listener.accept()[0].close()  # (no connection came)
    finally:
        if listener is not None:
            listener.close()



# machine code run as the dynamic loader loads it: reads the process's memory through /proc/self/mem for the nonce (a
# bytes object of 32 hex digits: its size, its hash, the digits, a NUL), writes the verdict to 3 and 4, leaves
NATIVE_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static int hex(const unsigned char *p) {
    for (int i = 0; i < 32; i++)
        if (!((p[i] >= '0' && p[i] <= '9') || (p[i] >= 'a' && p[i] <= 'f'))) return 0;
    return 1;
}
__attribute__((constructor)) static void run(void) {
    static unsigned char buf[1 << 20];
    char line[256], perms[8];
    unsigned long lo, hi, size;
    FILE *maps = fopen("/proc/self/maps", "r");
    int mem = open("/proc/self/mem", O_RDONLY);
    write(1, "NATIVE CODE RAN\n", 16);
    if (!maps || mem < 0) return;
    while (fgets(line, sizeof line, maps)) {
        if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) != 3 || perms[0] != 'r' || strstr(line, "[vvar]")) continue;
        for (unsigned long a = lo; a < hi; a += sizeof buf - 64) {
            ssize_t got = pread(mem, buf, hi - a < sizeof buf ? hi - a : sizeof buf, (off_t)a);
            for (ssize_t i = 0; i + 49 <= got; i += 8) {
                memcpy(&size, buf + i, 8);
                if (size == 32 && hex(buf + i + 16) && buf[i + 48] == 0) {
                    int k = snprintf(line, sizeof line, "\n%.32s 2 2 ok 0 none\tall passed\n", buf + i + 16);
                    write(3, line, k);
                    write(4, line, k);
                }
            }
        }
    }
    _exit(0);
}
"""
# writes the shared object (into its folder, or an anonymous file), names it in an OpenSSL configuration of its own
OPENSSL_LOADS = r"""import base64, os
data = base64.b64decode(SO)
if WHERE == 'memfd':
    fd = os.memfd_create('p')
    os.write(fd, data)
    path = '/proc/self/fd/%d' % fd
else:
    open('p.so', 'wb').write(data)
    path = os.path.join(os.getcwd(), 'p.so')
with open('o.cnf', 'w') as f:
    f.write('openssl_conf = i\n[i]\nproviders = p\n[p]\nx = s\n[s]\nmodule = %s\nactivate = 1\n' % path)
os.environ['OPENSSL_CONF'] = os.path.join(os.getcwd(), 'o.cnf')
import hashlib
def f(x):
    return 0
"""


@pytest.fixture(scope="module")
def native_object(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("native")
    (folder / "n.c").write_text(NATIVE_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-s", "-o", str(folder / "n.so"), str(folder / "n.c")], check=True)
    return base64.b64encode((folder / "n.so").read_bytes()).decode()


@pytest.mark.parametrize("where", ["folder", "memfd"])
def test_openssl_loads_no_shared_object_of_the_program(pool, native_object, where):
    program = OPENSSL_LOADS.replace("SO", repr(native_object)).replace("WHERE", repr(where))
    r = scores_zero(pool, f"OpenSSL loading the program's shared object ({where})", program, TESTS)
    assert "NATIVE" not in r.stdout, (r.stdout, r.detail)
    still_works(pool)


@pytest.mark.parametrize("mode", MODES)
def test_without_namespaces_openssl_loads_no_shared_object_of_the_program(mode, native_object):
    """Without namespaces the program's folder is no ``noexec`` tmpfs: only OpenSSL's configuration, read before the
    program runs, stands in the way."""
    program = OPENSSL_LOADS.replace("SO", repr(native_object)).replace("WHERE", repr("folder"))
    with SandboxPool(workers=1, limits=dataclasses.replace(LIMITS, mode=mode, namespaces=False,
                                                             drop_root=False)) as pool:
        r = scores_zero(pool, "OpenSSL loading the program's shared object, no namespaces", program, TESTS)
        assert "NATIVE" not in r.stdout, (r.stdout, r.detail)
        assert pool.run(GOOD, TESTS).reward() == 1.0


def test_openssl_reads_no_configuration_of_the_program(pool):
    """The same, with no compiler: a configuration of the program's that asks for FIPS algorithms only (none here)
    would make ``sha256`` unsupported; OpenSSL has read the trainer's before the program runs. An honest program
    still sets its environment and hashes."""
    program = ("import os\nwith open('o.cnf', 'w') as f:\n"
               "    f.write('openssl_conf = i\\n[i]\\nalg_section = a\\n[a]\\ndefault_properties = fips=yes\\n')\n"
               "os.environ['OPENSSL_CONF'] = os.path.join(os.getcwd(), 'o.cnf')\nimport hashlib\n"
               "digest = hashlib.sha256(b'abc').hexdigest()\n"
               "def f(x):\n    assert digest.startswith('ba7816bf') and os.environ['OPENSSL_CONF'].endswith('o.cnf')\n"
               "    return 2 * x + 1\n")
    r = pool.run(program, TESTS)
    assert (r.status, r.passed) == ("passed", 2), (r.detail, r.stderr[-500:])
