"""Judge mode's driver: the container's init (pid 1), trusted, runs the compiled program once per case.

Runs each case in a new session with its stdin from a memfd (no file the program could read), reads its
stdout/stderr under the case's output limit and time limit (CPU time, with a wall-time cap: CaseClock), takes
exit status and peak memory from wait4,
and checks the output with the requested checker (checkers.py, read before any case runs, or a checker program
held in a memfd and run after the case, with every process the case left killed first). The program cannot
reach this process: signals from inside the pid namespace to its init are ignored unless handled (SIGINT is set
to ignore), it is non-dumpable (no /proc/1/mem or /proc/1/fd), and every case's output arrives through pipes.
Verdicts are printed once, after every other process in the namespace is killed, on one line behind a nonce."""
import array
import fcntl
import json
import os
import select
import selectors
import signal
import socket
import struct
import sys
import time


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _move_fds(moves: list[tuple[int, int]]) -> None:
    """In a child: (source, target) descriptors into place, every other one closed."""
    # copies far above every target first, so no dup2 overwrites a source still to be moved
    staged = [(fcntl.fcntl(src, fcntl.F_DUPFD, 1000), dst) for src, dst in moves]
    for src, dst in staged:
        os.dup2(src, dst)
    os.closerange(max(dst for _, dst in staged) + 1, 65536)


class Exec:
    """Each case a fresh fork and exec of the program."""

    def __init__(self, cmd: list[str]):
        self.cmd = cmd

    def start(self, moves: list[tuple[int, int]]) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                _move_fds(moves)
                os.execvp(self.cmd[0], self.cmd)
            finally:
                os._exit(127)
        return pid

    def reap(self, pid: int, clock: "CaseClock") -> tuple[int, int, float, bool]:
        """(wait status, peak RSS KiB, CPU s, timed out): killed when its time is up if still running."""
        pidfd = os.pidfd_open(pid)
        try:
            while True:
                ready = select.select([pidfd], [], [], max(0.0, clock.deadline - time.monotonic()))[0]
                if ready or clock.expired():
                    break
        finally:
            os.close(pidfd)
        if not ready:
            _kill_group(pid)
        _, status, usage = os.wait4(pid, 0)
        return status, usage.ru_maxrss, usage.ru_utime + usage.ru_stime, not ready


class Zygote:
    """Python's fork server (python_zygote.py): one interpreter start for all cases. Anything it fails to
    answer makes the driver take the case over and go back to Exec for the rest."""

    def __init__(self, source: str):
        self.sock, theirs = socket.socketpair()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                _move_fds([(os.open("/dev/null", os.O_RDONLY), 0), (1, 1), (2, 2), (theirs.fileno(), 3)])
                os.execvp("python3", ["python3", "-I", "-c", source])
            finally:
                os._exit(127)
        theirs.close()

    def _read(self, n: int, deadline: float) -> bytes | None:
        data = b""
        while len(data) < n:
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def start(self, moves: list[tuple[int, int]]) -> int | None:
        fds = [src for src, _ in sorted(moves, key=lambda m: m[1])]
        try:
            self.sock.sendmsg([b"R"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except OSError:
            return None
        frame = self._read(8, time.monotonic() + 5)
        return struct.unpack("!q", frame)[0] if frame else None

    def reap(self, pid: int, clock: "CaseClock") -> tuple[int | None, int, float, bool]:
        """As Exec.reap; the wait status None where the case's end is not known."""
        while True:
            frame = self._read(32, clock.deadline)
            # a frame; or none before the deadline: the fork server is gone
            if frame is not None or time.monotonic() < clock.deadline or clock.expired():
                break
        timed_out = frame is None and time.monotonic() >= clock.deadline
        if frame is None:
            _kill_group(pid)
            frame = self._read(32, time.monotonic() + 1)
        if frame is not None and struct.unpack("!q", frame[:8])[0] == pid:
            _, status, peak_kb, cpu_s = struct.unpack("!qqqd", frame)
            return status, peak_kb, cpu_s, timed_out
        self.close()  # stopped or dead: the case is init's child now, and no later case uses it
        try:
            _, status, usage = os.wait4(pid, 0)
        except ChildProcessError:  # reaped by the fork server, killed (by the case's kin) before it reported
            return None, 0, 0.0, timed_out
        return status, usage.ru_maxrss, usage.ru_utime + usage.ru_stime, timed_out

    def close(self) -> None:
        """Kill and reap it: once reaped, its children (a case it never reported) are init's to wait for."""
        self.sock.close()
        if self.pid > 0:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):  # already reaped by a sweep of kill_all_except
                pass
        self.pid = -1


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _group_cpu_s(pgid: int) -> float | None:
    """CPU seconds of process group `pgid` so far (its members' own, and of the children they reaped); None
    when no process of the group is left."""
    ticks, found = 0, False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2:].split()  # state ppid pgrp session ... utime stime cutime cstime
        if int(fields[2]) == pgid:
            found = True
            ticks += sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


