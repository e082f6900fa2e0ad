"""Where sessions live: each live session on a seat of its own (a cgroup slot and a network namespace outside the
run pool: a session idles while its agent's model generates, and must not hold a slot runs need), its container
served by a thread of its own from start to end; a seat is made when a session first needs it and reused once
it is drained."""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable

from . import metrics
from .cgroups import Slot
from .config import Resolved, SandboxConfig
from .containers import Containers
from .errors import BadRequest, Overloaded
from .images import Image
from .models import SessionRequest
from .sessions import DRIVER as SESSION_DRIVER
from .sessions import Session

log = logging.getLogger("tide.sandbox")


@dataclass
class SessionSeat:
    """Where one session's container lives: a cgroup slot and a network namespace of the sessions' own."""

    slot: Slot
    netns: str


class SessionHost:
    """The live sessions and their seats. `new_seat(index)` makes the seat of a slot index past the run pool's."""

    def __init__(self, config: SandboxConfig, containers: Containers, images: dict[str, Image],
                 new_seat: Callable[[int], SessionSeat]):
        self.config = config
        self.containers = containers
        self.images = images
        self._new_seat = new_seat
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._free_seats: list[SessionSeat] = []
        self._seats_made = 0

    @property
    def max_sessions(self) -> int:
        """Live sessions allowed (each on a seat of its own, beside the run pool)."""
        return self.config.max_sessions

    def open(self, req: SessionRequest) -> Session:
        """Start a session on a seat of its own; its `ready` future gives the id once its kernel answers."""
        image = req.image or self.config.default_image
        if image not in self.images:
            raise BadRequest(f"unknown image {image!r}; known: {sorted(self.images)}")
        limits = self.config.effective(req.limits)
        session = Session(req, output_bytes=limits.output_kb * 1024, default_timeout_s=limits.timeout_s,
                          max_timeout_s=min(self.config.max_limits.timeout_s or math.inf, req.ttl_s))
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                metrics.REJECTED.inc()
                raise Overloaded(f"{len(self._sessions)} sessions live (max {self.max_sessions})")
            self._sessions[session.id] = session
        try:
            seat = self._take_seat()
        except Exception:
            self._ended(session)
            raise
        threading.Thread(target=self._serve, args=(seat, session), name=f"sandbox-session-{seat.slot.index}",
                         daemon=True).start()
        return session

    def get(self, session_id: str) -> Session:
        with self._lock:
            return self._sessions[session_id]  # KeyError: unknown or ended

    def live(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close_all(self) -> None:
        """End every live session and wait until each one's seat is drained."""
        with self._lock:
            live = list(self._sessions.values())
        for session in live:
            session.close()
        for session in live:  # its thread has drained its seat
            session.ended.wait(timeout=30)

    def _take_seat(self) -> SessionSeat:
        with self._lock:
            if self._free_seats:
                return self._free_seats.pop()
            index = self.config.pool_size + self._seats_made  # run slots are 0..pool_size-1
            self._seats_made += 1
        return self._new_seat(index)

    def _serve(self, seat: SessionSeat, session: Session) -> None:
        """The session's own thread: its container from start to end, then the seat drained and freed."""
        seat.slot.join_current_thread()
        metrics.SESSIONS.inc()
        try:
            self._run_container(seat, session)
        except Exception as exc:  # a session that fails ends alone
            log.exception("session failed")
            if not session.ready.done():
                session.ready.set_exception(exc)
        finally:
            drained = seat.slot.drain(timeout_s=5.0)
            with self._lock:  # the session counts (health, the cap) until its seat is empty again
                self._sessions.pop(session.id, None)
                if drained:
                    self._free_seats.append(seat)
            if not drained:
                log.error("session slot %d: processes survive SIGKILL; not reused", seat.slot.index)
                metrics.BROKEN.inc()
            metrics.SESSIONS.dec()
            session.ended.set()

    def _ended(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)

    def _run_container(self, seat: SessionSeat, session: Session) -> None:
        limits = self.config.effective(session.req.limits)
        image = self.images[session.req.image or self.config.default_image]
        files = {".tide_session.py": SESSION_DRIVER}
        # The container lives until the session ends (at most max_session_s); limits.timeout_s is per cell.
        lifetime = Resolved(timeout_s=self.config.max_session_s, memory_mb=limits.memory_mb,
                            output_kb=limits.output_kb, pids=limits.pids, disk_mb=limits.disk_mb)
        args = ["python3", "-I", ".tide_session.py", str(limits.output_kb * 1024)]
        out_bytes = limits.output_kb * 1024
        with self.containers.workspace(seat, limits, image, files, {}, b"", out_bytes) as (rootfs, out, _):
            self.containers.phase(seat, rootfs, image, args, lifetime, None, out, "session", session=session)
