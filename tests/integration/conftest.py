"""Fixtures shared by the integration tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def address(ray_cluster) -> str:
    """The test session's Ray cluster, for `ray.address` in the configs the tests run through the CLI."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def engine(rollout_engine, tiny_model_dir, tmp_path_factory):
    """The session's engine actor, for a module that restarts it onto models of its own (`sync(manifest,
    "restart")`, any family): ~5 s a restart, where a new engine actor costs 20-30 s here (importing vLLM in a new
    process). Restarted back onto the session's tiny model when the module ends."""
    import ray

    from tests.rollout.rollout_helpers import publish_like

    yield rollout_engine
    base = publish_like(tiny_model_dir, tmp_path_factory.mktemp("restore") / "0", 0, run="restore")
    ray.get(rollout_engine.sync.remote(base, "restart"), timeout=600)
