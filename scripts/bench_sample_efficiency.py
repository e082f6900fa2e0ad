"""Sample efficiency against TRL on the quickstart job: iterations until the 5-iteration moving average of
reward reaches 0.5, for tide and for TRL's GRPOTrainer given the same job.

The same job on both sides, seed by seed: the same tiny model directory (built once by tide from the config),
the same supervised warm start (40 Adam steps of 64 reference answers at lr 3e-3, then a fresh optimizer), the
same prompts in the same order (64 per iteration, 8 samples each, 4 new tokens at temperature 1), 4 optimizer
steps per iteration, lr 1e-3 decayed linearly to 0 over the run (TRL's default scheduler; tide's
`lr_schedule: {decay: linear}`; the full run repeats everything with a constant rate), no KL, clip 0.2, token-level loss (TRL's default `dapo`, tide's `grpo` with
`token_mean`), group-std advantages (TRL's default `scale_rewards: group`), gradient clipping 1.0, fp32 on CPU.
TRL is otherwise left at its defaults, as its users run it (transformers generation, no vLLM).

A run that never reaches 0.5 counts as infinitely many iterations on either side. Goal (issue 13): tide's
median over the seeds within 1.2x TRL's with TRL's default (linear) schedule, reported as TRL / tide >= 1 / 1.2.

    python scripts/bench_sample_efficiency.py            # seeds 1 2 3, 70 iterations, linear and constant lr
    python scripts/bench_sample_efficiency.py --quick    # seed 1, 40 iterations, linear (about 4 minutes)
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, bench_arguments, ratio_of, sft_steps  # noqa: E402

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
TARGET, WINDOW = 0.5, 5


def iterations_to_target(rewards: list[float], target: float = TARGET, window: int = WINDOW) -> float:
    """First iteration (1-based) whose trailing `window`-iteration mean reward is >= target; inf if none."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window:end]) / window >= target:
            return float(end)
    return math.inf


def job_config(seed: int, iterations: int, decay: str = "linear") -> dict:
    cfg = yaml.safe_load(QUICKSTART.read_text())
    cfg.update(name=f"sample_efficiency_{seed}", seed=seed, iterations=iterations, save_every=iterations)
    t = cfg["trainer"]
    t.update(loss="grpo", loss_agg="token_mean", adv_std_norm=True, lr=1.0e-3, updates_per_iteration=4,
             lr_schedule={"warmup_iterations": 0, "decay": decay, "min_lr": 0.0}, kl={"coef": 0.0})
    cfg["rollout"].update(temperature=1.0, top_p=1.0, top_k=0)
    return cfg


