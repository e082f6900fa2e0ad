"""End to end against what a user would pick instead: TRL's GRPOTrainer and tide, each run the way its users run
it (a fresh process: `tide run config.yaml`; a Python script calling `GRPOTrainer.train()`), on the quickstart
job.

The job, the same on both sides (scripts/bench_sample_efficiency.py builds both): the quickstart's tiny model
and supervised warm start, the same prompts in the same order (64 per iteration, 8 samples each, 4 new tokens
at temperature 1), 4 optimizer steps per iteration (TRL: per_device_train_batch_size=128,
steps_per_generation=4), lr 1e-3 constant, no KL, token-level loss (TRL `loss_type="dapo"`, tide `grpo` +
`token_mean`), group-std advantages, gradient clipping 1.0, fp32 on CPU, fixed seeds; TRL otherwise at its
defaults (it generates with transformers on CPU).

Figures, per side and seed, from the moment the process is spawned:
- whole-process wall time (spawn to exit: imports, start-up, warm start, RL, saving);
- RL-iteration time: median time between consecutive iterations' rewards;
- wall time until the 5-iteration moving average of reward first reaches 0.4 and 0.5, counted from the start
  of RL (TRL: `train()` called; tide: the first rollout starts) -- the goal -- and from the spawn (reported).
  A run that never reaches it counts as infinite on either side.

A ~100M-parameter variant of the same job (hidden 768, 12 layers; 16 prompts x 8 samples per iteration to keep
it to minutes) measures the RL-iteration time. Only the iteration time is compared there, but both sides must do
the same work in it: tide takes no optimizer step on a mini-batch without learning signal (every advantage zero),
TRL steps regardless, so the variant warms up for 40 steps at lr 1e-3 (rewards ~0.1-0.2: most groups mixed) and
trains at lr 1e-5 (rewards stay there), and a tide iteration that took fewer optimizer steps than TRL's 4 makes
that run's figure a failed sample (inf).

Goals (issue 16): TRL time / tide time to a moving average of 0.5 >= 1.0 on the quickstart job; TRL / tide
RL-iteration time >= 2.0 at ~100M.

    python scripts/bench_e2e.py            # seeds 1 2 3 (70 iterations) and the ~100M variant (2 seeds)
    python scripts/bench_e2e.py --quick    # seed 1, 30 iterations, no ~100M variant (about 2 minutes)
"""
from __future__ import annotations

import gc
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, bench_arguments, ratio_of  # noqa: E402
from bench_sample_efficiency import (  # noqa: E402
    WINDOW, iterations_to_target, job_config, run_metrics, run_trl, tide_run)
from measure_overlap_bound import tree_cpu  # noqa: E402

TARGETS = (0.4, 0.5)
# optimizer steps per iteration on both sides (tide's updates_per_iteration, TRL's steps_per_generation)
LARGE_UPDATES = job_config(1, 1)["trainer"]["updates_per_iteration"]
LARGE_MODEL = {"hidden_size": 768, "num_layers": 12, "num_heads": 12, "num_kv_heads": 12, "intermediate_size": 3072}


@dataclass
class Timeline:
    """One run, in seconds since its process was spawned."""

    process_s: float
    rl_start: float
    rewards: list[float]  # one per iteration
    reward_times: list[float]  # when each iteration's rewards were known
    phase_medians: dict[str, float] | None = None  # tide: median seconds of each phase over the iterations
    optimizer_steps: list[int] | None = None  # tide: optimizer steps each iteration took (TRL: always all)
    cpu: list[tuple[float, float]] | None = None  # (seconds since spawn, process tree's CPU seconds), sampled

    def cores_between(self, start: float, end: float) -> float:
        """Cores the process tree kept busy from `start` to `end` (seconds since spawn), from the samples nearest
        inside them."""
        inside = [c for c in self.cpu or [] if start <= c[0] <= end]
        if len(inside) < 2:
            return math.nan
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def iteration_s(self) -> float:
        steps = [b - a for a, b in zip(self.reward_times, self.reward_times[1:])]
        return statistics.median(steps)

    def equal_work_iteration_s(self, updates: int) -> float:
        """iteration_s, or inf where an iteration took fewer than `updates` optimizer steps (TRL always takes
        them all: such a run did less work than TRL's and its time is no figure against TRL's)."""
        if self.optimizer_steps is not None and min(self.optimizer_steps) < updates:
            return math.inf
        return self.iteration_s()

    def time_to(self, target: float, from_spawn: bool = False) -> float:
        k = iterations_to_target(self.rewards, target, WINDOW)
        if math.isinf(k):
            return math.inf
        return self.reward_times[int(k) - 1] - (0.0 if from_spawn else self.rl_start)


