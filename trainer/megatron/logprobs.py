"""Token log-probs and entropy of the last pipeline stage's output under the rollout's sampling distribution
(trainer/sampling.py), without gathering the vocabulary where the distribution does not truncate it. The output is
either the logits [b, s, V / tp] (this rank's shard of the vocabulary), or, with trainer.logprob_chunk, the final
hidden states with the output layer (`FinalHidden`), turned into logits one chunk of positions at a time so that
the [positions, V / tp] float32 tensors exist for one chunk only, in the forward and in the backward pass."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from trainer.batch import TokenDistribution
from trainer.megatron.packing import unpack
from trainer.sampling import entropy, entropy_from_partials, entropy_partials, processed_logits

EntropyMode = Literal["no", "metric", "grad"]
ENTROPY_CHUNK = 1024  # positions per piece of the entropy metric


@dataclass
class FinalHidden:
    """What the last stage's GPTModel returns through its `output_processor` hook (megatron-core 0.19) when the
    log-probs are chunked: the final hidden states [s, b, h] (this rank's positions under sequence parallelism),
    the output layer (a ColumnParallelLinear), the weight it is given (the embedding's, when tied) and the model's
    logit scaling."""

    hidden: torch.Tensor
    layer: torch.nn.Module
    weight: torch.Tensor | None
    scale: Callable[[torch.Tensor], torch.Tensor]
    chunk: int

    @classmethod
    def processor(cls, chunk: int) -> Callable[..., "FinalHidden"]:
        def make(*, hidden_states, output_layer, output_weight, scale_logits, **_ignored) -> FinalHidden:
            return cls(hidden_states, output_layer, output_weight, scale_logits, chunk)

        return make

    def inputs(self) -> torch.Tensor:
        """The output layer's input [b, s, h] over every position of the micro-batch, through the tensor-parallel
        region its own forward would apply to each call (ColumnParallelLinear): under sequence parallelism the
        all-gather of the positions (backward: reduce-scatter), else the identity whose backward all-reduces the
        input's gradient over the vocabulary shards."""
        from megatron.core import tensor_parallel as tpl

        from megatron.core.utils import get_pg_size

        x, group = self.hidden, self.layer.tp_group
        if self.layer.sequence_parallel:
            x = tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
        elif get_pg_size(group) > 1:
            x = tpl.copy_to_tensor_model_parallel_region(x, group=group)
        return x.transpose(0, 1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., V / tp] of inputs `x` [..., h] (from `inputs`): the output layer's matmul without its
        communication, which `inputs` did once for all chunks."""
        weight = self.layer.weight if self.weight is None else self.weight
        out = torch.matmul(x, weight.t())
        if self.layer.bias is not None and not self.layer.skip_bias_add:
            out = out + self.layer.bias
        return self.scale(out)


def full_logits(output: torch.Tensor | FinalHidden) -> torch.Tensor:
    """The logits [b, s, V / tp] of the whole micro-batch, whichever the model returned."""
    return output.logits(output.inputs()) if isinstance(output, FinalHidden) else output


def token_logprobs(output: torch.Tensor | FinalHidden, mb: dict, dist: TokenDistribution,
                   with_entropy: EntropyMode = "no") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The labels' log-probs [b, s] of micro-batch `mb` under `dist` (tempered and, when the rollout truncated,
    truncated over the whole vocabulary), differentiable, and the entropy of `dist` at each position [b, s]
    (`metric`: without gradient, `grad`: differentiable, `no`: None). A packed micro-batch's come as one row per
    sequence (packing.unpack)."""
    device = output.hidden.device if isinstance(output, FinalHidden) else output.device
    labels = mb["labels"].to(device)
    if isinstance(output, FinalHidden):
        logp, ent = chunked_logprobs(output, labels, dist, with_entropy)
    else:
        logp, ent = logits_logprobs(output, labels, dist, with_entropy)
    return unpack(logp, mb), unpack(ent, mb)


def chunked_logprobs(output: FinalHidden, labels: torch.Tensor, dist: TokenDistribution,
                     with_entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logits_logprobs` over `output.chunk` positions at a time, each chunk's logits computed from the hidden
    states and, where a gradient is needed, recomputed in the backward pass instead of kept (an activation
    checkpoint per chunk): Liger Kernel's fused linear cross entropy (Hsu et al. 2024, arXiv 2410.10989, section
    3.1) chunks the output layer and the loss so, and Megatron's own linear_cross_entropy fusion does for its
    language-model loss. Values and gradients are the unchunked ones; the output weight's gradient is summed over
    the chunks."""
    from torch.utils.checkpoint import checkpoint

    x = output.inputs()
    shape = labels.shape
    rows, flat_labels = x.reshape(-1, x.shape[-1]), labels.reshape(-1)

    def piece(xc: torch.Tensor, lc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return logits_logprobs(output.logits(xc), lc, dist, with_entropy)

    def run(xc: torch.Tensor, lc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not torch.is_grad_enabled():
            return piece(xc, lc)
        return checkpoint(piece, xc, lc, use_reentrant=False, preserve_rng_state=False)

    parts = [run(xc, lc) for xc, lc in zip(rows.split(output.chunk), flat_labels.split(output.chunk))]
    logp = torch.cat([p[0] for p in parts]).reshape(shape)
    ent = None if with_entropy == "no" else torch.cat([p[1] for p in parts]).reshape(shape)
    return logp, ent


def logits_logprobs(logits: torch.Tensor, labels: torch.Tensor, dist: TokenDistribution,
                    with_entropy: EntropyMode) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The labels' log-probs and the entropies [...] from `logits` [..., V / tp] and `labels` [...]."""
    from megatron.core import parallel_state as ps, tensor_parallel as tpl

    if dist.truncates or ps.get_tensor_model_parallel_world_size() == 1:
        z = processed_logits(tpl.gather_from_tensor_model_parallel_region(logits), labels, dist)
        logp = z.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return logp, position_entropy(z, with_entropy, entropy)
    z = logits.float() / dist.temperature
    ent = position_entropy(z, with_entropy, vocab_parallel_entropy)
    # Megatron's vocab-parallel cross entropy shifts and exponentiates its input in place: it gets a copy
    # where the entropy's backward still needs z
    logp = -tpl.vocab_parallel_cross_entropy(z.clone() if with_entropy == "grad" else z, labels)
    return logp, ent


def position_entropy(z: torch.Tensor, mode: EntropyMode,
                     fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """`fn(z)` per position. As a metric it runs without gradient on ENTROPY_CHUNK positions at a time: its
    temporaries are vocabulary-wide (a 150k vocabulary makes each 0.6 GB per 1k positions in float32)."""
    if mode == "no":
        return None
    if mode == "grad":
        return fn(z)
    with torch.no_grad():
        rows = z.detach().reshape(-1, z.shape[-1])
        return torch.cat([fn(chunk) for chunk in rows.split(ENTROPY_CHUNK)]).reshape(z.shape[:-1])


def vocab_parallel_entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) over the vocabulary split across the TP ranks, without gathering it: each rank's
    partial sums are all-reduced (backward: each rank's own shard's gradient, as Megatron's vocab-parallel cross
    entropy does)."""
    import torch.distributed as torch_dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    m = z.detach().max(dim=-1).values
    torch_dist.all_reduce(m, op=torch_dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    s, t = entropy_partials(z, m)
    return entropy_from_partials(m, reduce_from_tensor_model_parallel_region(s),
                                 reduce_from_tensor_model_parallel_region(t))
