#!/usr/bin/env python
"""Weight-transfer benchmark (docs/benchmarks.md): Mooncake pull vs a plain loopback socket copy vs memcpy.

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
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import Report  # noqa: E402
from ckpt_transfer.checksum import checksum_file  # noqa: E402
from ckpt_transfer.manifest import ShardRecord  # noqa: E402
from ckpt_transfer.transport import MooncakeTransport, TransferConfig  # noqa: E402

BASELINES = ("socket_copy", "socket_sendfile", "memcpy")
GBPS = "GB/s"
CPU_METRIC = "CPU seconds per GiB, receiver + source process"
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

    report = Report("transfer", a.quick, out=a.out)
    root = Path("/dev/shm") / f"tide_bench_transfer_{os.getpid()}"
    (root / "src").mkdir(parents=True)
    (root / "dst").mkdir()
    src = subprocess.Popen([sys.executable, __file__, "--_source", str(root / "src")], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
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
                    row = report.add(f"{name} vs {base} @ {size // MiB} MiB", name, base, GBPS, samples[name],
                                     samples[base], size_bytes=size)
                    if base == "memcpy":
                        row["fraction_of_floor"] = row["ratio"]
                    report.add(f"{name} vs {base} @ {size // MiB} MiB, CPU", name, base, CPU_METRIC, cpu[name],
                               cpu[base], higher_is_better=False, size_bytes=size)
            (root / "src" / info["name"]).unlink(missing_ok=True)
    finally:
        if src.poll() is None:
            src.stdin.close()
            src.kill()  # our own child, by its handle
            src.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)

    results = report.results
    gbps = [r for r in results if r["metric"] == GBPS]
    goal = next(r for r in gbps if r["contender"] == "mooncake_pull" and r["baseline"] == "socket_copy"
                and r["size_bytes"] == goal_size)
    best = max((r for r in gbps if r["baseline"] == "socket_copy" and r["size_bytes"] == goal_size),
               key=lambda r: r["ratio"])
    from ckpt_transfer.checksum import ALGORITHM

    report.note("checksum_algorithm", ALGORITHM)
    report.note("config", {"default": default_cfg.model_dump(), "sweep_at_goal_size": [
        {"bucket_bytes": b, "concurrency": c} for b, c in sweep]})
    report.goal("mooncake pull >= 0.8x plain loopback socket copy at 1 GiB (default config)", goal["ratio"], 0.8, row=goal)
    report.note("best_at_goal_size", {"contender": best["contender"], "ratio_vs_socket": best["ratio"]})
    out = report.write()
    load = report.written["machine"]

    print(f"\nweight transfer over loopback, {os.cpu_count()} cores, {repeats} repeats, checksum {ALGORITHM}, "
          f"load {load['load_avg_at_start'][0]:.1f} -> {load['load_avg_at_end'][0]:.1f}")
    print(f"{'contender':40s} {'size':>8s} {'GB/s median [min-max]':>22s} {'/socket':>8s} {'/sendfile':>9s} "
          f"{'/memcpy':>8s} {'CPU s/GiB':>9s}")
    row = {(r["contender"], r["size_bytes"], r["baseline"], r["metric"]): r for r in results}
    for r in gbps:
        if r["baseline"] != "socket_copy":
            continue
        key = (r["contender"], r["size_bytes"])
        socket_x, sendfile_x, memcpy_x = (row[(*key, base, GBPS)]["ratio"] for base in BASELINES)
        lo, hi = r["contender_spread"]
        print(f"{r['contender']:40s} {r['size_bytes'] // MiB:>5d}MiB {r['contender_median']:8.2f} [{lo:.2f}-{hi:.2f}]"
              f" {socket_x:7.2f}x {sendfile_x:8.2f}x {memcpy_x:7.2f}x"
              f" {row[(*key, 'socket_copy', CPU_METRIC)]['contender_median']:9.2f}")
    for size in sizes:
        med, cpu_med = ([row[("mooncake_pull", size, base, metric)]["baseline_median"] for base in BASELINES]
                        for metric in (GBPS, CPU_METRIC))
        print(f"{'  baselines socket / sendfile / memcpy':40s} {size // MiB:>5d}MiB "
              f"{med[0]:.2f} / {med[1]:.2f} / {med[2]:.2f} GB/s; CPU s/GiB "
              f"{cpu_med[0]:.2f} / {cpu_med[1]:.2f} / {cpu_med[2]:.2f}")
    report.print_goals()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
