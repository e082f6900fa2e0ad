"""Jupyter mode's driver, the container's init: one fresh IPython kernel (ipykernel, over unix sockets since the
container's loopback is down) runs the cells in order; per cell its stdout, stderr, display data (every MIME
bundle: text/plain, image/png as base64, ...) and errors. A cell over `cell_timeout_s` is interrupted and
reported as a TimeoutError, and the cells after it are not run. The kernel's own stdout/stderr go nowhere: its
output reaches the report only through Jupyter's messages, and the report is printed once, after every other
process is killed, behind a nonce."""
import json
import os
import queue
import subprocess
import sys
import time


def _run_cell(kc, code: str, timeout_s: float | None) -> tuple[dict, bool]:
    cell = {"stdout": "", "stderr": "", "display": [], "error": []}
    msg_id = kc.execute(code, allow_stdin=False, stop_on_error=False)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            cell["error"].append({"ename": "TimeoutError", "evalue": f"cell exceeded {timeout_s} s",
                                  "traceback": []})
            return cell, False
        try:
            msg = kc.get_iopub_msg(timeout=min(left, 1.0) if left is not None else 1.0)
        except queue.Empty:
            continue
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            cell["stdout" if content.get("name") == "stdout" else "stderr"] += content.get("text", "")
        elif kind in ("display_data", "execute_result", "update_display_data"):
            cell["display"].append(content.get("data", {}))
        elif kind == "error":
            cell["error"].append({k: content.get(k) for k in ("ename", "evalue", "traceback")})
        elif kind == "status" and content.get("execution_state") == "idle":
            return cell, True


def main() -> None:
    init: dict = {}  # container_init.py, run from its file (never imported: the code under judgement can write /work)
    with open(".tide_init.py") as f:
        exec(compile(f.read(), ".tide_init.py", "exec"), init)
    spec = init["take_secrets"](".tide_jupyter.json", ".tide_jupyter.py", ".tide_init.py")
    os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # ipykernel's debugger would warn on every start
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    from jupyter_client import KernelManager

    report = {"cells": [], "kernel_error": None}
    km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(os.getcwd(), ".kernel"))
    try:
        km.start_kernel(cwd=os.getcwd(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=spec["start_timeout_s"])
        for code in spec["cells"]:
            cell, finished = _run_cell(kc, code, spec["cell_timeout_s"])
            report["cells"].append(cell)
            if not finished:
                break
    except Exception as e:  # the kernel would not start or died
        report["kernel_error"] = f"{type(e).__name__}: {e}"
    init["kill_everyone_else"]()
    sys.stdout.write("\n" + spec["nonce"] + " " + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
