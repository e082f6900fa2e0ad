"""Sessions for multi-turn agents: one long-lived Python container per session, in its own slot, running
sandbox/harness/session_driver.py; cells go to it over the container's stdin and come back on its stdout.

A session ends when its owner deletes it (at once, a running cell included), when it has been idle for `ttl_s`
(reaped), when a cell runs past its timeout or the container dies (its state is gone: later requests get 404),
or at the server's `max_session_s`. Ending kills the container and removes its mounts, cgroup state and crun
state like any run. A cell runs at most the server's `max_limits.timeout_s` and the session's `ttl_s`, whatever
it asks for.

Replies are bounded and framed by the service, not trusted from the container: a cell runs in the driver's
process and can write to its reply pipe, so each request carries a fresh id the reply must echo (a message
with another id is dropped, so a forged message never stands in for a later cell's reply), and every field of
a reply is cut to the session's `output_kb` here. The channel itself (sandbox/replies.py) is read as hostile input
too: whatever a cell writes to it, closes or breaks, the running request is answered (`dead`, or `timeout`) and the
session ends; nothing a reply holds can leave a request unanswered or take the service's thread."""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from .models import SessionRequest, SessionResult
from .replies import LEFT_OUT, Channel, SessionEnded

__all__ = ["Session", "SessionEnded", "bounded_result"]
DRIVER = (Path(__file__).with_name("harness") / "session_driver.py").read_text()  # the container's init
log = logging.getLogger(__name__)


@dataclass
class Session:
    req: SessionRequest
    output_bytes: int
    default_timeout_s: float
    max_timeout_s: float  # a cell's longest run: the server's cap, and never past the session's ttl
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    ready: Future = field(default_factory=Future)
    requests: queue.Queue = field(default_factory=queue.Queue)
    ended: threading.Event = field(default_factory=threading.Event)  # set once its slot is free again
    end_reason: str = ""
    _stopped: bool = False  # no more cells: the container is gone or going
    _closing: threading.Event = field(default_factory=threading.Event)
    _running: Future | None = None  # the cell being run: answered however the session ends
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, code: str, timeout_s: float | None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._stopped:
                raise SessionEnded(self.end_reason)
            self.requests.put((code, min(timeout_s or self.default_timeout_s, self.max_timeout_s), fut))
        return fut

    def close(self) -> None:
        """End the session now: a running cell is interrupted (its container killed), not waited for."""
        self._closing.set()
        self.requests.put(None)

    def serve(self, proc, pidfd: int, deadline: float) -> None:
        """The worker's loop while the container lives: one cell at a time; returns when the session ends, whatever
        happened (the caller then kills the container and frees its seat), with every request answered."""
        try:
            self._serve(proc, pidfd, deadline)
        except Exception as e:  # a failure of ours, not the cell's: the session still ends cleanly
            log.exception("session %s failed", self.id)
            self.end_reason = f"the session failed: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._stopped = True
            if not self.ready.done():
                self.ready.set_exception(SessionEnded(self.end_reason or "the session did not start"))
            if self._running is not None and not self._running.done():
                self._running.set_result(_died(self.end_reason, time.monotonic()))
            while True:  # whoever still waits learns that the session is over
                try:
                    item = self.requests.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[2].set_exception(SessionEnded(self.end_reason))

    def _serve(self, proc, pidfd: int, deadline: float) -> None:
        channel = Channel(proc.stdout.fileno(), pidfd, self._closing, proc.stdin.fileno())
        try:
            hello = channel.message(min(deadline, time.monotonic() + 30))
        except SessionEnded as e:
            self.end_reason = f"the session's kernel did not start: {e}"
            return
        if not hello["ready"]:
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
            self._running = fut
            t0 = time.monotonic()
            cell_id = uuid.uuid4().hex
            try:
                end = min(deadline, t0 + timeout_s)
                channel.send({"id": cell_id, "code": code}, end)
                reply = None
                while reply is None:  # a frame under another id was written by a cell, not by the driver: dropped
                    reply = channel.message(end, cell_id, self.output_bytes)
                result = bounded_result(reply, self.output_bytes, _ms(t0))
            except Exception as e:  # SessionEnded, OSError, or anything a reply could make go wrong: the cell
                reason = e.args[0] if isinstance(e, SessionEnded) and e.args else None  # fails, the session ends
                self.end_reason = ("a cell ran past its timeout" if reason == "timeout"
                                   else "closed" if reason == "closed" else f"the session died: {e}")
                fut.set_result(_died(self.end_reason, t0, timed_out=reason == "timeout"))
                return
            fut.set_result(result)
            self._running = None
            idle_since = time.monotonic()


def _died(reason: str, t0: float, timed_out: bool = False) -> SessionResult:
    return SessionResult(status="timeout" if timed_out else "dead", wall_ms=_ms(t0),
                         error=[{"ename": "TimeoutError" if timed_out else "SessionDied", "evalue": reason,
                                 "traceback": []}])


def bounded_result(reply: dict, output_bytes: int, wall_ms: float) -> SessionResult:
    """A cell's reply as a SessionResult with every field bounded: stdout and stderr cut to `output_bytes` each,
    the display items and the errors kept while their text fits in `output_bytes` together (the rest dropped,
    noted by a last item; all of them when the channel left them out undecoded), and nothing but strings inside
    them."""
    def text(v) -> str:
        return v if type(v) is str else ""

    def left_out(cut: int | str, kind: str) -> dict:
        note = f"tide: {cut} {kind} item(s) left out: over the session's output_kb"
        return {"ename": "OutputLimit", "evalue": note, "traceback": []} if kind == "error" else {"text/plain": note}

    def items(values, kind: str) -> list[dict]:
        if values is LEFT_OUT:  # too large to decode (replies.Channel.message)
            return [left_out("all", kind)]
        kept, used = [], 0
        for item in values if type(values) is list else []:
            if type(item) is not dict:
                continue
            if kind == "error":
                tb = item.get("traceback")
                clean = {"ename": text(item.get("ename")), "evalue": text(item.get("evalue")),
                         "traceback": [t for t in tb if type(t) is str] if type(tb) is list else []}
            else:
                clean = {str(k): text(v) for k, v in item.items() if type(k) is str}
            size = len(json.dumps(clean))
            if used + size > output_bytes:
                kept.append(left_out(len(values) - len(kept), kind))
                break
            kept.append(clean)
            used += size
        return kept

    error = items(reply.get("error"), "error")
    return SessionResult(status="error" if error else "ok", wall_ms=wall_ms,
                         stdout=text(reply.get("stdout"))[:output_bytes], stderr=text(reply.get("stderr"))[:output_bytes],
                         display=items(reply.get("display"), "display"), error=error)


def _ms(t0: float) -> float:
    return round((time.monotonic() - t0) * 1000, 3)
