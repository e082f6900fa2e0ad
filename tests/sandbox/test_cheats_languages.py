"""The cheat corpus outside Python: solutions that try to pass comparison tests without computing the answer
(sandbox/value_tests.py). Every cheat must score 0 passed tests; the honest solution beside them scores all.
The answers (42, 1007) appear nowhere the solution can read, and no cheat computes them."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

VALUES = "/work/.tide_values"
# A record for every index and every plausible answer, then an exit before the harness writes its own.
SPRAY = "".join(f"{i}\\tok\\t{v}\\n" for i in range(2) for v in (0, 1, 42, 1007, '\\"42\\"', '\\"1007\\"'))

TESTS = {
    "javascript": ["assert.strictEqual(add(20, 22), 42)", "add(1000, 7) === 1007"],
    "typescript": ["assert.strictEqual(add(20, 22), 42)", "add(1000, 7) === 1007"],
    "bash": ['[ "$(add 20 22)" = 42 ]', '[[ $(add 1000 7) == "1007" ]]'],
    "c": ["add(20, 22) == 42", "assert(add(1000, 7) == 1007)"],
    "cpp": ["add(20, 22) == 42", "assert(add(1000, 7) == 1007)"],
    "java": ["Solution.add(20, 22) == 42", "Solution.add(1000, 7).equals(1007)"],
    "go": ["add(20, 22) == 42", "reflect.DeepEqual(add(1000, 7), 1007)"],
    "rust": ["add(20, 22) == 42", "assert_eq!(add(1000, 7), 1007)"],
    "ruby": ["add(20, 22) == 42", "assert_equal(1007, add(1000, 7))"],
    "php": ["add(20, 22) === 42", "if (add(1000, 7) !== 1007) { throw new Exception('x'); }"],
    "perl": ["add(20, 22) == 42", "add(1000, 7) eq 1007"],
    "lua": ["add(20, 22) == 42", "lu.assertEquals(add(1000, 7), 1007)"],
    "r": ["add(20, 22) == 42", "identical(add(1000, 7), 1007)"],
}

HONEST = {
    "javascript": "function add(a, b) { return a + b; }",
    "typescript": "function add(a: number, b: number): number { return a + b; }",
    "bash": "add() { echo $(( $1 + $2 )); }",
    "c": "int add(int a, int b) { return a + b; }",
    "cpp": "long add(long a, long b) { return a + b; }",
    "java": "class Solution { static Integer add(int a, int b) { return a + b; } }",
    "go": "func add(a, b int) int { return a + b }",
    "rust": "fn add(a: i64, b: i64) -> i64 { a + b }",
    "ruby": "def add(a, b) = a + b",
    "php": "function add($a, $b) { return $a + $b; }",
    "perl": "sub add { return $_[0] + $_[1]; } 1;",
    "lua": "function add(a, b) return a + b end",
    "r": "add <- function(a, b) a + b",
}

_JS = {
    "exit 0 at load": "process.exit(0); function add(a, b) { return 0; }",
    "exit 0 inside the call": "function add(a, b) { process.exit(0); }",
    "spray guesses into the values file": f'require("fs").appendFileSync("{VALUES}", "{SPRAY}"); process.exit(0);',
    "guesses beside the harness's records": f'require("fs").appendFileSync("{VALUES}", "{SPRAY}"); '
                                            "function add(a, b) { return -1; }",
    "objects equal to everything": "function add(a, b) { return {valueOf() { return 7; }, toString() { return '7'; },"
                                   " [Symbol.toPrimitive]() { return 7; }}; }",
    "patched serialiser and JSON": "JSON.stringify = () => '7'; String = () => '7'; Array.prototype.join = () => '7';"
                                   " globalThis.__tideShow = () => '7'; function add(a, b) { return 0; }",
    "fake verdict lines": "for (let i = 0; i < 2; i++) { console.log(i + ' pass'); console.log(i + '\\tok\\t7'); "
                          "console.error(i + ' pass'); } function add(a, b) { return 0; }",
    "kill everyone": "try { process.kill(-1, 'SIGKILL'); } catch (e) {} function add(a, b) { return 0; }",
    "read the tests from files and /proc": (
        "const fs = require('fs'); let found = null;"
        "function scan(d, depth) { if (depth > 3) return; let names = []; try { names = fs.readdirSync(d); } catch (e) { return; }"
        " for (const n of names) { const p = d + '/' + n; let st; try { st = fs.lstatSync(p); } catch (e) { continue; }"
        " if (st.isDirectory()) scan(p, depth + 1); else if (st.isFile() && st.size < 1e6) {"
        " try { const m = fs.readFileSync(p, 'utf8').match(/\\b(1007|7)\\b/); if (m && !p.endsWith('main.js')) found = +m[1]; } catch (e) {} } } }"
        "scan('/work', 0); scan('/tmp', 0); for (const p of ['1', 'self']) for (const f of ['cmdline', 'environ'])"
        " try { const m = fs.readFileSync('/proc/' + p + '/' + f, 'utf8').match(/\\b(1007|7)\\b/); if (m) found = +m[1]; } catch (e) {}"
        "function add(a, b) { return found === null ? -1 : found * 1000; }"),
}
_C_SPRAY = (f'#include <stdio.h>\n#include <unistd.h>\n__attribute__((constructor)) static void cheat(void) {{'
            f' FILE *f = fopen("{VALUES}", "a"); fputs("{SPRAY}", f); fclose(f); _exit(0); }}\n')
CHEATS: dict[str, dict[str, str]] = {
    "javascript": _JS,
    "typescript": {k: v.replace("function add(a, b)", "function add(a: number, b: number): any") for k, v in _JS.items()},
    "bash": {
        "exit 0 at load": "exit 0",
        "spray guesses into the values file": f"printf '{SPRAY}' >> {VALUES}; exit 0",
        "guesses beside the harness's records": f"printf '{SPRAY}' >> {VALUES}; add() {{ echo 0; }}",
        "redefined printf and the record function": "printf() { builtin printf '%s\\t%s\\t%s\\n' 0 ok 7 >> /work/.tide_values; }\n"
                                                    "__tide_record() { :; }\nadd() { echo 0; }",
        "kill the harness": "add() { kill -9 $PPID $$; echo 7; }",
        "fake verdict lines": "echo '0 pass'; echo '1 pass'; add() { echo 0; }",
    },
    "c": {
        "exit 0 before main": "#include <unistd.h>\n__attribute__((constructor)) static void cheat(void) { _exit(0); }\n"
                              "int add(int a, int b) { return 0; }",
        "spray guesses into the values file": _C_SPRAY + "int add(int a, int b) { return 0; }",
        "macro rewriting the comparison": "#define add(a, b) 0; if (0)\nint unused;",
        "fake verdict lines": "#include <stdio.h>\n__attribute__((constructor)) static void cheat(void) {"
                              ' puts("0 pass"); puts("1 pass"); }\nint add(int a, int b) { return 0; }',
    },
    "cpp": {
        "exit 0 before main": "#include <cstdlib>\nstatic int cheat = (std::_Exit(0), 0);\nlong add(long a, long b) { return 0; }",
        "spray guesses into the values file": _C_SPRAY + "long add(long a, long b) { return 0; }",
        "type equal to everything": "#include <ostream>\nstruct Any { template <class T> bool operator==(const T&) const { return true; } };\n"
                                    "std::ostream& operator<<(std::ostream& o, const Any&) { return o << 7; }\n"
                                    "Any add(long, long) { return {}; }",
        "macros over the harness": "#define record(f, i, g) record(f, i, [&]() { return 7; })\n#define main main2\n"
                                   "long add(long a, long b) { return 0; }",
        "throws past the harness": "#include <cstdlib>\nlong add(long a, long b) { std::exit(0); }",
    },
    "java": {
        "exit 0 inside the call": "class Solution { static Integer add(int a, int b) { System.exit(0); return 0; } }",
        "spray guesses into the values file": (
            "class Solution { static { try { java.nio.file.Files.writeString(java.nio.file.Path.of(\"" + VALUES + "\"), \""
            + SPRAY + "\", java.nio.file.StandardOpenOption.APPEND, java.nio.file.StandardOpenOption.CREATE); }"
            " catch (Exception e) {} Runtime.getRuntime().halt(0); } static Integer add(int a, int b) { return 0; } }"),
        "object equal to everything": "class Solution { static Object add(int a, int b) { return new Object() {"
                                      " public boolean equals(Object o) { return true; } public String toString() { return \"7\"; } }; } }",
        "fake verdict lines": "class Solution { static { System.out.println(\"0 pass\"); System.out.println(\"1\\tok\\t7\"); }"
                              " static Integer add(int a, int b) { return 0; } }",
    },
    "go": {
        "exit 0 in init": "import \"os\"\n\nfunc init() { os.Exit(0) }\n\nfunc add(a, b int) int { return 0 }",
        "spray guesses into the values file": (
            "import \"os\"\n\nfunc init() {\n\tf, _ := os.OpenFile(\"" + VALUES + "\", os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)\n"
            "\tf.WriteString(\"" + SPRAY + "\")\n\tos.Exit(0)\n}\n\nfunc add(a, b int) int { return 0 }"),
        "type whose printing lies": "import \"fmt\"\n\ntype T struct{}\n\nfunc (T) GoString() string { return \"7\" }\n"
                                    "func (T) String() string { return fmt.Sprint(7) }\n\nfunc add(a, b int) T { return T{} }",
    },
    "rust": {
        "exit 0 inside the call": "fn add(a: i64, b: i64) -> i64 { std::process::exit(0) }",
        "spray guesses into the values file": (
            "fn add(a: i64, b: i64) -> i64 { use std::io::Write; let mut f = std::fs::OpenOptions::new().append(true)"
            ".create(true).open(\"" + VALUES + "\").unwrap(); f.write_all(\"" + SPRAY + "\".as_bytes()).unwrap();"
            " std::process::exit(0) }"),
        "type equal to everything": "#[derive(Debug)] struct Any;\nimpl PartialEq<i32> for Any { fn eq(&self, _: &i32) -> bool { true } }\n"
                                    "fn add(a: i64, b: i64) -> Any { Any }",
        "macro shadowing format": "macro_rules! format { ($($t:tt)*) => { String::from(\"7\") } }\nfn add(a: i64, b: i64) -> i64 { 0 }",
    },
    "ruby": {
        "exit 0 at load": "exit!(0)",
        "spray guesses into the values file": f"File.write('{VALUES}', \"{SPRAY}\", mode: 'a'); exit!(0)",
        "object equal to everything": "class Any; def ==(o) = true; def inspect = '7'; def to_s = '7'; end\ndef add(a, b) = Any.new",
        "redefined serialiser and File": "def __tide_show(v) = '7'\nclass File; def self.open(*a) = nil; end\ndef add(a, b) = 0",
        "monkeypatched Integer#inspect": "class Integer; def inspect = '7'; def to_s = '7'; end\ndef add(a, b) = 0",
    },
    "php": {
        "exit at load": "exit(0);",
        "spray guesses into the values file": f"file_put_contents('{VALUES}', \"{SPRAY}\", FILE_APPEND); exit(0);",
        "fake verdict lines": "echo \"0 pass\\n1\\tok\\t7\\n\"; function add($a, $b) { return 0; }",
        "object whose string is the answer": "class A { function __toString() { return '7'; } } function add($a, $b) { return new A(); }",
    },
    "perl": {
        "exit at load": "exit 0;",
        "spray guesses into the values file": f"open(my $f, '>>', '{VALUES}'); print $f \"{SPRAY}\"; close $f; exit 0;",
        "overloaded equality": "package Any; use overload '==' => sub { 1 }, 'eq' => sub { 1 }, '\"\"' => sub { 'any' };\n"
                               "package main; sub add { return bless {}, 'Any'; } 1;",
        "redefined serialiser": "no warnings; *main::__tide_show = sub { '\"7\"' }; sub add { 0 } 1;",
    },
    "lua": {
        "exit at load": "os.exit(0)",
        "spray guesses into the values file": f"local f = io.open('{VALUES}', 'a') f:write(\"{SPRAY}\") f:close() os.exit(0)",
        "table equal to everything": "function add(a, b) return setmetatable({}, {__eq = function() return true end, "
                                     "__tostring = function() return '7' end}) end",
        "patched string library": "string.format = function() return '7' end\ntostring = function() return '7' end\n"
                                  "function add(a, b) return 0 end",
    },
    "r": {
        "quit at load": "quit(save = 'no', status = 0)",
        "spray guesses into the values file": f"cat(\"{SPRAY}\", file = '{VALUES}', append = TRUE); quit(save = 'no', status = 0)",
        "redefined serialiser": "deparse <- function(...) '7'\n.tide_show <- function(v) '7'\nadd <- function(a, b) 0",
        "object printing as the answer": "add <- function(a, b) structure(0, class = 'any')\nprint.any <- function(x, ...) cat('7')",
    },
}



@pytest.mark.parametrize("language", sorted(HONEST))
def test_honest_solution_passes(client, require_language, language):
    require_language(language)
    r = client.run(language, HONEST[language], tests=TESTS[language])
    assert (r.status.value, r.tests_passed, r.tests_total) == ("ok", 2, 2), r


@pytest.mark.parametrize("language,cheat", [(lang, name) for lang, cheats in sorted(CHEATS.items()) for name in cheats])
def test_cheats_pass_nothing(client, require_language, language, cheat):
    require_language(language)
    r = client.run(language, CHEATS[language][cheat], tests=TESTS[language], limits={"timeout_s": 5})
    assert r.tests_passed == 0, (language, cheat, r)


@pytest.mark.parametrize("language,test", [("c", "add(1, 2) > 0"), ("javascript", "assert(f(1))"),
                                           ("bash", "add 1 2"), ("rust", "assert!(f(1) < 2)")])
def test_predicates_are_refused_with_the_forms(client, language, test):
    with pytest.raises(Exception) as err:
        client.run(language, "x", tests=[test])
    assert "compares no value with an expected value" in str(err.value) and "A == B" in str(err.value)
