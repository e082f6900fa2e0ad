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
Variants: lockstep; max_staleness 1 disaggregated and colocated, each with pi_old recomputed (`one_step_*`) and
interpolated in the train step (`loglinear_*`, rollout.proximal); max_staleness 2 with partial rollouts (a
generation gets half its token budget per sampling and is continued in the next), disaggregated; lockstep
disaggregated; max_staleness 1 with the weights taken in flight as soon as published (`in_flight_disaggregated`:
rollout.weight_update in_flight, PipelineRL's way, which timing decides, so with deterministic false, the only
variant that differs from lockstep there: prefix caching on, torch's deterministic algorithms off), its share of
tokens sampled by the training policy itself reported beside it.
Goals (issue 34): samples/s of max_staleness 1 (disaggregated; a goal per proximal) >= 1.3x lockstep's on the
long-tail and the tool-heavy jobs, and of max_staleness 2 with partial rollouts on the long-tail job; reward
gain (mean reward of the last 10 iterations minus the first 10) at equal samples >= 0.9x lockstep's on the
70-iteration quickstart (full mode only).
Weight-update latency (`--jobs update_latency`, full mode only): bench_e2e's ~100M job in lockstep with the
shipped sync (reload), per iteration from the end of its train step to the end of its sync (publish, then every
engine holding the new weights; its next rollout generates with them), with the sync's verify and load, beside
the floor measured right after each run: the checkpoint's bytes copied once between two buffers in memory. A copy
from a file in /dev/shm into a new one is reported beside it, not as the floor: the new file's pages are allocated
and zeroed as it is written, and tide's publish, which writes into recycled pages, beats it (measured: 0.08 s
against 0.19 s for 434 MB). Goal (issue 34): latency <= 2x the floor.
Against TRL (`--jobs trl_100m`, full mode only): bench_e2e's ~100M job (its 40-step warm start gives every
iteration a learning signal, so both sides take all 4 optimizer steps), 6 iterations, tide in lockstep and with
max_staleness 1 (colocated, disaggregated), then TRL's GRPOTrainer in its own process, per seed; RL-iteration time
as bench_e2e defines it (median time between consecutive iterations' rewards), each tide run's cores by role.
Goal (issue 34): TRL / tide >= 1.3 for tide as its users run it (lockstep, the default); the overlapped variants
are reported beside it. Not in this script yet, so no figure is claimed: max_staleness 2 on the tool-heavy job
(partial rollouts of multi-turn trajectories are not built).
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, bench_arguments, ratio_of, repeats_for  # noqa: E402
from bench_e2e import LARGE_UPDATES, large_job, run_trl_process, tide_timeline  # noqa: E402
from measure_overlap_bound import bound, measure  # noqa: E402  (its phase table; its bound assumes lockstep's speeds)

from orchestrator.run.wall_time import iteration_ends  # noqa: E402
from orchestrator.records.rundir import read_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SPEEDUP_TARGET, LEARNING_TARGET = 1.3, 0.9
ONE_STEP = ["rollout.max_staleness=1", "rollout.mismatch_correction=tis"]
# max_staleness 2 with partial rollouts: a generation gets half its token budget per sampling (the default)
PARTIAL = ["rollout.max_staleness=2", "rollout.partial_rollout=true", "rollout.mismatch_correction=tis"]
DISAGGREGATED = ["placement.mode=disaggregated"]
LOGLINEAR = ["rollout.proximal=loglinear"]  # pi_old interpolated in the train step, not recomputed
# the weights taken as soon as published: where the switch lands depends on timing (deterministic runs need a fixed
# rollout.in_flight_step, where the engines would wait for the train step)
IN_FLIGHT = ["rollout.weight_update=in_flight", "deterministic=false"]
VARIANTS = {  # name -> overrides; "lockstep" is every row's baseline
    "lockstep": [],
    "one_step_disaggregated": ONE_STEP + DISAGGREGATED,
    "loglinear_disaggregated": ONE_STEP + LOGLINEAR + DISAGGREGATED,
    "partial_disaggregated": PARTIAL + DISAGGREGATED,
    "in_flight_disaggregated": ONE_STEP + IN_FLIGHT + DISAGGREGATED,
    "one_step_colocated": ONE_STEP,
    "loglinear_colocated": ONE_STEP + LOGLINEAR,
    "lockstep_disaggregated": DISAGGREGATED,
}
ONE_STEP_VARIANTS = ("one_step_disaggregated", "loglinear_disaggregated")  # the goals' max_staleness 1 sides
JOBS = {  # name -> (config, overrides, iterations in full mode, in quick mode)
    "long_tail": ("quickstart.yaml", ["rollout.max_new_tokens=256", "model.tiny.max_position_embeddings=512",
                                      "trainer.warmup_sft_steps=5", "trainer.micro_batch_tokens=4096"], 12, 0),
    # multi-turn: up to 3 turns of model output and python tool calls run in the run's sandbox service
    "tool_heavy": ("tool_calc.yaml", ["eval.every=0"], 10, 0),
    "quickstart": ("quickstart.yaml", [], 70, 10),
}
QUICK_VARIANTS = ("lockstep", "one_step_disaggregated")
# not built: partial rollouts of multi-turn trajectories, weights taken in flight by them
NOT_WITH = {("tool_heavy", "partial_disaggregated"), ("tool_heavy", "in_flight_disaggregated")}
LATENCY_JOB, LATENCY_ITERATIONS, LATENCY_TARGET = "update_latency", 6, 2.0  # latency <= 2x the copy floor
# bench_e2e's ~100M job against TRL's GRPOTrainer: TRL / tide RL-iteration time >= 1.3 (tide as users run it)
TRL_JOB, TRL_ITERATIONS, TRL_TARGET = "trl_100m", 6, 1.3
# both sides' process trees sampled this often, alike: the sampler shares the 2 cores with what it measures (at the
# other jobs' 0.05 s, tide's lockstep ~100M iteration took 5.7 s against 5.2 s unsampled in a one-seed probe)
CPU_INTERVAL = 0.5
TRL_VARIANTS = ("lockstep", "one_step_colocated", "one_step_disaggregated", "loglinear_colocated",
                "loglinear_disaggregated")
GAIN_WINDOW = 10  # iterations averaged at each end of a run for its reward gain
CORES = len(os.sched_getaffinity(0))


def cores_by_role(samples: dict, ends: dict[int, float], last: int) -> dict[str, float]:
    """Cores each role kept busy over iterations 2..`last` (from the end of iteration 1 to the end of `last`),
    from `measure`'s CPU seconds per (iteration, phase) and role."""
    cpu: dict[str, float] = {}
    for key, roles in samples["cpu"].items():
        if 2 <= int(key.split("/")[0]) <= last:
            for role, seconds in roles.items():
                cpu[role] = cpu.get(role, 0.0) + seconds
    return {role: seconds / (ends[last] - ends[1]) for role, seconds in sorted(cpu.items())}


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
    rewards = [m["reward_mean"] for m in metrics]
    window = min(GAIN_WINDOW, len(rewards) // 2)
    tokens = sum(m["completion_len"] * m["samples"] for m in metrics if m["iteration"] in steady)
    out = {"samples_per_s": trained / steady_s, "tokens_per_s": tokens / steady_s,
           "seconds_per_iteration": steady_s / len(steady),
           "cores": cores_by_role(samples, ends, iterations - 1),
           "reward_gain": statistics.fmean(rewards[-window:]) - statistics.fmean(rewards[:window]),
           # over every sample the run trained (with partial rollouts the batches differ in size)
           "completion_len": sum(m["completion_len"] * m["samples"] for m in metrics) / sum(m["samples"]
                                                                                             for m in metrics),
           "completion_len_steady": tokens / trained,
           "completion_len_max": max(m["completion_len_max"] for m in metrics),
           "clipped_ratio": statistics.fmean(m["clipped_ratio"] for m in metrics),
           "staleness_max": max(m.get("staleness_token_max", m.get("staleness", 0)) for m in metrics),
           # weights taken in flight: the share of trained tokens sampled by the policy that trained them
           "fresh_token_share": statistics.mean(m.get("staleness_tokens_0", float(not m.get("staleness", 0)))
                                                for m in metrics if m["iteration"] in steady),
           "partial_share": statistics.fmean(m.get("partial_share", 0.0) for m in metrics),
           "phases": bound(samples, CORES)["phases"] if variant == "lockstep" else None}
    # wall >= CPU seconds / cores: the speed-up this run could still reach doing the same CPU work on idle cores
    out["speedup_bound_at_this_work"] = CORES / sum(out["cores"].values())
    print(f"  {job:<11}{variant:<24}seed {seed}: {out['samples_per_s']:7.1f} samples/s "
          f"{out['tokens_per_s']:7.0f} tokens/s "
          f"({out['seconds_per_iteration']:.3f} s/it), cores " +
          " ".join(f"{r} {c:.2f}" for r, c in out["cores"].items()) +
          f", reward gain {out['reward_gain']:+.3f}, mean length {out['completion_len']:.1f}", flush=True)
    return out


def against_trl(seed: int, iterations: int, variants: tuple[str, ...], work: Path) -> dict:
    """bench_e2e's ~100M job (its learning signal makes both sides take every optimizer step): each tide variant
    (`tide run`, its cores sampled) and TRL's GRPOTrainer (bench_e2e's process, as its users run it) on the same
    config and seed. RL-iteration time on both sides as bench_e2e defines it: the median time between consecutive
    iterations' rewards; a tide run with an iteration of fewer optimizer steps than TRL's counts as no figure."""
    cfg = large_job(seed, iterations)
    out: dict = {"seed": seed, "tide": {}}
    for variant in variants:
        cfg["name"] = f"trl_100m_{variant}_{seed}"
        path, run_dir = work / f"{cfg['name']}.yaml", work / cfg["name"]
        path.write_text(yaml.safe_dump(cfg))
        samples = measure(path, VARIANTS[variant], CPU_INTERVAL, run_dir)
        run = tide_timeline(run_dir, 0.0, math.nan)  # its iteration times are differences: any origin does
        ends = iteration_ends(read_jsonl(run_dir / "timings.jsonl"))
        out["tide"][variant] = {
            "iteration_s": run.equal_work_iteration_s(LARGE_UPDATES), "optimizer_steps": run.optimizer_steps,
            "cores": cores_by_role(samples, ends, iterations),
            "phases": bound(samples, CORES)["phases"] if variant == "lockstep" else None}
        print(f"  {TRL_JOB} {variant:<24}seed {seed}: {run.iteration_s():.2f} s/iteration, optimizer steps "
              f"{run.optimizer_steps}, cores " + " ".join(f"{r} {c:.2f}" for r, c in out["tide"][variant]
                                                          ["cores"].items()), flush=True)
    cfg["name"] = f"trl_100m_trl_{seed}"
    trl = run_trl_process(cfg, work / "trl", cpu_interval=CPU_INTERVAL)
    # iterations 2..N, as tide's cores are counted
    cores = trl.cores_between(trl.reward_times[0], trl.reward_times[-1])
    out["trl"] = {"iteration_s": trl.iteration_s(), "process_s": trl.process_s, "cores": cores}
    print(f"  {TRL_JOB} {'trl GRPOTrainer':<24}seed {seed}: {trl.iteration_s():.2f} s/iteration, cores {cores:.2f}",
          flush=True)
    return out


def update_latency(seed: int, iterations: int, work: Path) -> dict:
    """bench_e2e's ~100M job in lockstep: median over iterations 2..N of train end -> sync end, its publish and
    sync, and the floor measured right after it on the same machine (best of 3 copies)."""
    cfg = large_job(seed, iterations)
    cfg["name"] = f"update_latency_{seed}"
    path, run_dir = work / f"{cfg['name']}.yaml", work / cfg["name"]
    path.write_text(yaml.safe_dump(cfg))
    measure(path, [], 0.05, run_dir)
    out = {"seed": seed, **latency_figures(read_jsonl(run_dir / "timings.jsonl"), iterations)}
    nbytes = out["bytes"]
    out |= {"floor_s": memcpy_floor(nbytes), "new_file_copy_s": new_file_copy(nbytes)}
    print(f"  update_latency seed {seed}: {out['latency_s']:.3f} s (publish {out['publish_s']:.3f}, sync "
          f"{out['sync_s']:.3f}: verify {out['verify_s']:.3f}, load {out['load_s']:.3f}) for {nbytes / 2**20:.0f} "
          f"MB; floor {out['floor_s']:.3f} s (a copy into a new /dev/shm file: {out['new_file_copy_s']:.3f} s)",
          flush=True)
    return out


def latency_figures(timings: list[dict], iterations: int) -> dict:
    """From a lockstep run's timings: per iteration 2..N, the end of its sync minus the end of its train step
    (the median, and each); the median publish, sync and the sync's verify and load; the checkpoint's bytes."""
    phases = {(t["iteration"], t["phase"]): t for t in timings}
    end = {key: t["start"] + t["seconds"] for key, t in phases.items()}
    its = range(2, iterations + 1)
    latency = [end[(it, "sync")] - end[(it, "train")] for it in its]
    sync_part = {part: statistics.median(phases[(it, "sync")].get("parts", {}).get(part, math.nan) for it in its)
                 for part in ("verify", "load")}
    return {"latency_s": statistics.median(latency), "latency_per_iteration_s": latency,
            "publish_s": statistics.median(phases[(it, "publish")]["seconds"] for it in its),
            "sync_s": statistics.median(phases[(it, "sync")]["seconds"] for it in its),
            **{f"{part}_s": v for part, v in sync_part.items()}, "bytes": phases[(iterations, "publish")]["bytes"]}


def new_file_copy(nbytes: int, repeats: int = 3) -> float:
    """Seconds to copy `nbytes` once from a file in /dev/shm into a new file there (the kernel's copy, the new
    file's pages allocated as it is written); the best of `repeats`."""
    best = math.inf
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tide-bench-floor-") as d:
        src = Path(d) / "src"
        chunk = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
        with open(src, "wb") as f:
            for left in range(nbytes, 0, -len(chunk)):
                f.write(chunk[:left])
        for k in range(repeats):
            dst = Path(d) / f"copy{k}"
            t0 = time.perf_counter()
            shutil.copyfile(src, dst)
            best = min(best, time.perf_counter() - t0)
            dst.unlink()
    return best


def memcpy_floor(nbytes: int, repeats: int = 3) -> float:
    """The copy floor: seconds to copy `nbytes` once between two numpy buffers in memory (the destination's
    pages touched before, as recycled shared memory's are); the best of `repeats`."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--jobs", nargs="+", choices=[*JOBS, LATENCY_JOB, TRL_JOB],
                    default=[*JOBS, LATENCY_JOB, TRL_JOB],
                    help="the jobs to run")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="the variants to run (lockstep always)")
    ap.add_argument("--repeats", type=int, help="seeds per variant (default: 5, 3 with --quick)")
    ap.add_argument("--out", help="the JSON report's path (default: bench_results/async.json)")
    args = ap.parse_args()
    report = Report("async", args.quick, out=args.out)
    repeats = args.repeats or repeats_for(args.quick)
    variants = QUICK_VARIANTS if args.quick else tuple(VARIANTS)
    if args.variants:
        variants = ("lockstep", *[v for v in args.variants if v != "lockstep"])
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tide-bench-async-") as tmp:
        for job in [j for j in args.jobs if j in JOBS]:
            full_its, quick_its = JOBS[job][2:]
            iterations = quick_its if args.quick else full_its
            if not iterations:
                continue
            for i in range(repeats):  # A B C D, A B C D, ...: every variant of a repeat on the same seed
                for variant in [v for v in variants if (job, v) not in NOT_WITH]:
                    runs.setdefault((job, variant), []).append(run_once(job, variant, iterations, 1 + i,
                                                                        Path(tmp)))
        # the ~100M job's weight updates, each seed's floor measured right after its run
        latency = [update_latency(1 + i, LATENCY_ITERATIONS, Path(tmp)) for i in range(repeats)] \
            if LATENCY_JOB in args.jobs and not args.quick else []
        trl_variants = tuple(v for v in TRL_VARIANTS if v in variants)
        against = [against_trl(1 + i, TRL_ITERATIONS, trl_variants, Path(tmp)) for i in range(repeats)] \
            if TRL_JOB in args.jobs and not args.quick else []
    for (job, variant), rs in runs.items():
        if variant == "lockstep":
            continue
        base = runs[(job, "lockstep")]
        row = report.add(f"{job}: {variant}", variant, "lockstep", "samples per second",
                         [r["samples_per_s"] for r in rs], [r["samples_per_s"] for r in base],
                         cores_contender=[r["cores"] for r in rs], cores_baseline=[r["cores"] for r in base],
                         staleness_max=max(r["staleness_max"] for r in rs),
                         fresh_token_share=[r["fresh_token_share"] for r in rs])
        report.add(f"{job}: {variant}, tokens", variant, "lockstep", "completion tokens trained per second",
                   [r["tokens_per_s"] for r in rs], [r["tokens_per_s"] for r in base],
                   completion_len_steady_contender=[r["completion_len_steady"] for r in rs],
                   completion_len_steady_baseline=[r["completion_len_steady"] for r in base])
        if job in ("long_tail", "tool_heavy") and variant in ONE_STEP_VARIANTS:
            report.goal(f"{job} samples/s, max_staleness 1 ({variant}) / lockstep", row["ratio"], SPEEDUP_TARGET,
                        row=row)
        if job == "long_tail" and variant == "partial_disaggregated":
            report.goal(f"{job} samples/s, max_staleness 2 with partial rollouts / lockstep", row["ratio"],
                        SPEEDUP_TARGET, row=row)
        # what each side learned beside its speed (a speed-up that stops learning is none); the goal on the
        # quickstart, the job long enough for it
        gains = report.add(f"{job}: {variant} reward gain", variant, "lockstep",
                           f"reward gain (mean reward of the last {GAIN_WINDOW} iterations, at most half the run, "
                           f"minus the first)", [r["reward_gain"] for r in rs], [r["reward_gain"] for r in base])
        if job == "quickstart" and not args.quick and variant.startswith(("one_step", "loglinear")):
            report.goal(f"reward gain at equal samples, {variant} / lockstep", gains["ratio"], LEARNING_TARGET,
                        row=gains)
    if latency:
        row = report.add("weight-update latency, ~100M (train step done -> engines on the new weights)",
                         "tide (reload)", "copy floor", "seconds", [r["latency_s"] for r in latency],
                         [r["floor_s"] for r in latency], higher_is_better=False,
                         checkpoint_bytes=latency[0]["bytes"],
                         **{k: statistics.median(r[k] for r in latency)
                            for k in ("publish_s", "sync_s", "verify_s", "load_s", "new_file_copy_s")})
        report.goal(f"weight-update latency at ~100M: copy floor / latency (latency <= {LATENCY_TARGET:g}x the floor)",
                    1.0 / row["ratio"], 1.0 / LATENCY_TARGET, row=row)
        report.note("update_latency_runs", latency)
    for variant in against[0]["tide"] if against else ():
        row = report.add(f"{TRL_JOB}: tide {variant} against TRL", f"tide {variant}", "trl GRPOTrainer",
                         "seconds between consecutive iterations' rewards (bench_e2e's ~100M job)",
                         [r["tide"][variant]["iteration_s"] for r in against],
                         [r["trl"]["iteration_s"] for r in against],
                         higher_is_better=False, cores_contender=[r["tide"][variant]["cores"] for r in against],
                         cores_baseline=[r["trl"]["cores"] for r in against],
                         tide_optimizer_steps=[r["tide"][variant]["optimizer_steps"] for r in against])
        if variant == "lockstep":  # tide as its users run it (the default); the overlapped variants are reported
            report.goal(f"~100M job: TRL / tide RL-iteration time (tide {variant})", ratio_of(1.0, row["ratio"]),
                        TRL_TARGET, row=row)
    if against:
        report.note("trl_100m_runs", against)
    report.note("runs", {f"{job}/{variant}": rs for (job, variant), rs in runs.items()})
    report.note("not_measured", ["max_staleness 2 on tool_heavy (partial rollouts of multi-turn trajectories are not "
                                 "built)"])
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
