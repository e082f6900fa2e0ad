"""How many cores each phase of a lockstep run keeps busy, and the most an overlap of rollout with the rest of the
iteration (issue 34's asynchronous actor-learner) could gain on this machine.

    .venv/bin/python scripts/measure_overlap_bound.py [--config configs/quickstart.yaml] [key=value ...]

Runs `tide run` on the config (overrides as `tide run` takes them) and samples, every --interval seconds, the CPU
time of every process of the run (the driver, Ray's own processes, trainer ranks, engines, a sandbox) and the
phase status.json names; each sample's CPU time goes to the phase current when it was taken, split by role
(engines and trainer ranks by the pids status.json lists, everything else `other`). Per phase: wall seconds
(timings.jsonl), CPU seconds and cores in use (CPU / wall). Then the bound, over the iterations after the first
(start-up and compilation excluded): with rollout overlapping the rest of the iteration (reward, train,
publish, sync, ...), an iteration takes at least max(rollout, rest, CPU of both / cores), so the speed-up over
lockstep is at most (rollout + rest) / that. Overlap only gains where a phase leaves a core idle.
Writes bench_results/overlap_bound.json (--out).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from orchestrator.records.rundir import read_jsonl  # noqa: E402

ROLLOUT = "rollout"


def tree_cpu(root: psutil.Process, engines: set[int], trainers: set[int]) -> dict[int, tuple[str, float]]:
    """Per live process under `root`: its role and CPU seconds (user + system)."""
    out: dict[int, tuple[str, float]] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        role = "engine" if p.pid in engines else "trainer" if p.pid in trainers else "other"
        out[p.pid] = (role, t.user + t.system)
    return out


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def measure(config: Path, overrides: list[str], interval: float, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "orchestrator.run.cli", "run", str(config), *overrides, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    root = psutil.Process(proc.pid)
    cpu = defaultdict(lambda: defaultdict(float))  # (iteration, phase) -> role -> CPU seconds
    last: dict[int, tuple[str, float]] = {}
    try:
        while proc.poll() is None:
            status = _status(run_dir)
            now = tree_cpu(root, set(status.get("engine_pids") or []), set(status.get("trainer_pids") or []))
            key = (status.get("iteration", 0), status.get("phase", "startup"))
            for pid, (role, seconds) in now.items():
                cpu[key][role] += max(0.0, seconds - last.get(pid, (role, 0.0))[1])
            last = now
            time.sleep(interval)
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        raise
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}): {proc.stderr.read()[-3000:]}")
    wall = {(t["iteration"], t["phase"]): t["seconds"] for t in read_jsonl(run_dir / "timings.jsonl")}
    return {"cpu": {f"{it}/{ph}": dict(v) for (it, ph), v in cpu.items()},
            "wall": {f"{it}/{ph}": s for (it, ph), s in wall.items()}}


def bound(samples: dict, cores: int) -> dict:
    """Per phase (over the iterations after the first): wall and CPU seconds, cores in use; the overlap bound."""
    wall, cpu = samples["wall"], samples["cpu"]
    iterations = sorted({int(k.split("/")[0]) for k in wall if int(k.split("/")[0]) > 1})
    phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key, seconds in wall.items():
        it, phase = key.split("/", 1)
        if int(it) in iterations:
            phases[phase]["wall_s"] += seconds
            for role, s in cpu.get(key, {}).items():
                phases[phase][f"cpu_{role}_s"] += s
    table = {}
    for phase, f in phases.items():
        used = sum(v for k, v in f.items() if k.startswith("cpu_"))
        table[phase] = {"wall_s_per_iteration": f["wall_s"] / len(iterations),
                        "cpu_s_per_iteration": used / len(iterations),
                        "cores_in_use": used / f["wall_s"] if f["wall_s"] else 0.0,
                        **{k.replace("_s", "_cores"): v / f["wall_s"] for k, v in f.items()
                           if k.startswith("cpu_") and f["wall_s"]}}
    rollout = table.get(ROLLOUT, {"wall_s_per_iteration": 0.0, "cpu_s_per_iteration": 0.0})
    rest_wall = sum(v["wall_s_per_iteration"] for k, v in table.items() if k != ROLLOUT)
    rest_cpu = sum(v["cpu_s_per_iteration"] for k, v in table.items() if k != ROLLOUT)
    lockstep = rollout["wall_s_per_iteration"] + rest_wall
    floor = max(rollout["wall_s_per_iteration"], rest_wall, (rollout["cpu_s_per_iteration"] + rest_cpu) / cores)
    return {"iterations": len(iterations), "cores": cores, "phases": table,
            "lockstep_s_per_iteration": lockstep, "overlapped_floor_s_per_iteration": floor,
            "speedup_bound": lockstep / floor if floor else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "quickstart.yaml")
    ap.add_argument("overrides", nargs="*", help="key.path=value, as `tide run` takes them")
    ap.add_argument("--interval", type=float, default=0.02)
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results" / "overlap_bound.json")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="tide-overlap-") as tmp:
        samples = measure(args.config, args.overrides, args.interval, Path(tmp) / "run")
    result = {"config": str(args.config), "overrides": args.overrides, **bound(samples, cores), "samples": samples}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'phase':<14}{'wall s/it':>10}{'cores':>8}{'engine':>8}{'trainer':>8}{'other':>8}")
    for phase, f in sorted(result["phases"].items(), key=lambda kv: -kv[1]["wall_s_per_iteration"]):
        print(f"{phase:<14}{f['wall_s_per_iteration']:>10.3f}{f['cores_in_use']:>8.2f}"
              + "".join(f"{f.get(f'cpu_{r}_cores', 0.0):>8.2f}" for r in ("engine", "trainer", "other")))
    print(f"lockstep {result['lockstep_s_per_iteration']:.3f} s/it; rollout overlapped with the rest, at least "
          f"{result['overlapped_floor_s_per_iteration']:.3f} s/it on {cores} cores: speed-up at most "
          f"{result['speedup_bound']:.2f}x ({result['iterations']} iterations); wrote {args.out}")


if __name__ == "__main__":
    main()
