"""Sessions: a live Python namespace per session in its own slot; state kept across cells and never visible to
another session; closed, timed-out and idle (reaped) sessions leave nothing behind; a cap on live sessions."""
from __future__ import annotations

import time

import pytest

from sandbox.client import SandboxError

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


def _wait_no_sessions(client, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while client.health().sessions:
        assert time.monotonic() < deadline, "sessions were not reaped"
        time.sleep(0.05)


def test_state_across_cells_and_outputs(client):
    sid = client.open_session()
    try:
        assert client.run_in_session(sid, "import os\nx = 40\nopen('/work/note', 'w').write('mine')").status == "ok"
        r = client.run_in_session(sid, "print('x is', x); x + 2")
        assert (r.status, r.stdout, r.display) == ("ok", "x is 40\n", [{"text/plain": "42"}])
        r = client.run_in_session(sid, "import subprocess; subprocess.run(['echo', 'child']); 1 / 0")
        assert r.status == "error" and r.stdout == "child\n" and r.error[0]["ename"] == "ZeroDivisionError"
        assert client.run_in_session(sid, "x").display == [{"text/plain": "40"}]  # the error kept the state
    finally:
        client.close_session(sid)


def test_two_sessions_cannot_see_each_other(client):
    a, b = client.open_session(), client.open_session()
    try:
        client.run_in_session(a, "secret = 'a-only'\nopen('/work/a.txt', 'w').write('a')\nopen('/tmp/a', 'w').write('a')")
        r = client.run_in_session(b, "import os\nprint('secret' in globals(), os.path.exists('/work/a.txt'), "
                                     "os.path.exists('/tmp/a'), sorted(os.listdir('/proc'))[:0])")
        assert r.stdout == "False False False []\n", r
        procs = client.run_in_session(b, "import os; print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
        assert procs.stdout.strip() in ("['1']", "['1', '2']", "['1', '3']"), procs  # only its own processes
    finally:
        client.close_session(a)
        client.close_session(b)


def test_timeout_ends_the_session_and_unknown_ids_are_404(client):
    sid = client.open_session(limits={"timeout_s": 1})
    assert client.run_in_session(sid, "while True: pass").status == "timeout"
    with pytest.raises(SandboxError, match="404"):
        client.run_in_session(sid, "1")
    with pytest.raises(SandboxError, match="404"):
        client.close_session("no-such-session")


def test_live_sessions_are_capped(client):
    cap = client.health().max_sessions
    ids = [client.open_session() for _ in range(cap)]
    try:
        over = client._http.post("/sessions", json={})  # once, without the client's retries on 503
        assert over.status_code == 503 and "sessions live" in over.text, over.text
        assert client.run("python", "print(1)").stdout == "1\n"  # runs still have slots
    finally:
        for sid in ids:
            client.close_session(sid)
    _wait_no_sessions(client)


def test_500_sessions_used_and_closed_and_50_abandoned_leave_nothing(client, service):
    _wait_no_sessions(client)
    before = service.snapshot()
    for i in range(500):
        sid = client.open_session()
        assert client.run_in_session(sid, f"v = {i}\nv * 2").display == [{"text/plain": str(2 * i)}]
        client.close_session(sid)
    cap = client.health().max_sessions
    abandoned = 0
    while abandoned < 50:
        _wait_no_sessions(client)
        for _ in range(min(cap, 50 - abandoned)):  # opened, used, never closed: reaped after ttl_s
            sid = client.open_session(ttl_s=0.3)
            client.run_in_session(sid, "import time; data = bytearray(1 << 20)")
            abandoned += 1
    _wait_no_sessions(client)
    service.assert_unchanged(before)  # no kernel, cgroup, mount or /run entry left
