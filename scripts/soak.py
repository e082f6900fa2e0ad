"""Soak: a long run of a small job under `tide run --max-restarts`, with faults injected at seeded random
iterations, every process of the run sampled once per iteration; then the run is checked against an
uninterrupted run of the same config.

    .venv/bin/python scripts/soak.py --iterations 1000           # the quickstart job, five kinds of fault
    .venv/bin/python scripts/soak.py --quick                     # 16 iterations, two faults (about 2 minutes)

Faults (`--faults`, each injected once, in a seeded order at seeded iterations after the first checkpoint):
  engine_kill    SIGKILL of a rollout engine mid-rollout: replaced on its iteration, the run goes on
  engine_stop    SIGSTOP of an engine mid-rollout, longer than rollout.engine_call_timeout_s: taken for hung,
                 killed and replaced
  trainer_kill   SIGKILL of a trainer rank mid-train: the driver fails; the run restarts from its checkpoint
  corrupt_shard  bytes of the served iteration's shard in /dev/shm overwritten, then the engine killed: its
                 replacement refuses the shard (checksum), the driver fails, the run restarts
  shm_full       the publish root filled to its last megabyte before a publish: the publish fails, the run
                 restarts once the space is given back (when status.json says `restarting`). The root is a tmpfs
                 of its own (--shm-size-mb, mounted by the soak): here /dev/shm is as large as the RAM, and
                 filling it brings the kernel's OOM killer before any write fails (measured: it killed the soak)
  sandbox_kill   SIGKILL of the sandbox service during a reward phase (configs with a code sandbox only)
  ray_head_kill  SIGKILL of the run's Ray head (its GCS server) mid-train: the driver fails, the run restarts on
                 a new local cluster

Sampled per iteration: RSS, open descriptors and threads of every process under the supervisor (driver, Ray,
trainer ranks, engines, sandbox), /dev/shm use. Checked at the end: the run finished; its final parameter digests
and metrics (less `restarts`) equal the uninterrupted run's (deterministic mode: faults that only cost time
leave the data path alone); every process's RSS growth once it has run SETTLE iterations under 20 MB (not judged
with --quick: its processes are still warming up); nothing left behind (processes, /dev/shm, mounts, cgroups,
engines' temporary directories). Writes bench_results/soak.json.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import Report  # noqa: E402

from orchestrator.records.rundir import read_jsonl  # noqa: E402

KINDS = ("engine_kill", "engine_stop", "trainer_kill", "corrupt_shard", "shm_full", "sandbox_kill", "ray_head_kill")
PHASE = {"engine_kill": "rollout", "engine_stop": "rollout", "trainer_kill": "train", "corrupt_shard": "rollout",
         "shm_full": "train", "sandbox_kill": "reward", "ray_head_kill": "train"}
RSS_GROWTH_LIMIT_MB = 20.0
SHM = Path("/dev/shm")


@dataclass
class Fault:
    iteration: int
    kind: str
    injected_at: float | None = None
    target: str = ""  # what was hit (pid, file)
    note: str = ""
    effect: str = ""  # the restart it caused, or that the run absorbed it


@dataclass
class Proc:
    pid: int
    created: float
    name: str
    first_iteration: int
    rss_mb: dict[int, float] = field(default_factory=dict)  # iteration -> RSS
    fds: dict[int, int] = field(default_factory=dict)
    threads: dict[int, int] = field(default_factory=dict)


def plan(seed: int, iterations: int, save_every: int, kinds: list[str]) -> list[Fault]:
    """Distinct iterations after the first checkpoint, leaving a checkpoint's worth of iterations at the end."""
    rng = random.Random(seed)
    lo, hi = save_every + 2, iterations - save_every
    if hi - lo < len(kinds):
        raise SystemExit(f"{iterations} iterations leave no room for {len(kinds)} faults after iteration {lo}")
    its = sorted(rng.sample(range(lo, hi), len(kinds)))
    order = list(kinds)
    rng.shuffle(order)
    return [Fault(i, k) for i, k in zip(its, order)]


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _cgroups() -> set[str]:
    root = Path("/sys/fs/cgroup")
    return {str(p) for p in root.glob("*/*") if p.is_dir()} | {str(p) for p in root.glob("*") if p.is_dir()}


def _mounts() -> set[str]:
    return set(Path("/proc/mounts").read_text().splitlines())


def _rollout_dirs() -> set[str]:
    d = Path("/tmp/tide-rollout")
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


