"""Per-node agent: publishes a node's shards to peers and pulls what the node lacks into its own shm root.

A node (a trainer host publishing, or a rollout "node" syncing) runs one `NodeAgent` in one process: in the
rollout worker itself, as a Ray actor (`ray.remote(NodeAgent)`), or as a subprocess through the CLI
(`python -m ckpt_transfer.node_agent serve|sync ...`, used by the tests and the netns integration test).

Local layout: `<shm_root>/<run>/<iteration>/<files>`; `manifest.json` is written last, atomically, after every
file verified, so its presence means "complete, ready for vLLM". `ckpt_transfer` never starts or stops vLLM.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ckpt_transfer import gc
from ckpt_transfer.checksum import ShardVerificationError, verify_shard
from ckpt_transfer.manifest import MANIFEST_FILE, Manifest, ShardRecord
from ckpt_transfer.owners import OWNER_FILE, claim, sweep_dead_runs
from ckpt_transfer.registry import RegistryClient
from ckpt_transfer.transport import (
    OPTIONAL_FILES,
    PARTIAL_SUFFIX,
    FaultHook,
    MooncakeTransport,
    ProgressHook,
    PullItem,
    ServedFile,
    TransferConfig,
    TransferError,
    served_key,
)

log = logging.getLogger(__name__)


@dataclass
class SyncResult:
    """Where the iteration now lives locally, and what it cost."""

    directory: str
    run: str
    iteration: int
    pulled_files: int = 0
    pulled_bytes: int = 0
    reused_files: int = 0
    seconds: float = 0.0
    attempts: int = 0


class NodeAgent:
    def __init__(
        self,
        node: str,
        shm_root: str | os.PathLike[str],
        config: TransferConfig | Mapping | None = None,
        registry: RegistryClient | None = None,
        keep_last: int | None = None,
    ) -> None:
        self.node = node
        self.root = Path(shm_root)
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = config if isinstance(config, TransferConfig) else TransferConfig(**(config or {}))
        self.transport = MooncakeTransport(cfg)
        self.registry = registry
        self.keep_last = keep_last
        if registry is not None:
            registry.register_node(node, self.transport.address)

    @property
    def address(self) -> str:
        return self.transport.address

    def local_dir(self, run: str, iteration: int) -> Path:
        return gc.iteration_dir(self.root, run, iteration)

    # ------------------------------------------------------------------ source side
    def prepare(self, run: str, iteration: int) -> str:
        """An empty directory under this node's root for its trainer ranks to write `iteration` into (what a
        killed run left there removed: half-written shards are never reused)."""
        if not (self.root / run / OWNER_FILE).exists():  # a node the driver is not on: the sweep's owner record
            claim(self.root / run)
        directory = self.local_dir(run, iteration)
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        return str(directory)

    def publish(self, manifest: Manifest) -> dict[str, ServedFile]:
        """Serve this node's shards of `manifest` (read from manifest.directory, this node's copy of the
        iteration) and the aux files it holds, and register them: a trainer spanning nodes publishes each node's
        part from that node, the aux files (config, tokenizer, index) from rank 0's."""
        mine = [s for s in manifest.shards if s.node == self.node]
        if not mine:
            raise ValueError(f"node {self.node!r} holds no shard of {manifest.run}/{manifest.iteration} "
                             f"(shard nodes: {sorted({s.node for s in manifest.shards})})")
        served = self.transport.serve_manifest(manifest, node=self.node)
        if self.registry is not None:
            held = [a for a in manifest.aux_files if (Path(manifest.directory) / a).exists()]
            self.registry.register(manifest.run, manifest.iteration, self.node, self.address, mine,
                                   directory=manifest.directory, aux_files=held, tp_size=manifest.tp_size)
        return served

    def retire(self, run: str, iteration: int) -> list[str]:
        """Stop serving an iteration (its memory is freed once the files are deleted too)."""
        return self.transport.unserve(prefix=served_key(run, iteration, ""))

    # ------------------------------------------------------------------ receiving side
    def sync(
        self,
        manifest: Manifest | None = None,
        *,
        run: str | None = None,
        iteration: int | None = None,
        addresses: Mapping[str, str] | None = None,
        on_progress: ProgressHook | None = None,
        fault_hook: FaultHook | None = None,
        require_complete: bool = False,
    ) -> SyncResult:
        """Make every file of the iteration present and verified under `local_dir(run, iteration)`.

        Give a manifest, or run+iteration to look it up in the registry. Node addresses come from
        `addresses` or the registry. Raises a `TransferError` (naming shard and peer) when a file cannot be
        fetched within the retry bound; nothing partial or unverified is ever left under a final name.
        """
        t0 = time.perf_counter()
        aux_node: str | None = None
        if manifest is None:
            if self.registry is None or run is None or iteration is None:
                raise ValueError("sync needs a manifest, or run and iteration with a registry")
            found = self.registry.lookup(run, iteration)
            if found is None:
                raise LookupError(f"registry has no iteration {run}/{iteration}")
            if require_complete and not found.complete:
                raise LookupError(f"iteration {run}/{iteration} is registered but not marked complete")
            manifest, aux_node = found.manifest, found.aux_node
            addresses = {**found.addresses, **(addresses or {})}
        local = self.local_dir(manifest.run, manifest.iteration)
        result = SyncResult(str(local), manifest.run, manifest.iteration)
        if (local / MANIFEST_FILE).exists():
            result.reused_files = len(manifest.shards) + len(manifest.aux_files)
            result.seconds = time.perf_counter() - t0
            return result
        local.mkdir(parents=True, exist_ok=True)

        lacking = [s for s in manifest.shards if not self._have(local, s, manifest)]
        aux = [a for a in manifest.aux_files if not (local / a).exists()]
        result.reused_files = len(manifest.shards) - len(lacking) + len(manifest.aux_files) - len(aux)
        if lacking or aux:
            if addresses is None and self.registry is not None:
                found = self.registry.lookup(manifest.run, manifest.iteration)
                if found is not None:
                    addresses, aux_node = found.addresses, found.aux_node
            if not addresses:
                raise TransferError(f"no peer addresses for {manifest.run}/{manifest.iteration}")
            items = self._items(manifest, lacking, aux, addresses, aux_node)
            try:
                stats = self.transport.pull_items(items, local, on_progress=on_progress, fault_hook=fault_hook)
            except TransferError as first:
                # A peer may have restarted with a new address: ask the registry once more, retry once.
                fresh = self.registry.lookup(manifest.run, manifest.iteration) if self.registry else None
                if fresh is None or fresh.addresses == dict(addresses):
                    raise naming_node(first, addresses) from first
                log.warning("retrying %s/%s with fresh addresses after: %s", manifest.run, manifest.iteration, first)
                still = [s for s in lacking if not (local / s.file).exists()]
                still_aux = [a for a in aux if not (local / a).exists()]
                items = self._items(manifest, still, still_aux, fresh.addresses, fresh.aux_node)
                try:
                    stats = self.transport.pull_items(items, local, on_progress=on_progress, fault_hook=fault_hook)
                except TransferError as second:
                    raise naming_node(second, fresh.addresses) from second
            result.pulled_files, result.pulled_bytes, result.attempts = stats.files, stats.bytes, stats.attempts
        replace(manifest, directory=str(local)).save(local)
        if self.keep_last:
            self.gc(manifest.run, self.keep_last, protect=(manifest.iteration,))
        result.seconds = time.perf_counter() - t0
        return result

    def _items(self, manifest: Manifest, shards: Sequence[ShardRecord], aux: Sequence[str],
               addresses: Mapping[str, str], aux_node: str | None) -> list[PullItem]:
        prefix = served_key(manifest.run, manifest.iteration, "")
        items = []
        for s in shards:
            if s.node not in addresses:
                raise TransferError(f"shard {s.file}: no transfer-engine address for node {s.node!r}", shard=s.file)
            items.append(PullItem(prefix + s.file, s.file, addresses[s.node], s.nbytes, s.checksum))
        aux_src = aux_node if aux_node in addresses else (shards[0].node if shards else next(iter(addresses)))
        items += [PullItem(prefix + a, a, addresses[aux_src]) for a in aux]
        items += [PullItem(prefix + f, f, addresses[aux_src], optional=True) for f in OPTIONAL_FILES
                  if f not in manifest.aux_files and not (self.local_dir(manifest.run, manifest.iteration) / f).exists()]
        return items

    def _have(self, local: Path, s: ShardRecord, manifest: Manifest) -> bool:
        """A file under its final name was verified when it got that name. A shard published on this
        very node (same filesystem) is hard-linked and verified instead of transferred."""
        if (local / s.file).exists():
            return True
        src = Path(manifest.directory) / s.file
        if s.node != self.node or not src.exists() or src.parent.resolve() == local.resolve():
            return False
        tmp = local / (s.file + PARTIAL_SUFFIX)
        try:
            tmp.unlink(missing_ok=True)
            os.link(src, tmp)
            verify_shard(tmp, s)
        except (OSError, ShardVerificationError) as e:
            log.warning("local copy of %s unusable (%s); will transfer", s.file, e)
            tmp.unlink(missing_ok=True)
            return False
        os.replace(tmp, local / s.file)
        return True

    # ------------------------------------------------------------------ housekeeping
    def gc(self, run: str, keep_last: int, protect: Sequence[int] = ()) -> list[int]:
        """Keep the newest `keep_last` iterations of `run` under this node's root; stop serving and delete
        the others."""
        dirs = [it for it, _ in gc.iteration_dirs(self.root / run)]
        keep = set(dirs[-keep_last:]) | set(protect)
        for it in dirs:
            if it not in keep:
                self.retire(run, it)
        return gc.gc_iterations(self.root / run, keep_last, protect)

    def release(self, run: str) -> None:
        """Stop serving `run` and remove what this node keeps of it (and the root, once empty)."""
        self.transport.unserve(prefix=f"{run}/")  # served_key's run part
        shutil.rmtree(self.root / run, ignore_errors=True)
        try:
            self.root.rmdir()
        except OSError:  # another run's files
            pass

    def ping(self) -> dict:
        return {"node": self.node, "address": self.address, "root": str(self.root), "pid": os.getpid()}

    def close(self) -> None:
        self.transport.close()


