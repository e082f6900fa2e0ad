"""scripts/gpu_check.py's LoRA step (issue 63: trainer.lora). Per family of `--lora-families` (default qwen2,
qwen3_moe: adapters on the attention and, on the MoE model, on every expert), a Megatron rank with rank-8
adapters on every projection of a frozen base:

- `lora_loss_decreases`: bf16 supervised steps (fp32 main copies of the adapters alone) lower the loss, and
  `lora_base_frozen`: every base parameter on the device is bit for bit what it was before the steps (none moved
  by an optimizer that should hold none of them, nor written back from a main copy);
- `lora_peft_logits_fp32`: a float32 rank, stepped likewise, writes its adapter as `tide export` does (a PEFT
  directory); transformers + PEFT over the base give the rank's logits within the float32 conversion bound (TF32
  off: the adapter's layout, scaling and the experts' adapters on transformers' fused experts);
- `lora_engine_logprobs` (cuda, where vLLM is importable: not on the machine of scripts/gpu_check.sh, where it is
  reported as skipped; dense families: vllm serves LoRA on MoE layers through its Triton kernels, checked on the
  cluster by the run's own gap check): a vLLM engine in another process loads the base in bf16 and serves the
  bf16 rank's adapter (a LoRARequest); its prompt log-probs of a few sequences against the rank's within the bf16
  log-prob gap bound (rollout.config.DEFAULT_LOGPROB_GAP: vLLM's LoRA kernels against the trainer's).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

LORA_FAMILIES = ("qwen2", "qwen3_moe")
LORA_SIZES = {
    "quick": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, num_experts=4,
                  experts_per_token=2),
    "full": dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=4096,
                 num_experts=8, experts_per_token=2),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 8, 16.0
# Where the adapter's B starts at zero, the first step's update is what makes the comparisons mean anything: a
# larger rate than the full-model steps', as adapters take in runs (configs/lora.yaml)
LORA_LR = 2e-2

ENGINE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
base, adapter, sequences = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(base, enable_lora=True, max_lora_rank=int(sys.argv[4]), max_loras=1, gpu_memory_utilization=0.4,
          enforce_eager=True, dtype="bfloat16", seed=0, max_model_len=256)
params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, lora_request=LoRARequest("a", 1, adapter))
print("ENGINE " + json.dumps([[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs]))
"""


def run_lora(args, work: Path, checks, gc: ModuleType) -> dict:
    return gc.per_family(args.lora_families, "lora", lambda fam: _family(fam, args, work, checks, gc), checks)


def _worker(model_dir: Path, args, dtype: str):
    from trainer.config import LoRAConfig, TrainerConfig, TrainerSpec
    from trainer.megatron.worker import SINGLE_RANK_PORT, MegatronWorker

    lora = LoRAConfig(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    trainer = TrainerConfig(device=args.device, backend=args.backend, micro_batch_size=8, lr=LORA_LR, lora=lora)
    return MegatronWorker(TrainerSpec(hf_dir=str(model_dir), trainer=trainer, dtype=dtype, seed=0), 0, 1,
                          "127.0.0.1", SINGLE_RANK_PORT)


def _adapter_dir(worker, model_dir: Path, out: Path) -> Path:
    from ckpt_transfer.peft_adapter import adapter_config, merge_records, write_peft_dir

    return write_peft_dir(merge_records(worker.adapter_tensors()), out, adapter_config(
        rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=TARGETS, base_model=str(model_dir)))


def _family(fam: str, args, work: Path, checks, gc: ModuleType) -> dict:
    import torch
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family=fam, **LORA_SIZES["quick" if args.quick else "full"])
    model_dir = build_tiny_model(work / f"lora-{fam}", AdditionTask(1).corpus(), spec)
    batch = gc._sft_batch(model_dir, 8, 1)
    rec: dict = {}

    worker = None
    try:  # bf16: the loss falls, the base stays
        worker = _worker(model_dir, args, "bfloat16")
        before = _base_parameters(worker)
        losses = [worker.train_step(batch, mode="sft", lr=LORA_LR)["loss"] for _ in range(args.steps)]
        rec["losses_bf16"] = losses
        checks.add(f"{fam}/lora_loss_decreases", losses[-1] < losses[0], value=losses[-1], bound=losses[0])
        if "base-moves" in args.fault:  # what an optimizer holding a base parameter would do to it
            name, moved_param = next((n, p) for n, p in worker.module.named_parameters() if n in before)
            with torch.no_grad():
                moved_param.view(-1)[0] += 1
            gc.log(f"fault: moved one element of base parameter {name}")
        after = _base_parameters(worker)
        moved = sorted(n for n in before if not torch.equal(before[n], after[n]))
        checks.add(f"{fam}/lora_base_frozen", not moved and before.keys() == after.keys() and len(before) > 0,
                   value=len(moved), bound=0, detail=", ".join(moved[:3]))
        adapter = _adapter_dir(worker, model_dir, work / f"lora-{fam}-bf16")
        sequences = [list(s.prompt_ids) + list(s.completion_ids) for s in batch.sequences[:4]]
        ours = _logprobs(worker, sequences)
    finally:
        gc._close(worker)
    worker = None
    rec["engine"] = _engine(model_dir, adapter, sequences, ours, args, checks, fam, gc)

    try:  # float32: transformers + PEFT over the base give the rank's logits
        worker = _worker(model_dir, args, "float32")
        for _ in range(args.steps):
            worker.train_step(batch, mode="sft", lr=LORA_LR)
        adapter32 = _adapter_dir(worker, model_dir, work / f"lora-{fam}-fp32")
        shortest = min(len(s) for s in sequences)
        tokens = [s[:shortest] for s in sequences]  # one [sequences, positions] tensor for transformers
        mine = worker.logits(tokens)
    finally:
        gc._close(worker)
    theirs = _peft_logits(model_dir, adapter32, args.device, tokens, args.fault)
    cmp = gc._compare(mine, theirs)
    rec["peft_fp32"] = {k: v for k, v in cmp.items() if k != "per_position"}
    checks.add(f"{fam}/lora_peft_logits_fp32", cmp["max_abs_diff"] <= gc.FP32_LOGITS_BOUND, value=cmp["max_abs_diff"],
               bound=gc.FP32_LOGITS_BOUND)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rec


