"""scripts/gpu_check.py's offload step (issue 62, the hybrid deployment: trainer and engines taking turns on one GPU).
Per family of `--offload-families` (default qwen2, qwen3_moe), one bf16 Megatron rank takes a step, publishes and
offloads (trainer/megatron/offload.py), then:

- `offload_frees_memory`: no parameter, gradient or optimizer storage of the rank is left on the device
  (offload.storages), and on cuda torch.cuda.memory_allocated() after the offload is at most OFFLOAD_LEFT_SHARE
  of what it was after the step;
- `engine_beside_offloaded` (cuda, where vLLM is importable: not on the machine of scripts/gpu_check.sh, where it
  is reported as skipped): a vLLM engine in another process on the same GPU, on the weights the rank published,
  generates greedily, sleeps (level 1, as rollout.sleep_level 1 does), wakes and generates the same tokens;
- `offload_round_trip_exact`: after onload a second step; a second rank that took the same two steps without the
  round trip ends with the same losses and the same parameter digest.

Figures: the bytes copied, offload and onload seconds and their GB/s (on cuda: device <-> pinned host memory, the
link docs/training.md's estimate divides by)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

OFFLOAD_FAMILIES = ("qwen2", "qwen3_moe")
OFFLOAD_SIZES = {
    "quick": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, num_experts=4,
                  experts_per_token=2),
    # ~0.2B parameters dense (hidden 1024, 12 layers, MLP 4096): ~3.4 GB of bf16 weights, fp32 main copies and
    # Adam state to move, enough for a bandwidth figure
    "full": dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=4096,
                 num_experts=8, experts_per_token=2),
}
# What may stay allocated on the device after an offload, as a share of what the rank held after its step: the
# allocator's own rounding and the few tensors that are not the rank's state (RNG tracker, rotary tables).
OFFLOAD_LEFT_SHARE = 0.02

ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], gpu_memory_utilization=float(sys.argv[2]), enforce_eager=True, enable_sleep_mode=True,
          dtype="bfloat16", seed=0, max_model_len=256)
greedy = SamplingParams(max_tokens=8, temperature=0.0)
first = llm.generate(["12+34="], greedy)[0].outputs[0].token_ids
llm.sleep(level=1)
llm.wake_up()
again = llm.generate(["12+34="], greedy)[0].outputs[0].token_ids
print("ENGINE " + json.dumps({"tokens": list(first), "after_wake": list(again)}))
"""


def run_offload(args, work: Path, checks, gc: ModuleType) -> dict:
    return gc.per_family(args.offload_families, "offload", lambda fam: _family(fam, args, work, checks, gc), checks)


def _family(fam: str, args, work: Path, checks, gc: ModuleType) -> dict:
    import torch

    from trainer.megatron.offload import storages
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    from rollout.tasks import AdditionTask

    spec = TinyModelConfig(family=fam, **OFFLOAD_SIZES["quick" if args.quick else "full"])
    model_dir = build_tiny_model(work / f"offload-{fam}", AdditionTask(1).corpus(), spec)
    batch = gc._sft_batch(model_dir, 8, 1)
    cuda = args.device == "cuda"
    rec: dict = {}
    worker = None
    try:
        worker = gc._worker(model_dir, args.device, args.backend, "bfloat16", 8)
        losses = [worker.train_step(batch, mode="sft", lr=args.lr)["loss"]]
        published = gc._publish(worker, work / f"offload-{fam}-publish", 1)
        held = _allocated(cuda)
        moved = worker.offload()
        left = _allocated(cuda)
        kept, grads = storages(worker)
        rec["offload"] = {"bytes": moved["offload_bytes"], "released_bytes": moved["released_bytes"],
                          "seconds": moved["offload_s"], "gb_per_s": moved["offload_bytes"] / max(moved["offload_s"], 1e-9) / 1e9,
                          "allocated_before_bytes": held, "allocated_after_bytes": left}
        freed = not kept and not grads and (not cuda or left <= OFFLOAD_LEFT_SHARE * held)
        checks.add(f"{fam}/offload_frees_memory", freed, value=left if cuda else len(kept) + len(grads),
                   bound=OFFLOAD_LEFT_SHARE * held if cuda else 0,
                   detail=f"{moved['offload_bytes'] / 2**20:.1f} MiB copied in {moved['offload_s']:.3f} s")
        rec["engine"] = _engine_beside(published, args, checks, fam, gc)
        back = worker.onload()
        rec["onload"] = {"bytes": back["onload_bytes"], "seconds": back["onload_s"],
                         "gb_per_s": back["onload_bytes"] / max(back["onload_s"], 1e-9) / 1e9}
        losses.append(worker.train_step(batch, mode="sft", lr=args.lr)["loss"])
        digest = worker.parameter_digest()
    finally:
        gc._close(worker)
    worker = None
    try:
        worker = gc._worker(model_dir, args.device, args.backend, "bfloat16", 8)
        straight = [worker.train_step(batch, mode="sft", lr=args.lr)["loss"] for _ in range(2)]
        straight_digest = worker.parameter_digest()
    finally:
        gc._close(worker)
    rec["round_trip"] = {"losses": losses, "losses_without": straight, "digests_equal": digest == straight_digest}
    checks.add(f"{fam}/offload_round_trip_exact", losses == straight and digest == straight_digest,
               detail=f"losses {losses} vs {straight}")
    if cuda:
        torch.cuda.empty_cache()
    return rec


def _allocated(cuda: bool) -> int:
    import torch

    if not cuda:
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _engine_beside(hf_dir: Path, args, checks, fam: str, gc: ModuleType) -> dict:
    """A vLLM engine in another process on the same GPU while the rank is offloaded (skipped without vLLM or
    off cuda: vLLM's CPU build has no sleep mode)."""
    import importlib.util

    if args.device != "cuda" or importlib.util.find_spec("vllm") is None:
        why = "device cpu" if args.device != "cuda" else "vllm is not installed here"
        gc.log(f"SKIP {fam}/engine_beside_offloaded: {why}")
        return {"skipped": why}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", ENGINE, str(hf_dir), "0.5"], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE ")]
    result = json.loads(lines[-1][len("ENGINE "):]) if proc.returncode == 0 and lines else {}
    ok = bool(result.get("tokens")) and result["tokens"] == result["after_wake"]
    checks.add(f"{fam}/engine_beside_offloaded", ok, detail="" if ok else (proc.stderr or proc.stdout)[-300:])
    return result | {"seconds": time.perf_counter() - start, "exit": proc.returncode}
