"""Sessions for multi-turn agents: one long-lived Python container per session, in its own slot, running
sandbox/harness/session_driver.py; cells go to it over the container's stdin and come back on its stdout.

A session ends when its owner deletes it, when it has been idle for `ttl_s` (reaped), when a cell runs past
its timeout or the container dies (its state is gone: later requests get 404), or at the server's
`max_session_s`. Ending kills the container and removes its mounts, cgroup state and crun state like any run."""
from __future__ import annotations

import json
import os
import queue
import select
import struct
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from .models import SessionRequest, SessionResult

DRIVER = (Path(__file__).with_name("harness") / "session_driver.py").read_text()  # the container's init
_MAX_REPLY = 64 << 20


class SessionEnded(Exception):
    pass


@dataclass
class Session:
    req: SessionRequest
    output_bytes: int
    default_timeout_s: float
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ready: Future = field(default_factory=Future)
    requests: queue.Queue = field(default_factory=queue.Queue)
    ended: threading.Event = field(default_factory=threading.Event)  # set once its slot is free again
    end_reason: str = ""
    _stopped: bool = False  # no more cells: the container is gone or going
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, code: str, timeout_s: float | None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._stopped:
                raise SessionEnded(self.end_reason)
            self.requests.put((code, timeout_s or self.default_timeout_s, fut))
        return fut

    def close(self) -> None:
        self.requests.put(None)

    def serve(self, proc, pidfd: int, deadline: float) -> None:
        """The worker's loop while the container lives: one cell at a time; returns when the session ends."""
        try:
            self._serve(proc, pidfd, deadline)
        finally:
            with self._lock:
                self._stopped = True
            if not self.ready.done():
                self.ready.set_exception(SessionEnded(self.end_reason or "the session did not start"))
            while True:  # whoever still waits learns that the session is over
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[2].set_exception(SessionEnded(self.end_reason))

    def _serve(self, proc, pidfd: int, deadline: float) -> None:
        reader = _Reader(proc.stdout.fileno(), pidfd)
        try:
            hello = reader.message(min(deadline, time.monotonic() + 30))
        except SessionEnded as e:
            self.end_reason = f"the session's kernel did not start: {e}"
            return
        if not hello.get("ready"):
            self.end_reason = "the session's kernel did not start"
            return
        self.ready.set_result(self.id)
        idle_since = time.monotonic()
        while True:
            now = time.monotonic()
            wait = min(self.req.ttl_s - (now - idle_since), deadline - now)
            if wait <= 0:
                self.end_reason = "reaped after ttl_s idle" if deadline - now > 0 else "reached max_session_s"
                return
            try:
                item = self.requests.get(timeout=wait)
            except queue.Empty:
                continue
            if item is None:
                self.end_reason = "closed"
                return
            code, timeout_s, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            t0 = time.monotonic()
            try:
                body = json.dumps({"code": code}).encode()
                os.write(proc.stdin.fileno(), struct.pack("<I", len(body)) + body)
                reply = reader.message(min(deadline, t0 + timeout_s))
            except (SessionEnded, OSError) as e:
                timed_out = isinstance(e, SessionEnded) and e.args and e.args[0] == "timeout"
                self.end_reason = "a cell ran past its timeout" if timed_out else f"the session died: {e}"
                fut.set_result(SessionResult(status="timeout" if timed_out else "dead", wall_ms=_ms(t0),
                                             error=[{"ename": "TimeoutError" if timed_out else "SessionDied",
                                                     "evalue": self.end_reason, "traceback": []}]))
                return
            fut.set_result(SessionResult(status="error" if reply.get("error") else "ok", wall_ms=_ms(t0),
                                         stdout=str(reply.get("stdout", ""))[:self.output_bytes],
                                         stderr=str(reply.get("stderr", ""))[:self.output_bytes],
                                         display=reply.get("display") or [], error=reply.get("error") or []))
            idle_since = time.monotonic()


def _ms(t0: float) -> float:
    return round((time.monotonic() - t0) * 1000, 3)


class _Reader:
    """Length-prefixed JSON from the container's stdout, with a deadline; ends if the container exits."""

    def __init__(self, fd: int, pidfd: int) -> None:
        self.fd, self.pidfd, self.buf = fd, pidfd, b""

    def _fill(self, n: int, deadline: float) -> None:
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionEnded("timeout")
            ready, _, _ = select.select([self.fd, self.pidfd], [], [], left)
            if self.fd in ready:
                chunk = os.read(self.fd, 1 << 20)
                if not chunk:
                    raise SessionEnded("the container exited")
                self.buf += chunk
            elif self.pidfd in ready:
                raise SessionEnded("the container exited")

    def message(self, deadline: float) -> dict:
        self._fill(4, deadline)
        (size,) = struct.unpack("<I", self.buf[:4])
        if size > _MAX_REPLY:
            raise SessionEnded("reply too large")
        self._fill(4 + size, deadline)
        body, self.buf = self.buf[4:4 + size], self.buf[4 + size:]
        try:
            message = json.loads(body)
        except ValueError:
            raise SessionEnded("malformed reply") from None
        if type(message) is not dict:
            raise SessionEnded("malformed reply")
        return message
