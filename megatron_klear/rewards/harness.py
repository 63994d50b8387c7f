"""The trusted first stage of every sandboxed run; the untrusted program runs after it, in-process.

This file is executed as a script by the sandbox's interpreter (standard library only, Python >= 3.8;
it never imports megatron_klear). In order, before any untrusted byte runs, it:
1. sets the resource limits (CPU, address space, file size, open files, processes, no core);
2. reads the program (so the program file can stay unreadable to the program's uid);
3. drops to the run's private uid/gid with no supplementary groups (when started as root);
4. installs the seccomp filter itself when the sandbox could not (fallback mode), after
   PR_SET_NO_NEW_PRIVS so setuid binaries cannot regain privileges;
   in fallback mode it first forks: the parent stays root as the run's reaper (see `_reaper`);
5. writes one byte to the status pipe and closes it: the grader's proof that the sandbox came up.
   A run without that byte is a sandbox failure, never charged to the program.

It knows nothing of expected outputs: a test's input arrives on stdin, the program's answer leaves
on stdout (stdin/stdout tests) or as one JSON line after RESULT_MARKER (function-call tests, and
expression tests -- a `functional` check's call, evaluated after the program's code -- where the
program's own prints are redirected to stderr). Whatever the program does to this harness
(patching it, inspecting its frames, exiting early) can only change the bytes it hands over, and
the grader compares those bytes itself.

The seccomp filter (`seccomp_filter`) is also imported by the grader, which hands it to bubblewrap.
"""

import os
import sys

RESULT_MARKER = b"\n@@klear-result@@"

# Arguments, positionally (no json import on the stdin/stdout path: startup time is the cost of a test).
_ARGS = (
    "mode",
    "status_fd",
    "code_path",
    "workdir",
    "uid",
    "gid",
    "cpu_s",
    "memory_bytes",
    "file_bytes",
    "open_files",
    "processes",
    "fallback",
    "fn_name",
)

# ----------------------------------------------------------------------------- seccomp (BPF)

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# Denied outright (EPERM): namespace and mount tricks, tracing other processes, io_uring (it can
# open sockets behind the socket() check), kernel keyrings, eBPF, perf, userfaultfd.
_DENY = {
    "x86_64": {
        "unshare": 272,
        "setns": 308,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "chroot": 161,
        "acct": 163,
        "open_by_handle_at": 304,
        "kexec_load": 246,
    },
    "aarch64": {
        "unshare": 97,
        "setns": 268,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "chroot": 51,
        "acct": 89,
        "open_by_handle_at": 265,
        "kexec_load": 104,
    },
}
_SOCKET = {"x86_64": 41, "aarch64": 198}
_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE3 = 435
_CLONE_NAMESPACES = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_AF_UNIX = 1
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_EPERM, _EACCES, _ENOSYS = 1, 13, 38


