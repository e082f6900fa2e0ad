"""Asynchronous actor-learner (issue 34): the same job and samples in lockstep (rollout.max_staleness 0) and with
the next batch sampled while this one trains (max_staleness 1), colocated (engines and trainer ranks take turns on
all cores) and disaggregated (placement.mode: engines on half the cores, ranks on the others), alternating.

    .venv/bin/python scripts/bench_async.py [--quick]     writes bench_results/async.json

Each run is `tide run` as a user starts it (a shipped config with overrides), its processes' CPU time sampled by
phase and role as scripts/measure_overlap_bound.py samples it. Jobs:
- `quickstart`: configs/quickstart.yaml (64 prompts x 8 samples, 4 new tokens): short completions, train-heavy.
- `long_tail`: the same with up to 256 new tokens after a 5-step warm start, whose policy ends most completions
  within a few dozen tokens and lets a few run to the limit (mean and longest length, share at the limit); the
  trainer's micro-batches by a token budget (trainer.micro_batch_tokens), as such a job is configured.
- `tool_heavy`: configs/tool_calc.yaml (32 prompts x 8 trajectories of up to 3 turns, python tool calls run in
  the run's sandbox service), its eval off.
Figures per run, over iterations 2..N-1 (start-up, compilation and the final checkpoint and export excluded):
samples per second (samples trained / seconds from the end of iteration 1 to the end of iteration N-1, every phase
included); the cores each role kept busy (engine, trainer, other: CPU seconds / those seconds), and the most a
run could still gain doing the same CPU work on its idle cores (cores / cores in use: wall >= CPU / cores).
Repeat i runs every variant with seed 1 + i.
Goals (issue 34): samples/s of max_staleness 1 (disaggregated) >= 1.3x lockstep's on the long-tail and the
tool-heavy jobs; reward gain (mean reward of the last 10 iterations minus the first 10) at equal samples >= 0.9x
lockstep's on the 70-iteration quickstart (full mode only). Not in this script yet, so no figure is claimed:
max_staleness 2 (not built), TRL on bench_e2e's job, weight-update latency against the copy floor.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, bench_arguments, repeats_for  # noqa: E402
from measure_overlap_bound import bound, measure  # noqa: E402  (its phase table; its bound assumes lockstep's speeds)

from orchestrator.rundir import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SPEEDUP_TARGET, LEARNING_TARGET = 1.3, 0.9
ONE_STEP = ["rollout.max_staleness=1", "rollout.mismatch_correction=tis"]
DISAGGREGATED = ["placement.mode=disaggregated"]
VARIANTS = {  # name -> overrides; "lockstep" is every row's baseline
    "lockstep": [],
    "one_step_disaggregated": ONE_STEP + DISAGGREGATED,
    "one_step_colocated": ONE_STEP,
    "lockstep_disaggregated": DISAGGREGATED,
}
JOBS = {  # name -> (config, overrides, iterations in full mode, in quick mode)
    "long_tail": ("quickstart.yaml", ["rollout.max_new_tokens=256", "model.tiny.max_position_embeddings=512",
                                      "trainer.warmup_sft_steps=5", "trainer.micro_batch_tokens=4096"], 12, 0),
    # multi-turn: up to 3 turns of model output and python tool calls run in the run's sandbox service
    "tool_heavy": ("tool_calc.yaml", ["eval.every=0"], 10, 0),
    "quickstart": ("quickstart.yaml", [], 70, 10),
}
QUICK_VARIANTS = ("lockstep", "one_step_disaggregated")
GAIN_WINDOW = 10  # iterations averaged at each end of a run for its reward gain
CORES = len(os.sched_getaffinity(0))


def iteration_ends(timings: list[dict]) -> dict[int, float]:
    """Each iteration's end: the latest end of its phases (a batch drawn ahead ends before its iteration does)."""
    ends: dict[int, float] = {}
    for t in timings:
        if isinstance(t.get("iteration"), int) and t["iteration"] > 0:
            ends[t["iteration"]] = max(ends.get(t["iteration"], 0.0), t["start"] + t["seconds"])
    return ends


