#!/usr/bin/env python3
"""Sandbox benchmark (docs/benchmarks.md): python `print(1)` executions per second per core.

Contender: tide's runtime (crun, pre-created cgroup pool, overlay on tmpfs, an empty netns per slot),
called in-process with its defaults; the `--no-pivot` option is measured beside it as an extra.
Baselines, in the same run and alternating with it:
  runc   - the Docker-like path: per-run cgroups (runc creates and deletes them), a copied root filesystem
           (the same skeleton the contender overlays; /usr bound read-only), same seccomp/mounts/netns;
  bwrap  - bubblewrap with all namespaces unshared, uid 65534, no capabilities;
  bare   - a plain subprocess.
Also: HTTP `/run` requests/s against the in-process runtime, and the floor (a trivial `exit 0` container
vs a bare process start). Needs root. Writes bench_results/sandbox.json.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import Report, bench_arguments, command_version  # noqa: E402
from sandbox.config import SandboxConfig  # noqa: E402
from sandbox.images import Image  # noqa: E402
from sandbox.models import RunRequest  # noqa: E402
from sandbox.oci import runtime_spec  # noqa: E402
from sandbox.runtime import SandboxRuntime  # noqa: E402
from sandbox.sysutil import MS_NODEV, MS_NOSUID, mount, umount_quiet  # noqa: E402

CORES = os.cpu_count() or 1
PY = "/usr/bin/python3"
PRINT1 = "print(1)"
Fn = Callable[[], float]


class Runc:
    """The Docker-like baseline: fresh cgroups per container, and a copied rootfs or (`overlay`) the contender's
    own layout, an overlay on the image with a tmpfs upper layer, so that the comparison is runc against crun
    and not copying against mounting."""

    def __init__(self, work: Path, image: Image, netns: str, overlay: bool = False):
        self.work, self.image, self.netns, self.overlay = work, image, netns, overlay
        self.root = work / "runc-state"
        self.root.mkdir(parents=True, exist_ok=True)

    def __call__(self, args: list[str]) -> float:
        t0 = time.perf_counter()
        cid = "bench-" + uuid.uuid4().hex[:12]
        b = self.work / cid
        rootfs = b / "rootfs"
        if self.overlay:
            layer = b / "layer"
            layer.mkdir(parents=True)
            mount("tmpfs", str(layer), "tmpfs", MS_NOSUID | MS_NODEV, "size=64m")
            (layer / "upper").mkdir()
            (layer / "work").mkdir()
            rootfs.mkdir()
            mount("overlay", str(rootfs), "overlay", 0,
                  f"lowerdir={self.image.lower},upperdir={layer}/upper,workdir={layer}/work")
        else:
            shutil.copytree(self.image.lower, rootfs, symlinks=True)
        try:
            return self._run(t0, cid, b, rootfs, args)
        finally:
            if self.overlay:
                umount_quiet(str(rootfs))
                umount_quiet(str(b / "layer"))
            shutil.rmtree(b, ignore_errors=True)

    def _run(self, t0: float, cid: str, b: Path, rootfs: Path, args: list[str]) -> float:
        spec = runtime_spec(rootfs=str(rootfs), image=self.image, args=args, env=["PATH=/usr/bin:/bin"],
                            netns=self.netns, shm_mb=16)
        # Top-level like the contender's slots, so each container weighs one process in the CPU scheduler.
        spec["linux"]["cgroupsPath"] = f"/tide-bench-runc-{cid}"
        spec["linux"]["resources"] = {"memory": {"limit": 512 << 20, "swap": 512 << 20},
                                      "pids": {"limit": 68}, "cpu": {"quota": 100_000, "period": 100_000}}
        (b / "config.json").write_text(json.dumps(spec))
        with tempfile.TemporaryFile(dir="/dev/shm") as out:
            rc = subprocess.call(["runc", "--root", str(self.root), "run", "--bundle", str(b), cid], stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            out.seek(0)
            got = out.read()
        if rc != 0 or got != b"1\n":
            raise RuntimeError(f"runc failed: {got[-500:]!r}")
        return time.perf_counter() - t0


BWRAP = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--uid", "65534",
         "--gid", "65534", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib",
         "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
         "--chdir", "/tmp"]


# A bare ipykernel's start and first cell, outside any container: Jupyter's own client and kernel, over TCP.
KERNEL_START = """
from jupyter_client import KernelManager
km = KernelManager(kernel_name="python3")
km.start_kernel()
kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=60)
kc.execute_interactive("1+1", timeout=60)
kc.stop_channels(); km.shutdown_kernel(now=True)
"""


def timed_subprocess(cmd: list[str], expect: bytes) -> float:
    """Output goes to a file, as the contender's does (pumping pipes in Python threads would handicap it).
    Each baseline process gets its own session: with the scheduler's autogroup feature (on here), processes
    of one session share a single CPU weight, while every container sits in its own cgroup."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile(dir="/dev/shm") as out:
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        out.seek(0)
        got = out.read()
    if got != expect or rc != 0:
        raise RuntimeError(f"{cmd[:3]}: rc {rc} {got[-300:]!r}")
    return time.perf_counter() - t0


