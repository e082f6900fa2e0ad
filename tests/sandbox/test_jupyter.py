"""Jupyter mode: cells in one fresh IPython kernel per request (state across cells, streams, display data with
image/png, errors, a cell timeout), and nothing of the kernel left afterwards."""
from __future__ import annotations

import base64

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def kernel(client):
    r = client.run("python", "", cells=["import ipykernel"])
    if r.status.value != "ok" or (r.cells and r.cells[0].error):
        pytest.skip(f"no ipykernel for the host image's python3 (scripts/setup.sh installs it): {r.stderr[-300:]}")
    return client


def test_cells_share_one_kernel_and_report_each_output(kernel, service):
    before = service.snapshot()
    r = kernel.run("python", "", cells=[
        "x = 41", "print(x + 1)", "import sys; print('warn', file=sys.stderr); x * 2", "1 / 0",
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3]);"])
    assert r.status.value == "ok", r
    out = r.cells
    assert len(out) == 5 and out[0].stdout == "" and not out[0].error
    assert out[1].stdout == "42\n"
    assert out[2].stderr == "warn\n" and out[2].display == [{"text/plain": "82"}]
    assert out[3].error[0]["ename"] == "ZeroDivisionError" and out[3].error[0]["traceback"]
    png = base64.b64decode(out[4].display[0]["image/png"])
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    service.assert_unchanged(before)  # no kernel, cgroup, mount or state entry left


def test_a_cell_over_its_timeout_stops_the_rest(kernel):
    r = kernel.run("python", "", cells=["import time; time.sleep(30)", "print('never')"], cell_timeout_s=1)
    assert r.status.value == "ok" and len(r.cells) == 1, r
    assert r.cells[0].error[0]["ename"] == "TimeoutError"


def test_cells_cannot_reach_the_driver(kernel):
    probe = ("import os, signal\n"
             "for what in ('mem', 'environ', 'fd/1'):\n"
             "    try:\n        open(f'/proc/1/{what}', 'rb').read(16); print(what, 'READ')\n"
             "    except OSError: print(what, 'denied')\n"
             "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):\n"
             "    os.kill(1, s)\n"
             "os.system('sleep 300 &')\nprint('alive')")
    r = kernel.run("python", "", cells=[probe, "print('still here')"])
    assert r.status.value == "ok", r
    assert r.cells[0].stdout.split() == ["mem", "denied", "environ", "denied", "fd/1", "denied", "alive"]
    assert r.cells[1].stdout == "still here\n"
