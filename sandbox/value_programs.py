"""The programs of tests mode outside Python (sandbox/value_tests.py): for each language, a program that
evaluates a list of expressions -- after loading the solution, or without one for the expected values -- and
appends `<index>\\t<ok|err>\\t<text>` per expression to a values file. The texts come from the serialisers in
sandbox/harness/show/, which both sides share."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

Files = dict[str, str]
Program = Callable[[str | None, list[str], str], Files]

_SHOW = {p.name: p.read_text() for p in Path(__file__).with_name("harness").joinpath("show").iterdir()}


def _q(s: str) -> str:
    """A string literal that JavaScript, C, C++, Java, Go, Rust, PHP (double quotes), Perl, Lua, R and Ruby
    all read back as `s` (the values path: plain ASCII)."""
    assert re.fullmatch(r"[\w./-]+", s), s
    return json.dumps(s)


def javascript(code: str | None, exprs: list[str], path: str, main: str = "main.js") -> Files:
    # The serialiser goes last (function declarations are hoisted) so the solution's line numbers are its own.
    body = "".join(f"__tideRecord({_q(path)}, {i}, () => ({e}));\n" for i, e in enumerate(exprs))
    return {main: (code or "") + "\n;\n" + body + _SHOW["show.js"]}


def typescript(code: str | None, exprs: list[str], path: str) -> Files:
    return javascript(code, exprs, path, main="main.ts")


def bash(code: str | None, exprs: list[str], path: str) -> Files:
    lines = [_SHOW["show.sh"], "source ./solution.sh" if code is not None else ""]
    lines += [f"( __tide_v={e}\n__tide_record {_q(path)} {i} \"$__tide_v\" )" for i, e in enumerate(exprs)]
    return {**({"solution.sh": code} if code is not None else {}), "main.sh": "\n".join(lines) + "\n"}


def _c_family(show: str, solution: str, code: str | None, opening: str, records: list[str]) -> str:
    """C's or C++'s program: the serialiser, the solution (its errors on its own lines of `solution`), then main:
    `opening` (which opens the values file, exit status 3 where it cannot) and a record statement per expression."""
    return (_SHOW[show] + f'#line 1 "{solution}"\n' + (code or "") + '\n#line 1 "tests"\n' + opening
            + "".join(f"  {r}\n" for r in records) + "  return 0;\n}\n")


def c(code: str | None, exprs: list[str], path: str) -> Files:
    opening = f"int main(void) {{\n  tide_values = fopen({_q(path)}, \"a\");\n  if (!tide_values) return 3;\n"
    records = [f"TIDE_RECORD({i}, {e});" for i, e in enumerate(exprs)]
    return {"main.c": _c_family("show.h", "solution.c", code, opening, records)}


def cpp(code: str | None, exprs: list[str], path: str) -> Files:
    # `signed main`: competitive-programming solutions often `#define int long long`
    opening = f"signed main() {{\n  std::FILE* tide_f = std::fopen({_q(path)}, \"a\");\n  if (!tide_f) return 3;\n"
    records = [f"tide_show::record(tide_f, {i}, [&]() {{ return {e}; }});" for i, e in enumerate(exprs)]
    return {"main.cpp": _c_family("show.hpp", "solution.cpp", code, opening, records)}


_JAVA_IMPORTS = "import java.util.*;\nimport java.util.function.*;\nimport java.util.stream.*;\nimport java.math.*;\n"


def java(code: str | None, exprs: list[str], path: str) -> Files:
    body = "".join(f"    TideShow.record({_q(path)}, {i}, () -> ({e}));\n" for i, e in enumerate(exprs))
    main = (_JAVA_IMPORTS + "public class Main {\n  public static void main(String[] args) {\n" + body + "  }\n}\n")
    return {**({"Solution.java": code} if code is not None else {}), "Main.java": main,
            "TideShow.java": _SHOW["TideShow.java"]}


_GO_PACKAGES = ("strings", "math", "sort", "strconv", "reflect", "unicode", "bytes")


def go(code: str | None, exprs: list[str], path: str) -> Files:
    used = sorted(p for p in _GO_PACKAGES if any(re.search(rf"\b{p}\.", e) for e in exprs))
    imports = "".join(f'\t"{p}"\n' for p in ["fmt", "os", *used])
    body = "".join(f"\ttideRecord(f, {i}, func() interface{{}} {{ return {e} }})\n" for i, e in enumerate(exprs))
    main = (f"package main\n\nimport (\n{imports})\n\n"
            "func tideRecord(f *os.File, i int, get func() interface{}) {\n"
            '\tstatus, text := "ok", ""\n'
            "\tfunc() {\n\t\tdefer func() {\n\t\t\tif r := recover(); r != nil {\n"
            '\t\t\t\tstatus, text = "err", ""\n\t\t\t\tfmt.Fprintln(os.Stderr, "test", i, "panicked:", r)\n'
            "\t\t\t}\n\t\t}()\n"
            '\t\ttext = fmt.Sprintf("%#v", get())\n\t}()\n'
            '\tfmt.Fprintf(f, "%d\\t%s\\t%s\\n", i, status, text)\n}\n\n'
            f"func main() {{\n\tf, err := os.OpenFile({_q(path)}, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)\n"
            f"\tif err != nil {{\n\t\tpanic(err)\n\t}}\n{body}}}\n")
    return {**({"solution.go": code} if code is not None else {}), "main.go": main}


def rust(code: str | None, exprs: list[str], path: str) -> Files:
    body = "".join(f"    tide_record({i}, || format!(\"{{:?}}\", {e}));\n" for i, e in enumerate(exprs))
    src = ((code or "") + "\n\n#[allow(unused_imports, unused_variables, unused_mut, unused_parens)]\nfn main() {\n"
           + body + "}\n\n"
           "fn tide_record(i: usize, get: impl FnOnce() -> String + std::panic::UnwindSafe) {\n"
           "    use std::io::Write;\n"
           "    let line = match std::panic::catch_unwind(get) {\n"
           '        Ok(text) => format!("{}\\tok\\t{}\\n", i, text),\n'
           '        Err(_) => format!("{}\\terr\\t\\n", i),\n    };\n'
           f"    std::fs::OpenOptions::new().append(true).create(true).open({_q(path)})\n"
           '        .and_then(|mut f| f.write_all(line.as_bytes())).expect("tide: the values file");\n}\n')
    return {"main.rs": src}


def _script(source: str, main: str, show: str, load: str, record: str) -> Program:
    """A scripting language: the serialiser, then the solution loaded from its own file, then one record per
    expression (`record` with placeholders {path}, {i} and {e})."""
    def build(code: str | None, exprs: list[str], path: str) -> Files:
        lines = [_SHOW[show], load if code is not None else ""]
        lines += [record.format(path=_q(path), i=i, e=e) for i, e in enumerate(exprs)]
        return {**({source: code} if code is not None else {}), main: "\n".join(lines) + "\n"}
    return build


ruby = _script("solution.rb", "main.rb", "show.rb", "require_relative 'solution'",
               "__tide_record({path}, {i}) {{ ({e}) }}")
php = _script("solution.php", "main.php", "show.php", "require 'solution.php';",
              "__tide_record({path}, {i}, function () {{ return ({e}); }});")
perl = _script("solution.pl", "main.pl", "show.pl", "do './solution.pl';\nprint STDERR $@ if $@;",
               "__tide_record({path}, {i}, sub {{ scalar({e}) }});")
lua = _script("solution.lua", "main.lua", "show.lua", "dofile('solution.lua')",
              "__tide_record({path}, {i}, function() return ({e}) end)")
r = _script("solution.R", "main.R", "show.R", "source('solution.R')", ".tide_record({path}, {i}, function() ({e}))")

PROGRAMS: dict[str, Program] = {"javascript": javascript, "typescript": typescript, "bash": bash, "c": c,
                                "cpp": cpp, "java": java, "go": go, "rust": rust, "ruby": ruby, "php": php,
                                "perl": perl, "lua": lua, "r": r}
