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
import ast
import builtins
import importlib
import json
import os
import struct
import subprocess
import sys
import threading
import traceback

_OUT_LOCK = threading.Lock()
_INIT: dict = {}  # container_init.py, run first thing by _secrets()
_MAX_REPLY = 64 << 20


class SolutionDied(Exception):
    pass


class SolutionError(Exception):
    """An exception raised in the solution that is not rebuilt as itself (not a builtin one, or one that
    steers control flow)."""


_CONTROL_FLOW = (StopIteration, StopAsyncIteration)  # BaseExceptions that are not Exceptions are never rebuilt
_END = object()  # a "next" request's iterator is exhausted
_NEVER_IMPORTED = {"this", "antigravity"}  # standard-library modules that act when imported


class _NoValue:
    """What a solution object without a plain value stands for in a comparison: equal to nothing."""


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
        if type(reply) is not dict or not ("value" in reply or "error" in reply or
                                           (reply.get("end") is True and message["op"] == "next")):
            self.dead = True
            raise SolutionDied("the solution's reply is malformed")
        if "end" in reply:
            return _END
        if "error" in reply:
            kind, text = reply["error"] if type(reply["error"]) is list and len(reply["error"]) == 2 else ("?", "")
            exc = getattr(builtins, kind, None) if isinstance(kind, str) else None
            # Rebuilt as itself, a builtin error can be what a test expects (`except ValueError`); an exception the
            # interpreter uses for control flow never is: a StopIteration raised here inside the test's map() or
            # generator would end the iteration as if the solution had answered everything.
            if (isinstance(exc, type) and issubclass(exc, Exception) and exc.__module__ == "builtins"
                    and not issubclass(exc, _CONTROL_FLOW)):
                raise exc(text)
            raise SolutionError(f"{kind}: {text}")
        return decode(reply["value"])

    def close(self) -> None:
        os.close(self._to_child)
        try:
            self.proc.wait()
            _INIT["kill_everyone_else"]()  # whatever the solution left running
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
        if type(iterator) is not Remote:
            raise TypeError("iter() of a solution object did not give an iterator")
        while True:
            item = iterator._ask("next")
            if item is _END:
                return
            yield item

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
        return item in self._converted("list")

    def _as(self, kind: str):
        return self._ask("convert", to=kind)

    def _converted(self, kind: str, ask: str | None = None):
        """The object as the solution converts it to `kind` (asked as `ask`: repr() gives a str); a handle back is
        no conversion."""
        value = self._as(ask or kind)
        if isinstance(value, Remote):
            raise TypeError(f"the solution's object did not convert to {kind}")
        return value

    def __bool__(self) -> bool:
        return self._converted("bool")

    def __int__(self) -> int:
        return self._converted("int")

    __index__ = __int__

    def __float__(self) -> float:
        return self._converted("float")

    def __str__(self) -> str:
        return self._converted("str")

    def __repr__(self) -> str:
        return self._converted("str", ask="repr")

    def _plain_value(self):
        """The object's plain value (sandbox/harness/python_runner.py `_plain`), asked without saying what it
        will be compared with, or _NO_VALUE."""
        try:
            value = self._as("plain")
        except (SolutionDied, RecursionError):
            raise
        except Exception:
            return _NO_VALUE
        return _NO_VALUE if _holds_remote(value) else value

    def __eq__(self, other) -> bool:
        # Both sides as plain values compared here: never two handles the solution chose (it could hand back the
        # same one for both), never a conversion asked for by the other side's type (which would tell the
        # solution what it is compared with, `None` included).
        mine = self._plain_value()
        theirs = other._plain_value() if type(other) is Remote else other
        if mine is _NO_VALUE or theirs is _NO_VALUE:
            return False
        return bool(mine == theirs)

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


_NO_VALUE = _NoValue()


def _holds_remote(value) -> bool:
    if type(value) is Remote:
        return True
    if type(value) is dict:
        return any(_holds_remote(k) or _holds_remote(v) for k, v in value.items())
    if type(value) in (list, tuple, set, frozenset):
        return any(_holds_remote(x) for x in value)
    return False


def _remote_handle(v):
    if type(v) is Remote:
        return [v._h, v._type]
    raise TypeError(f"a test passed a {type(v).__name__} to the solution: only plain values and its own objects "
                    f"cross")


encode = decode = None  # set by _secrets() from python_wire.py


