"""Request/response messages of the sandbox HTTP API (the contract in shared/DESIGN.md)."""
from __future__ import annotations

import base64
import binascii
import enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Requests refuse NaN and Infinity (sandbox/wire.py refuses them in bodies before any model sees them).
STRICT = ConfigDict(allow_inf_nan=False)


class Status(str, enum.Enum):
    ok = "ok"
    runtime_error = "runtime_error"
    timeout = "timeout"
    memory_limit = "memory_limit"
    output_limit = "output_limit"
    compile_error = "compile_error"
    internal_error = "internal_error"


class Limits(BaseModel):
    """Per-run limits; any left out take the server's defaults, and all are capped by the server's maxima."""

    model_config = STRICT
    timeout_s: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    output_kb: int | None = Field(None, gt=0)
    pids: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)


class JudgeCase(BaseModel):
    stdin: str = ""
    expected_stdout: str


CHECKER_LANGUAGES = ("python", "c", "cpp", "go", "rust")


class Checker(BaseModel):
    """How a case's output is judged (sandbox/harness/checkers.py): exact (line ends and trailing blank lines
    ignored), tokens, float (tokens; numbers within abs_tol or rel_tol of the expected, except that an expected
    integer token must be the same integer unless `exact_integers` is false), or program: `code` in
    `language`, run in the sandbox after each case as `checker <input> <output> <answer>` (testlib's order);
    exit status 0 accepts, anything else is a wrong answer, and its stderr is the case's checker_message."""

    model_config = STRICT

    kind: Literal["exact", "tokens", "float", "program"] = "exact"
    abs_tol: float = Field(1e-6, ge=0)
    rel_tol: float = Field(1e-6, ge=0)
    exact_integers: bool = True
    language: str = "python"
    code: str | None = None

    @model_validator(mode="after")
    def _program(self) -> "Checker":
        if self.kind == "program":
            if not self.code:
                raise ValueError("checker kind `program` needs its `code`")
            if self.language not in CHECKER_LANGUAGES:
                raise ValueError(f"checker programs are written in one of {list(CHECKER_LANGUAGES)}, "
                                 f"not {self.language!r}")
        return self


class Verdict(str, enum.Enum):
    accepted = "AC"
    wrong_answer = "WA"
    time_limit = "TLE"
    memory_limit = "MLE"
    runtime_error = "RE"
    output_limit = "OLE"


class CaseResult(BaseModel):
    verdict: Verdict
    exit_code: int | None = None
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    peak_memory_kb: int = 0
    stdout: str = Field("", description="the start of the case's output")
    stderr: str = ""
    checker_message: str = Field("", description="a checker program's stderr (its explanation), start of")


class CellResult(BaseModel):
    """One Jupyter cell: its streams, display data (MIME bundles; image/png base64) and errors
    ({ename, evalue, traceback})."""

    stdout: str = ""
    stderr: str = ""
    display: list[dict] = Field(default_factory=list)
    error: list[dict] = Field(default_factory=list)


_PYTHON = ("python", "python3", "py")  # the names a request may give Python by


