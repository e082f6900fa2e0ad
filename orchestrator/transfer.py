"""Weight transfer between the trainer's node and the rollout nodes through the Mooncake transfer engine.

When `transfer.enabled`, the trainer node's agent serves each published iteration and registers its shards in
the shard registry (a detached named Ray actor); every rollout engine has its own node agent and shared-memory
root and pulls the iteration it lacks before its engine loads it. Without it, engines read the publish
directory directly (one machine, one shared memory)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ray

from ckpt_transfer.manifest import Manifest


@dataclass
class PullReport:
    manifests: list[Manifest]
    bytes: int = 0
    seconds: float = 0.0
    per_node: list[dict] = field(default_factory=list)


class WeightTransfer:
    def __init__(self, cfg, trainer_node: str, engines: int, timeout_s: float = 600):
        from ckpt_transfer.node_agent import start_node_agent_actor
        from ckpt_transfer.registry import get_or_create_registry

        t = cfg.transfer
        self.run, self.timeout = cfg.name, timeout_s
        mooncake = t.mooncake.model_dump()
        self.registry = get_or_create_registry(t.registry_name, cfg.ray.namespace,
                                               state_path=t.registry_state_path)
        self.source = start_node_agent_actor(trainer_node, cfg.publish.shm_root, mooncake, self.registry)
        self.sinks = [start_node_agent_actor(f"rollout{k}", str(Path(t.rollout_shm_root) / f"rollout{k}"),
                                             mooncake, self.registry, keep_last=cfg.publish.keep_last)
                      for k in range(engines)]
        ray.get([a.ping.remote() for a in [self.source, *self.sinks]], timeout=timeout_s)

    def publish(self, manifest: Manifest) -> None:
        ray.get(self.source.publish.remote(manifest), timeout=self.timeout)
        self.registry.mark_complete(manifest.run, manifest.iteration)

    def pull(self, manifest: Manifest) -> PullReport:
        results = ray.get([a.sync.remote(run=manifest.run, iteration=manifest.iteration, require_complete=True)
                           for a in self.sinks], timeout=self.timeout)
        return PullReport(manifests=[Manifest.load(r.directory) for r in results],
                          bytes=sum(r.pulled_bytes for r in results),
                          seconds=max(r.seconds for r in results),
                          per_node=[{"directory": r.directory, "bytes": r.pulled_bytes, "seconds": r.seconds,
                                     "reused_files": r.reused_files} for r in results])

    def gc(self, keep_last: int, newest: int) -> None:
        ray.get(self.source.gc.remote(self.run, keep_last), timeout=self.timeout)
        self.registry.drop(self.run, newest - keep_last + 1)

    def close(self) -> None:
        for a in [self.source, *self.sinks]:
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # already gone
                pass
            ray.kill(a)
        self.sinks = []
