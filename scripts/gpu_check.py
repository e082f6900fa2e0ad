"""GPU check: the Megatron trainer, its Megatron -> Hugging Face conversion and the JAX engine, on one device.

    python scripts/gpu_check.py [--device cuda|cpu] [--out DIR] [--quick] [--families a,b] [--no-jax]

What runs, in this process, with this repository's own packages (no Ray, no vLLM, nothing installed):

1. Per tiny-model family (every value of `trainer.tiny_model.TinyModelConfig.family`, read at run time), one
   Megatron-core rank (`trainer.megatron.worker.MegatronWorker`, world size 1, TP1; backend nccl on cuda, gloo
   on cpu) in bfloat16:
   - `train_step(mode="sft")` steps on the same batch: the loss must decrease (`loss_decreases`), and every
     published weight must lie within what Adam can move it in that many steps (`update_size`: a trainer that
     lost the loaded weights, e.g. an optimizer writing back main copies taken before loading, fails it);
   - one RL step (grpo, truncated importance sampling, lr 0) with pi_old recomputed and with it interpolated in
     the step (rollout.proximal loglinear): one mini-batch, so the two losses must agree (`rl_proximal`);
   - `logits` against transformers loading the bf16 checkpoint that `publish` wrote (through `Manifest` and
     `materialize_whole`), on the same device in bf16 (`logits_bf16`: a bf16 bound, per position);
   - `save_checkpoint`, then two more bf16 steps on the rank and on a new rank that loaded the checkpoint: the
     losses and the published tensors must be bit-identical (`resume_exact`: what `tide resume` promises in
     deterministic mode; ops that warn of no deterministic kernel are named);
   - a second rank in float32 loads that published checkpoint (HF -> Megatron) and publishes it again
     (Megatron -> HF): the tensors must come back bit for bit (`roundtrip`), and its logits must match
     transformers' in float32 (`logits_fp32`: the exact check of the conversion; TF32 off).
   A family that fails to build, train or convert is a failed check; the other families still run.
2. Long sequences (scripts/gpu_check_long.py): per family of `--long-families` (default qwen2, qwen3, llama3,
   qwen3_moe), a ~1B-class bf16 rank with trainer.attention sdpa trains one sequence of 8k and of 16k positions
   (peak memory: torch.cuda.max_memory_allocated over the step; tokens/s; `long_<L>_trains`: a finite loss), and
   its logits on a 2k-position prefix match transformers' in bf16 (`long_logits_bf16`, the bound of
   `logits_bf16`). `--no-long` skips it.
3. Offload (scripts/gpu_check_offload.py, the hybrid deployment): per family of `--offload-families` (default qwen2,
   qwen3_moe) a bf16 rank steps, publishes and offloads: no parameter, gradient or optimizer storage left on the
   device and torch.cuda.memory_allocated() near zero (`offload_frees_memory`), a vLLM engine in another process
   serving on the same GPU meanwhile where vLLM is installed (`engine_beside_offloaded`), and the step after onload
   identical to a rank's without the round trip (`offload_round_trip_exact`); offload/onload GB/s. `--no-offload`
   skips it.
4. LoRA (scripts/gpu_check_lora.py, trainer.lora): per family of `--lora-families` (default qwen2, qwen3_moe), a
   rank with adapters on every projection of a frozen base: bf16 steps lower the loss and leave every base
   parameter bit for bit (`lora_loss_decreases`, `lora_base_frozen`); a float32 rank's adapter, written as
   `tide export` writes it, gives the rank's logits through transformers + PEFT (`lora_peft_logits_fp32`); on cuda
   with vLLM, an engine serving the bf16 adapter on the base gives the rank's log-probs within the bf16 gap bound
   (`lora_engine_logprobs`). `--no-lora` skips it.
5. The JAX engine (`trainer.jax.engine.Engine`) on configs/cartpole.yaml (PPO) and configs/pendulum_sac.yaml
   (SAC): compile time, then env steps per second over the timed chunks (after one untimed chunk), and finite
   metrics.

Writes DIR/gpu_check.json (default DIR: bench_results/) with every figure and check, prints a line per step,
and exits 1 when any check fails (the failed checks are named on the last line), 0 otherwise. `--quick` uses
the smallest sizes (the CPU test); `--fault swap-rows` swaps two rows of one converted tensor in the
transformers model (a deliberate conversion error: the logits checks must fail); `--fault skip-load` has the resumed
rank not load the checkpoint (resume_exact must fail); `--fault base-moves` moves a base parameter during the LoRA
steps (lora_base_frozen must fail).

On the GPU machine (torch, transformers, jax there; megatron-core and a few pure-Python packages travel as
wheels): `bash scripts/gpu_check.sh` (see that file).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import typing
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):  # the repository's packages; gpu_check_long beside this script
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# Bounds (max |difference| over every position and vocabulary entry of the compared sequences).
# float32: `tide export --verify` and tests/integration/test_publish_layouts.py hold the conversion to 1e-4 on
# logits; both sides compute in float32 (TF32 off), so only summation order differs.
FP32_LOGITS_BOUND = 1e-4
# bfloat16: both sides round activations to bf16 (8 significant bits) at different places (Megatron's norms and
# fused QKV, transformers' fp32 RMSNorm), so logits differ by a few bf16 ulps of the logits' scale: the bound is
# relative to max |logit| (at least 1). Measured on CPU after the bf16 steps: --quick (logits up to ~5) the dense
# families' positions differ by at most 1.0-1.3% of it; full size (qwen2, mixtral, qwen3_moe, deepseek_v3; logits
# up to ~9-11) by 0.6-0.7%, no position past the bound, and float32 by 3-5e-6. A mixture of experts also flips
# a top-k routing decision that bf16 rounding puts on a near-tie, on either side (--quick on CPU: mixtral's
# transformers-bf16 and qwen3_moe's Megatron-bf16 each differ from transformers-fp32 by 0.7-1.6 at one position
# of 96, and by < 0.06 everywhere else); for those families BF16_MOE_FLIP_SHARE of the positions may exceed it.
# The exact check of the conversion is the float32 one.
BF16_LOGITS_REL_BOUND = 5e-2
# A mixture of experts past its flip allowance still passes when Megatron's bf16 logits lie no farther (p90 over
# positions, within this margin) from transformers' float32 logits of the same weights than transformers' own bf16
# logits do: the positions over the bound are then bf16 rounding on both sides and near-tie routing, not a
# conversion error. Measured on CPU (--quick, qwen3_moe after its bf16 steps, SDPA attention): 5 of 96 positions
# over the bound, allowance 4; on one trained tiny qwen3_moe Megatron's SDPA bf16 lies at p90 0.10 from float32,
# its eager attention at 0.15.
BF16_AS_EXACT_MARGIN = 1.25
# rl_proximal: loss and gradient norm of one bf16 step with pi_old from the log-prob pass and from the step's own
# forward; measured on CPU (--quick): equal to ~1e-6 relative (bf16 rounding of the two passes)
RL_REL_BOUND = 1e-2
BF16_MOE_FLIP_SHARE = 0.05
# bfloat16 has 8 significant bits: rounding moves a weight by at most 2^-8 of its magnitude
BF16_UNIT_ROUNDOFF = 2.0 ** -8

SIZES = {  # TinyModelConfig fields per mode
    "quick": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, num_experts=4,
                  experts_per_token=2),
    "full": dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1024, num_experts=8,
                 experts_per_token=2),
}
JAX_CONFIGS = {"ppo": "configs/cartpole.yaml", "sac": "configs/pendulum_sac.yaml"}

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[gpu_check {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class Checks:
    """Named pass/fail checks with their measured value and bound."""

    def __init__(self) -> None:
        self.items: list[dict] = []

    def add(self, name: str, ok: bool, value=None, bound=None, detail: str = "") -> bool:
        ok = bool(ok)
        self.items.append({"name": name, "ok": ok, "value": value, "bound": bound, "detail": detail})
        log(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if value is None else f" = {_fmt(value)}")
            + ("" if bound is None else f" (bound {_fmt(bound)})") + (f": {detail}" if detail else ""))
        return ok

    @property
    def failed(self) -> list[str]:
        return [c["name"] for c in self.items if not c["ok"]]


def per_family(families: list[str], step: str, check, checks: Checks) -> dict:
    """`check(family)` for each family of a step: one that raises is a failed `<family>/<step>_runs` check (its
    error recorded), and the other families still run."""
    out = {}
    for fam in families:
        log(f"== {step} {fam}")
        try:
            out[fam] = check(fam)
        except Exception as exc:  # noqa: BLE001  (a family that fails is a failed check; the others still run)
            out[fam] = {"error": f"{type(exc).__name__}: {exc}"}
            checks.add(f"{fam}/{step}_runs", False, detail=out[fam]["error"][:300])
    return out


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def families() -> list[str]:
    """Every value of TinyModelConfig's `family` Literal (new families are picked up without editing here)."""
    from trainer.tiny_model import TinyModelConfig

    annotation = TinyModelConfig.model_fields["family"].annotation
    return list(typing.get_args(annotation))