def seccomp_filter(machine=None):
    """The BPF program (bytes of struct sock_filter) that keeps a program off the network.

    Allows every syscall except: socket() for any family but AF_UNIX (EACCES), the _DENY list
    (EPERM), clone() with namespace flags (EPERM), clone3 (ENOSYS, so libc falls back to clone,
    whose flags we can inspect), and any foreign ABI (x32, i386: the process is killed, since
    its syscall numbers would dodge these rules). None on architectures we have no table for.
    """
    import struct

    machine = machine or os.uname().machine
    if machine not in _AUDIT_ARCH:
        return None
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog = []  # (code, jt_label, jf_label, k); labels resolved below

    def emit(code, k, jt=None, jf=None):
        prog.append([code, jt, jf, k])

    emit(ld, 4)  # seccomp_data.arch
    emit(jeq, _AUDIT_ARCH[machine], None, "kill")
    emit(ld, 0)  # seccomp_data.nr
    if machine == "x86_64":
        emit(jge, 0x40000000, "kill", None)  # x32 ABI
    for nr in sorted(_DENY[machine].values()):
        emit(jeq, nr, "eperm", None)
    emit(jeq, _CLONE3, "enosys", None)
    emit(jeq, _CLONE[machine], "clone", None)
    emit(jeq, _SOCKET[machine], "socket", "allow")
    labels = {"clone": len(prog)}
    emit(ld, 16)  # args[0], low 32 bits
    emit(jset, _CLONE_NAMESPACES, "eperm", "allow")
    labels["socket"] = len(prog)
    emit(ld, 16)
    emit(jeq, _AF_UNIX, "allow", "eacces")
    for name, value in (
        ("allow", _RET_ALLOW),
        ("eperm", _RET_ERRNO | _EPERM),
        ("eacces", _RET_ERRNO | _EACCES),
        ("enosys", _RET_ERRNO | _ENOSYS),
        ("kill", _RET_KILL_PROCESS),
    ):
        labels[name] = len(prog)
        emit(ret, value)
    out = []
    for i, (code, jt, jf, k) in enumerate(prog):
        jt_off = 0 if jt is None else labels[jt] - i - 1
        jf_off = 0 if jf is None else labels[jf] - i - 1
        assert 0 <= jt_off < 256 and 0 <= jf_off < 256
        out.append(struct.pack("=HBBI", code, jt_off, jf_off, k))
    return b"".join(out)


def _install_seccomp(prog):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _Fprog(len(prog) // 8, ctypes.addressof(buf))
    ul = ctypes.c_ulong
    if libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)) != 0:  # PR_SET_SECCOMP, FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


# ----------------------------------------------------------------------------- setup


def _setup(a):
    import resource

    cpu = int(a["cpu_s"])
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, int(a["memory_bytes"])),
        (resource.RLIMIT_FSIZE, int(a["file_bytes"])),
        (resource.RLIMIT_NOFILE, int(a["open_files"])),
        (resource.RLIMIT_NPROC, int(a["processes"])),
    ]
    for which, value in limits:
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))

    with open(a["code_path"], "rb") as f:
        code = f.read()

    uid, gid = int(a["uid"]), int(a["gid"])
    if uid >= 0 and os.getuid() == 0:
        os.chown(a["workdir"], uid, gid)
        os.chmod(a["workdir"], 0o700)
        # The grader's pipes belong to root: hand them to the program's uid so that reopening
        # them (open("/dev/stdin"), /proc/self/fd/1) works as it does outside a sandbox.
        for fd in (0, 1, 2):
            try:
                os.fchown(fd, uid, gid)
            except OSError:
                pass
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
            raise OSError("privilege drop did not take")
    if a["fallback"] == "1":
        prog = seccomp_filter()
        if prog is None:
            raise OSError("no seccomp table for " + os.uname().machine)
        _install_seccomp(prog)
    os.chdir(a["workdir"])
    os.umask(0o077)
    return code


_PRELUDE = (
    "from typing import *\nfrom collections import *\nfrom itertools import *\n"
    "from functools import *\nfrom heapq import *\nfrom bisect import *\n"
    "import math, heapq, bisect, collections, itertools, functools, re, string, sys\n"
    "from math import inf, gcd, sqrt, floor, ceil, log\n"
)


def _jsonable(x):
    if isinstance(x, (set, frozenset)):
        try:
            return sorted(x)
        except TypeError:
            return list(x)
    raise TypeError("result of type %s is not JSON serialisable" % type(x).__name__)


