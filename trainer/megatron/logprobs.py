"""Token log-probs and entropy from the last pipeline stage's logits [b, s, V / tp], this rank's shard of the
vocabulary: under the rollout's sampling distribution (trainer/sampling.py), without gathering the vocabulary
where the distribution does not truncate it."""
from __future__ import annotations

from typing import Callable, Literal

import torch

from trainer.batch import TokenDistribution
from trainer.megatron.packing import unpack
from trainer.sampling import entropy, entropy_from_partials, entropy_partials, processed_logits

EntropyMode = Literal["no", "metric", "grad"]
ENTROPY_CHUNK = 1024  # positions per piece of the entropy metric


def token_logprobs(output: torch.Tensor, mb: dict, dist: TokenDistribution,
                   with_entropy: EntropyMode = "no") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The labels' log-probs [b, s] of micro-batch `mb` under `dist` (tempered and, when the rollout truncated,
    truncated over the whole vocabulary), differentiable, and the entropy of `dist` at each position [b, s]
    (`metric`: without gradient, `grad`: differentiable, `no`: None). A packed micro-batch's come as one row per
    sequence (packing.unpack)."""
    from megatron.core import parallel_state as ps, tensor_parallel as tpl

    labels = mb["labels"].to(output.device)
    if dist.truncates or ps.get_tensor_model_parallel_world_size() == 1:
        z = processed_logits(tpl.gather_from_tensor_model_parallel_region(output), labels, dist)
        logp = z.log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return unpack(logp, mb), unpack(position_entropy(z, with_entropy, entropy), mb)
    z = output.float() / dist.temperature
    ent = position_entropy(z, with_entropy, vocab_parallel_entropy)
    # Megatron's vocab-parallel cross entropy shifts and exponentiates its input in place: it gets a copy
    # where the entropy's backward still needs z
    logp = -tpl.vocab_parallel_cross_entropy(z.clone() if with_entropy == "grad" else z, labels)
    return unpack(logp, mb), unpack(ent, mb)


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
