"""Offload and onload seconds of one trainer rank (trainer/megatron/offload.py), the figures of docs/training.md's
"Colocated or disaggregated": the quickstart's model (configs/quickstart.yaml: float32, its tiny size) and a ~0.26B
bf16 model, each after one optimizer step (Adam state exists), median of `--repeats` round trips.

    python scripts/measure_offload.py [--device cpu|cuda] [--repeats 5]

Prints one JSON line per model: parameters, bytes copied, bytes released, offload_s, onload_s and GB/s."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = {
    "quickstart": ("float32", dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)),
    "0.26B": ("bfloat16", dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=4096,
                              vocab_multiple=32768)),
}


def measure(name: str, device: str, repeats: int, work: Path) -> dict:
    import torch

    from rollout.tasks import AdditionTask
    from trainer.batch import TrainBatch, TrainSequence
    from trainer.config import TrainerConfig, TrainerSpec
    from trainer.megatron.worker import SINGLE_RANK_PORT, MegatronWorker
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    dtype, size = MODELS[name]
    model_dir = build_tiny_model(work / name, AdditionTask(1).corpus(), TinyModelConfig(**size))
    backend = "nccl" if device == "cuda" else "gloo"
    w = MegatronWorker(TrainerSpec(hf_dir=str(model_dir), dtype=dtype, trainer=TrainerConfig(
        device=device, backend=backend, micro_batch_size=4, lr=1e-4)), 0, 1, "127.0.0.1", SINGLE_RANK_PORT)
    try:
        w.train_step(TrainBatch([TrainSequence([5, 6, 7], [8, 9, 10, 11]) for _ in range(4)]), mode="sft")
        rounds = []
        for _ in range(repeats):
            out, back = w.offload(), w.onload()
            rounds.append((out["offload_s"], back["onload_s"]))
        off, on = (statistics.median(x) for x in zip(*rounds))
        copied = out["offload_bytes"]
        return {"model": name, "device": device, "dtype": dtype,
                "parameters": sum(p.numel() for p in w.module.parameters()), "bytes_copied": copied,
                "bytes_released": out["released_bytes"], "offload_s": off, "onload_s": on,
                "offload_gb_per_s": copied / off / 1e9, "onload_gb_per_s": copied / on / 1e9,
                "torch_threads": torch.get_num_threads(), "measured_at": time.strftime("%Y-%m-%d")}
    finally:
        w.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tide_offload_") as work:
        for name in args.models.split(","):
            print(json.dumps(measure(name, args.device, args.repeats, Path(work))), flush=True)


if __name__ == "__main__":
    main()
