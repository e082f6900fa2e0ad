"""Judge mode's fork server for Python: started by the judge driver (python3 -I -c <this>) with its control
socket on fd 3 before any case runs; it compiles main.py once, then forks one child per case, which becomes
what `python3 main.py` would be -- fresh module __main__, sys.argv, sys.path[0] -- on the case's stdin/stdout/
stderr (three descriptors the driver sends with each request). It saves an interpreter start per case.

It holds nothing secret (expected outputs stay in the driver), it is non-dumpable (a case cannot write its
memory through /proc), and the driver trusts it for nothing a program could gain from: the driver reads every
output through its own pipes, kills on its own deadlines, and a fork server that stops answering is replaced.
Frames on the socket: request b"R" + SCM_RIGHTS(stdin, stdout, stderr); replies struct "!q" (the child's pid)
right after the fork, then "!qqqd" (pid, wait status, peak RSS in KiB, CPU seconds) once it has ended."""
import array
import ctypes
import os
import socket
import struct
import sys

PR_SET_DUMPABLE = 4


def _serve() -> list[int]:
    """Answers requests until the driver closes the socket; returns in each forked child with its stdio."""
    libc = ctypes.CDLL(None)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit("zygote: prctl(PR_SET_DUMPABLE) failed")
    control = socket.socket(fileno=3)
    while True:
        fds = array.array("i")
        msg, ancillary, _, _ = control.recvmsg(1, socket.CMSG_SPACE(3 * fds.itemsize))
        if not msg:
            os._exit(0)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if len(fds) != 3:
            os._exit(3)
        pid = os.fork()
        if pid == 0:
            control.close()
            libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as an exec'd program would be
            os.setsid()
            return list(fds)
        for fd in fds:
            os.close(fd)
        control.sendall(struct.pack("!q", pid))
        # Wait first without reaping: a case may kill this process, and where the kill lands after the case has
        # ended (this process idle on the case's CPU) reaping it first would take its exit status along. Unreaped,
        # the case is then the driver's zombie to reap, status and all.
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        _, status, usage = os.wait4(pid, 0)
        control.sendall(struct.pack("!qqqd", pid, status, usage.ru_maxrss, usage.ru_utime + usage.ru_stime))


with open("/work/main.py", "rb") as _f:
    _code = compile(_f.read(), "/work/main.py", "exec")  # a SyntaxError ends the zygote: the driver execs instead
_fds = _serve()
for _target, _fd in enumerate(_fds):
    os.dup2(_fd, _target)
    os.close(_fd)
os.closerange(3, 65536)
sys.argv[:] = ["main.py"]
sys.path[0:0] = ["/work"]
_main = type(sys)("__main__")
_main.__file__ = "/work/main.py"
_main.__builtins__ = __builtins__
sys.modules["__main__"] = _main
del _f, _fds, _target, _fd, _serve, array, ctypes, socket, struct


def _exit_status(exc: SystemExit) -> int:
    """What the interpreter makes of a SystemExit."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


try:
    exec(_code, _main.__dict__)
    _status = 0
except SystemExit as _exc:
    _status = _exit_status(_exc)
except BaseException:
    sys.excepthook(*sys.exc_info())
    _status = 1
# The interpreter's own exit, minus tearing down every module (milliseconds a case does not need): wait for
# non-daemon threads, run atexit handlers, flush (a failed flush is status 120, as there).
if "threading" in sys.modules:
    sys.modules["threading"]._shutdown()
import atexit  # noqa: E402

atexit._run_exitfuncs()
for _stream in (sys.stdout, sys.stderr):
    try:
        _stream.flush()
    except Exception:
        _status = 120
os._exit(_status)
