"""Issue 61 item 3, memory for long sequences, on a one-rank trainer built in this process: Megatron's activation
recompute (trainer.recompute), the routing a recomputed MoE forward replays, and log-probs computed from the
final hidden states by chunks of positions (trainer.logprob_chunk)."""
from __future__ import annotations

import random
import socket
from contextlib import contextmanager

import pytest
import torch

from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.config import TrainerConfig, TrainerSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def one_rank(model_dir, **trainer):
    """A MegatronRank of world size 1 in this process (torch.distributed and Megatron's parallel state torn down
    after)."""
    from trainer.megatron.rank import MegatronRank

    rank = MegatronRank(TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(**trainer)), 0, 1, "127.0.0.1",
                        _free_port())
    try:
        yield rank
    finally:
        rank.shutdown()


def _batch(seed: int = 0, lengths=(3, 7, 4, 9), dist: TokenDistribution = TokenDistribution()) -> TrainBatch:
    rng = random.Random(seed)
    seqs = [TrainSequence([rng.randrange(3, 120) for _ in range(5)], [rng.randrange(3, 120) for _ in range(n)],
                          old_logprobs=[-4.0] * n, reward=float(k % 2), group=k // 2)
            for k, n in enumerate(lengths)]
    return TrainBatch(seqs, distribution=dist)


def _step(rank, batch: TrainBatch) -> tuple[dict, dict[str, torch.Tensor]]:
    """One optimizer step: its statistics and the gradients it applied (Megatron's main_grad buffers keep them
    until the next step zeroes them)."""
    from trainer.megatron.train_step import train_step

    out = train_step(rank, batch, lr=1e-3)
    return out, {name: p.main_grad.clone() for name, p in rank.module.named_parameters()}


def test_recompute_keeps_the_loss_and_gradients(tiny_model_dir, monkeypatch):
    """trainer.recompute selective (core attention) and full (each layer) give today's loss and gradients: the
    recomputation replays the same arithmetic. Each recomputes in the backward pass (counted: 2 layers x 2
    micro-batches), none does not."""
    from megatron.core.tensor_parallel import random as mp_random

    recomputed, megatrons = [], mp_random.CheckpointFunction

    class Counting(megatrons):
        @staticmethod
        def backward(ctx, *grads):
            recomputed.append(1)
            return megatrons.backward(ctx, *grads)

    monkeypatch.setattr(mp_random, "CheckpointFunction", Counting)
    results = {}
    for mode in ("none", "selective", "full"):
        recomputed.clear()
        with one_rank(tiny_model_dir, recompute=mode, micro_batch_size=2) as rank:
            results[mode] = _step(rank, _batch())
        assert len(recomputed) == (0 if mode == "none" else 4), mode
    (stats, grads) = results["none"]
    assert stats["grad_norm"] > 0
    for mode in ("selective", "full"):
        assert results[mode][0]["loss"] == pytest.approx(stats["loss"], rel=1e-6, abs=1e-9), mode
        assert results[mode][0]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-6), mode
        for name, g in grads.items():
            torch.testing.assert_close(results[mode][1][name], g, rtol=1e-6, atol=1e-9, msg=f"{mode} {name}")


def test_a_recomputed_forward_routes_as_its_micro_batch_did():
    """Under full recompute a MoE layer's forward runs again in the backward pass, after later micro-batches' forwards
    set their own routing (a pipeline's 1F1B schedule: forward 1, forward 2, backward 1, ...). The slot replays the
    experts each checkpointed forward used, in forward order; the gradient reaches the router's scores at those
    experts only."""
    from megatron.core import tensor_parallel

    from trainer.megatron.routing_replay import ReplaySlot, RoutingPass, set_targets, take_counts

    def topk(scores, k, num_groups=None, group_topk=None):
        return torch.topk(scores, k=k, dim=1)

    slot = ReplaySlot(layer=0)
    # one layer, 2 positions, top-1 of 4 experts; micro-batch a routes to experts 0 and 1, b to 2 and 3
    routing = {"a": torch.tensor([[[[0]]], [[[1]]]]), "b": torch.tensor([[[[2]]], [[[3]]]])}
    scores = {k: torch.randn(2, 4, requires_grad=True) for k in routing}
    outputs = {}
    for mb in ("a", "b"):
        set_targets([slot], routing[mb].transpose(0, 1), RoutingPass(replay=True))
        outputs[mb] = tensor_parallel.checkpoint(
            lambda s: slot.get_replay_topk(s, 1, default_compute_topk=topk)[0], False, scores[mb])
    for mb in ("a", "b"):  # backward in forward order, b's routing still set
        outputs[mb].sum().backward()
        experts = scores[mb].grad.nonzero()[:, 1].tolist()
        assert experts == routing[mb].flatten().tolist(), mb
    assert slot.checkpointed == []
    take_counts([slot])


@pytest.mark.parametrize("dist", [TokenDistribution(temperature=0.7),
                                  TokenDistribution(temperature=0.7, top_k=40, top_p=0.9)],
                         ids=["tempered", "truncated"])
def test_chunked_logprobs_equal_the_whole_micro_batchs(tiny_model_dir, monkeypatch, dist):
    """trainer.logprob_chunk 5 (rows of 13 positions: each cut into 3 chunks, one across a row's end) gives the
    per-token log-probs, the loss, the entropy bonus and every parameter's gradient of the logits of the whole
    micro-batch at once (null), under a tempered and a truncated (top-k, top-p) distribution."""
    from trainer.megatron import logprobs as lp
    from trainer.megatron.scoring import logprobs

    chunked_calls = []
    original = lp.chunked_logprobs
    monkeypatch.setattr(lp, "chunked_logprobs", lambda *a: chunked_calls.append(1) or original(*a))
    results = {}
    for chunk in (None, 5):
        with one_rank(tiny_model_dir, logprob_chunk=chunk, micro_batch_size=2, entropy_coef=0.01) as rank:
            batch = _batch(dist=dist)
            results[chunk] = (logprobs(rank, batch), *_step(rank, batch))
        assert bool(chunked_calls) == (chunk is not None)
    (scored, stats, grads), (scored_c, stats_c, grads_c) = results[None], results[5]
    for i, row in scored.items():
        assert scored_c[i] == pytest.approx(row, rel=1e-6, abs=1e-6), i
    for key in ("loss", "entropy", "logp_mean", "grad_norm"):
        assert stats_c[key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), key
    for name, g in grads.items():
        torch.testing.assert_close(grads_c[name], g, rtol=1e-5, atol=1e-7, msg=name)
