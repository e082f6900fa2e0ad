"""How a run's container output becomes its result, per mode: a plain run's phase (and Python tests mode's verdict
lines), and what judge mode and Jupyter mode add -- the trusted driver the container starts as its init, its spec,
the limits around it, and its report (one line behind a nonce) turned into per-case or per-cell results."""
from __future__ import annotations

import json
from pathlib import Path

from .config import Resolved
from .containers import Phase
from .languages import Language, command
from .models import CaseResult, CellResult, RunRequest, RunResult, Status, Verdict

_HARNESS = Path(__file__).with_name("harness")
_JUDGE_DRIVER = (_HARNESS / "judge_driver.py").read_text()
_CHECKERS = (_HARNESS / "checkers.py").read_text()
_ZYGOTE = (_HARNESS / "python_zygote.py").read_text()  # Python's fork server in judge mode
_JUPYTER_DRIVER = (_HARNESS / "jupyter_driver.py").read_text()
_CONTAINER_INIT = (_HARNESS / "container_init.py").read_text()  # what each driver loads first


def phase_result(p: Phase, req: RunRequest, nonce: str, compiled: dict, judge_tests: bool = True) -> RunResult:
    """The run step's phase as a result; in Python's tests mode (`judge_tests`) its verdict lines, one per test
    behind the nonce, are counted and taken out of stdout."""
    if p.runtime_error:
        return RunResult(status=Status.internal_error, stderr=p.runtime_error, wall_ms=p.wall_ms)
    if p.oom and p.exit_code != 0:
        status = Status.memory_limit
    elif p.output_exceeded:
        status = Status.output_limit
    elif p.timed_out:
        status = Status.timeout
    elif p.exit_code != 0:
        status = Status.runtime_error
    else:
        status = Status.ok
    stdout = p.stdout.decode("utf-8", "replace")
    passed = total = None
    if req.tests and not judge_tests:
        total, passed = len(req.tests), 0  # counted by valued()
    elif req.tests:
        total, passed, kept = len(req.tests), 0, []
        seen: set[int] = set()
        for line in stdout.splitlines(keepends=True):
            parts = line.split()
            if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit():
                i = int(parts[1])
                if parts[2] == "pass" and i < total and i not in seen:
                    passed += 1
                seen.add(i)
            else:
                kept.append(line)
        stdout = "".join(kept)
    return RunResult(status=status, exit_code=p.exit_code, stdout=stdout,
                     stderr=p.stderr.decode("utf-8", "replace"), wall_ms=round(p.wall_ms, 3),
                     cpu_ms=round(p.cpu_ms, 3), peak_memory_kb=p.peak_kb, tests_passed=passed,
                     tests_total=total, **compiled)


def _driver_report(stdout: str, nonce: str) -> tuple[dict | None, str]:
    """A driver's report (its one line behind the nonce; judge and Jupyter modes) and the rest of stdout."""
    report, kept = None, []
    for line in stdout.splitlines(keepends=True):
        if line.startswith(nonce + " "):
            report = json.loads(line[len(nonce) + 1:])
        else:
            kept.append(line)
    return report, "".join(kept)


# Judge mode (sandbox/harness/judge_driver.py is the container's init; the program runs once per case under it).
JUDGE_RUN = ("python3", "-I", ".tide_judge.py")
_ECHO_BYTES = 1024  # of each case's output, returned for debugging


def judge_files(req: RunRequest, lang: Language, limits: Resolved, nonce: str, checker: bytes | None = None,
                wall_factor: float = 1.0) -> dict[str, str | bytes]:
    """The driver, its spec and (`checker`: a checker program, source or binary) the checker's file. Written only
    after the compile step: a compiler could embed any file it finds (Rust's include_str!, Go's embed)."""
    checker_cmd = None
    if checker is not None:
        checker_cmd = ["python3", "-I", "{checker}"] if req.checker.language == "python" else ["{checker}"]
    spec = {"nonce": nonce, "cmd": command(lang, lang.run, {lang.source: ""}, limits.memory_mb),
            "checker_cmd": checker_cmd, "zygote_source": _ZYGOTE if lang.name == "python" else None,
            "cases": [c.model_dump() for c in req.cases], "checker": req.checker.model_dump(),
            "timeout_s": limits.timeout_s, "wall_factor": wall_factor, "output_bytes": limits.output_kb * 1024,
            "memory_kb": limits.memory_mb * 1024, "echo_bytes": _ECHO_BYTES,
            "stop_on_first_failure": req.stop_on_first_failure,
            "checkers_source": _CHECKERS}
    return {".tide_judge.py": _JUDGE_DRIVER, ".tide_judge.json": json.dumps(spec), ".tide_init.py": _CONTAINER_INIT,
            **({".tide_checker": checker} if checker is not None else {})}


def judge_limits(per_case: Resolved, n_cases: int, wall_factor: float = 1.0) -> Resolved:
    """The container's limits around n cases: their longest wall times and the driver's report, plus start-up
    slack."""
    return Resolved(timeout_s=n_cases * (per_case.timeout_s * wall_factor + 0.25) + 5,
                    memory_mb=per_case.memory_mb + 64, pids=per_case.pids + 4, disk_mb=per_case.disk_mb,
                    output_kb=per_case.output_kb + n_cases * (_ECHO_BYTES * 6 + 8192) // 1024 + 64)


def judged(result: RunResult, req: RunRequest, nonce: str) -> RunResult:
    """The driver's report as per-case results; without it, the whole judge run failed (its status says how)
    and every case counts as failed."""
    report, rest = _driver_report(result.stdout, nonce)
    cases = [CaseResult.model_validate(c) for c in report["cases"]] if report else []
    return result.model_copy(update={
        "stdout": rest.rstrip("\n"), "cases": cases, "cases_total": len(req.cases),
        "cases_passed": sum(c.verdict == Verdict.accepted for c in cases)})


# Jupyter mode (sandbox/harness/jupyter_driver.py is the container's init and starts one ipykernel).
JUPYTER_RUN = ("python3", "-I", ".tide_jupyter.py")
_KERNEL_START_S = 20.0


def jupyter_files(req: RunRequest, limits: Resolved, nonce: str) -> dict[str, str]:
    spec = {"nonce": nonce, "cells": req.cells, "cell_timeout_s": req.cell_timeout_s,
            "start_timeout_s": _KERNEL_START_S}
    return {".tide_jupyter.py": _JUPYTER_DRIVER, ".tide_jupyter.json": json.dumps(spec),
            ".tide_init.py": _CONTAINER_INIT}


def jupyter_limits(limits: Resolved) -> Resolved:
    """The request's limits for the cells, plus the kernel's start (about a second) and the report."""
    return Resolved(timeout_s=limits.timeout_s + _KERNEL_START_S, memory_mb=limits.memory_mb,
                    output_kb=limits.output_kb * 2 + 64, pids=limits.pids, disk_mb=limits.disk_mb)


def jupyter_result(result: RunResult, nonce: str) -> RunResult:
    """Cells from the driver's report; a kernel that would not start is a runtime error naming why."""
    report, rest = _driver_report(result.stdout, nonce)
    update: dict = {"stdout": rest.strip("\n"), "cells": []}
    if report:
        update["cells"] = [CellResult.model_validate(c) for c in report["cells"]]
        if report.get("kernel_error"):
            update.update(status=Status.runtime_error, stderr=result.stderr + report["kernel_error"])
    elif result.status == Status.ok:
        update.update(status=Status.runtime_error, stderr=result.stderr + "the Jupyter driver gave no report")
    return result.model_copy(update=update)
