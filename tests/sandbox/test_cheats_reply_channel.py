"""The third cheat corpus, first class (issue 58, item 12): reply channel forgery and service starvation. A policy's
tool calls are hostile input, to the service as much as to the judge.

A session's cell runs in the driver's own process, so it can write anything to the pipe the service reads replies
from (forged, malformed, huge or deeply nested frames, half a header, a length that never arrives), close or replace
the driver's descriptors, replace the driver's own sender or reader. Whatever it does, its request gets an answer
(the forgery is dropped, or the cell fails and the session ends), the session's container is killed and its seat
freed, and after many such cells `/health`, `/run` and new sessions still work: an unanswered request held one of
uvicorn's request slots for good, and a few hundred put the service at 503 (a reply nested deeply enough raised a
RecursionError that left the cell's future unresolved)."""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from sandbox.client import SandboxClient

TOKEN = "test-token"  # the test service's (conftest.py)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

# Reaches the driver's reply descriptor and the running request's id through the interpreter's frames (the cell is
# the session owner's own code, run in the driver's process: nothing stops it).
PRELUDE = ("import json, os, struct, sys\n"
           "_f = sys._getframe()\n"
           "while _f is not None and 'replies' not in _f.f_locals:\n    _f = _f.f_back\n"
           "REPLY, ID = _f.f_locals['replies'], _f.f_locals['request']['id']\n"
           "def frame(body):\n    os.write(REPLY, struct.pack('<I', len(body)) + body)\n"
           "def under_id(rest):\n    return b'{\"id\":\"' + ID.encode() + b'\",' + rest + b'}'\n")
DEEP = "b'[' * 200_000 + b']' * 200_000"
ATTACKS = {
    "deep frame, no id": f"frame({DEEP})",
    "deep frame under the cell's id": f"frame(under_id(b'\"display\":' + {DEEP}))",
    "deep object under the cell's id": "frame(under_id(b'\"error\":' + b'{\"a\":' * 100_000 + b'1' + b'}' * 100_000))",
    "truncated JSON under the id": "frame(under_id(b'\"stdout\":')[:-1])",
    "invalid UTF-8 under the id": "frame(under_id(b'\"stdout\":\"\\xff\\xfe\"'))",
    "NaN under the id": "frame(under_id(b'\"stdout\":NaN'))",
    "lone surrogates under the id": "frame(json.dumps({'id': ID, 'stdout': '\\ud800' * 1000}).encode())",
    "not an object": "frame(b'[1, 2]')\nframe(b'null')\nframe(b'\"x\"')\nframe(b'')",
    "wrong types under the id": "frame(under_id(b'\"stdout\":5,\"stderr\":[1],\"display\":{\"a\":1},\"error\":\"x\"'))",
    "huge forged frame, wrong id": "frame(json.dumps({'id': 'x', 'stdout': 'a' * (40 << 20)}).encode())",
    "huge list of objects under the id": "frame(under_id(b'\"display\":[' + b'{},' * (8 << 20) + b'{}]'))",
    "a stream of forged frames until the timeout": "while True:\n    frame(b'{}')",
    "oversized length header": "os.write(REPLY, struct.pack('<I', 0xFFFFFFFF))",
    "half a header": "os.write(REPLY, b'\\x01\\x02')",
    "a header promising more than comes": "os.write(REPLY, struct.pack('<I', 1 << 20) + b'{')",
    "stdout redirected into the reply pipe": "os.dup2(REPLY, 1)\nprint('x' * 100_000, flush=True)",
    "close the reply descriptor": "os.close(REPLY)",
    "close every descriptor": "os.closerange(0, 4096)",
    "the request pipe over the reply pipe": "os.dup2(_f.f_locals['requests'], REPLY)",
    "replace the driver's sender": ("sys.modules['__main__']._send = "
                                    "lambda fd, m: os.write(fd, struct.pack('<I', 5) + b'[[[[[')"),
    "exit the driver": "os._exit(3)",
    "a child that keeps forging": ("import subprocess\nsubprocess.Popen([sys.executable, '-c', 'import os, struct\\n"
                                   "while True: os.write(%d, struct.pack(\"<I\", 2) + b\"{}\")' % REPLY], "
                                   "pass_fds=[REPLY])"),
    "both stdout and stderr flooded with frames": ("for fd in (1, 2):\n"
                                                   "    os.write(fd, struct.pack('<I', 2) + b'{}' * 1000)"),
}
# Forgeries the service drops without ending the session: the driver's own reply still answers both cells.
DROPPED = {"huge forged frame, wrong id", "a child that keeps forging", "both stdout and stderr flooded with frames"}
CELL_TIMEOUT_S = 5  # every hostile cell's: a hang becomes a timeout, never a request left unanswered
ANSWER_S = 60  # the HTTP client's read timeout: a request that gets no answer fails the test instead of hanging it


