"""Long sequences (issue 61): the trainer's memory-efficient attention, packing, recompute and chunked log-probs
against today's path, one RL train step at a time.

    .venv/bin/python scripts/bench_long.py [--quick] [--parts lengths,long_tail,32k] [--lengths 1024,2048]
                                           [--step-memory-gb 10] [--out PATH]

lengths: one RL step (loss kimi, which steps on a single sequence) of one sequence of L positions on a ~100M
  Qwen2 model (hidden 768, 12 layers, 12 heads, 4 key/value heads, MLP 2048, vocabulary 16384; --quick: ~5M)
  at L = 1k, 2k, 4k, 8k, 16k (--quick: 1k, 2k, 4k). The new path: trainer.attention sdpa, logprob_chunk 4096
  and recompute `none` below RECOMPUTE_FULL_FROM positions, `full` from there (what fits the budget); today's:
  attention eager (Megatron's local attention), logprob_chunk null, recompute none. Figures: peak memory (the
  rank process's RSS high-water mark over the step: VmHWM after the step, reset before it; the process's RSS
  before the step, model and Adam state included, is reported beside it), tokens/s, and the share of the
  machine's GEMM rate the step's model FLOPs reach.
long_tail: 32 sequences (--quick: 16) with lengths drawn log-uniformly from 32..4096 (--quick: ..2048; seed
  0), one RL step (grpo) on a ~25M model (--quick: the ~5M one): packed (trainer.packing, micro_batch_tokens
  4096) against today's sorted, padded micro-batches with the same budget; both on sdpa with logprob_chunk 4096,
  so that only the packing differs. Figure: trained positions per second (padding not counted).
32k: one RL step of one 32,768-position sequence on a ~25M model (hidden 512, 8 layers, 8 heads; --quick: a
  ~1M model) on the new path with recompute full, and today's path beside it. Goal: it trains (the step finishes
  with a finite loss).

Each side runs in a worker process of its own (scripts/capped_rank.py: one Megatron rank of world size 1, both
sides alive at once, stepped alternately A B A B) whose data segment is capped once built: a step may allocate
--step-memory-gb more (at most what the machine has available less both built workers and a margin). A step that
needs more fails with an allocation error and counts as failed (peak memory: inf, more than the budget; tokens/s:
no figure), and is not repeated at that length. Repeats: 5 at L <= 4k, 3 at 8k, 2 at 16k and one 32k step (a step at 16k takes minutes on 2 cores);
--quick: 3, and the long sizes once.

Memory planner (trainer/memory_plan.py, `tide plan`), when present: its estimate of each measured step's peak
is written beside it (`planned_peak_bytes`, `planned_over_measured`).
"""
from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import ROOT, Report, bench_arguments, ratio_of  # noqa: E402
from capped_rank import CappedRank, StepResult  # noqa: E402

GiB = 2**30
MODELS = {  # TinyModelConfig fields (family qwen2)
    "100m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                 vocab_multiple=16384),
    "25m": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1024,
                vocab_multiple=4096),
    "5m": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768,
               vocab_multiple=4096),
    "1m": dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_multiple=256),
}
PLAN = {  # per mode: (model, lengths) of each part
    False: {"lengths": ("100m", (1024, 2048, 4096, 8192, 16384)), "long_tail": ("25m", (32, 4096, 32)),
            "32k": ("25m", 32768)},
    True: {"lengths": ("5m", (1024, 2048, 4096)), "long_tail": ("5m", (32, 2048, 16)), "32k": ("1m", 32768)},
}
# The new path's recompute: `none` keeps every activation (fastest); from this many positions the ~100M model's
# activations (~1.5 MB per position in float32) pass the step budget, and `full` keeps each layer's input only
RECOMPUTE_FULL_FROM = 8192
TODAY = dict(attention="eager", logprob_chunk=None, recompute="none")
NEW = dict(attention="sdpa", logprob_chunk=4096)
LONG_TAIL_BUDGET = 4096
# The goals at 8k; --quick, whose lengths stop at 4k, holds its 4k figures to them
GOAL_LENGTH = {False: 8192, True: 4096}


def repeats(length: int, quick: bool) -> int:
    if length > 4096:
        return 1 if quick else (3 if length <= 8192 else 2)
    return 3 if quick else 5


