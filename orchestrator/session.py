"""Everything one RL run holds between iterations: config, run directory, task, trainer ranks, rollout
engines. `loop.py` drives it; this module hides set-up, resume and the plumbing of each phase."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console

from ckpt_transfer.gc import gc_iterations
from ckpt_transfer.manifest import Manifest
from ckpt_transfer.writer import iteration_dir
from orchestrator.cluster import Cluster, connect
from orchestrator.config import TideConfig, dump_config
from orchestrator.rollout_group import RolloutGroup
from orchestrator.rundir import RunDir
from orchestrator.trainer_group import TrainerGroup, trainer_spec
from rollout.samples import Samples
from rollout.tasks import Problem, Task, make_task
from trainer.batch import TrainBatch, TrainSequence
from trainer.losses import length_reward

if TYPE_CHECKING:
    from orchestrator.sandbox_service import SandboxService
    from orchestrator.transfer import WeightTransfer

console = Console(stderr=True)
PROBE_STREAM = 10**9  # iteration index reserved for the fixed probe problems


class LogprobGapError(RuntimeError):
    pass


def prepare_engine_dir(manifest: Manifest) -> Path:
    from rollout.checkpoint import engine_checkpoint_dir, verify_manifest

    verify_manifest(manifest)
    return engine_checkpoint_dir(manifest, "engine-start")


def check_logprob_gap(iteration: int, gap: float, limit: float) -> None:
    if not gap <= limit:  # also catches NaN
        raise LogprobGapError(
            f"iteration {iteration}: vLLM and trainer log-probs differ by {gap:.3g} on the probe batch "
            f"(rollout.max_logprob_gap = {limit:g}); the weights the engines serve are not the trainer's"
        )


def derive_seed(seed: int, iteration: int) -> int:
    return (seed * 1_000_003 + iteration * 7919) % (2**31 - 1)


def resolve_model_dir(cfg: TideConfig, task: Task) -> str:
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not path.exists() and "/" not in cfg.model.path.strip("/"):
            raise FileNotFoundError(f"model.path {cfg.model.path!r} does not exist")
        return str(path) if path.exists() else _download(cfg.model.path)
    from trainer.tiny_model import TinySpec, build_tiny_model

    t = cfg.model.tiny
    spec = TinySpec(architecture=t.architecture, num_experts=t.num_experts, experts_per_token=t.experts_per_token,
                    hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                    num_kv_heads=t.num_kv_heads, intermediate_size=t.intermediate_size,
                    max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=t.tie_word_embeddings,
                    init_std=t.init_std, seed=cfg.seed)
    cache = Path(os.environ.get("TIDE_CACHE", Path.cwd() / ".cache" / "tide"))
    key = hashlib.sha256(repr((spec, task.corpus())).encode()).hexdigest()[:12]
    return str(build_tiny_model(cache / f"tiny-{task.name}-{key}", task.corpus(), spec))


def _download(repo_id: str) -> str:
    """A hub id: the same path users take with a real model (fails with the hub's error where none is
    reachable)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])


