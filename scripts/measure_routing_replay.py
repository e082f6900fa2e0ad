"""What routing replay (trainer.moe.routing_replay: rollout) does to the log-prob gap, sequence by sequence.

On one tiny mixture-of-experts model and several rollouts of its initial weights, the trainer computes every
sample's log-probs twice on the same weights: routing each token to the experts the engine routed it to (replay)
and to its own routers' choice. Both are compared with the engine's log-probs. A sequence is "affected" when the
two passes differ at all (some token of it was routed otherwise by the trainer's routers); on all others replay
and free routing must agree bit for bit, which the script checks. Writes bench_results/routing_replay.json.

    .venv/bin/python scripts/measure_routing_replay.py --family qwen3_moe --dtype bfloat16 --batches 4

In float32 the engine's and the trainer's routers agree on every token (mismatch 0, the passes identical); in
bfloat16 a few tokens sit on near-ties and are routed apart.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(family: str, dtype: str, batches: int, prompts: int, n_samples: int, model: Path | None,
            micro_batch: int = 64) -> list[dict]:
    import ray

    from orchestrator.workers.trainer_group import RankPool, TrainerGroup
    from rollout.config import EngineConfig
    from rollout.engine import RolloutEngine
    from rollout.tasks import AdditionTask
    from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
    from trainer.config import MoEConfig, TrainerConfig, TrainerSpec
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    task = AdditionTask(1)
    spec = TinyModelConfig(family=family, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, num_experts=4, experts_per_token=2)
    if model is None:
        model = build_tiny_model(Path(tempfile.mkdtemp(prefix="tide-replay-")) / "model", task.corpus(), spec)
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="tide_replay_measure")
    pool = RankPool()
    trainer = TrainerConfig(loss="grpo", micro_batch_size=micro_batch, moe=MoEConfig(routing_replay="rollout"))
    group = TrainerGroup(TrainerSpec(hf_dir=str(model), trainer=trainer, dtype=dtype), pool=pool)
    engine = ray.remote(num_cpus=0)(RolloutEngine).remote(str(model), EngineConfig(kv_cache_gb=0.25,
                                                          enforce_eager=True), dtype=dtype, deterministic=True)
    rows = []
    try:
        for seed in range(batches):
            samples = ray.get(engine.generate.remote(task.problems(seed, 1, prompts), n_samples, 4, 1.0, seed),
                              timeout=600)

            def batch(replay: bool) -> TrainBatch:
                return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, old_logprobs=s.logprobs,
                                                 reward=float(k % 2), group=s.prompt_index,
                                                 routed_experts=s.routed_experts if replay else None)
                                   for k, s in enumerate(samples)], TokenDistribution())

            replayed, free = group.logprobs(batch(True)), group.logprobs(batch(False))
            step = group.train_step(batch(True), lr=0.0)  # the train step's own replay figures, whole batch
            row = {"batch": seed, "sequences": len(samples), "routing_mismatch": step["routing_mismatch"],
                   "routing_mismatch_trained": step["routing_mismatch_trained"],
                   "train_step_gap_replayed": step["behaviour_gap_replayed"],
                   "train_step_gap_unreplayed": step["behaviour_gap_unreplayed"], "affected": 0,
                   "affected_better": 0, "affected_worse": 0, "affected_gap_replay": 0.0, "affected_gap_free": 0.0}
            gaps_r, gaps_f = [], []
            for s, r, f in zip(samples, replayed, free):
                b, r, f = np.asarray(s.logprobs), np.asarray(r), np.asarray(f)
                gaps_r.append(np.abs(r - b))
                gaps_f.append(np.abs(f - b))
                if np.array_equal(r, f):
                    continue
                er, ef = float(gaps_r[-1].sum()), float(gaps_f[-1].sum())
                row["affected"] += 1
                row["affected_better"] += er < ef
                row["affected_worse"] += er > ef
                row["affected_gap_replay"] += er
                row["affected_gap_free"] += ef
            row["gap_replay"] = float(np.concatenate(gaps_r).mean())
            row["gap_free"] = float(np.concatenate(gaps_f).mean())
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        group.shutdown()
        pool.close()
        ray.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--model", type=Path, default=None,
                    help="an HF directory of a mixture-of-experts model trained on the addition task (e.g. a run's "
                    "RUN_DIR/hf); default: a tiny one of --family with its initial weights")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n-samples", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=64, help="the trainer's micro_batch_size")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results" / "routing_replay.json")
    args = ap.parse_args()
    rows = measure(args.family, args.dtype, args.batches, args.prompts, args.n_samples, args.model,
                   args.micro_batch)
    summary = {key: sum(r[key] for r in rows) for key in ("sequences", "affected", "affected_better",
                                                          "affected_worse")}
    summary |= {"batches_gap_replay_smaller": sum(r["gap_replay"] < r["gap_free"] for r in rows),
                "batches_gap_replay_larger": sum(r["gap_replay"] > r["gap_free"] for r in rows),
                "gap_replay_mean": float(np.mean([r["gap_replay"] for r in rows])),
                "gap_free_mean": float(np.mean([r["gap_free"] for r in rows]))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"area": "routing_replay", "family": args.family, "dtype": args.dtype,
                                    "batches": rows, "summary": summary}, indent=1))
    print(json.dumps(summary))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
