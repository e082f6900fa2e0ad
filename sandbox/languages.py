"""Per-language compile and run steps, and the tests harness (user code + test snippets).

With tests, every snippet runs in order and one line `<nonce> <index> pass|fail` per test reaches stdout; the
server strips those lines and counts passes. Python's tests run in a judge process apart from the solution's
(sandbox/harness/python_judge.py; only values and handles cross, so the solution cannot forge a verdict). The
other languages' harnesses run the tests in the solution's process and delete their own file before user code
runs, so printing a fake verdict requires the nonce, which code in that process can still find in its memory:
this stops accidents and naive cheating, not a determined adversary (judge mode is the unforgeable way there).

Test snippet conventions: Python, JavaScript and Bash take statements (assert ...; `assert` is node's
module in JS; a Bash test passes when its last command succeeds); C, C++ and Java take boolean expressions.
In tests mode C/C++ code must not define main and Java code must not declare `class Main`.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

Files = dict[str, str]


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # the file user code goes into when there are no tests
    compile: tuple[str, ...] | None
    run: tuple[str, ...]
    harness: Callable[[str, list[str], str], Files]
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


def _py_harness(code: str, tests: list[str], nonce: str) -> Files:
    """Tests run in a judge process apart from the solution's (sandbox/harness/python_judge.py)."""
    return {"solution.py": code, **_PY_HARNESS,
            "judge_input.json": json.dumps({"nonce": nonce, "tests": tests})}


def _js_harness(code: str, tests: list[str], nonce: str) -> Files:
    main = f"""const fs = require("fs"), vm = require("vm");
fs.unlinkSync(__filename);
globalThis.assert = require("assert");
globalThis.require = require;
const N = {json.dumps(nonce)}, T = {json.dumps(tests)};
vm.runInThisContext(fs.readFileSync("solution.js", "utf8"), {{filename: "solution.js"}});
for (let i = 0; i < T.length; i++) {{
  let ok = true;
  try {{ vm.runInThisContext(T[i], {{filename: "test" + i}}); }}
  catch (e) {{ ok = false; console.error(e && e.stack ? e.stack : String(e)); }}
  fs.writeSync(1, N + " " + i + " " + (ok ? "pass" : "fail") + "\\n");
}}
"""
    return {"solution.js": code, "main.js": main}


def _bash_harness(code: str, tests: list[str], nonce: str) -> Files:
    lines = ['rm -f -- "$0"', "source ./solution.sh"]
    for i, t in enumerate(tests):
        lines.append(f"if (\n{t}\n); then echo '{nonce} {i} pass'; else echo '{nonce} {i} fail'; fi")
    return {"solution.sh": code, "main.sh": "\n".join(lines) + "\n"}


def _c_like_harness(ext: str, header: str, guarded: bool) -> Callable[[str, list[str], str], Files]:
    def build(code: str, tests: list[str], nonce: str) -> Files:
        body = []
        for i, t in enumerate(tests):
            if guarded:
                check = f"bool ok = false; try {{ ok = ({t}); }} catch (...) {{ ok = false; }}"
            else:
                check = f"int ok = ({t});"
            body.append(f'  {{ {check} printf("%s {i} %s\\n", N, ok ? "pass" : "fail"); fflush(stdout); }}')
        src = (f"{header}\n#line 1 \"solution.{ext}\"\n{code}\n#line 1 \"tests\"\n"
               f'static const char *N = "{nonce}";\nint main(void) {{\n' + "\n".join(body) + "\n  return 0;\n}\n")
        return {f"main.{ext}": src}
    return build


def _java_harness(code: str, tests: list[str], nonce: str) -> Files:
    body = "\n".join(
        f'    {{ boolean ok; try {{ ok = ({t}); }} catch (Throwable e) {{ ok = false; e.printStackTrace(); }}\n'
        f'      System.out.println(N + " {i} " + (ok ? "pass" : "fail")); System.out.flush(); }}'
        for i, t in enumerate(tests))
    main = (f'public class Main {{\n  static final String N = "{nonce}";\n'
            f"  public static void main(String[] args) {{\n{body}\n  }}\n}}\n")
    return {"Solution.java": code, "Main.java": main}


def _go_harness(code: str, tests: list[str], nonce: str) -> Files:
    body = "\n".join(
        f'\tfmt.Println(N, {i}, verdict(func() (ok bool) {{ defer func() {{ if recover() != nil {{ ok = false }} }}(); '
        f'return {t} }}()))' for i, t in enumerate(tests))
    main = (f'package main\n\nimport "fmt"\n\nconst N = "{nonce}"\n\n'
            'func verdict(ok bool) string {\n\tif ok {\n\t\treturn "pass"\n\t}\n\treturn "fail"\n}\n\n'
            f"func main() {{\n{body}\n}}\n")
    return {"solution.go": code, "main.go": main}


def _rust_harness(code: str, tests: list[str], nonce: str) -> Files:
    body = "\n".join(
        f'    let ok = std::panic::catch_unwind(|| -> bool {{ {t} }}).unwrap_or(false);\n'
        f'    println!("{{}} {i} {{}}", N, if ok {{ "pass" }} else {{ "fail" }});' for i, t in enumerate(tests))
    src = (f"{code}\n\nconst N: &str = \"{nonce}\";\n"
           f"fn main() {{\n    std::panic::set_hook(Box::new(|_| {{}}));\n{body}\n}}\n")
    return {"main.rs": src}


