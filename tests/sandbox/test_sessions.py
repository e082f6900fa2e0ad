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


def test_processes_a_cell_forks_never_answer_the_next_cells(client):
    """A cell's forked children that come back out of the cell (a fork loop stopped by the pids limit, a bare
    os.fork()) must not become drivers of their own reading the session's next requests."""
    # 30 s for a cell, not the default 10: in one full run on the loaded 2-core machine the fork loop had not met the
    # pids limit after 10 s and the cell ended in a timeout (the test's subject is what comes after it)
    sid = client.open_session(limits={"pids": 32, "timeout_s": 30})
    try:
        bomb = client.run_in_session(sid, "import os\nwhile True:\n    os.fork()")
        assert bomb.status == "error" and bomb.error[0]["ename"] == "BlockingIOError", bomb
        assert client.run_in_session(sid, "for _ in range(3):\n    os.fork()").status == "ok"
        answers = [client.run_in_session(sid, "os.getpid()").display for _ in range(8)]
        assert answers == [[{"text/plain": "1"}]] * 8, answers  # one process answers every cell: the driver
        flood = client.run_in_session(sid, "print('x' * 1_000_000)")
        assert flood.status == "ok" and flood.stdout.startswith("xxx"), flood
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


def test_256_sessions_live_at_once_each_used_while_the_others_wait_beside_reward_batches(client):
    """Agents hold a session per trajectory while their model generates: hundreds live at once on this 2-core
    machine, none refused, each keeping its state across cells while the others wait, and runs (reward batches)
    served meanwhile on the run pool, which sessions never take; one more than --max-sessions is refused."""
    from concurrent.futures import ThreadPoolExecutor

    from sandbox.models import RunRequest

    SESSIONS, BATCH = 256, 8  # the test service's --max-sessions (tests/sandbox/conftest.py); a reward batch
    assert client.health().max_sessions == SESSIONS
    with ThreadPoolExecutor(64) as pool:
        ids = list(pool.map(lambda _: client.open_session(ttl_s=120), range(SESSIONS)))
        try:
            assert client.health().sessions == SESSIONS and len(set(ids)) == SESSIONS
            over = client._http.post("/sessions", json={})  # once, without the client's retries on 503
            assert over.status_code == 503 and "sessions live" in over.text, over.text
            batch = pool.submit(client.run_batch, [RunRequest(language="python", code=f"print({i} * 7)")
                                                   for i in range(BATCH)])
            for turn in range(3):  # every session runs a cell, in turn, while the others idle
                code = "v = {k}\nv" if turn == 0 else "v = v + 1\nv"
                replies = list(pool.map(lambda k: client.run_in_session(ids[k], code.format(k=k)), range(SESSIONS)))
                assert [r.display for r in replies] == [[{"text/plain": str(k + turn)}] for k in range(SESSIONS)]
            assert [r.stdout for r in batch.result(timeout=120)] == [f"{i * 7}\n" for i in range(BATCH)]
        finally:
            list(pool.map(client.close_session, ids))
    _wait_no_sessions(client)


def test_500_sessions_used_and_closed_and_50_abandoned_leave_nothing(client, service):
    """...but the seats sessions live on (a cgroup slot and a network namespace each), made once and reused: 50 are
    made first, and 550 sessions later there are no more."""
    from concurrent.futures import ThreadPoolExecutor

    _wait_no_sessions(client)
    with ThreadPoolExecutor(50) as pool:
        list(pool.map(client.close_session, list(pool.map(lambda _: client.open_session(), range(50)))))
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
