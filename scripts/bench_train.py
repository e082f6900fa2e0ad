"""Train and publish throughput per Megatron layout, against a plain transformers step and torch.save.

    .venv/bin/python scripts/bench_train.py [--quick]

train: completion+prompt tokens per second of one RL (GRPO) optimizer step on the same model and batch,
  Megatron-core ranks (TP1, TP2, PP2, EP2-MoE; one thread per rank) vs a plain PyTorch/transformers step
  (forward, the same loss, backward, Adam) in one process with as many threads as the layout has ranks.
publish: GB/s of Megatron -> HF conversion into /dev/shm safetensors vs torch.save of the same tensors into
  /dev/shm, and a memcpy of the same bytes (the floor).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Report, alternate, bench_arguments, repeats_for, timed  # noqa: E402

LAYOUTS = {"tp1": ("qwen2", 1, 1, 1), "tp2": ("qwen2", 2, 1, 1), "pp2": ("qwen2", 1, 2, 1),
           "ep2-moe": ("mixtral", 1, 1, 2)}


def build_model(arch: str, tmp: Path, quick: bool) -> Path:
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    hidden = 128 if quick else 256
    spec = TinyModelConfig(family=arch, hidden_size=hidden, num_layers=4, num_heads=4, num_kv_heads=2,
                           intermediate_size=2 * hidden, num_experts=4, experts_per_token=2)
    return build_tiny_model(tmp / arch, AdditionTask(2).corpus(), spec)


def make_batch(model_dir: Path, n: int, seq: int):
    import random

    from transformers import AutoConfig

    from trainer.batch import TrainBatch, TrainSequence

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    rng = random.Random(0)
    seqs = []
    for i in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(seq // 2)]
        comp = [rng.randrange(1, vocab) for _ in range(seq // 2)]
        seqs.append(TrainSequence(prompt, comp, [-3.0] * len(comp), float(rng.random() < 0.5), i // 4))
    return TrainBatch(seqs)


class PlainStep:
    """The same model and loss with transformers + torch.optim.Adam, in this process."""

    def __init__(self, model_dir: Path, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-5)

    def step(self, batch) -> None:
        from trainer.losses import LossSpec, advantages, policy_loss

        torch = self.torch
        seqs = batch.sequences
        L = max(len(s.prompt_ids) + len(s.completion_ids) for s in seqs)
        ids = torch.zeros(len(seqs), L, dtype=torch.long)
        mask = torch.zeros(len(seqs), L - 1)
        old = torch.zeros(len(seqs), L - 1)
        for r, s in enumerate(seqs):
            full = s.prompt_ids + s.completion_ids
            ids[r, :len(full)] = torch.tensor(full)
            p, c = len(s.prompt_ids), len(s.completion_ids)
            mask[r, p - 1:p - 1 + c] = 1
            old[r, p - 1:p - 1 + c] = torch.tensor(s.old_logprobs)
        spec = LossSpec("grpo", adv_std_norm=True)
        adv = advantages(spec, torch.tensor([s.reward for s in seqs]), torch.tensor([s.group for s in seqs]))
        self.opt.zero_grad()
        logits = self.model(ids).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = policy_loss(spec, logp, old, mask, adv, len(seqs), int(mask.sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def main() -> None:
    ap = bench_arguments(__doc__)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import torch

    from orchestrator.workers.trainer_group import TrainerGroup
    from trainer.config import ParallelConfig, TrainerConfig, TrainerSpec

    repeats = repeats_for(args.quick)
    n, seq = (32, 64) if args.quick else (64, 128)
    report = Report("train", args.quick)
    tmp = Path(tempfile.mkdtemp(prefix="bench_train_"))
    shm = Path(tempfile.mkdtemp(prefix="bench_train_", dir="/dev/shm"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        for name in args.layouts.split(","):
            arch, tp, pp, ep = LAYOUTS[name]
            model_dir = build_model(arch, tmp, args.quick)
            batch = make_batch(model_dir, n, seq)
            tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.sequences)
            trainer = TrainerConfig(parallel=ParallelConfig(tp=tp, pp=pp, ep=ep), loss="grpo", lr=1e-5,
                                    micro_batch_size=8 if pp > 1 else n)
            group = TrainerGroup(TrainerSpec(hf_dir=str(model_dir), trainer=trainer))
            plain = PlainStep(model_dir, threads=tp * pp * ep)
            group.train_step(batch)  # warm-up: first steps allocate buffers
            plain.step(batch)
            a, b = alternate(lambda: tokens / timed(lambda: group.train_step(batch)),
                             lambda: tokens / timed(lambda: plain.step(batch)), repeats)
            row = report.add(f"train {name}", f"megatron-core {name}", "transformers+torch.optim", "tokens/s", a, b)
            print(f"train {name}: {row['contender_median']:.0f} vs {row['baseline_median']:.0f} tokens/s", flush=True)

            state = {k: v.detach().clone() for k, v in plain.model.state_dict().items()}
            nbytes = sum(v.numel() * v.element_size() for v in state.values())

            def publish(it=[0]) -> float:
                it[0] += 1
                d = shm / f"{name}-{it[0]:07d}"
                m = group.publish("bench", it[0], str(d), 512 << 20)
                shutil.rmtree(d)
                return m.nbytes

            def torch_save() -> None:
                path = shm / "torch_save.pt"
                torch.save(state, path)
                path.unlink()

            a, b = alternate(lambda: _rate(publish),
                             lambda: nbytes / 1e9 / timed(torch_save), repeats)
            src = torch.empty(nbytes, dtype=torch.uint8)
            dst = torch.empty_like(src)
            floor = [nbytes / 1e9 / timed(lambda: dst.copy_(src)) for _ in range(repeats)]
            report.add(f"publish {name}", "HF safetensors into /dev/shm", "torch.save into /dev/shm", "GB/s", a, b,
                       memcpy_floor_gbps=sorted(floor)[len(floor) // 2],
                       fraction_of_floor=sorted(a)[len(a) // 2] / sorted(floor)[len(floor) // 2], bytes=nbytes)
            group.shutdown()
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    report.finish()


def _rate(fn) -> float:
    t0 = time.perf_counter()
    nbytes = fn()
    return nbytes / 1e9 / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
