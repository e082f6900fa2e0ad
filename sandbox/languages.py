"""Per-language compile and run steps, and the tests harness (user code + test snippets).

With tests, every snippet runs in order and the harness prints one line `<nonce> <index> pass|fail` per
test; the server strips those lines and counts passes. The nonce is random per request and the harness file
removes itself before user code runs, so printing a fake verdict requires guessing it. (Code that runs in
the harness's own process can still find it in memory: this stops accidents and naive cheating, not a
determined adversary.)

Test snippet conventions: Python, JavaScript and Bash take statements (assert ...; `assert` is node's
module in JS; a Bash test passes when its last command succeeds); C, C++ and Java take boolean expressions.
In tests mode C/C++ code must not define main and Java code must not declare `class Main`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
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


def _py_harness(code: str, tests: list[str], nonce: str) -> Files:
    main = f"""import os, sys, traceback
os.unlink(__file__)
_N, _T = {nonce!r}, {tests!r}
_g = {{"__name__": "solution", "__builtins__": __builtins__}}
with open("solution.py") as _f:
    exec(compile(_f.read(), "solution.py", "exec"), _g)
for _i, _src in enumerate(_T):
    try:
        exec(compile(_src, "test%d" % _i, "exec"), _g)
        _ok = True
    except BaseException:
        _ok = False
        traceback.print_exc()
    sys.stdout.flush()
    print(_N, _i, "pass" if _ok else "fail", flush=True)
"""
    return {"solution.py": code, "main.py": main}


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


_C_RUN = ("./prog",)
LANGUAGES: dict[str, Language] = {
    "python": Language("python", "main.py", None, ("python3", "main.py"), _py_harness),
    "javascript": Language("javascript", "main.js", None, ("node", "main.js"), _js_harness),
    "bash": Language("bash", "main.sh", None, ("bash", "main.sh"), _bash_harness),
    "c": Language("c", "main.c", ("gcc", "-O2", "-std=gnu11", "-o", "prog", "main.c", "-lm"), _C_RUN,
                  _c_like_harness("c", "#include <stdio.h>", guarded=False)),
    "cpp": Language("cpp", "main.cpp", ("g++", "-O2", "-std=gnu++17", "-o", "prog", "main.cpp"), _C_RUN,
                    _c_like_harness("cpp", "#include <cstdio>", guarded=True)),
    "java": Language("java", "Main.java", ("javac", "-encoding", "UTF-8", "-d", ".", "JAVA_SOURCES"),
                     ("java", "-cp", ".", "Main"), _java_harness, jvm=True),
}
ALIASES = {"py": "python", "python3": "python", "js": "javascript", "node": "javascript", "sh": "bash",
           "c++": "cpp", "cxx": "cpp"}


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
    if lang.jvm:
        java_files = sorted(f for f in files if f.endswith(".java") and "/" not in f)
        if "JAVA_SOURCES" in cmd:
            i = cmd.index("JAVA_SOURCES")
            cmd[i:i + 1] = java_files
            cmd[1:1] = ["-J" + f for f in jvm_flags(memory_mb)]
        else:
            cmd[1:1] = jvm_flags(memory_mb)
    return cmd
