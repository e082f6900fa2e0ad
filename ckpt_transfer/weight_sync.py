"""The one door between the orchestrator and weight hand-over, shaped like checkpoint-engine's: trainer ranks
write an iteration into `staging_dir`, `publish` announces it, `pull` makes it available to every rollout
engine, `verify` checks a copy before an engine loads it, `gc` collects old iterations and `close` removes
what the run left in shared memory.

Two implementations: `SharedMemorySync`, where engines read the publish directory itself (one machine, one
shared memory), and `MooncakeSync`, where each rollout node has its own node agent and shared-memory root
and pulls every iteration from the trainer node's agent through the Mooncake transfer engine, looking the
shards up in the shard registry (a detached named Ray actor)."""
from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from .config import PublishConfig, WeightTransferConfig
from .gc import gc_iterations, iteration_dir
from .manifest import Manifest
from .owners import claim, sweep_dead_runs
from .verify import engine_checkpoint_dir, verify_manifest


@dataclass
class Delivery:
    """An iteration made available to the engines: the manifest each engine loads (a copy on its own node),
    and what moving it cost."""

    manifests: list[Manifest]
    bytes: int = 0
    seconds: float = 0.0


class WeightSync(ABC):
    def __init__(self, run: str, publish: PublishConfig, engines: int) -> None:
        """`run`: the run's own key (two live runs never share one: ckpt_transfer/owners.py)."""
        self.run, self.cfg, self.engines = run, publish, engines
        self.root = Path(publish.shm_root) / run
        self.swept = sweep_dead_runs(Path(publish.shm_root))  # what killed runs left on this host
        claim(self.root)

    def staging_dir(self, iteration: int) -> Path:
        """An empty directory for the trainer ranks to write `iteration` into."""
        directory = iteration_dir(self.cfg.shm_root, self.run, iteration)
        if directory.exists():  # left by a killed run: never reuse half-written shards
            shutil.rmtree(directory)
        return directory

    @abstractmethod
    def publish(self, manifest: Manifest) -> None:
        """Announce a complete iteration (its manifest written) so that engines' nodes can pull it."""

    @abstractmethod
    def pull(self, manifest: Manifest) -> Delivery:
        """Make the iteration available to every engine; returns one manifest per engine."""

    def verify(self, manifest: Manifest) -> int:
        """Raise `CheckpointError` unless the copy `manifest` describes is complete and intact."""
        return verify_manifest(manifest)

    def engine_dirs(self, manifest: Manifest) -> list[str]:
        """The HF directories engines start from: each engine's verified copy, TP shards merged whole (once
        per copy: engines sharing the publish directory share its checks and its merge)."""
        copies = self.pull(manifest).manifests
        ready: dict[str, str] = {}
        for m in copies:
            if m.directory not in ready:
                self.verify(m)
                ready[m.directory] = str(engine_checkpoint_dir(m, "engine-start"))
        return [ready[m.directory] for m in copies]

    @abstractmethod
    def gc(self, newest: int) -> None:
        """Keep the newest `publish.keep_last` iterations up to `newest`; free the older ones."""

    def close(self) -> None:
        self.release_local()

    def release_local(self) -> None:
        """Remove what the run keeps in shared memory on this machine: the part of `close` that needs no Ray
        (a run whose Ray cluster died can still do it)."""
        shutil.rmtree(self.root, ignore_errors=True)
        _remove_if_empty(Path(self.cfg.shm_root))


def _remove_if_empty(directory: Path) -> None:
    """The publish root (`publish.shm_root`), once no run keeps anything there: a run leaves nothing in /dev/shm."""
    try:
        directory.rmdir()
    except OSError:  # another run's files, or gone already
        pass


class SharedMemorySync(WeightSync):
    """Engines on the trainer's machine read the publish directory directly."""

    def publish(self, manifest: Manifest) -> None:
        pass  # the manifest, written last, already marks the directory complete

    def pull(self, manifest: Manifest) -> Delivery:
        return Delivery([manifest] * self.engines)

    def gc(self, newest: int) -> None:
        # no transport maps these files: their pages go to the recycle pool for the next publish
        gc_iterations(self.root, self.cfg.keep_last, recycle=True)


