"""Fixtures shared by the integration tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def address(ray_cluster) -> str:
    """The test session's Ray cluster, for `ray.address` in the configs the tests run through the CLI."""
    import ray

    return ray.get_runtime_context().gcs_address
