"""One run request on a worker's seat, start to result: the request's files (its code, Python's tests harness or
another language's tests program, a mode's driver), the compile step and the run step on one overlay, and the
result in the request's mode. What a task's own programs compute without the solution -- the expected values of
a test set outside Python, a compiled checker program -- runs first, in containers of their own, cached."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import uuid
from pathlib import Path

from .config import Resolved, SandboxConfig
from .containers import Containers, Phase, Seat
from .images import SANDBOX_GID, SANDBOX_UID, Image
from .languages import Language, command, get_language, python_tests
from .lru import LruCache
from .models import Limits, RunRequest, RunResult, Status
from .run_modes import (
    JUDGE_RUN,
    JUPYTER_RUN,
    judge_files,
    judge_limits,
    judged,
    jupyter_files,
    jupyter_limits,
    jupyter_result,
    phase_result,
)
from .value_tests import (
    EXPECTED_DIR,
    VALUES_PATH,
    Expected,
    Split,
    expected_key,
    parse_values,
    read_values,
    split_test,
    valued,
)
from .workdir import fetch_files, write_files, write_late_files

CHECKER_DIR = ".tide_checker_build"  # under /work of a checker program's own build container
_C_RUN_BINARY = "prog"  # what the compiled checker languages (c, cpp, go, rust) build


class Executor:
    """Runs requests with the service's `config`, on `images` (the runtime's, filled when it starts)."""

    def __init__(self, config: SandboxConfig, containers: Containers, images: dict[str, Image]):
        self.config = config
        self.containers = containers
        self.images = images
        self._expected: LruCache[Expected] = LruCache(4096)  # by test set (value_tests.expected_key)
        self._checkers: LruCache[bytes] = LruCache(16)  # compiled checker programs by source

    def execute(self, w: Seat, req: RunRequest) -> RunResult:
        lang = get_language(req.language)
        limits = self.config.effective(req.limits)
        image = self.images[req.image or self.config.default_image]
        nonce = uuid.uuid4().hex
        files = dict(req.files)
        code = lang.solution(req.code)
        splits = [split_test(lang.name, t) for t in req.tests] if req.tests and lang.values else None
        if splits is not None:
            files.update(lang.values(code, [s.value for s in splits], VALUES_PATH))
        elif req.tests:
            files.update(python_tests(code, req.tests, nonce, req.test_setup, req.solution_names))
        else:
            files[lang.source] = code
        if req.cells:
            files.pop(lang.source, None)  # the cells are the code
            files.update(jupyter_files(req, limits, nonce))
        out_bytes = limits.output_kb * 1024
        compile_out = (self.config.compile_limits.output_kb or 64) * 1024
        binary = {k: base64.b64decode(v, validate=True) for k, v in req.binary_files.items()}
        if splits is not None:
            expected = self._expected_values(w, image, lang, req, splits, binary)
        checker = None
        if req.cases and req.checker.kind == "program":
            checker = self._checker_program(w, image, req)
            if isinstance(checker, RunResult):
                return checker
        with self.containers.workspace(w, limits, image, files, binary, req.stdin.encode(),
                                       max(out_bytes, compile_out)) as (rootfs, out, stdin):
            compile_output = None
            if lang.compile:
                climits = self.config.compile_step(limits, req.compile_timeout_s)
                args = command(lang, lang.compile, files, climits.memory_mb)
                c = self.containers.phase(w, rootfs, image, args, climits, None, out, "compile", cpu_time=True)
                compile_output = (c.stdout + c.stderr).decode("utf-8", "replace")
                compiled = dict(compile_output=compile_output, compile_exit_code=c.exit_code,
                                compile_wall_ms=round(c.wall_ms, 3), compile_timed_out=c.timed_out)
                if c.runtime_error:
                    return RunResult(status=Status.internal_error, stderr=c.runtime_error, wall_ms=c.wall_ms)
                if c.exit_code != 0 or c.timed_out or c.oom:
                    why = " (compiler timed out)" if c.timed_out else " (compiler ran out of memory)" if c.oom else ""
                    return RunResult(status=Status.compile_error, exit_code=c.exit_code, stderr=compile_output + why,
                                     wall_ms=c.wall_ms, cpu_ms=c.cpu_ms, peak_memory_kb=c.peak_kb,
                                     tests_passed=0 if req.tests else None,
                                     tests_total=len(req.tests) if req.tests else None,
                                     cases_passed=0 if req.cases else None,
                                     cases_total=len(req.cases) if req.cases else None, **compiled)
            else:
                compiled = {}
            plain = not (req.cases or req.cells)  # judge and Jupyter modes time each case or cell themselves
            if req.cases:
                factor = self.config.wall_time_factor
                write_late_files(Path(rootfs, "work"), judge_files(req, lang, limits, nonce, checker, factor))
                args, run_limits = list(JUDGE_RUN), judge_limits(limits, len(req.cases), factor)
            elif req.cells:
                args, run_limits = list(JUPYTER_RUN), jupyter_limits(limits)
            else:
                run = lang.tests_run if req.tests and lang.tests_run else lang.run
                args, run_limits = command(lang, run, files, limits.memory_mb), limits
            p = self.containers.phase(w, rootfs, image, args, run_limits, stdin, out, "run", cpu_time=plain)
            result = phase_result(p, req, nonce, compiled, judge_tests=splits is None)
            if splits is not None:
                got = read_values(f"{rootfs}/work", VALUES_PATH.rsplit("/", 1)[1], limits.disk_mb << 20)
                result = valued(result, req.tests, expected, parse_values(got, len(req.tests)))
            elif req.cases:
                result = judged(result, req, nonce)
            elif req.cells:
                result = jupyter_result(result, nonce)
            if req.fetch_files:
                files, left_out = fetch_files(Path(rootfs, "work"), req.fetch_files,
                                              min(limits.disk_mb, self.config.max_fetch_mb) << 20)
                result.files = files
                if left_out:
                    result.stderr += "".join(f"tide: fetch_files left out {why}\n" for why in left_out)
            return result

    def _side_limits(self) -> Resolved:
        """Limits of the task's own programs (expected values, checker builds): the service's, never a request's,
        so that what is cached for a test set does not depend on who asked first."""
        return self.config.compile_step(self.config.effective(Limits()))

    def _expected_values(self, w: Seat, image: Image, lang: Language, req: RunRequest, splits: list[Split],
                         binary_files: dict[str, bytes]) -> Expected:
        """Tests mode outside Python: evaluate the tests' expected sides, in a container of their own (with the
        request's files, without the solution), before anything of the solution's runs. Cached by test set, and
        only when every expected value was recorded by a program that ran to its end."""
        key = expected_key(lang.name, image.name, req)
        hit = self._expected.get(key)
        if hit is not None:
            return hit
        files = lang.values(None, [s.expected for s in splits], f"/work/{EXPECTED_DIR}/.tide_values")
        elimits = self._side_limits()
        steps = [command(lang, step, files, elimits.memory_mb) for step in (lang.compile, lang.run) if step]
        p, data = self._side_phase(w, image, "expected", EXPECTED_DIR, files, steps, elimits, ".tide_values",
                                   elimits.disk_mb << 20, req.files, binary_files)
        error = ""
        if p.runtime_error or p.exit_code != 0 or p.timed_out or p.oom or p.output_exceeded:
            why = (p.runtime_error or "timed out" if p.timed_out else "ran out of memory" if p.oom
                   else "output limit" if p.output_exceeded else f"exit status {p.exit_code}")
            detail = (p.stdout + p.stderr).decode("utf-8", "replace")[-2000:]
            error = f"tide: the tests' expected values did not all evaluate ({why}):\n{detail}"
        result = Expected(parse_values(data, len(splits)), error)
        if not error and len(result.values) == len(splits) and all(v is not None for v in result.values.values()):
            self._expected.put(key, result)
        return result

    def _checker_program(self, w: Seat, image: Image, req: RunRequest) -> bytes | RunResult:
        """Judge mode's checker program: Python's source, or a compiled language's binary built in a container of
        its own before anything of the solution's (cached by source); a checker that does not compile fails the
        request."""
        lang = get_language(req.checker.language)
        code = lang.solution(req.checker.code or "")
        if not lang.compile:
            return code.encode()
        key = hashlib.sha256(json.dumps([lang.name, image.name, code]).encode()).hexdigest()
        hit = self._checkers.get(key)
        if hit is not None:
            return hit
        files = {lang.source: code}
        climits = self._side_limits()
        p, binary = self._side_phase(w, image, "checker", CHECKER_DIR, files,
                                     [command(lang, lang.compile, files, climits.memory_mb)], climits,
                                     _C_RUN_BINARY, 256 << 20)
        if p.runtime_error or p.exit_code != 0 or not binary:
            detail = (p.runtime_error or "") + (p.stdout + p.stderr).decode("utf-8", "replace")[-4000:]
            return RunResult(status=Status.compile_error, stderr=f"the checker program did not compile:\n{detail}",
                             wall_ms=p.wall_ms, cases_passed=0, cases_total=len(req.cases))
        self._checkers.put(key, binary)
        return binary

    def _side_phase(self, w: Seat, image: Image, tag: str, subdir: str, files: dict[str, str],
                    steps: list[list[str]], limits: Resolved, product: str, max_bytes: int,
                    given: dict[str, str] | None = None, binary_files: dict[str, bytes] | None = None,
                    ) -> tuple[Phase, bytes]:
        """Run `steps` (e.g. compile, then run) on `files` in /work/<subdir> of a container of their own, with the
        request's files (`given`, `binary_files`) in /work, and return the phase and the file `product` it left
        there, read from outside without following links. The container's whole writable layer goes with its
        mounts, so nothing a toolchain writes anywhere (Go's build cache, Rust's target directory, Java's classes,
        temp files) outlives the phase: the solution's container starts from the image."""
        with self.containers.workspace(w, limits, image, given or {}, binary_files or {}, b"",
                                       limits.output_kb * 1024) as (rootfs, out, _):
            sub = Path(rootfs, "work", subdir)
            sub.mkdir()
            os.chown(sub, SANDBOX_UID, SANDBOX_GID)
            write_files(sub, files)
            script = f"cd {subdir} && " + "".join(shlex.join(s) + " && " for s in steps[:-1]) + "exec " + \
                shlex.join(steps[-1])
            p = self.containers.phase(w, rootfs, image, ["sh", "-c", script], limits, None, out, tag)
            return p, read_values(str(sub), product, max_bytes)
