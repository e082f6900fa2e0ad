"""Hostile programs: each gets the right status, the service stays healthy, and nothing of the run remains."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from sandbox.models import RunResult

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

TIGHT = {"timeout_s": 2, "memory_mb": 128, "output_kb": 64, "pids": 32, "disk_mb": 16}
# A memory hog must meet the memory limit before the clock: on a machine the suite oversubscribes, lua's
# string.rep loop got 0.3 s of CPU in its 2 s and timed out below 128 MB (CI). Time is not what these cases test.
HOG = {**TIGHT, "timeout_s": 10}
# R's interpreter alone takes about a second to start; under the suite's load its network case ran out of its 2 s
# (CI: exit 137, 139 ms of CPU) before it tried the connection. The case tests the wall, not R's start-up: a
# connection that got through still prints LEAKED, one left hanging still times out.
SLOW_START = {**TIGHT, "timeout_s": 10}


@dataclass
class Case:
    id: str
    language: str
    code: str
    status: set[str]
    check: Callable[[RunResult], bool] = lambda r: True
    limits: dict = field(default_factory=lambda: dict(TIGHT))
    jupyter: bool = False  # the code is one cell of a Jupyter-mode request (language python)


def _all_blocked(r: RunResult) -> bool:
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    return bool(lines) and all(ln.startswith("blocked") for ln in lines)


CASES = [
    # A fork bomb is stopped by whichever limit it meets first: 32 processes (pids), or 128 MB of memory in the
    # copies and their forks in progress (a C bomb was OOM-killed at 2.1 s in a clean-clone run under load)
    Case("py-fork-bomb", "python", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
         {"timeout", "memory_limit"}),
    Case("c-fork-bomb", "c", "#include <unistd.h>\nint main(){for(;;) fork();}", {"timeout", "memory_limit"}),
    Case("bash-fork-bomb", "bash", ":(){ :|:& };:\nwait", {"timeout", "runtime_error", "ok", "memory_limit"}),
    Case("py-thread-bomb", "python",
         "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n",
         {"runtime_error"}, lambda r: "thread" in r.stderr),
    Case("py-memory-hog", "python", "x = []\nwhile True:\n    x.append(b'x' * (16 << 20))\n", {"memory_limit"},
         limits=HOG),
    Case("c-memory-hog", "c", "#include <stdlib.h>\n#include <string.h>\n"
         "int main(){for(;;){char*p=malloc(1<<24); if(p) memset(p,1,1<<24);}}", {"memory_limit"}, limits=HOG),
    Case("cpp-memory-hog", "cpp", "#include <vector>\nint main(){std::vector<long> v; for(;;) v.push_back(1);}",
         {"memory_limit", "runtime_error"}, limits=HOG),
    Case("py-disk-fill", "python", "print('before', flush=True)\nwith open('/tmp/big', 'wb') as f:\n"
         "    while True:\n        f.write(b'x' * (1 << 20))\n", {"runtime_error"},
         lambda r: "before" in r.stdout and "No space left" in r.stderr),
    Case("bash-disk-fill", "bash", "dd if=/dev/zero of=/work/fill bs=1M count=200 2>/dev/null; echo still-talking",
         {"ok"}, lambda r: "still-talking" in r.stdout),
    Case("py-shm-fill", "python", "f = open('/dev/shm/x', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))\n",
         {"runtime_error", "memory_limit"}),
    Case("py-output-flood", "python", "while True:\n    print('x' * 1000)\n", {"output_limit"},
         lambda r: len(r.stdout) <= 64 * 1024),
    Case("c-output-flood", "c", "#include <stdio.h>\nint main(){for(;;) fputs(\"yyyyyyyyyyyyyyyy\\n\", stdout);}",
         {"output_limit"}),
    Case("bash-stderr-flood", "bash", "yes err >&2", {"output_limit"}),
    # the limit is CPU time within 3x of it in wall time: stopped once it has spent its 2 s, or at the 6 s cap where
    # the node is too busy to give it that (a full suite run: 1.15 s of CPU in 6 s)
    Case("py-infinite-loop", "python", "while True:\n    pass\n", {"timeout"},
         lambda r: (r.cpu_ms >= 1800 or r.wall_ms >= 3 * 2000) and r.wall_ms < 3 * 2000 + 1000),
    Case("js-infinite-loop", "javascript", "while (true) {}", {"timeout"}),
    Case("java-infinite-loop", "java", "public class Main { public static void main(String[] a) { while (true) {} } }",
         {"timeout"}, limits={**TIGHT, "memory_mb": 256}),
    Case("py-sleeping-daemon", "python",
         "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n"
         "    os._exit(0)\nprint('parent done')\n", {"ok"}, lambda r: r.wall_ms < 1500),
    Case("bash-nohup-daemon", "bash", "(nohup sleep 1000 >/dev/null 2>&1 &)\necho started", {"ok"},
         lambda r: "started" in r.stdout and r.wall_ms < 1500),
    Case("py-network", "python", """import socket