@pytest.fixture(scope="module")
def quick(service):
    with SandboxClient(service.url, token=TOKEN, timeout_s=ANSWER_S, retries=0) as c:
        yield c


def _attack(client: SandboxClient, code: str) -> list[str]:
    """One hostile cell in a fresh session, then an honest one: both must be answered (a 404 for the second is an
    answer: the first ended the session). Returns the statuses."""
    sid = client.open_session(ttl_s=60)
    statuses = [client.run_in_session(sid, PRELUDE + code, timeout_s=CELL_TIMEOUT_S).status]
    r = httpx.post(f"{client.url}/sessions/{sid}/run", json={"code": "print('after')"}, headers=AUTH, timeout=ANSWER_S)
    assert r.status_code in (200, 404), (r.status_code, r.text[:300])
    statuses.append(r.json()["status"] if r.status_code == 200 else "404")
    httpx.delete(f"{client.url}/sessions/{sid}", headers=AUTH, timeout=ANSWER_S)
    return statuses


def test_the_prelude_reaches_the_reply_channel(quick):
    """Control: the corpus's cells really write where the service reads replies (a well-formed reply under the
    running cell's id is taken as that cell's: the owner's own code answering for itself, no one else's)."""
    sid = quick.open_session()
    r = quick.run_in_session(sid, PRELUDE + "frame(json.dumps({'id': ID, 'stdout': 'FORGED'}).encode())")
    assert r.stdout == "FORGED", r
    assert quick.run_in_session(sid, "print('next')").stdout == "next\n"  # the driver's own late reply is dropped
    quick.close_session(sid)


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_reply_channel_attacks_are_answered(quick, service, live_sessions, name):
    statuses = _attack(quick, ATTACKS[name])
    assert statuses[0] in ("ok", "error", "dead", "timeout"), statuses
    if name in DROPPED:
        assert statuses == ["ok", "ok"], statuses
    assert live_sessions(30) == 0, "the session's seat was not freed"
    snap = service.snapshot()
    assert not snap["slot_procs"] and not snap["sandbox_uid_procs"] and not snap["crun_state"], snap


