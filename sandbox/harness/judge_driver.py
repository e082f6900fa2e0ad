"""Judge mode's driver: the container's init (pid 1), trusted, runs the compiled program once per case.

Runs each case in a new session with its stdin from a memfd (no file the program could read), reads its
stdout/stderr under the case's output limit and wall-time limit, takes exit status and peak memory from wait4,
and checks the output with the requested checker (checkers.py, read before any case runs). The program cannot
reach this process: signals from inside the pid namespace to its init are ignored unless handled (SIGINT is set
to ignore), it is non-dumpable (no /proc/1/mem or /proc/1/fd), and every case's output arrives through pipes.
Verdicts are printed once, after every other process in the namespace is killed, on one line behind a nonce."""
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


def _run_case(cmd: list[str], stdin: str, timeout_s: float, output_bytes: int, memory_kb: int) -> dict:
    memfd = os.memfd_create("stdin")
    os.write(memfd, stdin.encode())
    os.lseek(memfd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            for src, dst in ((memfd, 0), (out_w, 1), (err_w, 2)):
                os.dup2(src, dst)
            os.closerange(3, 65536)
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


def main() -> None:
    init = _container_init()
    spec = init.take_secrets(".tide_judge.json", ".tide_judge.py")
    checkers: dict = {}
    exec(compile(spec["checkers_source"], "checkers.py", "exec"), checkers)
    checker = spec["checker"]
    results, passed = [], 0
    for case in spec["cases"]:
        r = _run_case(spec["cmd"], case["stdin"], spec["timeout_s"], spec["output_bytes"], spec["memory_kb"])
        if r["verdict"] is None:
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
