#!/usr/bin/env python3
"""Sandbox benchmark (see shared/BENCHMARKS.md): python `print(1)` executions per second per core.

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

import argparse
import json
import os
import platform
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

from sandbox.config import SandboxConfig  # noqa: E402
from sandbox.images import Image  # noqa: E402
from sandbox.models import RunRequest  # noqa: E402
from sandbox.oci import runtime_spec  # noqa: E402
from sandbox.runtime import SandboxRuntime  # noqa: E402

CORES = os.cpu_count() or 1
PY = "/usr/bin/python3"
PRINT1 = "print(1)"
Fn = Callable[[], float]


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0].strip()
    except (OSError, IndexError):
        return "missing"


class Runc:
    """The Docker-like baseline: fresh cgroups and a copied rootfs per container."""

    def __init__(self, work: Path, image: Image, netns: str):
        self.work, self.image, self.netns = work, image, netns
        self.root = work / "runc-state"
        self.root.mkdir(parents=True, exist_ok=True)

    def __call__(self, args: list[str]) -> float:
        t0 = time.perf_counter()
        cid = "bench-" + uuid.uuid4().hex[:12]
        b = self.work / cid
        rootfs = b / "rootfs"
        shutil.copytree(self.image.lower, rootfs, symlinks=True)
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
        shutil.rmtree(b)
        if rc != 0 or got != b"1\n":
            raise RuntimeError(f"runc failed: {got[-500:]!r}")
        return time.perf_counter() - t0


BWRAP = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--uid", "65534",
         "--gid", "65534", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib",
         "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
         "--chdir", "/tmp"]


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


def result(name: str, contender: str, baseline: str, metric: str, a: list[float], b: list[float],
           **extra: object) -> dict:
    ca, cb = statistics.median(a), statistics.median(b)
    return {"name": name, "contender": contender, "baseline": baseline, "metric": metric,
            "samples_contender": [round(x, 4) for x in a], "samples_baseline": [round(x, 4) for x in b],
            "contender_median": round(ca, 4), "baseline_median": round(cb, 4),
            "contender_spread": [round(min(a), 4), round(max(a), 4)],
            "baseline_spread": [round(min(b), 4), round(max(b), 4)],
            "ratio": round(ca / cb, 4) if cb else 0.0, **extra}


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="under 2 minutes on 2 cores")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "sandbox.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_sandbox.py needs root (crun, cgroups, overlayfs)")
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
        py_req = RunRequest(language="python", code=PRINT1)
        true_req = RunRequest(language="bash", code="exit 0")
        variants: dict[str, Fn] = {
            "crun-pool": lambda: timed_runtime(rt, py_req, "1\n"),
            "crun-pool-no-pivot": lambda: timed_runtime(rt, py_req, "1\n"),  # same runtime, config.no_pivot
            "runc-copied-rootfs": lambda: runc([PY, "-c", PRINT1]),
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
        results, goals = [], []
        for c in concs:
            for base in ("crun-pool", "bare-subprocess"):
                a, b = rate[("crun-pool-no-pivot", c)], rate[(base, c)]
                results.append(result(f"throughput_c{c}_no_pivot_vs_{base}", "crun-pool-no-pivot", base,
                                      "python print(1) executions/s/core (option, not the default)", a, b,
                                      concurrency=c))
            for base in ("runc-copied-rootfs", "bubblewrap", "bare-subprocess"):
                a, b = rate[("crun-pool", c)], rate[(base, c)]
                results.append(result(f"throughput_c{c}_vs_{base}", "crun-pool", base,
                                      "python print(1) executions/s/core (higher is better)", a, b, concurrency=c))
            for name in variants:
                ls = [x * 1000 for x in lat[(name, c)]]
                results[-1].setdefault("latency_ms", {})[name] = {"p50": round(pct(ls, .5), 2),
                                                                  "p99": round(pct(ls, .99), 2), "n": len(ls)}
            for base, target in (("runc-copied-rootfs", 2.0), ("bare-subprocess", 0.7)):
                ratio = statistics.median(rate[("crun-pool", c)]) / statistics.median(rate[(base, c)])
                goals.append({"name": f"throughput_c{c}_vs_{base}", "ratio": round(ratio, 4), "target": target,
                              "met": ratio >= target})
        # Latency p50 per repetition, as ratios (lower is better).
        for c in (1, max(concs)):
            for base in ("runc-copied-rootfs", "bare-subprocess"):
                per_rep = per(c)

                def medians(name: str) -> list[float]:
                    ls = lat[(name, c)]
                    return [statistics.median(ls[i * per_rep:(i + 1) * per_rep]) * 1000 for i in range(reps)]

                results.append(result(f"latency_p50_c{c}_vs_{base}", "crun-pool", base,
                                      "p50 start-to-exit latency ms (lower is better)", medians("crun-pool"),
                                      medians(base), concurrency=c))
        # Floor: a trivial program, container vs bare process start.
        c = max(concs)
        fa, fb = [], []
        for _ in range(reps):
            fa.append(sample(lambda: timed_runtime(rt, true_req, ""), c, per(c), pool)[0])
            fb.append(sample(lambda: timed_subprocess(["/bin/bash", "-c", "exit 0"], b""), c, per(c), pool)[0])
        results.append(result("floor_trivial_container_vs_bare_start", "crun-pool `exit 0`", "bare `bash -c 'exit 0'`",
                              "executions/s/core; ratio = fraction of a bare process start achieved", fa, fb,
                              concurrency=c))
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
            results.append(result(f"http_run_c{c}", "HTTP POST /run", "in-process runtime",
                                  "requests/s (whole machine)", ha, hb, concurrency=c))
        http.close()
        elapsed = time.perf_counter() - t_start
    finally:
        if svc is not None:
            svc.terminate()
            svc.wait(timeout=60)
        rt.close()
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "area": "sandbox",
        "machine": {"cores": CORES, "cpu": platform.processor() or _cpu_name(),
                    "load_avg_at_end": os.getloadavg(),
                    "versions": {"crun": _version(["crun", "--version"]), "runc": _version(["runc", "--version"]),
                                 "bwrap": _version(["bwrap", "--version"]), "python": _version([PY, "--version"]),
                                 "kernel": platform.release(), "cgroups": rt.layout.mode.value if rt.layout else "?"}},
        "quick": args.quick,
        "seconds": round(elapsed, 1),
        "results": results,
        "goals": goals,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nsandbox benchmark ({'quick' if args.quick else 'full'}, {CORES} cores, {elapsed:.0f} s) -> {args.out}")
    print(f"{'result':48} {'contender':>10} {'baseline':>10} {'ratio':>7}")
    for r in results:
        print(f"{r['name']:48} {r['contender_median']:10.2f} {r['baseline_median']:10.2f} {r['ratio']:7.2f}")
    for r in results:
        if "latency_ms" in r:
            c = r["concurrency"]
            print(f"latency c={c}: " + ", ".join(f"{k} p50 {v['p50']:.1f} / p99 {v['p99']:.1f} ms"
                                                 for k, v in r["latency_ms"].items()))
    print(f"{'goal':48} {'ratio':>10} {'target':>10} {'met':>7}")
    for g in goals:
        print(f"{g['name']:48} {g['ratio']:10.2f} {g['target']:10.2f} {str(g['met']):>7}")


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
