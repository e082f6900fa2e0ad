"""Weight sync: seconds from a published iteration to a rollout engine serving it, `reload` (weights loaded
into the running vLLM engine) against `restart` (engine process stopped and a new one started on the
checkpoint, the Kimi way); and publish GB/s (Megatron -> HF safetensors in /dev/shm, the real trainer path,
followed by the run's GC, which recycles collected iterations' pages) against a memcpy of the same bytes.

    .venv/bin/python scripts/bench_sync.py [--quick]     writes bench_results/sync.json

Both syncs go through `RolloutEngine.sync` on the same manifest (verification included in both), the
trainer is a one-rank Megatron-core group on the same ~100M-parameter Qwen2 model (--quick: ~25M) as
bench_rollout.py. Goals: reload at least 30x faster than restart; publish at least 0.5x memcpy.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, alternate, bench_arguments, repeats_for, timed  # noqa: E402
from bench_rollout import build_model  # noqa: E402

RELOAD_TARGET = 30.0
PUBLISH_TARGET = 0.5
SHARD_BYTES = 512 << 20


def main() -> None:
    args = bench_arguments(__doc__).parse_args()

    import ray
    import torch

    from ckpt_transfer.gc import gc_iterations
    from ckpt_transfer.recycle import pool_dir
    from ckpt_transfer.config import PublishConfig
    from orchestrator.workers.trainer_group import TrainerGroup
    from rollout.config import EngineConfig
    from rollout.engine import RolloutEngine
    from trainer.config import TrainerConfig, TrainerSpec

    quick = args.quick
    repeats = repeats_for(quick)
    report = Report("sync", quick)
    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    shm = Path(tempfile.mkdtemp(prefix="bench_sync_", dir="/dev/shm"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    engine = group = None
    try:
        model_dir = build_model(tmp, quick)
        group = TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(loss="grpo", lr=1e-5)))
        iteration = [0]

        keep_last = PublishConfig().keep_last

        def publish_once():
            iteration[0] += 1
            return group.publish("bench", iteration[0], str(shm / f"{iteration[0]:07d}"), SHARD_BYTES)

        def publish_rate(recycle: bool) -> float:
            """One publish, then the run's GC (untimed, as in the loop, where it follows the sync). The steady
            state recycles the pages of collected iterations; without recycling every file is new."""
            if not recycle:
                shutil.rmtree(pool_dir(shm), ignore_errors=True)
            t0 = time.perf_counter()
            m = publish_once()
            s = time.perf_counter() - t0
            gc_iterations(shm, keep_last, recycle=recycle)
            return m.nbytes / 1e9 / s

        # --- publish vs memcpy of the same bytes
        manifest = publish_once()  # warm-up (first conversion allocates)
        nbytes = manifest.nbytes
        # A run rotates keep_last + 1 sets of files (kept iterations and the recycle pool); each set is new
        # once, then mapped on its first reuse. Steady state after that: copies into kept mappings.
        for _ in range(2 * (keep_last + 1)):
            publish_rate(True)

        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src).fill_(0)
        a, b = alternate(lambda: publish_rate(True), lambda: nbytes / 1e9 / timed(lambda: dst.copy_(src)), repeats)
        row = report.add("publish", "Megatron -> HF safetensors in /dev/shm (steady state)", "memcpy of the same bytes",
                         "GB/s", a, b, bytes=nbytes)
        report.goal("publish_gbps_vs_memcpy", row["ratio"], PUBLISH_TARGET, row=row)
        # Context, not the goal: the first publishes of a run (or any with recycling off) write new files,
        # whose pages the kernel allocates and zeroes; a memcpy into freshly allocated memory pays the same.
        a, fresh = alternate(lambda: publish_rate(False), lambda: nbytes / 1e9 / timed(lambda: src.clone()), repeats)
        report.add("publish into new pages", "Megatron -> HF safetensors in /dev/shm, no recycled pages",
                   "memcpy into freshly allocated memory", "GB/s", a, fresh, bytes=nbytes)
        del src, dst
        print(f"publish: {row['contender_median']:.2f} GB/s vs memcpy {row['baseline_median']:.2f}", flush=True)
        manifest = publish_once()

        # --- reload vs restart on the same published iteration
        engine = RolloutEngine(str(model_dir), EngineConfig(kv_cache_gb=0.5), seed=0)
        engine.sync(manifest, "reload")  # warm-up

        def sync_seconds(mode: str) -> float:
            return engine.sync(manifest, mode)["seconds"]

        a, b = alternate(lambda: sync_seconds("reload"), lambda: sync_seconds("restart"), repeats)
        # seconds: lower is better, so the goal's ratio is restart / reload (how many times faster)
        row = report.add("sync", "reload (in place)", "restart (new engine process)", "seconds", a, b,
                         higher_is_better=False, bytes=nbytes)
        report.goal("reload_speedup_vs_restart", 1.0 / row["ratio"], RELOAD_TARGET, row=row)
        print(f"sync: reload {row['contender_median']:.2f} s, restart {row['baseline_median']:.2f} s", flush=True)
    finally:
        if engine is not None:
            engine.shutdown()
        if group is not None:
            group.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    report.finish()


if __name__ == "__main__":
    main()
