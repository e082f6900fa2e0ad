"""Routing replay on the trainer side (trainer.moe.routing_replay): the Megatron routers of a model route each
token to the experts the rollout engine routed it to, and every forward can count how often the router's own
choice differs from the rollout's.

Built on megatron-core's RouterReplay, the hook every TopKRouter passes to topk_routing_with_score_function: each
router gets a slot of its own here, addressed by its global layer number, so a pipeline stage's routers, the
policy's and the frozen reference's are told apart (RouterReplay's class-wide list would mix them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

# Per router and forward: routings the rollout gave, of those the ones the router's own top-k set differs from,
# and the ones whose experts the forward used differ from the rollout's (0 when replayed).
COUNTS = ("given", "differs", "used_differs")


class ReplaySlot(RouterReplay):
    def __init__(self, layer: int) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.layer = layer  # index of the hidden layer in the rollout's records (layer_number - 1)
        self.replay = False
        self.counts: torch.Tensor | None = None
        # (target, replay) of each forward run inside an activation checkpoint (trainer.recompute full), oldest
        # first: its recomputation in the backward pass routes as it did. Megatron's schedules run a micro-batch's
        # backward after its forward, in forward order (also 1F1B), when set_targets may already hold a later
        # micro-batch's routing; Megatron's own RouterReplay keeps such a queue (replay_backward_list).
        self.checkpointed: list[tuple[torch.Tensor | None, bool]] = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        from megatron.core.tensor_parallel.random import is_checkpointing

        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        # a checkpoint's first forward runs without grad, its recomputation in the backward pass with
        recomputed = is_checkpointing() and torch.is_grad_enabled()
        if recomputed:
            target, replay = self.checkpointed.pop(0)
        else:
            target, replay = self.target_topk_idx, self.replay
            if is_checkpointing():
                self.checkpointed.append((target, replay))
        if target is None:
            return probs, own
        target = target.to(scores.device)
        given = target[:, 0] >= 0  # -1: the rollout did not route this token (padding, unrecorded)
        used = own
        if replay:
            # R3, Rollout Routing Replay ("Stabilizing MoE Reinforcement Learning by Aligning Training and
            # Inference Routers", Ma et al. 2025, arXiv 2510.11370): the experts are the rollout's, the gate
            # weights the trainer's own scores at those experts, so the router still gets its gradient.
            used = torch.where(given.unsqueeze(1), target, own)
            probs = scores.gather(1, used)
        if self.counts is not None and not recomputed:  # counted once, in the forward
            def differs(idx):
                return ((idx.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & given).sum()

            self.counts += torch.stack([given.sum(), differs(own), differs(used)]).to(self.counts)
        return probs, used


@dataclass
class RoutingPass:
    """How one forward uses the rollout's routing: `replay` it, `measure` the mismatch counts."""

    replay: bool = False
    measure: bool = False


def attach(module: torch.nn.Module) -> list[ReplaySlot]:
    """A replay slot on each of the module's top-k routers (none for a dense model)."""
    from megatron.core.transformer.moe.router import TopKRouter

    slots = []
    for m in module.modules():
        if isinstance(m, TopKRouter):
            if m.config.moe_router_fusion:
                raise ValueError("routing replay needs the unfused top-k router (moe_router_fusion off)")
            m.router_replay = ReplaySlot(m.layer_number - 1)
            slots.append(m.router_replay)
    return slots


def set_targets(slots: list[ReplaySlot], routing: torch.Tensor | None, how: RoutingPass) -> None:
    """Hand one micro-batch's rollout routing [b, s, layers, top_k] (-1: none) to the routers. Megatron routes
    activations [s, b, h] flattened to s * b rows, sequence position major."""
    for slot in slots:
        if routing is None:
            slot.target_topk_idx, slot.replay, slot.counts = None, False, None
            continue
        layer = routing[:, :, slot.layer]
        slot.target_topk_idx = layer.transpose(0, 1).reshape(-1, layer.shape[-1]).long()
        slot.replay = how.replay
        if how.measure and slot.counts is None:
            slot.counts = torch.zeros(len(COUNTS), dtype=torch.long)
        elif not how.measure:
            slot.counts = None


def take_counts(slots: list[ReplaySlot]) -> torch.Tensor:
    """The counts measured since the last take, summed over this rank's routers; the slots stop measuring and
    forget their checkpointed routings (rank.run takes them once its schedule, every backward included, is done)."""
    total = torch.zeros(len(COUNTS), dtype=torch.long)
    for slot in slots:
        if slot.counts is not None:
            total += slot.counts
        # a forward-only pass under checkpoints (the model in training mode) leaves its routings unconsumed
        slot.counts, slot.target_topk_idx, slot.checkpointed = None, None, []
    return total


def micro_batch_routing(records: list, lengths: list[int], seq_len: int) -> torch.Tensor | None:
    """[b, seq_len, layers, top_k] int16 of one micro-batch's sequences from their rollout records (position t:
    the token at t, as the model's input), -1 where a sequence has none; None if no sequence has a record."""
    present = [r for r in records if r is not None]
    if not present:
        return None
    layers, top_k = present[0].shape[1:]
    out = torch.full((len(records), seq_len, layers, top_k), -1, dtype=torch.int16)
    for row, (rec, n) in enumerate(zip(records, lengths)):
        if rec is None:
            continue
        if tuple(rec.shape[1:]) != (layers, top_k):
            raise ValueError(f"routing records of shapes {tuple(rec.shape[1:])} and {(layers, top_k)} in one batch")
        n = min(n, rec.shape[0], seq_len)
        out[row, :n] = torch.from_numpy(rec[:n].astype("int16", copy=False))
    return out