def large_job(seed: int, iterations: int) -> dict:
    cfg = job_config(seed, iterations, "constant")
    cfg["name"] = f"e2e_large_{seed}"
    cfg["model"]["tiny"] = dict(LARGE_MODEL)
    # a learning signal in every iteration, so that both sides take all 4 optimizer steps (module docstring)
    cfg["trainer"].update(warmup_sft_steps=40, warmup_sft_lr=1.0e-3, lr=1.0e-5)
    cfg["rollout"].update(prompts_per_iteration=16, kv_cache_gb=2.0)
    return cfg


def run_tide(cfg: dict, work: Path) -> Timeline:
    spawned = time.time()
    run_dir = tide_run(cfg, work)
    return tide_timeline(run_dir, spawned, time.time() - spawned)


def tide_timeline(run_dir: Path, spawned: float, process_s: float) -> Timeline:
    """A finished `tide run`'s Timeline from its run directory (`spawned`: when its process was started)."""
    metrics = run_metrics(run_dir)
    phases = [json.loads(line) for line in (run_dir / "timings.jsonl").read_text().splitlines()]
    scored = {p["iteration"]: p["start"] + p["seconds"] for p in phases if p["phase"] == "reward"}
    rl_start = min(p["start"] for p in phases if p["phase"] == "rollout" and p["iteration"] == 1)
    per_phase: dict[str, list[float]] = {}
    for p in phases:
        if p["iteration"] >= 1:
            per_phase.setdefault(p["phase"], []).append(p["seconds"])
    return Timeline(process_s, rl_start - spawned, [m["reward_mean"] for m in metrics],
                    [scored[m["iteration"]] - spawned for m in metrics],
                    {name: statistics.median(v) for name, v in per_phase.items()},
                    [m["optimizer_steps"] for m in metrics])


def run_trl_process(cfg: dict, work: Path, cpu_interval: float | None = None) -> Timeline:
    """TRL's side in a process of its own; with `cpu_interval`, its process tree's CPU seconds sampled that often
    (Timeline.cpu), as bench_async samples tide's."""
    work.mkdir(parents=True, exist_ok=True)
    job, out = work / f"trl_{cfg['name']}.json", work / f"trl_{cfg['name']}.out.json"
    job.write_text(json.dumps(cfg))
    spawned = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--trl-worker", str(job), str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu = tree_cpu_samples(proc, cpu_interval, spawned) if cpu_interval else None
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    process_s = time.time() - spawned
    got = json.loads(out.read_text())
    clock = got["clock"]
    return Timeline(process_s, clock[0] - spawned, got["rewards"], [t - spawned for t in clock[1:]], cpu=cpu)


def tree_cpu_samples(proc: subprocess.Popen, interval: float, since: float) -> list[tuple[float, float]]:
    """Until `proc` exits: (seconds since `since`, CPU seconds of its process tree so far) every `interval`
    seconds (a child's CPU counted while it lives: the sum can drop when one ends)."""
    root, samples = psutil.Process(proc.pid), []
    while proc.poll() is None:
        samples.append((time.time() - since, sum(seconds for _, seconds in tree_cpu(root, set(), set()).values())))
        time.sleep(interval)
    return samples


def trl_worker(job: Path, out: Path) -> None:
    """The TRL side as a user runs it: this process imports TRL, warms up, trains, exits."""
    cfg = json.loads(job.read_text())
    clock: list[float] = []
    rewards = run_trl(cfg, job.parent / f"trl_{cfg['name']}", clock)
    out.write_text(json.dumps({"rewards": rewards, "clock": clock}))