class Soak:
    def __init__(self, args: argparse.Namespace, config: Path, overrides: list[str], run_dir: Path, shm_root: Path,
                 faults: list[Fault]):
        self.args, self.config, self.overrides, self.run_dir, self.shm_root = args, config, overrides, run_dir, shm_root
        self.faults = faults
        self.procs: dict[tuple[int, float], Proc] = {}
        self.shm_used_mb: dict[int, float] = {}
        self.filler = shm_root / ".soak-filler"
        self.log: list[str] = []

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        self.log.append(line)
        print(line, flush=True)

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self, root_pid: int, iteration: int) -> None:
        for p in _descendants(root_pid):
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    proc = self.procs.get(key)
                    if proc is None:
                        cmd = " ".join(p.cmdline()[:3])[:120] or p.name()
                        proc = self.procs[key] = Proc(p.pid, key[1], cmd, iteration)
                    proc.rss_mb[iteration] = p.memory_info().rss / 2**20
                    proc.fds[iteration] = p.num_fds()
                    proc.threads[iteration] = p.num_threads()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.shm_used_mb[iteration] = shutil.disk_usage(SHM).used / 2**20

    # ---- faults ----------------------------------------------------------------------------------
    def inject(self, fault: Fault, status: dict) -> bool:
        """Inject `fault` if the run is where it needs to be; True once done."""
        if status.get("state") != "running" or status.get("phase") != PHASE[fault.kind]:
            return False
        kind = fault.kind
        if kind in ("engine_kill", "engine_stop", "corrupt_shard"):
            pids = status.get("engine_pids") or []
            if not pids:
                return False
            if kind == "corrupt_shard":
                fault.note = self._corrupt_served_shard(status)
            sig = signal.SIGSTOP if kind == "engine_stop" else signal.SIGKILL
            self._signal(pids[0], sig, fault)
        elif kind == "trainer_kill":
            self._signal((status.get("trainer_pids") or [None])[0], signal.SIGKILL, fault)
        elif kind == "sandbox_kill":
            self._signal(status.get("sandbox_pid"), signal.SIGKILL, fault)
        elif kind == "ray_head_kill":
            gcs = [p.pid for p in _descendants(self.supervisor_pid) if "gcs_server" in " ".join(_cmdline(p))]
            self._signal(gcs[0] if gcs else None, signal.SIGKILL, fault)
        elif kind == "shm_full":
            size = self._fill_shm()
            left = shutil.disk_usage(self.shm_root).free
            fault.target, fault.note = str(self.filler), f"{size / 2**20:.1f} MB filled, {left / 2**20:.1f} MB left"
        fault.injected_at = time.time()
        self.say(f"fault {kind} at iteration {status.get('iteration')}: {fault.target} {fault.note}")
        return True

    def _fill_shm(self, attempts: int = 50) -> int:
        """Fill the run's publish root to its last bytes with one file; the bytes filled. The run may be writing
        there meanwhile (status.json lags the run: a publish can be under way), so a fill that no longer fits
        (ENOSPC) is retried with what is free then."""
        for _ in range(attempts):
            size = shutil.disk_usage(self.shm_root).free
            with open(self.filler, "wb") as f:  # emptied: what a failed try allocated is free again
                try:
                    os.posix_fallocate(f.fileno(), 0, size)
                    return size
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        raise RuntimeError(f"shm_full: {self.shm_root} never held still long enough to be filled ({attempts} tries)")

    def _signal(self, pid: int | None, sig: int, fault: Fault) -> None:
        if pid is None:
            raise SystemExit(f"{fault.kind}: status.json names no process to hit ({self.run_dir})")
        fault.target = f"pid {pid} ({signal.Signals(sig).name})"
        os.kill(pid, sig)

    def _corrupt_served_shard(self, status: dict) -> str:
        """Overwrite bytes in the middle of the largest shard of the newest iteration in the run's /dev/shm."""
        shards = sorted(self.shm_root.glob("*/*/*.safetensors"), key=lambda p: (p.parent.name, p.stat().st_size))
        if not shards:
            return "no shard found"
        shard = shards[-1]
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(64))
        return f"64 bytes of {shard} overwritten"

    def release_shm(self) -> None:
        if self.filler.exists():
            self.filler.unlink()
            self.say("shm_full: the filler removed")

    # ---- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        cmd = [sys.executable, "-m", "orchestrator.run.cli", "run", str(self.config), *self.overrides, "--run-dir",
               str(self.run_dir), "--max-restarts", str(self.args.max_restarts), "--restart-backoff",
               str(self.args.restart_backoff)]
        with open(self.run_dir.parent / f"{self.run_dir.name}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.supervisor_pid = proc.pid
        pending = list(self.faults)
        sampled: set[int] = set()
        try:
            while proc.poll() is None:
                status = _status(self.run_dir)
                it = status.get("iteration", 0)
                if status.get("state") == "running" and it not in sampled and status.get("phase") == "rollout":
                    sampled.add(it)
                    self.sample(proc.pid, it)
                if pending and it >= pending[0].iteration and self.inject(pending[0], status):
                    pending.pop(0)
                if status.get("state") == "restarting":
                    self.release_shm()
                time.sleep(0.005)
        finally:
            self.release_shm()
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=300)
        for f in pending:
            f.note = "never injected: the run ended first"
        return proc.returncode


