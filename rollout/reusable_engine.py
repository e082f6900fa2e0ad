"""A rollout engine's process kept between engines: `ReusableEngine` is a `RolloutEngine` started and stopped by
calls (`start`, `stop`) instead of by the actor's life, for a process that drives many runs one after another (the
test suite, a sweep, a benchmark's repeats: orchestrator/workers/pools.py). Most of an engine's start on CPU is its
process importing vLLM (~8 of ~10 CPU-s here); a reused process pays it once. What one engine changed in the
process is put back before the next starts: the environment (vLLM's, and a config's extra_env), the cores its
threads were bound to, and vLLM's cache of its environment variables."""
from __future__ import annotations

import os
from typing import Any

from .engine import RolloutEngine
from .engine_proc import pin_threads


class ReusableEngine(RolloutEngine):
    """No engine until `start`; `stop` tears it down (vLLM's own in-process teardown, as a restart does) and keeps
    the process, imports and all, for the next `start`."""

    def __init__(self) -> None:  # noqa: D107  (the engine's arguments come with `start`)
        self._environ = dict(os.environ)
        self._any_cpu = os.sched_getaffinity(0)
        self._closed = True
        self._vllm: Any = None

    def start(self, model_dir: str, cfg, **kwargs) -> int:
        """Start an engine as `RolloutEngine(model_dir, cfg, **kwargs)` would; its engine process's pid."""
        if not self._closed:
            raise RuntimeError("this process runs an engine already: stop() it first")
        os.environ.clear()
        os.environ.update(self._environ)
        pin_threads(self._any_cpu)  # the last engine's cores (placement.mode disaggregated) are not this one's
        if self._vllm is not None:
            # vLLM froze the last engine's environment when its engine core started (enable_envs_cache); its
            # in-process teardown unfreezes it (cleanup_dist_env_and_memory), which a teardown that failed half-way
            # may not have reached
            from vllm import envs

            envs.disable_envs_cache()
        RolloutEngine.__init__(self, model_dir, cfg, **kwargs)
        return self.engine_pid()

    def stop(self) -> None:
        """Stop the engine, its processes and what it left in shared memory; the process stays."""
        if self._vllm is not None:
            self.shutdown(process_ends=False)

    def engine_pid(self) -> int:
        if self._vllm is None:
            from .engine_errors import EngineError

            raise EngineError("engine is not running (not started)")
        return super().engine_pid()
