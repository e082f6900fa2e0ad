"""One Megatron-core trainer rank. The orchestrator runs one of these per rank as a Ray actor; every public
method is called on all ranks at once (they take part in the same collectives)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

import torch

from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.config import TrainerSpec
from trainer.losses import advantages, clip_counts, kl_estimate, kl_importance_weight, masked_reference, policy_loss
from trainer.megatron.behaviour import (ProximalStep, behaviour_gaps, computed_proximal, fresh_sequences,
                                        minibatch_bounds)
from trainer.sampling import entropy, entropy_from_partials, entropy_partials, kl_distribution, processed_logits

EntropyMode = Literal["no", "metric", "grad"]
ENTROPY_CHUNK = 1024  # positions per piece of the entropy metric
# What train_step sums per optimizer step (over micro-batches and data-parallel ranks)
STATS = ("loss", "logp", "sq_log_ratio", "kl_ref", "gap", "entropy", "clip_low", "clip_high", "is_weight",
         "is_truncated")

if TYPE_CHECKING:
    from trainer.megatron.routing_replay import RoutingPass

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positions(s: TrainSequence) -> int:
    """Input positions of a sequence: position t predicts token t + 1."""
    return len(s.prompt_ids) + len(s.completion_ids) - 1


def _write_results_in_process() -> None:
    """Megatron's synchronous torch_dist save writes with threads of this process, yet hands their results over a
    multiprocessing Manager queue that its first save creates by spawning a server process (3.5 s, 275 MB resident
    for the life of the rank, measured on a tiny model; 5-11 s for a rank under Ray). A thread-safe queue of this
    process carries them as well. Only an asynchronous save, which tide does not use, writes from another process."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


# The rendezvous port of a one-rank process group (export, gpu_check): 0 lets the rank's own TCP store bind a port the
# OS picks; a port found free beforehand and released can be taken by another process before the store binds it
# (EADDRINUSE, seen once in the suite's gpu_check run)
SINGLE_RANK_PORT = 0