# ---- Megatron ------------------------------------------------------------------------------------------
def _sft_batch(model_dir: Path, n: int, digits: int):
    from transformers import AutoTokenizer

    from rollout.tasks import AdditionTask
    from trainer.batch import TrainBatch, TrainSequence

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = AdditionTask(digits).sft_examples(0, n)
    return TrainBatch([TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id]) for p, a in examples])


def _worker(model_dir: Path, device: str, backend: str, dtype: str, micro_batch: int):
    from trainer.config import TrainerConfig, TrainerSpec
    from trainer.megatron.worker import SINGLE_RANK_PORT, MegatronWorker

    trainer = TrainerConfig(device=device, backend=backend, micro_batch_size=micro_batch, lr=1e-3)
    spec = TrainerSpec(hf_dir=str(model_dir), trainer=trainer, dtype=dtype, seed=0)
    return MegatronWorker(spec, 0, 1, "127.0.0.1", SINGLE_RANK_PORT)


def _close(worker) -> None:
    """World size 1 in this process: the next rank initialises torch.distributed and Megatron's groups anew
    (also after a constructor that failed half-way, when there is no worker to shut down)."""
    import torch

    try:
        if worker is not None:
            worker.shutdown()
    finally:
        try:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _publish(worker, out_dir: Path, iteration: int) -> Path:
    """The worker's weights as an HF directory: publish, the manifest, materialize_whole (what `tide export`
    and the rollout's weight sync read)."""
    from ckpt_transfer.manifest import Manifest
    from ckpt_transfer.reslice import materialize_whole
    from ckpt_transfer.writer import finalize_manifest

    staging = out_dir / f"publish-{iteration}"
    written = worker.publish(str(staging), node="gpu-check", shard_bytes=64 << 20)
    manifest = Manifest(run="gpu_check", iteration=iteration, directory=str(staging), shards=written["shards"],
                        aux_files=written["aux_files"], tp_size=1)
    finalize_manifest(manifest)
    return materialize_whole(Manifest.load(staging), out_dir / f"whole-{iteration}")


