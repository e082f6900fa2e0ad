"""GPU placement on a Ray cluster (the session cluster declares 4 GPUs, none real): the trainer's ranks on one
node, engine k and rollout node agent k in the same bundle, the source agent beside the trainer, and a layout
the cluster cannot hold refused by name instead of waiting forever."""
import pytest

from orchestrator.workers import placement as placement_module
from orchestrator.workers.placement import Placement, split_cpus
from rollout.config import RolloutConfig
from trainer.config import ParallelConfig, TrainerConfig

GPU_TRAINER = TrainerConfig(device="cuda", backend="nccl", parallel=ParallelConfig(dp=2))


def test_cpu_runs_reserve_and_pin_nothing(ray_cluster):
    p = Placement.reserve(TrainerConfig(), RolloutConfig(engines=2))
    assert p.trainer is None and p.engines is None
    assert p.trainer_rank(0) == {} and p.engine(1) == {} and p.agents(2, ["any"]).sinks == []


def test_gpu_bundles_hold_ranks_engines_and_their_agents(ray_cluster):
    import ray

    class Where:  # defined here: Ray ships it by value (the test module is not importable in its workers)
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), ray.get_gpu_ids(), ctx.get_placement_group_id()

    p = Placement.reserve(GPU_TRAINER, RolloutConfig(device="cuda", engines=2, tp=1))
    try:
        actor = ray.remote(Where)
        ranks = [actor.options(num_gpus=1, num_cpus=0, **p.trainer_rank(i)).remote() for i in range(2)]
        engines = [actor.options(num_gpus=1, num_cpus=0, **p.engine(k)).remote() for k in range(2)]
        rank_at = ray.get([r.where.remote() for r in ranks], timeout=60)
        engine_at = ray.get([e.where.remote() for e in engines], timeout=60)
        gpus = [g for _, ids, _ in rank_at + engine_at for g in ids]
        assert len(gpus) == 4 and len(set(gpus)) == 4  # each its own GPU
        assert {pg for *_, pg in rank_at} == {p.trainer.id.hex()}
        assert {pg for *_, pg in engine_at} == {p.engines.id.hex()}
        agents = p.agents(2, [rank_at[0][0]])
        sinks = [actor.options(num_cpus=0, **agents.sink(k)).remote() for k in range(2)]
        source = actor.options(num_cpus=0, **agents.source(0)).remote()
        for k, (node, _, pg) in enumerate(ray.get([s.where.remote() for s in sinks], timeout=60)):
            assert (node, pg) == (engine_at[k][0], p.engines.id.hex())
        assert ray.get(source.where.remote(), timeout=60)[0] == rank_at[0][0]
        for a in ranks + engines + sinks + [source]:
            ray.kill(a)
    finally:
        p.release()


def test_colocated_engines_share_the_trainer_ranks_gpus(ray_cluster):
    """The hybrid deployment: no GPU reserved for the engines; engine k and its node agent run in the bundle of
    trainer rank k x tp, asking Ray for no GPU, and its vLLM sees exactly the GPUs of ranks k x tp .. (k+1) x tp - 1;
    an engine's GPUs on several nodes, or more engine GPUs than ranks, are refused by name."""
    import os

    import ray

    class Where:
        def where(self):
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), ray.get_gpu_ids(), ctx.get_placement_group_id(), \
                os.environ.get("CUDA_VISIBLE_DEVICES")

    trainer = TrainerConfig(device="cuda", backend="nccl", parallel=ParallelConfig(dp=4))
    p = Placement.reserve(trainer, RolloutConfig(device="cuda", engines=2, tp=2), "colocated")
    try:
        assert p.shares_gpus and p.engines is None
        actor = ray.remote(Where)
        ranks = [actor.options(num_gpus=1, num_cpus=0, **p.trainer_rank(i)).remote() for i in range(4)]
        rank_at = ray.get([r.where.remote() for r in ranks], timeout=60)
        gpus = [[str(g) for g in ids] for _, ids, _, _ in rank_at]
        with pytest.raises(RuntimeError, match="call Placement.colocate"):
            p.engine(0)
        with pytest.raises(ValueError, match=r"3 engine\(s\) of rollout.tp 2 need 6 GPUs, the trainer's ranks hold 4"):
            p.colocate(["n"] * 4, gpus, engines=3)
        with pytest.raises(ValueError, match="engine 1's GPUs .* lie on several nodes"):
            p.colocate(["a", "a", "b", "c"], gpus, engines=2)
        p.colocate(["a"] * 4, gpus, engines=2)
        engines = [actor.options(num_cpus=0, **{k: v for k, v in p.engine(k).items()}).remote() for k in range(2)]
        for k, (node, ids, pg, visible) in enumerate(ray.get([e.where.remote() for e in engines], timeout=60)):
            assert ids == [] and pg == p.trainer.id.hex() and node == rank_at[2 * k][0]
            assert visible == ",".join(gpus[2 * k] + gpus[2 * k + 1])
        sinks = p.agents(2, [rank_at[0][0]]).sinks
        assert [s["scheduling_strategy"].placement_group_bundle_index for s in sinks] == [0, 2]
        for a in ranks + engines:
            ray.kill(a)
    finally:
        p.release()


def test_a_layout_the_cluster_cannot_hold_is_refused_by_name(ray_cluster, monkeypatch):
    monkeypatch.setattr(placement_module, "PLACEMENT_TIMEOUT_S", 2)
    with pytest.raises(RuntimeError, match=r"no room for 3 rollout engine\(s\) of 2 GPU\(s\) each .*free GPUs per "
                                           r"node: \{.*: 2\.0\}"):
        Placement.reserve(GPU_TRAINER, RolloutConfig(device="cuda", engines=3, tp=2))
    # what was reserved before the refusal is released: the whole cluster is free again
    p = Placement.reserve(TrainerConfig(device="cuda", backend="nccl", parallel=ParallelConfig(dp=4)),
                          RolloutConfig())
    p.release()


def test_disaggregated_cpu_runs_split_the_cores_between_engines_and_ranks():
    rollout = RolloutConfig()
    assert split_cpus([0, 1], None, rollout) == ((0,), (1,))
    assert split_cpus([2, 3, 5, 7, 8], None, rollout) == ((2, 3), (5, 7, 8))  # half, rounded down, to the engines
    assert split_cpus(list(range(8)), 6, rollout) == ((0, 1, 2, 3, 4, 5), (6, 7))
    with pytest.raises(ValueError, match="needs 2 cores or more; this host has 1"):
        split_cpus([0], None, rollout)
    with pytest.raises(ValueError, match="placement.rollout_cpus must be 1 to 3, not 4"):
        split_cpus([0, 1, 2, 3], 4, rollout)
    with pytest.raises(ValueError, match="rollout.tp 2 workers need a core each"):
        split_cpus([0, 1, 2, 3], 1, RolloutConfig(tp=2))
    p = Placement(engine_cpus=(0, 1, 2, 3), trainer_cpus=(4, 5), tp=2)
    assert p.engine_env({"A": "1"}) == {"A": "1", "VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"}
    assert Placement().engine_env({"A": "1"}) == {"A": "1"}  # colocated: the engines' default binding
    colocated = Placement.reserve(TrainerConfig(), RolloutConfig())
    assert colocated.engine_cpus is colocated.trainer_cpus is None