def _compile_expr_test(source):
    """An expression test (the checks of a `functional` test turned into one expression each):
    setup statements, then the expression whose value is the program's answer. Compiled before
    the program runs; it names no expected value (the grader keeps those)."""
    import ast

    tree = ast.parse(source, "<test>")
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        raise ValueError("an expression test must end with an expression")
    setup = ast.Module(body=tree.body[:-1], type_ignores=[])
    return (compile(setup, "<test>", "exec"), compile(ast.Expression(body=tree.body[-1].value), "<test>", "eval"))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _prctl(option, arg):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ul = ctypes.c_ulong
    if libc.prctl(option, ul(arg), ul(0), ul(0), ul(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(%d)" % option)


def _reaper(a, status_fd):
    """Fallback mode only (no PID namespace): fork; the child becomes the program, this process
    stays root as a child subreaper, so every orphan the program leaves is re-parented here, not
    to init (which may never reap it). When the program's main process ends, it kills every
    process of the run's uid (kill(-1) from a helper that drops to that uid), reaps them all and
    exits with the main process's status (128+N for a signal, as bubblewrap reports it).
    Returns only in the child."""
    import signal

    _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    main_pid = os.fork()
    if main_pid == 0:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(status_fd)
    uid, gid = int(a["uid"]), int(a["gid"])
    status = None
    while status is None:  # reap until the main process ends
        try:
            pid, st = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == main_pid:
            status = st
    while True:  # then: anything of the run still alive is our (possibly adopted) child
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break  # nothing left: the common case, no helper needed
        if pid != 0:
            continue  # reaped a dead one; look again
        if os.fork() == 0:  # some are alive: kill every process of the uid, then reap them all
            try:
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
        break
    code = os.waitstatus_to_exitcode(status) if status is not None else 125
    os._exit(128 - code if code < 0 else code)


def main(argv):
    if len(argv) != len(_ARGS):
        sys.stderr.write("harness: expected %d arguments, got %d\n" % (len(_ARGS), len(argv)))
        os._exit(125)
    a = dict(zip(_ARGS, argv))
    status_fd = int(a["status_fd"])
    try:
        if a["fallback"] == "1" and int(a["uid"]) >= 0 and os.getuid() == 0:
            _reaper(a, status_fd)
        code = _setup(a)
        call_args = None
        if a["mode"] == "call":
            import json

            if hasattr(sys, "set_int_max_str_digits"):
                sys.set_int_max_str_digits(0)
            call_args = json.loads(sys.stdin.buffer.read())
            if not isinstance(call_args, list):
                raise ValueError("call arguments must be a JSON list")
        elif a["mode"] == "expr":
            if hasattr(sys, "set_int_max_str_digits"):
                sys.set_int_max_str_digits(0)
            call_args = _compile_expr_test(sys.stdin.buffer.read().decode("utf-8"))
    except BaseException as e:  # noqa: BLE001 -- the sandbox failed to come up: say so, not started
        sys.stderr.write("harness: setup failed: %r\n" % (e,))
        os._exit(125)
    os.write(status_fd, b"S")
    os.close(status_fd)
    sys.argv = ["solution.py"]

    if a["mode"] == "stdio":
        del a, argv
        g = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": "solution.py"}
        exec(compile(code, "solution.py", "exec"), g)
        return

    # Function-call and expression tests: the program's prints go to stderr; the result goes to
    # the saved stdout.
    import json
    import types

    dumps = json.dumps
    sys.stdout.flush()
    result_fd = os.dup(1)
    os.dup2(2, 1)
    fn_name = a["fn_name"]
    module = types.ModuleType("solution")  # `from solution import f` in a test's setup finds it
    g = module.__dict__
    g.update({"__name__": "__solution__", "__builtins__": __builtins__, "__file__": "solution.py"})
    sys.modules["solution"] = module
    exec(compile(_PRELUDE, "<prelude>", "exec"), g)
    exec(compile(code, "solution.py", "exec"), g)
    if a["mode"] == "expr":
        setup, expr = call_args
        t = dict(g)
        exec(setup, t)
        result = eval(expr, t)
    else:
        cls = g.get("Solution")
        if isinstance(cls, type) and hasattr(cls, fn_name):
            target = getattr(cls(), fn_name)
        elif callable(g.get(fn_name)):
            target = g[fn_name]
        else:
            raise NameError("no function %r and no class Solution with that method" % fn_name)
        result = target(*call_args)
    payload = dumps(result, default=_jsonable).encode("utf-8")
    sys.stdout.flush()
    sys.stderr.flush()
    _write_all(result_fd, RESULT_MARKER + payload + b"\n")
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