def test_many_hostile_cells_leave_the_service_healthy(quick, service, live_sessions):
    """More hostile cells than uvicorn's request slots (4 x (pool + queue) + 64 = 112 for the test service), 8 at
    a time: every one answered, and then /health, /run and a new session work as before."""
    names = [n for n in sorted(ATTACKS) if "huge" not in n] * 6  # the huge frames have their own test above
    assert len(names) > 112
    with ThreadPoolExecutor(8) as pool:
        try:
            for fut in [pool.submit(_attack, quick, ATTACKS[n]) for n in names]:
                fut.result()  # raises at the first request left unanswered
        finally:
            pool.shutdown(cancel_futures=True)
    assert live_sessions(30) == 0, "sessions were not freed"
    r = httpx.get(f"{service.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert quick.run("python", "print(6 * 7)").stdout == "42\n"
    sid = quick.open_session()
    assert quick.run_in_session(sid, "x = 1\nx + 1").display == [{"text/plain": "2"}]
    quick.close_session(sid)
    assert live_sessions(30) == 0, "the last session was not freed"
    snap = service.snapshot()
    assert not snap["slot_procs"] and not snap["sandbox_uid_procs"] and not snap["crun_state"], snap


def test_a_driver_that_stops_reading_cannot_hold_the_sessions_thread(quick, live_sessions):
    """A cell replaces the driver's request reader with one that never reads: the next request, larger than the
    pipe's buffer, blocked the session's thread in its write for good (no answer, and DELETE could not end it)."""
    sid = quick.open_session(ttl_s=60)
    quick.run_in_session(sid, "import sys, time\nsys.modules['__main__']._read = lambda fd, n: time.sleep(10 ** 6)")
    r = httpx.post(f"{quick.url}/sessions/{sid}/run", json={"code": "#" * (4 << 20), "timeout_s": 3}, headers=AUTH,
                   timeout=ANSWER_S)
    assert r.status_code in (200, 404), r.text[:300]
    assert r.status_code == 404 or r.json()["status"] in ("timeout", "dead"), r.text[:300]
    assert live_sessions(30) == 0, "the session's seat was not freed"


@pytest.mark.timeout(60)
def test_the_reply_buffer_grows_linearly():
    """A 60 MB frame through a one-page pipe (about 15,000 reads): with `buf += chunk` every read copied the whole
    buffer (about 450 GB copied in all; a 60 MB forged frame cost 17 s of the service's CPU at 64 KiB reads), so this
    ran into the test's timeout; grown in place it is read at once."""
    import fcntl

    from sandbox.replies import Channel

    r, w = os.pipe()
    fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ: one page, so no read returns more than 4 KiB
    body = json.dumps({"id": "x", "stdout": "a" * (60 << 20)}).encode()
    writer = threading.Thread(target=os.write, args=(w, struct.pack("<I", len(body)) + body), daemon=True)
    writer.start()
    pidfd = os.pidfd_open(os.getpid())
    try:
        reader = Channel(r, pidfd, threading.Event())
        message = reader.message(time.monotonic() + 600)
        assert message["id"] == "x" and len(message["stdout"]) == 60 << 20
    finally:
        os.close(r)  # first: a writer still blocked in the pipe then fails instead of waiting for a reader
        writer.join()
        for fd in (w, pidfd):
            os.close(fd)


def test_any_error_reading_a_reply_answers_the_cell_and_ends_the_session(monkeypatch):
    """Whatever goes wrong between the pipe and the reply (here a decoder bug, RuntimeError; before, deep JSON's
    RecursionError), the running cell is answered `dead` and the session's loop returns (its container is then
    killed and its seat freed by the runtime)."""
    from sandbox import replies, sessions
    from sandbox.models import SessionRequest

    session = sessions.Session(SessionRequest(), output_bytes=1024, default_timeout_s=5, max_timeout_s=5)
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    proc = SimpleNamespace(stdout=open(out_r, "rb", buffering=0), stdin=open(in_w, "wb", buffering=0))
    hello = b'{"ready": true}'
    os.write(out_w, struct.pack("<I", len(hello)) + hello)
    real, calls = replies.Channel.message, []

    def broken_after_hello(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("a bug in the reply decoder")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(replies.Channel, "message", broken_after_hello)
    pidfd = os.pidfd_open(os.getpid())
    loop = threading.Thread(target=session.serve, args=(proc, pidfd, time.monotonic() + 60), daemon=True)
    loop.start()
    try:
        assert session.ready.result(10) == session.id
        result = session.run("1 + 1", 5).result(10)
        assert result.status == "dead" and "a bug in the reply decoder" in result.error[0]["evalue"], result
        loop.join(10)
        assert not loop.is_alive()
        with pytest.raises(sessions.SessionEnded):
            session.run("1", 5)
    finally:
        session.close()
        loop.join(10)
        for f in (proc.stdout, proc.stdin):
            f.close()
        for fd in (out_w, in_r, pidfd):
            os.close(fd)
