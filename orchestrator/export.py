"""`tide export RUN_DIR OUT [--iteration N]`: a kept checkpoint as a Hugging Face directory, in this process
(one Megatron rank on gloo; no Ray, no vLLM), from whatever TP/PP/EP/DP layout saved it: Megatron's distributed
checkpoint reshards the parameters into TP=PP=EP=1, which publishes whole tensors."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

from ckpt_transfer.manifest import Manifest
from orchestrator.config import load_config
from orchestrator.model_source import resolve_model_dir
from orchestrator.rundir import CKPT_PREFIX, RunDir
from rollout.tasks import make_task
from trainer.config import KLConfig, ParallelConfig, TrainerSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export_checkpoint(run: RunDir, out: Path, iteration: int | None = None) -> Path:
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
    from trainer.megatron.worker import MegatronWorker

    worker = MegatronWorker(spec, 0, 1, "127.0.0.1", _free_port())
    try:
        worker.load_model(str(run.checkpoint_dir(iteration)))
        out = Path(out)
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        written = worker.publish(str(staging), node="export", shard_bytes=cfg.publish.shard_bytes)
        manifest = Manifest(run=cfg.name, iteration=iteration, directory=str(staging), shards=written["shards"],
                            aux_files=written["aux_files"])
        finalize_manifest(manifest)
        return rename_into_place(manifest, staging, out)
    finally:
        worker.shutdown()
