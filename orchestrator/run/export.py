"""`tide export RUN_DIR OUT [--iteration N]`: a kept checkpoint as a Hugging Face directory, in this process
(one Megatron rank on gloo; no Ray, no vLLM), from whatever TP/PP/EP/DP layout saved it: Megatron's distributed
checkpoint reshards the parameters into TP=PP=EP=1, which publishes whole tensors."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ckpt_transfer.manifest import Manifest
from ckpt_transfer.peft_adapter import adapter_config, merge_records, write_peft_dir
from orchestrator.config.schema import load_config
from orchestrator.config.model_source import resolve_model_dir
from orchestrator.records.rundir import CKPT_PREFIX, RunDir
from rollout.tasks import make_task
from trainer.config import KLConfig, ParallelConfig, TrainerSpec


@dataclass(frozen=True)
class ExportResult:
    path: Path
    iteration: int
    logit_diff: float | None = None  # max |transformers - Megatron| over the check's tokens (verify only)
    logprob_diff: float | None = None


class ExportMismatch(RuntimeError):
    pass


def export_checkpoint(run: RunDir, out: Path, iteration: int | None = None, verify: bool = False,
                      merged: bool = False) -> ExportResult:
    """`verify`: load the export with transformers and compare its logits with the Megatron model's on the same
    tokens; float32 must agree to 1e-4 (logits), other dtypes to the run's log-prob gap bound (log-probs). A LoRA
    run (trainer.lora) exports its adapter as a PEFT directory over the base (verified through PEFT), or with
    `merged` the base with the adapter merged in."""
    cfg = load_config(run.config_file)
    if cfg.engine != "megatron":
        raise ValueError(f"{run.path} is a JAX run: there is no language model to export")
    kept = sorted(int(p.name.removeprefix(CKPT_PREFIX)) for p in run.checkpoints.glob(f"{CKPT_PREFIX}*")
                  if p.is_dir() and not p.name.endswith(".tmp"))
    if not kept:
        raise FileNotFoundError(f"{run.path} has no checkpoint to export")
    iteration = kept[-1] if iteration is None else iteration
    if iteration not in kept:
        raise FileNotFoundError(f"{run.path} keeps no checkpoint of iteration {iteration} (kept: "
                                f"{', '.join(map(str, kept))})")
    # The task only supplies the built-in tiny model's corpus (its tokenizer): no sandbox is contacted.
    task = make_task(cfg.task, sandbox_url=cfg.sandbox.url or "http://sandbox.unused", seed=cfg.seed)
    model_dir = resolve_model_dir(cfg.model.path, cfg.model.tiny, task, cfg.seed)
    trainer = cfg.trainer.model_copy(update={"parallel": ParallelConfig(), "kl": KLConfig()})
    spec = TrainerSpec(hf_dir=model_dir, trainer=trainer, seed=cfg.seed, deterministic=cfg.deterministic,
                       dtype=cfg.model.dtype)
    from ckpt_transfer.writer import finalize_manifest, rename_into_place
    from trainer.megatron.worker import SINGLE_RANK_PORT, MegatronWorker

    if merged and cfg.trainer.lora is None:
        raise ValueError(f"{run.path} trained the whole model (no trainer.lora): there is no adapter to merge")
    worker = MegatronWorker(spec, 0, 1, "127.0.0.1", SINGLE_RANK_PORT)
    try:
        worker.load_model(str(run.checkpoint_dir(iteration)))
        out = Path(out)
        lora = cfg.trainer.lora
        if lora is not None and not merged:
            path = write_peft_dir(merge_records(worker.adapter_tensors()), out, adapter_config(
                rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules,
                base_model=model_dir))
        else:
            staging = out.with_name(out.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            written = worker.publish(str(staging), node="export", shard_bytes=cfg.publish.shard_bytes)
            manifest = Manifest(run=cfg.name, iteration=iteration, directory=str(staging), shards=written["shards"],
                                aux_files=written["aux_files"])
            finalize_manifest(manifest)
            path = rename_into_place(manifest, staging, out)
        if not verify:
            return ExportResult(path, iteration)
        adapter_of = model_dir if lora is not None and not merged else None
        logit_diff, logprob_diff = _compare_with_transformers(worker, path, cfg.model.dtype, cfg.seed, adapter_of)
        bound = 1e-4 if cfg.model.dtype == "float32" else cfg.rollout.logprob_gap_bound(cfg.model.dtype)
        measured, what = (logit_diff, "logits") if cfg.model.dtype == "float32" else (logprob_diff, "log-probs")
        if measured > bound:
            raise ExportMismatch(f"{path}: transformers' {what} differ from Megatron's by {measured:.3g} "
                                 f"(> {bound:g} for {cfg.model.dtype}); the conversion is wrong for this model")
        return ExportResult(path, iteration, logit_diff, logprob_diff)
    finally:
        worker.shutdown()


def _compare_with_transformers(worker, hf_dir: Path, dtype: str, seed: int,
                               adapter_of: str | None = None) -> tuple[float, float]:
    """Max |difference| of logits and of log-probs between transformers (loading `hf_dir`; a PEFT adapter over the
    base `adapter_of`) and the Megatron model, over a few seeded random token sequences of the vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM

    if adapter_of is None:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(adapter_of, dtype=getattr(torch, dtype))
        model = PeftModel.from_pretrained(base, hf_dir).eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (4, 24), generator=generator)
    ours = torch.stack(worker.logits(tokens.tolist())).float()
    with torch.no_grad():
        theirs = model(tokens).logits.float()
    logit_diff = (ours - theirs).abs().max().item()
    logprob_diff = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item()
    return logit_diff, logprob_diff
