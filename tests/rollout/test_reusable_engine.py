"""A rollout engine's process reused for the next engine (rollout/reusable_engine.py) starts it from the process's
own environment: what the last engine set (a config's extra_env, vLLM's variables) is gone, and vLLM's cache of the
environment, which its engine core turns on once started (vllm.envs.enable_envs_cache), is off again, so that the
next engine's settings (an inline or a separate engine process, say) are read afresh."""
from __future__ import annotations

import os

import pytest


def test_the_next_engine_starts_from_the_processs_own_environment(monkeypatch):
    from vllm import envs

    from rollout.engine import RolloutEngine
    from rollout.reusable_engine import ReusableEngine

    seen = []

    def start_engine(self, model_dir, cfg, **kwargs):  # what RolloutEngine's start leaves behind in the process
        seen.append((os.environ.get("TIDE_TEST_LAST_ENGINE"), envs._is_envs_cache_enabled()))
        os.environ["TIDE_TEST_LAST_ENGINE"] = str(model_dir)
        envs.enable_envs_cache()
        self._vllm, self._closed = object(), False

    monkeypatch.setattr(RolloutEngine, "__init__", start_engine)
    monkeypatch.setattr(RolloutEngine, "engine_pid", lambda self: 1)
    monkeypatch.setattr(RolloutEngine, "shutdown", lambda self, process_ends=False: setattr(self, "_closed", True))
    engine = ReusableEngine()
    try:
        assert engine.start("first", None) == 1
        with pytest.raises(RuntimeError, match="runs an engine already"):
            engine.start("second", None)
        engine.stop()
        engine.start("second", None)
        assert seen == [(None, False), (None, False)]
    finally:
        envs.disable_envs_cache()
        os.environ.pop("TIDE_TEST_LAST_ENGINE", None)