@dataclass
class Session:
    cfg: TideConfig
    run: RunDir
    task: Task
    model_dir: str
    tokenizer: object
    cluster: Cluster
    trainer: TrainerGroup
    rollout: RolloutGroup | None = None
    transfer: "WeightTransfer | None" = None
    sandbox: "SandboxService | None" = None
    last_pull: dict = field(default_factory=dict)
    start_iteration: int = 0
    metrics_history: list[dict] = field(default_factory=list)

    # ---- set-up and resume ----------------------------------------------------------------------
    @classmethod
    def open(cls, cfg: TideConfig, run: RunDir, resume: bool) -> "Session":
        """Build everything a run needs; whatever was started is stopped again if a later step fails."""
        from transformers import AutoTokenizer

        sandbox = None
        if cfg.task.name == "code" and not cfg.sandbox.url:
            from orchestrator.sandbox_service import SandboxService

            sandbox = SandboxService.start(run.path, cfg.sandbox.state_dir)
        cluster = trainer = None
        try:
            task = make_task(cfg.task.name, path=cfg.task.path, max_digits=cfg.task.max_digits,
                             length=cfg.task.length, sandbox_url=cfg.sandbox.url or (sandbox.url if sandbox else None))
            model_dir = resolve_model_dir(cfg, task)
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            run.config_file.write_text(dump_config(cfg))
            cluster = connect(cfg.ray.address, cfg.ray.namespace, cfg.ray.num_cpus, cfg.ray.log_to_driver)
            console.log(f"[bold]{cfg.name}[/]: model {model_dir}, run dir {run.path}")
            trainer = TrainerGroup(trainer_spec(cfg, model_dir))
        except BaseException:
            for part in (trainer, cluster, sandbox):
                if part is not None:
                    part.shutdown() if hasattr(part, "shutdown") else part.stop()
            raise
        s = cls(cfg, run, task, model_dir, tokenizer, cluster, trainer, sandbox=sandbox)
        try:
            s._start(resume)
        except BaseException:
            s.close()
            raise
        return s

    def _start(self, resume: bool) -> None:
        cfg, run, trainer = self.cfg, self.run, self.trainer
        if cfg.transfer.enabled:
            from orchestrator.transfer import WeightTransfer

            self.transfer = WeightTransfer(cfg, trainer.node, cfg.rollout.engines)
        ckpt = run.latest_checkpoint() if resume else None
        if ckpt is not None:
            state = run.read_run_state(ckpt)
            trainer.load_checkpoint(str(ckpt))
            self.start_iteration = state["iteration"]
            self.metrics_history = state["metrics"]
            run.truncate_after(self.start_iteration)
            console.log(f"resumed from {ckpt.name} (iteration {self.start_iteration})")
        else:
            run.truncate_after(-1)
            if cfg.trainer.warmup_sft_steps:
                with run.phase(0, "warmup"):
                    losses = self.warmup()
                console.log(f"supervised warm start: {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        # Engines start on exactly the trainer's current weights: the base model, or a publish of the
        # warmed-up model or of the checkpoint a resume starts from (pulled to each rollout node when
        # transfer is on, verified, and merged to whole tensors when the trainer is tensor-parallel).
        dirs = [self.model_dir] * cfg.rollout.engines
        if ckpt is not None or cfg.trainer.warmup_sft_steps > 0:
            start = self.publish(self.start_iteration)
            manifests = self.transfer.pull(start).manifests if self.transfer else [start] * cfg.rollout.engines
            dirs = [str(prepare_engine_dir(m)) for m in manifests]
        self.rollout = RolloutGroup(dirs, self.engine_config(), cfg.rollout.engine_start_timeout_s)
        run.set_status(engine_pids=self.rollout.engine_pids())

    def engine_config(self):
        from rollout.engine import EngineConfig

        r = self.cfg.rollout
        return EngineConfig(tp=r.tp, dtype=self.cfg.model.dtype, kv_cache_gb=r.kv_cache_gb, seed=self.cfg.seed,
                            deterministic=self.cfg.deterministic, max_engine_restarts=r.max_engine_restarts,
                            start_timeout_s=r.engine_start_timeout_s)

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
        if self.transfer is not None:
            self.transfer.close()
        if self.sandbox is not None:
            self.sandbox.stop()
        self.trainer.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(Path(self.cfg.publish.shm_root) / self.cfg.name, ignore_errors=True)
        if self.cfg.transfer.enabled:
            for k in range(self.cfg.rollout.engines):
                shutil.rmtree(Path(self.cfg.transfer.rollout_shm_root) / f"rollout{k}" / self.cfg.name,
                              ignore_errors=True)

    # ---- phases --------------------------------------------------------------------------------
    def problems(self, iteration: int) -> list[Problem]:
        return self.task.problems(self.cfg.seed, iteration, self.cfg.rollout.prompts_per_iteration)

    def generate(self, problems: list[Problem], iteration: int) -> Samples:
        r = self.cfg.rollout
        return self.rollout.generate(problems, r.n_samples, r.max_new_tokens, r.temperature,
                                     derive_seed(self.cfg.seed, iteration))

    def score(self, problems: list[Problem], samples: Samples) -> dict[str, float]:
        by_index = [problems[s.prompt_index] for s in samples]
        correct = self.task.score(by_index, [s.text for s in samples])
        rewards = torch.tensor(correct, dtype=torch.float32)
        w = self.cfg.trainer.length_penalty
        if w > 0:
            lengths = torch.tensor([len(s.completion_ids) for s in samples])
            groups = torch.tensor([s.prompt_index for s in samples])
            rewards = rewards + w * length_reward(lengths, rewards > 0.5, groups)
        for s, r in zip(samples, rewards.tolist()):
            s.reward = r
        return {"reward_mean": float(rewards.mean()), "accuracy": sum(correct) / len(correct),
                "completion_len": sum(len(s.completion_ids) for s in samples) / len(samples)}

    def train(self, samples: Samples) -> dict:
        seqs = [TrainSequence(s.prompt_ids, s.completion_ids, s.logprobs, s.reward, s.prompt_index) for s in samples]
        t = self.cfg.trainer
        return self.trainer.train_step(TrainBatch(seqs), lr=t.lr, updates=t.updates_per_iteration)

    def publish(self, iteration: int) -> Manifest:
        p = self.cfg.publish
        directory = iteration_dir(p.shm_root, self.cfg.name, iteration)
        if directory.exists():  # left by a killed run: never reuse half-written shards
            shutil.rmtree(directory)
        manifest = self.trainer.publish(self.cfg.name, iteration, str(directory), p.shard_bytes, p.writer_threads)
        if self.transfer is not None:
            self.transfer.publish(manifest)
        return manifest

    def sync(self, manifest: Manifest) -> float:
        """Bring the engines onto `manifest` (pulling it to their nodes first when transfer is on), collect
        old iterations, and return the log-prob gap on the probe batch."""
        self.load_into_engines(manifest, self.cfg.rollout.sync_mode)
        keep = self.cfg.publish.keep_last
        if self.transfer is not None:
            self.transfer.gc(keep, manifest.iteration)
        else:
            gc_iterations(Path(self.cfg.publish.shm_root) / self.cfg.name, keep, recycle=True)
        self.run.set_status(engine_pids=self.rollout.engine_pids())
        return self.logprob_gap()

    def load_into_engines(self, manifest: Manifest, mode: str) -> None:
        """Engines on other nodes cannot read the trainer's shared memory: with transfer on, each loads its
        own pulled copy."""
        if self.transfer is not None:
            pulled = self.transfer.pull(manifest)
            self.last_pull = {"transfer_bytes": pulled.bytes, "transfer_seconds": pulled.seconds}
            self.rollout.sync(pulled.manifests, mode)
        else:
            self.rollout.sync(manifest, mode)

    def probe_batch(self) -> TrainBatch:
        """Fixed (prompt, target completion) pairs, the same every iteration."""
        eos = self.tokenizer.eos_token_id
        seqs = []
        for prompt, completion in self.task.sft_examples(self.cfg.seed + PROBE_STREAM, self.cfg.rollout.probe_prompts):
            seqs.append(TrainSequence(self.tokenizer(prompt, add_special_tokens=False).input_ids,
                                      self.tokenizer(completion, add_special_tokens=False).input_ids + [eos]))
        return TrainBatch(seqs)

    def logprob_gap(self) -> float:
        """Mean |vLLM - trainer| teacher-forced log-prob over a fixed probe batch (worst engine)."""
        batch = self.probe_batch()
        ours = self.trainer.logprobs(batch)
        per_engine = self.rollout.score_sequences([s.prompt_ids for s in batch.sequences],
                                                  [s.completion_ids for s in batch.sequences])
        gaps = []
        for theirs in per_engine:
            diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
            gaps.append(sum(diffs) / len(diffs))
        return max(gaps)

    def check_gap(self, iteration: int, gap: float) -> None:
        check_logprob_gap(iteration, gap, self.cfg.rollout.max_logprob_gap)

    def record(self, iteration: int, metrics: dict) -> None:
        rec = {"iteration": iteration, **metrics}
        self.metrics_history.append(rec)
        self.run.log_metrics(rec)

    def checkpoint(self, iteration: int) -> None:
        state = {"iteration": iteration, "data_cursor": iteration, "seed": self.cfg.seed,
                 "metrics": self.metrics_history}
        with self.run.writing_checkpoint(iteration, state) as tmp:
            self.trainer.save_checkpoint(str(tmp))
        self.run.prune_checkpoints(self.cfg.keep_checkpoints)

    def warmup(self) -> list[float]:
        """Supervised warm start on the task's reference answers, so that RL starts with some signal."""
        t = self.cfg.trainer
        eos = self.tokenizer.eos_token_id
        examples = self.task.sft_examples(self.cfg.seed, t.warmup_sft_steps * t.warmup_sft_batch)
        losses = []
        for step in range(t.warmup_sft_steps):
            chunk = examples[step * t.warmup_sft_batch:(step + 1) * t.warmup_sft_batch]
            seqs = [TrainSequence(self.tokenizer(p, add_special_tokens=False).input_ids,
                                  self.tokenizer(a, add_special_tokens=False).input_ids + [eos]) for p, a in chunk]
            losses.append(self.trainer.train_step(TrainBatch(seqs), mode="sft", lr=t.warmup_sft_lr)["loss"])
        return losses

    def write_final(self, iteration: int) -> None:
        (self.run.path / "final.json").write_text(json.dumps(
            {"iteration": iteration, "parameter_digests": self.trainer.parameter_digests()}, indent=1))
