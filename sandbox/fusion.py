"""SandboxFusion's HTTP API (bytedance/SandboxFusion: `POST /run_code`, `POST /run_jupyter`), served by tide's runtime so that its PyPI
client `sandbox-fusion` (sync and async) and the code-RL stacks built on it (veRL's sandbox reward, ...) work
unchanged against `tide-sandbox serve`.

The request and response models follow SandboxFusion's field for field. Translation of tide's statuses:

| tide `RunResult.status` | SandboxFusion                                                                 |
| ----------------------- | ----------------------------------------------------------------------------- |
| ok                      | Success; run_result Finished, return_code 0                                    |
| runtime_error           | Failed; run_result Finished, the program's non-zero return_code               |
| timeout                 | Failed; run_result TimeLimitExceeded, return_code null                         |
| memory_limit            | Failed; run_result Finished, return_code as killed (non-zero), stderr notes it |
| output_limit            | Failed; run_result Finished, return_code as killed, output cut at the limit    |
| compile_error           | Failed; compile_result Finished with the compiler's return_code (or           |
|                         | TimeLimitExceeded), run_result null                                            |
| internal_error          | SandboxError (the client raises and retries), message = tide's stderr         |

A language SandboxFusion names but this service has no runtime for is a SandboxError naming it.
`memory_limit_MB` (-1: the service's default) and `run_timeout` map onto tide's limits, capped by the server's
maxima; `compile_timeout` can only shorten the server's compile limit."""
from __future__ import annotations

import enum
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from .languages import LANGUAGES
from .models import Limits, RunRequest, RunResult, Status

# SandboxFusion's language names -> tide's, for the languages this service runs.
LANGUAGE_NAMES = {"python": "python", "cpp": "cpp", "nodejs": "javascript", "java": "java", "bash": "bash",
                  "go": "go", "rust": "rust", "ruby": "ruby", "php": "php", "perl": "perl", "lua": "lua",
                  "R": "r", "typescript": "typescript", "c": "c"}


class RunStatus(str, enum.Enum):
    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(str, enum.Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: Optional[float] = None
    return_code: Optional[int] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    compile_timeout: float = Field(10, gt=0)
    run_timeout: float = Field(10, gt=0)
    memory_limit_MB: int = -1
    code: str
    stdin: Optional[str] = None
    language: str
    files: dict[str, Optional[str]] = {}
    fetch_files: list[str] = []
    args: list[str] = []


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: Optional[CommandRunResult] = None
    run_result: Optional[CommandRunResult] = None
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = {}


class RunJupyterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    cells: list[str]
    cell_timeout: float = Field(0, ge=0)  # 0: no per-cell limit
    total_timeout: float = Field(45, gt=0)
    memory_limit_MB: int = -1
    kernel: str = "python3"
    files: dict[str, Optional[str]] = {}
    fetch_files: list[str] = []


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict]
    error: list[dict]


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str = ""
    driver: Optional[CommandRunResult] = None
    cells: list[CellRunResult] = []
    executor_pod_name: Optional[str] = None
    files: dict[str, str] = {}


def jupyter_error(message: str) -> RunJupyterResponse:
    return RunJupyterResponse(status=RunStatus.SandboxError, message=message)


def jupyter_request(req: RunJupyterRequest) -> RunRequest | RunJupyterResponse:
    if req.kernel != "python3":
        return jupyter_error(f"kernel {req.kernel!r} is not available (python3 is)")
    files = {name: content for name, content in req.files.items() if isinstance(content, str)}
    return RunRequest(language="python", code="", cells=req.cells, cell_timeout_s=req.cell_timeout or None,
                      binary_files=files, fetch_files=req.fetch_files,
                      limits=Limits(timeout_s=req.total_timeout,
                                    memory_mb=req.memory_limit_MB if req.memory_limit_MB > 0 else None))


def jupyter_response(res: RunResult) -> RunJupyterResponse:
    """Success with every cell's output when the kernel ran them (a cell that raised is still Success, its error
    in `error`, as in SandboxFusion); Failed with no cells when the driver did not finish."""
    if res.status == Status.internal_error:
        return jupyter_error(res.stderr or "the sandbox failed")
    finished = res.status == Status.ok
    driver = CommandRunResult(
        status=CommandRunStatus.TimeLimitExceeded if res.status == Status.timeout else CommandRunStatus.Finished,
        execution_time=res.wall_ms / 1000, return_code=None if res.status == Status.timeout else res.exit_code,
        stdout=res.stdout, stderr=res.stderr)
    cells = [CellRunResult(**c.model_dump()) for c in res.cells or []] if finished else []
    return RunJupyterResponse(status=RunStatus.Success if finished else RunStatus.Failed, driver=driver,
                              cells=cells, files=res.files if finished else {})


def sandbox_error(message: str) -> RunCodeResponse:
    return RunCodeResponse(status=RunStatus.SandboxError, message=message)


def to_run_request(req: RunCodeRequest) -> RunRequest | RunCodeResponse:
    """tide's request for a SandboxFusion one, or the SandboxError answering it."""
    language = LANGUAGE_NAMES.get(req.language)
    if language not in LANGUAGES or not LANGUAGES[language].installed():
        available = sorted(k for k, v in LANGUAGE_NAMES.items() if v in LANGUAGES and LANGUAGES[v].installed())
        return sandbox_error(f"language {req.language!r} is not available in this sandbox (available: {available})")
    if req.args:
        return sandbox_error("`args` (pytest arguments) is not supported: run pytest from the code instead")
    files = {name: content for name, content in req.files.items() if isinstance(content, str)}
    return RunRequest(language=language, code=req.code, stdin=req.stdin or "", binary_files=files,
                      fetch_files=req.fetch_files, compile_timeout_s=req.compile_timeout,
                      limits=Limits(timeout_s=req.run_timeout,
                                    memory_mb=req.memory_limit_MB if req.memory_limit_MB > 0 else None))


def to_response(res: RunResult) -> RunCodeResponse:
    if res.status == Status.internal_error:
        return sandbox_error(res.stderr or "the sandbox could not run the code")
    compile_result = None
    if res.compile_exit_code is not None or res.compile_timed_out:
        compile_result = CommandRunResult(
            status=CommandRunStatus.TimeLimitExceeded if res.compile_timed_out else CommandRunStatus.Finished,
            execution_time=(res.compile_wall_ms or 0) / 1000, stdout="", stderr=res.compile_output or "",
            return_code=None if res.compile_timed_out else res.compile_exit_code)
    if res.status == Status.compile_error:
        return RunCodeResponse(status=RunStatus.Failed, compile_result=compile_result, files=res.files)
    timed_out = res.status == Status.timeout
    stderr = res.stderr
    if res.status == Status.memory_limit:
        stderr += "\n[tide-sandbox] killed: memory limit"
    elif res.status == Status.output_limit:
        stderr += "\n[tide-sandbox] killed: output limit"
    return_code = None if timed_out else (res.exit_code if res.exit_code is not None else
                                          0 if res.status == Status.ok else 1)
    if res.status not in (Status.ok, Status.timeout) and return_code == 0:
        return_code = 1  # killed for a limit after exiting 0 is still a failure
    run_result = CommandRunResult(
        status=CommandRunStatus.TimeLimitExceeded if timed_out else CommandRunStatus.Finished,
        execution_time=res.wall_ms / 1000, return_code=return_code, stdout=res.stdout, stderr=stderr)
    ok = res.status == Status.ok
    return RunCodeResponse(status=RunStatus.Success if ok else RunStatus.Failed, compile_result=compile_result,
                           run_result=run_result, files=res.files)