for host, port in [("127.0.0.1", {port}), ("127.0.0.1", 22), ("{host_ip}", {port}), ("1.1.1.1", 53), ("::1", {port})]:
    try:
        socket.create_connection((host, port), timeout=1).close()
        print("CONNECTED", host, port)
    except OSError as e:
        print("blocked", host, port, e.errno)
try:
    socket.getaddrinfo("example.com", 80)
    print("CONNECTED dns")
except OSError:
    print("blocked dns")
""", {"ok"}, _all_blocked),
    Case("js-network", "javascript", """const net = require('net');
const s = net.connect({port: {port}, host: '127.0.0.1'});
s.on('connect', () => { console.log('CONNECTED'); process.exit(0); });
s.on('error', (e) => { console.log('blocked ' + e.code); process.exit(0); });
""", {"ok"}, _all_blocked),
    Case("py-write-outside", "python", """import os
for path in ["/usr/bin/tide-evil", "/etc/passwd", "/proc/sys/kernel/hostname", "/proc/sysrq-trigger",
             "/usr/lib/tide-evil", "/etc/alternatives/tide-evil"]:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as e:
        print("blocked", path, e.errno)
""", {"ok"}, _all_blocked),
    Case("py-escape-syscalls", "python", """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET = 0x10000000, 0x20000, 0x40000000
checks = {
    "unshare-user": lambda: libc.unshare(CLONE_NEWUSER),
    "unshare-ns": lambda: libc.unshare(CLONE_NEWNS),
    "unshare-net": lambda: libc.unshare(CLONE_NEWNET),
    "mount": lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None),
    "ptrace": lambda: libc.ptrace(16, 1, 0, 0),
    "keyctl": lambda: libc.syscall(250, 0, 0, 0, 0),
    "bpf": lambda: libc.syscall(321, 0, 0, 0),
    "setuid0": lambda: libc.setuid(0),
    "chroot": lambda: libc.chroot(b"/tmp"),
}
for name, f in checks.items():
    rc = f()
    print(("blocked " if rc == -1 else "ALLOWED ") + name, ctypes.get_errno())
st = open("/proc/self/status").read()
caps = [l for l in st.splitlines() if l.startswith(("CapEff", "CapPrm", "CapBnd"))]
print("blocked caps" if all(l.split()[1] == "0000000000000000" for l in caps) else "ALLOWED caps " + str(caps))
print("blocked nnp" if "NoNewPrivs:\\t1" in st else "ALLOWED nnp")
print("blocked root" if os.getuid() == 65534 else "ALLOWED uid %d" % os.getuid())
""", {"ok"}, _all_blocked),
    Case("py-outside-the-allow-list", "python", """import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
checks = {  # name: (call, the errno the allow list answers with)
    "io_uring_setup": (lambda: libc.syscall(425, 1, 0), errno.EPERM),
    "kcmp": (lambda: libc.syscall(312, 1, 1, 0, 0, 0), errno.EPERM),
    "pidfd_getfd": (lambda: libc.syscall(438, 0, 0, 0), errno.EPERM),
    "personality-no-aslr": (lambda: libc.syscall(135, ctypes.c_ulong(0x0040000)), errno.ENOSYS),
    "unknown-syscall-1000": (lambda: libc.syscall(1000, 0, 0), errno.ENOSYS),
    "name_to_handle_at": (lambda: libc.syscall(303, -100, b"/", 0, 0, 0), errno.EPERM),
}
for name, (call, want) in checks.items():
    rc = call()
    got = ctypes.get_errno()
    print(("blocked " if rc == -1 and got == want else "ALLOWED ") + name, rc, got)
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
    print("ALLOWED vsock")
except OSError as e:
    print("blocked vsock", e.errno)