def vllm_generate_floor(cfg: dict, repeats: int) -> list[float]:
    """Seconds vLLM's `LLM.generate`, called directly in this process with tide's engine arguments, takes for
    one iteration's requests of the job (and nothing else an iteration does): a floor under tide's RL-iteration
    time while vLLM generates its samples."""
    from vllm import LLM

    from orchestrator.config.model_source import resolve_model_dir
    from rollout.config import RolloutConfig, TaskConfig
    from rollout.engine import configure_env, generate_requests, llm_kwargs
    from rollout.tasks import make_task
    from trainer.tiny_model import TinyModelConfig

    from transformers import AutoTokenizer

    from orchestrator.workers.prompts import PromptRenderer, RenderedTask

    seed, r = cfg["seed"], RolloutConfig(**cfg["rollout"])
    task = make_task(TaskConfig(**cfg["task"]))
    model_dir = resolve_model_dir(None, TinyModelConfig(**cfg["model"]["tiny"]), task, seed)
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(model_dir), cfg["model"].get("chat_template", "auto"))
    task = RenderedTask(task, renderer)  # the token ids tide's engines get
    configure_env(r)
    llm = LLM(model_dir, **llm_kwargs(r, cfg["model"].get("dtype", "float32"), seed, cfg["deterministic"]))
    gc.collect()
    gc.freeze()  # as tide's engine actor does after start-up
    times = []
    for it in range(repeats + 1):  # the first call warms up
        problems, _ = task.rendered_problems(seed, it + 1, r.prompts_per_iteration)
        prompts, params = generate_requests(problems, r.n_samples, r.max_new_tokens, r.temperature, seed + it,
                                            stop_token_ids=renderer.end_of_turn_ids())
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    llm.llm_engine.engine_core.shutdown()
    return times[1:]


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--trl-worker":
        trl_worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return
    ap = bench_arguments(__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--large-seeds", type=int, nargs="*", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seeds = args.seeds or ([1] if args.quick else [1, 2, 3])
    iterations = args.iterations or (30 if args.quick else 70)
    large_seeds = args.large_seeds if args.large_seeds is not None else ([] if args.quick else [1, 2])
    report = Report("e2e", args.quick, out=args.out)
    runs: dict[str, dict[int, Timeline]] = {"tide": {}, "trl": {}}
    large: dict[str, dict[int, Timeline]] = {"tide": {}, "trl": {}}
    with tempfile.TemporaryDirectory(prefix="tide-e2e-") as tmp:
        for seed in seeds:  # A B A B: tide then TRL, seed by seed
            cfg = job_config(seed, iterations, "constant")
            cfg["name"] = f"e2e_{seed}"
            runs["tide"][seed] = run_tide(cfg, Path(tmp))
            runs["trl"][seed] = run_trl_process(cfg, Path(tmp))
            print(f"seed {seed}: " + ", ".join(
                f"{side} {t.process_s:.1f} s whole, {t.iteration_s():.3f} s/iteration, MA 0.5 after "
                f"{t.time_to(0.5):.1f} s of RL" for side, t in ((s, runs[s][seed]) for s in runs)), flush=True)
        for seed in large_seeds:
            cfg = large_job(seed, 4)
            large["tide"][seed] = run_tide(cfg, Path(tmp) / "large")
            large["trl"][seed] = run_trl_process(cfg, Path(tmp) / "large")
            print(f"~100M, seed {seed}: tide {large['tide'][seed].iteration_s():.2f} s/iteration "
                  f"(optimizer steps per iteration {large['tide'][seed].optimizer_steps}), "
                  f"TRL {large['trl'][seed].iteration_s():.2f}", flush=True)

    floor = vllm_generate_floor(job_config(seeds[0], iterations, "constant"), 5 if args.quick else 10)

    def column(side: str, figure, source=runs) -> list[float]:
        return [figure(source[side][s]) for s in sorted(source[side])]

    job = {"seeds": seeds, "iterations": iterations}
    report.add("whole process", "tide", "trl GRPOTrainer", "seconds, spawn to exit",
               column("tide", lambda t: t.process_s), column("trl", lambda t: t.process_s),
               higher_is_better=False, **job)
    report.add("RL iteration", "tide", "trl GRPOTrainer", "seconds between consecutive iterations' rewards",
               column("tide", Timeline.iteration_s), column("trl", Timeline.iteration_s),
               higher_is_better=False, **job)
    goal_row = None
    for target in TARGETS:
        row = report.add(f"time to moving-average reward {target}", "tide", "trl GRPOTrainer",
                         f"seconds from the start of RL until the {WINDOW}-iteration mean reward first reaches "
                         f"{target} (inf: not within the run)",
                         column("tide", lambda t: t.time_to(target)), column("trl", lambda t: t.time_to(target)),
                         higher_is_better=False, **job)
        report.add(f"time to moving-average reward {target}, from spawn", "tide", "trl GRPOTrainer",
                   "seconds from the process's spawn (start-up and warm start included)",
                   column("tide", lambda t: t.time_to(target, True)),
                   column("trl", lambda t: t.time_to(target, True)), higher_is_better=False, **job)
        report.add(f"iterations to moving-average reward {target}", "tide", "trl GRPOTrainer", "iterations",
                   [iterations_to_target(runs["tide"][s].rewards, target) for s in seeds],
                   [iterations_to_target(runs["trl"][s].rewards, target) for s in seeds],
                   higher_is_better=False, **job)
        if target == 0.5:
            goal_row = row
    # a run of either side that never gets there: the goal is not met (Report.goal reads the row's samples)
    report.goal("quickstart job: time from the start of RL to moving-average reward 0.5 (TRL / tide)",
                ratio_of(goal_row["baseline_median"], goal_row["contender_median"]), 1.0, row=goal_row)
    if large_seeds:
        row = report.add("RL iteration, ~100M variant", "tide", "trl GRPOTrainer",
                         "seconds between consecutive iterations' rewards",
                         column("tide", lambda t: t.equal_work_iteration_s(LARGE_UPDATES), large),
                         column("trl", Timeline.iteration_s, large), higher_is_better=False, seeds=large_seeds,
                         model=LARGE_MODEL, prompts_per_iteration=16,
                         tide_optimizer_steps=column("tide", lambda t: t.optimizer_steps, large))
        report.goal("~100M variant: RL-iteration time (TRL / tide)", ratio_of(1.0, row["ratio"]), 2.0, row=row)
        train = [large["tide"][s].phase_medians["train"] for s in large_seeds]
        report.note("large_floor", {
            "what": "tide's train phase alone (forward and backward of the iteration's samples, 4 optimizer "
                    "steps): under its RL-iteration time; a TRL / tide ratio of 2 needs TRL's iteration to take "
                    "at least twice this",
            "tide_train_phase_s": train, "tide_phase_medians": [large["tide"][s].phase_medians for s in large_seeds],
            "trl_iteration_s": column("trl", Timeline.iteration_s, large),
            "ratio_if_all_but_training_were_free": statistics.median(column("trl", Timeline.iteration_s, large))
            / statistics.median(train),
        })
    tide_iteration = statistics.median(column("tide", Timeline.iteration_s))
    trl_iteration = statistics.median(column("trl", Timeline.iteration_s))
    tide_its = statistics.median(iterations_to_target(runs["tide"][s].rewards, 0.5) for s in seeds)
    rollout = statistics.median(runs["tide"][s].phase_medians["rollout"] for s in seeds)
    report.note("floor", {
        "what": "generation alone against TRL's whole iteration. vllm_direct: vLLM LLM.generate of one "
                "iteration's requests (64 prompts x 8 samples x 4 tokens, tide's token ids), called directly "
                "with tide's engine arguments; tide_rollout_phase: the rollout phase of the runs above. tide's "
                "iterations run in lockstep, so each takes longer than its rollout phase",
        "vllm_direct_samples_s": floor, "vllm_direct_median_s": statistics.median(floor),
        "tide_rollout_phase_median_s": rollout, "tide_iteration_median_s": tide_iteration,
        "trl_iteration_median_s": trl_iteration, "tide_rollout_over_trl_iteration": rollout / trl_iteration,
        "tide_time_to_0.5_if_iterations_were_only_rollouts_s": rollout * tide_its,
        "trl_time_to_0.5_s": goal_row["baseline_median"],
    })
    report.note("timelines", {name: {side: {s: vars(t) for s, t in per.items()} for side, per in source.items()}
                              for name, source in (("quickstart", runs), ("large", large))})
    report.note("job", job_config(seeds[0], iterations, "constant"))
    report.finish()


if __name__ == "__main__":
    main()
