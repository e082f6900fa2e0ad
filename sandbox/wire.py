"""JSON over HTTP, strictly both ways: a malformed request answers 4xx, never 500, and no answer fails to render.

In: request bodies are parsed by msgspec as RFC 8259 JSON: NaN, Infinity and numbers out of a double's range,
invalid UTF-8 and lone surrogates (which no file, pipe or later reply could carry) are a 422 `json_invalid` before
any model sees them (the standard library accepts all of them, and FastAPI could not serialise its own 422 for a
NaN), and a body nested past the parser's depth is one too. The models refuse non-finite numbers as well
(`allow_inf_nan=False`), for callers that build them in Python.

Out: every response, errors included, renders without failing: a lone surrogate that reaches one (an exception's
text) becomes U+FFFD and a non-finite number null; a validation error shows each offending input as itself when it
is a short scalar and as a bounded repr otherwise (the whole body of a request with a model-level error was echoed,
nested or huge as it came)."""
from __future__ import annotations

import json
import math
import re
import reprlib
from typing import Any, Callable

import msgspec
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

_SURROGATES = re.compile("[\ud800-\udfff]")
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 200, 200


class StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = msgspec.json.decode(await self.body())
            # ValidationError: a number out of range; RecursionError: nested past the parser's depth
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
                raise json.JSONDecodeError(str(e) or type(e).__name__, "", 0) from None
        return self._json


class StrictRoute(APIRoute):
    """A route whose body is parsed by StrictRequest (FastAPI's documented way to swap the request class)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictRequest(request.scope, request.receive))
        return strict


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        except (ValueError, UnicodeEncodeError):  # a non-finite number, a lone surrogate
            text = json.dumps(_finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            return _SURROGATES.sub("\ufffd", text).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _shown(value: Any) -> Any:
    """An offending input as a 422 shows it: short JSON scalars as they are, anything else as a bounded repr."""
    if value is None or isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if isinstance(value, str) and len(value) <= 200:
        return value
    try:
        return _SHOWN.repr(value)
    except Exception:  # a repr that fails (the value is the client's): shown by type
        return f"<{type(value).__name__}>"


def validation_errors(errors: Any) -> list[dict]:
    return [{"type": str(e.get("type", "")), "loc": [p if isinstance(p, int) else str(p) for p in e.get("loc", ())],
             "msg": str(e.get("msg", "")), "input": _shown(e.get("input")),
             **({"ctx": {str(k): _shown(v if isinstance(v, (str, int, float)) else str(v))
                         for k, v in e["ctx"].items()}} if isinstance(e.get("ctx"), dict) else {})}
            for e in errors]


def install(app: FastAPI) -> None:
    """Strict bodies on the routes added from now on, safe rendering for every response and error."""
    app.router.route_class = StrictRoute

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> Response:
        return SafeJSONResponse({"detail": validation_errors(exc.errors())}, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> Response:
        if exc.status_code in (204, 304) or exc.status_code < 200:
            return Response(status_code=exc.status_code, headers=exc.headers)
        return SafeJSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