def run_once(job: str, variant: str, iterations: int, seed: int, work: Path) -> dict:
    config, job_overrides = JOBS[job][:2]
    overrides = [*job_overrides, *VARIANTS[variant], f"iterations={iterations}", f"seed={seed}",
                 f"save_every={iterations}"]
    run_dir = work / f"{job}-{variant}-{seed}"
    samples = measure(CONFIGS / config, overrides, 0.02, run_dir)
    ends = iteration_ends(read_jsonl(run_dir / "timings.jsonl"))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steady = range(2, iterations)
    steady_s = ends[iterations - 1] - ends[1]
    trained = sum(m["samples"] for m in metrics if m["iteration"] in steady)
    cpu: dict[str, float] = {}
    for key, roles in samples["cpu"].items():
        if int(key.split("/")[0]) in steady:
            for role, s in roles.items():
                cpu[role] = cpu.get(role, 0.0) + s
    rewards = [m["reward_mean"] for m in metrics]
    window = min(GAIN_WINDOW, len(rewards) // 2)
    out = {"samples_per_s": trained / steady_s, "seconds_per_iteration": steady_s / len(steady),
           "cores": {role: s / steady_s for role, s in sorted(cpu.items())},
           "reward_gain": statistics.fmean(rewards[-window:]) - statistics.fmean(rewards[:window]),
           "completion_len": statistics.fmean(m["completion_len"] for m in metrics),
           "completion_len_max": max(m["completion_len_max"] for m in metrics),
           "clipped_ratio": statistics.fmean(m["clipped_ratio"] for m in metrics),
           "staleness_max": max(m.get("staleness", 0) for m in metrics),
           "phases": bound(samples, CORES)["phases"] if variant == "lockstep" else None}
    # wall >= CPU seconds / cores: the speed-up this run could still reach doing the same CPU work on idle cores
    out["speedup_bound_at_this_work"] = CORES / sum(out["cores"].values())
    print(f"  {job:<11}{variant:<24}seed {seed}: {out['samples_per_s']:7.1f} samples/s "
          f"({out['seconds_per_iteration']:.3f} s/it), cores " +
          " ".join(f"{r} {c:.2f}" for r, c in out["cores"].items()) +
          f", reward gain {out['reward_gain']:+.3f}, mean length {out['completion_len']:.1f}", flush=True)
    return out


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS), help="the jobs to run")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="the variants to run (lockstep always)")
    ap.add_argument("--repeats", type=int, help="seeds per variant (default: 5, 3 with --quick)")
    args = ap.parse_args()
    report = Report("async", args.quick)
    repeats = args.repeats or repeats_for(args.quick)
    variants = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    if args.variants:
        variants = ("lockstep", *[v for v in args.variants if v != "lockstep"])
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tide-bench-async-") as tmp:
        for job in args.jobs:
            full_its, quick_its = JOBS[job][2:]
            iterations = quick_its if args.quick else full_its
            if not iterations:
                continue
            for i in range(repeats):  # A B C D, A B C D, ...: every variant of a repeat on the same seed
                for variant in variants:
                    runs.setdefault((job, variant), []).append(run_once(job, variant, iterations, 1 + i,
                                                                        Path(tmp)))
    for (job, variant), rs in runs.items():
        if variant == "lockstep":
            continue
        base = runs[(job, "lockstep")]
        row = report.add(f"{job}: {variant}", variant, "lockstep", "samples per second",
                         [r["samples_per_s"] for r in rs], [r["samples_per_s"] for r in base],
                         cores_contender=[r["cores"] for r in rs], cores_baseline=[r["cores"] for r in base],
                         staleness_max=max(r["staleness_max"] for r in rs))
        if job in ("long_tail", "tool_heavy") and variant == "one_step_disaggregated":
            report.goal(f"{job} samples/s, max_staleness 1 / lockstep", row["ratio"], SPEEDUP_TARGET, row=row)
        if job == "quickstart" and not args.quick and variant.startswith("one_step"):
            gains = report.add(f"{job}: {variant} reward gain", variant, "lockstep",
                               f"reward gain (last {GAIN_WINDOW} - first {GAIN_WINDOW} iterations)",
                               [r["reward_gain"] for r in rs], [r["reward_gain"] for r in base])
            report.goal(f"reward gain at equal samples, {variant} / lockstep", gains["ratio"], LEARNING_TARGET,
                        row=gains)
    report.note("runs", {f"{job}/{variant}": rs for (job, variant), rs in runs.items()})
    report.note("not_measured", ["max_staleness 2 (not built)", "TRL / tide iteration time on bench_e2e's ~100M job",
                                 "weight-update latency against the copy floor"])
    report.finish()
    for (job, variant), rs in runs.items():
        cores = ", ".join(f"{role} {statistics.median(r['cores'].get(role, 0.0) for r in rs):.2f}"
                          for role in rs[0]["cores"])
        most = statistics.median(r["speedup_bound_at_this_work"] for r in rs)
        print(f"  {job} {variant}: cores in use {cores} of {CORES}; at that CPU work at most {most:.2f}x faster; "
              f"completion length mean {rs[0]['completion_len']:.1f}, max {rs[0]['completion_len_max']}, "
              f"{rs[0]['clipped_ratio']:.1%} at the limit")


if __name__ == "__main__":
    main()