def _base_parameters(worker) -> dict:
    """Copies of the rank's base (non-adapter) parameters."""
    from trainer.megatron.lora import is_adapter_parameter

    return {n: p.detach().clone() for n, p in worker.module.named_parameters() if not is_adapter_parameter(n)}


def _logprobs(worker, sequences: list[list[int]]) -> list[list[float]]:
    """The rank's log-probs of every token after the first (what vLLM's prompt log-probs give)."""
    import torch

    out = []
    for seq, logits in zip(sequences, worker.logits(sequences)):
        logp = logits.float().log_softmax(-1)[:-1]
        out.append(logp.gather(-1, torch.tensor(seq[1:]).unsqueeze(-1)).squeeze(-1).tolist())
    return out


def _peft_logits(model_dir: Path, adapter: Path, device: str, tokens, faults: list[str]):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      adapter).to(device).eval()
    if "swap-rows" in faults:  # a deliberate layout error: two rows of layer 0's first adapter B swapped
        name, p = next((n, p) for n, p in model.named_parameters() if ".layers.0." in n and "lora_B" in n)
        with torch.no_grad():
            p[[0, 1]] = p[[1, 0]]
    with torch.no_grad():
        out = model(torch.tensor(tokens, device=device)).logits.float().cpu()
    del model
    return out


def _engine(model_dir: Path, adapter: Path, sequences, ours, args, checks, fam: str, gc: ModuleType) -> dict:
    import importlib.util

    from transformers import AutoConfig

    from ckpt_transfer.convert import is_moe
    from rollout.config import DEFAULT_LOGPROB_GAP

    why = ("device cpu" if args.device != "cuda" else "vllm is not installed here"
           if importlib.util.find_spec("vllm") is None else "a mixture-of-experts family"
           if is_moe(AutoConfig.from_pretrained(model_dir)) else None)
    if why:
        gc.log(f"SKIP {fam}/lora_engine_logprobs: {why}")
        return {"skipped": why}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", ENGINE, str(model_dir), str(adapter), json.dumps(sequences),
                           str(RANK)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ENGINE ")]
    theirs = json.loads(lines[-1][len("ENGINE "):]) if proc.returncode == 0 and lines else []
    diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    gap = sum(diffs) / len(diffs) if diffs else float("inf")
    bound = DEFAULT_LOGPROB_GAP["bfloat16"]
    checks.add(f"{fam}/lora_engine_logprobs", gap <= bound, value=gap, bound=bound,
               detail="" if diffs else (proc.stderr or proc.stdout)[-300:])
    return {"gap": gap, "seconds": time.perf_counter() - start, "exit": proc.returncode}