def _run_file(name: str) -> dict:
    """What a harness file beside this one defines, run from its file (never imported: the solution can write
    /work)."""
    namespace: dict = {}
    with open(name) as f:
        exec(compile(f.read(), name, "exec"), namespace)
    return namespace


def _secrets() -> dict:
    """The nonce, tests, set-up and solution names, read before the solution's process exists, from a file then
    removed, into a process whose memory and descriptors its user (the solution's too) can no longer read through
    /proc."""
    global _INIT, encode, decode
    _INIT = _run_file(".tide_init.py")
    data = _INIT["take_secrets"]("judge_input.json", "main.py", ".tide_init.py", require_init=False)
    encode, decode = _run_file("python_wire.py")["codec"](_remote_handle, Remote)
    return data


def _free_names(sources: list[str]) -> tuple[set[str], set[str]]:
    """Names the tests read without binding them anywhere themselves (a function, parameter, assignment, import,
    loop or comprehension variable of theirs): what they expect from elsewhere; and those of them they call or
    pass to a call (`area(2)`, `check(add)`)."""
    read, bound, called = set(), set(), set()
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, ast.alias):
                bound.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                bound.add(node.name)
            if isinstance(node, ast.Call):
                called |= {n.id for n in (node.func, *node.args, *(k.value for k in node.keywords))
                           if isinstance(n, ast.Name)}
    free = read - bound
    return free, called & free


def _tests_scope(data: dict, loaded: dict) -> dict:
    """The scope the tests run in. What crosses from the solution is only what the task names as the solution's
    (`solution_names`, HumanEval's entry point) or, by default, the names the tests call or pass to a call that
    nothing else gives them: not a builtin, not a name the task's set-up code defines. Standard-library modules
    the tests use without importing them are imported here, as the tests' own. The set-up (`test_setup`: MBPP's
    test_imports and test_setup_code) runs here, after the solution's names are in, and wins over them: a
    solution's `class math` or `Counter` never stands in for what the tests import."""
    scope = {"__name__": "tests", "__builtins__": builtins}
    free, called = _free_names(data["tests"])
    # a module is never called: `copy(x)` is the solution's function, `math.isclose(...)` the standard library's
    stdlib = {n for n in free - called if n in sys.stdlib_module_names and n not in _NEVER_IMPORTED}
    names = data.get("solution_names")
    if names is None:  # a name only reached through (`np.isclose`) is a module the tests expect, not the solution
        names = sorted(called - _bound_names(data.get("setup") or ""))
    for name in names:
        if type(name) is str and name.isidentifier() and not hasattr(builtins, name) and name in loaded:
            scope[name] = loaded[name]
    if data.get("setup"):
        exec(compile(data["setup"], "test_setup", "exec"), scope)
    for name in sorted(stdlib - set(names) - set(scope)):
        scope[name] = importlib.import_module(name)
    return scope


def _bound_names(source: str) -> set[str]:
    """Names a piece of code binds at its top level (what exec() of it leaves in a scope), by syntax."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            out |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return out


def main() -> None:
    global _CHANNEL
    data = _secrets()
    nonce, tests = data["nonce"], data["tests"]
    _CHANNEL = _Channel()
    try:
        loaded = _CHANNEL.request({"op": "load"})
        loaded = {k: v for k, v in loaded.items() if type(k) is str} if type(loaded) is dict else {}
    except Exception:  # the solution's top level raised or exited: every test fails
        loaded = None
    scope = None
    if loaded is not None:
        try:
            scope = _tests_scope(data, loaded)
        except BaseException:
            sys.stderr.write("tide: the tests' set-up code failed:\n")
            traceback.print_exc()
    for i, src in enumerate(tests):
        ok = False
        if scope is not None:
            try:
                exec(compile(src, "test%d" % i, "exec"), scope)
                ok = True
            except BaseException:
                traceback.print_exc()
                # which test, in words, as the other languages' verdicts say it (the traceback names "test<i>")
                sys.stderr.write(f"tide: test {i} failed: {src if len(src) <= 200 else src[:200] + '...'}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        _write_line(1, f"{nonce} {i} {'pass' if ok else 'fail'}\n".encode())
    _CHANNEL.close()
    code = _CHANNEL.proc.returncode
    sys.exit(code if code and code > 0 else 1 if scope is None else 0)


if __name__ == "__main__":
    main()
