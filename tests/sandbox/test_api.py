"""HTTP API: auth, limits on requests, overload, batch, health, metrics, schema; plus the leak test."""
from __future__ import annotations

import time

import httpx
import pytest

from sandbox.client import SandboxClient, SandboxError
from sandbox.models import RunRequest

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
POOL, QUEUE = 4, 8  # as started by conftest


def test_the_service_keeps_an_idle_connection_longer_than_the_client_does(service):
    """A request sent on a kept-alive connection at the moment the server closes it for idling is lost ("Server
    disconnected without sending a response") and, opening a session or running a cell, cannot be retried. The
    client drops idle connections after KEEPALIVE_S; the service keeps one well past that (uvicorn's default, 5 s,
    equal to httpx's, was the race): an idle connection still answers after 6 s."""
    import http.client

    from sandbox.client import KEEPALIVE_S

    host, port = service.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for idle in (0.0, 6.0):
            time.sleep(idle)  # the connection idles, as one in the client's pool may for up to KEEPALIVE_S
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            assert conn.sock is not None, "the service closed the connection after answering"
        assert KEEPALIVE_S < 6.0
    finally:
        conn.close()


def test_health_schema_metrics(client, service):
    h = client.health()
    assert h.status == "ok" and h.slots == POOL and h.cgroup_mode in ("v1", "hybrid", "v2")
    assert {"python", "c", "cpp", "javascript", "bash", "java"} <= set(h.languages)
    schema = httpx.get(service.url + "/openapi.json").json()
    assert {"/run", "/run_batch", "/health", "/metrics"} <= set(schema["paths"])
    client.run("bash", "true")
    m = httpx.get(service.url + "/metrics", headers={"Authorization": "Bearer test-token"}).text
    assert 'tide_sandbox_runs_total{language="bash",status="ok"}' in m
    assert "tide_sandbox_run_seconds_bucket" in m
    # The leak probes really see the service's state (it lives in the service's own mount namespace).
    snap = service.snapshot()
    assert "netns/slot0" in snap["state_files"] and len(snap["cgroups"]) >= POOL


def test_crun_runs_from_a_read_only_bind(client, service):
    """crun skips its per-start self re-exec (CVE-2019-5736 guard) only from a read-only mount."""
    mounts = [line.split() for line in open(f"/proc/{service.pid}/mountinfo")]
    options = [m[5].split(",") for m in mounts if m[4].endswith(f"/{service.pid}/bin/crun")]
    assert options and "ro" in options[-1], options
    assert client.run("bash", "echo ok").stdout == "ok\n"


