"""In-flight weight updates (PipelineRL, Piche et al. 2025, arXiv:2509.19128): weights published while an engine
generates are loaded between two of its decode steps instead of after the generate call. No request is aborted:
the running generations' KV is recomputed under the new weights (vLLM's `reset_prefix_cache(
reset_running_requests=True)` preempts them, and they are prefilled again), so every token after the switch is
sampled from exactly the new policy, and each token keeps the version that sampled it (vLLM's own weight-version
spans). PipelineRL keeps the stale KV instead; tide recomputes it so that the trainer's log-probs of each token,
under the version that sampled it, are the engine's (the gap check holds token by token).

`InFlight` says what a generate call expects (sent with the call); `WeightSlot` hands the weights from the thread
that serves the engine's `sync` to the engine thread that runs the generate, `generate_in_flight`, one engine step
at a time, takes them between two steps."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ckpt_transfer.manifest import Manifest

from .engine_errors import EngineError


@dataclass(frozen=True)
class InFlight:
    """A generate call that takes the weights of `to_version` when they are published while it runs.
    `from_version`: the version the engine serves when the call starts; `at_step`: the decode step (engine steps
    since the call began) at which the switch happens, waiting up to `wait_s` for the weights if they are not
    published yet, so that which version sampled which token is fixed by the config; None: as soon as they are
    published (between the next two steps)."""

    from_version: int
    to_version: int
    at_step: int | None = None
    wait_s: float = 900.0

    def __post_init__(self) -> None:
        if self.to_version <= self.from_version:
            raise ValueError(f"in-flight switch from version {self.from_version} to {self.to_version}: not newer")
        if self.at_step is not None and self.at_step < 1:
            raise ValueError(f"in-flight switch at step {self.at_step}: the first is 1 (after the first step)")


@dataclass(frozen=True)
class Offered:
    """Verified weights of `version` (published as `manifest`, to load from `path`, with the tensors of `layout`)
    for the running generate to load."""

    version: int
    path: Path
    manifest: Manifest
    layout: dict


class WeightSlot:
    """One generate call's slot: `offer` (the sync's thread) posts weights and waits until the engine thread has
    loaded them (`take` between two steps, then `loaded`); an offer the call can no longer take (it ended, or
    expects another version) is refused, and the sync loads them as usual. `release` stops a wait for weights
    that will not come (the run is stopping)."""

    def __init__(self, switch: InFlight) -> None:
        self.switch = switch
        self._cond = threading.Condition()
        self._open, self._released = True, False
        self._offered: Offered | None = None
        self._result: BaseException | float | None = None  # seconds of the load, or what it raised

    def offer(self, weights: Offered, timeout_s: float) -> float | None:
        """Seconds the engine thread took to load `weights` between two steps; None when the call will not take
        them. Raises what the load raised."""
        with self._cond:
            if not self._open or self._offered is not None or weights.version != self.switch.to_version:
                return None
            self._offered = weights
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._result is not None or not self._open, timeout_s):
                raise TimeoutError(f"the engine did not take version {weights.version} within {timeout_s:g} s")
            if self._result is None:  # closed first: the call ended before its next step
                self._offered = None
                return None
            if isinstance(self._result, BaseException):
                raise self._result
            return self._result

    def take(self, wait: bool) -> Offered | None:
        """The offered weights, if any; with `wait`, blocks until they are offered (or released, or the
        switch's wait_s ran out: TimeoutError)."""
        with self._cond:
            if wait:
                if not self._cond.wait_for(lambda: self._offered is not None or self._released,
                                           self.switch.wait_s):
                    raise TimeoutError(f"the weights of version {self.switch.to_version} were not published within "
                                       f"{self.switch.wait_s:g} s of decode step {self.switch.at_step}")
            return self._offered

    def loaded(self, outcome: BaseException | float) -> None:
        with self._cond:
            self._result = outcome
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._released = True
            self._cond.notify_all()

    def close(self) -> None:
        """The call ended: an offer not taken is refused."""
        with self._cond:
            self._open = False
            self._cond.notify_all()


def token_versions(spans, n_tokens: int, default: int) -> list[int]:
    """Per token, the policy version that sampled it, from vLLM's weight-version spans of a completion (labels
    are the versions as strings; None: no label, every token by `default`)."""
    if not spans:
        return [default] * n_tokens
    out = [int(span.version) for span in spans for _ in range(span.start, span.end)]
    if len(out) != n_tokens:
        raise ValueError(f"weight-version spans cover {len(out)} tokens of {n_tokens}")
    return out


def generate_in_flight(llm: Any, prompts: list, params: list, slot: WeightSlot, first: int,
                       switch_weights: Callable[[Offered], None], serving: Callable[[], bool]) -> list:
    """LLM.generate's loop, one engine step at a time, taking `switch.to_version`'s weights between two steps when
    a sync offers them (at `switch.at_step`, waiting for them) with `switch_weights`. The outputs in request order;
    `first`: the version that samples the first tokens; vLLM labels every token with the version set when it was
    sampled (its weight-version spans). `serving`: whether the engine that runs the call still serves (a call
    that fails on it leaves nothing behind for the next one)."""
    engine = llm.llm_engine
    core = getattr(engine.engine_core, "engine_core", None)  # the in-process EngineCore (engine_process inline)
    if core is None or core.batch_queue is not None:
        raise EngineError("in-flight weight updates need engine_process inline without vLLM's batch queue "
                          "(async scheduling or pipeline parallelism): a step must end before the weights change")
    switch = slot.switch
    engine.set_weight_version(str(first))
    pending = first < switch.to_version  # an engine started again on the new weights has nothing to take
    if not pending:
        slot.close()
    request_ids = llm.enqueue(prompts, params, use_tqdm=False)
    outputs, step = [], 0
    try:
        while engine.has_unfinished_requests():
            # at_step: at that step exactly (waiting for the weights); else whenever they are offered
            due = pending and (switch.at_step is None or step >= switch.at_step)
            if due:
                offered = slot.take(wait=switch.at_step is not None)
                if offered is not None:
                    switch_weights(offered)
                if offered is not None or switch.at_step is not None:  # taken, or released: no more waiting
                    slot.close()
                    pending = False
            outputs += [out for out in engine.step() if out.finished]
            step += 1
    except BaseException:
        if serving():  # nothing of this call is left for the next one
            engine.abort_request(request_ids, internal=True)  # enqueue's ids are vLLM's internal ones
        raise
    finally:
        slot.close()
    return sorted(outputs, key=lambda out: int(out.request_id))