def timed_runtime(rt: SandboxRuntime, req: RunRequest, expect: str) -> float:
    t0 = time.perf_counter()
    r = rt.run(req)
    if r.stdout != expect or r.status.value != "ok":
        raise RuntimeError(f"runtime: {r}")
    return time.perf_counter() - t0


def sample(fn: Fn, conc: int, n: int, pool: ThreadPoolExecutor) -> tuple[float, list[float]]:
    """n executions with conc in flight: (executions per second per core, latencies in s)."""
    it = iter(range(n))

    def loop() -> list[float]:
        out = []
        for _ in it:  # shared iterator: each thread takes the next execution (GIL-safe for range iterators)
            out.append(fn())
        return out

    t0 = time.perf_counter()
    futs = [pool.submit(loop) for _ in range(conc)]
    lats = [x for f in futs for x in f.result()]
    return n / (time.perf_counter() - t0) / CORES, lats


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_service(state: Path, pool: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sandbox.cli", "serve", "--port", str(port), "--pool-size",
                             str(pool), "--state-dir", str(state), "--log-level", "warning"], cwd=REPO)
    from sandbox.client import SandboxClient

    url = f"http://127.0.0.1:{port}"
    with SandboxClient(url) as c:
        c.wait_ready(timeout_s=60)
    return proc, url


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--out", default=str(REPO / "bench_results" / "sandbox.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_sandbox.py needs root (crun, cgroups, overlayfs)")
    report = Report("sandbox", args.quick, out=args.out)
    reps = 5 if args.quick else 7
    concs = [1, 2, 4, 8]
    per = (lambda c: max(8, 2 * c)) if args.quick else (lambda c: 16 + 4 * c)
    work = Path(f"/run/tide-sandbox-bench-{os.getpid()}")
    cfg = SandboxConfig(state_dir=work / "state", pool_size=max(concs), max_queue=64)
    rt = SandboxRuntime(cfg).start(private_namespace=True)  # before any thread exists
    svc = None
    try:
        image = rt.images["host"]
        runc = Runc(work / "runc", image, rt.workers[0].netns or "")
        runc_overlay = Runc(work / "runc-overlay", image, rt.workers[0].netns or "", overlay=True)
        py_req = RunRequest(language="python", code=PRINT1)
        true_req = RunRequest(language="bash", code="exit 0")
        variants: dict[str, Fn] = {
            "crun-pool": lambda: timed_runtime(rt, py_req, "1\n"),
            "crun-pool-no-pivot": lambda: timed_runtime(rt, py_req, "1\n"),  # same runtime, config.no_pivot
            "runc-copied-rootfs": lambda: runc([PY, "-c", PRINT1]),
            "runc-same-overlay": lambda: runc_overlay([PY, "-c", PRINT1]),
            "bubblewrap": lambda: timed_subprocess(BWRAP + [PY, "-c", PRINT1], b"1\n"),
            "bare-subprocess": lambda: timed_subprocess([PY, "-c", PRINT1], b"1\n"),
        }
        pool = ThreadPoolExecutor(max(concs))
        for fn in variants.values():  # warm caches once
            fn()
        rate: dict[tuple[str, int], list[float]] = {}
        lat: dict[tuple[str, int], list[float]] = {}
        t_start = time.perf_counter()
        for rep in range(reps):
            for c in concs:
                for name, fn in variants.items():  # A B C D, A B C D, ...
                    rt.config.no_pivot = name == "crun-pool-no-pivot"
                    r, ls = sample(fn, c, per(c), pool)
                    rate.setdefault((name, c), []).append(r)
                    lat.setdefault((name, c), []).extend(ls)
        rt.config.no_pivot = False
        for c in concs:
            for base in ("crun-pool", "bare-subprocess"):
                a, b = rate[("crun-pool-no-pivot", c)], rate[(base, c)]
                report.add(f"throughput_c{c}_no_pivot_vs_{base}", "crun-pool-no-pivot", base,
                           "python print(1) executions/s/core (option, not the default)", a, b, concurrency=c)
            rows = {}
            for base in ("runc-copied-rootfs", "runc-same-overlay", "bubblewrap", "bare-subprocess"):
                a, b = rate[("crun-pool", c)], rate[(base, c)]
                rows[base] = report.add(f"throughput_c{c}_vs_{base}", "crun-pool", base,
                                        "python print(1) executions/s/core", a, b, concurrency=c)
            for name in variants:  # every variant's latency at this concurrency, on the last row
                ls = [x * 1000 for x in lat[(name, c)]]
                rows["bare-subprocess"].setdefault("latency_ms", {})[name] = {
                    "p50": round(pct(ls, .5), 2), "p99": round(pct(ls, .99), 2), "n": len(ls)}
            # The 2x-runc goal against runc on the same overlay (crun vs runc); the copied rootfs is reported.
            for base, target in (("runc-same-overlay", 2.0), ("bare-subprocess", 0.7)):
                report.goal(f"throughput_c{c}_vs_{base}", rows[base]["ratio"], target, row=rows[base])
        # Latency p50 per repetition, as ratios (lower is better).
        for c in (1, max(concs)):
            for base in ("runc-copied-rootfs", "runc-same-overlay", "bare-subprocess"):
                per_rep = per(c)

                def medians(name: str) -> list[float]:
                    ls = lat[(name, c)]
                    return [statistics.median(ls[i * per_rep:(i + 1) * per_rep]) * 1000 for i in range(reps)]

                report.add(f"latency_p50_c{c}_vs_{base}", "crun-pool", base, "p50 start-to-exit latency ms",
                           medians("crun-pool"), medians(base), higher_is_better=False, concurrency=c)
        # Floor: a trivial program, container vs bare process start.
        c = max(concs)
        fa, fb = [], []
        for _ in range(reps):
            fa.append(sample(lambda: timed_runtime(rt, true_req, ""), c, per(c), pool)[0])
            fb.append(sample(lambda: timed_subprocess(["/bin/bash", "-c", "exit 0"], b""), c, per(c), pool)[0])
        report.add("floor_trivial_container_vs_bare_start", "crun-pool `exit 0`", "bare `bash -c 'exit 0'`",
                   "executions/s/core; ratio = fraction of a bare process start achieved", fa, fb, concurrency=c)
        # HTTP /run against the in-process runtime.
        svc, url = start_service(work / "svc-state", max(concs))
        import httpx

        http = httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=16))

        def http_run() -> float:
            t0 = time.perf_counter()
            r = http.post("/run", json={"language": "python", "code": PRINT1})
            if r.status_code != 200 or r.json()["stdout"] != "1\n":
                raise RuntimeError(r.text)
            return time.perf_counter() - t0

        http_run()
        for c in (1, 4, 8):
            ha, hb = [], []
            for _ in range(reps):
                ha.append(sample(http_run, c, per(c), pool)[0] * CORES)
                hb.append(sample(variants["crun-pool"], c, per(c), pool)[0] * CORES)
            report.add(f"http_run_c{c}", "HTTP POST /run", "in-process runtime", "requests/s (whole machine)",
                       ha, hb, concurrency=c)
        # SandboxFusion's /run_code (its request and response translated) against tide's /run.
        def http_run_code() -> float:
            t0 = time.perf_counter()
            r = http.post("/run_code", json={"language": "python", "code": PRINT1})
            if r.status_code != 200 or r.json()["run_result"]["stdout"] != "1\n":
                raise RuntimeError(r.text)
            return time.perf_counter() - t0

        http_run_code()
        for c in (1, 8):
            fa, fb = [], []
            for _ in range(reps):
                fa.append(sample(http_run_code, c, per(c), pool)[0] * CORES)
                fb.append(sample(http_run, c, per(c), pool)[0] * CORES)
            row = report.add(f"http_run_code_c{c}", "HTTP POST /run_code (SandboxFusion API)", "HTTP POST /run",
                             "requests/s (whole machine)", fa, fb, concurrency=c)
            report.goal(f"http_run_code_c{c}_vs_run", row["ratio"], 0.9, row=row)
        # Sessions: a warm session's `1+1` over HTTP, and opening one, against a bare ipykernel started outside
        # any container (what a Jupyter-backed session would pay; tide's session is a plain Python namespace,
        # so Jupyter mode's kernel start in a container is reported beside it as the like-for-like row).
        from sandbox.client import SandboxClient

        with SandboxClient(url) as sc:
            sid = sc.open_session()
            for _ in range(20):
                sc.run_in_session(sid, "1+1")
            cell_ms = []
            for _ in range(reps * 40):
                t0 = time.perf_counter()
                if sc.run_in_session(sid, "1+1").display != [{"text/plain": "2"}]:
                    raise RuntimeError("session cell")
                cell_ms.append((time.perf_counter() - t0) * 1000)
            sc.close_session(sid)
            p50 = pct(cell_ms, .5)
            report.note("session_cell_latency_ms", {"p50": round(p50, 3), "p99": round(pct(cell_ms, .99), 3),
                                                    "n": len(cell_ms), "code": "1+1", "over": "HTTP"})
            report.goal("session_cell_p50_within_10ms (10 ms / p50)", 10.0 / p50, 1.0)

            def open_close() -> float:
                t0 = time.perf_counter()
                s_id = sc.open_session()
                took = time.perf_counter() - t0
                sc.close_session(s_id)
                deadline = time.monotonic() + 10
                while sc.health().sessions and time.monotonic() < deadline:
                    time.sleep(0.005)
                return took

            def bare_kernel() -> float:
                t0 = time.perf_counter()
                km = subprocess.run([PY, "-c", KERNEL_START], capture_output=True, text=True, timeout=60)
                if km.returncode != 0:
                    raise RuntimeError(km.stderr[-500:])
                return time.perf_counter() - t0

            def jupyter_in_container() -> float:
                t0 = time.perf_counter()
                r = rt.run(RunRequest(language="python", code="", cells=["1+1"]))
                if not r.cells or r.cells[0].display != [{"text/plain": "2"}]:
                    raise RuntimeError(r)
                return time.perf_counter() - t0

            open_close(), bare_kernel(), jupyter_in_container()
            sa, sb, sj = [], [], []
            for _ in range(reps):
                sa.append(statistics.median(open_close() for _ in range(5)) * 1000)
                sb.append(statistics.median(bare_kernel() for _ in range(3)) * 1000)
                sj.append(statistics.median(jupyter_in_container() for _ in range(3)) * 1000)
            row = report.add("session_start_vs_bare_ipykernel", "POST /sessions (ready)",
                             "bare ipykernel start + first `1+1`, no container", "ms", sa, sb, higher_is_better=False)
            report.goal("session_start_vs_bare_ipykernel (speed-up)", 1 / row["ratio"], 0.8, row=row)
            report.add("jupyter_mode_vs_bare_ipykernel", "Jupyter mode request, one `1+1` cell, in a container",
                       "bare ipykernel start + first `1+1`, no container", "ms", sj, sb, higher_is_better=False)
        http.close()
        # Judge mode: 20 stdin/stdout cases in one container against one case (compile once, one container
        # start; in Python one interpreter start, cases forked from a fork server), and Python's two-process
        # tests mode against a plain run of the same code (the price of verdicts the solution cannot forge).
        programs = {"cpp": "#include <cstdio>\nint main(){long a,b; scanf(\"%ld %ld\",&a,&b); printf(\"%ld\\n\",a+b);}",
                    "python": "a, b = map(int, input().split())\nprint(a + b)"}
        cases = [{"stdin": f"{i} {i}\n", "expected_stdout": f"{2 * i}\n"} for i in range(20)]

        def judged(language: str, n: int) -> Fn:
            req = RunRequest(language=language, code=programs[language], cases=cases[:n])

            def fn() -> float:
                t0 = time.perf_counter()
                res = rt.run(req)
                if res.cases_passed != n:
                    raise RuntimeError(res)
                return time.perf_counter() - t0
            return fn

        for language in programs:
            one, twenty = judged(language, 1), judged(language, 20)
            one(), twenty()
            ta, tb = [], []
            for _ in range(reps):
                ta.append(statistics.median(one() for _ in range(3)) * 1000)
                tb.append(statistics.median(twenty() for _ in range(3)) * 1000)
            row = report.add(f"judge_20_cases_vs_1_{language}", f"judge mode, 20 cases ({language})",
                             f"judge mode, 1 case ({language})", "ms per request (compile included), sequential",
                             tb, ta, higher_is_better=False)
            report.goal(f"judge_{language}_one_case_over_20_cases (>= 1/3: 20 cases cost at most 3x one)",
                        1 / row["ratio"], 1 / 3, row=row)
        tests_req = RunRequest(language="python", code="def add(a, b):\n    return a + b",
                               tests=["assert add(1, 2) == 3"] * 5)
        plain_req = RunRequest(language="python", code="def add(a, b):\n    return a + b\nassert add(1, 2) == 3")
        ua, ub = [], []
        for _ in range(reps):
            ua.append(statistics.median(timed_runtime(rt, tests_req, "") for _ in range(5)) * 1000)
            ub.append(statistics.median(timed_runtime(rt, plain_req, "") for _ in range(5)) * 1000)
        report.add("python_tests_mode_vs_plain", "tests mode (judge + solution processes)", "plain run",
                   "ms per request, sequential", ua, ub, higher_is_better=False)
        # Tests mode outside Python: the expected sides run once per test set, in a container of their own (a new
        # test set each request: the cache never helps), against the same test set again (served from the cache).
        fresh = iter(range(10**9))

        def js_tests(cached: bool) -> float:
            i = 7 if cached else next(fresh)
            req = RunRequest(language="javascript", code="function add(a, b) { return a + b; }",
                             tests=[f"add({i}, 1) === {i + 1}", f"add({i}, {i}) === {2 * i}"])
            t0 = time.perf_counter()
            res = rt.run(req)
            if res.tests_passed != 2:
                raise RuntimeError(res)
            return time.perf_counter() - t0
        js_plain = RunRequest(language="javascript", code="function add(a, b) { return a + b; }\n"
                              "if (add(7, 1) !== 8) process.exit(1);")
        js_tests(True)
        va, vb, vc = [], [], []
        for _ in range(reps):
            va.append(statistics.median(js_tests(False) for _ in range(5)) * 1000)
            vb.append(statistics.median(js_tests(True) for _ in range(5)) * 1000)
            vc.append(statistics.median(timed_runtime(rt, js_plain, "") for _ in range(5)) * 1000)
        report.add("javascript_tests_mode_new_test_set_vs_plain", "tests mode, a new test set (expected sides run)",
                   "plain run", "ms per request, sequential", va, vc, higher_is_better=False)
        report.add("javascript_tests_mode_cached_vs_plain", "tests mode, a cached test set", "plain run",
                   "ms per request, sequential", vb, vc, higher_is_better=False)
        elapsed = time.perf_counter() - t_start
        report.note("seconds", round(elapsed, 1))  # the measurements, without set-up and warm-up
        report.machine_extra["cgroups"] = rt.layout.mode.value if rt.layout else "?"
    finally:
        if svc is not None:
            svc.terminate()
            svc.wait(timeout=60)
        rt.close()
        shutil.rmtree(work, ignore_errors=True)
    report.machine_extra["versions"] = {
        "crun": command_version(["crun", "--version"]), "runc": command_version(["runc", "--version"]),
        "bwrap": command_version(["bwrap", "--version"]), "sandboxed python": command_version([PY, "--version"])}
    out = report.write()
    print(f"\nsandbox benchmark ({'quick' if args.quick else 'full'}, {CORES} cores, {elapsed:.0f} s) -> {out}")
    report.print_results()
    for r in report.results:
        if "latency_ms" in r:
            c = r["concurrency"]
            print(f"latency c={c}: " + ", ".join(f"{k} p50 {v['p50']:.1f} / p99 {v['p99']:.1f} ms"
                                                 for k, v in r["latency_ms"].items()))
    report.print_goals()


if __name__ == "__main__":
    main()
