"""Routing replay (trainer.moe.routing_replay) end to end: a vLLM engine records the experts it routed each token
to, and Megatron ranks under expert parallelism 2 replay them: the loss's forward uses exactly the given experts,
the mismatch metric counts what it should, and with the rollout's own routing the log-prob gap shrinks."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.config import MoEConfig, ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow

NUM_EXPERTS, TOP_K, LAYERS = 4, 2, 2
DTYPE = "bfloat16"  # where the engine's and the trainer's kernels round apart enough to route some tokens apart


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from rollout.tasks import AdditionTask
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    spec = TinyModelConfig(family="mixtral", hidden_size=64, num_layers=LAYERS, num_heads=2, num_kv_heads=1,
                           intermediate_size=64, num_experts=NUM_EXPERTS, experts_per_token=TOP_K, init_std=0.1)
    return build_tiny_model(tmp_path_factory.mktemp("moe-replay") / "model", AdditionTask(1).corpus(), spec)


@pytest.fixture(scope="module")
def rollout(worker_pools, moe_dir):
    """Samples of one rollout on the model's initial weights (the engine, in a pooled process, is stopped again)."""
    import ray

    from rollout.config import EngineConfig
    from rollout.tasks import AdditionTask

    cfg = EngineConfig(kv_cache_gb=0.125, enforce_eager=True)
    engine = worker_pools.engines.take()
    try:
        ray.get(engine.start.remote(str(moe_dir), cfg, dtype=DTYPE, deterministic=True), timeout=600)
        problems = AdditionTask(1).problems(0, 1, 16)
        return ray.get(engine.generate.remote(problems, 4, 4, 1.0, 0), timeout=600)
    finally:
        ray.get(engine.stop.remote(), timeout=120)
        worker_pools.engines.give_back(engine)


@pytest.fixture(scope="module")
def ranks(ray_cluster, rank_pool, moe_dir):
    from orchestrator.workers.trainer_group import TrainerGroup

    trainer = TrainerConfig(parallel=ParallelConfig(ep=2), loss="kimi", micro_batch_size=16,
                            moe=MoEConfig(routing_replay="rollout"))
    group = TrainerGroup(TrainerSpec(hf_dir=str(moe_dir), trainer=trainer, dtype=DTYPE), pool=rank_pool)
    try:
        yield group
    finally:
        group.shutdown()


def _batch(samples, shift: int = 0) -> TrainBatch:
    """The samples as the trainer gets them; `shift` renames every routed expert e to e + shift (mod experts),
    a routing no router chose."""
    def routed(s):
        r = s.routed_experts
        return np.where(r >= 0, (r + shift) % NUM_EXPERTS, r).astype(np.int16)

    return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, old_logprobs=s.logprobs, reward=float(k % 2),
                                     group=s.prompt_index, routed_experts=routed(s))
                       for k, s in enumerate(samples)], TokenDistribution())


def test_rollout_records_every_tokens_experts(rollout):
    assert len(rollout) == 64
    for s in rollout:
        r = s.routed_experts
        # every input position of the trainer's forward: the prompt and all completion tokens but the last
        assert r.dtype == np.int16 and r.shape == (len(s.prompt_ids) + len(s.completion_ids) - 1, LAYERS, TOP_K)
        assert r.min() >= 0 and r.max() < NUM_EXPERTS
        assert (np.sort(r, axis=-1)[..., 0] != np.sort(r, axis=-1)[..., 1]).all()  # top-k distinct experts
    # samples of one prompt were prefilled separately (deterministic: no prefix cache) and routed alike
    by_prompt = {}
    for s in rollout:
        by_prompt.setdefault(s.prompt_index, []).append(s.routed_experts[:len(s.prompt_ids)])
    for group in by_prompt.values():
        assert all((np.sort(g, -1) == np.sort(group[0], -1)).all() for g in group)


