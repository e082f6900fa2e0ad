"""scripts/gpu_check.py's long-sequence step (issue 61): per family, one bf16 Megatron rank of a ~1B-class model with
trainer.attention sdpa (torch's flash / memory-efficient kernels on CUDA) trains one sequence of 8k and of 16k
positions: peak memory (torch.cuda.max_memory_allocated over the step, reset before it; on cpu the process's RSS
high-water mark), tokens/s (median of the timed steps after one untimed step per length), and its logits on a
prefix of the sequence against transformers' (bf16, its own sdpa attention) on the same device.

The dense families qwen2, qwen3 (q/k norms) and llama3 (llama3 rope scaling) and one mixture of experts
(qwen3_moe) by default. `--quick` (the CPU test) runs the same code on the tiny sizes and short lengths."""
from __future__ import annotations

import math
import shutil
import statistics
import time
from pathlib import Path
from types import ModuleType

LONG_FAMILIES = ("qwen2", "qwen3", "llama3", "qwen3_moe")
LONG_SIZES = {
    # the tiny sizes and lengths of the CPU test
    "quick": dict(model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                             num_experts=4, experts_per_token=2),
                  lengths=(128, 256), timed_steps=1, compare_positions=96),
    # ~1.1B parameters dense (Llama-3.2-1B's widths: hidden 2048, 16 layers, MLP 8192, 8 key/value heads; 16
    # heads of 128; a 32k vocabulary), ~1.2B for qwen3_moe (8 experts of MLP 1408, top 2); bf16 weights, float32
    # gradients and Adam state (~18 GB) and the 16k step's activations fit one 80 GB device without recompute
    "full": dict(model=dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=8192,
                            num_experts=8, experts_per_token=2, vocab_multiple=32768),
                 moe_intermediate_size=1408, lengths=(8192, 16384), timed_steps=2, compare_positions=2048),
}


def _spec(fam: str, quick: bool):
    from trainer.tiny_model import TinyModelConfig

    sizes = LONG_SIZES["quick" if quick else "full"]
    model = dict(sizes["model"])
    if fam in ("qwen3_moe", "mixtral") and "moe_intermediate_size" in sizes:
        model["intermediate_size"] = sizes["moe_intermediate_size"]
    longest = max(sizes["lengths"])
    # init std 0.8 / sqrt(width), as gpu_check's families: logits far from uniform at every width
    return TinyModelConfig(family=fam, init_std=0.8 / math.sqrt(model["hidden_size"]),
                           max_position_embeddings=longest + 1, **model)


