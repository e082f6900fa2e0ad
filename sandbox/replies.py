"""A session's channel to its driver, read as hostile input: a cell runs in the driver's own process and can write
anything to the pipe the service reads replies from, close or replace the driver's descriptors, or stop it reading.

Requests go out with a deadline (the pipe is non-blocking: a driver that stops reading cannot hold the session's
thread). Replies are length-prefixed JSON frames, buffered in place (a bytearray: `bytes += chunk` copied the whole
buffer on every read, so a 60 MB forged frame cost 17 s of the service's CPU) and decoded by msgspec, which is
strict where the standard library is not: no NaN / Infinity, valid UTF-8 and no lone surrogate (a reply holding one
could not be sent on as JSON), a depth error instead of a RecursionError escaping, and fields of the expected types.
`display` and `error` stay raw until their size is known: past a bound the reply could not keep them anyway, so
they are left out without building their objects (a list of 8 million `{}` would take gigabytes). Whatever goes
wrong is a SessionEnded: the caller answers the cell and ends the session."""
from __future__ import annotations

import math
import os
import select
import struct
import threading
import time

import msgspec

MAX_FRAME = 64 << 20
CLOSE_POLL_S = 0.05  # how often a wait for the container notices the session was deleted
LEFT_OUT = object()  # a reply's display or error list too large to keep (sessions.bounded_result notes it)


class SessionEnded(Exception):
    pass


class _Frame(msgspec.Struct):
    """A reply as the driver writes it: {"ready": true} once, then {id, stdout, stderr, display, error} per cell."""

    id: str = ""
    ready: bool = False
    stdout: str = ""
    stderr: str = ""
    display: msgspec.Raw = msgspec.Raw(b"[]")
    error: msgspec.Raw = msgspec.Raw(b"[]")


class Channel:
    """The driver's stdin (requests) and stdout (replies), with deadlines; ends if the container exits."""

    def __init__(self, out_fd: int, pidfd: int, closing: threading.Event, in_fd: int | None = None) -> None:
        self.fd, self.in_fd, self.pidfd, self.closing = out_fd, in_fd, pidfd, closing
        self.buf = bytearray()
        # poll, not select: select() cannot watch a descriptor numbered past 1024, and a service with hundreds of
        # sessions has more open
        self.poller = select.poll()
        self.poller.register(out_fd, select.POLLIN)
        self.poller.register(pidfd, select.POLLIN)
        if in_fd is not None:
            os.set_blocking(in_fd, False)
            self.out_poller = select.poll()
            self.out_poller.register(in_fd, select.POLLOUT)
            self.out_poller.register(pidfd, select.POLLIN)

    def _wait(self, poller: select.poll, fd: int, deadline: float) -> None:
        """Until `fd` is ready (a container that exited still has its last bytes read)."""
        while True:
            if self.closing.is_set():
                raise SessionEnded("closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionEnded("timeout")
            ready = {ready_fd for ready_fd, _ in poller.poll(math.ceil(min(left, CLOSE_POLL_S) * 1000))}
            if fd in ready:
                return
            if self.pidfd in ready:
                raise SessionEnded("the container exited")

    def send(self, message: dict, deadline: float) -> None:
        """One request frame, written within the deadline (a driver a cell stopped reading cannot block it)."""
        body = msgspec.json.encode(message)
        data = memoryview(struct.pack("<I", len(body)) + body)
        while data:
            try:
                data = data[os.write(self.in_fd, data):]
            except BlockingIOError:
                self._wait(self.out_poller, self.in_fd, deadline)

    def _fill(self, n: int, deadline: float) -> None:
        while len(self.buf) < n:
            self._wait(self.poller, self.fd, deadline)
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise SessionEnded("the container exited")
            self.buf += chunk  # in place: amortised linear

    def frame(self, deadline: float) -> bytes:
        """The next frame's body."""
        self._fill(4, deadline)
        (size,) = struct.unpack_from("<I", self.buf)
        if size > MAX_FRAME:
            raise SessionEnded("reply too large")
        self._fill(4 + size, deadline)
        with memoryview(self.buf) as view, view[4:4 + size] as part:
            body = bytes(part)
        del self.buf[:4 + size]  # from the front: bytearray only moves its start
        return body

    def message(self, deadline: float, cell_id: str | None = None, output_bytes: int = 0) -> dict | None:
        """The next frame as a reply dict (see bounded_result); with `cell_id`, None for a frame that is not that
        cell's reply (a cell wrote it: dropped, so it never stands in for the reply). Display and error lists whose
        JSON passes twice `output_bytes` (with slack) are LEFT_OUT undecoded: the reply keeps at most `output_bytes`
        of them."""
        body = self.frame(deadline)
        try:
            frame = msgspec.json.decode(body, type=_Frame)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            raise SessionEnded(f"malformed reply: {e}") from None
        if cell_id is not None and frame.id != cell_id:
            return None
        reply: dict = {"id": frame.id, "ready": frame.ready, "stdout": frame.stdout, "stderr": frame.stderr}
        for name in ("display", "error"):
            raw = getattr(frame, name)
            if len(raw) > 2 * output_bytes + 4096:
                reply[name] = LEFT_OUT
                continue
            try:
                reply[name] = msgspec.json.decode(raw)
            except (msgspec.DecodeError, RecursionError) as e:
                raise SessionEnded(f"malformed reply: {e}") from None
        return reply
