"""SandboxFusion compatibility: its PyPI client (`sandbox-fusion`, sync and async) against `tide-sandbox serve`,
in every language both name, with the statuses and outputs SandboxFusion documents."""
from __future__ import annotations

import asyncio
import base64

import pytest

TOKEN = "test-token"  # the session service's (conftest.py)

sandbox_fusion = pytest.importorskip("sandbox_fusion")
from sandbox_fusion import (RunCodeRequest, RunJupyterRequest, run_code, run_code_async,  # noqa: E402
                            run_jupyter)

pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

UPPER = {
    "python": "import sys\nprint(sys.stdin.read().upper(), end='')",
    "nodejs": "process.stdout.write(require('fs').readFileSync(0, 'utf8').toUpperCase())",
    "bash": "tr a-z A-Z",
    "cpp": "#include <iostream>\n#include <cctype>\nint main(){char c; while(std::cin.get(c)) std::cout << (char)std::toupper(c);}",
    "java": ("import java.io.*;\npublic class Main { public static void main(String[] a) throws IOException {"
             " System.out.print(new String(System.in.readAllBytes()).toUpperCase()); } }"),
    "go": ("package main\nimport (\"io\"; \"os\"; \"strings\")\n"
           "func main() { b, _ := io.ReadAll(os.Stdin); os.Stdout.WriteString(strings.ToUpper(string(b))) }"),
    "rust": ("use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s)"
             ".unwrap(); print!(\"{}\", s.to_uppercase()); }"),
    "ruby": "print $stdin.read.upcase",
    "php": "echo strtoupper(stream_get_contents(STDIN));",  # SandboxFusion adds the open tag where it is missing
    "perl": "print uc(join('', <STDIN>));",
    "lua": "io.write(string.upper(io.read('a')))",
    "R": "writeLines(toupper(readLines(file('stdin'))))",
    "typescript": "const s: string = require('fs').readFileSync(0, 'utf8'); process.stdout.write(s.toUpperCase());",
}
FAIL = {"python": "import sys\nsys.exit(3)", "nodejs": "process.exit(3)", "bash": "exit 3",
        "cpp": "int main(){return 3;}", "java": "public class Main { public static void main(String[] a) { System.exit(3); } }",
        "go": "package main\nimport \"os\"\nfunc main() { os.Exit(3) }", "rust": "fn main() { std::process::exit(3) }",
        "ruby": "exit 3", "php": "exit(3);", "perl": "exit 3;", "lua": "os.exit(3)", "R": "quit(status = 3)",
        "typescript": "process.exit(3);"}
COMPILED = {"cpp", "java", "go", "rust", "typescript"}
TIDE_NAME = {"nodejs": "javascript", "R": "r"}


@pytest.fixture(scope="module")
def endpoint(service) -> str:
    return f"{service.url}/token/{TOKEN}"  # the client sends no credentials: the token travels in the path


def _run(endpoint: str, **fields):
    return run_code(RunCodeRequest(**fields), endpoint=endpoint, max_attempts=1)


@pytest.mark.parametrize("language", sorted(UPPER))
def test_run_code_in_every_language(endpoint, require_language, language):
    require_language(TIDE_NAME.get(language, language))
    r = _run(endpoint, code=UPPER[language], language=language, stdin="hello fusion\n")
    assert r.status.value == "Success" and r.message == "", r
    assert r.run_result.status.value == "Finished" and r.run_result.return_code == 0
    assert r.run_result.stdout == "HELLO FUSION\n" and r.run_result.execution_time > 0
    compiled = language in COMPILED
    assert (r.compile_result is not None) == compiled
    if compiled:
        assert r.compile_result.status.value == "Finished" and r.compile_result.return_code == 0
    failed = _run(endpoint, code=FAIL[language], language=language)
    assert failed.status.value == "Failed" and failed.run_result.return_code == 3, failed


def test_statuses_as_sandbox_fusion_documents_them(endpoint):
    slow = _run(endpoint, code="while True: pass", language="python", run_timeout=1)
    assert slow.status.value == "Failed" and slow.run_result.status.value == "TimeLimitExceeded"
    assert slow.run_result.return_code is None
    broken = _run(endpoint, code="int main( { return 0; }", language="cpp")
    assert broken.status.value == "Failed" and broken.run_result is None
    assert broken.compile_result.status.value == "Finished" and broken.compile_result.return_code != 0
    assert "error" in broken.compile_result.stderr
    raised = _run(endpoint, code="raise ValueError('boom')", language="python")
    assert raised.status.value == "Failed" and "ValueError: boom" in raised.run_result.stderr
    with pytest.raises(Exception, match="language 'julia' is not available"):  # SandboxError: the client raises
        _run(endpoint, code="println(1)", language="julia")


def test_files_in_and_fetch_files_out_as_base64(endpoint):
    blob = bytes(range(256))
    code = ("data = open('in/blob.bin', 'rb').read()\nopen('out.bin', 'wb').write(data[::-1])\n"
            "import os\nos.symlink('/etc/hostname', 'leak')\nos.mkfifo('pipe')")
    r = _run(endpoint, code=code, language="python", files={"in/blob.bin": base64.b64encode(blob).decode()},
             fetch_files=["out.bin", "missing.txt", "leak", "pipe", "../etc/passwd"])
    assert r.status.value == "Success", r
    assert r.files == {"out.bin": base64.b64encode(blob[::-1]).decode()}  # no symlink, FIFO, missing or escape


def test_async_client(endpoint):
    async def many():
        reqs = [RunCodeRequest(code=f"print({i} * {i})", language="python") for i in range(6)]
        return await asyncio.gather(*(run_code_async(r, endpoint=endpoint, max_attempts=1) for r in reqs))

    results = asyncio.run(many())
    assert [r.run_result.stdout for r in results] == [f"{i * i}\n" for i in range(6)]


def test_wrong_path_token_is_refused(service):
    with pytest.raises(Exception, match="401"):
        run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=f"{service.url}/token/wrong",
                 max_attempts=1)


def test_run_jupyter(endpoint):
    r = run_jupyter(RunJupyterRequest(cells=["a = 20", "print(a + 1)", "a * 2", "undefined_name"],
                                      files={"data.txt": base64.b64encode(b"payload").decode()},
                                      fetch_files=["out.txt"]), endpoint=endpoint, max_attempts=1)
    assert r.status.value == "Success" and r.driver.status.value == "Finished", r
    assert [c.stdout for c in r.cells] == ["", "21\n", "", ""]
    assert r.cells[2].display == [{"text/plain": "40"}] and r.cells[3].error[0]["ename"] == "NameError"
    written = run_jupyter(RunJupyterRequest(cells=["open('out.txt', 'w').write(open('data.txt').read().upper())"],
                                            files={"data.txt": base64.b64encode(b"payload").decode()},
                                            fetch_files=["out.txt"]), endpoint=endpoint, max_attempts=1)
    assert base64.b64decode(written.files["out.txt"]) == b"PAYLOAD"