class MooncakeSync(WeightSync):
    """Rollout node k keeps its copy under `<transfer.rollout_shm_root>/rollout<k>` and pulls each iteration
    from the trainer node's agent (Ray actors, one per node)."""

    def __init__(self, run: str, publish: PublishConfig, engines: int, transfer: WeightTransferConfig,
                 trainer_node: str, namespace: str, timeout_s: float = 600,
                 placement: AgentPlacement | None = None) -> None:
        """`placement`: Ray options (a scheduling strategy) of the source agent and of each rollout node's
        agent, which must run where the trainer's rank 0 and engine k run; None: wherever Ray puts them (one
        machine)."""
        import ray

        from .node_agent import start_node_agent_actor
        from .registry import get_or_create_registry

        super().__init__(run, publish, engines)
        self.transfer, self.timeout = transfer, timeout_s
        for k in range(engines):  # the killed runs' copies on this host's rollout nodes
            for name in self.swept:
                shutil.rmtree(self._rollout_root(k) / name, ignore_errors=True)
        mooncake = transfer.mooncake.model_dump()
        self.registry = get_or_create_registry(transfer.registry_name, namespace,
                                               state_path=transfer.registry_state_path)
        place = placement or AgentPlacement()
        self.source = start_node_agent_actor(trainer_node, publish.shm_root, mooncake, self.registry,
                                             **place.source)
        self.sinks = [start_node_agent_actor(f"rollout{k}", str(self._rollout_root(k)), mooncake, self.registry,
                                             keep_last=publish.keep_last, **place.sink(k)) for k in range(engines)]
        try:
            ray.get([a.ping.remote() for a in [self.source, *self.sinks]], timeout=timeout_s)
        except BaseException:
            self.close()
            raise

    def _rollout_root(self, k: int) -> Path:
        return Path(self.transfer.rollout_shm_root) / f"rollout{k}"

    def publish(self, manifest: Manifest) -> None:
        import ray

        ray.get(self.source.publish.remote(manifest), timeout=self.timeout)
        self.registry.mark_complete(manifest.run, manifest.iteration)

    def pull(self, manifest: Manifest) -> Delivery:
        import ray

        results = ray.get([a.sync.remote(run=manifest.run, iteration=manifest.iteration, require_complete=True)
                           for a in self.sinks], timeout=self.timeout)
        return Delivery(manifests=[Manifest.load(r.directory) for r in results],
                        bytes=sum(r.pulled_bytes for r in results), seconds=max(r.seconds for r in results))

    def gc(self, newest: int) -> None:
        import ray

        keep = self.cfg.keep_last
        ray.get(self.source.gc.remote(self.run, keep), timeout=self.timeout)
        self.registry.drop(self.run, newest - keep + 1)

    def close(self) -> None:
        import ray

        for a in [self.source, *self.sinks]:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # already gone
                pass
            ray.kill(a)
        self.sinks = []
        self.release_local()

    def release_local(self) -> None:
        super().release_local()
        for k in range(self.engines):
            shutil.rmtree(self._rollout_root(k) / self.run, ignore_errors=True)
            _remove_if_empty(self._rollout_root(k))
        _remove_if_empty(Path(self.transfer.rollout_shm_root))


@dataclass
class AgentPlacement:
    """Ray actor options placing the node agents: `source` beside the trainer's rank 0, `sinks[k]` beside
    engine k (empty: anywhere)."""

    source: dict = field(default_factory=dict)
    sinks: list[dict] = field(default_factory=list)

    def sink(self, k: int) -> dict:
        return self.sinks[k] if self.sinks else {}


def open_weight_sync(run: str, publish: PublishConfig, transfer: WeightTransferConfig, engines: int, *,
                     trainer_node: str, namespace: str, placement: AgentPlacement | None = None) -> WeightSync:
    """The implementation the config asks for (`transfer.enabled`)."""
    if transfer.enabled:
        return MooncakeSync(run, publish, engines, transfer, trainer_node, namespace, placement=placement)
    return SharedMemorySync(run, publish, engines)
