"""LoRA (issue 63): what adapter-only weight sync saves, what serving an unmerged adapter costs, and a LoRA RL
iteration against full fine-tuning's.

    .venv/bin/python scripts/bench_lora.py [--quick]     writes bench_results/lora.json

One process, one Megatron-core rank training rank-16 adapters (alpha 32, PEFT's seven projections) on the
~100M-parameter Qwen2 model of bench_rollout.py (--quick: ~25M), two vLLM engines on the same base:
- **sync** (the goal): seconds from the trainer's weights to an engine generating on them. Contender:
  `trainer.lora.sync: adapter`, the adapter alone published (PEFT names, /dev/shm) and served through vLLM's LoRA
  support (a new adapter id each time, the previous one removed). Baseline: what full fine-tuning and `sync: merged`
  do, the whole model published (the adapters merged in) and reloaded into the running engine (`sync_mode:
  reload`, tide's fastest full-model sync: bench_sync.py). Both include verification of the published files.
  Alternating, each repeat publishing a new iteration; the run's GC of old iterations untimed, as in the loop.
- **generation** (reported, no goal): generated tokens/s of the engine serving the adapter unmerged against the
  engine serving the merged weights, same prompts, samples and seeds, alternating: the per-token cost of serving
  an adapter (vLLM's punica kernels on CPU), which `sync: merged` avoids.
- **RL iteration** (reported, no goal): median seconds of a `tide run` iteration of the LoRA job on the same model
  (16 prompts x 4 samples, Kimi's loss, one optimizer step) against the same job fully fine-tuned, each as users
  start it, alternating runs.

- **against TRL** (a goal): configs/lora.yaml on its base (configs/lora_base.yaml, run first) against TRL's
  GRPOTrainer with PEFT's LoraConfig of the same rank, alpha and targets on the same base, job and seeds, each in a
  process of its own (bench_e2e.py's runners): seconds from the start of RL to a 5-iteration moving-average reward
  of THRESHOLD, RL-iteration seconds and reward gain beside it. Seeds 1, 2, 3 (--quick: 1).

Goals: (full mode, ~100M) adapter sync >= 5x faster than the full-model reload (baseline seconds / contender
seconds); TRL / tide time to the LoRA job's threshold >= 1.0 (a side that never reaches it fails the goal).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, alternate, bench_arguments, ratio_of, repeats_for  # noqa: E402
from bench_rollout import build_model  # noqa: E402
from bench_sample_efficiency import run_metrics, tide_run  # noqa: E402

SYNC_TARGET = 5.0
THRESHOLD = 0.4  # the LoRA job's reward threshold: a 5-iteration moving average (bench_e2e's window)
RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARD_BYTES = 512 << 20


def sync_and_generation(report: Report, quick: bool, repeats: int) -> None:
    import ray
    from transformers import AutoTokenizer

    from ckpt_transfer.config import PublishConfig
    from ckpt_transfer.gc import gc_iterations
    from orchestrator.workers.trainer_group import TrainerGroup
    from rollout.config import EngineConfig, EngineLoRAConfig
    from rollout.engine import RolloutEngine
    from rollout.tasks import AdditionTask
    from trainer.batch import TrainBatch, TrainSequence
    from trainer.config import LoRAConfig, TrainerConfig, TrainerSpec

    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    shm = Path(tempfile.mkdtemp(prefix="bench_lora_", dir="/dev/shm"))
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    group = adapter_engine = full_engine = None
    try:
        model_dir = build_model(tmp, quick)
        lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
        group = TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(lora=lora, lr=1e-4)))
        tok = AutoTokenizer.from_pretrained(model_dir)
        seqs = [TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id])
                for p, a in AdditionTask(4).sft_examples(0, 16)]
        for _ in range(2):  # B is zero at the start: trained adapters, as a sync carries them
            group.train_step(TrainBatch(seqs), mode="sft", lr=1e-3)

        keep_last = PublishConfig().keep_last
        iteration = [0]

        def publish(adapter: bool):
            iteration[0] += 1
            return group.publish("bench", iteration[0], str(shm / f"{iteration[0]:07d}"), SHARD_BYTES,
                                 adapter=adapter)

        lora_cfg = EngineLoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
        adapter_engine = RolloutEngine(str(model_dir), EngineConfig(kv_cache_gb=0.5, lora=lora_cfg), seed=0)
        full_engine = RolloutEngine(str(model_dir), EngineConfig(kv_cache_gb=0.5), seed=0)
        sizes = {}

        def sync_seconds(adapter: bool) -> float:
            t0 = time.perf_counter()
            manifest = publish(adapter)
            (adapter_engine if adapter else full_engine).sync(manifest, "adapter" if adapter else "reload")
            seconds = time.perf_counter() - t0
            sizes["adapter" if adapter else "model"] = manifest.nbytes
            gc_iterations(shm, keep_last)  # untimed, as in the loop
            return seconds

        sync_seconds(True), sync_seconds(False)  # warm-up: first conversion and first adapter slot
        a, b = alternate(lambda: sync_seconds(True), lambda: sync_seconds(False), repeats)
        row = report.add("sync", "adapter alone: publish + vLLM LoRA load (sync: adapter)",
                         "whole model, adapters merged: publish + in-place reload (sync: merged / full fine-tuning)",
                         "seconds", a, b, higher_is_better=False, adapter_bytes=sizes["adapter"],
                         model_bytes=sizes["model"], rank=RANK)
        if not quick:  # the goal is on the ~100M model; --quick's ~25M one is reported only
            report.goal("adapter sync speed-up vs full-model reload (~100M)", 1.0 / row["ratio"], SYNC_TARGET,
                        row=row)
        print(f"sync: adapter {row['contender_median']:.3f} s ({sizes['adapter'] / 1e6:.1f} MB), "
              f"full reload {row['baseline_median']:.3f} s ({sizes['model'] / 1e6:.0f} MB)", flush=True)

        # the syncs above left both engines on the trainer's current weights: the adapter unmerged, and merged
        # into the base. Unmerged on CPU a ~100M engine generates ~140 tokens/s: 16 x 4 x 32 tokens keep a sample
        # under a minute
        problems = AdditionTask(4).problems(seed=0, iteration=1, n=16)
        n_samples, max_new = 4, 32
        seeds = iter(range(10_000))

        def rate(engine) -> float:
            seed = next(seeds)
            t0 = time.perf_counter()
            samples = engine.generate(problems, n_samples, max_new, 1.0, seed)
            return sum(len(s.completion_ids) for s in samples.items) / (time.perf_counter() - t0)

        rate(adapter_engine), rate(full_engine)
        a, b = alternate(lambda: rate(adapter_engine), lambda: rate(full_engine), repeats)
        report.add("generation", "adapter served unmerged (vLLM LoRA)", "the same weights merged (no LoRA)",
                   "generated tokens/s", a, b, prompts=len(problems), samples_per_prompt=n_samples,
                   max_new_tokens=max_new)
    finally:
        for closeable in (adapter_engine, full_engine, group):
            if closeable is not None:
                closeable.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def iteration_seconds(run_dir: Path) -> float:
    """Median wall seconds of a run's iterations past the first, as `tide inspect` spans them (the end of one
    iteration to the end of the next)."""
    from orchestrator.records.rundir import read_jsonl
    from orchestrator.run.wall_time import iteration_windows

    windows = iteration_windows(read_jsonl(run_dir / "timings.jsonl"))
    return statistics.median(end - start for it, (start, end) in windows.items() if it > 1)


def rl_iterations(report: Report, quick: bool, repeats: int) -> None:
    """configs/lora.yaml's job on the sync rows' model (~100M; --quick ~25M) with a rollout cut to what a 2-core
    machine trains in seconds (16 prompts x 4 samples, one optimizer step), LoRA against full fine-tuning, each a
    `tide run` as users start it, alternating runs. The job's own tiny model would show only fixed costs: what
    LoRA saves (the frozen weights' gradients and optimizer state) grows with the model."""
    base = yaml.safe_load((ROOT / "configs" / "lora.yaml").read_text())
    base.update(iterations=4, save_every=100)
    base["rollout"].update(prompts_per_iteration=16, n_samples=4)
    # Kimi's loss steps every iteration; GRPO's takes no step on a random model's all-zero rewards (no spread)
    base["trainer"].update(updates_per_iteration=1, micro_batch_size=64, loss="kimi")
    with tempfile.TemporaryDirectory(prefix="bench_lora_runs_") as tmp:
        # seconds per iteration do not depend on the weights: random ones stand in for a pretrained base
        base["model"] = {"dtype": "float32", "path": str(build_model(Path(tmp), quick))}
        full = json.loads(json.dumps(base))
        full["trainer"].pop("lora")
        full["trainer"].update(lr=1.0e-3)  # the quickstart's rate

        def run(cfg: dict, name: str) -> float:
            run_dir = tide_run({**cfg, "name": name}, Path(tmp) / f"{name}-{time.monotonic_ns()}")
            steps = [m["optimizer_steps"] for m in run_metrics(run_dir)]
            if steps != [1] * cfg["iterations"]:  # an iteration without its step would not be the work compared
                raise RuntimeError(f"{name}: optimizer steps per iteration {steps}, expected one each")
            return iteration_seconds(run_dir)

        a, b = alternate(lambda: run(base, "lora"), lambda: run(full, "full"), max(2, repeats // 2))
    report.add("rl_iteration", f"configs/lora.yaml's job (rank 16 adapters, sync: adapter) on the "
               f"{'~25M' if quick else '~100M'} model, 16 prompts x 4 samples, loss kimi, one optimizer step",
               "the same job fully fine-tuned (sync_mode: reload)", "seconds per iteration", a, b,
               higher_is_better=False)


def against_trl(report: Report, quick: bool) -> None:
    """configs/lora.yaml on its base (configs/lora_base.yaml, made first by `tide run`) against TRL's GRPOTrainer
    with PEFT's LoraConfig on the same base, job and seeds (bench_sample_efficiency.run_trl: same prompts, samples,
    optimizer steps, lr, clip and loss; TRL otherwise at its defaults), each in a process of its own as users run
    it, seed by seed: seconds from the start of RL to a moving-average reward of THRESHOLD."""
    from bench_e2e import WINDOW, run_tide as e2e_tide, run_trl_process

    seeds = [1] if quick else [1, 2, 3]
    with tempfile.TemporaryDirectory(prefix="bench_lora_trl_") as tmp:
        base_dir = tide_run(yaml.safe_load((ROOT / "configs" / "lora_base.yaml").read_text()), Path(tmp)) / "hf"
        runs: dict[str, list] = {"tide": [], "trl": []}
        for seed in seeds:  # A B A B
            cfg = yaml.safe_load((ROOT / "configs" / "lora.yaml").read_text())
            cfg["model"]["path"] = str(base_dir)
            cfg.update(seed=seed, name=f"lora_{seed}", save_every=cfg["iterations"])
            runs["tide"].append(e2e_tide(cfg, Path(tmp) / "tide"))
            runs["trl"].append(run_trl_process(cfg, Path(tmp) / "trl"))
            print(f"seed {seed}: " + ", ".join(f"{side} {r[-1].iteration_s():.3f} s/iteration, moving average "
                                               f"{THRESHOLD} after {r[-1].time_to(THRESHOLD):.1f} s of RL"
                                               for side, r in runs.items()), flush=True)
    job = {"seeds": seeds, "iterations": cfg["iterations"], "threshold": THRESHOLD, "window": WINDOW}
    row = report.add(f"LoRA job: time to moving-average reward {THRESHOLD}", "tide (configs/lora.yaml)",
                     "trl GRPOTrainer + peft LoraConfig", f"seconds from the start of RL until the {WINDOW}-iteration "
                     f"mean reward first reaches {THRESHOLD} (inf: not within the run)",
                     [t.time_to(THRESHOLD) for t in runs["tide"]], [t.time_to(THRESHOLD) for t in runs["trl"]],
                     higher_is_better=False, **job)
    report.add("LoRA job: RL iteration", "tide (configs/lora.yaml)", "trl GRPOTrainer + peft LoraConfig",
               "seconds between consecutive iterations' rewards", [t.iteration_s() for t in runs["tide"]],
               [t.iteration_s() for t in runs["trl"]], higher_is_better=False, **job)
    report.add("LoRA job: reward gain", "tide (configs/lora.yaml)", "trl GRPOTrainer + peft LoraConfig",
               "mean reward of the last two iterations minus the first two's",
               [sum(t.rewards[-2:]) / 2 - sum(t.rewards[:2]) / 2 for t in runs["tide"]],
               [sum(t.rewards[-2:]) / 2 - sum(t.rewards[:2]) / 2 for t in runs["trl"]], **job)
    # a side that never reaches the threshold in a seed fails the goal (Report.goal reads the row's samples)
    report.goal(f"LoRA job: time to moving-average reward {THRESHOLD} (TRL / tide)",
                ratio_of(row["baseline_median"], row["contender_median"]), 1.0, row=row)


def main() -> None:
    args = bench_arguments(__doc__).parse_args()
    report = Report("lora", args.quick)
    repeats = repeats_for(args.quick)
    sync_and_generation(report, args.quick, repeats)
    rl_iterations(report, args.quick, repeats)
    against_trl(report, args.quick)
    report.finish()


if __name__ == "__main__":
    main()
