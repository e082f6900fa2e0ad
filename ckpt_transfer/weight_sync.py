"""The one door between the orchestrator and weight hand-over, shaped like checkpoint-engine's: trainer ranks
write an iteration into `staging_dir`, `publish` announces it, `pull` makes it available to every rollout
engine, `verify` checks a copy before an engine loads it, `gc` collects old iterations and `close` removes
what the run left in shared memory.

Two implementations: `SharedMemorySync`, where engines read the publish directory itself (one machine, one
shared memory), and `MooncakeSync`, where each rollout node has its own node agent and shared-memory root
and pulls every iteration from the trainer nodes' agents through the Mooncake transfer engine, looking the
shards up in the shard registry (a detached named Ray actor). A trainer spanning nodes publishes each node's
part into that node's shared memory, served by that node's agent: no node holds the whole checkpoint."""
from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from pathlib import Path

from .config import PublishConfig, WeightTransferConfig, node_shm_root
from .gc import gc_iterations, iteration_dir
from .manifest import Manifest
from .owners import claim, sweep_dead_runs
from .transfer_errors import NodeAgentLostError
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
        self.shm_root = Path(node_shm_root(publish.shm_root))  # this (the driver's) node's
        self.root = self.shm_root / run
        self.swept = sweep_dead_runs(self.shm_root)  # what killed runs left on this host
        claim(self.root)

    def staging_dir(self, iteration: int) -> Path:
        """An empty directory on this node for the trainer ranks to write `iteration` into."""
        directory = iteration_dir(self.shm_root, self.run, iteration)
        if directory.exists():  # left by a killed run: never reuse half-written shards
            shutil.rmtree(directory)
        return directory

    def staging_dirs(self, iteration: int, nodes: list[str]) -> dict[str, str]:
        """Per trainer node (by the name its shards carry), the directory its ranks write `iteration` into."""
        if len(nodes) != 1:
            raise ValueError(f"{type(self).__name__} publishes from one node; the trainer spans {nodes}")
        return {nodes[0]: str(self.staging_dir(iteration))}

    @abstractmethod
    def publish(self, manifest: Manifest, directories: dict[str, str] | None = None) -> None:
        """Announce a complete iteration (its manifest written) so that engines' nodes can pull it;
        `directories`: where each trainer node holds its part (staging_dirs), None: manifest.directory."""

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
        _remove_if_empty(self.shm_root)


def _remove_if_empty(directory: Path) -> None:
    """The publish root (`publish.shm_root`), once no run keeps anything there: a run leaves nothing in /dev/shm."""
    try:
        directory.rmdir()
    except OSError:  # another run's files, or gone already
        pass


class SharedMemorySync(WeightSync):
    """Engines on the trainer's machine read the publish directory directly."""

    def publish(self, manifest: Manifest, directories: dict[str, str] | None = None) -> None:
        pass  # the manifest, written last, already marks the directory complete

    def pull(self, manifest: Manifest) -> Delivery:
        return Delivery([manifest] * self.engines)

    def gc(self, newest: int) -> None:
        # no transport maps these files: their pages go to the recycle pool for the next publish
        gc_iterations(self.root, self.cfg.keep_last, recycle=True)


