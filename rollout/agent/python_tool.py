"""The built-in `python` tool: one sandbox session per trajectory (sandbox/sessions.py), opened at the trajectory's
first call and closed when it ends; a session left behind by a run that died is reaped by the sandbox after its
`ttl_s` of idleness. Its state (variables, files) lasts across the trajectory's calls, as in a notebook: the tool
is stateful, so a turn's calls run one after another in the order the model wrote them (rollout/agent/tools.py),
and the session itself takes one call at a time, in the order they come.

What comes back to the model is the cell's stdout, stderr, the value of a final expression and the error, if
any; a cell past its timeout ends the session (the sandbox kills it): the call fails (counted as a timeout), the
model reads that its state is gone, and the next call opens a new one. A call that the tool box's timeout cancels
ends the session too (its cell may still be running), and a session whose opening such a call left in flight is
closed once it has opened: `close` waits for both, so no session outlives its trajectory.

The session's HTTP requests run in two threads of its own (a cell's request, and the request that ends its session
while the cell's still waits), never in a pool other trajectories need."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .tools import Tool, tool_from_function


class _Opening:
    sid: str | None = None
    abandoned: bool = False


class PythonSession:
    def __init__(self, client, limits: dict[str, Any] | None = None, ttl_s: float = 300.0,
                 cell_timeout_s: float = 10.0) -> None:
        self.client, self.limits, self.ttl_s, self.cell_timeout_s = client, limits or {}, ttl_s, cell_timeout_s
        self.session_id: str | None = None
        self.opened = 0
        self._threads: ThreadPoolExecutor | None = None
        self._in_flight: list[Future] = []  # openings and closings not known to have finished
        self._tickets = threading.Lock()  # an opening's outcome against its caller's cancellation
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    async def python(self, code: str) -> str:
        """Run Python code in this conversation's own interpreter, which keeps its variables between calls, and
        return what it printed and the value of its last expression.

        Args:
            code: the Python source to run
        """
        async with self._one_at_a_time():
            sid = await self._session()
            try:
                r = await asyncio.wrap_future(self._submit(self.client.run_in_session, sid, code, self.cell_timeout_s))
            except asyncio.CancelledError:  # the tool box's timeout: the cell may still run; end the session
                self._end(sid)
                raise
            except Exception:  # the request failed: the session's state is unknown
                self._end(sid)
                raise
        parts = [r.stdout, r.stderr] + [d.get("text/plain", "") for d in r.display]
        if r.status in ("timeout", "dead"):
            self.session_id = None  # the sandbox ended it: the next call starts afresh
            # raised, so that the tool box counts the call as failed (TimeoutError: as a timeout)
            if r.status == "timeout":
                raise TimeoutError(f"the cell ran past {self.cell_timeout_s:g} s; the interpreter was restarted "
                                   f"and its variables are gone")
            raise RuntimeError("the interpreter died; its variables are gone")
        for e in r.error:
            parts.append("".join(e.get("traceback") or []) or f"{e.get('ename')}: {e.get('evalue')}")
        return "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts if p).rstrip("\n")

    def tool(self) -> Tool:
        return tool_from_function(self.python, stateful=True)

    async def close(self) -> None:
        """End the session, after any opening or closing still in flight (a session they open is ended too)."""
        if self.session_id is not None:
            self._end(self.session_id)
        while self._in_flight:
            pending, self._in_flight = self._in_flight, []
            await asyncio.gather(*[asyncio.wrap_future(f) for f in pending], return_exceptions=True)
        if self._threads is not None:
            self._threads.shutdown(wait=False)
            self._threads = None

    def _one_at_a_time(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:  # a lock belongs to the event loop it was used in
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _session(self) -> str:
        if self.session_id is None:
            ticket = _Opening()
            opening = self._submit(self._open, ticket)
            self._in_flight.append(opening)
            try:
                self.session_id = await asyncio.shield(asyncio.wrap_future(opening))
            except asyncio.CancelledError:  # the session may open after all: whoever comes second ends it
                with self._tickets:
                    ticket.abandoned, sid = True, ticket.sid
                if sid is not None:
                    self._end(sid)
                raise
            self._in_flight.remove(opening)
        return self.session_id

    def _open(self, ticket: "_Opening") -> str | None:
        """In a thread: open a session, and end it at once if the call that asked for it was cancelled."""
        sid = self.client.open_session(self.limits, self.ttl_s)
        with self._tickets:
            ticket.sid, abandoned = sid, ticket.abandoned
        if abandoned:
            self._close_quietly(sid)
            return None
        self.opened += 1
        return sid

    def _end(self, sid: str) -> None:
        if self.session_id == sid:
            self.session_id = None
        self._in_flight.append(self._submit(self._close_quietly, sid))

    def _close_quietly(self, sid: str) -> None:
        try:
            self.client.close_session(sid)
        except Exception:  # already ended (timeout, reaped): nothing to close
            pass

    def _submit(self, fn, *args) -> Future:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(2, thread_name_prefix="tide-python-tool")
        return self._threads.submit(fn, *args)
