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

from trainer.jax.config import JaxConfig  # noqa: E402

# Tiny settings: a few seconds of compile, well under a second per chunk.
TINY = dict(env="CartPole-v1", num_envs=4, num_steps=16, updates_per_iteration=2, epochs=2, minibatches=2,
            hidden_sizes=[16, 16])


def tiny(**overrides) -> JaxConfig:
    return JaxConfig(**{**TINY, **overrides})


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache():
    from trainer.jax.engine import enable_compilation_cache

    enable_compilation_cache(".cache/jax")
