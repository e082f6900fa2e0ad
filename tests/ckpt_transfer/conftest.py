"""Fixtures for the checkpoint-transfer tests: safetensors shards in a private /dev/shm tree, source nodes
as subprocesses (`python -m ckpt_transfer.node_agent serve`)."""
from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from ckpt_helpers import SourceNode, make_iteration

from ckpt_transfer.manifest import Manifest


@pytest.fixture(scope="session")
def shm_base() -> Iterator[Path]:
    base = Path("/dev/shm") / f"tide_test_ckpt_{os.getpid()}"
    base.mkdir(parents=True)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def tmp_shm(shm_base: Path) -> Path:
    d = shm_base / uuid.uuid4().hex[:8]
    d.mkdir()
    return d


@pytest.fixture(scope="session")
def make_iteration_fn() -> Callable[..., Manifest]:
    return make_iteration


@pytest.fixture
def start_source() -> Iterator[Callable[..., SourceNode]]:
    started: list[SourceNode] = []

    def start(*args, **kwargs) -> SourceNode:
        s = SourceNode(*args, **kwargs)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# `ray_cluster` (one local cluster per test session) comes from tests/conftest.py.
