"""FastAPI app around a started SandboxRuntime: /run, /run_batch, /health, /metrics."""
from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from . import fusion, metrics, wire
from .models import (BatchRequest, BatchResult, Health, RunRequest, RunResult, SessionInfo, SessionRequest,
                     SessionResult, SessionRun)
from .sessions import SessionEnded
from .runtime import BadRequest, Overloaded, SandboxRuntime, languages

RETRY_AFTER_S = 1

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class BodyLimit:
    """Answers 413 for request bodies above max_bytes, whether or not Content-Length is sent."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.max_bytes:
                return await self._reject(send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send: Callable[[dict], Awaitable[None]]) -> None:
        body = b'{"detail":"request body too large"}'
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def create_app(runtime: SandboxRuntime, token: str | None = None, max_request_bytes: int | None = None) -> Any:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await asyncio.to_thread(runtime.close)

    app = FastAPI(title="tide sandbox", version="0.1.0", lifespan=lifespan,
                  default_response_class=wire.SafeJSONResponse)
    wire.install(app)  # before any route: strict request bodies, answers that always render

    def auth(request: Request) -> None:
        if token is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    def path_auth(path_token: str) -> None:
        if token is not None and not hmac.compare_digest(path_token.encode(), token.encode()):
            raise HTTPException(401, "wrong token in the path")

    def overloaded(exc: Overloaded) -> JSONResponse:
        return wire.SafeJSONResponse({"detail": f"sandbox overloaded: {exc}"}, status_code=503,
                                     headers={"Retry-After": str(RETRY_AFTER_S)})

    def record(req: RunRequest, res: RunResult) -> RunResult:
        metrics.RUNS.labels(req.language, res.status.value).inc()
        metrics.RUN_SECONDS.labels(req.language).observe(res.wall_ms / 1000)
        return res

    def submit(reqs: list[RunRequest]) -> list:
        try:
            return runtime.submit_many(reqs)
        except KeyError as exc:
            raise HTTPException(400, str(exc.args[0])) from exc
        except BadRequest as exc:
            raise HTTPException(413 if "capacity" in str(exc) else 400, str(exc)) from exc

    @app.post("/run", response_model=RunResult, dependencies=[Depends(auth)])
    async def run(req: RunRequest) -> Any:
        try:
            (fut,) = submit([req])
        except Overloaded as exc:
            return overloaded(exc)
        return record(req, await asyncio.wrap_future(fut))

    @app.post("/run_batch", response_model=BatchResult, dependencies=[Depends(auth)])
    async def run_batch(batch: BatchRequest) -> Any:
        try:
            futs = submit(batch.runs)
        except Overloaded as exc:
            return overloaded(exc)
        results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        return BatchResult(results=[record(r, res) for r, res in zip(batch.runs, results)])

    async def through_runtime(translated: Any, answer: Callable, refused: Callable) -> Any:
        """A SandboxFusion request run as tide's: `answer` maps the result, `refused(message)` builds the
        SandboxError reply (a translation that is already a reply is returned as it is)."""
        if not isinstance(translated, RunRequest):
            return translated
        try:
            (fut,) = submit([translated])
        except Overloaded as exc:
            return overloaded(exc)
        except HTTPException as exc:
            return refused(str(exc.detail))
        return answer(record(translated, await asyncio.wrap_future(fut)))

    def translated(translate: Callable, req: Any) -> Any:
        try:
            return translate(req)
        except ValidationError as exc:  # the request's own fields (files that are not base64): a 422 like any
            raise RequestValidationError(exc.errors(include_url=False)) from None

    async def run_code(req: fusion.RunCodeRequest) -> Any:
        return await through_runtime(translated(fusion.to_run_request, req), fusion.to_response, fusion.sandbox_error)

    async def run_jupyter(req: fusion.RunJupyterRequest) -> Any:
        return await through_runtime(translated(fusion.jupyter_request, req), fusion.jupyter_response,
                                     fusion.jupyter_error)

    # SandboxFusion's client sends no credentials: with a token, point it at http://HOST:PORT/token/<token>.
    for path, handler, model in (("run_code", run_code, fusion.RunCodeResponse),
                                 ("run_jupyter", run_jupyter, fusion.RunJupyterResponse)):
        app.post(f"/{path}", response_model=model, dependencies=[Depends(auth)])(handler)
        app.post(f"/token/{{path_token}}/{path}", response_model=model, dependencies=[Depends(path_auth)])(handler)

    @app.post("/sessions", response_model=SessionInfo, dependencies=[Depends(auth)])
    async def open_session(req: SessionRequest) -> Any:
        try:
            session = runtime.open_session(req)
        except Overloaded as exc:
            return overloaded(exc)
        except BadRequest as exc:
            raise HTTPException(400, str(exc)) from exc
        try:
            return SessionInfo(id=await asyncio.wrap_future(session.ready), ttl_s=req.ttl_s)
        except SessionEnded as exc:
            raise HTTPException(500, f"the session did not start: {exc}") from exc

    def live(session_id: str):
        try:
            return runtime.session(session_id)
        except KeyError:
            raise HTTPException(404, f"no live session {session_id!r} (closed, reaped or ended)") from None

    @app.post("/sessions/{session_id}/run", response_model=SessionResult, dependencies=[Depends(auth)])
    async def run_in_session(session_id: str, cell: SessionRun) -> Any:
        try:
            fut = live(session_id).run(cell.code, cell.timeout_s)
            return await asyncio.wrap_future(fut)
        except SessionEnded as exc:
            raise HTTPException(404, f"session {session_id!r} ended: {exc}") from exc

    @app.delete("/sessions/{session_id}", dependencies=[Depends(auth)])
    async def close_session(session_id: str) -> Any:
        live(session_id).close()
        return {"closed": session_id}

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        s = runtime.stats()
        ok = s["broken"] < s["slots"]
        mode = runtime.layout.mode.value if runtime.layout else ""
        return Health(status="ok" if ok else "degraded", cgroup_mode=mode,
                      slots=s["slots"], busy=s["busy"], queued=s["queued"], broken_slots=s["broken"],
                      sessions=runtime.live_sessions(), max_sessions=runtime.max_sessions,
                      max_batch=runtime.capacity,
                      languages=languages(), images=sorted(runtime.images))

    @app.get("/metrics", dependencies=[Depends(auth)])
    async def prom() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    if max_request_bytes:
        return BodyLimit(app, max_request_bytes)
    return app
