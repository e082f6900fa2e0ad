"""Judge mode's driver: the container's init (pid 1), trusted, runs the compiled program once per case.

Runs each case in a new session with its stdin from a memfd (no file the program could read), reads its
stdout/stderr under the case's output limit and wall-time limit, takes exit status and peak memory from wait4,
and checks the output with the requested checker (checkers.py, read before any case runs, or a checker program
held in a memfd and run after the case, with every process the case left killed first). The program cannot
reach this process: signals from inside the pid namespace to its init are ignored unless handled (SIGINT is set
to ignore), it is non-dumpable (no /proc/1/mem or /proc/1/fd), and every case's output arrives through pipes.
Verdicts are printed once, after every other process in the namespace is killed, on one line behind a nonce."""
import fcntl
import importlib.util
import json
import os
import selectors
import signal
import sys
import time


def _container_init():
    """container_init.py, loaded by path before the code under judgement runs."""
    spec = importlib.util.spec_from_file_location("tide_container_init", ".tide_init.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.unlink(".tide_init.py")
    return module


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run_case(cmd: list[str], stdin: str, timeout_s: float, output_bytes: int, memory_kb: int,
              extra_fds: dict[int, int] | None = None) -> dict:
    """One program to its end: stdin from a memfd, stdout/stderr through pipes, `extra_fds` (target -> source)
    passed on; every other descriptor closed."""
    memfd = _memfd("stdin", stdin.encode())
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            moves = [(memfd, 0), (out_w, 1), (err_w, 2), *((src, dst) for dst, src in (extra_fds or {}).items())]
            # copies far above every target first, so no dup2 overwrites a source still to be moved
            staged = [(fcntl.fcntl(src, fcntl.F_DUPFD, 1000), dst) for src, dst in moves]
            for src, dst in staged:
                os.dup2(src, dst)
            os.closerange(max(dst for _, dst in staged) + 1, 65536)
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    for fd in (memfd, out_w, err_w):
        os.close(fd)
    sel = selectors.DefaultSelector()
    buffers = {out_r: bytearray(), err_r: bytearray()}
    for fd in buffers:
        sel.register(fd, selectors.EVENT_READ)
    timed_out = over = False
    deadline = start + timeout_s
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
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
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    try:  # stragglers the case left in its session
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for fd in buffers:
        os.close(fd)
    sel.close()
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    if timed_out:
        verdict = "TLE"
    elif over:
        verdict = "OLE"
    elif usage.ru_maxrss > memory_kb or (killed and not timed_out):
        verdict = "MLE"  # the cgroup's OOM killer is what SIGKILLs a case the driver did not kill
    elif not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        verdict = "RE"
    else:
        verdict = None  # ran: the checker decides
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    return {"verdict": verdict, "exit_code": code, "wall_ms": round(wall * 1000, 3),
            "cpu_ms": round((usage.ru_utime + usage.ru_stime) * 1000, 3), "peak_memory_kb": usage.ru_maxrss,
            "stdout": bytes(buffers[out_r][:output_bytes]).decode("utf-8", "replace"),
            "stderr": bytes(buffers[err_r][:4096]).decode("utf-8", "replace")}


def _check_with_program(spec: dict, checker_fd: int, case: dict, output: str) -> tuple[bool, str]:
    """testlib's convention: `checker <input> <output> <answer>`, exit status 0 accepts (1 and 2, wrong answer
    and presentation error, are a wrong answer; anything else a failed checker, never an accept). The three
    files are memfds, the checker itself another (read into memory before any program ran, and deleted)."""
    fds = {3: _memfd("input", case["stdin"].encode()), 4: _memfd("output", output.encode()),
           5: _memfd("answer", case["expected_stdout"].encode())}
    cmd = [a.replace("{checker}", "/proc/self/fd/6") for a in spec["checker_cmd"]]
    cmd += ["/proc/self/fd/3", "/proc/self/fd/4", "/proc/self/fd/5"]
    try:
        r = _run_case(cmd, "", spec["timeout_s"], 65536, spec["memory_kb"], {**fds, 6: checker_fd})
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
    init = _container_init()
    spec = init.take_secrets(".tide_judge.json", ".tide_judge.py")
    checker_fd = None
    if spec.get("checker_cmd"):  # into memory and off the disk before the program under judgement runs
        with open(".tide_checker", "rb") as f:
            checker_fd = _memfd("checker", f.read())
        os.unlink(".tide_checker")
    checkers: dict = {}
    exec(compile(spec["checkers_source"], "checkers.py", "exec"), checkers)
    checker = spec["checker"]
    results, passed = [], 0
    for case in spec["cases"]:
        r = _run_case(spec["cmd"], case["stdin"], spec["timeout_s"], spec["output_bytes"], spec["memory_kb"])
        init.kill_everyone_else()  # nothing a case started survives into the checker or the next case
        if r["verdict"] is None and checker_fd is not None:
            ok, r["checker_message"] = _check_with_program(spec, checker_fd, case, r["stdout"])
            r["verdict"] = "AC" if ok else "WA"
        elif r["verdict"] is None:
            ok = checkers["check"](checker["kind"], r["stdout"], case["expected_stdout"], checker["abs_tol"],
                                   checker["rel_tol"])
            r["verdict"] = "AC" if ok else "WA"
        passed += r["verdict"] == "AC"
        r["stdout"] = r["stdout"][:spec["echo_bytes"]]
        results.append(r)
        if spec["stop_on_first_failure"] and r["verdict"] != "AC":
            break
    init.kill_everyone_else()
    sys.stdout.write("\n" + spec["nonce"] + " " + json.dumps({"cases": results}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
