"""The trusted half of Python's tests mode (see sandbox/languages.py): runs the tests, talks to the solution's
process (python_runner.py) over two pipes, and prints the verdicts.

The solution never runs in this process. What crosses from it is data: plain values (None, bool, int, float,
complex, str, bytes, list, tuple, dict, set, frozenset, rebuilt here by this process) or opaque handles to its
other objects, on which a test can call, get attributes, iterate, index and convert; comparing a handle asks the
solution to convert it to the plain type of the other side and compares here, so a patched `__eq__`, replaced
builtins or a fake `assert` never reach the verdict, and the expected values never reach the solution. This
process is made non-dumpable before it reads anything secret, so the solution (same uid) cannot read its memory
or file descriptors through /proc; the solution's stdout and stderr reach the container's through this
process, line by line, and the verdict lines carry a nonce the solution never sees."""
import builtins
import importlib.util
import json
import os
import struct
import subprocess
import sys
import threading
import traceback

_OUT_LOCK = threading.Lock()
_INIT = None  # container_init.py, loaded first thing by _secrets()
_MAX_REPLY = 64 << 20


class SolutionDied(Exception):
    pass


class SolutionError(Exception):
    """An exception raised in the solution that is not a builtin one."""


def _write_line(fd: int, data: bytes) -> None:
    with _OUT_LOCK:
        os.write(fd, data)


def _relay(src, fd: int) -> None:
    """Copy the solution's output to ours a whole line at a time, so a verdict line is never glued to its text."""
    pending = b""
    while True:
        chunk = os.read(src.fileno(), 65536)
        if not chunk:
            break
        pending += chunk
        cut = pending.rfind(b"\n") + 1
        if cut:
            _write_line(fd, pending[:cut])
            pending = pending[cut:]
    if pending:
        _write_line(fd, pending + b"\n")


class _Channel:
    def __init__(self) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "runner.py", str(to_child_r), str(from_child_w)],
                                     stdin=0, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     pass_fds=(to_child_r, from_child_w), close_fds=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._relays = [threading.Thread(target=_relay, args=(self.proc.stdout, 1), daemon=True),
                        threading.Thread(target=_relay, args=(self.proc.stderr, 2), daemon=True)]
        for t in self._relays:
            t.start()
        self.dead = False

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = os.read(self._from_child, n - len(data))
            if not chunk:
                self.dead = True
                raise SolutionDied("the solution's process exited")
            data += chunk
        return data

    def request(self, message: dict):
        if self.dead:
            raise SolutionDied("the solution's process exited")
        body = json.dumps(message).encode()
        try:
            os.write(self._to_child, struct.pack("<I", len(body)) + body)
        except BrokenPipeError:
            self.dead = True
            raise SolutionDied("the solution's process exited") from None
        (size,) = struct.unpack("<I", self._read(4))
        if size > _MAX_REPLY:
            self.dead = True
            raise SolutionDied(f"the solution sent a {size}-byte reply")
        try:
            reply = json.loads(self._read(size))
        except ValueError:
            self.dead = True  # garbage on the channel: nothing after it can be trusted to line up
            raise SolutionDied("the solution's reply is not JSON") from None
        if type(reply) is not dict or not ("value" in reply or "error" in reply):
            self.dead = True
            raise SolutionDied("the solution's reply is malformed")
        if "error" in reply:
            kind, text = reply["error"] if type(reply["error"]) is list and len(reply["error"]) == 2 else ("?", "")
            exc = getattr(builtins, kind, None) if isinstance(kind, str) else None
            if isinstance(exc, type) and issubclass(exc, Exception) and exc.__module__ == "builtins":
                raise exc(text)
            raise SolutionError(f"{kind}: {text}")
        return decode(reply["value"])

    def close(self) -> None:
        os.close(self._to_child)
        try:
            self.proc.wait()
            _INIT.kill_everyone_else()  # whatever the solution left running
        finally:
            for t in self._relays:
                t.join()


_CHANNEL: _Channel