class RunRequest(BaseModel):
    model_config = STRICT

    language: str
    code: str
    stdin: str = ""
    files: dict[str, str] = Field(default_factory=dict, description="extra files, relative paths under /work")
    tests: list[str] = Field(default_factory=list, description="test snippets run after the code (see languages)")
    test_setup: str = Field("", description="Python tests mode: code run in the tests' scope before them, judge-side "
                            "(imports, helpers: MBPP's test_imports and test_setup_code); its names win over the "
                            "solution's")
    solution_names: list[str] | None = Field(None, description="Python tests mode: the solution's names the tests "
                                             "may use (HumanEval's entry_point); default: the names the tests "
                                             "call or pass to a call that no builtin or test_setup gives")
    limits: Limits = Field(default_factory=Limits)
    image: str | None = Field(None, description="image name; default: the server's default image")
    binary_files: dict[str, str] = Field(default_factory=dict,
                                         description="extra files as base64, relative paths under /work")
    fetch_files: list[str] = Field(default_factory=list,
                                   description="files under /work to return (base64) after the run; missing or "
                                               "non-regular ones are left out")
    compile_timeout_s: float | None = Field(None, gt=0, description="compile step wall time, at most the server's")
    cases: list[JudgeCase] = Field(default_factory=list, description="judge mode: run the program once per case "
                                   "(limits apply per case) and check its stdout")
    checker: Checker = Field(default_factory=Checker)
    stop_on_first_failure: bool = False
    cells: list[str] = Field(default_factory=list, description="Jupyter mode (python): run these cells in one "
                             "fresh IPython kernel, in order; limits.timeout_s bounds them all")
    cell_timeout_s: float | None = Field(None, gt=0, description="Jupyter mode: one cell's wall time")

    @model_validator(mode="after")
    def _one_mode(self) -> "RunRequest":
        if sum(map(bool, (self.tests, self.cases, self.cells))) > 1:
            raise ValueError("give one of `tests` (tests mode), `cases` (judge mode) or `cells` (Jupyter mode)")
        if self.cells and self.language not in _PYTHON:
            raise ValueError("Jupyter mode (`cells`) runs a python kernel: language must be python")
        if (self.test_setup or self.solution_names is not None) and not (
                self.tests and self.language in _PYTHON):
            raise ValueError("`test_setup` and `solution_names` belong to Python's tests mode (`tests` with "
                             "language python); other languages' tests see what their program declares")
        return self

    @field_validator("binary_files")
    @classmethod
    def _base64(cls, files: dict[str, str]) -> dict[str, str]:
        for name, content in files.items():
            try:
                base64.b64decode(content, validate=True)
            except binascii.Error:
                raise ValueError(f"binary_files[{name!r}] is not base64") from None
        return files


class RunResult(BaseModel):
    status: Status
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    peak_memory_kb: int = 0
    tests_passed: int | None = None
    tests_total: int | None = None
    compile_output: str | None = None
    compile_exit_code: int | None = None
    compile_wall_ms: float | None = None
    compile_timed_out: bool = False
    files: dict[str, str] = Field(default_factory=dict, description="fetch_files that existed, base64")
    cases: list[CaseResult] | None = Field(None, description="judge mode: one per case run, in order")
    cases_passed: int | None = None
    cases_total: int | None = None
    cells: list[CellResult] | None = Field(None, description="Jupyter mode: one per cell run, in order")


class BatchRequest(BaseModel):
    runs: list[RunRequest]


class BatchResult(BaseModel):
    results: list[RunResult]


class Health(BaseModel):
    status: str
    cgroup_mode: str
    slots: int
    busy: int
    queued: int
    broken_slots: int
    sessions: int = 0
    max_sessions: int = 0
    max_batch: int
    languages: list[str]
    images: list[str]


class SessionRequest(BaseModel):
    """POST /sessions: a long-lived Python namespace in its own container (sandbox/sessions.py)."""

    model_config = STRICT

    language: Literal["python"] = "python"
    limits: Limits = Field(default_factory=Limits, description="memory, pids, disk and output per cell; "
                           "timeout_s is each cell's default wall time")
    ttl_s: float = Field(300.0, gt=0, le=3600, description="idle time after which the session is reaped")
    image: str | None = None


class SessionInfo(BaseModel):
    id: str
    ttl_s: float


class SessionRun(BaseModel):
    model_config = STRICT

    code: str
    timeout_s: float | None = Field(None, gt=0)


class SessionResult(BaseModel):
    """One cell of a session. `timeout` and `dead` end the session (its state is gone)."""

    status: Literal["ok", "error", "timeout", "dead"]
    stdout: str = ""
    stderr: str = ""
    display: list[dict] = Field(default_factory=list)
    error: list[dict] = Field(default_factory=list)
    wall_ms: float = 0.0
