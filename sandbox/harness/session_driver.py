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
import struct
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
    body = json.dumps(message).encode()
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


def _reap(copies: int, pending: set[int], within_s: float = 2.0) -> set[int]:
    """Reap the driver copies that came out of the last cell, so their pids are free for the next one (exited,
    they would hold them as zombies up to the pids limit). A copy forked by another copy becomes ours (we are
    init) only once that one has exited; those not yet ours after `within_s` are tried again after the next cell.
    The cell's own children are left to the cell: a subprocess it started is its to wait for."""
    while True:
        try:
            data = os.read(copies, 4096)
        except BlockingIOError:
            break
        pending.update(pid for (pid,) in struct.iter_unpack("<i", data))
    deadline = time.monotonic() + within_s
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    pending.discard(pid)
            except ChildProcessError:
                pass
        if pending:
            time.sleep(0.002)
    return pending


def main() -> None:
    requests, replies = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    driver = os.getpid()
    copies, returned = os.pipe()
    os.set_blocking(copies, False)
    pending: set[int] = set()
    _send(replies, {"ready": True})
    while True:
        pending = _reap(copies, pending)
        (size,) = struct.unpack("<I", _read(requests, 4))
        request = json.loads(_read(requests, size))
        code = request["code"]
        out, err = os.memfd_create("stdout"), os.memfd_create("stderr")
        os.dup2(out, 1)
        os.dup2(err, 2)
        result = _run(code, scope)
        if os.getpid() != driver:  # a copy of the driver the cell forked came out of it: only the driver reads
            os.write(returned, struct.pack("<i", os.getpid()))  # requests; it goes, for the driver to reap
            os._exit(0)
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
