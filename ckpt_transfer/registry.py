"""Shard registry: which node holds which shard of (run, iteration), and each node's engine address.

`ShardRegistry` is a plain class (testable without Ray); `get_or_create_registry()` runs it as a detached,
named Ray actor (it outlives the driver that created it; `tide resume` reconnects by name) and returns a
`RegistryClient` that bounds every call with a timeout and retries while the actor restarts.
With `state_path` set, the registry snapshots its state to a JSON file after each change and reloads it
when (re)started, so an actor restart loses nothing. Importing this module does not import Ray.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckpt_transfer.manifest import Manifest, ShardRecord

DEFAULT_NAME = "tide_shard_registry"
DEFAULT_NAMESPACE = "tide"


class RegistryUnavailableError(RuntimeError):
    """The registry actor did not answer within the bound (after retries)."""


@dataclass
class IterationEntry:
    """What the registry knows about one (run, iteration)."""

    run: str
    iteration: int
    directory: str = ""
    aux_files: list[str] = field(default_factory=list)
    tp_size: int = 1
    shards: dict[str, list[ShardRecord]] = field(default_factory=dict)  # node -> its shards
    aux_node: str | None = None  # node whose engine serves the aux files
    complete: bool = False  # set by mark_complete once every publisher registered


@dataclass
class Lookup:
    """Answer to `lookup`: the merged manifest plus the engine address of every node holding shards."""

    manifest: Manifest
    addresses: dict[str, str]
    aux_node: str | None = None
    complete: bool = False


class ShardRegistry:
    def __init__(self, state_path: str | None = None) -> None:
        self._state_path = Path(state_path) if state_path else None
        self._entries: dict[tuple[str, int], IterationEntry] = {}
        self._addresses: dict[str, str] = {}
        self._started = time.time()
        if self._state_path is not None and self._state_path.exists():
            self._load()

    # ---------------------------------------------------------------- API
    def ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "started": self._started, "iterations": len(self._entries)}

    def register_node(self, node: str, address: str) -> None:
        self._addresses[node] = address
        self._save()

    def register(
        self,
        run: str,
        iteration: int,
        node: str,
        address: str,
        shards: list[ShardRecord],
        *,
        directory: str = "",
        aux_files: list[str] | None = None,
        tp_size: int = 1,
    ) -> None:
        """Record `node`'s shards of (run, iteration). Several publishers of one node (trainer ranks) may
        each register their files: records merge by file name (a re-registered file replaces its record)."""
        e = self._entries.setdefault((run, iteration), IterationEntry(run, iteration))
        merged = {s.file: s for s in e.shards.get(node, [])}
        merged.update({s.file: s for s in shards})
        e.shards[node] = sorted(merged.values(), key=lambda s: s.file)
        if directory and not e.directory:
            e.directory = directory
        if aux_files:
            e.aux_files = sorted(set(e.aux_files) | set(aux_files))
            e.aux_node = e.aux_node or node
        e.tp_size = max(e.tp_size, tp_size)
        self._addresses[node] = address
        self._save()

    def lookup(self, run: str, iteration: int) -> Lookup | None:
        e = self._entries.get((run, iteration))
        if e is None:
            return None
        shards = [s for node in sorted(e.shards) for s in e.shards[node]]
        m = Manifest(run=run, iteration=iteration, directory=e.directory, shards=shards,
                     aux_files=list(e.aux_files), tp_size=e.tp_size)
        nodes = set(e.shards) | ({e.aux_node} if e.aux_node else set())
        return Lookup(m, {n: self._addresses[n] for n in nodes if n in self._addresses}, e.aux_node, e.complete)

    def mark_complete(self, run: str, iteration: int) -> None:
        """Every publisher of (run, iteration) has registered (the orchestrator calls this after publish)."""
        e = self._entries.get((run, iteration))
        if e is None:
            raise KeyError(f"no iteration {run}/{iteration} registered")
        e.complete = True
        self._save()

    def latest(self, run: str, complete_only: bool = False) -> int | None:
        its = [it for (r, it), e in self._entries.items() if r == run and (e.complete or not complete_only)]
        return max(its) if its else None

    def iterations(self, run: str) -> list[int]:
        return sorted(it for (r, it) in self._entries if r == run)

    def addresses(self) -> dict[str, str]:
        return dict(self._addresses)

    def drop(self, run: str, below_iteration: int) -> list[int]:
        """Forget iterations of `run` lower than `below_iteration`; returns those dropped."""
        gone = sorted(it for (r, it) in self._entries if r == run and it < below_iteration)
        for it in gone:
            del self._entries[(run, it)]
        if gone:
            self._save()
        return gone

    # ---------------------------------------------------------------- persistence
    def _save(self) -> None:
        if self._state_path is None:
            return
        state = {
            "addresses": self._addresses,
            "entries": [asdict(e) for e in self._entries.values()],
        }
        tmp = self._state_path.with_suffix(".tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(state))
        tmp.replace(self._state_path)

    def _load(self) -> None:
        assert self._state_path is not None
        state = json.loads(self._state_path.read_text())
        self._addresses = dict(state["addresses"])
        for d in state["entries"]:
            shards = {n: [ShardRecord.from_dict(s) for s in ss] for n, ss in d.pop("shards").items()}
            e = IterationEntry(**d, shards=shards)
            self._entries[(e.run, e.iteration)] = e


class RegistryClient:
    """Calls the registry actor with a timeout; while it is restarting (or was recreated) retries within
    `retries` attempts, re-resolving the actor by name, then raises RegistryUnavailableError."""

    def __init__(self, handle: Any, name: str, namespace: str, *, timeout_s: float = 30.0,
                 retries: int = 5, state_path: str | None = None) -> None:
        self._handle = handle
        self.name = name
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.retries = retries
        self.state_path = state_path

    @property
    def handle(self) -> Any:
        return self._handle

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        last: Exception | None = None
        for attempt in range(1 + self.retries):
            try:
                return ray.get(getattr(self._handle, method).remote(*args, **kwargs), timeout=self.timeout_s)
            except (RayActorError, GetTimeoutError) as e:
                last = e
                time.sleep(min(0.2 * 2**attempt, 2.0))
                try:  # the actor may have been recreated under the same name
                    self._handle = _create(self.name, self.namespace, self.state_path)
                except Exception as e2:  # noqa: BLE001 - reported below if it keeps failing
                    last = e2
        raise RegistryUnavailableError(
            f"shard registry {self.namespace}/{self.name} did not answer {method}() after "
            f"{1 + self.retries} attempts of {self.timeout_s}s: {last}"
        )

    def ping(self) -> dict[str, Any]:
        return self._call("ping")

    def register_node(self, node: str, address: str) -> None:
        self._call("register_node", node, address)

    def register(self, run: str, iteration: int, node: str, address: str, shards: list[ShardRecord], *,
                 directory: str = "", aux_files: list[str] | None = None, tp_size: int = 1) -> None:
        self._call("register", run, iteration, node, address, list(shards),
                   directory=directory, aux_files=aux_files, tp_size=tp_size)

    def lookup(self, run: str, iteration: int) -> Lookup | None:
        return self._call("lookup", run, iteration)

    def mark_complete(self, run: str, iteration: int) -> None:
        self._call("mark_complete", run, iteration)

    def latest(self, run: str, complete_only: bool = False) -> int | None:
        return self._call("latest", run, complete_only)

    def iterations(self, run: str) -> list[int]:
        return self._call("iterations", run)

    def addresses(self) -> dict[str, str]:
        return self._call("addresses")

    def drop(self, run: str, below_iteration: int) -> list[int]:
        return self._call("drop", run, below_iteration)


def _create(name: str, namespace: str, state_path: str | None) -> Any:
    import ray

    actor_cls = ray.remote(ShardRegistry)
    return actor_cls.options(
        name=name,
        namespace=namespace,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_restarts=-1,
        max_task_retries=3,
    ).remote(state_path)


def get_or_create_registry(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, *,
                           state_path: str | None = None, timeout_s: float = 30.0, retries: int = 5) -> RegistryClient:
    """Connect to the named detached registry, creating it if absent. Needs `ray.init` done."""
    client = RegistryClient(_create(name, namespace, state_path), name, namespace,
                            timeout_s=timeout_s, retries=retries, state_path=state_path)
    client.ping()
    return client


def kill_registry(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> bool:
    """Kill the named registry for good (tests, `tide` cleanup). True if one existed."""
    import ray

    try:
        h = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    ray.kill(h, no_restart=True)
    return True
