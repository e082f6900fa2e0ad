"""The untrusted half of Python's tests mode: loads the solution and serves the judge's requests on two pipes
(see python_judge.py). Whatever this process does, only values and handles reach the judge."""
import json
import os
import struct
import sys
import traceback

import python_wire

_IN, _OUT = int(sys.argv[1]), int(sys.argv[2])
_objects: list = []
_END = object()  # the iterator of a "next" request is exhausted (said apart from any exception's reply)


def _read(n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = os.read(_IN, n - len(data))
        if not chunk:
            raise SystemExit(0)
        data += chunk
    return data


def _send(message) -> None:
    body = json.dumps(message).encode()
    os.write(_OUT, struct.pack("<I", len(body)) + body)


def _to_handle(obj):
    _objects.append(obj)
    return [len(_objects) - 1, type(obj).__name__]


encode, decode = python_wire.codec(_to_handle, lambda handle, _type: _objects[handle])


_CONVERT = {"bool": bool, "int": int, "float": float, "str": str, "repr": repr, "bytes": bytes, "list": list,
            "tuple": tuple, "dict": dict, "set": set, "frozenset": frozenset, "complex": complex}
_SCALARS = (bool, int, float, complex, str, bytes)
_CONTAINERS = (list, tuple, set, frozenset, dict)
_MAX_PLAIN_DEPTH = 100


class NoPlainValue(Exception):
    """The object has no plain value (an instance of the solution's own class, a generator, a range...)."""


def _convert(obj, kind: str):
    if kind == "plain":
        return _plain(obj, 0)
    if kind == "list" and hasattr(obj, "tolist"):  # numpy arrays and scalars
        obj = obj.tolist()
    elif kind in ("int", "float", "bool") and hasattr(obj, "item"):
        obj = obj.item()
    return _CONVERT[kind](obj)


def _plain(obj, depth: int):
    """The object as a value of the exact plain types, decided by the object alone (never by what it will be
    compared with): a subclass of a plain type as its base type (a Counter as a dict, a namedtuple as a
    tuple), numpy values by `tolist()`; anything else has none."""
    if depth > _MAX_PLAIN_DEPTH:
        raise NoPlainValue("nested too deeply")
    if obj is None:
        return None
    if type(obj).__module__ == "numpy" and hasattr(obj, "tolist"):
        obj = obj.tolist()
        if type(obj) in _SCALARS or obj is None:
            return obj
    for base in _SCALARS:  # bool before int: bool is the narrower
        if isinstance(obj, base):
            value = base(obj) if type(obj) is not base else obj
            if type(value) is not base:
                raise NoPlainValue(f"a {type(obj).__name__} did not convert to a {base.__name__}")
            return value
    for base in _CONTAINERS:
        if isinstance(obj, base):
            if base is dict:
                return {_plain(k, depth + 1): _plain(v, depth + 1) for k, v in dict.items(obj)}
            return base(_plain(x, depth + 1) for x in base.__iter__(obj))
    raise NoPlainValue(f"a {type(obj).__name__} has no plain value")


def _serve(req: dict, scope: dict):
    op = req["op"]
    if op == "load":
        return {name: value for name, value in scope.items() if not name.startswith("__")}
    obj = _objects[req["h"]]
    if op == "call":
        return obj(*decode(req["args"]), **decode(req["kwargs"]))
    if op == "getattr":
        return getattr(obj, req["name"])
    if op == "setattr":
        return setattr(obj, req["name"], decode(req["value"]))
    if op == "iter":
        return iter(obj)
    if op == "next":
        try:
            return next(obj)
        except StopIteration:
            return _END
    if op == "len":
        return len(obj)
    if op == "getitem":
        return obj[decode(req["key"])]
    if op == "setitem":
        obj[decode(req["key"])] = decode(req["value"])
        return None
    if op == "convert":
        return _convert(obj, req["to"])
    raise ValueError(f"unknown request {op!r}")


def main() -> None:
    scope = {"__name__": "solution", "__builtins__": __builtins__}
    with open("solution.py") as f:
        source = f.read()
    exec(compile(source, "solution.py", "exec"), scope)  # an exception here ends this process: all tests fail
    while True:
        (size,) = struct.unpack("<I", _read(4))
        req = json.loads(_read(size))
        try:
            value = _serve(req, scope)
            reply = {"end": True} if value is _END else {"value": encode(value)}
        except Exception as e:
            if req.get("op") == "call":  # the solution's own error, worth its traceback
                traceback.print_exc()
            reply = {"error": [type(e).__name__, str(e)[:1000]]}
        sys.stdout.flush()
        sys.stderr.flush()
        _send(reply)


if __name__ == "__main__":
    main()
