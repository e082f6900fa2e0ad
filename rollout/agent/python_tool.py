"""The built-in `python` tool: one sandbox session per trajectory (sandbox/sessions.py), opened at the trajectory's
first call and closed when it ends; a session left behind by a run that died is reaped by the sandbox after its
`ttl_s` of idleness. Its state (variables, files) lasts across the trajectory's calls, as in a notebook.

What comes back to the model is the cell's stdout, stderr, the value of a final expression and the error, if
any; a cell past its timeout ends the session (the sandbox kills it): the call fails (counted as a timeout), the
model reads that its state is gone, and the next call opens a new one."""
from __future__ import annotations

import asyncio
from typing import Any

from .tools import Tool, tool_from_function


class PythonSession:
    def __init__(self, client, limits: dict[str, Any] | None = None, ttl_s: float = 300.0,
                 cell_timeout_s: float = 10.0) -> None:
        self.client, self.limits, self.ttl_s, self.cell_timeout_s = client, limits or {}, ttl_s, cell_timeout_s
        self.session_id: str | None = None
        self.opened = 0

    async def python(self, code: str) -> str:
        """Run Python code in this conversation's own interpreter, which keeps its variables between calls, and
        return what it printed and the value of its last expression.

        Args:
            code: the Python source to run
        """
        if self.session_id is None:
            self.session_id = await asyncio.to_thread(self.client.open_session, self.limits, self.ttl_s)
            self.opened += 1
        r = await asyncio.to_thread(self.client.run_in_session, self.session_id, code, self.cell_timeout_s)
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
        return tool_from_function(self.python)

    async def close(self) -> None:
        if self.session_id is not None:
            sid, self.session_id = self.session_id, None
            try:
                await asyncio.to_thread(self.client.close_session, sid)
            except Exception:  # already ended (timeout, reaped): nothing to close
                pass
