"""Per-language compile and run steps, and the programs of tests mode.

Python's tests are statements (any assertion) judged in a process apart from the solution's
(sandbox/harness/python_judge.py; only values and handles cross, so the solution cannot forge a verdict). Every
other language's tests are comparisons (`add(1, 2) == 3`, `assert.deepEqual(f(x), [1])`, `[ "$(f 1)" = 2 ]`,
... see sandbox/value_tests.py): the expected side is evaluated without the solution before it exists, the other
side with it, and the service compares the two values' texts (sandbox/value_programs.py). In tests mode C/C++
and Go code must not define main, Java code must not declare `class Main`.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sandbox import value_programs
from sandbox.value_programs import Program

Files = dict[str, str]


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # the file user code goes into when there are no tests
    compile: tuple[str, ...] | None
    run: tuple[str, ...]
    values: Program | None  # tests mode's program (sandbox/value_programs.py); None: Python's judge
    jvm: bool = False
    tests_run: tuple[str, ...] | None = None  # the run step in tests mode, where it differs from `run`
    prepare: Callable[[str], str] | None = None  # completes a solution as its toolchain needs (PHP's open tag)

    def installed(self) -> bool:
        """Whether the host (whose /usr the `host` image binds) has this language's toolchain."""
        return shutil.which((self.compile or self.run)[0], path="/usr/local/bin:/usr/bin:/bin") is not None

    def solution(self, code: str) -> str:
        return self.prepare(code) if self.prepare else code


_HARNESS = Path(__file__).with_name("harness")


_PY_HARNESS = {name: (_HARNESS / source).read_text() for name, source in
               (("main.py", "python_judge.py"), ("runner.py", "python_runner.py"), ("python_wire.py", "python_wire.py"),
                (".tide_init.py", "container_init.py"))}


def python_tests(code: str, tests: list[str], nonce: str, setup: str = "",
                 solution_names: list[str] | None = None) -> Files:
    """Tests run in a judge process apart from the solution's (sandbox/harness/python_judge.py)."""
    return {"solution.py": code, **_PY_HARNESS,
            "judge_input.json": json.dumps({"nonce": nonce, "tests": tests, "setup": setup,
                                            "solution_names": solution_names})}


_C_RUN = ("./prog",)
LANGUAGES: dict[str, Language] = {
    # -I: the judge imports nothing from /work, where the solution can write
    "python": Language("python", "main.py", None, ("python3", "main.py"), None,
                       tests_run=("python3", "-I", "main.py")),
    "javascript": Language("javascript", "main.js", None, ("node", "main.js"), value_programs.javascript),
    "bash": Language("bash", "main.sh", None, ("bash", "main.sh"), value_programs.bash),
    "c": Language("c", "main.c", ("gcc", "-O2", "-std=gnu11", "-o", "prog", "main.c", "-lm"), _C_RUN, value_programs.c),
    "cpp": Language("cpp", "main.cpp", ("g++", "-O2", "-std=gnu++17", "-o", "prog", "main.cpp"), _C_RUN, value_programs.cpp),
    "java": Language("java", "Main.java", ("javac", "-encoding", "UTF-8", "-d", ".", "JAVA_SOURCES"),
                     ("java", "-cp", ".", "Main"), value_programs.java, jvm=True),
    # MultiPL-E's languages that Debian packages (scripts/setup.sh installs them)
    "go": Language("go", "main.go", ("go", "build", "-o", "prog", "GO_SOURCES"), _C_RUN, value_programs.go,
                   prepare=lambda c: c if re.search(r"^\s*package\s", c, re.M) else "package main\n\n" + c),
    "rust": Language("rust", "main.rs", ("rustc", "-O", "-o", "prog", "main.rs"), _C_RUN, value_programs.rust),
    "ruby": Language("ruby", "main.rb", None, ("ruby", "main.rb"), value_programs.ruby),
    "php": Language("php", "main.php", None, ("php", "-f", "main.php"), value_programs.php,
                    prepare=lambda c: c if "<?php" in c else "<?php\n" + c),
    "perl": Language("perl", "main.pl", None, ("perl", "main.pl"), value_programs.perl),
    "lua": Language("lua", "main.lua", None, ("lua5.4", "main.lua"), value_programs.lua),
    "r": Language("r", "main.R", None, ("Rscript", "--vanilla", "main.R"), value_programs.r),
    # TypeScript: the npm registry's compiler, type checks off (tsx's and SandboxFusion's behaviour)
    "typescript": Language("typescript", "main.ts",
                           ("tsc", "--noCheck", "--target", "es2022", "--module", "commonjs", "--outDir", ".",
                            "TS_SOURCES"), ("node", "main.js"), value_programs.typescript),
}
ALIASES = {"py": "python", "python3": "python", "js": "javascript", "node": "javascript", "nodejs": "javascript",
           "sh": "bash", "c++": "cpp", "cxx": "cpp", "golang": "go", "rs": "rust", "rb": "ruby", "pl": "perl",
           "R": "r", "ts": "typescript"}


def get_language(name: str) -> Language:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in LANGUAGES:
        raise KeyError(f"unknown language {name!r}; known: {sorted(LANGUAGES)}")
    return LANGUAGES[key]


def jvm_flags(memory_mb: int) -> list[str]:
    """Keep the JVM's heap inside the cgroup limit (it cannot see the limit without /sys/fs/cgroup)."""
    heap = max(32, memory_mb // 2)
    return [f"-Xmx{heap}m", "-Xss16m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"]


def command(lang: Language, step: tuple[str, ...], files: Files, memory_mb: int) -> list[str]:
    cmd = list(step)
    for marker, ext in (("GO_SOURCES", ".go"), ("TS_SOURCES", ".ts")):
        if marker in cmd:
            i = cmd.index(marker)
            cmd[i:i + 1] = sorted(f for f in files if f.endswith(ext) and "/" not in f)
    if lang.jvm:
        java_files = sorted(f for f in files if f.endswith(".java") and "/" not in f)
        if "JAVA_SOURCES" in cmd:
            i = cmd.index("JAVA_SOURCES")
            cmd[i:i + 1] = java_files
            cmd[1:1] = ["-J" + f for f in jvm_flags(memory_mb)]
        else:
            cmd[1:1] = jvm_flags(memory_mb)
    return cmd
