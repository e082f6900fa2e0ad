"""Rollout throughput: tide's rollout path (vLLM engine in its own process, k samples per prompt with the
log-prob of every sampled token) against Hugging Face `generate` on the same model, prompts and sampling
settings, also returning the sampled tokens' log-probs. Figure of merit: generated tokens per second.

    .venv/bin/python scripts/bench_rollout.py [--quick]     writes bench_results/rollout.json

The model is a Qwen2-architecture decoder of about 100M parameters (random init, float32; --quick: about
25M) built locally like the quickstart's. Both sides sample at temperature 1 with no top-k/top-p, stop at
EOS or `max_new_tokens`, and use every core; tokens are counted as generated (EOS-stopped sequences count
only what they produced), so the metric does not favour either side's stopping. HF batches all prompts x
samples in one `generate` call (its best case on CPU); the first call of each side is a warm-up.

Floor: decoding is bound by the float32 matrix multiplications of the linear layers on these cores, the same
torch kernels for both sides. `ceiling_tokens_per_s` = measured GEMM FLOP/s (all threads, the model's own
shapes at the benchmark's batch) / (2 x linear-layer parameters) per generated token, attention left out (so
it is an upper bound); each side's fraction of it shows how much room a faster engine could still find.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, alternate, bench_arguments, repeats_for, timed  # noqa: E402

TARGET = 3.0


def build_model(tmp: Path, quick: bool) -> Path:
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    # ~104M parameters (12 x 8.7M per layer); quick: ~25M
    hidden, layers, inter = (512, 6, 2048) if quick else (768, 12, 3072)
    spec = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=hidden // 64, num_kv_heads=4,
                           intermediate_size=inter, max_position_embeddings=512)
    return build_tiny_model(tmp / "model", AdditionTask(4).corpus(), spec)


class HFGenerate:
    """transformers' generate on the whole batch, with the sampled tokens' raw log-probs."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def __call__(self, prompts: list[str], n: int, max_new_tokens: int, seed: int) -> int:
        torch = self.torch
        torch.manual_seed(seed)
        batch = self.tok(prompts, return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = self.model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      num_return_sequences=n, max_new_tokens=max_new_tokens,
                                      return_dict_in_generate=True, output_logits=True,
                                      pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
            new = out.sequences[:, batch["input_ids"].shape[1]:]
            logits = torch.stack(out.logits, dim=1)  # [B, T, V] raw logits, what tide returns log-probs of
            logprobs = torch.log_softmax(logits.float(), -1).gather(-1, new[..., None])[..., 0]
        eos = self.tok.eos_token_id
        produced = 0
        for row in new.tolist():  # tokens up to and including the first EOS
            produced += row.index(eos) + 1 if eos in row else len(row)
        assert logprobs.shape == new.shape
        return produced


def gemm_ceiling(model, batch: int, repeats: int = 5) -> tuple[float, float]:
    """(GEMM FLOP/s over the model's linear-layer shapes at `batch` rows, FLOPs per token)."""
    import time

    import torch

    shapes = [m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)]
    flops_per_token = sum(2 * o * i for o, i in shapes)
    weights = [torch.randn(o, i) for o, i in shapes]
    x = {i: torch.randn(batch, i) for _, i in shapes}
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(x[w.shape[1]], w)
        best = min(best, time.perf_counter() - t0)
    return flops_per_token * batch / best, flops_per_token


def main() -> None:
    args = bench_arguments(__doc__).parse_args()

    from rollout.config import EngineConfig
    from rollout.engine import RolloutEngine
    from rollout.tasks import AdditionTask

    quick = args.quick
    repeats = repeats_for(quick)
    n_prompts, n_samples, max_new = (16, 4, 32) if quick else (64, 4, 64)
    report = Report("rollout", quick)
    tmp = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    try:
        model_dir = build_model(tmp, quick)
        problems = AdditionTask(4).problems(seed=0, iteration=1, n=n_prompts)
        prompts = [p.prompt for p in problems]
        engine = RolloutEngine(str(model_dir), EngineConfig(kv_cache_gb=1.0), seed=0)
        hf = HFGenerate(model_dir)
        seeds = iter(range(10_000))

        def tide_rate() -> float:
            produced = []
            s = timed(lambda: produced.append(engine.generate(problems, n_samples, max_new, 1.0, next(seeds))))
            return sum(len(x.completion_ids) for x in produced[0]) / s

        def hf_rate() -> float:
            produced = []
            s = timed(lambda: produced.append(hf(prompts, n_samples, max_new, next(seeds))))
            return produced[0] / s

        tide_rate(), hf_rate()  # warm-up
        a, b = alternate(tide_rate, hf_rate, repeats)
        params = sum(p.numel() for p in hf.model.parameters())
        flops, per_token = gemm_ceiling(hf.model, n_prompts * n_samples)
        ceiling = flops / per_token
        row = report.add("rollout generate", "tide RolloutEngine (vLLM)", "transformers generate",
                         "generated tokens/s", a, b, parameters=params, prompts=n_prompts, samples_per_prompt=n_samples,
                         max_new_tokens=max_new, gemm_gflops=flops / 1e9, ceiling_tokens_per_s=ceiling)
        row["contender_fraction_of_ceiling"] = row["contender_median"] / ceiling
        row["baseline_fraction_of_ceiling"] = row["baseline_median"] / ceiling
        row["max_ratio_allowed_by_ceiling"] = ceiling / row["baseline_median"]
        print(f"GEMM ceiling {ceiling:.0f} tokens/s ({flops / 1e9:.1f} GFLOP/s); tide {row['contender_median']:.0f}, "
              f"HF {row['baseline_median']:.0f}: at most {ceiling / row['baseline_median']:.2f}x HF is possible here")
        report.goal("rollout_tokens_per_s_vs_hf_generate", row["ratio"], TARGET)
        engine.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.finish()


if __name__ == "__main__":
    main()
