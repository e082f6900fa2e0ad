"""The value format between Python's judge and the solution's process (python_judge.py, python_runner.py): plain
values as JSON with tags for what JSON lacks, and anything else as a handle `{"h": [id, type name]}`. Exact
types only (`type(v) is int`, never isinstance), so a subclass with its own `__eq__` travels as a handle.
Both processes load this file: the runner imports it, the judge executes its text read before the solution
starts (the solution can write /work, so the judge never imports from there)."""


def codec(to_handle, from_handle):
    """(encode, decode) for one side: `to_handle(v)` gives the handle of a non-plain value (or raises),
    `from_handle(id, type_name)` the object a handle stands for on this side."""

    def encode(v):
        t = type(v)
        if v is None or t in (bool, int, str):
            return v
        if t is float:
            return v if v == v and v not in (float("inf"), float("-inf")) else {"f": repr(v)}
        if t is list:
            return [encode(x) for x in v]
        if t is tuple:
            return {"t": [encode(x) for x in v]}
        if t is dict:
            return {"d": [[encode(k), encode(x)] for k, x in v.items()]}
        if t is set:
            return {"s": [encode(x) for x in v]}
        if t is frozenset:
            return {"fs": [encode(x) for x in v]}
        if t is bytes:
            return {"b": v.hex()}
        if t is complex:
            return {"c": [v.real, v.imag]}
        return {"h": to_handle(v)}

    def decode(v):
        if isinstance(v, list):
            return [decode(x) for x in v]
        if not isinstance(v, dict):
            return v
        (tag, x), = v.items()
        if tag == "h":
            return from_handle(x[0], x[1])
        if tag == "t":
            return tuple(decode(i) for i in x)
        if tag == "d":
            return {decode(k): decode(val) for k, val in x}
        if tag == "s":
            return {decode(i) for i in x}
        if tag == "fs":
            return frozenset(decode(i) for i in x)
        if tag == "b":
            return bytes.fromhex(x)
        if tag == "f":
            return float(x)
        if tag == "c":
            return complex(x[0], x[1])
        raise ValueError(f"bad value: tag {tag!r}")

    return encode, decode
