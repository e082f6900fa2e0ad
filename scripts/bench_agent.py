"""Multi-turn rollouts with tool time hidden behind generation: the same tool-heavy iteration scheduled with
`agent.overlap` (the engine is called for the trajectories whose tools answered while others' tools still run)
and in lockstep (one engine call per turn, after every reply of the turn), alternating.

    .venv/bin/python scripts/bench_agent.py [--quick]     writes bench_results/agent.json

The iteration: trajectories of a tiny random model (built locally) on the run's real path -- the RolloutEngine
as a Ray actor behind orchestrator.workers.rollout_group, the AgentRunner, the episodes -- where every model turn is
answered by a tool whose latency is drawn per call (seeded, uniform in 0.1-2.0 s: what a search API or a sandboxed
test run takes; the tool waits, it does not compute, as such remote calls do). A turn ends at one of the
vocabulary's first 64 tokens (stop tokens), so that turns are short and many. Both schedules sample every turn
with the same per-trajectory seeds and budgets.

Figures: `overlap` = (the lockstep run's generate time + its tool time, each measured alone) / the overlapped
run's wall time -- the issue's goal >= 1.3 -- and the lockstep / overlapped wall-time ratio.

Against TRL (`--parts trl`): TRL's GRPOTrainer with `tools=` and `tide run` on configs/tool_calc.yaml, each in a
process of its own, seed by seed (scripts/bench_agent_trl.py sets TRL up and says where the two cannot be equal).
Both start RL from the same weights: the job's supervised warm start is run once per seed in plain PyTorch
(SHARED_WARMUP_STEPS steps, below) and saved, and both load that directory (`model.path`, no warm start of their
own), so that the figure compares the RL loops rather than two optimizers' rounding through a warm start whose
outcome turns on it. No eval on either side. Figures: wall time from the start of RL (TRL: `train()` called; tide:
the first rollout starts) until the 5-iteration moving average of training reward first reaches 0.5 (goal: TRL /
tide >= 1.0; a side that never reaches it counts as infinite), the iterations that took, and the median seconds per
iteration.

    .venv/bin/python scripts/bench_agent.py --parts trl [--seeds 1 2 3] [--iterations 40] [--warmup-steps 255]
"""
from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, bench_arguments, ratio_of, repeats_for  # noqa: E402

OVERLAP_TARGET = 1.3
# The shared warm start (--parts trl): a fixed number of steps, the config's loss bound (warmup_sft_stop_loss) off,
# as measured. The config's warm start was 240 steps then, tuned to tide's; the PyTorch one lags it slightly (loss
# 0.084 against 0.040 at step 240, seed 1), and the copy skill appears abruptly: from PyTorch's 240 steps both
# sides started RL at reward 0.01, from 270 at 0.4, from 255 at 0.07 (three iterations each).
SHARED_WARMUP_STEPS = 255
LATENCY_S = (0.1, 2.0)  # a tool call's round trip, drawn per call


class SlowTool:
    """An environment whose every reply takes a seeded latency (a tool call's round trip), for `turns` turns."""

    def __init__(self, rng: random.Random, turns: int) -> None:
        self.rng, self.turns, self.n = rng, turns, 0

    def reset(self, columns):
        return [{"role": "user", "content": "Count with me: 1"}]

    def step(self, text: str):
        from rollout.agent import Step

        self.n += 1
        time.sleep(self.rng.uniform(*LATENCY_S))
        return Step([{"role": "user", "content": f"{self.n + 1}"}], 0.0, self.n >= self.turns)


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--parts", nargs="+", choices=["overlap", "trl"], default=["overlap"],
                    help="overlap: the schedules; trl: against TRL's GRPOTrainer on configs/tool_calc.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="--parts trl (default 1 2 3; quick: 1)")
    ap.add_argument("--iterations", type=int, default=None, help="--parts trl (default 40; quick: 10)")
    ap.add_argument("--warmup-steps", type=int, default=SHARED_WARMUP_STEPS,
                    help="--parts trl: steps of the shared warm start")
    args = ap.parse_args()
    report = Report("agent", args.quick)
    if "overlap" in args.parts:
        overlap_part(report, args.quick)
    if "trl" in args.parts:
        trl_part(report, args.seeds or ([1] if args.quick else [1, 2, 3]),
                 args.iterations or (10 if args.quick else 40), args.warmup_steps)
    report.finish()