def _hf_logits(hf_dir: Path, dtype, device: str, tokens, faults: list[str]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    if "swap-rows" in faults:  # a deliberate conversion error: two rows of layer 0's first matrix swapped
        name, p = next((n, p) for n, p in model.named_parameters() if ".layers.0." in n and p.ndim == 2)
        with torch.no_grad():
            p[[0, 1]] = p[[1, 0]]
        log(f"fault: swapped rows 0 and 1 of {name} in the transformers model")
    with torch.no_grad():
        out = model(torch.tensor(tokens, device=device)).logits.float().cpu()
    del model
    return out


def _compare(ours: list, theirs) -> dict:
    """Max |logits diff| and |log-prob diff| over every sequence, position and vocabulary entry, the per-position
    max |logits diff| (flattened over sequences) and max |logit|."""
    import torch

    mine = torch.stack([o.float() for o in ours])
    per_position = (mine - theirs).abs().amax(-1).flatten()
    return {"max_abs_diff": per_position.max().item(),
            "logprob_max_abs_diff": (mine.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item(),
            "logit_scale": max(mine.abs().max().item(), theirs.abs().max().item()),
            "per_position": per_position}


def rl_proximal_step(worker, batch) -> dict:
    """One RL step (grpo, truncated importance sampling) at lr 0 on `batch` with rewards 1, 0 per pair of
    sequences and the engines' log-probs taken 0.5 below the rank's: pi_old recomputed by a forward pass
    (rollout.proximal recompute) and interpolated in the step (loglinear). One mini-batch: loglinear's pi_old is
    the step's own log-probs, the recomputed one the same policy's, so the two losses must agree."""
    from orchestrator.iteration.mismatch import MismatchCorrection, use_trainer_old_logprobs
    from trainer.batch import LoglinearProximal, TrainBatch, TrainSequence

    seqs = [TrainSequence(s.prompt_ids, s.completion_ids, reward=float(i % 2 == 0), group=i // 2)
            for i, s in enumerate(batch.sequences)]
    ours = worker.logprobs(TrainBatch(seqs))
    ours = [ours[i] for i in range(len(seqs))]
    for s, lp in zip(seqs, ours):
        s.old_logprobs = [x - 0.5 for x in lp]
    loglinear = TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, old_logprobs=list(s.old_logprobs),
                                          reward=s.reward, group=s.group, versions=[0] * len(s.completion_ids))
                            for s in seqs], proximal=LoglinearProximal(trained_by=1, tis_cap=2.0))
    recomputed = TrainBatch(seqs)
    use_trainer_old_logprobs(recomputed, ours, MismatchCorrection("tis", tis_cap=2.0))
    a = worker.train_step(recomputed, mode="rl", lr=0.0)
    b = worker.train_step(loglinear, mode="rl", lr=0.0)
    return {"loss_recompute": a["loss"], "loss_loglinear": b["loss"], "grad_norm_recompute": a["grad_norm"],
            "grad_norm_loglinear": b["grad_norm"], "is_weight_mean_loglinear": b["is_weight_mean"]}


