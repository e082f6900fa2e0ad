"""Second models served for a run (`models:`): each a set of Ray actors holding the model (rollout/reward_model.py),
started and health-checked before the first iteration, a batch split evenly between the replicas, a replica that
dies replaced and its part scored again (up to `max_replacements`), and a replica that does not answer within
`timeout_s` stopping the run with an error naming the model. Never a default score in place of an answer.

Metrics per model (`served/<name>/...`): seconds of the last batch, conversations scored, replicas replaced."""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from orchestrator.rewards.served_config import ServedModelConfig


class ServedModelError(RuntimeError):
    """A served model that cannot start or answer; the message names it."""


class _RewardModelActor:
    """The actor around rollout.reward_model.RewardModel (imported in the actor's process: torch there)."""

    def __init__(self, name: str, cfg: dict) -> None:
        from rollout.reward_model import RewardModel

        self.model = RewardModel(name, cfg["path"], cfg["device"], cfg["dtype"], cfg["batch_size"], cfg["threads"])

    def info(self) -> dict:
        return self.model.info()

    def score(self, prompts: list, completions: list[str]) -> list[float]:
        return self.model.score(prompts, completions)


@dataclass
class _Replica:
    actor: Any
    pid: int


@dataclass
class ServedModel:
    """One `models:` entry's replicas."""

    name: str
    cfg: ServedModelConfig
    replicas: list[_Replica] = field(default_factory=list)
    replaced: int = 0
    last: dict[str, float] = field(default_factory=dict)

    def start(self) -> "ServedModel":
        self.replicas = [self._launch() for _ in range(self.cfg.replicas)]
        return self

    def _launch(self) -> _Replica:
        cfg = self.cfg
        actor_class = ray.remote(num_cpus=cfg.num_cpus, num_gpus=1 if cfg.device == "cuda" else 0,
                                 max_restarts=0, max_concurrency=1)(_RewardModelActor)
        actor = actor_class.options(name=None).remote(self.name, cfg.model_dump())
        try:
            info = ray.get(actor.info.remote(), timeout=cfg.timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise ServedModelError(f"served model {self.name!r} ({cfg.path}) did not start within timeout_s = "
                                   f"{cfg.timeout_s:g}") from None
        except ray.exceptions.RayError as e:
            ray.kill(actor)
            raise ServedModelError(f"served model {self.name!r} ({cfg.path}) failed to start: "
                                   f"{_cause(e)}") from None
        return _Replica(actor, int(info["pid"]))

    def score(self, prompts: Sequence, completions: Sequence[str]) -> list[float]:
        """Scores of every (prompt, completion), the batch split between the replicas."""
        t0 = time.perf_counter()
        n = len(completions)
        parts = _split(n, len(self.replicas))
        pending = {i: self.replicas[i].actor.score.remote(list(prompts[lo:hi]), list(completions[lo:hi]))
                   for i, (lo, hi) in enumerate(parts) if hi > lo}
        results: dict[int, list[float]] = {}
        deadline = time.monotonic() + self.cfg.timeout_s
        while pending:
            i, ref = next(iter(pending.items()))
            try:
                results[i] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
                del pending[i]
            except ray.exceptions.GetTimeoutError:
                raise ServedModelError(f"served model {self.name!r}: replica {i} (pid {self.replicas[i].pid}) did "
                                       f"not score its {parts[i][1] - parts[i][0]} conversations within timeout_s "
                                       f"= {self.cfg.timeout_s:g}") from None
            except ray.exceptions.ActorDiedError:
                self._replace(i)
                lo, hi = parts[i]
                pending[i] = self.replicas[i].actor.score.remote(list(prompts[lo:hi]), list(completions[lo:hi]))
                deadline = time.monotonic() + self.cfg.timeout_s
            except ray.exceptions.RayTaskError as e:
                raise ServedModelError(f"served model {self.name!r}: {_cause(e)}") from None
        scores = [s for i in sorted(results) for s in results[i]]
        if len(scores) != n:
            raise ServedModelError(f"served model {self.name!r} returned {len(scores)} scores for {n} conversations")
        self.last = {"seconds": time.perf_counter() - t0, "scored": float(n), "replaced": float(self.replaced)}
        return scores

    def _replace(self, i: int) -> None:
        dead = self.replicas[i]
        if self.replaced >= self.cfg.max_replacements:
            raise ServedModelError(f"served model {self.name!r}: replica {i} (pid {dead.pid}) died, and "
                                   f"max_replacements = {self.cfg.max_replacements} were used")
        self.replaced += 1
        ray.kill(dead.actor)
        self.replicas[i] = self._launch()

    def pids(self) -> list[int]:
        return [r.pid for r in self.replicas]

    def shutdown(self) -> None:
        for replica in self.replicas:
            ray.kill(replica.actor)
        self.replicas = []


class ServedModels:
    """Every `models:` entry, started together; `close()` ends them."""

    def __init__(self, models: Mapping[str, ServedModelConfig]) -> None:
        self.models: dict[str, ServedModel] = {}
        try:
            for name, cfg in models.items():
                self.models[name] = ServedModel(name, cfg).start()
        except BaseException:
            self.close()
            raise

    def __getitem__(self, name: str) -> ServedModel:
        return self.models[name]

    def pids(self) -> dict[str, list[int]]:
        return {name: m.pids() for name, m in self.models.items()}

    def metrics(self) -> dict[str, float]:
        return {f"served/{name}/{k}": v for name, m in self.models.items() for k, v in m.last.items()}

    def close(self) -> None:
        for model in self.models.values():
            model.shutdown()


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (lo, hi) ranges covering range(n), sizes differing by at most one."""
    size, extra = divmod(n, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + size + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _cause(error: BaseException) -> str:
    """The message of what the actor raised, without Ray's wrapping."""
    cause = getattr(error, "cause", None)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error).strip().splitlines()[-1]
