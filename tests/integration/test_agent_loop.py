"""Multi-turn agents in the RL loop, configs/guess.yaml's run (through the Python API, on the session's pooled ranks
and engines): trajectories of
several turns are sampled by vLLM, scored by the environment and trained on by Megatron with the environment's
replies masked out; the trainer's log-probs of the sampled tokens match the engine's, the metrics and logs say
what the agent did, and a run killed after a checkpoint resumes to the uninterrupted run's exact end."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.integration.run_helpers import ROOT, assert_ends_as, resume_cut_back, run_here

pytestmark = pytest.mark.slow


def _guess_config(tmp: Path, address: str) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "guess.yaml").read_text())
    cfg.update(iterations=3, save_every=2, keep_checkpoints=3, ray={"address": address},
               eval={"every": 3, "prompts": 4, "n_samples": 2})
    # the loop, not the learning: a smaller model and shorter games than the shipped config's, a warm start
    # enough to end turns on their own (EOS) and so play several
    cfg["model"]["tiny"].update(hidden_size=64, num_layers=2, intermediate_size=128, max_position_embeddings=320)
    cfg["agent"].update(max_turns=6, max_total_tokens=256)
    cfg["trainer"].update(warmup_sft_steps=12, warmup_sft_batch=32, warmup_sft_lr=1e-2, lr=1e-3)
    cfg["rollout"].update(prompts_per_iteration=8, n_samples=4, probe_every=3)
    cfg["publish"]["shm_root"] = f"/dev/shm/tide-test-agent-{os.getpid()}"
    path = tmp / "guess.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_guessing_game_trains_on_multi_turn_trajectories_and_resumes_exactly(tmp_path, address, worker_pools):
    run = tmp_path / "run"
    run_here(worker_pools, _guess_config(tmp_path, address), run_dir=run)
    metrics = _jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    # the gap over the sampled tokens only (the environment's replies carry no behaviour log-prob): float32 engine
    # and trainer ~1e-7 apart, as in single-turn runs; a reply trained on as if sampled would read ~1
    assert 0 < metrics[-1]["probe_gap_agent"] <= 1e-5
    for m in metrics:
        assert 0 < m["logprob_gap"] <= 1e-5, m
        assert m["samples"] == 32 and 1 < m["turns/mean"] <= 6 and m["turns/max"] <= 6
        assert 0 < m["masked_token_share"] < 1 and 0 <= m["env/solved"] <= 1
        assert m["tokens"] < m["completion_len"] * m["samples"]  # the trainer counted the model's tokens only
    assert any(m["env/solved"] > 0 for m in metrics)
    # the eval phase measures the agent beside the single completion (one guess, no feedback) on held-out games
    assert 0 <= metrics[-1]["eval/agent_reward_mean"] <= 1 and 1 <= metrics[-1]["eval/agent_turns_mean"] <= 6
    assert 0 <= metrics[-1]["eval/pass@1"] <= 1
    rollouts = [t for t in _jsonl(run / "timings.jsonl") if t["phase"] == "rollout"]
    assert len(rollouts) == 3 and all(set(t["parts"]) == {"generate", "tools"} for t in rollouts)
    assert all(t["parts"]["generate"] + t["parts"]["tools"] <= t["seconds"] for t in rollouts)
    logged = _jsonl(run / "samples.jsonl")
    assert logged and all(r["completion"].startswith("assistant: ") for r in logged)
    assert any("\nuser: " in r["completion"] for r in logged)  # the environment's replies between the turns

    # killed during iteration 3, after its checkpoint of iteration 2: the resumed run ends as the whole one did
    resume_cut_back(run, tmp_path / "killed", 2, pools=worker_pools)
    assert_ends_as(tmp_path / "killed", run, files=("metrics.jsonl",), final_key=None)


def test_partial_multi_turn_trajectories_span_versions_within_the_bound_and_resume_exactly(tmp_path, address,
                                                                                          worker_pools):
    """rollout.partial_rollout with `agent:`: a game is set aside at the end of the turn that reaches 8 sampled tokens
    (two turns) after the environment's reply, and continued in the next batch's sampling under newer weights, for
    at most max_staleness 2 samplings; every batch's tokens match the policy that sampled them, no token is more than
    2 updates old when trained (2 reached), every game is trained once, and a run resumed from its iteration-2
    checkpoint (which holds the batch drawn ahead and the games it set aside, environments' state included) ends with
    the uninterrupted run's metrics, samples and parameters."""
    path = _guess_config(tmp_path, address)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(iterations=4, eval={"every": 0})
    cfg["rollout"].update(max_staleness=2, partial_rollout=True, partial_rollout_tokens=8, mismatch_correction="tis",
                          probe_every=0)
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    run_here(worker_pools, path, run_dir=run)
    metrics = _jsonl(run / "metrics.jsonl")
    assert all(0 < m["logprob_gap"] <= 1e-5 and m["stale_masked_tokens"] == 0 for m in metrics), metrics
    assert max(m["staleness_token_max"] for m in metrics) == 2 and all(m["staleness_token_max"] <= 2 for m in metrics)
    assert any(m["partial_share"] > 0 and m["partial_continued"] > 0 for m in metrics)
    assert metrics[-1]["partial_groups_set_aside"] == 0  # the last iteration ends every game
    assert sum(m["samples"] for m in metrics) == 4 * 8 * 4  # every game opened is trained once
    assert all(0 < m["masked_token_share"] < 1 for m in metrics)

    assert (run / "checkpoints" / "iter_0000002" / "drawn_ahead.pkl").is_file()
    resume_cut_back(run, tmp_path / "resumed", 2, pools=worker_pools)
    assert_ends_as(tmp_path / "resumed", run, final_key=None)


def test_mixture_of_experts_agent_replays_each_turns_routing(tmp_path, address, worker_pools):
    """trainer.moe.routing_replay with `agent:`: a trajectory's turns are separate engine calls, whose routing
    records merge into one per trajectory (rollout/routing_capture.extend_record). In float32 the trainer's own
    routers agree with the engine's on every token, so every merged record names, position by position, the
    experts Megatron picks there: mismatch 0 over all the recorded routings (a record off by one position, or a
    turn's record laid over the wrong positions, reads far above 0)."""
    path = _guess_config(tmp_path, address)
    cfg = yaml.safe_load(path.read_text())
    cfg.update(iterations=2, eval={"every": 0})
    cfg["model"]["tiny"].update(family="qwen3_moe", num_experts=4, experts_per_token=2, intermediate_size=64)
    cfg["rollout"].update(sync_mode="restart", probe_every=0)
    cfg["trainer"]["moe"] = {"routing_replay": "rollout"}
    path.write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    run_here(worker_pools, path, run_dir=run)
    for m in _jsonl(run / "metrics.jsonl"):
        assert m["turns/mean"] > 1, m
        # every position up to a trajectory's last sampled token was computed by some turn's call and recorded;
        # at least the sampled tokens' positions, in both MoE layers
        assert m["routed_tokens"] >= 2 * m["tokens"], m
        assert m["routing_mismatch"] == 0.0 and m["routing_mismatch_trained"] == 0.0, m
        assert 0 < m["logprob_gap"] <= 1e-5, m
