"""Worker pools: the same short run, driven from Python (`orchestrator.run.api`), on pooled trainer-rank and
rollout-engine processes (`WorkerPools`, kept between runs) against fresh ones (each run starts its own, as
`tide run` does), alternating in one process: seconds per run and the machine's busy CPU-seconds per run.

    .venv/bin/python scripts/bench_pools.py [--quick]     writes bench_results/pools.json

The job is configs/quickstart.yaml cut to a few iterations (a sweep's or a notebook's short run, where start-up
weighs most), seeded and deterministic: every run of either side must end with the same parameter digests, or the
benchmark fails (equal work). The pools' first run starts their processes and is not counted (a sweep pays it once);
the driver's own imports are paid once by this process on both sides. Reported, no goal (no issue sets one).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, alternate, bench_arguments, repeats_for  # noqa: E402


def busy_cpu_seconds() -> float:
    """Seconds of CPU the whole machine has spent busy since boot (every process: the ranks' and engines' too)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def main() -> None:
    args = bench_arguments(__doc__).parse_args()
    import ray

    from orchestrator.run import api
    from orchestrator.workers.pools import WorkerPools

    quick = args.quick
    repeats = repeats_for(quick)
    iterations = 2 if quick else 4
    report = Report("pools", quick)
    tmp = Path(tempfile.mkdtemp(prefix="bench_pools_"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    pools = WorkerPools()
    digests: dict[str, list] = {"pooled": [], "fresh": []}
    cpu: dict[str, list[float]] = {"pooled": [], "fresh": []}
    count = [0]

    def one_run(side: str, counted: bool = True) -> float:
        count[0] += 1
        run_dir = tmp / f"{side}-{count[0]}"
        overrides = [f"iterations={iterations}", f"save_every={iterations}",
                     f"publish.shm_root=/dev/shm/tide-bench-pools-{os.getpid()}-{count[0]}"]
        c0, t0 = busy_cpu_seconds(), time.perf_counter()
        api.run(ROOT / "configs" / "quickstart.yaml", overrides, run_dir=run_dir,
                pools=pools if side == "pooled" else None)
        seconds, cpu_seconds = time.perf_counter() - t0, busy_cpu_seconds() - c0
        digests[side].append(json.loads((run_dir / "final.json").read_text())["parameter_digests"])
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"{side:>6}: {seconds:6.1f} s, {cpu_seconds:6.1f} CPU-s{'' if counted else ' (not counted)'}", flush=True)
        if counted:
            cpu[side].append(cpu_seconds)
        return seconds

    try:
        one_run("pooled", counted=False)  # starts the pools' processes: a sweep's first run
        pooled, fresh = alternate(lambda: one_run("pooled"), lambda: one_run("fresh"), repeats)
    finally:
        pools.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    first = digests["fresh"][0]
    same = all(d == first for side in digests.values() for d in side)
    report.note("equal_work", {"parameter_digests_equal": same, "runs": {k: len(v) for k, v in digests.items()}})
    if not same:
        raise SystemExit("pooled and fresh runs ended with different parameters: not the same work")
    report.note("job", {"config": "configs/quickstart.yaml", "iterations": iterations, "repeats": repeats})
    report.add(f"a {iterations}-iteration quickstart run", "pooled workers", "fresh workers", "seconds per run",
               pooled, fresh, higher_is_better=False)
    report.add(f"a {iterations}-iteration quickstart run", "pooled workers", "fresh workers",
               "busy CPU-seconds per run (whole machine)", cpu["pooled"], cpu["fresh"], higher_is_better=False)
    out = report.write()
    for row in report.results:
        print(f"{row['metric']}: pooled {row['contender_median']:.1f} vs fresh {row['baseline_median']:.1f} "
              f"(ratio {row['ratio']:.2f})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