def _final(run_dir: Path) -> dict:
    path = run_dir / "final.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _metrics(run_dir: Path) -> list[dict]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for r in rows:
        r.pop("restarts", None)
    return rows


def growth(procs: dict, settle: int, span: int) -> list[dict]:
    """Per process sampled for at least `settle` + `span` iterations: RSS at its last sample minus at its
    `settle`-th (a process replaced by a fault counts on its own)."""
    out = []
    for p in procs.values():
        its = sorted(p.rss_mb)
        row = {"pid": p.pid, "name": p.name, "first_iteration": p.first_iteration, "iterations": len(its),
               "rss_first_mb": round(p.rss_mb[its[0]], 1), "rss_last_mb": round(p.rss_mb[its[-1]], 1),
               "fds_first": p.fds[its[0]], "fds_last": p.fds[its[-1]], "threads_first": p.threads[its[0]],
               "threads_last": p.threads[its[-1]]}
        if len(its) >= settle + span:
            base = its[settle]
            row |= {"from_iteration": base, "rss_growth_mb": round(p.rss_mb[its[-1]] - p.rss_mb[base], 2),
                    "fds_growth": p.fds[its[-1]] - p.fds[base], "threads_growth": p.threads[its[-1]] - p.threads[base],
                    # every tenth sample: the shape of the growth (a plateau or a slope)
                    "rss_mb_series": {i: round(p.rss_mb[i], 2) for i in its[::10] + its[-1:]}}
        out.append(row)
    return sorted(out, key=lambda r: -r.get("rss_growth_mb", float("-inf")))


