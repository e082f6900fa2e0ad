"""What each trusted driver of a container (python_judge.py, judge_driver.py, jupyter_driver.py) does first and
last. The runtime writes this file as .tide_init.py beside the driver, which runs it from that file into a namespace
of its own (never imported through sys.path: /work is writable by the code under judgement) before any of that code
runs, and deletes it with its spec (take_secrets)."""
import ctypes
import json
import os
import signal
import time


def take_secrets(spec_file: str, *also_remove: str, require_init: bool = True) -> dict:
    """Become unreachable, then read the driver's spec and delete it (and `also_remove`, such as the driver's
    own file and this one) before the code under judgement exists: non-dumpable, so the same uid can open neither
    /proc/<driver>/mem nor its descriptors; SIGINT ignored (signals from inside a pid namespace reach its init
    only where it handles them)."""
    if require_init and os.getpid() != 1:  # its guarantees, and kill(-1) at the end, need its own pid namespace
        raise SystemExit(f"{spec_file}: the driver must run as the container's init (pid 1)")
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 0
        raise SystemExit("driver: prctl(PR_SET_DUMPABLE) failed")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(spec_file) as f:
        spec = json.load(f)
    for name in (spec_file, *also_remove):
        os.unlink(name)
    return spec


def kill_everyone_else() -> None:
    """As the pid namespace's init, SIGKILL every other process in it and reap them (a no-op elsewhere: kill(-1)
    outside a namespace of its own would reach the whole uid)."""
    if os.getpid() != 1:
        return
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def kill_all_except(keep: set[int], within_s: float = 2.0) -> bool:
    """As init, SIGKILL every process of the namespace but `keep` and reap what becomes ours; False when some
    still remained after `within_s` (a fork storm outrunning the scans: the caller then uses kill(-1))."""
    if os.getpid() != 1:
        return True
    spare, deadline = {1, *keep}, time.monotonic() + within_s
    while True:
        while True:  # reap: orphans of killed processes become init's children
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        victims = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in spare]
        if not victims:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.0005)