def test_a_compiled_engine_in_its_own_processes_records_the_routing_transformers_computes(worker_pools, moe_dir):
    """Recording where a cluster runs its engines: the engine core in a child process (engine_process separate),
    the model in two tensor-parallel worker processes and compiled (torch.compile; CUDA graphs on GPUs). In
    float32 every recorded routing is the one the model's own router (transformers) picks for that token,
    position by position. The engine's actor is a pooled process, which may have run inline engines before: its
    engine core must start in a process of its own all the same (vLLM's cached environment reset)."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.config import EngineConfig
    from rollout.tasks import AdditionTask

    cfg = EngineConfig(kv_cache_gb=0.125, enforce_eager=False, engine_process="separate", tp=2,
                       engine_start_timeout_s=600)
    engine = worker_pools.engines.take()
    try:
        engine_pid = ray.get(engine.start.remote(str(moe_dir), cfg, dtype="float32", deterministic=True), timeout=900)
        assert engine_pid != ray.get(engine.process.remote(), timeout=60)[1]  # a child process, not the actor's
        samples = ray.get(engine.generate.remote(AdditionTask(1).problems(0, 1, 8), 2, 4, 1.0, 0), timeout=900)
    finally:
        ray.get(engine.stop.remote(), timeout=120)
        worker_pools.engines.give_back(engine)
    model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    assert len(samples) == 16
    for s in samples:
        ids = list(s.prompt_ids) + list(s.completion_ids[:-1])
        assert s.routed_experts.shape == (len(ids), LAYERS, TOP_K)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
        own = np.stack([layer.topk(TOP_K, dim=-1).indices.numpy() for layer in logits], axis=1)
        assert (np.sort(s.routed_experts, -1) == np.sort(own, -1)).all()


def test_replay_uses_exactly_the_given_experts(rollout, ranks):
    replayed = ranks.logprobs(_batch(rollout))
    renamed = ranks.logprobs(_batch(rollout, shift=1))
    behaviour = [s.logprobs for s in rollout]
    gap = np.mean([abs(a - b) for x, y in zip(replayed, behaviour) for a, b in zip(x, y)])
    gap_renamed = np.mean([abs(a - b) for x, y in zip(renamed, behaviour) for a, b in zip(x, y)])
    assert gap_renamed > 10 * gap  # other experts, other log-probs


def test_metrics_and_gap_under_replay(rollout, ranks):
    # Before any update (the trainer's weights are the engine's): replaying the rollout's routing. Two
    # mini-batches: the replay figures cover the whole batch all the same, before the first update.
    out = ranks.train_step(_batch(rollout), lr=1e-9, updates=2)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in rollout)
    assert out["routed_tokens"] == tokens * LAYERS
    assert out["routing_mismatch_trained"] == 0.0
    assert 0.0 < out["routing_mismatch"] < 0.2  # bf16 routers disagree with vLLM's on a few tokens
    assert out["behaviour_gap_replayed"] < out["behaviour_gap_unreplayed"]
    assert 0 < out["replay_sequences_affected"] < len(rollout)
    assert out["replay_sequences_closer"] > out["replay_sequences_farther"]
    assert out["replay_sequences_closer"] + out["replay_sequences_farther"] <= out["replay_sequences_affected"]
    # the gap check's own figure (the first mini-batch, from the loss's forward) is the replayed pass's
    whole = ranks.train_step(_batch(rollout), lr=1e-9)
    assert whole["behaviour_gap"] == pytest.approx(whole["behaviour_gap_replayed"], rel=1e-6)
    # a routing no router chose: nearly every token's expert set differs from the trainer's own, and the
    # replayed forward used it all the same
    renamed = ranks.train_step(_batch(rollout, shift=1), lr=1e-9)
    assert renamed["routing_mismatch"] > 0.95
    assert renamed["routing_mismatch_trained"] == 0.0
    assert renamed["behaviour_gap"] > 10 * out["behaviour_gap"]
    assert renamed["replay_sequences_affected"] == renamed["replay_sequences_farther"] == len(rollout)



def test_the_loop_records_the_replay_figures_the_train_step_reports():
    """What orchestrator/iteration/loop.py writes to metrics.jsonl from a train step under replay (the figures
    themselves: test_metrics_and_gap_under_replay)."""
    from orchestrator.iteration.loop import TRAIN_METRICS, replay_gaps

    step = {"behaviour_gap_replayed": 1e-3, "behaviour_gap_unreplayed": 2e-3, "replay_sequences_affected": 3,
            "replay_sequences_closer": 2, "replay_sequences_farther": 1, "routing_mismatch": 0.01,
            "routing_mismatch_trained": 0.0, "routed_tokens": 100}
    assert replay_gaps(step) == {"logprob_gap_replayed": 1e-3, "logprob_gap_unreplayed": 2e-3}
    assert replay_gaps({"routing_mismatch": 0.01}) == {}  # no replay: no replay figures
    assert {k for k in step if not k.startswith("behaviour_gap")} <= set(TRAIN_METRICS)


def test_partial_rollouts_replay_their_segments_routing(tmp_path, address, worker_pools):
    """rollout.partial_rollout with replay: a generation continued in later batches is several engine calls,
    whose records merge (rollout/routing_capture.extend_record). With weights that do not move (no warm start:
    every reward and advantage 0), every merged record names the experts the trainer's routers pick, position by
    position, over generations of up to three segments."""
    import json
    import os

    from tests.integration.run_helpers import ROOT, run_here

    run = tmp_path / "run"
    run_here(worker_pools, ROOT / "configs/models/qwen3_moe.yaml", f"ray.address={address}", "iterations=3",
             "save_every=100", "trainer.warmup_sft_steps=0", "trainer.moe.routing_replay=rollout",
             "rollout.max_staleness=2", "rollout.partial_rollout=true", "rollout.partial_rollout_tokens=2",
             "rollout.mismatch_correction=tis", f"publish.shm_root=/dev/shm/tide-test-replay-{os.getpid()}",
             run_dir=run)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["partial_continued"] for m in metrics) > 0
    for m in metrics:
        assert m["routed_tokens"] >= 2 * m["tokens"], m  # at least every trained token's position, both layers
        assert m["routing_mismatch"] == 0.0 and m["routing_mismatch_trained"] == 0.0, m
        assert 0 < m["logprob_gap"] <= 1e-5, m
