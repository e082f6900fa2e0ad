"""Second models (issue 64): a served reward model's scoring throughput against the same model in a plain
transformers loop in this process, and the scoring phase's share of an RL iteration.

    .venv/bin/python scripts/bench_second_models.py [--quick]     writes bench_results/second_models.json

- **scoring** (goal >= 1.0x, per batch shape): conversations scored per second by a reward model the size of
  bench_rollout.py's ~100M Qwen2 (--quick: ~25M) with a one-label score head (random weights: the work does not
  depend on them). Contender: tide's served model (`models:`, orchestrator/workers/served_models.py) as a run
  configures it on this 2-core machine: two replicas of one torch thread each, batch_size 64. Baseline: the same
  directory loaded in this process with transformers' AutoModelForSequenceClassification (torch's default threads, every
  core) and called as a TRL reward function would: the conversations through the tokenizer's chat template with
  padding, 64 at a time, `logits[:, 0]`. Same conversations, alternating, each side warmed up once (and checked
  to give the same scores). Two batches: the quickstart job's (64 prompts x 8 samples, answers of a few tokens;
  --quick 16 x 8) and 200-character completions (reasoning-like lengths the tiny task does not produce; 4 x 8,
  --quick 16 x 8).
- **share** (reported): configs/reward_model.yaml's job as shipped (its tiny reward model, here trained for a
  few steps only: seconds do not depend on its weights), 12 iterations: the reward phase's median seconds over the
  median iteration's, iterations past the first.
"""
from __future__ import annotations

import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, alternate, bench_arguments, repeats_for  # noqa: E402
from bench_rollout import build_model  # noqa: E402

BATCH = 64


def conversations(n_prompts: int, n_samples: int, long: bool, seed: int = 0) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    prompts, completions = [], []
    for _ in range(n_prompts):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        for _ in range(n_samples):
            size = 200 if long else rng.randint(1, 3)
            prompts.append(f"{a}+{b}=")
            completions.append("".join(rng.choice("0123456789+= ") for _ in range(size)))
    return prompts, completions


class PlainLoop:
    """The baseline: transformers in this process, as a reward function calls a reward model."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()

    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        scores = []
        for lo in range(0, len(prompts), BATCH):
            chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                     for p, c in zip(prompts[lo:lo + BATCH], completions[lo:lo + BATCH])]
            batch = self.tok.apply_chat_template(chats, tokenize=True, padding=True, return_tensors="pt",
                                                 return_dict=True)
            with self.torch.inference_mode():
                scores.extend(self.model(**batch).logits[:, 0].tolist())
        return scores


def reward_model_dir(tmp: Path, quick: bool) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    lm = build_model(tmp, quick)
    out = tmp / "rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(lm, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(lm).pad_token_id
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(lm).save_pretrained(out)
    return out


def scoring(report: Report, quick: bool, repeats: int) -> None:
    import ray

    from orchestrator.workers.served_models import ServedModels
    from orchestrator.rewards.served_config import ServedModelConfig

    tmp = Path(tempfile.mkdtemp(prefix="bench_second_models_"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    served = None
    try:
        path = reward_model_dir(tmp, quick)
        served = ServedModels({"rm": ServedModelConfig(path=str(path), replicas=2, threads=1, batch_size=BATCH)})
        plain = PlainLoop(path)
        for long in (False, True):
            # 200-character completions at ~100M: 4 prompts x 8 keep a measurement under half a minute here
            prompts, completions = conversations(16 if quick else (4 if long else 64), 8, long)
            here, there = plain(prompts, completions), served["rm"].score(prompts, completions)  # warm-up
            worst = max(abs(a - b) for a, b in zip(here, there))
            if worst > 1e-3:  # not the same work if not the same scores
                raise RuntimeError(f"served and plain scores differ by {worst:g}")

            def rate(score) -> float:
                t0 = time.perf_counter()
                score(prompts, completions)
                return len(prompts) / (time.perf_counter() - t0)

            a, b = alternate(lambda: rate(served["rm"].score), lambda: rate(plain), repeats)
            shape = "200-character completions" if long else "the quickstart job's answers"
            row = report.add(f"scoring: {shape}", "served reward model (models:, 2 replicas x 1 thread)",
                             "transformers in-process (all cores)", "conversations/s", a, b,
                             conversations=len(prompts), batch_size=BATCH, max_abs_score_difference=worst,
                             model="~25M" if quick else "~100M")
            report.goal(f"served reward-model scoring vs plain transformers ({shape})", row["ratio"], 1.0, row=row)
            print(f"{shape}: served {row['contender_median']:.0f}/s, plain {row['baseline_median']:.0f}/s", flush=True)
    finally:
        if served is not None:
            served.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def share(report: Report, quick: bool) -> None:
    import subprocess

    from bench_lora import iteration_seconds
    from bench_sample_efficiency import tide_run
    from orchestrator.records.rundir import read_jsonl

    with tempfile.TemporaryDirectory(prefix="bench_second_models_run_") as tmp:
        rm = Path(tmp) / "rm"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "train_reward_model.py"), "--out", str(rm),
                        "--steps", "2", "--lm-steps", "2"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        cfg = yaml.safe_load((ROOT / "configs" / "reward_model.yaml").read_text())
        cfg["models"]["rm"]["path"] = str(rm)
        cfg.update(iterations=6 if quick else 12, save_every=100)
        run_dir = tide_run(cfg, Path(tmp) / "run")
        reward = [r["seconds"] for r in read_jsonl(run_dir / "timings.jsonl")
                  if r["phase"] == "reward" and r["iteration"] > 1]
        iteration = iteration_seconds(run_dir)
    report.note("reward_phase_share", {"job": "configs/reward_model.yaml", "iterations": cfg["iterations"],
                                       "reward_phase_median_s": statistics.median(reward),
                                       "iteration_median_s": iteration,
                                       "share": statistics.median(reward) / iteration})
    print(f"reward phase {statistics.median(reward):.3f} s of a {iteration:.3f} s iteration", flush=True)


def main() -> None:
    args = bench_arguments(__doc__).parse_args()
    report = Report("second_models", args.quick)
    scoring(report, args.quick, repeats_for(args.quick))
    share(report, args.quick)
    report.finish()


if __name__ == "__main__":
    main()