libc.personality.argtypes = [ctypes.c_ulong]  # c_int would leave the register's upper half to chance
persona = libc.personality(0xFFFFFFFF)  # querying stays allowed, and nothing above changed the persona
print(("blocked" if persona == 0 else "ALLOWED") + " personality change, query " + hex(persona))
""", {"ok"}, _all_blocked),
    Case("c-clone-newuser", "c", """#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
static char stack[65536];
static int child(void *a) { return 0; }
int main() {
  int r = clone(child, stack + sizeof stack, CLONE_NEWUSER | SIGCHLD, 0);
  printf(r == -1 ? "blocked clone\\n" : "ALLOWED clone\\n");
  long r3 = syscall(435, 0, 0);  /* clone3 */
  printf(r3 == -1 ? "blocked clone3\\n" : "ALLOWED clone3\\n");
  return 0;
}""", {"ok"}, _all_blocked),
    Case("py-read-host", "python", """import os
for path in ["/etc/shadow", "/root", "{repo}/pyproject.toml", "/work/main", "/run/tide-sandbox-tests",
             "/sys/fs/cgroup", "/proc/kcore", "/home"]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        print("READ", path)
    except OSError as e:
        print("blocked", path, e.errno)
pids = [p for p in os.listdir("/proc") if p.isdigit()]
print("blocked pids" if pids == ["1"] else "ALLOWED pids %s" % pids[:5])
""", {"ok"}, _all_blocked),
    Case("py-root-escape", "python", """import os
root = sorted(os.listdir("/"))
os.chdir("/")
for _ in range(20):
    os.chdir("..")
print("blocked dotdot" if sorted(os.listdir(".")) == root else "ESCAPED dotdot")
print("blocked proc-root" if sorted(os.listdir("/proc/1/root")) == root else "ESCAPED proc-root")
points = [line.split()[4] for line in open("/proc/self/mountinfo")]
host = [p for p in points if p.startswith(("/sys", "/run", "/work", "/mnt", "/old_root"))]
print("blocked mountinfo" if not host else "LEAKED mountinfo %s" % host)
""", {"ok"}, _all_blocked),
    Case("py-signal-host", "python", """import os
try:
    os.kill({host_pid}, 9)
    print("KILLED {host_pid}")
except OSError as e:
    print("blocked", e.errno)
""", {"ok"}, _all_blocked),
    Case("bash-kill-all", "bash", "kill -9 -1; echo survived", {"runtime_error", "ok"}),
    # The MultiPL-E languages: runaway loops, memory and processes are contained the same way.
    Case("go-memory-hog", "go", "package main\nfunc main() { var s [][]byte; for { s = append(s, make([]byte, 1<<24)); "
         "for i := range s[len(s)-1] { s[len(s)-1][i] = 1 } } }", {"memory_limit", "runtime_error"}, limits=HOG),
    Case("go-infinite-loop", "go", "package main\nfunc main() { for {} }", {"timeout"}),
    Case("rust-memory-hog", "rust", "fn main() { let mut v: Vec<Vec<u8>> = Vec::new(); loop { v.push(vec![1u8; 1 << 24]); } }",
         {"memory_limit", "runtime_error"}, limits=HOG),
    Case("rust-fork-bomb", "rust", "fn main() { loop { let _ = std::process::Command::new(\"/proc/self/exe\").spawn(); } }",
         {"timeout", "runtime_error", "memory_limit"}),
    Case("ruby-memory-hog", "ruby", "a = []\nloop { a << ('x' * (1 << 24)) }", {"memory_limit", "runtime_error"},
         limits=HOG),
    # An interpreter's fork bomb is stopped by whichever limit its copies meet first: 32 processes (pids) or, as
    # their copy-on-write pages get dirty, 128 MB between them (a perl bomb was OOM-killed at 392 ms in CI)
    Case("ruby-fork-bomb", "ruby", "loop { begin; fork { sleep 100 }; rescue; end }",
         {"timeout", "runtime_error", "memory_limit"}),
    Case("php-infinite-loop", "php", "<?php while (true) {}", {"timeout"}),
    Case("php-memory-hog", "php", "<?php ini_set('memory_limit', '-1'); $a = []; while (true) { $a[] = str_repeat('x', 1 << 24); }",
         {"memory_limit", "runtime_error"}, limits=HOG),
    Case("perl-fork-bomb", "perl", "while (1) { fork(); }", {"timeout", "runtime_error", "memory_limit"}),
    Case("perl-output-flood", "perl", "while (1) { print 'y' x 1000, \"\\n\"; }", {"output_limit"}),
    Case("lua-memory-hog", "lua", "local t = {}\nwhile true do t[#t + 1] = string.rep('x', 1 << 24) end",
         {"memory_limit", "runtime_error"}, limits=HOG),
    Case("lua-read-host", "lua", "local f = io.open('/etc/shadow')\nprint(f and 'LEAKED shadow' or 'blocked shadow')",
         {"ok"}, _all_blocked),
    Case("r-infinite-loop", "r", "while (TRUE) {}", {"timeout"}),
    Case("r-network", "r", "r <- tryCatch({ url('http://{host_ip}:{port}/health', open = 'r'); 'LEAKED network' },\n"
         "  error = function(e) 'blocked network', warning = function(w) 'blocked network')\ncat(r, '\\n')",
         {"ok"}, _all_blocked, limits=SLOW_START),
    Case("ts-infinite-loop", "typescript", "while (true) {}", {"timeout"}),
    # The service runs with NOTIFY_SOCKET, LISTEN_FDS and its token in its environment (conftest.py).
    # The Jupyter kernel (one cell of a Jupyter-mode request): the same walls around an ipykernel
    Case("jupyter-fork-bomb", "python", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
         "        pass", {"ok", "timeout", "memory_limit", "runtime_error"}, jupyter=True),
    Case("jupyter-memory-hog", "python", "x = []\nwhile True:\n    x.append(bytearray(50 << 20))",
         {"ok", "memory_limit", "runtime_error"}, jupyter=True),
    Case("jupyter-kill-all", "python", "import os\nos.system('kill -9 -1; kill -9 1')\nprint('blocked kill')",
         {"ok", "runtime_error"}, jupyter=True),
    Case("jupyter-network-and-host", "python", """import socket