class Remote:
    """A handle to one of the solution's objects. Everything a test does with it is a request; nothing the
    solution defines runs here."""

    __slots__ = ("_h", "_type")

    def __init__(self, handle: int, type_name: str) -> None:
        object.__setattr__(self, "_h", handle)
        object.__setattr__(self, "_type", type_name)

    def _ask(self, op: str, **kw):
        return _CHANNEL.request({"op": op, "h": self._h, **kw})

    def __call__(self, *args, **kwargs):
        return self._ask("call", args=encode(list(args)), kwargs=encode(kwargs))

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self._ask("getattr", name=name)

    def __setattr__(self, name: str, value) -> None:
        self._ask("setattr", name=name, value=encode(value))

    def __iter__(self):
        iterator = self._ask("iter")
        while True:
            try:
                yield iterator._ask("next")
            except StopIteration:
                return

    def __len__(self) -> int:
        n = self._ask("len")
        if type(n) is not int:
            raise TypeError("len() of a solution object did not give an int")
        return n

    def __getitem__(self, key):
        return self._ask("getitem", key=encode(key))

    def __setitem__(self, key, value) -> None:
        self._ask("setitem", key=encode(key), value=encode(value))

    def __contains__(self, item) -> bool:
        # Decided here on the object's elements: asking the solution would hand it the value looked for.
        return item in self._plain("list", self._as("list"))

    def _as(self, kind: str):
        return self._ask("convert", to=kind)

    @staticmethod
    def _plain(kind: str, value):
        if isinstance(value, Remote):
            raise TypeError(f"the solution's object did not convert to {kind}")
        return value

    def __bool__(self) -> bool:
        return self._plain("bool", self._as("bool"))

    def __int__(self) -> int:
        return self._plain("int", self._as("int"))

    def __index__(self) -> int:
        return self._plain("int", self._as("int"))

    def __float__(self) -> float:
        return self._plain("float", self._as("float"))

    def __str__(self) -> str:
        return self._plain("str", self._as("str"))

    def __repr__(self) -> str:
        return self._plain("str", self._as("repr"))

    def __eq__(self, other) -> bool:
        if isinstance(other, Remote):
            return self._h == other._h
        kind = _KIND.get(type(other))
        if kind is None:
            return False
        try:
            mine = self._as(kind)
        except Exception:
            return False
        return not isinstance(mine, Remote) and type(mine) is type(other) and mine == other

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(("tide-remote", self._h))

    def __lt__(self, other):
        return _number(self) < other

    def __le__(self, other):
        return _number(self) <= other

    def __gt__(self, other):
        return _number(self) > other

    def __ge__(self, other):
        return _number(self) >= other


def _number(r: Remote):
    value = r._as("float")
    if type(value) is not float:
        raise TypeError("the solution's object is not a number")
    return value


_KIND = {bool: "bool", int: "int", float: "float", str: "str", bytes: "bytes", list: "list", tuple: "tuple",
         dict: "dict", set: "set", frozenset: "frozenset", complex: "complex", type(None): "none"}


def _remote_handle(v):
    if type(v) is Remote:
        return [v._h, v._type]
    raise TypeError(f"a test passed a {type(v).__name__} to the solution: only plain values and its own objects "
                    f"cross")


encode = decode = None  # set by _load_wire() from python_wire.py


def _load_wire() -> None:
    global encode, decode
    wire: dict = {}
    with open("python_wire.py") as f:
        exec(compile(f.read(), "python_wire.py", "exec"), wire)
    encode, decode = wire["codec"](_remote_handle, Remote)


def _secrets() -> tuple[str, list[str]]:
    """The nonce and the tests, read before the solution's process exists, from a file then removed, into a
    process whose memory and descriptors its user (the solution's too) can no longer read through /proc."""
    global _INIT
    _INIT = _container_init()
    data = _INIT.take_secrets("judge_input.json", "main.py", require_init=False)
    _load_wire()
    return data["nonce"], data["tests"]


def _container_init():
    """container_init.py, loaded by path before the code under judgement runs."""
    spec = importlib.util.spec_from_file_location("tide_container_init", ".tide_init.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(".tide_init.py")
    return module


def main() -> None:
    global _CHANNEL
    nonce, tests = _secrets()
    _CHANNEL = _Channel()
    scope = {"__name__": "tests", "__builtins__": builtins}
    try:
        loaded = _CHANNEL.request({"op": "load"})
        # The solution's top-level names, except any that would shadow a builtin for the tests (a solution's
        # `abs = lambda x: 0` must not decide `assert abs(f(x) - y) < 1e-9`).
        scope.update({k: v for k, v in (loaded if type(loaded) is dict else {}).items()
                      if type(k) is str and k.isidentifier() and not k.startswith("__") and not hasattr(builtins, k)})
    except Exception:  # the solution's top level raised or exited: every test fails
        loaded = None
    for i, src in enumerate(tests):
        ok = False
        if loaded is not None:
            try:
                exec(compile(src, "test%d" % i, "exec"), scope)
                ok = True
            except BaseException:
                traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        _write_line(1, f"{nonce} {i} {'pass' if ok else 'fail'}\n".encode())
    _CHANNEL.close()
    code = _CHANNEL.proc.returncode
    sys.exit(code if code and code > 0 else 1 if loaded is None else 0)


if __name__ == "__main__":
    main()
