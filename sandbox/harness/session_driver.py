"""A session's driver, the container's init: a persistent Python namespace that runs one cell per request.

Requests and replies are length-prefixed JSON on the descriptors the service gave as stdin and stdout; a
cell's own stdout and stderr are captured in memfds (so a subprocess's output is caught too), the value of a
trailing expression is shown as text/plain display data, and an exception becomes {ename, evalue, traceback}.
The cells are the session owner's own code: nothing here is a verdict, so nothing needs hiding from them; they
run in this process and could write to the reply pipe, so the service frames replies by each request's id and
bounds every field itself (sandbox/sessions.py). Display text is cut here too, to keep honest replies small."""
import ast
import json
import os
import re
import struct
import signal
import sys
import time
import traceback

_OUTPUT_BYTES = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20


def _read(fd: int, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            raise SystemExit(0)  # the service closed the session
        data += chunk
    return data


def _send(fd: int, message: dict) -> None:
    """One reply frame, valid UTF-8 whatever the cell's text holds: a lone surrogate (an exception's message, a
    repr) becomes U+FFFD, as undecodable output bytes do (the service refuses a reply it could not pass on)."""
    text = json.dumps(message, ensure_ascii=False)
    try:
        body = text.encode()
    except UnicodeEncodeError:
        body = re.sub("[\ud800-\udfff]", "\ufffd", text).encode()
    os.write(fd, struct.pack("<I", len(body)) + body)


def _captured(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, _OUTPUT_BYTES)
    os.close(fd)
    return data.decode("utf-8", "replace")


def _run(code: str, scope: dict) -> dict:
    result: dict = {"display": [], "error": []}
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
            if value is not None:
                result["display"].append({"text/plain": repr(value)[:_OUTPUT_BYTES]})
    except BaseException as e:  # SystemExit and KeyboardInterrupt in a cell end the cell, not the session
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":  # from the cell's own frames
            tb = tb.tb_next
        result["error"].append({"ename": type(e).__name__, "evalue": str(e)[:_OUTPUT_BYTES],
                                "traceback": [line[:_OUTPUT_BYTES] for line in
                                              traceback.format_exception(type(e), e, tb)[-50:]]})
    return result


_COPY_EXIT = 87  # the exit status of a driver copy that came out of a cell (see main)


def _reap_copies(*_) -> None:
    """SIGCHLD: as the container's init, reap the driver copies that exited (they would hold their pids as
    zombies up to the pids limit), also those orphaned to us by a copy that exited first. Only they: a zombie is
    looked at without being reaped (WNOWAIT) and taken only with the copies' exit status, so a subprocess the
    cell started stays the cell's to wait for."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == "1":
            continue
        try:
            info = os.waitid(os.P_PID, int(name), os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_code == os.CLD_EXITED and info.si_status == _COPY_EXIT:
                os.waitpid(int(name), 0)
        except ChildProcessError:
            pass


def _running_copies(cmdline: bytes) -> set[int]:
    """Processes running this driver's program but the driver: copies a cell forked (a subprocess the cell
    started runs another program)."""
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if f.read() == cmdline:  # empty for a zombie
                        out.add(int(name))
            except OSError:
                pass
    return out


def _settle(before: set[int], cmdline: bytes, within_s: float = 2.0) -> None:
    """Wait until the copies the last cell forked have come out of it and been reaped, so that their pids are
    free for the next cell. The wait goes on while copies keep leaving (on a loaded machine, the cell after a
    fork loop met the pids limit when the wait was 2 s in all); a copy the cell left running on purpose (a
    background worker) is waited for `within_s` after the last one left, once."""
    deadline = time.monotonic() + within_s
    remaining = _running_copies(cmdline) - before
    while remaining and time.monotonic() < deadline:
        time.sleep(0.002)
        now = _running_copies(cmdline) - before
        if len(now) < len(remaining):
            deadline = time.monotonic() + within_s
        remaining = now
    _reap_copies()


def main() -> None:
    requests, replies = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    driver = os.getpid()
    if driver == 1:
        signal.signal(signal.SIGCHLD, _reap_copies)
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read()
    _send(replies, {"ready": True})
    while True:
        (size,) = struct.unpack("<I", _read(requests, 4))
        request = json.loads(_read(requests, size))
        code = request["code"]
        out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
        os.dup2(out, 1)
        os.dup2(err, 2)
        before = _running_copies(cmdline) if driver == 1 else set()
        result = _run(code, scope)
        if os.getpid() != driver:  # a copy of the driver the cell forked came out of it: only the driver reads
            os._exit(_COPY_EXIT)  # requests
        if driver == 1:
            _settle(before, cmdline)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os.dup2(null, 1)
        os.dup2(null, 2)
        result["stdout"], result["stderr"] = _captured(out), _captured(err)
        result["id"] = request["id"]
        _send(replies, result)


if __name__ == "__main__":
    main()
