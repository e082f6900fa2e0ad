"""The third cheat corpus, second class (issue 58, item 13): malformed request bodies. NaN / Infinity, numbers out of
range, lone surrogates, invalid UTF-8, bodies of the wrong type or depth, on every endpoint that takes a body: each
answers 4xx with a body that is valid JSON in UTF-8, never 500 (FastAPI could not serialise its own 422 for a NaN,
nor any answer holding a lone surrogate), and a cell whose error text holds a lone surrogate is still answered."""
from __future__ import annotations

import json

import httpx
import pytest

from sandbox.client import SandboxClient

TOKEN = "test-token"  # the test service's (conftest.py)
AUTH = {"Authorization": f"Bearer {TOKEN}"}
pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def quick(service):
    with SandboxClient(service.url, token=TOKEN, timeout_s=60, retries=0) as c:
        yield c


SID = "0" * 32  # no such session: a body is validated before the session is looked up
RUN = '{"language":"python","code":"print(1)"'
BODIES = {  # name -> (path, body bytes, content type)
    "NaN limit": ("/run", RUN + ',"limits":{"timeout_s":NaN}}', None),
    "Infinity limit": ("/run", RUN + ',"limits":{"timeout_s":Infinity}}', None),
    "-Infinity tolerance": ("/run", RUN + ',"cases":[{"expected_stdout":"1"}],"checker":{"abs_tol":-Infinity}}', None),
    "number out of range": ("/run", RUN + ',"limits":{"timeout_s":1e999}}', None),
    "NaN for an int": ("/run", RUN + ',"limits":{"memory_mb":NaN}}', None),
    "NaN for a string": ("/run", '{"language":"python","code":NaN}', None),
    "NaN in a batch": ("/run_batch", '{"runs":[' + RUN + ',"limits":{"timeout_s":NaN}}]}', None),
    "NaN ttl": ("/sessions", '{"ttl_s":NaN}', None),
    "Infinity ttl": ("/sessions", '{"ttl_s":Infinity}', None),
    "NaN cell timeout": (f"/sessions/{SID}/run", '{"code":"1","timeout_s":NaN}', None),
    "NaN run_timeout": ("/run_code", '{"code":"print(1)","language":"python","run_timeout":NaN}', None),
    "NaN memory_limit_MB": ("/run_code", '{"code":"print(1)","language":"python","memory_limit_MB":NaN}', None),
    "NaN through the path token": (f"/token/{TOKEN}/run_code",
                                   '{"code":"print(1)","language":"python","run_timeout":NaN}', None),
    "NaN total_timeout": ("/run_jupyter", '{"cells":["1"],"total_timeout":NaN}', None),
    "lone surrogate echoed by a model error": (
        "/run", '{"language":"python","code":"\\ud800","tests":["assert 1"],"cases":[{"expected_stdout":""}]}', None),
    "lone surrogate in code": ("/run", '{"language":"python","code":"print(1) # \\ud800"}', None),
    "lone surrogate in stdin": ("/run", RUN + ',"stdin":"\\udcff"}', None),
    "lone surrogate in a file name": ("/run", RUN + ',"files":{"\\ud800":"x"}}', None),
    "lone surrogate in a test": ("/run", '{"language":"javascript","code":"1","tests":["\\ud800"]}', None),
    "lone surrogate in a language": ("/run", '{"language":"\\ud800","code":"1"}', None),
    "lone surrogate in fusion code": ("/run_code", '{"code":"print(1) # \\ud800","language":"python"}', None),
    "lone surrogate in a jupyter cell": ("/run_jupyter", '{"cells":["1 # \\ud800"]}', None),
    "lone surrogate in a session's code": (f"/sessions/{SID}/run", '{"code":"\\ud800"}', None),
    "fusion file that is not base64": ("/run_code", '{"code":"print(1)","language":"python","files":{"a":"!!"}}', None),
    "invalid UTF-8": ("/run", b'{"language":"python","code":"\xff"}', None),
    "invalid UTF-8 as text/plain": ("/run", b'\xff\xfe', "text/plain"),
    "nested just under the parser's depth": ("/run", '{"language":"python","code":' + "[" * 900 + "]" * 900 + "}",
                                             None),
    "nested past the parser's depth": ("/run", '{"language":"python","code":' + "[" * 100_000 + "]" * 100_000 + "}",
                                       None),
    "not an object": ("/sessions", "[1, 2]", None),
}


def _strict_json(data: bytes):
    """The body as JSON that any client can read: UTF-8, no NaN / Infinity, no lone surrogate in a string."""
    def refuse(token):
        raise ValueError(f"non-JSON constant {token}")
    value = json.loads(data.decode("utf-8"), parse_constant=refuse)
    json.dumps(value, ensure_ascii=False).encode("utf-8")  # raises on a lone surrogate
    return value


@pytest.mark.parametrize("name", sorted(BODIES))
def test_malformed_bodies_answer_4xx(service, name):
    path, body, content_type = BODIES[name]
    headers = {**AUTH, "content-type": content_type or "application/json"}
    r = httpx.post(service.url + path, content=body.encode() if isinstance(body, str) else body, headers=headers,
                   timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert "detail" in _strict_json(r.content), r.text[:500]


def test_malformed_bodies_leave_the_service_healthy(service, quick):
    for path, body, content_type in BODIES.values():
        httpx.post(service.url + path, content=body.encode() if isinstance(body, str) else body,
                   headers={**AUTH, "content-type": content_type or "application/json"}, timeout=60)
    assert httpx.get(f"{service.url}/health", timeout=10).json()["status"] == "ok"
    assert quick.run("python", "print('fine')").stdout == "fine\n"


def test_a_lone_surrogate_in_a_cells_error_is_answered_and_the_session_lives(quick):
    """An exception's text or a repr holding a lone surrogate: the reply reached the service as JSON's `\\ud800` and
    its answer could not be encoded (a 500); the driver sends U+FFFD in its place, as for undecodable output."""
    sid = quick.open_session()
    r = quick.run_in_session(sid, "raise ValueError('bad \\ud800 text')")
    assert r.status == "error" and r.error[0]["ename"] == "ValueError", r
    assert r.error[0]["evalue"] == "bad \ufffd text", r.error
    r = quick.run_in_session(sid, "class R:\n    def __repr__(self): return '\\udcff'\nR()")
    assert r.display == [{"text/plain": "\ufffd"}], r
    assert quick.run_in_session(sid, "print('alive')").stdout == "alive\n"
    quick.close_session(sid)