def naming_node(error: TransferError, addresses: Mapping[str, str]) -> TransferError:
    """`error` (of the same class, shard and peer), its message naming the node whose address is its peer, the
    shard's holder as the registry knows it (a trainer node's name tells which part of the trainer it was)."""
    node = next((n for n, address in addresses.items() if address == error.peer), None)
    if node is None or f"node {node!r}" in str(error):
        return error
    return type(error)(f"{error} (node {node!r})", shard=error.shard, peer=error.peer)


def start_node_agent_actor(node: str, shm_root: str, config: TransferConfig | Mapping | None = None,
                           registry: RegistryClient | None = None, keep_last: int | None = None,
                           publish_root: bool = False, **ray_options):
    """Run a NodeAgent as a Ray actor (its own process, its own engine and shm root). `publish_root`: shm_root is
    publish.shm_root, which the node the actor lands on may name otherwise (ckpt_transfer.config.node_shm_root).
    `ray_options` go to `.options()`, e.g. a node-affinity scheduling strategy on a cluster; default num_cpus=0."""
    import ray

    opts = {"num_cpus": 0, **ray_options}
    cfg = config.model_dump() if isinstance(config, TransferConfig) else config
    return ray.remote(_RayNodeAgent).options(**opts).remote(node, shm_root, cfg, registry, keep_last, publish_root)


