"""The rollout engine as a Ray actor on real vLLM: sampling, log-probs against transformers, weight syncs,
refused checkpoints and a killed engine process. One (inline) engine for the session; the tests run in file order
from the base weights, and the module leaves them loaded."""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import ray
from rollout_helpers import WEIGHTS, HFReference, max_abs_diff, perturb, publish_like

from rollout.engine_proc import engine_segments, pids_alive, process_tree
from rollout.tasks import AdditionTask, Problem

pytestmark = pytest.mark.slow
T = 400  # seconds for any call that may start an engine
TOL = 1e-4


def get(ref, timeout: float = T):
    return ray.get(ref, timeout=timeout)


def lps(samples) -> list[list[float]]:
    return [s.logprobs for s in samples]


def ids(samples) -> list[list[int]]:
    return [s.completion_ids for s in samples]


@pytest.fixture(scope="module")
def engine(rollout_engine, tiny_model_dir, tmp_path_factory):
    """The session's engine on the base weights (earlier modules may have loaded others), restored after."""
    base = publish_like(tiny_model_dir, tmp_path_factory.mktemp("base") / "0", 0)
    get(rollout_engine.sync.remote(base, "reload"))
    yield rollout_engine
    get(rollout_engine.sync.remote(base, "reload"))


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    return AdditionTask(1).problems(0, 0, 4)


@pytest.fixture(scope="module")
def long_problem() -> Problem:
    """A prompt longer than one KV block, so that its first block lands in the prefix cache."""
    return Problem("addition", "".join(f"{i}+{i}={2 * i}\n" for i in range(10)) * 3 + "4+4=", "8")


