"""Routing replay's pieces without engines: the rollout records' bookkeeping (rollout/routing_capture.py), the
Megatron router slot (trainer/megatron/routing_replay.py) and the start-up refusal on a dense model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rollout import routing_capture
from trainer.megatron import routing_replay
from trainer.megatron.routing_replay import ReplaySlot, RoutingPass


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_slot_replays_given_rows_and_counts_against_its_own_choice():
    scores = torch.tensor([[4.0, 3.0, 1.0, 0.0], [0.0, 1.0, 3.0, 4.0], [4.0, 0.0, 3.0, 1.0]])
    slot = ReplaySlot(layer=0)
    # row 0 as the router would route it, row 1 otherwise, row 2 not given (-1)
    slot.target_topk_idx = torch.tensor([[1, 0], [0, 1], [-1, -1]])
    slot.replay, slot.counts = True, torch.zeros(3, dtype=torch.long)
    probs, used = slot.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert used.tolist() == [[1, 0], [0, 1], [0, 2]]
    assert probs.tolist() == [[3.0, 4.0], [0.0, 1.0], [4.0, 3.0]]  # the router's own scores at those experts
    assert slot.counts.tolist() == [2, 1, 0]  # given, the router's choice differs, the used experts differ
    slot.replay, slot.counts = False, torch.zeros(3, dtype=torch.long)
    _, used = slot.get_replay_topk(scores, 2, default_compute_topk=_topk)
    assert sorted(used[1].tolist()) == [2, 3]
    assert slot.counts.tolist() == [2, 1, 1]


def test_micro_batch_layout_is_megatrons_sequence_major_rows():
    rec = np.arange(3 * 2 * 2, dtype=np.int16).reshape(3, 2, 2)  # 3 positions, 2 layers, top-2
    routing = routing_replay.micro_batch_routing([rec, None], [3, 2], seq_len=4)
    assert routing.shape == (2, 4, 2, 2)
    assert (routing[1] == -1).all() and (routing[0, 3] == -1).all()  # no record; padding
    slots = [ReplaySlot(layer=1)]
    routing_replay.set_targets(slots, routing, RoutingPass(replay=True))
    rows = slots[0].target_topk_idx  # [s * b, k]: position 0 of both sequences, then position 1, ...
    assert rows[0].tolist() == rec[0, 1].tolist() and rows[1].tolist() == [-1, -1]
    assert rows[2].tolist() == rec[1, 1].tolist()
    assert routing_replay.take_counts(slots).tolist() == [0, 0, 0] and slots[0].target_topk_idx is None


def test_request_records_follow_vllm_request_ids():
    a, b = np.zeros((2, 1, 1), np.int16), np.ones((2, 1, 1), np.int16)
    assert set(routing_capture.request_records({"0_7-1a2b3c4d": a, "1_7-1a2b3c4d": b}, 2)) == {("7", 0), ("7", 1)}
    assert set(routing_capture.request_records({"7-1a2b3c4d": a}, 1)) == {("7", 0)}


def test_cached_prompt_positions_take_a_siblings_routing():
    full = np.array([[[1, 2]], [[2, 3]], [[0, 1]]], dtype=np.int16)
    cached = full.copy()
    cached[:2] = routing_capture.NOT_RECORDED  # its prompt's block came from the prefix cache
    cached[2] = [[3, 0]]
    routing_capture.fill_shared_prefix([full, cached], prompt_len=2)
    assert cached[:2].tolist() == full[:2].tolist() and cached[2].tolist() == [[3, 0]]


def test_a_trajectorys_turns_merge_keeping_each_positions_first_routing():
    X = routing_capture.NOT_RECORDED

    def rec(*rows):  # one layer, top-1
        return np.array(rows, dtype=np.int16).reshape(-1, 1, 1)

    turn1 = rec(0, 1, 2)  # prompt of 2 + 2 sampled tokens: positions 0-2
    # the second call's prompt is the trajectory so far plus an inserted reply; positions 0-1 came from the prefix
    # cache (not computed: X), 2 was computed again and routed apart (bf16), 3-5 are new
    turn2 = rec(X, X, 3, 1, 0, 3)
    merged = routing_capture.extend_record(routing_capture.extend_record(None, turn1), turn2)
    assert merged[:, 0, 0].tolist() == [0, 1, 2, 1, 0, 3]
    assert routing_capture.extend_record(turn2, turn1)[:, 0, 0].tolist() == [0, 1, 3, 1, 0, 3]  # never shorter
    assert routing_capture.fit_record(merged, 4)[:, 0, 0].tolist() == [0, 1, 2, 1]
    assert routing_capture.fit_record(merged, 8)[:, 0, 0].tolist() == [0, 1, 2, 1, 0, 3, X, X]
    assert routing_capture.fit_record(None, 3) is None


def test_records_cross_the_engine_process_boundary_unchanged():
    rec = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2) - 1
    back = routing_capture.from_wire(routing_capture.to_wire({"req-1": rec}))["req-1"]
    assert back.dtype == np.int16 and (back == rec).all()
    back[0, 0, 0] = 7  # fill_shared_prefix writes into the records


def test_recording_refuses_a_model_runner_it_cannot_read():
    """vLLM's V2 runner (GPUs) lays batches out otherwise: the engine fails at start naming the switch, not with
    misfiled records or an AttributeError at the first step."""
    from types import SimpleNamespace

    from rollout import routing_worker

    class ModelRunnerV2:
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(is_moe=True))

    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER.*rollout.record_routing false"):
        routing_worker.install(SimpleNamespace(model_runner=ModelRunnerV2()))


def test_engines_of_moe_models_load_through_the_recorder_and_the_v1_runner(tmp_path, tiny_model_dir):
    from rollout.config import EngineConfig
    from rollout.engine import routing_capture_setup

    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text('{"model_type": "qwen3_moe", "num_experts": 4}')
    kwargs, env = routing_capture_setup(EngineConfig(), moe)
    assert kwargs == {"worker_extension_cls": "rollout.routing_worker.RoutingCaptureExtension",
                      "load_format": routing_capture.LOAD_FORMAT}
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # wherever vLLM would pick V2
    assert routing_capture_setup(EngineConfig(record_routing=False), moe) == ({}, {})
    assert routing_capture_setup(EngineConfig(), tiny_model_dir) == ({}, {})  # dense: vLLM's own loader and runner


def test_routing_replay_on_a_dense_model_is_a_config_error(tiny_model_dir):
    from orchestrator.config.schema import ConfigError
    from orchestrator.workers.trainer_group import check_routing_replay
    from trainer.config import MoEConfig, TrainerConfig, TrainerSpec

    spec = TrainerSpec(hf_dir=str(tiny_model_dir), trainer=TrainerConfig(moe=MoEConfig(routing_replay="rollout")))
    with pytest.raises(ConfigError, match="routing_replay: rollout needs a mixture-of-experts model"):
        check_routing_replay(spec)
    check_routing_replay(TrainerSpec(hf_dir=str(tiny_model_dir)))  # none: nothing to check
