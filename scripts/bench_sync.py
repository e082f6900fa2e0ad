"""Weight sync: seconds from a published iteration to a rollout engine serving it, `reload` (weights loaded
into the running vLLM engine) against `restart` (engine process stopped and a new one started on the
checkpoint, the Kimi way); and publish GB/s (Megatron -> HF safetensors in /dev/shm, the real trainer path)
against a memcpy of the same bytes.

    .venv/bin/python scripts/bench_sync.py [--quick]     writes bench_results/sync.json

Both syncs go through `RolloutEngine.sync` on the same manifest (verification included in both), the
trainer is a one-rank Megatron-core group on the same ~100M-parameter Qwen2 model (--quick: ~25M) as
bench_rollout.py. Goals: reload at least 30x faster than restart; publish at least 0.5x memcpy.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, alternate, timed  # noqa: E402
from bench_rollout import build_model  # noqa: E402

RELOAD_TARGET = 30.0
PUBLISH_TARGET = 0.5
SHARD_BYTES = 512 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()

    import ray
    import torch

    from orchestrator.trainer_group import TrainerGroup
    from rollout.engine import EngineConfig, RolloutEngine
    from trainer.batch import TrainerSpec

    quick = args.quick
    repeats = 3 if quick else 5
    report = Report("sync", quick)
    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    shm = Path(tempfile.mkdtemp(prefix="bench_sync_", dir="/dev/shm"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    engine = group = None
    try:
        model_dir = build_model(tmp, quick)
        group = TrainerGroup(TrainerSpec(hf_dir=str(model_dir), tp=1, pp=1, ep=1, loss="grpo", lr=1e-5))
        iteration = [0]

        def publish_once():
            iteration[0] += 1
            return group.publish("bench", iteration[0], str(shm / f"{iteration[0]:07d}"), SHARD_BYTES)

        # --- publish vs memcpy of the same bytes
        manifest = publish_once()  # warm-up (first conversion allocates)
        nbytes = manifest.nbytes

        def publish_rate() -> float:
            t0 = time.perf_counter()
            m = publish_once()
            s = time.perf_counter() - t0
            shutil.rmtree(m.directory)
            return m.nbytes / 1e9 / s

        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src).fill_(0)
        a, b = alternate(publish_rate, lambda: nbytes / 1e9 / timed(lambda: dst.copy_(src)), repeats)
        row = report.add("publish", "Megatron -> HF safetensors in /dev/shm", "memcpy of the same bytes", "GB/s",
                         a, b, bytes=nbytes)
        report.goal("publish_gbps_vs_memcpy", row["ratio"], PUBLISH_TARGET)
        # Context, not the goal: a publish writes new files, so its pages are allocated and zeroed by the
        # kernel; a memcpy into freshly allocated memory pays the same, the in-place memcpy above does not.
        fresh = [nbytes / 1e9 / timed(lambda: src.clone()) for _ in range(repeats)]
        report.add("publish vs fresh-page memcpy", "Megatron -> HF safetensors in /dev/shm",
                   "memcpy into freshly allocated memory", "GB/s", a, fresh, bytes=nbytes)
        del src, dst
        print(f"publish: {row['contender_median']:.2f} GB/s vs memcpy {row['baseline_median']:.2f}", flush=True)

        # --- reload vs restart on the same published iteration
        engine = RolloutEngine(str(model_dir), EngineConfig(kv_cache_gb=0.5, seed=0))
        engine.sync(manifest, "reload")  # warm-up

        def sync_seconds(mode: str) -> float:
            return engine.sync(manifest, mode)["seconds"]

        a, b = alternate(lambda: sync_seconds("reload"), lambda: sync_seconds("restart"), repeats)
        # seconds: lower is better, so the goal's ratio is restart / reload (how many times faster)
        row = report.add("sync", "reload (in place)", "restart (new engine process)", "seconds", a, b,
                         higher_is_better=False, bytes=nbytes)
        report.goal("reload_speedup_vs_restart", 1.0 / row["ratio"], RELOAD_TARGET)
        print(f"sync: reload {row['contender_median']:.2f} s, restart {row['baseline_median']:.2f} s", flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    out = report.write()
    report.print_table()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
