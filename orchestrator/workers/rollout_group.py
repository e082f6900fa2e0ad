"""The rollout engines as Ray actors: prompts are split across engines, every engine syncs every iteration.

An engine whose actor dies (an inline engine dies with its actor), or that does not answer a call within
`engine_call_timeout_s` (hung, or stopped), is replaced by a new actor on the latest iteration that engine had
loaded, and the call it was serving runs again there; at most `max_engine_restarts` times per call and engine."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from ckpt_transfer.manifest import Manifest
from orchestrator.workers.cluster import kill_workers
from rollout.config import EngineConfig
from rollout.engine_proc import wait_gone
from rollout.in_flight import InFlight
from rollout.samples import Samples
from rollout.tasks import Problem
from trainer.batch import TokenDistribution

if TYPE_CHECKING:
    from orchestrator.workers.pools import EnginePool

log = logging.getLogger(__name__)
ACTOR_EXIT_TIMEOUT_S = 5.0


class RolloutGroup:
    def __init__(self, model_dirs: list[str], cfg: EngineConfig, *, dtype: str, seed: int, deterministic: bool,
                 stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                 placement: Callable[[int], dict] | None = None, pool: "EnginePool | None" = None):
        """One engine per directory (each engine's own copy of the starting weights). Every generation ends
        at a string of `stop` or a token of `stop_token_ids` (the chat template's end of turn), besides EOS.
        `placement(k)`: Ray options placing engine k (orchestrator/workers/placement.py), also when it is replaced.
        `pool`: start the engines in processes borrowed from it (CPU, no placement), handed back at shutdown.
        Returns once the engines are launched; `wait_started` waits until they serve (the first call on them
        would wait as well), so that the caller can do other start-up work meanwhile."""
        from rollout.engine import RolloutEngine

        self.cfg, self.timeout = cfg, cfg.engine_start_timeout_s
        self._placement = placement or (lambda k: {})
        self.stop, self.stop_token_ids = tuple(stop), tuple(stop_token_ids)
        # On GPUs an engine's actor holds its TP degree's GPUs (Ray sets CUDA_VISIBLE_DEVICES for it and the TP
        # workers vLLM starts from it); on CPU the phases take turns on the host's cores
        gpus = {"num_gpus": cfg.tp} if cfg.device == "cuda" else {}
        # concurrent calls: a generate, a sync handing it weights in flight, and info / engine_pid while they run
        self._actor = ray.remote(num_cpus=0, max_concurrency=3, **gpus)(RolloutEngine)
        self._engine_args = dict(dtype=dtype, seed=seed, deterministic=deterministic)
        self._model_dirs = list(model_dirs)
        self._loaded: list[Manifest | None] = [None] * len(model_dirs)  # the iteration each engine serves
        self._replacing = threading.Lock()
        if pool is not None and (cfg.device != "cpu" or placement is not None):
            raise ValueError("an EnginePool serves CPU engines placed anywhere on the driver's node")
        self._pool = pool
        self._starting: dict[int, ray.ObjectRef] = {}  # a pooled engine's start, until wait_started has seen it
        self.engines = [self._launch(i) for i in range(len(model_dirs))]

    def _launch(self, i: int):
        """Engine i's actor; a new actor starts its engine as it is built, a pooled one by the `start` call
        that `wait_started` (or, for a replacement, `_replace`) waits for."""
        args = (self._model_dirs[i], self.cfg)
        kwargs = {**self._engine_args, "start_on": self._loaded[i]}
        if self._pool is None:
            return self._actor.options(**self._placement(i)).remote(*args, **kwargs)
        engine = self._pool.take()
        self._starting[i] = engine.start.remote(*args, **kwargs)
        return engine

    def wait_started(self) -> None:
        """Block until every engine serves; an engine that failed to start stops them all and raises. An
        interrupt (Ctrl-C, SIGTERM) leaves the stop to the group's owner, who knows whether Ray can still answer
        (a scheduler's SIGTERM reaches the raylet too: each Ray call would then wait out its timeout)."""
        try:
            ray.get(list(self._starting.values()), timeout=self.timeout)  # a pooled engine answers before it starts
            self._starting.clear()
            ray.get([e.engine_pid.remote() for e in self.engines], timeout=self.timeout)
        except Exception:
            self.shutdown()
            raise

    def generate(self, problems: list[Problem], n_samples: int, max_new_tokens: int, sampling: TokenDistribution,
                 seed: int, in_flight: InFlight | None = None, opened: threading.Event | None = None) -> Samples:
        """The problems split across engines, `n_samples` completions each, drawn from `sampling`. `in_flight`:
        each engine takes the weights of a `sync` to its version between two decode steps (the call may then
        last as long as the train step that publishes them, up to in_flight.wait_s more); `opened` is set once
        every engine will hand such a sync to this call, before the call starts."""
        k = len(self.engines)
        bounds = [len(problems) * i // k for i in range(k + 1)]
        parts = {i: (lo, hi) for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo}
        if in_flight is not None:  # only where a generate follows: an engine left out hands its sync to none
            ray.get([self.engines[i].open_in_flight.remote(in_flight) for i in parts], timeout=self.timeout)
        if opened is not None:
            opened.set()
        done = self._on_engines({
            i: (lambda e, lo=lo, hi=hi: self._generate(e, problems[lo:hi], n_samples, max_new_tokens, sampling,
                                                       seed + lo, in_flight))
            for i, (lo, hi) in parts.items()}, extra_timeout_s=in_flight.wait_s if in_flight else 0.0)
        out = Samples()
        for i, (lo, _) in parts.items():
            for s in done[i].items:
                s.prompt_index += lo
                out.items.append(s)
        return out

    def generate_on_each(self, problems: list[Problem], max_new_tokens: int, sampling: TokenDistribution,
                         seed: int) -> list[Samples]:
        """One completion per problem from every engine (each must sample the trainer's distribution)."""
        done = self._on_engines({i: lambda e: self._generate(e, problems, 1, max_new_tokens, sampling, seed)
                                 for i in range(len(self.engines))})
        return [done[i] for i in range(len(self.engines))]

    def sync(self, manifests: Manifest | list[Manifest], mode: str, restart_if_layout_differs: bool = False
             ) -> list[dict]:
        """Load an iteration into every engine: one manifest for all, or one per engine (each engine's
        own local copy after a transfer). See RolloutEngine.sync."""
        if isinstance(manifests, Manifest):
            manifests = [manifests] * len(self.engines)
        done = self._on_engines({i: lambda e, m=m: e.sync.remote(m, mode, restart_if_layout_differs)
                                 for i, m in enumerate(manifests)})
        self._loaded = list(manifests)
        return [done[i] for i in range(len(self.engines))]

    def sleep(self, level: int) -> None:
        """Every engine asleep (rollout.sleep_level), its GPU memory free for the trainer on the same GPUs."""
        self._on_engines({i: lambda e: e.sleep.remote(level) for i in range(len(self.engines))})

    def park(self) -> None:
        """Every engine stopped, all its memory free for the trainer, until its next sync (a restart onto the new
        weights) or call (rollout.sync_mode restart)."""
        self._on_engines({i: lambda e: e.park.remote() for i in range(len(self.engines))})

    def wake_up(self) -> None:
        """Every engine awake again, for the sync and rollout that follow."""
        self._on_engines({i: lambda e: e.wake_up.remote() for i in range(len(self.engines))})

    def release_in_flight(self) -> None:
        """Engines waiting for in-flight weights go on without them (the run is stopping)."""
        for e in self.engines:
            try:
                ray.get(e.release_in_flight.remote(), timeout=10)
            except Exception:  # dead or hung: its call fails on its own
                pass

    def _generate(self, engine, problems: list[Problem], n_samples: int, max_new_tokens: int,
                  sampling: TokenDistribution, seed: int, in_flight: InFlight | None = None):
        return engine.generate.remote(problems, n_samples, max_new_tokens, sampling.temperature, seed,
                                      sampling.top_p, sampling.top_k, self.stop, self.stop_token_ids, in_flight)

    def _on_engines(self, calls: dict[int, Callable[[Any], ray.ObjectRef]], extra_timeout_s: float = 0.0
                    ) -> dict[int, Any]:
        """Run calls[i] on engine i, all at once, and gather the results. An engine whose actor died or that
        did not answer in time (engine_call_timeout_s, plus `extra_timeout_s`) is replaced (on the iteration it
        had loaded) and its call made again."""
        handles = {i: self.engines[i] for i in calls}
        pending = {i: call(handles[i]) for i, call in calls.items()}
        replaced = dict.fromkeys(calls, 0)
        results: dict[int, Any] = {}
        while pending:
            i, ref = next(iter(pending.items()))
            # a replaced engine's call waits for its start as well
            timeout = self.cfg.engine_call_timeout_s + extra_timeout_s + (self.timeout if replaced[i] else 0.0)
            try:
                results[i] = ray.get(ref, timeout=timeout)
                del pending[i]
            except (RayActorError, GetTimeoutError) as e:
                what = "died" if isinstance(e, RayActorError) else \
                    f"did not answer within engine_call_timeout_s={self.cfg.engine_call_timeout_s:g} s"
                if replaced[i] >= self.cfg.max_engine_restarts:
                    raise RuntimeError(f"rollout engine {i} {what}, {replaced[i] + 1} times during one call "
                                       f"(max_engine_restarts={self.cfg.max_engine_restarts}): {e}") from e
                replaced[i] += 1
                with self._replacing:  # a draw taking weights in flight and the sync can both find it dead
                    if self.engines[i] is handles[i]:
                        self._replace(i, what)
                    handles[i] = self.engines[i]
                pending[i] = calls[i](handles[i])
        return results

    def _replace(self, i: int, what: str) -> None:
        """A new engine i on what the old one had loaded (launched: the call made on it next waits for its
        start too)."""
        loaded = self._loaded[i]
        log.warning("rollout engine %d %s; starting a new one on %s", i, what,
                    f"iteration {loaded.iteration}" if loaded else self._model_dirs[i])
        try:
            ray.kill(self.engines[i])  # a hung or stopped engine too: Ray ends its process with SIGKILL
        except Exception:
            pass
        self.engines[i] = self._launch(i)
        if i in self._starting:  # a pooled process runs its calls concurrently: the next must find it started
            ray.get(self._starting.pop(i), timeout=self.timeout)

    def engine_pids(self) -> list[int]:
        return ray.get([e.engine_pid.remote() for e in self.engines], timeout=self.timeout)

    def shutdown(self) -> None:
        """Stop every engine and end its actor (a pooled one's process goes back to the pool); returns once the
        ended actors' processes on this node are gone (ray.kill only asks: an inline engine's actor process is the
        engine, and it must not outlive the run)."""
        here = ray.get_runtime_context().get_node_id()
        local: list[int] = []
        for i, e in enumerate(self.engines):
            if self._pool is not None:
                try:
                    if i in self._starting:  # its calls run concurrently: the stop must follow the start
                        ray.get(self._starting.pop(i), timeout=self.timeout)
                    ray.get(e.stop.remote(), timeout=120)
                    self._pool.give_back(e)
                    continue
                except Exception:  # dead or hung: ended as any engine is
                    pass
            try:
                node, pid = ray.get(e.process.remote(), timeout=10)
                local += [pid] if node == here else []
            except Exception:  # already dead
                pass
            try:
                ray.get(e.shutdown.remote(process_ends=True), timeout=120)
            except Exception:  # already dead: nothing of ours left inside it
                pass
            ray.kill(e)
        self.engines, self._starting = [], {}
        if alive := wait_gone(local, ACTOR_EXIT_TIMEOUT_S):
            # Ray could not end them (its raylet died with the run: a scheduler's SIGTERM to the whole job)
            log.warning("rollout engine actor process(es) %s still alive %.0f s after ray.kill: SIGKILL", alive,
                        ACTOR_EXIT_TIMEOUT_S)
            kill_workers(alive)