def test_auth(service):
    body = {"language": "bash", "code": "true"}
    assert httpx.post(service.url + "/run", json=body).status_code == 401
    assert httpx.post(service.url + "/run", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    with pytest.raises(SandboxError, match="401"):
        SandboxClient(service.url, token="nope").run("bash", "true")


def test_bad_requests(client, service):
    hdr = {"Authorization": "Bearer test-token"}
    r = httpx.post(service.url + "/run", json={"language": "cobol", "code": "x"}, headers=hdr)
    assert r.status_code == 400 and "unknown language" in r.text
    r = httpx.post(service.url + "/run", json={"language": "bash", "code": "x", "files": {"../x": ""}}, headers=hdr)
    assert r.status_code == 400
    r = httpx.post(service.url + "/run", json={"language": "bash"}, headers=hdr)
    assert r.status_code == 422
    big = {"language": "bash", "code": "#" * (17 * 1024 * 1024)}
    r = httpx.post(service.url + "/run", json=big, headers=hdr, timeout=60)
    assert r.status_code == 413
    assert client.health().status == "ok"


def test_limits_are_capped(client):
    r = client.run("bash", "ulimit -n; echo ok", limits={"timeout_s": 10_000, "memory_mb": 10**6})
    assert r.status.value == "ok"


def test_batch_and_overload(client, service):
    reqs = [RunRequest(language="bash", code=f"echo {i}") for i in range(POOL + QUEUE)]
    res = client.run_batch(reqs)
    assert [r.stdout for r in res] == [f"{i}\n" for i in range(POOL + QUEUE)]
    # More than pool + queue can never fit: refused at once (413), nothing is run; the client splits it.
    hdr = {"Authorization": "Bearer test-token"}
    body = {"runs": [q.model_dump() for q in reqs + reqs[:1]]}
    r = httpx.post(service.url + "/run_batch", json=body, headers=hdr, timeout=10)
    assert r.status_code == 413
    assert len(client.run_batch(reqs + reqs[:3])) == len(reqs) + 3
    # A full queue answers 503 with Retry-After at once, never hangs.
    sleeper = {"runs": [{"language": "bash", "code": "sleep 2", "limits": {"timeout_s": 5}}] * (POOL + QUEUE)}
    with httpx.Client(base_url=service.url, headers=hdr, timeout=30) as h:
        import threading

        t = threading.Thread(target=h.post, args=("/run_batch",), kwargs={"json": sleeper})
        t.start()
        deadline = time.monotonic() + 10
        while client.health().queued + client.health().busy < POOL + QUEUE and time.monotonic() < deadline:
            time.sleep(0.02)
        t0 = time.monotonic()
        r = httpx.post(service.url + "/run", json={"language": "bash", "code": "true"}, headers=hdr, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and time.monotonic() - t0 < 2
        with pytest.raises(SandboxError, match="overloaded"):
            SandboxClient(service.url, token="test-token", retries=1, backoff_s=0.01).run("bash", "true")
        t.join()
    assert client.health().queued == 0


def test_leak_1000_runs(client, service):
    """1,000 executions, then the same processes, mounts, cgroups, files and fds as before."""
    client.health()
    before = service.snapshot()
    langs = [("bash", "echo $((6 * 7))", "42\n"), ("python", "print(6 * 7)", "42\n")]
    n, batch = 1000, POOL + QUEUE
    done = 0
    while done < n:
        k = min(batch, n - done)
        reqs = [RunRequest(language=langs[(done + i) % 10 == 0][0], code=langs[(done + i) % 10 == 0][1])
                for i in range(k)]
        for q, r in zip(reqs, client.run_batch(reqs)):
            assert r.status.value == "ok" and r.stdout == "42\n", r
        done += k
    service.assert_unchanged(before)
    assert client.health().status == "ok"


def test_a_runs_time_limit_is_cpu_time_with_a_wall_cap(client):
    """A run kept off the CPU beyond its limit (on a core where a process of the host spins: a busy node made to
    happen, the two cgroups sharing the core) ends `ok` on the CPU it spent; a sleeping run times out at the wall cap,
    wall_time_factor (3) x its limit; a spinning one once it has spent its limit (tests/sandbox/test_hostile.py)."""
    import subprocess
    import sys

    cpu = min(__import__("os").sched_getaffinity(0))
    spin = ("import os, time\nos.sched_setaffinity(0, {%d})\nend = time.monotonic() + 3.5\n"
            "while time.monotonic() < end: pass\n" % cpu)
    code = ("import os, time\n"
            f"os.sched_setaffinity(0, {{{cpu}}})\n"
            "t = time.process_time()\n"
            "while time.process_time() - t < 1.7: pass\n"
            "print('done')")

    def starved_run():
        spinner = subprocess.Popen([sys.executable, "-c", spin])
        try:
            return client.run("python", code, limits={"timeout_s": 2})
        finally:
            spinner.kill()
            spinner.wait()

    starved = starved_run()
    # where the suite's other worker shares the core too, the run may not get its 1.7 s of CPU within the 6 s cap
    # (1.55 s once, defb89d's suite): the cap came first and tells nothing about the CPU limit, so it runs again
    for _ in range(3):
        if not (starved.status.value == "timeout" and starved.wall_ms >= 3 * 2000 and starved.cpu_ms < 1700):
            break
        starved = starved_run()
    assert starved.status.value == "ok" and starved.stdout.strip() == "done", starved
    # the container's cgroup got ~3/4 of the core beside the host's spinner (measured here): past its 2 s of wall (a
    # wall-clock limit would have stopped it) on ~1.75 s of CPU, within its 6 s cap down to ~0.3 of a core
    assert starved.wall_ms > 2000 and starved.cpu_ms < 2000, starved
    sleeping = client.run("bash", "sleep 100", limits={"timeout_s": 1})
    assert sleeping.status.value == "timeout" and 3000 <= sleeping.wall_ms < 3000 + 2000, sleeping