def _script_harness(source: str, main: str, include: str, check: Callable[[str], str], emit: str):
    """A harness for a scripting language: load the solution file, then per test evaluate `check(test)` (a
    boolean, false on any error) and print the verdict line with `emit` (placeholders {i} and {ok})."""
    def build(code: str, tests: list[str], nonce: str) -> Files:
        lines = [include]
        for i, t in enumerate(tests):
            lines.append(check(t))
            lines.append(emit.format(i=i, nonce=nonce))
        return {source: code, main: "\n".join(lines) + "\n"}
    return build


_ruby = _script_harness("solution.rb", "main.rb", "File.delete(__FILE__)\nrequire_relative 'solution'",
                        lambda t: f"ok = begin; ({t}) ? true : false; rescue Exception; false; end",
                        "puts \"{nonce} {i} #{{ok ? 'pass' : 'fail'}}\"; $stdout.flush")
_php = _script_harness("solution.php", "main.php", "<?php\nunlink(__FILE__);\nrequire 'solution.php';",
                       lambda t: f"try {{ $ok = (bool)({t}); }} catch (Throwable $e) {{ $ok = false; }}",
                       "echo \"{nonce} {i} \" . ($ok ? 'pass' : 'fail') . \"\\n\"; flush();")
_perl = _script_harness("solution.pl", "main.pl", "unlink $0;\ndo './solution.pl';\n$| = 1;",
                        lambda t: f"$ok = eval {{ ({t}) ? 1 : 0 }} // 0;",
                        "print \"{nonce} {i} \" . ($ok ? 'pass' : 'fail') . \"\\n\";")
_lua = _script_harness("solution.lua", "main.lua", "os.remove(arg[0])\ndofile('solution.lua')",
                       lambda t: f"do local s, r = pcall(function() return ({t}) end); ok = s and r and true or false end",
                       "print('{nonce} {i} ' .. (ok and 'pass' or 'fail')); io.stdout:flush()")
_r = _script_harness("solution.R", "main.R", "invisible(file.remove('main.R'))\nsource('solution.R')",
                     lambda t: f"ok <- tryCatch(isTRUE({t}), error = function(e) FALSE)",
                     "cat('{nonce} {i}', if (ok) 'pass' else 'fail', '\\n')")


def _ts_harness(code: str, tests: list[str], nonce: str) -> Files:
    files = _js_harness(code, tests, nonce)
    return {"solution.ts": code, "main.ts": files["main.js"].replace('"solution.js"', '"solution.js"')}


_C_RUN = ("./prog",)
LANGUAGES: dict[str, Language] = {
    # -I: the judge imports nothing from /work, where the solution can write
    "python": Language("python", "main.py", None, ("python3", "main.py"), _py_harness,
                       tests_run=("python3", "-I", "main.py")),
    "javascript": Language("javascript", "main.js", None, ("node", "main.js"), _js_harness),
    "bash": Language("bash", "main.sh", None, ("bash", "main.sh"), _bash_harness),
    "c": Language("c", "main.c", ("gcc", "-O2", "-std=gnu11", "-o", "prog", "main.c", "-lm"), _C_RUN,
                  _c_like_harness("c", "#include <stdio.h>", guarded=False)),
    "cpp": Language("cpp", "main.cpp", ("g++", "-O2", "-std=gnu++17", "-o", "prog", "main.cpp"), _C_RUN,
                    _c_like_harness("cpp", "#include <cstdio>", guarded=True)),
    "java": Language("java", "Main.java", ("javac", "-encoding", "UTF-8", "-d", ".", "JAVA_SOURCES"),
                     ("java", "-cp", ".", "Main"), _java_harness, jvm=True),
    # MultiPL-E's languages that Debian packages (scripts/setup.sh installs them); tests are boolean expressions
    "go": Language("go", "main.go", ("go", "build", "-o", "prog", "GO_SOURCES"), _C_RUN, _go_harness,
                   prepare=lambda c: c if re.search(r"^\s*package\s", c, re.M) else "package main\n\n" + c),
    "rust": Language("rust", "main.rs", ("rustc", "-O", "-o", "prog", "main.rs"), _C_RUN, _rust_harness),
    "ruby": Language("ruby", "main.rb", None, ("ruby", "main.rb"), _ruby),
    "php": Language("php", "main.php", None, ("php", "-f", "main.php"), _php,
                    prepare=lambda c: c if "<?php" in c else "<?php\n" + c),
    "perl": Language("perl", "main.pl", None, ("perl", "main.pl"), _perl),
    "lua": Language("lua", "main.lua", None, ("lua5.4", "main.lua"), _lua),
    "r": Language("r", "main.R", None, ("Rscript", "--vanilla", "main.R"), _r),
    # TypeScript: the npm registry's compiler, type checks off (tsx's and SandboxFusion's behaviour)
    "typescript": Language("typescript", "main.ts",
                           ("tsc", "--noCheck", "--target", "es2022", "--module", "commonjs", "--outDir", ".",
                            "TS_SOURCES"), ("node", "main.js"), _ts_harness),
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
