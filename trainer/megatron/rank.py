"""One Megatron-core trainer rank's state and forward pass: the process group and Megatron's parallel state, this
rank's stage of the model (initialised from the HF checkpoint), its optimizer, the frozen copies (the reference of
trainer.kl, the behaviour snapshot), their routing-replay slots, and Megatron's forward(-backward) schedule over
micro-batches. What the orchestrator calls on it is trainer/megatron/worker.py."""
from __future__ import annotations

import os
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from trainer.batch import TrainSequence
from trainer.config import TrainerSpec
from trainer.megatron.micro_batches import MicroBatcher
from trainer.megatron.packing import packed_seq_params

if TYPE_CHECKING:
    from trainer.megatron.routing_replay import RoutingPass

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _natively(loss_fn, mb, output):
    """A loss function (tide's: trainer/megatron/train_step.py, scoring.py) without the CPU device-rewriting mode
    (compat.native_torch): it names no device but its tensors' own, and the mode's dispatch of its many small ops
    was ~5% of a tiny model's train step."""
    from trainer.megatron.compat import native_torch

    with native_torch():
        return loss_fn(mb, output)


class MegatronRank:
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
        from trainer.megatron import lora, routing_replay

        # with adapters the reference is the base itself, the adapters off (no second copy of the weights)
        self.reference = None if t.kl.coef == 0 else lora.AdaptersOff(self.module) if t.lora else \
            self._frozen_copy()
        self.behaviour = None  # snapshot_behaviour's copy, made on first use
        self.routers = routing_replay.attach(self.module)
        self._reference_routers = [] if self.reference is None else self.routers if t.lora else \
            routing_replay.attach(self.reference)
        self._behaviour_routers: list = []
        self.routing_replay = t.moe.routing_replay == "rollout"
        if self.routing_replay and not self.routers:
            raise ValueError("trainer.moe.routing_replay: rollout needs a mixture-of-experts model")

    # ---- construction -----------------------------------------------------------------------
    def _build(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        from trainer.megatron.model import transformer_config

        s, t = self.spec, self.spec.trainer
        self.config = transformer_config(self.hf_config, tp=t.parallel.tp, pp=t.parallel.pp, ep=t.parallel.ep,
                                         dtype=self.dtype, deterministic=s.deterministic, recompute=t.recompute)
        # micro-batches cut by a token budget (padded to their own longest, or packed) differ in shape: pipeline
        # stages then send each activation's shape before it (Megatron's variable_seq_lengths)
        self.config.variable_seq_lengths = t.parallel.pp > 1 and t.micro_batch_tokens is not None
        module = self._new_module()
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=t.uses_distributed_optimizer)
        self.model = DistributedDataParallel(self.config, ddp_config, module)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model.no_sync
        self.batcher = MicroBatcher(
            rows=t.micro_batch_size, token_budget=t.micro_batch_tokens, packed=t.packing,
            # sequence parallelism splits the positions over the tensor-parallel ranks
            position_parts=self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1)

    def _new_module(self):
        """This rank's stage of the GPT model, on the trainer's device."""
        from trainer.megatron.model import build_gpt

        module = build_gpt(self.hf_config, self.config, pre_process=self.ps.is_pipeline_first_stage(),
                           post_process=self.ps.is_pipeline_last_stage(), attention=self.spec.trainer.attention)
        if self.dtype != torch.float32:
            # What Megatron's Float16Module does (without renaming every parameter `module.*`): the norms too,
            # so every parameter gets an fp32 main copy in the mixed-precision optimizer. Inputs are token
            # ids, and log-probs are computed in fp32 from the half-precision logits (as vLLM's sampler does).
            module = module.to(self.dtype)
        if self.spec.trainer.lora is not None:  # before DDP: the adapters are the parameters it reduces
            from trainer.megatron import lora

            lora.attach(module, self.hf_config, self.layout(module), self.spec.trainer.lora, self.spec.seed)
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
        if self.reference is not None and self.spec.trainer.lora is None:  # with adapters: always the base
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

        from trainer.megatron.lora import is_adapter_parameter

        params = {n: p for n, p in self.module.named_parameters() if not is_adapter_parameter(n)}
        state = family(self.hf_config).hf_to_megatron(get, params.keys(), self.hf_config, self.layout())
        with torch.no_grad():
            for name, p in params.items():
                src = state[name]
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: HF gives shape {tuple(src.shape)}, Megatron expects {tuple(p.shape)}")
                p.copy_(src.to(p.dtype))

    def reset_optimizer(self) -> None:
        """A fresh Adam (no moments, step 0) over the current parameters."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = self.spec.trainer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.lr, weight_decay=t.weight_decay,
                            clip_grad=t.grad_clip, params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16,
                            fp16=self.dtype == torch.float16,
                            use_distributed_optimizer=t.uses_distributed_optimizer),
            [self.model],
        )
        from trainer.megatron.compat import native_torch_steps

        native_torch_steps(self.optimizer)

    @property
    def module(self):
        return self.model.module

    def layout(self, module=None):
        """Where this rank sits (of `module`, this rank's stage, before it is wrapped: the policy's)."""
        from ckpt_transfer.convert import RankLayout

        ps = self.ps
        layers = (module or self.module).decoder.layers
        return RankLayout(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=ps.get_pipeline_model_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ps.get_expert_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(), expert_dp_rank=ps.get_expert_data_parallel_rank(),
            layer_map={i: layer.layer_number - 1 for i, layer in enumerate(layers)},
            dp_size=ps.get_data_parallel_world_size(),
            expert_dp_size=ps.get_expert_data_parallel_world_size() if self.config.num_moe_experts else 1,
        )

    # ---- forward passes -----------------------------------------------------------------------
    def micro_batches(self, seqs: list[TrainSequence], chunk: list[int], adv: torch.Tensor | None, seq_len: int,
                      split: bool = True) -> list[dict]:
        """This rank's micro-batches of `chunk` (its data-parallel share when `split`; micro_batches.py)."""
        dp, r = (self.ps.get_data_parallel_world_size(), self.ps.get_data_parallel_rank()) if split else (1, 0)
        return self.batcher.micro_batches(seqs, chunk, adv, seq_len, dp, r)

    def seq_len(self, seqs: list[TrainSequence]) -> int:
        return self.batcher.seq_len(seqs)

    def run(self, mbs: list[dict], loss_fn, seq_len: int, forward_only: bool, model=None,
            routing: RoutingPass | None = None) -> tuple[list[dict], torch.Tensor]:
        """Megatron's forward(-backward) schedule over the micro-batches; `loss_fn(mb, output)` on the last
        stage, with output the logits [b, s, V / tp] or, with trainer.logprob_chunk, a logprobs.FinalHidden.
        `model`: the policy (None), the reference or the behaviour snapshot. `routing`: how the forward uses the
        micro-batches' rollout routing. Returns the loss_fn outputs and this rank's routing counts
        (routing_replay.COUNTS; zeros unless measured)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from trainer.megatron import routing_replay
        from trainer.megatron.compat import native_torch
        from trainer.megatron.logprobs import FinalHidden

        routing = routing or routing_replay.RoutingPass()
        device = "cuda" if self.spec.trainer.device == "cuda" else "cpu"
        routers = (self.routers if model is None else self._reference_routers if model is self.reference
                   else self._behaviour_routers)
        uses_routing = routing.replay or routing.measure
        # trainer.logprob_chunk: the last stage returns its final hidden states, turned into logits by chunks
        chunk = self.spec.trainer.logprob_chunk
        head = FinalHidden.processor(chunk) if chunk else None

        def forward_step(data_iter: Iterator[dict], model):
            mb = next(data_iter)
            # the targets set here serve this micro-batch's forward; a recomputed forward (trainer.recompute
            # full, under a pipeline's 1F1B too) takes the routing its checkpointed forward queued (ReplaySlot)
            routing_replay.set_targets(routers, mb["routing"] if uses_routing else None, routing)
            with native_torch():  # the model's forward names no device of its own
                out = model(mb["tokens"].to(device), mb["position_ids"].to(device), attention_mask=None,
                            packed_seq_params=packed_seq_params(mb, device), output_processor=head)
            return out, partial(_natively, loss_fn, mb)

        try:
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(mbs), model=[model or self.model],
                num_microbatches=len(mbs), seq_length=seq_len,
                micro_batch_size=max(m["tokens"].shape[0] for m in mbs),  # a packed micro-batch is one row
                forward_only=forward_only,
            )
        finally:
            counts = routing_replay.take_counts(routers)
        return out, counts

    def reporting_rank(self) -> bool:
        """Whether this rank holds results: the last pipeline stage's tensor-parallel rank 0."""
        ps = self.ps
        return ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0

    def sum_over_dp_on_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.ps.is_pipeline_last_stage() and self.ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return t

    def shutdown(self) -> None:
        """Tear down Megatron's parallel state and the process group, so that the process can exit or build
        another worker (the orchestrator's RankPool), as Megatron's own tests do between cases."""
        import torch.distributed as dist

        self.ps.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
