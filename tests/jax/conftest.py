"""Fixtures for the JAX engine tests.

XLA_FLAGS=--xla_force_host_platform_device_count=2 gives this process two CPU devices for the
multi-device tests; it only works if set before jax is first imported, hence at the top of this file.
Compiles are slow on this machine, so programs are compiled once per session (session-scoped fixtures)
and the persistent compilation cache in .cache/jax is enabled.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache():
    from trainer.jax.engine import enable_compilation_cache

    enable_compilation_cache(".cache/jax")
