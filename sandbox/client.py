"""HTTP client of the sandbox service (httpx), with retries on connection errors and 503 overload answers."""
from __future__ import annotations

import random
import threading
import time
import weakref
from typing import Any

import httpx

from .models import (BatchResult, Health, Limits, RunRequest, RunResult, SessionInfo, SessionRequest, SessionResult,
                     SessionRun)


KEEPALIVE_S = 2.0  # an idle connection's life in the client's pool; the service keeps one for SERVER_KEEPALIVE_S
SERVER_KEEPALIVE_S = 30.0


class SandboxError(RuntimeError):
    pass


class SandboxClient:
    """Synchronous client. Safe to share between threads (each thread has its own connection pool)."""

    def __init__(self, url: str = "http://127.0.0.1:8600", token: str | None = None, timeout_s: float = 120.0,
                 retries: int = 5, backoff_s: float = 0.2):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self._max_batch: int | None = None
        # No pool limits: the client is shared by as many threads as a rollout has trajectories, and httpcore 1.0.9
        # closes an idle connection whenever the pool holds more connections than max_keepalive_connections (it
        # counts all of them as idle), also one it just handed to a waiting request: that request then reads a
        # closed socket (EBADF) or waits out its timeout (encode/httpcore#1110). Seen here with 64 threads on the
        # default limits (20 kept alive). Unlimited, no connection is closed under a request.
        # An idle connection is dropped here after KEEPALIVE_S, before the server may close it (uvicorn's default
        # is 5 s, as httpx's expiry is): with equal timeouts a request sent on a connection the server is closing
        # at that moment gets "Server disconnected without sending a response", and a stateful request (opening
        # a session, a cell) cannot be retried after that, since it might have run.
        # Each thread's pool (_http) shares one TLS context: making one loads the CA bundle, 54 ms a client here.
        self._client_args: dict[str, Any] = dict(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=5.0),
            verify=httpx.create_ssl_context(),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S))
        self._local = threading.local()
        self._clients: weakref.WeakSet[httpx.Client] = weakref.WeakSet()
        self._clients_lock = threading.Lock()

    @property
    def _http(self) -> httpx.Client:
        """This thread's own connection pool. Shared between threads, httpcore 1.0.9 may also close a connection
        whose keep-alive expired while the pool hands it to another thread's waiting request (the suite's 256
        sessions at once, each cell a request: httpx.ReadError, Bad file descriptor, on a cell that may have run);
        a pool used by one thread only cannot. A thread's pool goes with the thread."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(**self._client_args)
            with self._clients_lock:
                self._clients.add(client)
        return client

    def close(self) -> None:
        with self._clients_lock:
            clients = list(self._clients)
        for client in clients:
            client.close()

    def __enter__(self) -> "SandboxClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, json: Any = None, stateful: bool = False) -> httpx.Response:
        """`stateful`: a request that changes state on the server (a session's cell, opening a session) is
        retried only when it cannot have reached the server (connection refused, 503): after a dropped
        answer it may have run, and running a cell twice, or opening a session whose id is lost, is not
        harmless as re-running a judged program is."""
        last: Exception | None = None
        retried = (httpx.ConnectError,) if stateful else (httpx.ConnectError, httpx.RemoteProtocolError,
                                                          httpx.ReadError)
        for attempt in range(self.retries + 1):
            delay = self.backoff_s * (2 ** attempt) * (0.5 + random.random())
            try:
                r = self._http.request(method, path, json=json)
            except retried as exc:
                # Nothing ran if the connection failed; a dropped answer means the run may be repeated,
                # which is harmless for a judge.
                last = exc
            else:
                if r.status_code == 503:
                    last = SandboxError(f"overloaded: {r.text}")
                    delay = max(delay, float(r.headers.get("retry-after", 0) or 0))
                elif r.status_code >= 400:
                    raise SandboxError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
                else:
                    return r
            if attempt < self.retries:
                time.sleep(delay)
        raise SandboxError(f"{method} {path} failed after {self.retries + 1} attempts: {last}")

    def run(self, language: str, code: str, *, stdin: str = "", tests: list[str] | None = None,
            files: dict[str, str] | None = None, limits: Limits | dict | None = None,
            image: str | None = None, **fields: Any) -> RunResult:
        """`fields`: the rest of RunRequest (judge mode's `cases`, `checker`, `stop_on_first_failure`;
        `binary_files`, `fetch_files`, ...)."""
        req = RunRequest(language=language, code=code, stdin=stdin, tests=tests or [], files=files or {},
                         limits=Limits.model_validate(limits or {}), image=image, **fields)
        return self.run_request(req)

    def run_request(self, req: RunRequest) -> RunResult:
        r = self._request("POST", "/run", json=req.model_dump(mode="json", exclude_none=True))
        return RunResult.model_validate(r.json())

    def run_batch(self, reqs: list[RunRequest]) -> list[RunResult]:
        """Run many; split into chunks the server accepts (its slots plus queue), sent one after another."""
        if self._max_batch is None:
            self._max_batch = max(1, self.health().max_batch)
        out: list[RunResult] = []
        for i in range(0, len(reqs), self._max_batch):
            chunk = reqs[i:i + self._max_batch]
            body = {"runs": [q.model_dump(mode="json", exclude_none=True) for q in chunk]}
            out += BatchResult.model_validate(self._request("POST", "/run_batch", json=body).json()).results
        return out

    # ---- sessions: a live Python namespace in its own container (POST/DELETE /sessions)
    def open_session(self, limits: Limits | dict | None = None, ttl_s: float = 300.0) -> str:
        req = SessionRequest(limits=Limits.model_validate(limits or {}), ttl_s=ttl_s)
        return SessionInfo.model_validate(
            self._request("POST", "/sessions", json=req.model_dump(mode="json", exclude_none=True),
                          stateful=True).json()).id

    def run_in_session(self, session_id: str, code: str, timeout_s: float | None = None) -> SessionResult:
        body = SessionRun(code=code, timeout_s=timeout_s).model_dump(exclude_none=True)
        return SessionResult.model_validate(self._request("POST", f"/sessions/{session_id}/run", json=body,
                                                          stateful=True).json())

    def close_session(self, session_id: str) -> None:
        self._request("DELETE", f"/sessions/{session_id}")

    def health(self) -> Health:
        return Health.model_validate(self._request("GET", "/health").json())

    def wait_ready(self, timeout_s: float = 60.0) -> Health:
        """Poll /health until it answers or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = self._http.get("/health", timeout=2.0)
                if r.status_code == 200:
                    return Health.model_validate(r.json())
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SandboxError(f"sandbox at {self.url} not ready after {timeout_s} s")
            time.sleep(0.05)