def _plot(procs: dict, faults: list[Fault], shm_used_mb: dict[int, float], path: Path) -> Path:
    """RSS growth of the run's ten largest processes per iteration, each against its own first sample (a
    replaced process is a line of its own), the faults marked; /dev/shm use below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[3, 1])
    for p in sorted(procs.values(), key=lambda p: -max(p.rss_mb.values()))[:10]:
        its = sorted(p.rss_mb)
        top.plot(its, [p.rss_mb[i] - p.rss_mb[its[0]] for i in its],
                 label=f"{p.name.split()[0].split('/')[-1][:28]} ({p.pid}, {p.rss_mb[its[0]]:.0f} MB at first)")
    for ax in (top, bottom):
        for f in faults:
            if f.injected_at:
                ax.axvline(f.iteration, color="red", alpha=0.3)
    for f in faults:
        if f.injected_at:
            top.annotate(f.kind, (f.iteration, top.get_ylim()[1]), rotation=90, va="top", fontsize=7, color="red")
    top.set_ylabel("RSS above its first sample (MB)")
    top.legend(fontsize=7, loc="center right")
    its = sorted(shm_used_mb)
    bottom.plot(its, [shm_used_mb[i] for i in its])
    bottom.set_ylabel("/dev/shm used (MB)")
    bottom.set_xlabel("iteration (when sampled: a restart repeats iterations)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--faults", default=None, help="comma-separated, each once, of: " + ", ".join(KINDS) +
                    "; default: every kind but sandbox_kill (--quick: engine_kill, trainer_kill)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-restarts", type=int, default=5)
    ap.add_argument("--restart-backoff", type=float, default=2.0)
    ap.add_argument("--engine-call-timeout", type=float, default=20.0, help="rollout.engine_call_timeout_s")
    ap.add_argument("--shm-size-mb", type=int, default=256, help="with shm_full: the size of the tmpfs the soak "
                    "mounts as the run's publish root")
    ap.add_argument("--settle", type=int, default=100, help="iterations a process runs before its growth counts")
    ap.add_argument("--span", type=int, default=50, help="iterations after --settle a process must run for its "
                    "growth to be measured")
    ap.add_argument("--reference", type=Path, default=None, help="an uninterrupted run of the same config and "
                    "settings to compare with (default: run one first)")
    ap.add_argument("--work-dir", type=Path, default=None, help="default: /tmp/tide-soak-<pid>")
    ap.add_argument("--quick", action="store_true", help="16 iterations, checkpoints every 4, an engine and a "
                    "trainer rank killed, growth after 2 iterations over 4")
    ap.add_argument("--out", type=Path, default=None, help="default: bench_results/soak.json")
    args = ap.parse_args()
    if args.quick:
        args.iterations, args.save_every, args.settle, args.span = 16, 4, 2, 4
    if args.faults is None:
        args.faults = "engine_kill,trainer_kill" if args.quick else \
            "engine_kill,engine_stop,trainer_kill,corrupt_shard,shm_full"
    kinds = [k for k in args.faults.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"unknown fault kinds {unknown}; known: {', '.join(KINDS)}")
    if "shm_full" in kinds and os.geteuid() != 0:
        raise SystemExit("the shm_full fault mounts a tmpfs for the run's publish root: run as root, or leave it out")
    work = args.work_dir or Path(f"/tmp/tide-soak-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    faults = plan(args.seed, args.iterations, args.save_every, kinds)
    common = [f"iterations={args.iterations}", f"save_every={args.save_every}",
              f"rollout.engine_call_timeout_s={args.engine_call_timeout}"]
    report = Report("soak", quick=args.quick, out=args.out)

    before = {"pids": set(psutil.pids()), "mounts": _mounts(), "cgroups": _cgroups(), "rollout_dirs": _rollout_dirs(),
              "shm": {p.name for p in SHM.iterdir()}}
    reference = args.reference
    if reference is None:
        reference = work / "reference"
        shm = SHM / f"tide-soak-{os.getpid()}-ref"
        t0 = time.perf_counter()
        print(f"uninterrupted reference run: {reference}", flush=True)
        with open(work / "reference.log", "w") as log:
            rc = subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(args.config), *common,
                                 f"publish.shm_root={shm}", "--run-dir", str(reference)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise SystemExit(f"the reference run failed (exit {rc}): {work / 'reference.log'}")
        report.note("reference_seconds", time.perf_counter() - t0)

    shm_root = SHM / f"tide-soak-{os.getpid()}"
    mounted = "shm_full" in kinds
    if mounted:
        shm_root.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={args.shm_size_mb}m", "tide-soak", str(shm_root)],
                       check=True)
    soak = Soak(args, args.config, [*common, f"publish.shm_root={shm_root}"], work / "soak", shm_root, faults)
    print("faults: " + ", ".join(f"{f.kind}@{f.iteration}" for f in faults), flush=True)
    t0 = time.perf_counter()
    try:
        rc = soak.run()
    finally:
        left_in_root = sorted(str(p) for p in shm_root.rglob("*") if p != soak.filler) if shm_root.exists() else []
        if mounted:
            soak.release_shm()
            subprocess.run(["umount", str(shm_root)], check=True)
            shm_root.rmdir()
    seconds = time.perf_counter() - t0

    # ---- checks ------------------------------------------------------------------------------------
    status = _status(soak.run_dir)
    restarts = read_jsonl(soak.run_dir / "restarts.jsonl")
    for k, f in enumerate(faults):
        until = next((g.injected_at for g in faults[k + 1:] if g.injected_at), float("inf"))
        caused = [r for r in restarts if f.injected_at and f.injected_at <= r["time"] < until]
        f.effect = "; ".join(f"restart {r['restart']} from iteration {r['from_iteration']}: "
                             f"{r['error'].splitlines()[0][:200]}" for r in caused) or \
            ("absorbed: no restart" if f.injected_at else "")
    final, ref_final = _final(soak.run_dir), _final(reference)
    metrics, ref_metrics = _metrics(soak.run_dir), _metrics(reference)
    deadline = time.monotonic() + 60  # processes of the run: ended by the time the supervisor exits, give or take
    seen = {(p.pid, p.created) for p in soak.procs.values()}
    while time.monotonic() < deadline:
        left = []
        for pid, created in seen:
            try:
                if psutil.Process(pid).create_time() == created and psutil.Process(pid).status() != "zombie":
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left:
            break
        time.sleep(0.5)
    after = {"mounts": _mounts(), "cgroups": _cgroups(), "rollout_dirs": _rollout_dirs(),
             "shm": {p.name for p in SHM.iterdir()}}
    new = {k: sorted(after[k] - before[k]) for k in after}
    # What the run owns (its processes' pids in the name, its publish roots): judged. Whatever else appeared in
    # the meantime (another job on the machine, a concurrent test) is reported beside it.
    pids = {str(p.pid) for p in soak.procs.values()}

    def owned(entry: str) -> bool:
        return bool(set(re.split(r"[-/ ]", entry)) & pids) or f"tide-soak-{os.getpid()}" in entry

    leftovers = {
        "processes": sorted(left),
        "shm": [e for e in new["shm"] if owned(e)],
        "shm_root_files": left_in_root,
        "mounts": [e for e in new["mounts"] if owned(e)],
        "cgroups": [e for e in new["cgroups"] if owned(e)],
        "engine_tmp_dirs": [e for e in new["rollout_dirs"] if e.split("-")[0] in pids],
    }
    report.note("appeared_elsewhere", {k: [e for e in v if e not in leftovers.get(k, [])] for k, v in new.items()})
    grown = growth(soak.procs, args.settle, args.span)
    measured = [g for g in grown if "rss_growth_mb" in g]
    worst = max((g["rss_growth_mb"] for g in measured), default=float("nan"))
    checks = {
        "finished": rc == 0 and status.get("state") == "finished",
        "digests_equal": bool(final) and final.get("parameter_digests") == ref_final.get("parameter_digests"),
        "metrics_equal": bool(metrics) and metrics == ref_metrics,
        "nothing_left_behind": not any(leftovers.values()),
        "faults_injected": all(f.injected_at is not None for f in faults),
    }
    for name, ok in checks.items():
        report.goal(name, 1.0 if ok else 0.0, 1.0)
    # The memory target is for long runs: a quick run's processes are still filling their caches (an
    # engine grows ~60 MB over its first 50 iterations), so there the growth is reported, not judged
    growth_ratio = (RSS_GROWTH_LIMIT_MB / worst if worst > 0 else float("inf")) if measured else float("nan")
    if args.quick:
        report.note("rss_growth_vs_limit", {"limit_mb": RSS_GROWTH_LIMIT_MB, "worst_mb": worst, "judged": False})
    else:
        report.goal(f"every process's RSS growth after its {args.settle}th iteration under {RSS_GROWTH_LIMIT_MB:g} MB "
                    "(limit / worst)", growth_ratio, 1.0)
    report.note("config", {"config": str(args.config), "overrides": soak.overrides, "seed": args.seed,
                           "max_restarts": args.max_restarts, "restart_backoff_s": args.restart_backoff,
                           "settle_iterations": args.settle, "span_iterations": args.span})
    report.note("run", {"exit_code": rc, "seconds": seconds, "status": status, "run_dir": str(soak.run_dir),
                        "reference": str(reference), "iterations_recorded": len(metrics)})
    report.note("faults", [asdict(f) for f in faults])
    report.note("restarts", restarts)
    report.note("leftovers", leftovers)
    report.note("processes", grown)
    report.note("shm_used_mb", {"first": next(iter(soak.shm_used_mb.values()), None),
                                "max": max(soak.shm_used_mb.values(), default=None),
                                "last": list(soak.shm_used_mb.values())[-1] if soak.shm_used_mb else None})
    report.note("log", soak.log)
    out = report.write()
    plot = _plot(soak.procs, faults, soak.shm_used_mb, out.with_name(out.stem + "_rss.png"))
    print(f"\nsoak: exit {rc} after {seconds:.0f} s, {len(restarts)} restart(s), {len(metrics)} iterations recorded")
    for f in faults:
        print(f"  {f.kind:<14} iteration {f.iteration:>5}: {f.target} {f.note}\n{'':<17}-> {f.effect}")
    print(f"  processes measured: {len(measured)} of {len(grown)}; worst RSS growth {worst:.2f} MB")
    for g in measured[:5]:
        print(f"    {g['pid']:>7} {g['name'][:60]:<60} {g['rss_growth_mb']:+.2f} MB over {g['iterations']} its, "
              f"fds {g['fds_growth']:+d}, threads {g['threads_growth']:+d}")
    print(f"  leftovers: {json.dumps({k: v for k, v in leftovers.items() if v}) or 'none'}")
    report.print_goals()
    print(f"wrote {out} and {plot}")
    sys.exit(0 if all(g["met"] for g in report.goals) else 1)


if __name__ == "__main__":
    main()
