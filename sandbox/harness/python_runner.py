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
            "tuple": tuple, "dict": dict, "set": set, "frozenset": frozenset, "complex": complex,
            "none": lambda o: None if o is None else o}


def _convert(obj, kind: str):
    if kind == "list" and hasattr(obj, "tolist"):  # numpy arrays and scalars
        obj = obj.tolist()
    elif kind in ("int", "float", "bool") and hasattr(obj, "item"):
        obj = obj.item()
    return _CONVERT[kind](obj)


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
        return next(obj)
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
            reply = {"value": encode(_serve(req, scope))}
        except StopIteration:
            reply = {"error": ["StopIteration", ""]}
        except Exception as e:
            if req.get("op") == "call":  # the solution's own error, worth its traceback
                traceback.print_exc()
            reply = {"error": [type(e).__name__, str(e)[:1000]]}
        sys.stdout.flush()
        sys.stderr.flush()
        _send(reply)


if __name__ == "__main__":
    main()