def resume_steps(worker, batch, lr: float, steps: int = 2) -> list[float]:
    """`steps` SFT steps on `batch` (after a checkpoint: the run's next steps, which a resumed rank must repeat
    bit for bit in deterministic mode)."""
    return [worker.train_step(batch, mode="sft", lr=lr)["loss"] for _ in range(steps)]


def adam_reach(lr: float, steps: int) -> float:
    """How far `steps` Adam steps at `lr` (no weight decay) can move one weight: with bias correction, step t's
    |m_hat| / sqrt(v_hat) is at most sqrt(t) (Cauchy-Schwarz over the t gradients), so at most lr * sum sqrt(t)."""
    return lr * sum(math.sqrt(t) for t in range(1, steps + 1))


def _tensors(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def check_family(fam: str, args, work: Path, checks: Checks) -> dict:
    import torch

    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    quick = args.quick
    rec: dict = {"family": fam}
    t_family = time.perf_counter()
    sizes = SIZES["quick" if quick else "full"]
    digits = 1 if quick else 3
    # init std 0.8 / sqrt(width) (0.1 at 64): logits and routing far from uniform, so a misplaced tensor shows in
    # the logits, and the same conditioning at every width (a fixed std grows activations with the width)
    spec = TinyModelConfig(family=fam, init_std=0.8 / math.sqrt(sizes["hidden_size"]), **sizes)
    model_dir = build_tiny_model(work / fam / "model", AdditionTask(digits).corpus(), spec, seed=0)
    rec["model"] = {k: v for k, v in spec.model_dump().items() if k in sizes or k in ("family", "init_std")}
    n_seqs = 16 if quick else 64
    batch = _sft_batch(model_dir, n_seqs, digits)
    hf_config = json.loads((model_dir / "config.json").read_text())
    vocab = hf_config["vocab_size"]
    moe = any(hf_config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    g = torch.Generator().manual_seed(0)
    n_cmp, cmp_len = (4, 24) if quick else (8, 64)
    tokens = torch.randint(0, vocab, (n_cmp, cmp_len), generator=g).tolist()
    rec["compare_tokens"] = [n_cmp, cmp_len]
    log(f"{fam}: model built ({sum(1 for _ in model_dir.glob('*.safetensors'))} shard(s), vocab {vocab}); "
        f"bf16 Megatron rank on {args.device}")

    worker = None
    try:
        # -- bf16: train steps, logits, publish -------------------------------------------------------
        t = time.perf_counter()
        worker = _worker(model_dir, args.device, args.backend, "bfloat16", micro_batch=n_seqs)
        rec["build_s"] = time.perf_counter() - t
        losses, times = [], []
        for _ in range(args.steps):
            if args.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = worker.train_step(batch, mode="sft", lr=args.lr)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            losses.append(out["loss"])
        tokens_per_step = sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.sequences)
        steady = times[1:] or times
        rec["train"] = {"dtype": "bfloat16", "lr": args.lr, "sequences": n_seqs, "tokens_per_step": tokens_per_step,
                        "losses": losses, "loss_before": losses[0], "loss_after": losses[-1],
                        "first_step_s": times[0], "step_time_s": statistics.median(steady),
                        "tokens_per_s": tokens_per_step / statistics.median(steady)}
        log(f"{fam}: bf16 train steps: loss {losses[0]:.4f} -> {losses[-1]:.4f}, step "
            f"{1e3 * rec['train']['step_time_s']:.1f} ms (first {1e3 * times[0]:.0f} ms)")
        checks.add(f"{fam}/loss_decreases", all(math.isfinite(x) for x in losses) and losses[-1] < losses[0],
                   losses[-1], losses[0], "last step's loss below the first's")
        rl = rec["rl_proximal"] = rl_proximal_step(worker, batch)
        # relative differences of the loss and of its gradient's norm (the loss alone, at ratio 1, is -A w per
        # token whatever the model: the gradient is what the policy's log-probs shape)
        gap = max(abs(rl[f"{k}_loglinear"] - rl[f"{k}_recompute"]) / abs(rl[f"{k}_recompute"])
                  for k in ("loss", "grad_norm")) if rl["loss_recompute"] and rl["grad_norm_recompute"] else math.inf
        checks.add(f"{fam}/rl_proximal", gap <= RL_REL_BOUND, gap, RL_REL_BOUND,
                   f"grpo + tis at lr 0, one mini-batch, pi_old interpolated (loglinear) vs recomputed: loss "
                   f"{rl['loss_loglinear']:.5g} vs {rl['loss_recompute']:.5g}, gradient norm "
                   f"{rl['grad_norm_loglinear']:.5g} vs {rl['grad_norm_recompute']:.5g}")
        bf16_logits = worker.logits(tokens)
        bf16_dir = _publish(worker, work / fam, 1)

        # -- bf16: checkpoint, then the same steps here and on a rank that loads it ---------------------
        ckpt = work / fam / "checkpoint"
        worker.save_checkpoint(str(ckpt))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            continued = resume_steps(worker, batch, args.lr)
            continued_dir = _publish(worker, work / fam, 3)
            _close(worker)
            worker = None
            worker = _worker(model_dir, args.device, args.backend, "bfloat16", micro_batch=n_seqs)
            if "skip-load" in args.fault:
                log(f"fault: {fam}'s resumed rank does not load the checkpoint")
            else:
                worker.load_checkpoint(str(ckpt))
            resumed = resume_steps(worker, batch, args.lr)
            resumed_dir = _publish(worker, work / fam, 4)
        _close(worker)
        worker = None
        c, r = _tensors(continued_dir), _tensors(resumed_dir)
        worst = max(((c[k].float() - r[k].float()).abs().max().item() for k in c if k in r), default=math.inf)
        nondeterministic = sorted({str(w.message).splitlines()[0][:200] for w in seen
                                   if "deterministic" in str(w.message)})
        rec["resume"] = {"steps": len(continued), "losses_continued": continued, "losses_resumed": resumed,
                         "tensors": len(c), "max_abs_diff": worst, "nondeterministic_op_warnings": nondeterministic,
                         "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
        checks.add(f"{fam}/resume_exact", continued == resumed and sorted(c) == sorted(r) and worst == 0.0, worst,
                   0.0, f"{len(continued)} bf16 steps after save_checkpoint, on the rank and on one that loaded it: "
                   f"losses {continued} vs {resumed}"
                   + (f"; ops without a deterministic kernel: {nondeterministic}" if nondeterministic else ""))

        # every published weight within Adam's reach of the model the rank loaded (plus bf16 rounding twice)
        before, after = _tensors(model_dir), _tensors(bf16_dir)
        common = sorted(set(before) & set(after))
        moved = max((after[k].float() - before[k].float()).abs().max().item() for k in common)
        magnitude = max(max(before[k].abs().max().item(), after[k].float().abs().max().item()) for k in common)
        reach = adam_reach(args.lr, args.steps) + 2 * BF16_UNIT_ROUNDOFF * magnitude
        rec["update"] = {"max_abs_change": moved, "bound": reach, "tensors": len(common),
                         "names_equal": sorted(before) == sorted(after)}
        checks.add(f"{fam}/update_size", rec["update"]["names_equal"] and 0 < moved <= reach, moved, reach,
                   f"max |published - loaded| after {args.steps} Adam steps at lr {args.lr:g} (> 0, within reach)")

        theirs = _hf_logits(bf16_dir, torch.bfloat16, args.device, tokens, args.fault)
        cmp = _compare(bf16_logits, theirs)
        bound = BF16_LOGITS_REL_BOUND * max(1.0, cmp["logit_scale"])
        over = int((cmp["per_position"] > bound).sum())
        positions = cmp["per_position"].numel()
        allowed = int(BF16_MOE_FLIP_SHARE * positions) if moe else 0
        # the same weights in float32 (transformers): how far each side's bf16 lies from the exact computation
        exact = _hf_logits(bf16_dir, torch.float32, args.device, tokens, args.fault)
        ours_p90 = _compare(bf16_logits, exact)["per_position"].quantile(0.9).item()
        theirs_p90 = (theirs - exact).abs().amax(-1).flatten().quantile(0.9).item()
        as_exact = ours_p90 <= BF16_AS_EXACT_MARGIN * theirs_p90
        rec["logits"] = {"bf16_max_abs_diff": cmp["max_abs_diff"],
                         "bf16_p90_from_fp32_megatron": ours_p90, "bf16_p90_from_fp32_transformers": theirs_p90,
                         "bf16_logprob_max_abs_diff": cmp["logprob_max_abs_diff"],
                         "bf16_logit_scale": cmp["logit_scale"], "bf16_bound": bound,
                         "bf16_positions": positions, "bf16_positions_over_bound": over,
                         "bf16_positions_over_bound_allowed": allowed,
                         "bf16_p90_abs_diff": cmp["per_position"].quantile(0.9).item()}
        checks.add(f"{fam}/logits_bf16", over <= allowed or (moe and as_exact), cmp["max_abs_diff"], bound,
                   f"Megatron bf16 vs transformers bf16: {over} of {positions} positions over the bound "
                   f"({allowed} allowed{': routing flips' if allowed else ''}); p90 distance from transformers "
                   f"float32: Megatron bf16 {ours_p90:.3g}, transformers bf16 {theirs_p90:.3g}")

        # -- fp32: HF -> Megatron -> HF round trip, and the exact logits check ---------------------------
        log(f"{fam}: float32 Megatron rank from the published bf16 checkpoint")
        worker = _worker(bf16_dir, args.device, args.backend, "float32", micro_batch=n_seqs)
        fp32_logits = worker.logits(tokens)
        fp32_dir = _publish(worker, work / fam, 2)
        _close(worker)
        worker = None
        a, b = _tensors(bf16_dir), _tensors(fp32_dir)
        names_equal = sorted(a) == sorted(b)
        worst = max(((a[k].float() - b[k].float()).abs().max().item() for k in a if k in b), default=math.inf)
        rec["roundtrip"] = {"tensors": len(a), "names_equal": names_equal, "max_abs_diff": worst}
        checks.add(f"{fam}/roundtrip", names_equal and worst == 0.0, worst, 0.0,
                   "HF bf16 -> Megatron fp32 -> HF: the same tensor names and values"
                   + ("" if names_equal else f" (names differ: {sorted(set(a) ^ set(b))[:4]})"))
        theirs = _hf_logits(fp32_dir, torch.float32, args.device, tokens, args.fault)
        cmp = _compare(fp32_logits, theirs)
        rec["logits"] |= {"fp32_max_abs_diff": cmp["max_abs_diff"],
                          "fp32_logprob_max_abs_diff": cmp["logprob_max_abs_diff"],
                          "fp32_logit_scale": cmp["logit_scale"]}
        checks.add(f"{fam}/logits_fp32", cmp["max_abs_diff"] <= FP32_LOGITS_BOUND, cmp["max_abs_diff"],
                   FP32_LOGITS_BOUND, "Megatron fp32 vs transformers fp32, every position")
        rec["ran"] = True
    except Exception as exc:  # a family that cannot build/train/convert is a failed check, not the script's end
        rec["ran"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["traceback"] = traceback.format_exc(limit=8)
        checks.add(f"{fam}/runs", False, detail=rec["error"].splitlines()[0][:300])
    finally:
        try:
            _close(worker)  # also when the constructor failed after init_process_group
        except Exception as exc:  # noqa: BLE001
            log(f"{fam}: cleanup failed: {exc}")
    rec["seconds"] = time.perf_counter() - t_family
    rec["ok"] = rec["ran"] and not any(c["name"].startswith(f"{fam}/") and not c["ok"] for c in checks.items)
    return rec


def run_megatron(args, work: Path, checks: Checks) -> dict:
    import torch

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 check compares true fp32 arithmetic
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    out = {}
    for fam in args.families:
        log(f"== Megatron family {fam}")
        out[fam] = check_family(fam, args, work, checks)
    return out


# ---- JAX -----------------------------------------------------------------------------------------------
def run_jax(args, checks: Checks) -> dict:
    import yaml

    t = time.perf_counter()
    import jax

    from trainer.jax.config import JaxConfig
    from trainer.jax.engine import Engine, summarize

    out: dict = {"import_s": time.perf_counter() - t, "backend": jax.default_backend(),
                 "devices": [str(d) for d in jax.devices()], "jax": jax.__version__}
    log(f"== JAX {jax.__version__} on {out['backend']} ({out['devices'][0]})")
    want = "gpu" if args.device == "cuda" else "cpu"
    checks.add("jax/backend", out["backend"] == want, out["backend"], want)
    for algo, path in JAX_CONFIGS.items():
        rec: dict = {"config": path}
        try:
            raw = yaml.safe_load((ROOT / path).read_text())["jax"]
            if args.jax_num_envs:
                raw["num_envs"] = args.jax_num_envs
            if args.quick:
                raw["updates_per_iteration"] = 10
                if "sac" in raw:  # gradient steps from the first update on, so the timed chunks include them
                    raw["sac"]["learning_starts"] = raw["num_envs"] * raw["num_steps"]
            cfg = JaxConfig(**raw)
            chunks = 2 if args.quick else 5
            t = time.perf_counter()
            engine = Engine(cfg, total_updates=(chunks + 1) * cfg.updates_per_iteration, seed=0, devices=1)
            state = engine.init_state()
            jax.block_until_ready(state)
            rec |= {"env": cfg.env, "num_envs": cfg.num_envs, "num_steps": cfg.num_steps,
                    "updates_per_chunk": cfg.updates_per_iteration, "env_steps_per_chunk": engine.steps_per_chunk,
                    "timed_chunks": chunks, "init_s": time.perf_counter() - t}
            if cfg.sac is not None:
                rec["sac"] = {"learning_starts": cfg.sac.learning_starts, "gradient_steps": cfg.sac.gradient_steps,
                              "batch_size": cfg.sac.batch_size}
            t = time.perf_counter()
            engine.compile(state)
            rec["compile_s"] = time.perf_counter() - t
            t = time.perf_counter()
            state, metrics = engine.run_chunk(state)  # first execution: not timed as throughput
            jax.block_until_ready(state)
            rec["first_chunk_s"] = time.perf_counter() - t
            times = []
            for _ in range(chunks):
                t = time.perf_counter()
                state, metrics = engine.run_chunk(state)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t)
            summary = summarize(metrics)
            rec["chunk_s"] = times
            rec["env_steps_per_s"] = engine.steps_per_chunk / statistics.median(times)
            rec["last_chunk"] = summary
            log(f"{algo} {cfg.env}: compile {rec['compile_s']:.1f} s, {rec['env_steps_per_s']:.0f} env steps/s "
                f"({engine.steps_per_chunk} steps per chunk, median of {chunks}), return "
                f"{summary['episode_return_mean']}")
            finite = all(math.isfinite(v) for v in summary.values() if isinstance(v, float))
            checks.add(f"jax/{algo}/env_steps_per_s", rec["env_steps_per_s"] > 0, rec["env_steps_per_s"], 0.0)
            checks.add(f"jax/{algo}/finite_metrics", finite, detail="every metric of the last chunk finite")
            del state, metrics, engine
        except Exception as exc:  # noqa: BLE001
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc(limit=8)
            checks.add(f"jax/{algo}/runs", False, detail=rec["error"].splitlines()[0][:300])
        out[algo] = rec
    return out


# ---- main ----------------------------------------------------------------------------------------------
def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "megatron-core", "jax", "jaxlib", "flax", "optax", "gymnax", "flashbax"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=str(ROOT / "bench_results"), help="where gpu_check.json goes")
    ap.add_argument("--quick", action="store_true", help="smallest models and JAX chunks (the CPU test)")
    ap.add_argument("--families", default="all", help="comma-separated tiny-model families (default: all)")
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX engine")
    ap.add_argument("--no-megatron", action="store_true", help="skip the Megatron families")
    ap.add_argument("--no-long", action="store_true", help="skip the long-sequence step")
    ap.add_argument("--long-families", default="qwen2,qwen3,llama3,qwen3_moe",
                    help="comma-separated families of the long-sequence step")
    ap.add_argument("--no-offload", action="store_true", help="skip the offload step")
    ap.add_argument("--offload-families", default="qwen2,qwen3_moe",
                    help="comma-separated families of the offload step")
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA step")
    ap.add_argument("--lora-families", default="qwen2,qwen3_moe", help="comma-separated families of the LoRA step")
    ap.add_argument("--jax-num-envs", type=int, default=None,
                    help="parallel envs of both JAX runs (default: the configs' own, 4)")
    ap.add_argument("--steps", type=int, default=None, help="bf16 train steps per family (default 3, 6 full)")
    ap.add_argument("--lr", type=float, default=5e-3, help="learning rate of the train steps")
    ap.add_argument("--backend", default=None, help="torch.distributed backend (default: nccl on cuda, gloo on cpu)")
    ap.add_argument("--fault", choices=("swap-rows", "skip-load", "base-moves"), action="append", default=[],
                    help="swap-rows: a conversion error on the transformers side (the logits checks must fail); "
                         "skip-load: the resumed rank does not load the checkpoint (resume_exact must fail); "
                         "base-moves: a LoRA step that moves a base parameter (lora_base_frozen must fail); "
                         "repeatable")
    args = ap.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    args.steps = args.steps or (3 if args.quick else 6)
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the loss check compares the first and last steps)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Before torch or jax start: JAX must not take 75% of the GPU that torch shares, and must stay on the CPU
    # when the check is asked to.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    checks = Checks()
    result: dict = {"args": {k: v for k, v in vars(args).items()}, "versions": _versions(),
                    "bounds": {"fp32_logits_abs": FP32_LOGITS_BOUND, "bf16_logits_rel_to_max_abs_logit":
                               BF16_LOGITS_REL_BOUND, "bf16_moe_positions_over_bound_share": BF16_MOE_FLIP_SHARE,
                               "bf16_moe_p90_from_fp32_margin": BF16_AS_EXACT_MARGIN,
                               "roundtrip_abs": 0.0, "update": "lr * sum_t sqrt(t) + 2 * 2^-8 * max |weight|"}}
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        checks.add("cuda/available", False, detail="torch.cuda.is_available() is False")
    else:
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name(0)
            log(f"device: {result['gpu']}, torch {torch.__version__}")
        known = families()
        args.families = known if args.families == "all" else args.families.split(",")
        args.long_families = args.long_families.split(",")
        args.offload_families = args.offload_families.split(",")
        args.lora_families = args.lora_families.split(",")
        unknown = sorted((set(args.families) | set(args.long_families) | set(args.offload_families)
                          | set(args.lora_families)) - set(known))
        if unknown:
            print(f"unknown families {unknown}; known: {known}", file=sys.stderr)
            return 2
        result["families_known"] = known
        with tempfile.TemporaryDirectory(prefix="tide_gpu_check_") as work:
            if not args.no_megatron:
                result["families"] = run_megatron(args, Path(work), checks)
            if not args.no_long:
                from gpu_check_long import run_long

                result["long"] = run_long(args, Path(work), checks, sys.modules[__name__])
            if not args.no_offload:
                from gpu_check_offload import run_offload

                result["offload"] = run_offload(args, Path(work), checks, sys.modules[__name__])
            if not args.no_lora:
                from gpu_check_lora import run_lora

                result["lora"] = run_lora(args, Path(work), checks, sys.modules[__name__])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if not args.no_jax:
            try:
                result["jax"] = run_jax(args, checks)
            except Exception as exc:  # noqa: BLE001  (jax itself failed to import or start)
                result["jax"] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
                checks.add("jax/runs", False, detail=result["jax"]["error"].splitlines()[0][:300])
    result["checks"] = checks.items
    result["failed"] = checks.failed
    result["ok"] = not checks.failed
    result["seconds"] = time.perf_counter() - T0
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    log(f"wrote {path}")
    if checks.failed:
        log(f"FAILED {len(checks.failed)} of {len(checks.items)} checks: {', '.join(checks.failed)}")
        return 1
    log(f"all {len(checks.items)} checks passed in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
