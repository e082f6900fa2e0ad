"""Multi-turn rollouts with tool time hidden behind generation: the same tool-heavy iteration scheduled with
`agent.overlap` (the engine is called for the trajectories whose tools answered while others' tools still run)
and in lockstep (one engine call per turn, after every reply of the turn), alternating.

    .venv/bin/python scripts/bench_agent.py [--quick]     writes bench_results/agent.json

The iteration: trajectories of a tiny random model (built locally) on the run's real path -- the RolloutEngine
as a Ray actor behind orchestrator.rollout_group, the AgentRunner, the episodes -- where every model turn is
answered by a tool whose latency is drawn per call (seeded, uniform in 0.1-2.0 s: what a search API or a sandboxed
test run takes; the tool waits, it does not compute, as such remote calls do). A turn ends at one of the vocabulary's first 64 tokens (stop
tokens), so that turns are short and many. Both schedules sample every turn with the same per-trajectory seeds and budgets.

Figures: `overlap` = (the lockstep run's generate time + its tool time, each measured alone) / the overlapped
run's wall time -- the issue's goal >= 1.3 -- and the lockstep / overlapped wall-time ratio. The comparison
with TRL's GRPOTrainer (`tools=`) on configs/tool_calc.yaml is not in this script yet: no figure is claimed.
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, bench_arguments, repeats_for  # noqa: E402

OVERLAP_TARGET = 1.3
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
    args = bench_arguments(__doc__).parse_args()
    import ray
    from transformers import AutoTokenizer

    from orchestrator.rollout_group import RolloutGroup
    from rollout.agent import AgentLimits, AgentRunner, EnvEpisode
    from rollout.config import EngineConfig
    from rollout.tasks import AdditionTask
    from trainer.batch import TokenDistribution
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    quick = args.quick
    repeats = repeats_for(quick)
    trajectories, turns = (32, 4) if quick else (64, 6)
    report = Report("agent", quick)
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
        report.finish()
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