def new_path(length: int) -> dict:
    return NEW | {"recompute": "full" if length >= RECOMPUTE_FULL_FROM else "none"}


def describe(trainer: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in trainer.items() if k not in ("loss", "micro_batch_size"))


def build_model(name: str, work: Path) -> Path:
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="qwen2", max_position_embeddings=32768, **MODELS[name])
    return build_tiny_model(work / f"bench-long-{name}", AdditionTask(2).corpus(), spec, seed=0)


def model_facts(model_dir: Path) -> dict:
    """Parameters and FLOPs per token: PaLM's count (Chowdhery et al. 2022, appendix B), 6 N + 12 l h d L per
    token for a step (forward and backward) over L positions, N the parameters outside the input embedding;
    recomputation is not counted (model FLOPs, not hardware FLOPs)."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    h, f, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    d, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * heads * d * 2 + 2 * h * kv * d + (heads + 2 * kv) * d + 3 * h * f + 2 * h
    n = layers * per_layer + h + h * v  # layers, final norm, output layer
    return {"parameters": n + h * v, "non_embedding_parameters": n, "layers": layers, "heads": heads, "head_dim": d}


def step_flops(facts: dict, length: int) -> float:
    return length * (6 * facts["non_embedding_parameters"]
                     + 12 * facts["layers"] * facts["heads"] * facts["head_dim"] * length)


def gemm_rate(threads: int) -> float:
    """The machine's float32 GEMM FLOP/s with torch's matmul (the kernel of the model's linears) on `threads`
    threads: the best of a few shapes of the models' projections, each the best of 3 timed runs."""
    import torch

    torch.set_num_threads(threads)
    best = 0.0
    for m, k, n in ((4096, 768, 2048), (4096, 2048, 768), (2048, 2048, 2048)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        for _ in range(3):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


def planner_estimate(model_dir: Path, length: int, trainer: dict) -> int | None:
    """trainer/memory_plan.py's peak for this step, or None where the planner is not in this checkout."""
    try:
        from transformers import AutoConfig

        from ckpt_transfer.convert import family
        from trainer.memory_plan import ModelShape, single_step_memory
    except ImportError:
        return None
    hf = AutoConfig.from_pretrained(model_dir)
    shape = ModelShape.from_megatron(family(hf).megatron_transformer_kwargs(hf), hf.vocab_size,
                                     bool(getattr(hf, "tie_word_embeddings", False)))
    return single_step_memory(shape, length, attention=trainer["attention"], recompute=trainer["recompute"],
                              logprob_chunk=trainer["logprob_chunk"]).total


def step_budget(requested_gb: float, built_bytes: int = 3 * GiB) -> int:
    """What a worker's step may allocate: as requested, but at most what the machine has available less the two
    built workers (~2.7 GB each at ~100M) and a margin, so that a step that fails does so by its own allocation
    error and not the kernel's OOM killer."""
    available = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    return int(min(requested_gb * GiB, available - 2 * built_bytes - 2 * GiB))


def figures(results: list[StepResult], tokens: int) -> tuple[list[float], list[float], list[float]]:
    """tokens/s (NaN: no figure), peak bytes (inf: the step needed more than its budget, NaN: failed otherwise) and
    the step's baseline RSS, per sample."""
    speed = [tokens / r.seconds if r.ok else math.nan for r in results]
    peak = [r.peak_bytes if r.ok else (math.inf if r.out_of_memory else math.nan) for r in results]
    return speed, peak, [r.baseline_bytes for r in results]


def alternate_steps(a: CappedRank, b: CappedRank, lengths: list[int], n: int, seed: int
                    ) -> tuple[list[StepResult], list[StepResult]]:
    """A B A B ... on the same batch (`lengths`, `seed`); a side whose step failed is not stepped again."""
    ra: list[StepResult] = []
    rb: list[StepResult] = []
    for _ in range(n):
        for side, out in ((a, ra), (b, rb)):
            if not out or out[-1].ok:
                out.append(side.step(lengths, seed))
                r = out[-1]
                print(f"    {describe(side.trainer)}: " + (f"{r.seconds:.2f} s, peak {r.peak_bytes / GiB:.2f} GiB "
                      f"(before {r.baseline_bytes / GiB:.2f})" if r.ok else f"FAILED {r.error[:160]}"), flush=True)
    return ra, rb


def failures(results: list[StepResult]) -> list[str]:
    return [r.error for r in results if not r.ok]


def run_lengths(report: Report, quick: bool, work: Path, lengths: list[int], budget: int, gemm: float) -> None:
    name, default_lengths = PLAN[quick]["lengths"]
    model_dir = build_model(name, work)
    facts = model_facts(model_dir)
    report.note("lengths_model", {"name": name, **MODELS[name], **facts})
    today = CappedRank(str(model_dir), dict(loss="kimi", micro_batch_size=1, **TODAY), budget)
    new: CappedRank | None = None
    try:
        for length in lengths or default_lengths:
            trainer = dict(loss="kimi", micro_batch_size=1, **new_path(length))
            if new is None or new.trainer != trainer:
                if new is not None:
                    new.close()
                new = CappedRank(str(model_dir), trainer, budget)
            print(f"L={length}: {describe(new.trainer)} vs {describe(today.trainer)}", flush=True)
            ra, rb = alternate_steps(new, today, [length], repeats(length, quick), seed=length)
            (sa, pa, ba), (sb, pb, bb) = figures(ra, length), figures(rb, length)
            flops = step_flops(facts, length)
            speed = report.add(f"step L={length} tokens/s", describe(new.trainer), describe(today.trainer),
                               "positions trained per second (one RL step, one sequence)", sa, sb, length=length,
                               model_flops=flops, gemm_share_contender=_share(sa, flops / length, gemm),
                               gemm_share_baseline=_share(sb, flops / length, gemm),
                               failed_contender=failures(ra), failed_baseline=failures(rb))
            planned = {k: planner_estimate(model_dir, length, r.trainer) for k, r in (("new", new), ("today", today))}
            memory = report.add(f"step L={length} peak memory", describe(new.trainer), describe(today.trainer),
                                "bytes, the rank's RSS high-water mark over the step (inf: needed more than the "
                                "step budget)", pa, pb, higher_is_better=False, length=length,
                                baseline_rss_contender=ba, baseline_rss_baseline=bb, step_budget_bytes=budget,
                                planned_peak_contender=planned["new"], planned_peak_baseline=planned["today"],
                                planned_over_measured_contender=_over(planned["new"], pa),
                                planned_over_measured_baseline=_over(planned["today"], pb))
            for side, key in (("new", "contender"), ("today", "baseline")):
                if planned[side] is not None:
                    print(f"  planner, {side}: {planned[side] / GiB:.2f} GiB planned / "
                          f"{memory[key + '_median'] / GiB:.2f} GiB measured", flush=True)
            length_goals(report, length, speed, memory, quick)
    finally:
        today.close()
        if new is not None:
            new.close()


def length_goals(report: Report, length: int, speed: dict, memory: dict, quick: bool) -> None:
    """The issue's goals on one length's rows: tokens/s >= 1.0x today's at 1k; at 8k (--quick: 4k) peak memory
    <= 0.35x today's "or today's fails" (a failed side's peak is inf: today's failing gives an infinite ratio, the
    new path's failing no ratio) and tokens/s >= 1.3x (a failed side on either hand: not met)."""
    if length == 1024:
        report.goal("tokens/s at 1k, new / today's", speed["ratio"], 1.0, row=speed)
    if length == GOAL_LENGTH[quick]:
        k = f"{length // 1024}k"
        report.goal(f"peak memory at {k}, today's / new (>= 1/0.35; today's failing counts as met)",
                    ratio_of(memory["baseline_median"], memory["contender_median"]), 1 / 0.35, row=memory,
                    met_when_baseline_fails=True)
        report.goal(f"tokens/s at {k}, new / today's", speed["ratio"], 1.3, row=speed)


def _share(speeds: list[float], flops_per_token: float, gemm: float) -> float:
    ok = [s for s in speeds if math.isfinite(s)]
    return statistics.median(ok) * flops_per_token / gemm if ok else math.nan


def _over(planned: int | None, peaks: list[float]) -> float | None:
    ok = [p for p in peaks if math.isfinite(p)]
    return planned / statistics.median(ok) if planned is not None and ok else None


def long_tail_lengths(low: int, high: int, n: int, seed: int = 0) -> list[int]:
    """`n` lengths drawn log-uniformly from low..high: most short, a few long (a reasoning batch's tail)."""
    rng = random.Random(seed)
    return [min(high, round(math.exp(rng.uniform(math.log(low), math.log(high))))) for _ in range(n)]


def run_long_tail(report: Report, quick: bool, work: Path, budget: int) -> None:
    name, (low, high, n) = PLAN[quick]["long_tail"]
    model_dir = build_model(name, work)
    lengths = long_tail_lengths(low, high, n)
    common = dict(loss="grpo", micro_batch_tokens=LONG_TAIL_BUDGET, recompute="none", **NEW)
    packed = CappedRank(str(model_dir), common | {"packing": True}, budget)
    padded = CappedRank(str(model_dir), common | {"packing": False}, budget)
    print(f"long tail: {n} sequences, {sum(lengths)} positions, {min(lengths)}..{max(lengths)}; model {name}",
          flush=True)
    try:
        ra, rb = alternate_steps(packed, padded, lengths, 3 if quick else 5, seed=1)
    finally:
        packed.close()
        padded.close()
    (sa, pa, _), (sb, pb, _) = figures(ra, sum(lengths)), figures(rb, sum(lengths))
    row = report.add("long-tail batch tokens/s", "packed (thd), micro_batch_tokens 4096",
                     "sorted padded micro-batches, micro_batch_tokens 4096", "sequence positions per second "
                     "(padding not counted), one RL step", sa, sb, model=name, lengths=lengths,
                     peak_contender=pa, peak_baseline=pb, failed_contender=failures(ra), failed_baseline=failures(rb))
    report.goal("long-tail batch tokens/s, packed / padded", row["ratio"], 1.3, row=row)


def run_32k(report: Report, quick: bool, work: Path, budget: int) -> None:
    name, length = PLAN[quick]["32k"]
    model_dir = build_model(name, work)
    new = CappedRank(str(model_dir), dict(loss="kimi", micro_batch_size=1, recompute="full", **NEW), budget)
    today = CappedRank(str(model_dir), dict(loss="kimi", micro_batch_size=1, **TODAY), budget)
    print(f"{length}-position sequence, model {name}", flush=True)
    try:
        ra, rb = alternate_steps(new, today, [length], 1, seed=length)
    finally:
        new.close()
        today.close()
    (sa, pa, ba), (sb, pb, _) = figures(ra, length), figures(rb, length)
    row = report.add(f"step L={length} tokens/s", describe(new.trainer), describe(today.trainer),
                     "positions trained per second (one RL step, one sequence)", sa, sb, model=name, length=length,
                     seconds_contender=[r.seconds for r in ra], peak_contender=pa, baseline_rss_contender=ba,
                     peak_baseline=pb, loss_contender=[r.loss for r in ra], failed_contender=failures(ra),
                     failed_baseline=failures(rb),
                     planned_peak_contender=planner_estimate(model_dir, length, new.trainer))
    # today's path is beside it to show that it cannot: the goal is the new path's step alone
    report.goal(f"a {length}-position sequence trains (1: finite loss)", float(all(r.ok for r in ra)), 1.0,
                row=row, met_when_baseline_fails=True)


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--parts", default="lengths,long_tail,32k")
    ap.add_argument("--lengths", default=None, help="comma-separated sequence lengths of the lengths part")
    ap.add_argument("--step-memory-gb", type=float, default=10.0,
                    help="what a worker's step may allocate beyond the built rank (its RLIMIT_DATA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = Report("long", args.quick, out=args.out)
    budget = step_budget(args.step_memory_gb)
    threads = os.cpu_count() or 1
    gemm = gemm_rate(threads)
    report.machine_extra |= {"gemm_flops_float32": gemm, "step_budget_bytes": budget, "threads_per_worker": threads}
    report.note("paths", {"today": TODAY, "new": NEW, "new_recompute_full_from": RECOMPUTE_FULL_FROM,
                          "loss": "kimi (lengths, 32k: steps on one sequence); grpo (long_tail)"})
    work = ROOT / ".cache" / "tide"
    work.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    if "lengths" in parts:
        run_lengths(report, args.quick, work, lengths, budget, gemm)
    if "long_tail" in parts:
        run_long_tail(report, args.quick, work, budget)
    if "32k" in parts:
        run_32k(report, args.quick, work, budget)
    report.finish()


if __name__ == "__main__":
    main()