class CaseClock:
    """A case's time limit is CPU time, as judges count it: a program that waits for a core on a busy machine is not
    out of time. At each deadline a case that has spent less CPU than its limit gets the rest (at least 10 ms
    more), up to a wall-time cap of `wall_factor` x the limit, which stops a program that sleeps or blocks.
    What a case spends is its process group's (the group the launcher made it lead); a process that leaves the
    group goes uncounted, and the cap still ends the case."""

    def __init__(self, pgid: int, start: float, cpu_limit_s: float, wall_factor: float):
        self.pgid, self.cpu_limit_s = pgid, cpu_limit_s
        self.deadline = start + cpu_limit_s
        self.cap = start + cpu_limit_s * max(1.0, wall_factor)

    def expired(self) -> bool:
        """Called at or after the deadline: True when the case's time is up, else the deadline moves on."""
        now = time.monotonic()
        if now < self.deadline:
            return False
        if now >= self.cap:
            return True
        spent = _group_cpu_s(self.pgid)
        if spent is None or spent >= self.cpu_limit_s:
            return True
        self.deadline = min(self.cap, now + max(self.cpu_limit_s - spent, 0.01))
        return False


def _run_case(launcher, stdin: str, timeout_s: float, output_bytes: int, memory_kb: int,
              extra_fds: dict[int, int] | None = None, wall_factor: float = 1.0) -> dict:
    """One program to its end: stdin from a memfd, stdout/stderr through pipes, `extra_fds` (target -> source)
    passed on; every other descriptor closed; `timeout_s` of CPU time within `wall_factor` x as much wall time
    (CaseClock). None when the launcher could not start it."""
    memfd = _memfd("stdin", stdin.encode())
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = launcher.start([(memfd, 0), (out_w, 1), (err_w, 2), *((src, dst) for dst, src in (extra_fds or {}).items())])
    for fd in (memfd, out_w, err_w):
        os.close(fd)
    if pid is None:
        os.close(out_r)
        os.close(err_r)
        return None
    sel = selectors.DefaultSelector()
    buffers = {out_r: bytearray(), err_r: bytearray()}
    for fd in buffers:
        sel.register(fd, selectors.EVENT_READ)
    timed_out = over = False
    clock = CaseClock(pid, start, timeout_s, wall_factor)
    while sel.get_map():
        left = clock.deadline - time.monotonic()
        if left <= 0:
            if not clock.expired():
                continue
            timed_out = True
            break
        for key, _ in sel.select(left):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            buffers[key.fd] += chunk
            if len(buffers[out_r]) + len(buffers[err_r]) > output_bytes:
                over = True
        if over:
            break
    if timed_out or over:
        _kill_group(pid)
    status, peak_kb, cpu_s, late = launcher.reap(pid, clock)
    timed_out = timed_out or late  # output closed, but still running when its time was up
    wall = time.monotonic() - start
    _kill_group(pid)  # stragglers the case left in its session
    for fd in buffers:
        os.close(fd)
    sel.close()
    lost = status is None
    status = 0 if lost else status
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if timed_out:
        verdict = "TLE"
    elif over:
        verdict = "OLE"
    elif lost:
        verdict = "RE"  # how it ended is unknown: never a pass
    elif peak_kb > memory_kb or (killed and not timed_out):
        verdict = "MLE"  # the cgroup's OOM killer is what SIGKILLs a case the driver did not kill
    elif not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        verdict = "RE"
    else:
        verdict = None  # ran: the checker decides
    code = None if lost else os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    stderr = bytes(buffers[err_r][:4096]).decode("utf-8", "replace")
    if lost:
        stderr += "\n[judge] the case's exit status was lost: its fork server was killed before reporting it"
    return {"verdict": verdict, "exit_code": code, "wall_ms": round(wall * 1000, 3),
            "cpu_ms": round(cpu_s * 1000, 3), "peak_memory_kb": peak_kb,
            "stdout": bytes(buffers[out_r][:output_bytes]).decode("utf-8", "replace"),
            "stderr": stderr}


