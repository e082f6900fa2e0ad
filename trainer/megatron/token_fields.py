"""A micro-batch's per-token fields: what the loss reads at each input position, one row per sequence."""
from __future__ import annotations

import torch

from trainer.batch import TrainSequence


def positions(s: TrainSequence) -> int:
    """Input positions of a sequence: position t predicts token t + 1."""
    return len(s.prompt_ids) + len(s.completion_ids) - 1


def per_token_rows(rows: list[TrainSequence], real: list[bool], width: int) -> dict[str, torch.Tensor]:
    """The per-token fields the loss reads, one row of `width` positions per sequence (a placeholder's: zeros),
    each completion's values from the position that predicts its first token (len(prompt) - 1) on."""
    def field(get) -> torch.Tensor:
        out = []
        for s, r in zip(rows, real):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            values = (get(s) or [0.0] * c) if r else [0.0] * c
            out.append([0.0] * (p - 1) + list(values) + [0.0] * (width - p + 1 - c))
        return torch.tensor(out, dtype=torch.float32)

    from trainer.megatron.routing_replay import micro_batch_routing

    return dict(mask=field(lambda s: s.trained_mask), old=field(lambda s: s.old_logprobs),
                ref=field(lambda s: s.ref_logprobs), rollout=field(lambda s: s.rollout_logprobs),
                is_weight=field(lambda s: s.is_weights), versions=field(lambda s: s.versions),
                routing=micro_batch_routing([s.routed_experts if r else None for s, r in zip(rows, real)],
                                            [positions(s) for s in rows], width))