def _rl_batch(vocab: int, length: int, seed: int):
    """One sequence of `length` positions (random tokens, a 64-token prompt), reward 1: one RL step (kimi, which
    steps on a single sequence)."""
    import torch

    from trainer.batch import TrainBatch, TrainSequence

    ids = torch.randint(1, vocab, (length + 1,), generator=torch.Generator().manual_seed(seed)).tolist()
    p = min(64, length // 2)
    return TrainBatch([TrainSequence(ids[:p], ids[p:], old_logprobs=[-math.log(vocab)] * (length + 1 - p),
                                     reward=1.0, group=0)])


def _peak_reset(device: str) -> int:
    """Reset the peak-memory counter; returns what is held now (the step's baseline)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    from capped_rank import reset_high_water_mark

    return reset_high_water_mark()


def _peak(device: str) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    from capped_rank import proc_status_bytes

    return proc_status_bytes("VmHWM")


def check_long(fam: str, args, work: Path, checks, host: ModuleType) -> dict:
    """The long-sequence step of one family; `host` is gpu_check (its log, rank teardown, transformers logits
    and logits comparison, bounds). A family that fails to build or step is a failed check."""
    import torch

    from rollout.tasks import AdditionTask
    from trainer.config import TrainerConfig, TrainerSpec
    from trainer.megatron.worker import SINGLE_RANK_PORT, MegatronWorker
    from trainer.tiny_model import build_tiny_model

    sizes = LONG_SIZES["quick" if args.quick else "full"]
    spec = _spec(fam, args.quick)
    rec: dict = {"family": fam, "model": spec.model_dump(), "lengths": list(sizes["lengths"])}
    t0 = time.perf_counter()
    worker = None
    try:
        model_dir = build_tiny_model(work / f"long-{fam}" / "model", AdditionTask(1).corpus(), spec, seed=0)
        vocab = _vocab(model_dir)
        rec["model_build_s"] = time.perf_counter() - t0
        trainer = TrainerConfig(device=args.device, backend=args.backend, loss="kimi", attention="sdpa",
                                micro_batch_size=1, lr=1e-5)
        worker = MegatronWorker(TrainerSpec(hf_dir=str(model_dir), trainer=trainer, dtype="bfloat16", seed=0), 0, 1,
                                "127.0.0.1", SINGLE_RANK_PORT)
        rec["parameters"] = sum(p.numel() for p in worker.module.parameters())
        host.log(f"{fam} long: {rec['parameters'] / 1e9:.2f}B parameters, bf16, attention sdpa on {args.device}")

        # logits first, on the loaded checkpoint, which transformers loads too
        prefix = _rl_batch(vocab, sizes["compare_positions"], seed=1).sequences[0]
        tokens = [(prefix.prompt_ids + prefix.completion_ids)[:sizes["compare_positions"]]]
        ours = worker.logits(tokens)
        theirs = host._hf_logits(model_dir, torch.bfloat16, args.device, tokens, args.fault)
        cmp = host._compare(ours, theirs)
        bound = host.BF16_LOGITS_REL_BOUND * max(1.0, cmp["logit_scale"])
        over = int((cmp["per_position"] > bound).sum())
        positions = cmp["per_position"].numel()
        allowed = int(host.BF16_MOE_FLIP_SHARE * positions) if fam in ("qwen3_moe", "mixtral") else 0
        rec["logits"] = {"positions": positions, "max_abs_diff": cmp["max_abs_diff"], "bound": bound,
                         "positions_over_bound": over, "positions_over_bound_allowed": allowed,
                         "p90_abs_diff": cmp["per_position"].quantile(0.9).item()}
        checks.add(f"{fam}/long_logits_bf16", over <= allowed, cmp["max_abs_diff"], bound,
                   f"Megatron (sdpa) vs transformers, bf16, the first {positions} positions: {over} over the bound "
                   f"({allowed} allowed)")
        del ours, theirs

        rec["steps"] = {}
        for length in sizes["lengths"]:
            batch = _rl_batch(vocab, length, seed=length)
            worker.train_step(batch, lr=1e-5)  # untimed: the kernels' first use at this length
            times, peaks, losses, base = [], [], [], 0
            for _ in range(sizes["timed_steps"]):
                base = _peak_reset(args.device)
                t = time.perf_counter()
                out = worker.train_step(batch, lr=1e-5)
                peaks.append(_peak(args.device))
                times.append(time.perf_counter() - t)
                losses.append(out["loss"])
            step = statistics.median(times)
            rec["steps"][length] = {"step_s": times, "tokens_per_s": length / step, "peak_memory_bytes": max(peaks),
                                    "memory_before_step_bytes": base, "losses": losses}
            host.log(f"{fam} long L={length}: {length / step:.0f} tokens/s ({step:.2f} s), peak "
                     f"{max(peaks) / 2**30:.2f} GiB ({base / 2**30:.2f} before the step)")
            checks.add(f"{fam}/long_{length}_trains", all(math.isfinite(x) for x in losses), losses[-1], None,
                       f"one RL step of one {length}-position sequence, finite loss")
        lo, hi = (rec["steps"][n] for n in sizes["lengths"])
        # activations over the step: the peak less what the rank held before it; linear in L gives ~2 from 8k to
        # 16k, Megatron's local attention ~4
        rec["activation_growth"] = ((hi["peak_memory_bytes"] - hi["memory_before_step_bytes"])
                                    / max(lo["peak_memory_bytes"] - lo["memory_before_step_bytes"], 1))
        rec["ran"] = True
    except Exception as exc:  # noqa: BLE001  (a failed family is a failed check; the others still run)
        import traceback

        rec["ran"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc(limit=8)
        checks.add(f"{fam}/long_runs", False, detail=rec["error"].splitlines()[0][:300])
    finally:
        host._close(worker)
        shutil.rmtree(work / f"long-{fam}", ignore_errors=True)  # a full-size model is ~4.4 GB of float32
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _vocab(model_dir: Path) -> int:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def run_long(args, work: Path, checks, host: ModuleType) -> dict:
    out = {}
    for fam in args.long_families:
        host.log(f"== long sequences {fam}")
        out[fam] = check_long(fam, args, work, checks, host)
    return out