def _check_with_program(spec: dict, checker_fd: int, case: dict, output: str) -> tuple[bool, str]:
    """testlib's convention: `checker <input> <output> <answer>`, exit status 0 accepts (1 and 2, wrong answer
    and presentation error, are a wrong answer; anything else a failed checker, never an accept). The three
    files are memfds, the checker itself another (read into memory before any program ran, and deleted)."""
    fds = {3: _memfd("input", case["stdin"].encode()), 4: _memfd("output", output.encode()),
           5: _memfd("answer", case["expected_stdout"].encode())}
    cmd = [a.replace("{checker}", "/proc/self/fd/6") for a in spec["checker_cmd"]]
    cmd += ["/proc/self/fd/3", "/proc/self/fd/4", "/proc/self/fd/5"]
    try:
        r = _run_case(Exec(cmd), "", spec["timeout_s"], 65536, spec["memory_kb"], {**fds, 6: checker_fd},
                      spec["wall_factor"])
    finally:
        for fd in fds.values():
            os.close(fd)
    message = (r["stderr"] or r["stdout"])[:1024]
    if r["verdict"] is None:
        return True, message
    if r["verdict"] == "RE" and r["exit_code"] in (1, 2):  # testlib's wrong answer and presentation error
        return False, message
    return False, f"the checker failed ({r['verdict']}, exit {r['exit_code']}): {message}"


def main() -> None:
    init: dict = {}  # container_init.py, run from its file (never imported: the code under judgement can write /work)
    with open(".tide_init.py") as f:
        exec(compile(f.read(), ".tide_init.py", "exec"), init)
    spec = init["take_secrets"](".tide_judge.json", ".tide_judge.py", ".tide_init.py")
    checker_fd = None
    if spec.get("checker_cmd"):  # into memory and off the disk before the program under judgement runs
        with open(".tide_checker", "rb") as f:
            checker_fd = _memfd("checker", f.read())
        os.unlink(".tide_checker")
    checkers: dict = {}
    exec(compile(spec["checkers_source"], "checkers.py", "exec"), checkers)
    checker = spec["checker"]
    exec_each = Exec(spec["cmd"])
    zygote = Zygote(spec["zygote_source"]) if spec.get("zygote_source") and len(spec["cases"]) > 1 else None
    results, passed = [], 0
    for case in spec["cases"]:
        args = (case["stdin"], spec["timeout_s"], spec["output_bytes"], spec["memory_kb"], None, spec["wall_factor"])
        r = _run_case(zygote, *args) if zygote else None
        if r is None:
            if zygote:
                zygote.close()
                zygote = None
            r = _run_case(exec_each, *args)
        # nothing a case started survives into the checker or the next case
        if zygote is not None and (zygote.pid < 0 or not init["kill_all_except"]({zygote.pid})):
            zygote.close()
            zygote = None
        if zygote is None:
            init["kill_everyone_else"]()
        if r["verdict"] is None and checker_fd is not None:
            ok, r["checker_message"] = _check_with_program(spec, checker_fd, case, r["stdout"])
            r["verdict"] = "AC" if ok else "WA"
        elif r["verdict"] is None:
            ok = checkers["check"](checker["kind"], r["stdout"], case["expected_stdout"], checker["abs_tol"],
                                   checker["rel_tol"], checker.get("exact_integers", True))
            r["verdict"] = "AC" if ok else "WA"
        passed += r["verdict"] == "AC"
        r["stdout"] = r["stdout"][:spec["echo_bytes"]]
        results.append(r)
        if spec["stop_on_first_failure"] and r["verdict"] != "AC":
            break
    init["kill_everyone_else"]()
    sys.stdout.write("\n" + spec["nonce"] + " " + json.dumps({"cases": results}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