def trl_part(report: Report, seeds: list[int], iterations: int, warmup_steps: int) -> None:
    import yaml
    from bench_agent_trl import warm_started_model
    from bench_e2e import Timeline, run_tide
    from bench_sample_efficiency import TARGET, WINDOW, iterations_to_target

    base = yaml.safe_load((ROOT / "configs" / "tool_calc.yaml").read_text())
    runs: dict[str, dict[int, Timeline]] = {"tide": {}, "trl": {}}
    with tempfile.TemporaryDirectory(prefix="bench_agent_trl_") as tmp:
        for seed in seeds:  # tide then TRL, seed by seed, from the same warm-started weights
            cfg = json.loads(json.dumps(base))
            cfg.update(seed=seed, iterations=iterations, save_every=iterations, name=f"agent_vs_trl_{seed}",
                       eval={"every": 0})
            cfg["trainer"] |= {"warmup_sft_steps": warmup_steps, "warmup_sft_stop_loss": None}
            start = warm_started_model(cfg, Path(tmp) / f"warm_{seed}")
            cfg["model"] = {"path": str(start), "dtype": cfg["model"]["dtype"]}
            cfg["trainer"]["warmup_sft_steps"] = 0
            runs["tide"][seed] = run_tide(cfg, Path(tmp))
            runs["trl"][seed] = run_trl_tools_process(cfg, Path(tmp))
            for side, got in ((side, runs[side][seed]) for side in runs):
                print(f"seed {seed} {side}: rewards {[round(x, 3) for x in got.rewards]}; to 0.5: "
                      f"{got.time_to(TARGET):.1f} s, {iterations_to_target(got.rewards, TARGET, WINDOW)} "
                      f"iterations; {got.iteration_s():.2f} s per iteration", flush=True)
    tide, trl = [runs["tide"][s] for s in seeds], [runs["trl"][s] for s in seeds]
    row = report.add(f"time to a {WINDOW}-iteration mean reward of {TARGET}", "tide", "trl GRPOTrainer tools=",
                     "seconds from the start of RL (inf: not within the run)", [x.time_to(TARGET) for x in tide],
                     [x.time_to(TARGET) for x in trl], higher_is_better=False, seeds=seeds, iterations=iterations)
    report.goal("time to a moving-average reward of 0.5 on tool_calc (issue 33: TRL / tide >= 1.0)",
                ratio_of(1.0, row["ratio"]), 1.0, row=row)
    report.add(f"iterations to a {WINDOW}-iteration mean reward of {TARGET}", "tide", "trl GRPOTrainer tools=",
               "iterations (inf: not within the run)",
               [iterations_to_target(x.rewards, TARGET, WINDOW) for x in tide],
               [iterations_to_target(x.rewards, TARGET, WINDOW) for x in trl], higher_is_better=False, seeds=seeds)
    report.add("RL iteration time", "tide", "trl GRPOTrainer tools=", "median seconds between iterations' rewards",
               [x.iteration_s() for x in tide], [x.iteration_s() for x in trl], higher_is_better=False, seeds=seeds)
    report.note("trl_reward_curves", {side: {s: runs[side][s].rewards for s in seeds} for side in runs})
    report.note("shared_warm_start_steps", warmup_steps)
    report.note("tide_phase_medians", {s: runs["tide"][s].phase_medians for s in seeds})