class MooncakeSync(WeightSync):
    """Rollout node k keeps its copy under `<transfer.rollout_shm_root>/rollout<k>` and pulls each iteration
    from the trainer nodes' agents (Ray actors, one per node), each tensor from the node that holds it."""

    def __init__(self, run: str, publish: PublishConfig, engines: int, transfer: WeightTransferConfig,
                 trainer_nodes: str | list[str], namespace: str, timeout_s: float = 600,
                 placement: AgentPlacement | None = None) -> None:
        """`trainer_nodes`: the names the trainer's shards carry for their nodes (a source agent serves each).
        `placement`: Ray options (a scheduling strategy) of each trainer node's agent and of each rollout node's
        agent, which must run on that trainer node and where engine k runs; None: wherever Ray puts them (one
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
        nodes = [trainer_nodes] if isinstance(trainer_nodes, str) else trainer_nodes
        self.sources = {node: start_node_agent_actor(node, publish.shm_root, mooncake, self.registry,
                                                     publish_root=True, **place.source(j))
                        for j, node in enumerate(nodes)}
        self.sinks = [start_node_agent_actor(f"rollout{k}", str(self._rollout_root(k)), mooncake, self.registry,
                                             keep_last=publish.keep_last, **place.sink(k)) for k in range(engines)]
        try:
            ray.get([a.ping.remote() for a in self._agents], timeout=timeout_s)
        except BaseException:
            self.close()
            raise

    def _rollout_root(self, k: int) -> Path:
        return Path(self.transfer.rollout_shm_root) / f"rollout{k}"

    @property
    def _agents(self) -> list:
        return [*self.sources.values(), *self.sinks]

    def staging_dirs(self, iteration: int, nodes: list[str]) -> dict[str, str]:
        """Each trainer node's agent empties the iteration's directory under its own root."""
        unknown = sorted(set(nodes) - set(self.sources))
        if unknown:
            raise ValueError(f"trainer nodes {unknown} have no node agent (agents on {sorted(self.sources)})")
        paths = self._each({n: self.sources[n].prepare.remote(self.run, iteration) for n in nodes}, "prepare")
        return dict(zip(nodes, paths))

    def publish(self, manifest: Manifest, directories: dict[str, str] | None = None) -> None:
        """Every trainer node's agent serves and registers its own part (read from its own directory); the
        iteration is marked complete once all have."""
        holders = sorted({s.node for s in manifest.shards})
        missing = [n for n in holders if n not in self.sources]
        if missing:
            raise ValueError(f"{manifest.run}/{manifest.iteration}: shards on nodes {missing} that no agent serves")
        self._each({n: self.sources[n].publish.remote(replace(manifest, directory=(directories or {}).get(
            n, manifest.directory))) for n in holders}, f"publish {manifest.run}/{manifest.iteration}")
        self.registry.mark_complete(manifest.run, manifest.iteration)

    def _each(self, calls: dict, what: str) -> list:
        """The results of one call to each of several node agents ({node: ref}), in order; an agent that died
        fails the whole call naming its node (NodeAgentLostError), which the run's restart then replaces."""
        import ray

        out = []
        for node, ref in calls.items():
            try:
                out.append(ray.get(ref, timeout=self.timeout))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                raise NodeAgentLostError(f"{what}: the node agent of node {node!r} died or does not answer "
                                         f"({type(e).__name__}); what it served is gone with it", peer=node) from e
        return out

    def pull(self, manifest: Manifest) -> Delivery:
        results = self._each({f"rollout{k}": a.sync.remote(run=manifest.run, iteration=manifest.iteration,
                                                            require_complete=True)
                              for k, a in enumerate(self.sinks)}, f"pull {manifest.run}/{manifest.iteration}")
        return Delivery(manifests=[Manifest.load(r.directory) for r in results],
                        bytes=sum(r.pulled_bytes for r in results), seconds=max(r.seconds for r in results))

    def gc(self, newest: int) -> None:
        keep = self.cfg.keep_last
        self._each({n: a.gc.remote(self.run, keep) for n, a in self.sources.items()}, "gc")
        self.registry.drop(self.run, newest - keep + 1)

    def close(self) -> None:
        import ray

        for a in self.sources.values():  # each trainer node's part, wherever that node is
            try:
                ray.get(a.release.remote(self.run), timeout=30)
            except Exception:  # gone: its node's sweep (owners.py) or the machine's restart frees it
                pass
        for a in self._agents:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # already gone
                pass
            ray.kill(a)
        self.sinks, self.sources = [], {}
        self.release_local()

    def release_local(self) -> None:
        super().release_local()
        for k in range(self.engines):
            shutil.rmtree(self._rollout_root(k) / self.run, ignore_errors=True)
            _remove_if_empty(self._rollout_root(k))
        _remove_if_empty(Path(self.transfer.rollout_shm_root))


@dataclass
class AgentPlacement:
    """Ray actor options placing the node agents: `sources[j]` on the trainer's node j, `sinks[k]` beside
    engine k (empty: anywhere)."""

    sources: list[dict] = field(default_factory=list)
    sinks: list[dict] = field(default_factory=list)

    def source(self, j: int) -> dict:
        return self.sources[j] if self.sources else {}

    def sink(self, k: int) -> dict:
        return self.sinks[k] if self.sinks else {}


def open_weight_sync(run: str, publish: PublishConfig, transfer: WeightTransferConfig, engines: int, *,
                     trainer_nodes: str | list[str], namespace: str,
                     placement: AgentPlacement | None = None) -> WeightSync:
    """The implementation the config asks for (`transfer.enabled`); a trainer spanning nodes needs it."""
    if transfer.enabled:
        return MooncakeSync(run, publish, engines, transfer, trainer_nodes, namespace, placement=placement)
    if not isinstance(trainer_nodes, str) and len(trainer_nodes) > 1:
        raise ValueError(f"the trainer spans nodes {trainer_nodes}: its parts reach the engines through the "
                         f"transfer engine (transfer.enabled true)")
    return SharedMemorySync(run, publish, engines)
