"""Judge mode: a program run once per stdin/stdout case inside one container, compiled once, with a verdict per
case (AC, WA, TLE, MLE, RE, OLE) decided by the trusted driver, and checkers for exact, token and float output."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

CASES = [{"stdin": f"{a} {b}\n", "expected_stdout": f"{a + b}\n"} for a, b in zip(range(20), range(5, 25))]
A_PLUS_B = {
    "python": "a, b = map(int, input().split())\nprint(a + b)",
    "cpp": "#include <cstdio>\nint main(){long a,b; scanf(\"%ld %ld\",&a,&b); printf(\"%ld\\n\", a+b);}",
    "java": ("import java.util.*;\npublic class Main { public static void main(String[] x) {"
             " Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); } }"),
    "javascript": "const [a, b] = require('fs').readFileSync(0, 'utf8').split(/\\s+/).map(Number); console.log(a + b)",
    "bash": "read a b; echo $((a + b))",
    "c": "#include <stdio.h>\nint main(){long a,b; scanf(\"%ld %ld\",&a,&b); printf(\"%ld\\n\", a+b); return 0;}",
    "go": "package main\nimport \"fmt\"\nfunc main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }",
    "rust": ("use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();"
             " let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect(); println!(\"{}\", v[0] + v[1]); }"),
    "ruby": "a, b = gets.split.map(&:to_i)\nputs a + b",
    "php": "<?php [$a, $b] = array_map('intval', explode(' ', trim(fgets(STDIN)))); echo $a + $b, \"\\n\";",
    "perl": "my ($a, $b) = split ' ', <STDIN>; print $a + $b, \"\\n\";",
    "lua": "local a, b = io.read('n', 'n')\nprint(math.tointeger(a + b))",
    "r": "x <- scan(file('stdin'), quiet = TRUE)\ncat(x[1] + x[2], '\\n', sep = '')",
    "typescript": "const [a, b]: number[] = require('fs').readFileSync(0, 'utf8').split(/\\s+/).map(Number); console.log(a + b);",
}


@pytest.mark.parametrize("language", sorted(A_PLUS_B))
def test_every_language_is_judged_per_case(client, require_language, language):
    require_language(language)
    r = client.run(language, A_PLUS_B[language], cases=CASES)
    assert r.status.value == "ok", r
    assert (r.cases_passed, r.cases_total, len(r.cases)) == (20, 20, 20), r
    assert all(c.verdict.value == "AC" and c.exit_code == 0 and c.wall_ms > 0 for c in r.cases)


def test_each_verdict(client):
    code = ("import sys\na, b = map(int, input().split())\n"
            "if a == 1: print(a + b + 1)\n"                      # WA
            "elif a == 2:\n    while True: pass\n"                # TLE
            "elif a == 3: sys.exit(4)\n"                          # RE
            "elif a == 4:\n    while True: print('y' * 1000)\n"   # OLE
            "elif a == 5: x = bytearray(400 << 20)\n"             # MLE
            "else: print(a + b)")
    r = client.run("python", code, cases=CASES[:7], limits={"timeout_s": 1, "memory_mb": 128, "output_kb": 64})
    assert r.status.value == "ok", r
    assert [c.verdict.value for c in r.cases] == ["AC", "WA", "TLE", "RE", "OLE", "MLE", "AC"], r.cases
    assert r.cases[3].exit_code == 4 and r.cases_passed == 2
    stop = client.run("python", code, cases=CASES[:7], stop_on_first_failure=True)
    assert [c.verdict.value for c in stop.cases] == ["AC", "WA"] and stop.cases_total == 7


def test_checkers(client):
    cases = [{"stdin": "", "expected_stdout": "0.3333333 1 ok\n"}]
    loose = "print('0.33333334   1\\nok')"
    assert client.run("python", loose, cases=cases).cases[0].verdict.value == "WA"
    assert client.run("python", loose, cases=cases, checker={"kind": "tokens"}).cases[0].verdict.value == "WA"
    assert client.run("python", loose, cases=cases,
                      checker={"kind": "float", "abs_tol": 1e-6}).cases[0].verdict.value == "AC"
    trailing = client.run("python", "print('0.3333333 1 ok   ')\nprint()", cases=cases)
    assert trailing.cases[0].verdict.value == "AC"  # exact ignores trailing spaces and blank lines


def test_compile_once_and_compile_errors(client):
    r = client.run("cpp", "int main( {", cases=CASES[:3])
    assert r.status.value == "compile_error" and (r.cases_passed, r.cases_total) == (0, 3)


JUDGE_CHEATS = {
    "fake report lines": "import uuid\nfor _ in range(50):\n    print(uuid.uuid4().hex, '{\"cases\": "
                         "[{\"verdict\": \"AC\"}]}')",
    "signal the driver": "import os, signal\nfor s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):\n"
                         "    try: os.kill(1, s)\n    except OSError: pass\nprint(0)",
    "write to the driver's stdout": "for p in ('/proc/1/fd/1', '/proc/1/fd/2'):\n    try: open(p, 'w').write('x')\n"
                                    "    except OSError: print('denied')",
    "read the driver's memory": "import re\ntry:\n    data = open('/proc/1/mem', 'rb').read()\nexcept OSError:\n"
                                "    print('denied')",
    "a daemon that answers later": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(0.5)\n"
                                   "    print('5', flush=True)\n    os._exit(0)\nprint('nope')",
    "leave an answer file": "import glob\nopen('/work/.tide_judge.json', 'w').write('{}')\n"
                            "print(open(glob.glob('/proc/1/cwd/*')[0]).read() if glob.glob('/proc/1/cwd/*') else 0)",
}


@pytest.mark.parametrize("cheat", sorted(JUDGE_CHEATS))
def test_judge_cheats_pass_nothing(client, cheat):
    r = client.run("python", JUDGE_CHEATS[cheat], cases=CASES[:4], limits={"timeout_s": 2})
    assert r.cases_passed == 0 and r.cases_total == 4, (cheat, r)