class MegatronWorker:
    def __init__(self, spec: TrainerSpec, rank: int, world_size: int, master_addr: str, master_port: int):
        t = spec.trainer
        if t.device == "cpu":
            from trainer.megatron.compat import enable_cpu_compat

            enable_cpu_compat()
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from transformers import AutoConfig

        from trainer.megatron.model import expert_tensor_parallel_size

        self.spec, self.rank, self.world_size = spec, rank, world_size
        torch.manual_seed(spec.seed)
        # set either way: a process may hold another worker before this one (RankPool)
        torch.use_deterministic_algorithms(spec.deterministic, warn_only=True)
        if t.device == "cuda":
            if spec.deterministic:
                # cuBLAS reduces in a nondeterministic order unless its workspace is fixed before its first handle
                # (PyTorch's reproducibility notes; use_deterministic_algorithms only warns without it here)
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(t.backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timedelta(minutes=10))
        self.hf_config = AutoConfig.from_pretrained(spec.hf_dir)
        ps.initialize_model_parallel(t.parallel.tp, t.parallel.pp, expert_model_parallel_size=t.parallel.ep,
                                     expert_tensor_parallel_size=expert_tensor_parallel_size(self.hf_config,
                                                                                             t.parallel.tp))
        model_parallel_cuda_manual_seed(spec.seed, force_reset_rng=True)
        self.ps = ps
        self.dtype = _DTYPES[spec.dtype]
        self._build()
        self._load_hf(spec.hf_dir)
        # after loading: a half-precision optimizer keeps float32 main copies of the parameters as they are when
        # it is created, and its first step writes them back (built before, it would revert to the random init)
        self.reset_optimizer()
        self.loss_spec = t.loss_spec()
        self.reference = self._frozen_copy() if t.kl.coef > 0 else None
        self.behaviour = None  # snapshot_behaviour's copy, made on first use
        from trainer.megatron import routing_replay

        self._routers = routing_replay.attach(self.module)
        self._reference_routers = routing_replay.attach(self.reference) if self.reference is not None else []
        self._behaviour_routers: list = []
        self.routing_replay = t.moe.routing_replay == "rollout"
        if self.routing_replay and not self._routers:
            raise ValueError("trainer.moe.routing_replay: rollout needs a mixture-of-experts model")

    # ---- construction -----------------------------------------------------------------------
    def _build(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        from trainer.megatron.model import transformer_config

        s, t = self.spec, self.spec.trainer
        self.config = transformer_config(self.hf_config, tp=t.parallel.tp, pp=t.parallel.pp, ep=t.parallel.ep,
                                         dtype=self.dtype, deterministic=s.deterministic)
        module = self._new_module()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        self.model = DistributedDataParallel(self.config, ddp_config, module)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync

    def _new_module(self):
        """This rank's stage of the GPT model, on the trainer's device."""
        from trainer.megatron.model import build_gpt

        module = build_gpt(self.hf_config, self.config, pre_process=self.ps.is_pipeline_first_stage(),
                           post_process=self.ps.is_pipeline_last_stage())
        if self.dtype != torch.float32:
            # What Megatron's Float16Module does (without renaming every parameter `module.*`): the norms too,
            # so every parameter gets an fp32 main copy in the mixed-precision optimizer. Inputs are token
            # ids, and log-probs are computed in fp32 from the half-precision logits (as vLLM's sampler does).
            module = module.to(self.dtype)
        return module.cuda() if self.spec.trainer.device == "cuda" else module

    def _frozen_copy(self):
        """A frozen copy of this rank's part of the policy, in the same layout (the reference of trainer.kl, the
        behaviour snapshot)."""
        ref = self._new_module()
        ref.load_state_dict(self.module.state_dict())
        ref.requires_grad_(False)
        return ref.eval()

    def snapshot_reference(self) -> None:
        """The reference becomes the current policy (RL's starting point, after the warm start)."""
        if self.reference is not None:
            self.reference.load_state_dict(self.module.state_dict())

    def snapshot_behaviour(self) -> None:
        """Keep the current policy (rollout.max_staleness 1: the version the engines are sampling the next batch
        with while this one trains), so that the batch is checked against the policy that sampled it once drawn
        (`logprobs(..., behaviour=True)`). One more copy of this rank's parameters, made on first use."""
        from trainer.megatron import routing_replay

        if self.behaviour is None:
            self.behaviour = self._frozen_copy()
            self._behaviour_routers = routing_replay.attach(self.behaviour)
        else:
            self.behaviour.load_state_dict(self.module.state_dict())

    def reset_optimizer(self) -> None:
        """A fresh Adam (no moments, step 0) over the current parameters."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.spec.trainer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
                            clip_grad=t.grad_clip, params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
                            fp16=self.dtype == torch.float16, use_distributed_optimizer=False),
            [self.model],
        )

    @property
    def module(self):
        return self.model.module

    def layout(self):
        from ckpt_transfer.convert import RankLayout

        ps = self.ps
        layers = self.module.decoder.layers
        return RankLayout(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(), expert_dp_rank=ps.get_expert_data_parallel_rank(),
            layer_map={i: layer.layer_number - 1 for i, layer in enumerate(layers)},
        )

    def _load_hf(self, hf_dir: str) -> None:
        """Initialise this rank's parameters from an HF checkpoint (slicing its TP shard)."""
        from safetensors import safe_open

        from ckpt_transfer.convert import family

        index: dict[str, str] = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                index.update({k: str(f) for k in h.keys()})
        if not index:
            raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")

        def get(name: str) -> torch.Tensor:
            if name not in index:
                raise KeyError(f"{hf_dir}: checkpoint has no tensor {name!r}")
            with safe_open(index[name], "pt") as h:
                return h.get_tensor(name)

        params = dict(self.module.named_parameters())
        state = family(self.hf_config).hf_to_megatron(get, params.keys(), self.hf_config, self.layout())
        with torch.no_grad():
            for name, p in params.items():
                src = state[name]
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: HF gives shape {tuple(src.shape)}, Megatron expects {tuple(p.shape)}")
                p.copy_(src.to(p.dtype))

    # ---- batches ----------------------------------------------------------------------------
    def _micro_batches(self, seqs: list[TrainSequence], chunk: list[int], adv: torch.Tensor | None, seq_len: int,
                       split: bool = True):
        """This rank's micro-batches of `chunk` (its data-parallel share when `split`): padded [b, seq_len]
        tensors (with trainer.micro_batch_tokens, of each micro-batch's own rows and longest); position t predicts
        token t + 1, so a completion's per-token fields (mask, log-probs) sit at the positions from
        len(prompt) - 1 on.

        Every data-parallel rank runs the same number of micro-batches of the same b rows, also when the chunk
        does not divide (dropped samples, a warm-start batch dp does not divide, 3 sequences on dp2): a rank
        short of sequences fills rows with placeholders (a copy of the chunk's first sequence, mask 0, index -1),
        which add nothing to the loss, its gradient or any statistic. A rank with fewer micro-batches would
        leave the others waiting in the gradient all-reduce, the expert-parallel token exchange of every forward
        (EP groups span data-parallel ranks) or, with rows of another count, in the pipeline's fixed-shape
        send/receive."""
        dp, r = (self.ps.get_data_parallel_world_size(), self.ps.get_data_parallel_rank()) if split else (1, 0)
        if self.spec.trainer.micro_batch_tokens:
            groups = self._token_budget_groups(seqs, chunk, dp, r)
        else:
            idx = chunk[r::dp]
            widest = -(-len(chunk) // dp)  # rank 0's share: the largest
            rows_per_mb = max(1, min(self.spec.trainer.micro_batch_size, widest))
            n_mbs = -(-widest // rows_per_mb)
            idx = idx + [-1] * (n_mbs * rows_per_mb - len(idx))
            groups = [idx[start:start + rows_per_mb] for start in range(0, len(idx), rows_per_mb)]
        stand_in = seqs[chunk[0]]

        def seq(i: int) -> TrainSequence:
            return seqs[i] if i >= 0 else stand_in

        def rows(chosen: list[int], field, seq_len: int) -> list[list]:
            out = []
            for i in chosen:
                s = seq(i)
                p, c = len(s.prompt_ids), len(s.completion_ids)
                values = (field(s) or [0.0] * c) if i >= 0 else [0.0] * c
                out.append([0.0] * (p - 1) + list(values) + [0.0] * (seq_len - p + 1 - c))
            return out

        from trainer.megatron.routing_replay import micro_batch_routing

        mbs = []
        for chosen in groups:
            if self.spec.trainer.micro_batch_tokens:  # padded to its own longest (the pipeline's fixed shape: pp 1)
                seq_len = self._padded_len(max(_positions(seq(i)) for i in chosen))
            full = [seq(i).prompt_ids + seq(i).completion_ids for i in chosen]
            tokens = torch.tensor([f[:-1] + [0] * (seq_len + 1 - len(f)) for f in full], dtype=torch.long)
            labels = torch.tensor([f[1:] + [0] * (seq_len + 1 - len(f)) for f in full], dtype=torch.long)
            mask = torch.tensor(rows(chosen, lambda s: s.trained_mask, seq_len), dtype=torch.float32)
            old = torch.tensor(rows(chosen, lambda s: s.old_logprobs, seq_len), dtype=torch.float32)
            ref = torch.tensor(rows(chosen, lambda s: s.ref_logprobs, seq_len), dtype=torch.float32)
            behaviour = torch.tensor(rows(chosen, lambda s: s.rollout_logprobs, seq_len), dtype=torch.float32)
            is_weight = torch.tensor(rows(chosen, lambda s: s.is_weights, seq_len), dtype=torch.float32)
            versions = torch.tensor(rows(chosen, lambda s: s.versions, seq_len), dtype=torch.float32)
            routing = micro_batch_routing(
                [seqs[i].routed_experts if i >= 0 else None for i in chosen],
                [_positions(seq(i)) for i in chosen], seq_len)
            mbs.append(dict(index=chosen, tokens=tokens, labels=labels, mask=mask, old=old, ref=ref,
                            rollout=behaviour, is_weight=is_weight, versions=versions, routing=routing,
                            position_ids=torch.arange(seq_len).unsqueeze(0).expand(len(chosen), -1),
                            adv=None if adv is None else torch.stack([adv[i] if i >= 0 else adv.new_zeros(())
                                                                      for i in chosen])))
        return mbs

    def _token_budget_groups(self, seqs: list[TrainSequence], chunk: list[int], dp: int, r: int) -> list[list[int]]:
        """trainer.micro_batch_tokens: this rank's share of `chunk` sorted by length and cut greedily into groups
        of at most the budget's positions (rows x the group's padded longest; a longer sequence alone). Every
        data-parallel rank cuts every rank's share alike and fills up to the largest count with placeholder
        micro-batches (index -1), so that all run the same number (see _micro_batches)."""
        budget = self.spec.trainer.micro_batch_tokens

        def cut(share: list[int]) -> list[list[int]]:
            groups: list[list[int]] = []
            for i in sorted(share, key=lambda i: (_positions(seqs[i]), i)):
                width = self._padded_len(_positions(seqs[i]))  # the longest so far: sorted ascending
                if groups and (len(groups[-1]) + 1) * width <= budget:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            return groups

        shares = [cut(chunk[k::dp]) for k in range(dp)]
        n = max(len(g) for g in shares)
        return shares[r] + [[-1]] * (n - len(shares[r]))

    def _padded_len(self, positions: int) -> int:
        # sequence parallelism splits the positions over the tensor-parallel ranks
        parts = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        return -(-positions // parts) * parts

    def _seq_len(self, seqs: list[TrainSequence]) -> int:
        return self._padded_len(max((_positions(s) for s in seqs), default=1))

    def _token_logprobs(self, output: torch.Tensor, mb: dict, dist: TokenDistribution,
                        with_entropy: EntropyMode = "no") -> tuple[torch.Tensor, torch.Tensor | None]:
        """From the last stage's logits [b, s, V / tp] (this rank's vocabulary shard): the labels' log-probs
        [b, s] under `dist` (tempered and, when the rollout truncated, truncated over the whole vocabulary),
        differentiable, and the entropy of `dist` at each position [b, s] (`metric`: without gradient, `grad`:
        differentiable, `no`: None)."""
        from megatron.core import tensor_parallel as tpl

        labels = mb["labels"].to(output.device)
        if dist.truncates or self.ps.get_tensor_model_parallel_world_size() == 1:
            z = processed_logits(tpl.gather_from_tensor_model_parallel_region(output), labels, dist)
            logp = z.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            return logp, self._entropy(z, with_entropy, entropy)
        z = output.float() / dist.temperature
        ent = self._entropy(z, with_entropy, self._vocab_parallel_entropy)
        # Megatron's vocab-parallel cross entropy shifts and exponentiates its input in place: it gets a copy
        # where the entropy's backward still needs z
        logp = -tpl.vocab_parallel_cross_entropy(z.clone() if with_entropy == "grad" else z, labels)
        return logp, ent

    @staticmethod
    def _entropy(z: torch.Tensor, mode: EntropyMode, fn) -> torch.Tensor | None:
        """`fn(z)` per position. As a metric it runs without gradient on ENTROPY_CHUNK positions at a time: its
        temporaries are vocabulary-wide (a 150k vocabulary makes each 0.6 GB per 1k positions in float32)."""
        if mode == "no":
            return None
        if mode == "grad":
            return fn(z)
        with torch.no_grad():
            rows = z.detach().reshape(-1, z.shape[-1])
            return torch.cat([fn(chunk) for chunk in rows.split(ENTROPY_CHUNK)]).reshape(z.shape[:-1])

    def _vocab_parallel_entropy(self, z: torch.Tensor) -> torch.Tensor:
        """Entropy of softmax(z) over the vocabulary split across the TP ranks, without gathering it: each rank's
        partial sums are all-reduced (backward: each rank's own shard's gradient, as Megatron's vocab-parallel
        cross entropy does)."""
        import torch.distributed as torch_dist
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        m = z.detach().max(dim=-1).values
        torch_dist.all_reduce(m, op=torch_dist.ReduceOp.MAX, group=self.ps.get_tensor_model_parallel_group())
        s, t = entropy_partials(z, m)
        return entropy_from_partials(m, reduce_from_tensor_model_parallel_region(s),
                                     reduce_from_tensor_model_parallel_region(t))

    def _run(self, mbs: list[dict], loss_fn, seq_len: int, forward_only: bool, model=None,
             routing: RoutingPass | None = None) -> tuple[list[dict], torch.Tensor]:
        """Megatron's forward(-backward) schedule over the micro-batches; `loss_fn(mb, logits)` on the last
        stage, with logits [b, s, V / tp]. `routing`: how the forward uses the micro-batches' rollout routing.
        Returns the loss_fn outputs and this rank's routing counts (routing_replay.COUNTS; zeros unless
        measured)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from trainer.megatron import routing_replay
        from trainer.megatron.compat import native_torch

        routing = routing or routing_replay.RoutingPass()
        device = "cuda" if self.spec.trainer.device == "cuda" else "cpu"
        routers = (self._routers if model is None else self._reference_routers if model is self.reference
                   else self._behaviour_routers)
        uses_routing = routing.replay or routing.measure

        def forward_step(data_iter: Iterator[dict], model):
            mb = next(data_iter)
            # without pipelining or recomputation, a micro-batch's backward never routes again: the targets
            # set here serve its forward only
            routing_replay.set_targets(routers, mb["routing"] if uses_routing else None, routing)
            with native_torch():  # the model's forward names no device of its own
                out = model(mb["tokens"].to(device), mb["position_ids"].to(device), attention_mask=None)
            return out, partial(loss_fn, mb)

        try:
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[model or self.model],
                num_microbatches=len(mbs), seq_length=seq_len, micro_batch_size=max(len(m["index"]) for m in mbs),
                forward_only=forward_only,
            )
        finally:
            counts = routing_replay.take_counts(routers)
        return out, counts

    def _reporting_rank(self) -> bool:
        ps = self.ps
        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    # ---- public API ---------------------------------------------------------------------------
    def train_step(self, batch: TrainBatch, mode: str = "rl", lr: float | None = None,
                   updates: int = 1, shuffle_seed: int | None = None, epochs: int = 1) -> dict[str, float]:
        """Optimizer steps on the batch (`mode` "rl" uses the configured RL loss, "sft" the negative
        log-likelihood of the completions) at learning rate `lr` (default: the configured one). The batch is
        cut into `updates` mini-batches, one optimizer step each: consecutive ones, or, with `shuffle_seed`, of
        a seeded permutation (each step then mixes prompts, as TRL's and veRL's mini-batches do); advantages
        are computed over the whole batch first, so a prompt's baseline always sees all of its samples. With
        `epochs` > 1 (trainer.epochs) the batch is gone through that many times, each time in a new order,
        against the same old log-probs."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.spec.trainer.lr if lr is None else lr
        seqs = batch.sequences
        seq_len = self._seq_len(seqs)
        rewards = torch.tensor([s.reward for s in seqs], dtype=torch.float32)
        groups = torch.tensor([s.group for s in seqs])
        adv = advantages(self.loss_spec, rewards, groups) if mode == "rl" else None
        if mode == "rl" and self.reference is not None and any(len(s.ref_logprobs) != len(s.completion_ids)
                                                               for s in seqs):
            raise ValueError("trainer.kl is on: every sequence needs the reference's log-probs (ref_logprobs)")
        bad = next((s for s in seqs if s.loss_mask and len(s.loss_mask) != len(s.completion_ids)), None)
        if bad is not None:
            raise ValueError(f"a sequence's loss_mask has {len(bad.loss_mask)} entries for "
                             f"{len(bad.completion_ids)} completion tokens")
        if mode == "rl" and batch.old_recomputed and any(
                len(s.rollout_logprobs) != len(s.completion_ids) or len(s.is_weights) != len(s.completion_ids)
                for s in seqs):
            raise ValueError("a mismatch correction needs every sequence's rollout_logprobs and is_weights")
        from trainer.megatron.routing_replay import RoutingPass

        dist = batch.distribution if mode == "rl" else TokenDistribution()
        cuts, skipped = minibatch_bounds(len(seqs), updates)
        if skipped and self.rank == 0:
            logging.getLogger(__name__).warning(f"{len(seqs)} samples for {updates} mini-batches: {skipped} skipped "
                                                f"each epoch (one sample each)")
        proximal = ProximalStep(batch.proximal, updates * epochs, seqs) if mode == "rl" and batch.proximal else None
        shuffle = None if shuffle_seed is None else torch.Generator().manual_seed(shuffle_seed)
        stats, grad_norms, gap, kl_first = torch.zeros(len(STATS)), [], float("nan"), float("nan")
        routed = mode == "rl" and bool(self._routers) and any(s.routed_experts is not None for s in seqs)
        if mode == "rl" and self.routing_replay and not routed:
            raise ValueError("trainer.moe.routing_replay is rollout but no sequence carries the rollout's routing "
                             "(rollout.record_routing)")
        replay = mode == "rl" and self.routing_replay
        # With replay, what it does is measured on the whole batch before any update: the gap to the rollout with
        # the rollout's routing and with the trainer's own (two forward passes; a mini-batch holds too few
        # sequences routed apart for the comparison to rise above bf16 rounding)
        routing_stats = self._replay_comparison(seqs, seq_len, dist, batch.old_recomputed) if routed and replay else {}
        for epoch in range(epochs):  # each pass over the batch in a new seeded order
            order = list(range(len(seqs))) if shuffle is None else \
                torch.randperm(len(seqs), generator=shuffle).tolist()
            for k, (lo, hi) in enumerate(cuts):
                chunk = order[lo:hi]
                first = epoch == 0 and k == 0
                if first and proximal:  # pi_prox of the staleness-0 tokens trained after an update (behaviour.py)
                    proximal.computed = computed_proximal(self, seqs, fresh_sequences(
                        seqs, order if epochs > 1 else order[hi:], batch.proximal), seq_len, dist,
                        RoutingPass(replay=replay))
                chunk_tokens = max(sum(seqs[i].trained_tokens for i in chunk), 1)
                how = RoutingPass(replay=replay, measure=first and routed and not replay)
                # A GRPO mini-batch with no learning signal (every advantage zero, no KL or entropy term) takes no
                # optimizer step: its gradient is zero, and Adam would still move every weight on its momentum
                # (measured: a tiny policy wrecked within two iterations of all-zero advantages after one
                # rewarded sample). Kimi's losses pull towards pi_old even then: they always step. Every rank
                # holds the whole batch's advantages: they all decide alike.
                spec = self.loss_spec
                signal = (mode != "rl" or spec.kind != "grpo" or spec.kl_coef > 0 or spec.entropy_coef > 0
                          or any(adv[i] != 0 and seqs[i].trained_tokens > 0 for i in chunk))
                step_stats, grad_norm, counts = self._optimizer_step(
                    seqs, chunk, adv, seq_len, mode, dist, batch.old_recomputed, how, step=signal, proximal=proximal,
                    steps_taken=len(grad_norms))
                if first:
                    gap = float(step_stats[STATS.index("gap")]) / chunk_tokens
                    kl_first = float(step_stats[STATS.index("kl_ref")]) / chunk_tokens
                    if routed and not replay:
                        routing_stats = self._routing_metrics(counts, counts)
                stats += step_stats
                if signal:
                    grad_norms.append(grad_norm)
        tokens = float(sum(s.trained_tokens for s in seqs))
        per_token = {name: float(v) / max(tokens * epochs, 1.0) for name, v in zip(STATS, stats.tolist())}
        out = {"loss": float(stats[0]) / max(len(cuts) * epochs, 1), "logp_mean": per_token["logp"],
               "sq_log_ratio": per_token["sq_log_ratio"], "entropy": per_token["entropy"],
               "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else 0.0, "tokens": int(tokens),
               "optimizer_steps": len(grad_norms), "lr": self._applied_lr(), "skipped_minibatches": skipped * epochs,
               # mean |trainer - rollout| log-prob over the first mini-batch's tokens, computed before any
               # update (the loss needs those log-probs anyway): with the engines in sync it is ~0
               "behaviour_gap": gap if mode == "rl" else float("nan"),
               "reporting": self._reporting_rank()}
        if mode == "rl" and self.reference is not None:
            # kl_ref: the first mini-batch before its update, on the tokens the policy itself sampled (later
            # mini-batches estimate it on tokens an earlier policy sampled); kl_ref_mean: what the loss term
            # saw, over every mini-batch and epoch (TRL's `kl`, veRL's `actor/kl_loss`)
            out |= {"kl_ref": kl_first, "kl_ref_mean": per_token["kl_ref"]}
        if mode == "rl" and self.loss_spec.kind == "grpo":
            out |= {"clip_fraction_low": per_token["clip_low"], "clip_fraction_high": per_token["clip_high"]}
        if mode == "rl" and batch.proximal is not None:  # the interpolated pi_old's weights, every mini-batch's
            out |= {"is_weight_mean": per_token["is_weight"], "is_truncated_frac": per_token["is_truncated"]}
        return out | routing_stats

    def _applied_lr(self) -> float:
        """The rate the optimizer's own parameter groups (torch's Adam inside Megatron's wrappers) stepped with."""
        rates = {group["lr"] for group in self.optimizer.param_groups}
        if len(rates) != 1:
            raise RuntimeError(f"the optimizer's parameter groups disagree on the learning rate: {sorted(rates)}")
        return float(rates.pop())

    def _replay_comparison(self, seqs: list[TrainSequence], seq_len: int, dist: TokenDistribution,
                           old_recomputed: bool) -> dict[str, float]:
        """With routing replay, before any update: the mean |trainer - rollout| log-prob over the whole batch
        with the rollout's routing (`behaviour_gap_replayed`) and with the trainer's own routers' choice
        (`behaviour_gap_unreplayed`); the sequences the two passes score differently (`replay_sequences_affected`:
        some token routed apart) and of those, how many replay brings closer to the rollout or farther; the
        routing metrics of the whole batch."""
        replayed, replayed_counts = self._gap_pass(seqs, seq_len, dist, old_recomputed, replay=True)
        free, free_counts = self._gap_pass(seqs, seq_len, dist, old_recomputed, replay=False)
        sums = torch.stack([replayed.sum(), free.sum(), (replayed != free).sum(), (replayed < free).sum(),
                            (replayed > free).sum()]).double()
        sums = self._sum_over_dp_on_last_stage(sums)
        tokens = max(sum(s.trained_tokens for s in seqs), 1)
        return {"behaviour_gap_replayed": float(sums[0]) / tokens, "behaviour_gap_unreplayed": float(sums[1]) / tokens,
                "replay_sequences_affected": int(sums[2]), "replay_sequences_closer": int(sums[3]),
                "replay_sequences_farther": int(sums[4]), **self._routing_metrics(replayed_counts, free_counts)}

    def _gap_pass(self, seqs: list[TrainSequence], seq_len: int, dist: TokenDistribution, old_recomputed: bool,
                  replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward of the whole batch with or without routing replay: each of this rank's sequences' summed
        |trainer - rollout| log-prob (empty off the last pipeline stage) and this rank's routing counts."""
        mbs = self._micro_batches(seqs, list(range(len(seqs))), None, seq_len)

        def loss_fn(mb, output):
            logp, _ = self._token_logprobs(output, mb, dist)
            return output.new_zeros(()), {"gap": behaviour_gaps(logp, mb, old_recomputed).cpu()}

        from trainer.megatron.routing_replay import RoutingPass

        with torch.no_grad():
            out, counts = self._run(mbs, loss_fn, seq_len, forward_only=True,
                                    routing=RoutingPass(replay=replay, measure=True))
        return (torch.cat([d["gap"] for d in out]) if out else torch.zeros(0)), counts

    def _routing_metrics(self, trained: torch.Tensor, free: torch.Tensor) -> dict[str, float]:
        """Routing counts of one pass, summed over all ranks (each tensor-parallel group counted
        once): `routing_mismatch`, the share of (token, MoE layer) routings whose expert set the trainer's own
        router chooses otherwise than the rollout did, and `routing_mismatch_trained`, the share the loss's
        forward routed otherwise (0 with routing replay)."""
        import torch.distributed as torch_dist

        from trainer.megatron import routing_replay

        both = torch.stack([trained, free]).double()
        if self.ps.get_tensor_model_parallel_rank() != 0:
            both.zero_()
        torch_dist.all_reduce(both)
        given = max(float(both[1, routing_replay.COUNTS.index("given")]), 1.0)
        return {"routing_mismatch": float(both[1, routing_replay.COUNTS.index("differs")]) / given,
                "routing_mismatch_trained": float(both[0, routing_replay.COUNTS.index("used_differs")]) / given,
                "routed_tokens": int(both[1, routing_replay.COUNTS.index("given")])}

    def _optimizer_step(self, seqs: list[TrainSequence], chunk: list[int], adv: torch.Tensor | None, seq_len: int,
                        mode: str, dist: TokenDistribution, old_recomputed: bool,
                        routing: RoutingPass | None = None, step: bool = True,
                        proximal: ProximalStep | None = None, steps_taken: int = 0
                        ) -> tuple[torch.Tensor, float, torch.Tensor]:
        """Forward and backward over the mini-batch `chunk` (its statistics), then the optimizer's step; with
        `step` false, the forward only (its statistics; a gradient nobody applies is not computed). `proximal`:
        pi_old made here (rollout.proximal loglinear, behaviour.ProximalStep), `steps_taken` optimizer steps after
        pi_old."""
        dp = self.ps.get_data_parallel_world_size()
        # a sequence the mismatch correction left out whole (trained_tokens 0) counts in no denominator
        n_seqs = sum(1 for i in chunk if seqs[i].trained_tokens > 0)
        n_tokens = sum(seqs[i].trained_tokens for i in chunk)
        mbs = self._micro_batches(seqs, chunk, adv, seq_len)
        # Each micro-batch's loss is its part of the mini-batch objective (normalised by the mini-batch's
        # counts); the schedule divides by the number of micro-batches and DDP averages over data-parallel
        # ranks, which the factor undoes.
        scale = len(mbs) * dp

        spec = self.loss_spec
        entropy_grad = mode == "rl" and spec.entropy_coef > 0

        def loss_fn(mb, output):
            logp, ent = self._token_logprobs(output, mb, dist, "grad" if entropy_grad else "metric")
            mask = mb["mask"].to(logp.device)
            old = mb["old"].to(logp.device)
            sq = kl = gap = clip_low = clip_high = is_weight = truncated = logp.new_zeros(())
            w = mb["is_weight"].to(logp.device) if old_recomputed else None
            if proximal is not None:  # old: the engines' log-probs, the behaviour policy's
                old, w, is_weight, truncated = proximal.terms(mb, logp, steps_taken)
            if mode == "sft":
                loss = -(logp * mask).sum() / max(n_tokens, 1)
            else:
                adv_mb = mb["adv"].to(logp.device)
                ref = mb["ref"].to(logp.device) if self.reference is not None else None
                kl_logp = None
                if ref is not None:  # the KL term's distribution: the whole tempered vocabulary (kl_distribution)
                    kl_logp = self._token_logprobs(output, mb, kl_distribution(dist))[0] if dist.truncates else logp
                loss = policy_loss(spec, logp, old, mask, adv_mb, n_seqs, n_tokens, ref, is_weight=w, entropy=ent,
                                   kl_logp=kl_logp)
                sq = (((logp - old) ** 2) * mask).sum()
                gap = behaviour_gaps(logp, mb, old_recomputed).sum()
                if ref is not None:
                    ref = masked_reference(kl_logp, ref, mask)  # weighed as the loss weighs it: what the term saw
                    kl = (kl_estimate(kl_logp.detach(), ref, spec.kl_estimator) * mask
                          * kl_importance_weight(kl_logp, old, mask, w)).sum()
                if spec.kind == "grpo":
                    clip_low, clip_high = clip_counts(logp, old, adv_mb, mask, spec.clip_eps_low, spec.clip_eps_high)
            stats = torch.stack([loss.detach(), (logp.detach() * mask).sum(), sq.detach(), kl, gap,
                                 (ent.detach() * mask).sum(), clip_low, clip_high, is_weight, truncated])
            return loss * scale, {"stats": stats}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out, counts = self._run(mbs, loss_fn, seq_len, forward_only=not step, routing=routing)
        grad_norm = 0.0
        if step:
            ok, grad_norm, _ = self.optimizer.step()
            if not ok:
                raise RuntimeError("optimizer step skipped (non-finite gradients)")
        stats = torch.zeros(len(STATS))
        for d in out:
            stats += d["stats"].cpu()
        return self._sum_over_dp_on_last_stage(stats), float(grad_norm or 0.0), counts

    def _sum_over_dp_on_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.ps.is_pipeline_last_stage() and self.ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return t

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, reference: bool = False,
                 behaviour: bool = False) -> dict[int, list[float]] | None:
        """Teacher-forced log-probs of every completion token under `batch.distribution`, of the policy, of
        the frozen reference (trainer.kl) or of the behaviour snapshot (`snapshot_behaviour`). Returns
        {sequence index: [logp...]} on the ranks that hold results (last pipeline stage, TP rank 0); None
        elsewhere."""
        if reference and self.reference is None:
            raise RuntimeError("no reference model: trainer.kl.coef is 0")
        if behaviour and self.behaviour is None:
            raise RuntimeError("no behaviour snapshot: snapshot_behaviour() was never called")
        seqs = batch.sequences
        # the reference serves the KL term only, whose distribution is the whole tempered vocabulary
        dist = kl_distribution(batch.distribution) if reference else batch.distribution
        seq_len = self._seq_len(seqs)
        mbs = self._micro_batches(seqs, list(range(len(seqs))), None, seq_len)

        def loss_fn(mb, output):
            logp, _ = self._token_logprobs(output, mb, dist)
            return output.new_zeros(()), {"index": mb["index"], "logp": logp.float().cpu()}

        from trainer.megatron.routing_replay import RoutingPass

        model = self.reference if reference else self.behaviour if behaviour else None
        out, _ = self._run(mbs, loss_fn, seq_len, forward_only=True, model=model,
                           routing=RoutingPass(replay=self.routing_replay))
        if not self._reporting_rank():
            return None
        result: dict[int, list[float]] = {}
        for d in out:
            for row, i in enumerate(d["index"]):
                if i < 0:  # a placeholder row (_micro_batches)
                    continue
                p, c = len(seqs[i].prompt_ids), len(seqs[i].completion_ids)
                result[i] = d["logp"][row, p - 1:p - 1 + c].tolist()
        return result

    @torch.no_grad()
    def logits(self, token_lists: list[list[int]]) -> list[torch.Tensor] | None:
        """Full-vocabulary logits [len, vocab] per sequence (TP shards gathered); None off the reporting ranks.
        For checking conversions against another implementation."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        seqs = [TrainSequence(t + [0], []) for t in token_lists]  # _micro_batches drops the last token
        seq_len = self._seq_len(seqs)
        mbs = self._micro_batches(seqs, list(range(len(seqs))), None, seq_len, split=False)

        def loss_fn(mb, output):
            full = gather_from_tensor_model_parallel_region(output.float())
            return output.new_zeros(()), {"index": mb["index"], "logits": full.cpu()}

        out, _ = self._run(mbs, loss_fn, seq_len, forward_only=True)
        if not self._reporting_rank():
            return None
        result = {}
        for d in out:
            for row, i in enumerate(d["index"]):
                if i >= 0:
                    result[i] = d["logits"][row, : len(token_lists[i])]
        return [result[i] for i in range(len(token_lists))]

    def publish(self, out_dir: str, node: str, shard_bytes: int, writer_threads: int = 2) -> dict:
        """Convert this rank's weights to HF names and layout and write them as safetensors shards.
        Data-parallel replicas do not write: dense weights come from data-parallel rank 0, experts from
        expert-data-parallel rank 0 of each expert-parallel rank. Rank 0 also copies config and tokenizer.
        Returns {"shards": [ShardRecord], "aux_files": [names]}."""
        from ckpt_transfer.convert import family
        from ckpt_transfer.writer import copy_aux_files, write_shards
        from trainer.megatron.compat import native_torch

        layout = self.layout()
        aux: list[str] = []
        if self.rank == 0:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            aux = copy_aux_files(self.spec.hf_dir, out_dir)
        if not (layout.writes_dense or (self.config.num_moe_experts and layout.writes_experts)):
            return {"shards": [], "aux_files": aux}
        with native_torch():  # views only: no device rewriting needed
            stream = list(family(self.hf_config).megatron_to_hf(self.module.named_parameters(), self.hf_config, layout))
        prefix = f"model-tp{layout.tp_rank:02d}-pp{layout.pp_rank:02d}-ep{layout.ep_rank:02d}"
        records = write_shards(stream, out_dir, node=node, prefix=prefix, shard_bytes=shard_bytes,
                               dtype=self.spec.dtype, threads=writer_threads)
        return {"shards": records, "aux_files": aux}

    # ---- checkpoints ----------------------------------------------------------------------------
    def _layout_record(self) -> dict:
        p = self.spec.trainer.parallel
        return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "moe": bool(self.config.num_moe_experts)}

    def _optimizer_has_state(self) -> bool:
        """Whether Adam holds moments yet: torch creates them at a parameter's first step, so right after a reset
        (the warm start's end) and until the first RL step that takes one there are none."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return any(len(state) > 0 for o in chained for state in o.optimizer.state.values())

    def _sharded_state(self, is_loading: bool, with_rng: bool = True, with_optimizer: bool = True) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        ps = self.ps
        model_sd = self.module.sharded_state_dict()
        rng = {"cpu": torch.get_rng_state()}
        if self.spec.trainer.device == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        rng["tracker"] = get_cuda_rng_tracker().get_states()
        pos = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
               ps.get_expert_model_parallel_rank())
        shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
                 ps.get_expert_model_parallel_world_size())
        state = {"model": model_sd}
        if with_optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
        if self.reference is not None:
            state["reference"] = self.reference.sharded_state_dict(prefix="reference.")
        if with_rng:
            # ranks that share (pp, tp, ep) coordinates hold copies: they form the expert-data-parallel group
            state["rng"] = ShardedObject("rng_state", rng, shape, pos, replica_id=ps.get_expert_data_parallel_rank())
        return state

    def save_checkpoint(self, ckpt_dir: str) -> None:
        from megatron.core import dist_checkpointing

        _write_results_in_process()
        target = Path(ckpt_dir) / "megatron"
        # A checkpoint taken before the optimizer's first step holds no optimizer state (Megatron writes none, and
        # loading would expect moments): recorded, so that a resume keeps its fresh optimizer. Every rank steps
        # together, so they all agree.
        with_optimizer = self._optimizer_has_state()
        if self.rank == 0:
            target.mkdir(parents=True, exist_ok=True)
            (Path(ckpt_dir) / "layout.json").write_text(json.dumps(self._layout_record()
                                                                   | {"optimizer_state": with_optimizer}))
        torch.distributed.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False, with_optimizer=with_optimizer), str(target))
        torch.distributed.barrier()

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """Load model, optimizer and RNG. A dense checkpoint may be loaded into another TP/PP layout
        (Megatron's distributed checkpoint reshards; RNG streams, which are per rank, are then re-seeded)."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        from trainer.megatron.model import LayoutError

        p = self.spec.trainer.parallel
        saved_file = Path(ckpt_dir) / "layout.json"
        saved = json.loads(saved_file.read_text()) if saved_file.exists() else self._layout_record()
        with_optimizer = saved.pop("optimizer_state", True)  # False: saved before any step (see save_checkpoint)
        same_layout = saved == self._layout_record()
        if not same_layout and saved.get("moe"):
            raise LayoutError(
                f"{ckpt_dir} holds a mixture-of-experts checkpoint saved with tp={saved['tp']} pp={saved['pp']} "
                f"ep={saved['ep']}; megatron-core 0.19.2 cannot reshard its optimizer state into tp={p.tp} "
                f"pp={p.pp} ep={p.ep}: resume with the saved trainer.parallel layout")
        state = dist_checkpointing.load(
            self._sharded_state(is_loading=True, with_rng=same_layout, with_optimizer=with_optimizer),
            str(Path(ckpt_dir) / "megatron"))
        self.module.load_state_dict(state["model"])
        if with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.reset_optimizer()  # as it was when saved: no moments, step 0
        if self.reference is not None:
            self.reference.load_state_dict({k.removeprefix("reference."): v for k, v in state["reference"].items()})
        if not same_layout:
            return
        rng = state["rng"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.spec.trainer.device == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        get_cuda_rng_tracker().set_states(rng["tracker"])

    def load_model(self, ckpt_dir: str) -> None:
        """The policy's parameters only (no optimizer, RNG or reference), resharded from whatever layout saved
        them into this rank's: what `tide export` needs."""
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load({"model": self.module.sharded_state_dict()}, str(Path(ckpt_dir) / "megatron"))
        self.module.load_state_dict(state["model"])

    def parameter_digest(self) -> str:
        """sha256 over this rank's parameters (names and bytes): equal digests mean equal weights."""
        h = hashlib.sha256()
        for name, p in sorted(self.module.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def shutdown(self) -> None:
        """Tear down Megatron's parallel state and the process group, so that the process can exit or build
        another worker (orchestrator.trainer_group.RankPool), as Megatron's own tests do between cases."""
        import torch.distributed as dist

        self.ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
