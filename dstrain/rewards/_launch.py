"""Stage 1 of a sandbox child (``launch``): isolation and limits, before any untrusted byte is read; runs only
inside a sandbox child, or in the trainer for tests of :func:`_map_own_ids`.

Its text is put after ``_unaudited.py``'s and in front of ``_child.py``'s, and executed in the same private globals
(see ``sandbox.py``); ``_child.py`` re-exports its names in the trainer. :func:`_launch` tries ``unshare`` of a
network and a PID namespace, then of a mount namespace (:func:`_private_mounts`), drops the capabilities, switches to
an unprivileged uid when asked, sets ``no_new_privs`` and the resource limits (:func:`_set_limits`, which the fork
server also calls for each job), and re-executes a fresh interpreter for the ``run`` (or ``serve``) stage.
"""

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME = 1, 2, 4, 8, 32, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
TMPFS_BYTES, TMPFS_INODES = 64 << 20, 8192
"""Size and files (and folders) of the tmpfs a sandboxed program (or a fork server's programs, one at a time)
may fill: the fork server removes a job's folder before the next job starts, so its entries are capped."""


def _launch(cfg: dict, result_fd: int) -> None:
    """Stage 1: isolate this process, limit it, and exec the ``run`` stage."""
    import ctypes
    import os
    import sys

    notes = []
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        libc = None
    pid_ns = False
    if cfg["namespaces"] and libc is not None:
        ids = os.geteuid(), os.getegid()
        for flags, label in ((CLONE_NEWNET | CLONE_NEWPID, "netns,pidns"),
                             (CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID, "userns,netns,pidns"),
                             (CLONE_NEWNET, "netns"), (CLONE_NEWUSER | CLONE_NEWNET, "userns,netns")):
            if libc.unshare(flags) == 0:
                notes.append(label)
                pid_ns = "pidns" in label
                if flags & CLONE_NEWUSER:
                    _map_own_ids(*ids)
                break
    fresh_proc = False
    if cfg["namespaces"] and libc is not None:
        mounts = _private_mounts(libc, cfg)
        if mounts:
            notes.append(mounts)
            fresh_proc = pid_ns
    if libc is not None and os.geteuid() == 0:
        try:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last = int(f.read())
        except (OSError, ValueError):
            last = 40
        if all(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0 for cap in range(last + 1)):
            notes.append("nocaps")
    if cfg.get("uid") is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        notes.append(f"uid={cfg['uid']}")
    if libc is not None and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        notes.append("nonewprivs")
    _set_limits(cfg)
    isolation = ",".join(notes) or "none"
    # One string hash for every run (a wrong program must not pass by the luck of a set's order): ``-I`` would
    # ignore PYTHONHASHSEED, so where ``-P`` exists its parts but ``-E`` are given, with an environment of our own.
    env = {k: os.environ[k] for k in ("PATH", "LANG", "HOME", "TMPDIR") if k in os.environ}
    flags = ["-I"]
    if sys.version_info >= (3, 11):
        flags, env["PYTHONHASHSEED"] = ["-s", "-P"], "0"
    if cfg.get("stage") == "serve":  # a fork server (see _server.py): per-program limits come with each job
        argv = [sys.executable, *flags, "-B", "-c", STUB, sys.argv[1], "serve", sys.argv[5], isolation]  # noqa: F821
    else:
        argv = [sys.executable, *flags, "-B", "-c", STUB, sys.argv[1], "run", str(result_fd), isolation,  # noqa: F821
                str(cfg["nproc"])]
    if not pid_ns:
        os.execve(sys.executable, argv, env)
    alive_r, alive_w = os.pipe()  # (at EOF for the child once this process is gone)
    pid = os.fork()  # the child is the init of the new PID namespace
    if pid == 0:
        try:
            # This process's death (the trainer's SIGKILL of its group at the deadline) kills the namespace's init,
            # and with it every process of the namespace: a program that left the group (``os.setsid``) outlived
            # the run, sleeping for ever with its 64 MiB tmpfs (red-team round 31). No program can undo it (no prctl).
            os.close(alive_w)
            if libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:  # (9: SIGKILL)
                os._exit(127)
            os.set_blocking(alive_r, False)
            try:
                if not os.read(alive_r, 1):
                    os._exit(127)  # this process died before the signal was armed
            except BlockingIOError:
                pass
            os.close(alive_r)
            # a /proc of this PID namespace: the trainer's processes are not even listed
            if fresh_proc and libc.mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                         None) == 0:
                argv[argv.index(isolation)] = isolation + ",procfs"
            os.execve(sys.executable, argv, env)
        finally:
            os._exit(127)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


def _map_own_ids(uid: int, gid: int) -> None:
    """In the new user namespace (an unprivileged trainer), map this process's own uid and gid
    to themselves. Unmapped, it could create no file on the tmpfs mounted inside the namespace
    (EOVERFLOW: its ids have no owner there), so no program could run. Mapped to themselves,
    not to 0, the process keeps no capabilities in the namespace once it execs, so the
    program cannot undo the read-only remounts. Left unmapped if the kernel refuses."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            return


def _private_mounts(libc, cfg: dict) -> str:
    """In a new mount namespace, mount a fresh tmpfs of :data:`TMPFS_BYTES` on the working
    directory (the program's files then never reach a disk nor the trainer's view of that
    folder) and remount every other mount read-only, so that nothing outside it can be
    created or changed even by calls no audit event covers (``mknod``, ``mkfifo``). Returns
    ``"mntns,rofs"``, ``"mntns"`` when some remount failed, or ``""`` when not permitted."""
    import os

    if libc.unshare(CLONE_NEWNS) != 0:
        return ""
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return ""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            table = [line.split() for line in f.read().splitlines()]
    except OSError:
        return ""
    keep = {b"nosuid": MS_NOSUID, b"nodev": MS_NODEV, b"noexec": MS_NOEXEC, b"noatime": MS_NOATIME,
            b"nodiratime": MS_NODIRATIME, b"relatime": MS_RELATIME}
    here = os.getcwd()
    opts = f"size={TMPFS_BYTES},nr_inodes={TMPFS_INODES},mode=0700"
    if cfg.get("uid") is not None:
        opts += f",uid={cfg['uid']},gid={cfg['gid']}"
    if libc.mount(b"tmpfs", os.fsencode(here), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, opts.encode()) != 0:
        return ""
    os.chdir(here)  # into the new tmpfs
    failed = 0
    for row in table:
        if len(row) < 6:
            continue
        point = row[4]
        for code in set(point.split(b"\\")[1:]):  # mountinfo escapes spaces etc. as \ooo
            if code[:3].isdigit():
                point = point.replace(b"\\" + code[:3], bytes([int(code[:3], 8)]))
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        for opt in row[5].split(b","):
            flags |= keep.get(opt, 0)
        if libc.mount(None, point, None, flags, None) != 0:
            failed += 1
    return "mntns" if failed else "mntns,rofs"


def _set_limits(cfg: dict) -> None:
    """Sets the resource limits ``cfg`` names (``cpu``, ``mem``, ``fsize``, ``nofile``; a
    missing or None entry is left as it is) and ``RLIMIT_CORE=0``."""
    import resource

    limits = [(resource.RLIMIT_CORE, 0, 0)]
    if cfg.get("cpu") is not None:
        limits.append((resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1))
    for key, which in (("mem", resource.RLIMIT_AS), ("fsize", resource.RLIMIT_FSIZE),
                       ("nofile", resource.RLIMIT_NOFILE)):
        if cfg.get(key) is not None:
            limits.append((which, cfg[key], cfg[key]))
    for which, soft, hard in limits:
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            pass
