"""Request/response messages of the sandbox HTTP API (the contract in shared/DESIGN.md)."""
from __future__ import annotations

import enum

from pydantic import BaseModel, Field


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

    timeout_s: float | None = Field(None, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    output_kb: int | None = Field(None, gt=0)
    pids: int | None = Field(None, gt=0)
    disk_mb: int | None = Field(None, gt=0)


class RunRequest(BaseModel):
    language: str
    code: str
    stdin: str = ""
    files: dict[str, str] = Field(default_factory=dict, description="extra files, relative paths under /work")
    tests: list[str] = Field(default_factory=list, description="test snippets run after the code (see languages)")
    limits: Limits = Field(default_factory=Limits)
    image: str | None = Field(None, description="image name; default: the server's default image")


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
    max_batch: int
    languages: list[str]
    images: list[str]