def test_generate_shapes_and_determinism(engine, problems, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    a = get(engine.generate.remote(problems, 3, 12, 1.0, 7))
    assert len(a) == 12 and sorted(a.groups()) == [0, 1, 2, 3]
    for k, s in enumerate(a):
        p = problems[k // 3]
        assert (s.prompt_index, s.task_id, s.answer) == (k // 3, p.task_id, p.answer)
        assert s.prompt_ids == tok(p.prompt)["input_ids"]
        assert 1 <= len(s.completion_ids) == len(s.logprobs) <= 12
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
        if s.finish_reason == "length":
            assert len(s.completion_ids) == 12
        else:
            assert s.completion_ids[-1] == tok.eos_token_id
        assert s.text == tok.decode(s.completion_ids, skip_special_tokens=True)
    b = get(engine.generate.remote(problems, 3, 12, 1.0, 7))
    assert ids(a) == ids(b) and max_abs_diff(lps(a), lps(b)) <= 1e-6
    # Per-request seeds: a sample does not depend on what else is in the batch.
    c = get(engine.generate.remote(problems[:2], 3, 12, 1.0, 7))
    assert ids(c) == ids(a)[:6]
    d = get(engine.generate.remote(problems, 3, 12, 1.0, 8))
    assert ids(d) != ids(a)


def test_logprobs_match_scoring_and_transformers(engine, problems, long_problem, tiny_model_dir):
    s = get(engine.generate.remote([*problems, long_problem], 2, 16, 1.0, 11))
    scored = get(engine.score_sequences.remote([x.prompt_ids for x in s], ids(s)))
    hf = HFReference(tiny_model_dir)
    ref = [hf.logprobs(x.prompt_ids, x.completion_ids) for x in s]
    gap_score, gap_hf = max_abs_diff(lps(s), scored), max_abs_diff(lps(s), ref)
    print(f"log-prob agreement: generate vs score_sequences {gap_score:.2e}, vs transformers {gap_hf:.2e}")
    assert gap_score <= TOL and gap_hf <= TOL
    assert get(engine.score_sequences.remote([[1, 2]], [[]])) == [[]]


@pytest.fixture
def separate_engine(ray_cluster, tiny_model_dir):
    """An engine whose engine core runs in a child process (`engine_process: separate`)."""
    from rollout.config import EngineConfig
    from rollout.engine import RolloutEngine

    cfg = EngineConfig(kv_cache_gb=0.125, max_engine_restarts=2, engine_start_timeout_s=400,
                       engine_process="separate")
    actor = ray.remote(num_cpus=0, max_concurrency=2)(RolloutEngine).remote(str(tiny_model_dir), cfg)
    try:
        yield actor
    finally:
        try:
            get(actor.shutdown.remote(), 120)
        finally:
            ray.kill(actor)


def test_separate_engine_process_killed_mid_generate_is_restarted_on_the_same_weights(separate_engine, engine):
    """The engine process is a child of the actor: the actor starts a new one and the call completes. (An
    inline engine dies with its actor: tests/rollout/test_rollout_group.py.)"""
    args = (AdditionTask(2).problems(0, 5, 24), 4, 48, 1.0, 3)
    reference = get(separate_engine.generate.remote(*args))
    assert ids(reference) == ids(get(engine.generate.remote(*args)))
    engine = separate_engine
    pid = get(engine.engine_pid.remote())
    tree = process_tree(pid)
    segments = engine_segments(tree)
    assert segments, "the engine should hold shared-memory queues"
    # vLLM's ZMQ sockets to the engine core: in the actor's own directory (<tmp>/tide-rollout/<actor pid>-rpc)
    rpc_dir = Path(tempfile.gettempdir()) / "tide-rollout" / f"{psutil.Process(pid).ppid()}-rpc"
    sockets = {p for p in rpc_dir.iterdir() if p.is_socket()}
    assert sockets, f"no sockets of the engine in {rpc_dir}"
    pending = engine.generate.remote(*args)
    deadline = time.monotonic() + 120
    # The actor runs with max_concurrency=2, so info() answers while generate runs.
    while get(engine.info.remote(), 30)["unfinished_requests"] == 0:
        assert time.monotonic() < deadline, "generate never reached the engine"
        assert not ray.wait([pending], timeout=0)[0], "generate finished before the kill: make it longer"
    os.kill(pid, signal.SIGKILL)
    got = get(pending)
    assert ids(got) == ids(reference) and max_abs_diff(lps(got), lps(reference)) <= 1e-5
    info = get(engine.info.remote())
    assert info["engine_pid"] != pid and info["engine_deaths"] >= 1
    assert not pids_alive(tree)
    assert not [p for p in segments if Path(p).exists()], "the dead engine's shared memory was not removed"
    assert not [p for p in sockets if p.exists()], "the dead engine's sockets were not removed"
    assert {p for p in rpc_dir.iterdir() if p.is_socket()}, "the new engine's sockets are elsewhere"
    get(engine.shutdown.remote())
    assert not rpc_dir.exists(), "the engine's socket directory outlived its shutdown"


def test_damaged_or_unloadable_checkpoint_is_refused_and_old_weights_keep_serving(engine, problems, tiny_model_dir,
                                                                                  tmp_path):
    before = get(engine.generate.remote(problems, 2, 8, 1.0, 5))
    serving = get(engine.info.remote())["iteration"]

    missing = publish_like(tiny_model_dir, tmp_path / "1", 1, perturb(1, 0.05))
    (Path(missing.directory) / WEIGHTS).unlink()
    corrupt = publish_like(tiny_model_dir, tmp_path / "2", 2, perturb(1, 0.05))
    data = bytearray((Path(corrupt.directory) / WEIGHTS).read_bytes())
    data[-64] ^= 0xFF
    (Path(corrupt.directory) / WEIGHTS).write_bytes(bytes(data))
    for manifest, reason in [(missing, "is missing"), (corrupt, "checksum")]:
        for mode in ("reload", "restart"):
            with pytest.raises(ray.exceptions.RayTaskError) as err:
                get(engine.sync.remote(manifest, mode))
            assert reason in str(err.value) and "still serving" in str(err.value)

    # Files match the manifest, but a matrix has the wrong shape for the running model: refused before vLLM
    # sees it (a failed reload_weights leaves vLLM unable to reload again until restarted).
    def wrong_shape(name, t):
        return t[:, :-1] if name.endswith("layers.0.mlp.down_proj.weight") else t

    unloadable = publish_like(tiny_model_dir, tmp_path / "3", 3, wrong_shape)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        get(engine.sync.remote(unloadable, "reload"))
    assert "cannot be loaded in place" in str(err.value) and "layers.0.mlp.down_proj.weight" in str(err.value)

    after = get(engine.generate.remote(problems, 2, 8, 1.0, 5))
    assert ids(after) == ids(before) and max_abs_diff(lps(after), lps(before)) <= 1e-5
    assert get(engine.info.remote())["iteration"] == serving


def _check_serves(engine, manifest, probe: list[Problem]) -> list:
    s = get(engine.generate.remote(probe, 2, 16, 1.0, 21))
    hf = HFReference(manifest.directory)
    gap = max_abs_diff(lps(s), [hf.logprobs(x.prompt_ids, x.completion_ids) for x in s])
    scored = get(engine.score_sequences.remote([x.prompt_ids for x in s], ids(s)))
    print(f"iteration {manifest.iteration}: engine vs transformers {gap:.2e}, score {max_abs_diff(lps(s), scored):.2e}")
    assert gap <= TOL and max_abs_diff(lps(s), scored) <= TOL
    return s


def test_reload_swaps_weights_in_place_and_resets_the_prefix_cache(engine, problems, long_problem, tiny_model_dir,
                                                                    tmp_path):
    info = get(engine.info.remote())
    probe = [long_problem, *problems[:2]]
    before = get(engine.generate.remote(probe, 2, 16, 1.0, 21))  # leaves the long prompt's KV in the cache
    assert len(before.items[0].prompt_ids) > info["block_size"]
    m = publish_like(tiny_model_dir, tmp_path / "1", 1, perturb(1, 0.05))
    t = get(engine.sync.remote(m, "reload"))
    print(f"reload: {t}")
    assert t["mode"] == "reload" and t["iteration"] == 1 and t["bytes"] == m.nbytes
    after = _check_serves(engine, m, probe)
    assert max_abs_diff(lps(after)[:1], lps(before)[:1]) > 1e-2 or ids(after) != ids(before)
    info2 = get(engine.info.remote())
    assert info2["engine_pid"] == info["engine_pid"] and info2["iteration"] == 1


def test_restart_starts_a_new_engine_on_the_new_weights(engine, problems, long_problem, tiny_model_dir, tmp_path):
    """The session's engine is inline: the new engine starts in the same process (after vLLM's teardown of
    the old one there)."""
    info = get(engine.info.remote())
    m = publish_like(tiny_model_dir, tmp_path / "2", 2, perturb(2, 0.05))
    t = get(engine.sync.remote(m, "restart"))
    print(f"restart: {t}")
    assert t["mode"] == "restart" and t["iteration"] == 2
    after = get(engine.info.remote())
    assert after["starts"] == info["starts"] + 1 and after["engine_pid"] == info["engine_pid"]
    _check_serves(engine, m, [long_problem, *problems[:2]])