def tide_run(cfg: dict, work: Path) -> Path:
    """`tide run` of the job in a fresh process, as a user starts it; returns the run directory."""
    work.mkdir(parents=True, exist_ok=True)
    path, run_dir = work / f"{cfg['name']}.yaml", work / f"tide_{cfg['name']}"
    path.write_text(yaml.safe_dump(cfg))
    subprocess.run([sys.executable, "-m", "orchestrator.run.cli", "run", str(path), "--run-dir", str(run_dir)],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def run_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl of a run, in iteration order."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted(metrics, key=lambda m: m["iteration"])


def run_tide(cfg: dict, work: Path) -> list[float]:
    return [m["reward_mean"] for m in run_metrics(tide_run(cfg, work))]


def run_trl(cfg: dict, work: Path, clock: list[float] | None = None) -> list[float]:
    """TRL's GRPOTrainer on the job; returns the mean reward of every generation (one per iteration).
    `clock`, when given, receives time.time() when training starts and when each generation is scored."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from orchestrator.iteration.batches import text_batch
    from orchestrator.config.model_source import resolve_model_dir
    from rollout.config import TaskConfig
    from rollout.tasks import make_task
    from trainer.tiny_model import TinyModelConfig

    seed, t, r = cfg["seed"], cfg["trainer"], cfg["rollout"]
    task = make_task(TaskConfig(**cfg["task"]))
    # the job's model: a directory (a pretrained base, as configs/lora.yaml's) or the tiny model tide builds
    model_dir = cfg["model"].get("path") or resolve_model_dir(None, TinyModelConfig(**cfg["model"]["tiny"]), task, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if t.get("warmup_sft_steps"):
        warm_start(model, tokenizer, text_batch, task, seed, t)
    peft_config = None
    if t.get("lora"):  # trainer.lora as PEFT's LoraConfig: the same rank, alpha, dropout and target projections
        from peft import LoraConfig

        lora = t["lora"]
        peft_config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora.get("dropout", 0.0),
                                 target_modules=list(lora["target_modules"]), task_type="CAUSAL_LM")

    per_iteration = r["prompts_per_iteration"]
    problems = [p for it in range(1, cfg["iterations"] + 1) for p in task.problems(seed, it, per_iteration)]
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    rewards_per_call: list[float] = []

    def reward(prompts, completions, answer, **_):
        scores = task.score([_Answer(a) for a in answer], completions)
        rewards_per_call.append(sum(scores) / len(scores))
        if clock is not None:
            clock.append(time.time())
        return scores

    updates = t["updates_per_iteration"]
    args = GRPOConfig(
        output_dir=str(work / f"trl_{seed}"), seed=seed, use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", logging_steps=updates, disable_tqdm=True,
        max_steps=cfg["iterations"] * updates, learning_rate=t["lr"], max_grad_norm=t.get("grad_clip", 1.0),
        per_device_train_batch_size=per_iteration * r["n_samples"] // updates, steps_per_generation=updates,
        num_generations=r["n_samples"], max_completion_length=r["max_new_tokens"], temperature=1.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group", shuffle_dataset=False,
        lr_scheduler_type=t["lr_schedule"]["decay"], warmup_steps=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    if clock is not None:
        clock.append(time.time())
    trainer.train()
    return rewards_per_call


class _Answer:
    """What `Task.score` reads of a problem: its reference answer."""

    def __init__(self, answer: str) -> None:
        self.answer = answer


def warm_start(model, tokenizer, text_batch, task, seed: int, t: dict) -> None:
    """tide's supervised warm start on the task's reference answers (bench_common.sft_steps); the RL optimizer
    starts fresh afterwards, as in tide."""
    examples = task.sft_examples(seed, t["warmup_sft_steps"] * t["warmup_sft_batch"])
    sft_steps(model, text_batch(tokenizer, examples).sequences, t["warmup_sft_batch"], t["warmup_sft_steps"],
              t["warmup_sft_lr"], t.get("weight_decay", 0.0), t.get("grad_clip", 1.0), tokenizer.pad_token_id,
              t.get("warmup_sft_stop_loss"))


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=None)
    ap.add_argument("--iterations", type=int, default=None)
    ap.add_argument("--schedules", nargs="+", choices=["linear", "constant"], default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seeds = args.seeds or ([1] if args.quick else [1, 2, 3])
    iterations = args.iterations or (40 if args.quick else 70)
    schedules = args.schedules or (["linear"] if args.quick else ["linear", "constant"])
    report = Report("sample_efficiency", args.quick, out=args.out)
    curves: dict[str, dict[str, dict[int, list[float]]]] = {}
    with tempfile.TemporaryDirectory(prefix="tide-sample-eff-") as tmp:
        for decay in schedules:
            curves[decay] = {"tide": {}, "trl": {}}
            for seed in seeds:  # A B A B: tide then TRL, seed by seed
                cfg = job_config(seed, iterations, decay)
                curves[decay]["tide"][seed] = run_tide(cfg, Path(tmp) / decay)
                curves[decay]["trl"][seed] = run_trl(cfg, Path(tmp) / decay)
                print(f"{decay} lr, seed {seed}: iterations to target: tide "
                      f"{iterations_to_target(curves[decay]['tide'][seed])}, "
                      f"trl {iterations_to_target(curves[decay]['trl'][seed])}", flush=True)
            a = [iterations_to_target(curves[decay]["tide"][s]) for s in seeds]
            b = [iterations_to_target(curves[decay]["trl"][s]) for s in seeds]
            row = report.add(f"iterations to {WINDOW}-iteration mean reward {TARGET}, {decay} lr", "tide",
                             "trl GRPOTrainer", "iterations (inf: not within the run)", a, b,
                             higher_is_better=False, seeds=seeds, iterations=iterations, lr_decay=decay)
            report.add(f"mean reward over the run, {decay} lr", "tide", "trl GRPOTrainer",
                       "mean reward of all iterations (area under the curve; a steadier figure than the first "
                       "crossing)", [sum(curves[decay]["tide"][s]) / iterations for s in seeds],
                       [sum(curves[decay]["trl"][s]) / iterations for s in seeds], seeds=seeds,
                       iterations=iterations, lr_decay=decay)
            if decay == "linear":
                report.goal("tide within 1.2x TRL's iterations, TRL's default schedule (TRL / tide)",
                            ratio_of(1.0, row["ratio"]), 1 / 1.2, row=row)
    report.note("reward_curves", curves)
    report.note("job", job_config(seeds[0], iterations))
    report.finish()


if __name__ == "__main__":
    main()
