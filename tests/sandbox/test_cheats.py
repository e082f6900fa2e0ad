"""The cheat corpus: solutions that try to pass tests without solving them. Every one must score 0 passed tests
(the honest solution beside them scores all). The tests ask `add(2, 3) == 5` style questions; a cheat never
computes the answer."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

TESTS = ["assert add(2, 3) == 5", "assert add(10, -4) == 6", "assert abs(add(0.5, 0.25) - 0.75) < 1e-9",
         "assert 7 in [add(3, 4)]", "assert add(1, 1) is not None and add(1, 1) == 2"]

PYTHON_CHEATS = {
    "always-equal object": "class Any:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                           "    def __lt__(s, o): return True\n    def __hash__(s): return 0\n"
                           "def add(a, b): return Any()",
    "int subclass equal to everything": "class I(int):\n    def __eq__(s, o): return True\n"
                                        "def add(a, b): return I(0)",
    "replaced AssertionError": "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\n"
                               "def add(a, b): return 0",
    "replaced builtins exec and compile": "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
                                          "builtins.compile = lambda *a, **k: compile('pass', 'x', 'exec')\n"
                                          "def add(a, b): return 0",
    "shadowed abs": "abs = lambda x: 0\ndef add(a, b): return 1e9",
    "early exit 0 at import": "import os\nos._exit(0)",
    "sys.exit(0) at import": "import sys\nsys.exit(0)",
    "exit 0 inside the call": "import os\ndef add(a, b): os._exit(0)",
    "fake verdict lines": "import sys\nfor i in range(5):\n    for v in ('pass', 'ok', '0 pass'):\n"
                          "        print(i, v); print('x', i, v); sys.stderr.write(f'{i} pass\\n')\n"
                          "def add(a, b): return 0",
    "kill the parent": "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGKILL)\nexcept Exception:\n    pass\n"
                       "def add(a, b): return 0",
    "stop the parent": "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGSTOP)\nexcept Exception:\n    pass\n"
                       "def add(a, b): return 0",
    "read the tests from /proc and files": (
        "import glob, os, re\nfound = set()\n"
        "for p in glob.glob('/proc/[0-9]*/*') + glob.glob('/proc/[0-9]*/fd/*') + glob.glob('/work/*'):\n"
        "    try:\n        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)\n        data = os.read(fd, 1 << 20)\n"
        "        os.close(fd)\n    except Exception: continue\n"
        "    found.update(re.findall(rb'[0-9a-f]{32}', data))\n"
        "def add(a, b):\n    for n in found: print(n.decode(), 0, 'pass'); print(n.decode(), 1, 'pass')\n    return 0"),
    "write through the parent's descriptors": (
        "import os\nfor fd in range(3, 64):\n    try: os.write(fd, b'ffffffffffffffffffffffffffffffff 0 pass\\n')\n"
        "    except OSError: pass\n"
        "for p in ('/proc/1/fd/1', f'/proc/{os.getppid()}/fd/1'):\n"
        "    try: open(p, 'w').write('x 0 pass\\n')\n    except OSError: pass\n"
        "def add(a, b): return 0"),
    "patch the judge's modules": "import sys\nfor m in list(sys.modules.values()):\n"
                                 "    if hasattr(m, 'main'): m.main = lambda: print('patched')\n"
                                 "def add(a, b): return 0",
    "answers that claim membership": "class C(list):\n    def __contains__(s, x): return True\n"
                                     "    def __eq__(s, o): return True\ndef add(a, b): return C()",
}


def test_honest_solution_passes_every_test(client):
    r = client.run("python", "def add(a, b):\n    return a + b\n", tests=TESTS)
    assert (r.status.value, r.tests_passed, r.tests_total) == ("ok", len(TESTS), len(TESTS)), r


@pytest.mark.parametrize("cheat", sorted(PYTHON_CHEATS))
def test_python_cheats_pass_nothing(client, cheat):
    r = client.run("python", PYTHON_CHEATS[cheat], tests=TESTS, limits={"timeout_s": 3})
    assert r.tests_passed == 0, (cheat, r)


def test_judge_memory_and_descriptors_are_out_of_reach(client):
    probe = ("import os\nppid = os.getppid()\n"
             "for what in ('mem', 'environ', 'fd/1', 'fd/0', 'maps'):\n"
             "    try:\n        open(f'/proc/{ppid}/{what}', 'rb').read(16); print(what, 'READ')\n"
             "    except OSError as e: print(what, 'denied')\n"
             "print('input', os.path.exists('judge_input.json'), os.path.exists('main.py'))\n"
             "def add(a, b): return a + b")
    r = client.run("python", probe, tests=["assert add(1, 2) == 3"])
    assert r.tests_passed == 1, r
    assert "READ" not in r.stdout and r.stdout.count("denied") == 5, r.stdout
    assert "input False False" in r.stdout