class _RayNodeAgent(NodeAgent):
    """A NodeAgent in a Ray actor: `local_host: auto` becomes the address Ray knows this node by, and a publish
    root the node's own, wherever the actor was placed."""

    def __init__(self, node: str, shm_root: str, config: Mapping | None, registry: RegistryClient | None,
                 keep_last: int | None, publish_root: bool = False) -> None:
        import ray

        from ckpt_transfer.config import node_shm_root

        config = dict(config or {})
        if config.get("local_host") == "auto":
            config["local_host"] = ray.util.get_node_ip_address()
        if publish_root:
            shm_root = node_shm_root(shm_root)
            sweep_dead_runs(Path(shm_root))  # what killed runs left on this node
        super().__init__(node, shm_root, config, registry, keep_last)


# ---------------------------------------------------------------------- CLI (subprocess nodes)
def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckpt_transfer.node_agent")
    ap.add_argument("command", choices=["serve", "sync"])
    ap.add_argument("--node", required=True)
    ap.add_argument("--root", required=True, help="this node's shm root")
    ap.add_argument("--host", default="127.0.0.1", help="IP peers reach this node's engine on")
    ap.add_argument("--config", default="{}", help="TransferConfig fields as JSON")
    ap.add_argument("--manifest", required=True, help="manifest.json to publish (serve) or to sync")
    ap.add_argument("--peer", action="append", default=[], help="node=ip:port (sync)")
    a = ap.parse_args(argv)
    cfg = TransferConfig(**{**json.loads(a.config), "local_host": a.host})
    manifest = Manifest.from_json(Path(a.manifest).read_text())
    agent = NodeAgent(a.node, a.root, cfg)
    if a.command == "serve":
        agent.publish(manifest)
        print(json.dumps({"address": agent.address, "pid": os.getpid()}), flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin
        agent.close()
        return 0
    peers = dict(p.split("=", 1) for p in a.peer)
    try:
        res = agent.sync(manifest, addresses=peers)
    except TransferError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e), "shard": e.shard, "peer": e.peer}), flush=True)
        return 2
    print(json.dumps(asdict(res)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