for target in [("{host_ip}", {port}), ("127.0.0.1", {port}), ("8.8.8.8", 53)]:
    try:
        socket.create_connection(target, timeout=1); print("ALLOWED", target)
    except OSError as e:
        print("blocked", target)
for path in ["/etc/shadow", "{repo}/pyproject.toml", "/proc/{host_pid}/environ"]:
    try:
        open(path).read(); print("ALLOWED", path)
    except OSError:
        print("blocked", path)
""", {"ok"}, _all_blocked, jupyter=True),
    Case("py-host-env", "python", """import os
env = [k for k in os.environ if k.startswith(("NOTIFY", "LISTEN", "TIDE"))]
print("blocked env" if not env else "LEAKED env %s" % env)
fds = sorted(os.listdir("/proc/self/fd"), key=int)
print("blocked fds" if fds == ["0", "1", "2", "3"] else "LEAKED fds %s" % fds)  # 3: the listing itself
mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
print("blocked notify" if not any("notify" in m for m in mounts) else "LEAKED notify mount")
""", {"ok"}, _all_blocked),
]


@pytest.fixture(scope="module")
def host_victim():
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture(scope="module")
def host_ip() -> str:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    return out.split()[3].split("/")[0] if out.split() else "10.0.0.1"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile(case: Case, client, service, host_victim, host_ip):
    if case.language not in client.health().languages:  # also opens the keep-alive connection (one fd)
        pytest.skip(f"{case.language} is not installed on this host (scripts/setup.sh installs it)")
    before = service.snapshot()
    port = service.url.rsplit(":", 1)[1]
    code = (case.code.replace("{port}", port).replace("{host_ip}", host_ip)
            .replace("{host_pid}", str(host_victim.pid)).replace("{repo}", str(REPO)))
    if case.jupyter:
        r = client.run("python", "", cells=[code], limits=case.limits, cell_timeout_s=case.limits["timeout_s"])
        r = r.model_copy(update={"stdout": "".join(c.stdout for c in r.cells or [])})
    else:
        r = client.run(case.language, code, limits=case.limits)
    assert r.status.value in case.status, r
    assert case.check(r), r
    assert host_victim.poll() is None, "a host process was killed"
    assert not Path("/usr/bin/tide-evil").exists() and not Path("/work/fill").exists()
    assert client.health().status == "ok"
    service.assert_unchanged(before)


def test_suite_size() -> None:
    assert len(CASES) >= 20 and len({c.language for c in CASES}) >= 5
