"""Each language: plain run with stdin, the tests harness, compile errors, extra files."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]

ADD = {  # each: one test passes, one fails, one more passes (outside Python: a comparison of a richer value)
    "python": ("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "print('noise')"]),
    "javascript": ("function add(a, b) { return a + b; }",
                   ["assert.strictEqual(add(1, 2), 3)", "assert.deepEqual(add(2, 2), 5)",
                    "assert.deepEqual([add(1, 1), {b: 1, a: 'x\\n'}, new Set([2, 1])], [2, {a: 'x\\n', b: 1}, new Set([1, 2])])"]),
    "typescript": ("function add(a: number, b: number): number { return a + b; }",
                   ["assert.strictEqual(add(1, 2), 3)", "assert.strictEqual(add(2, 2), 5)", "(add(0, 0) as number) === 0"]),
    "bash": ("add() { echo $(( $1 + $2 )); }", ['[ "$(add 1 2)" = 3 ]', '[ "$(add 2 2)" = 5 ]', '[[ $(add 0 0) == "0" ]]']),
    "c": ("int add(int a, int b) { return a + b; }\nconst char *hi(void) { return \"a\\\"b\"; }",
          ["add(1, 2) == 3", "add(2, 2) == 5", "hi() == \"a\\\"b\""]),
    "cpp": ("#include <stdexcept>\n#include <vector>\n#include <map>\n"
            "int add(int a, int b) { if (a < -5) throw std::runtime_error(\"neg\"); return a + b; }\n"
            "std::map<long, std::vector<std::string>> m() { return {{2, {\"b\"}}, {1, {\"a\"}}}; }",
            ["add(1, 2) == 3", "add(-9, 0) == -9",
             "assert(m() == (std::map<long, std::vector<std::string>>({{1, {\"a\"}}, {2, {\"b\"}}})))"]),
    "java": ("import java.util.*;\nclass Solution { static int add(int a, int b) { return a + b; }\n"
             "  static List<Long> two(long a) { return new ArrayList<>(List.of(a, a)); } }",
             ["Solution.add(1, 2) == 3", "Solution.add(2, 2) == 5",
              "Solution.two(3).equals(new ArrayList<Long>(Arrays.asList((long)3, (long)3)))"]),
    "go": ("func add(a, b int) int { return a + b }\nfunc two(a int) []int { return []int{a, a} }",
           ["add(1, 2) == 3", "add(2, 2) == 5", "reflect.DeepEqual(two(3), []int{3, 3})"]),
    "rust": ("fn add(a: i64, b: i64) -> i64 { if a < -5 { panic!(\"neg\") } a + b }\nfn two(a: i64) -> Vec<i64> { vec![a, a] }",
             ["add(1, 2) == 3", "add(-9, 0) == -9", "assert_eq!(two(3), vec![3, 3])"]),
    "ruby": ("def add(a, b) = a + b", ["add(1, 2) == 3", "add(2, 2) == 5",
                                     "assert_equal({b: 1, a: [2.0]}, {a: [add(1, 1)], b: 1})"]),
    "php": ("function add($a, $b) { return $a + $b; }",
            ["add(1, 2) == 3", "add(2, 2) == 5", "if (add(0, 0) !== 0) { throw new Exception('x'); }"]),
    "perl": ("sub add { my ($a, $b) = @_; return $a + $b; } sub two { return [$_[0], {k => $_[0]}]; } 1;",
             ["add(1, 2) == 3", "add(2, 2) == 5", "is_deeply(two(3), [3, {k => 3}])"]),
    "lua": ("function add(a, b) return a + b end", ["add(1, 2) == 3", "add(2, 2) == 5",
                                                   "lu.assertEquals({add(0, 0), 2.0, x = 'y'}, {0, 2, x = 'y'})"]),
    "r": ("add <- function(a, b) a + b", ["add(1, 2) == 3", "add(0.1, 0.2) == 0.3",
                                          "if(!identical(add(c(a = 1), 2), c(a = 3))) {quit('no', 1)}"]),
}
CAT = {
    "python": "import sys\nprint(sys.stdin.read().upper(), end='')",
    "javascript": "process.stdout.write(require('fs').readFileSync(0, 'utf8').toUpperCase())",
    "bash": "tr a-z A-Z",
    "c": "#include <stdio.h>\n#include <ctype.h>\nint main(){int c; while((c=getchar())!=EOF) putchar(toupper(c));}",
    "cpp": "#include <iostream>\n#include <cctype>\nint main(){char c; while(std::cin.get(c)) std::cout << (char)std::toupper(c);}",
    "java": ("import java.io.*;\npublic class Main { public static void main(String[] a) throws IOException {"
             " System.out.print(new String(System.in.readAllBytes()).toUpperCase()); } }"),
    "go": ("package main\nimport (\"io\"; \"os\"; \"strings\")\n"
           "func main() { b, _ := io.ReadAll(os.Stdin); os.Stdout.WriteString(strings.ToUpper(string(b))) }"),
    "rust": ("use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s)"
             ".unwrap(); print!(\"{}\", s.to_uppercase()); }"),
    "ruby": "print $stdin.read.upcase",
    "php": "<?php echo strtoupper(stream_get_contents(STDIN));",
    "perl": "print uc(join('', <STDIN>));",
    "lua": "io.write(string.upper(io.read('a')))",
    "r": "writeLines(toupper(readLines(file('stdin'))))",
    "typescript": "const s: string = require('fs').readFileSync(0, 'utf8'); process.stdout.write(s.toUpperCase());",
}



@pytest.mark.parametrize("language", sorted(ADD))
def test_tests_harness(client, require_language, language):
    require_language(language)
    code, tests = ADD[language]
    r = client.run(language, code, tests=tests)
    assert r.status.value == "ok", r
    assert (r.tests_passed, r.tests_total) == (2, 3), r


@pytest.mark.parametrize("language", sorted(CAT))
def test_stdin_roundtrip(client, require_language, language):
    require_language(language)
    r = client.run(language, CAT[language], stdin="hello sandbox\n")
    assert r.status.value == "ok", r
    assert r.stdout == "HELLO SANDBOX\n"
    assert r.exit_code == 0 and r.wall_ms > 0 and r.cpu_ms > 0 and r.peak_memory_kb > 0


@pytest.mark.parametrize("language,code", [("c", "int main( { return 0; }"), ("cpp", "int main() { return x; }"),
                                           ("java", "public class Main { void f( }")])
def test_compile_error(client, language, code):
    r = client.run(language, code)
    assert r.status.value == "compile_error", r
    assert r.compile_output and "error" in r.compile_output


def test_runtime_error_and_exit_code(client):
    r = client.run("python", "import sys\nprint('out')\nsys.exit(7)")
    assert (r.status.value, r.exit_code, r.stdout) == ("runtime_error", 7, "out\n")
    r = client.run("python", "raise ValueError('boom')")
    assert r.status.value == "runtime_error" and "ValueError: boom" in r.stderr


def test_extra_files_and_fake_verdicts(client):
    r = client.run("python", "import helper\nprint(helper.X)\nprint(open('data/in.txt').read())",
                   files={"helper.py": "X = 41 + 1", "data/in.txt": "payload"})
    assert r.status.value == "ok" and r.stdout == "42\npayload\n", r
    # A program that prints verdict-looking lines cannot raise its own score.
    r = client.run("python", "print('0 0 pass')\nprint('x 1 pass')", tests=["assert False", "assert False"])
    assert (r.tests_passed, r.tests_total) == (0, 2), r


def test_top_level_error_with_tests(client):
    r = client.run("python", "raise SystemExit(3)", tests=["assert True"])
    assert r.status.value == "runtime_error" and r.tests_passed == 0


def test_debian_rootfs_image(client):
    if "debian" not in client.health().images:
        pytest.skip("no rootfs built (scripts/build_sandbox_rootfs.sh /var/lib/tide-sandbox/rootfs python3)")
    r = client.run("python", "import os\nprint(os.path.exists('/.tide-rootfs'), os.getuid())", image="debian",
                   tests=["assert 1 + 1 == 2"])
    assert (r.status.value, r.stdout, r.tests_passed) == ("ok", "True 65534\n", 1), r