def run_trl_tools_process(cfg: dict, work: Path):
    """TRL's side in a process of its own (scripts/bench_agent_trl.py --worker), timed from its spawn."""
    import subprocess

    from bench_e2e import Timeline

    job, out = work / f"trl_{cfg['name']}.json", work / f"trl_{cfg['name']}.out.json"
    job.write_text(json.dumps(cfg))
    spawned = time.time()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_agent_trl.py"), "--worker", str(job), str(out)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    process_s = time.time() - spawned
    got = json.loads(out.read_text())
    clock = got["clock"]
    return Timeline(process_s, clock[0] - spawned, got["rewards"], [t - spawned for t in clock[1:]])


def overlap_part(report: Report, quick: bool) -> None:
    import ray
    from transformers import AutoTokenizer

    from orchestrator.workers.rollout_group import RolloutGroup
    from rollout.agent import AgentLimits, AgentRunner, EnvEpisode
    from rollout.config import EngineConfig
    from rollout.tasks import AdditionTask
    from trainer.batch import TokenDistribution
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    repeats = repeats_for(quick)
    trajectories, turns = (32, 4) if quick else (64, 6)
    tmp = Path(tempfile.mkdtemp(prefix="bench_agent_"))
    group = None
    try:
        spec = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                               max_position_embeddings=1024)
        model_dir = build_tiny_model(tmp / "model", AdditionTask(2).corpus(), spec)
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
        group = RolloutGroup([str(model_dir)], EngineConfig(kv_cache_gb=0.5), dtype="float32", seed=0,
                             deterministic=False, stop_token_ids=list(range(64)))
        group.wait_started()
        sampling = TokenDistribution(temperature=1.0)

        def generate(problems, max_new, seed):
            return group.generate(problems, 1, max_new, sampling, seed)

        def iteration(overlap: bool, k: int) -> dict[str, float]:
            rngs = [random.Random(f"{k}/{i}") for i in range(trajectories)]  # the same latencies for both sides
            episodes = [EnvEpisode(SlowTool(r, turns), {}) for r in rngs]
            runner = AgentRunner(generate, tok, AgentLimits(max_turns=turns, max_total_tokens=900,
                                                            max_tokens_per_turn=32), overlap=overlap)
            t0 = time.perf_counter()
            samples = runner.run(episodes, seed=k)
            wall = time.perf_counter() - t0
            return {"wall": wall, "generate": runner.timings["generate_s"], "tools": runner.timings["tool_s"],
                    "tokens": sum(sum(s.loss_mask) for s in samples)}

        iteration(True, -1)  # warm-up: the engine's first batches
        lock, over = [], []
        for k in range(repeats):  # A B A B, the same seeds and latencies on both sides of a pair
            over.append(iteration(True, k))
            lock.append(iteration(False, k))
        sequential = [x["generate"] + x["tools"] for x in lock]
        row = report.add("overlap", "overlapped schedule: wall seconds",
                         "lockstep schedule: generate + tool seconds, each measured alone", "seconds",
                         [x["wall"] for x in over], sequential, higher_is_better=False,
                         trajectories=trajectories, turns=turns, tool_latency_s=list(LATENCY_S),
                         tokens_contender=[x["tokens"] for x in over], tokens_baseline=[x["tokens"] for x in lock])
        report.goal("wall time under generate + tool time (issue 33: overlap >= 1.3x)",
                    1 / row["ratio"], OVERLAP_TARGET, row=row)
        report.add("wall_time", "overlapped schedule", "lockstep schedule", "seconds",
                   [x["wall"] for x in over], [x["wall"] for x in lock], higher_is_better=False)
        report.note("lockstep_parts", {"generate_s": [x["generate"] for x in lock],
                                       "tool_s": [x["tools"] for x in lock]})
        report.note("overlapped_parts", {"generate_s": [x["generate"] for x in over],
                                         "tool_s": [x["tools"] for x in over]})
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
