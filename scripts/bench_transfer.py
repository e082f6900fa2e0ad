#!/usr/bin/env python
"""Weight-transfer benchmark (BENCHMARKS.md): Mooncake pull vs a plain loopback socket copy vs memcpy.

A source process holds one shm file per size and serves it through `MooncakeTransport.serve` (TCP
protocol, P2P handshake, loopback) and through plain TCP sockets. This process receives each into a fresh
/dev/shm file:
  - contender `mooncake_pull`: `MooncakeTransport.pull` (bucketed async reads, checksum verified while it
    lands, `.partial` renamed when verified) with the default TransferConfig, plus a small sweep of
    bucket size / concurrency at the goal size;
  - baseline `socket_copy` (the goal's baseline): the source `sendall`s its mapping, we `recv_into` a
    mapping of the destination file, no checksum: a user-space copy on both ends, as any user-space
    transport does;
  - baseline `socket_sendfile`: the same with `socket.sendfile` on the source (zero-copy sender), the
    fastest plain socket path, reported for reference;
  - floor `memcpy`: a copy of the source mapping into a fresh destination mapping in this process.
Samples alternate (order rotated each repeat); medians, min-max spreads and ratios go to
bench_results/transfer.json, a table is printed last.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckpt_transfer.checksum import checksum_file  # noqa: E402
from ckpt_transfer.manifest import ShardRecord  # noqa: E402
from ckpt_transfer.transport import MooncakeTransport, TransferConfig  # noqa: E402

BASELINES = ("socket_copy", "socket_sendfile", "memcpy")
MiB = 1 << 20
GiB = 1 << 30


# ---------------------------------------------------------------------------- source process
def _source_main(root: Path) -> None:
    transport = MooncakeTransport(TransferConfig())
    srv = socket.create_server(("127.0.0.1", 0))
    files: dict[str, Path] = {}

    def serve_socket() -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                mode, name = conn.recv(256).decode().split()
                with open(files[name], "rb") as f:
                    if mode == "sendfile":
                        conn.sendfile(f)
                    else:
                        size = os.fstat(f.fileno()).st_size
                        with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m, memoryview(m) as v:
                            conn.sendall(v)

    threading.Thread(target=serve_socket, daemon=True).start()
    print(json.dumps({"address": transport.address, "socket_port": srv.getsockname()[1]}), flush=True)
    for line in sys.stdin:
        size = int(line)
        name = f"src_{size}.bin"
        path = root / name
        block = os.urandom(MiB)
        with open(path, "wb") as f:
            for _ in range(size // MiB):
                f.write(block)
        files[name] = path
        transport.serve({name: path})
        print(json.dumps({"name": name, "path": str(path), "checksum": checksum_file(path)}), flush=True)


# ---------------------------------------------------------------------------- receivers
def _fresh_map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def socket_copy(port: int, name: str, size: int, dest: Path, mode: str = "sendall") -> float:
    t0 = time.perf_counter()
    dst = _fresh_map(dest, size)
    with socket.create_connection(("127.0.0.1", port)) as s, memoryview(dst) as view:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
        s.sendall(f"{mode} {name}".encode())
        got = 0
        while got < size:
            n = s.recv_into(view[got:], size - got)
            if n == 0:
                raise RuntimeError("socket closed early")
            got += n
    dst.close()
    dt = time.perf_counter() - t0
    dest.unlink()
    return size / dt / 1e9


def memcpy(src_path: str, size: int, dest: Path) -> float:
    with open(src_path, "rb") as f:
        src = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    t0 = time.perf_counter()
    dst = _fresh_map(dest, size)
    dst[:] = src
    dst.close()
    dt = time.perf_counter() - t0
    src.close()
    dest.unlink()
    return size / dt / 1e9


def mooncake_pull(t: MooncakeTransport, address: str, rec: ShardRecord, dest_dir: Path) -> float:
    stats = t.pull([rec], address, dest_dir)
    (dest_dir / rec.file).unlink()
    return rec.nbytes / stats.seconds / 1e9


# ---------------------------------------------------------------------------- driver
def _proc_cpu(pid: int) -> float:
    """user+system CPU seconds of another process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def _versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for pkg in ("mooncake-transfer-engine-non-cuda", "pydantic", "crc32c"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = None
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB and 1 GiB, 5 repeats (under 2 minutes)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="also sweep bucket size / concurrency in --quick")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "transfer.json"))
    ap.add_argument("--_source", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._source:
        _source_main(Path(a._source))
        return 0

    sizes = [64 * MiB, GiB] if a.quick else [64 * MiB, 256 * MiB, GiB, 2 * GiB]
    repeats = a.repeats or 5
    goal_size = GiB
    sweep = [(16 * MiB, 4), (16 * MiB, 8), (64 * MiB, 2), (64 * MiB, 8), (256 * MiB, 2)]
    if a.quick and not a.sweep:
        sweep = []
    default_cfg = TransferConfig()

    load_start = os.getloadavg()
    root = Path("/dev/shm") / f"tide_bench_transfer_{os.getpid()}"
    (root / "src").mkdir(parents=True)
    (root / "dst").mkdir()
    src = subprocess.Popen([sys.executable, __file__, "--_source", str(root / "src")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    results: list[dict] = []
    try:
        hello = json.loads(src.stdout.readline())
        address, port = hello["address"], hello["socket_port"]
        transports = {(default_cfg.bucket_bytes, default_cfg.concurrency): MooncakeTransport(default_cfg)}
        for b, c in sweep:
            transports.setdefault((b, c), MooncakeTransport(TransferConfig(bucket_bytes=b, concurrency=c)))
        for size in sizes:
            src.stdin.write(f"{size}\n")
            src.stdin.flush()
            info = json.loads(src.stdout.readline())
            rec = ShardRecord(file=info["name"], node="src", nbytes=size, checksum=info["checksum"], tensors=())
            dst = root / "dst"
            runners: dict[str, Callable[[], float]] = {
                "mooncake_pull": lambda: mooncake_pull(
                    transports[(default_cfg.bucket_bytes, default_cfg.concurrency)], address, rec, dst),
                "socket_copy": lambda: socket_copy(port, info["name"], size, dst / "sock.bin"),
                "socket_sendfile": lambda: socket_copy(port, info["name"], size, dst / "sf.bin", "sendfile"),
                "memcpy": lambda: memcpy(info["path"], size, dst / "memcpy.bin"),
            }
            if size == goal_size:
                for b, c in sweep:
                    runners[f"mooncake_pull[bucket={b // MiB}MiB,conc={c}]"] = (
                        lambda t=transports[(b, c)]: mooncake_pull(t, address, rec, dst))
            names = list(runners)
            if size == sizes[0]:  # warm-up: connections, handshakes, first-touch of code paths
                for name in names:
                    runners[name]()
                for t in transports.values():
                    mooncake_pull(t, address, rec, dst)
            samples: dict[str, list[float]] = {n: [] for n in names}
            cpu: dict[str, list[float]] = {n: [] for n in names}  # CPU seconds per GiB, both processes
            for r in range(repeats):
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    c0 = time.process_time() + _proc_cpu(src.pid)
                    samples[name].append(runners[name]())
                    cpu[name].append((time.process_time() + _proc_cpu(src.pid) - c0) * GiB / size)
            for name in names:
                if name in BASELINES:
                    continue
                for base in BASELINES:
                    c, b = _summary(samples[name]), _summary(samples[base])
                    results.append({
                        "name": f"{name} vs {base} @ {size // MiB} MiB",
                        "contender": name, "baseline": base, "metric": "GB/s (higher is better)",
                        "size_bytes": size,
                        "samples_contender": [round(x, 4) for x in samples[name]],
                        "samples_baseline": [round(x, 4) for x in samples[base]],
                        "contender_median": c["median"], "baseline_median": b["median"],
                        "contender_spread": [c["min"], c["max"]], "baseline_spread": [b["min"], b["max"]],
                        "ratio": c["median"] / b["median"],
                        **({"fraction_of_floor": c["median"] / b["median"]} if base == "memcpy" else {}),
                    })
                    cc, cb = _summary(cpu[name]), _summary(cpu[base])
                    results.append({
                        "name": f"{name} vs {base} @ {size // MiB} MiB, CPU",
                        "contender": name, "baseline": base,
                        "metric": "CPU seconds per GiB, receiver + source process (lower is better)",
                        "size_bytes": size,
                        "samples_contender": [round(x, 4) for x in cpu[name]],
                        "samples_baseline": [round(x, 4) for x in cpu[base]],
                        "contender_median": cc["median"], "baseline_median": cb["median"],
                        "contender_spread": [cc["min"], cc["max"]], "baseline_spread": [cb["min"], cb["max"]],
                        "ratio": cc["median"] / cb["median"],
                    })
            (root / "src" / info["name"]).unlink(missing_ok=True)
    finally:
        if src.poll() is None:
            src.stdin.close()
            src.kill()  # our own child, by its handle
            src.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)

    gbps = [r for r in results if r["metric"].startswith("GB/s")]
    goal = next(r for r in gbps if r["contender"] == "mooncake_pull" and r["baseline"] == "socket_copy"
                and r["size_bytes"] == goal_size)
    best = max((r for r in gbps if r["baseline"] == "socket_copy" and r["size_bytes"] == goal_size),
               key=lambda r: r["ratio"])
    from ckpt_transfer.checksum import ALGORITHM

    doc = {
        "area": "transfer",
        "machine": {"cores": os.cpu_count(), "cpu": _cpu_model(), "versions": _versions(),
                    "load_avg_at_start": load_start, "load_avg_at_end": os.getloadavg()},
        "checksum_algorithm": ALGORITHM,
        "quick": a.quick,
        "config": {"default": default_cfg.model_dump(), "sweep_at_goal_size": [
            {"bucket_bytes": b, "concurrency": c} for b, c in sweep]},
        "results": results,
        "goals": [{
            "name": "mooncake pull >= 0.8x plain loopback socket copy at 1 GiB (default config)",
            "ratio": goal["ratio"], "target": 0.8, "met": goal["ratio"] >= 0.8,
        }],
        "best_at_goal_size": {"contender": best["contender"], "ratio_vs_socket": best["ratio"]},
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))

    print(f"\nweight transfer over loopback, {os.cpu_count()} cores, {repeats} repeats, checksum {ALGORITHM}, "
          f"load {load_start[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'contender':40s} {'size':>8s} {'GB/s median [min-max]':>22s} {'/socket':>8s} {'/sendfile':>9s} "
          f"{'/memcpy':>8s} {'CPU s/GiB':>9s}")
    for r in gbps:
        if r["baseline"] != "socket_copy":
            continue
        other = {x["baseline"]: x["ratio"] for x in gbps
                 if x["contender"] == r["contender"] and x["size_bytes"] == r["size_bytes"]}
        cpu_row = next(x for x in results if x["contender"] == r["contender"] and x["size_bytes"] == r["size_bytes"]
                       and not x["metric"].startswith("GB/s"))
        lo, hi = r["contender_spread"]
        print(f"{r['contender']:40s} {r['size_bytes'] // MiB:>5d}MiB {r['contender_median']:8.2f} [{lo:.2f}-{hi:.2f}]"
              f" {other['socket_copy']:7.2f}x {other['socket_sendfile']:8.2f}x {other['memcpy']:7.2f}x"
              f" {cpu_row['contender_median']:9.2f}")
    for size in sizes:
        med = {x["baseline"]: x["baseline_median"] for x in gbps
               if x["size_bytes"] == size and x["contender"] == "mooncake_pull"}
        cpu_med = {x["baseline"]: x["baseline_median"] for x in results
                   if x["size_bytes"] == size and x["contender"] == "mooncake_pull" and not x["metric"].startswith("GB/s")}
        print(f"{'  baselines socket / sendfile / memcpy':40s} {size // MiB:>5d}MiB "
              f"{med['socket_copy']:.2f} / {med['socket_sendfile']:.2f} / {med['memcpy']:.2f} GB/s; CPU s/GiB "
              f"{cpu_med['socket_copy']:.2f} / {cpu_med['socket_sendfile']:.2f} / {cpu_med['memcpy']:.2f}")
    for g in doc["goals"]:
        print(f"goal: {g['name']}: {g['ratio']:.2f}x (target {g['target']}) -> {'met' if g['met'] else 'NOT met'}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
