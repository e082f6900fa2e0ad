"""The rollout engines as Ray actors: prompts are split across engines, every engine syncs every iteration."""
from __future__ import annotations

from collections.abc import Sequence

import ray

from ckpt_transfer.manifest import Manifest
from rollout.config import EngineConfig
from rollout.samples import Samples
from rollout.tasks import Problem
from trainer.batch import TokenDistribution


class RolloutGroup:
    def __init__(self, model_dirs: list[str], cfg: EngineConfig, *, dtype: str, seed: int, deterministic: bool,
                 stop: Sequence[str] = (), stop_token_ids: Sequence[int] = ()):
        """One engine per directory (each engine's own copy of the starting weights). Every generation ends
        at a string of `stop` or a token of `stop_token_ids` (the chat template's end of turn), besides EOS.
        Returns once the engines are launched; `wait_started` waits until they serve (the first call on them
        would wait as well), so that the caller can do other start-up work meanwhile."""
        from rollout.engine import RolloutEngine

        self.timeout = cfg.engine_start_timeout_s
        self.stop, self.stop_token_ids = tuple(stop), tuple(stop_token_ids)
        actor = ray.remote(num_cpus=0, max_concurrency=2)(RolloutEngine)
        self.engines = [actor.remote(d, cfg, dtype=dtype, seed=seed, deterministic=deterministic) for d in model_dirs]

    def wait_started(self) -> None:
        """Block until every engine serves; an engine that failed to start stops them all and raises."""
        try:
            ray.get([e.engine_pid.remote() for e in self.engines], timeout=self.timeout)
        except BaseException:
            self.shutdown()
            raise

    def generate(self, problems: list[Problem], n_samples: int, max_new_tokens: int, sampling: TokenDistribution,
                 seed: int) -> Samples:
        """The problems split across engines, `n_samples` completions each, drawn from `sampling`."""
        k = len(self.engines)
        bounds = [len(problems) * i // k for i in range(k + 1)]
        refs = [self._generate(e, problems[lo:hi], n_samples, max_new_tokens, sampling, seed + lo)
                for e, lo, hi in zip(self.engines, bounds, bounds[1:]) if hi > lo]
        out = Samples()
        for lo, part in zip(bounds, ray.get(refs, timeout=self.timeout)):
            for s in part.items:
                s.prompt_index += lo
                out.items.append(s)
        return out

    def generate_on_each(self, problems: list[Problem], max_new_tokens: int, sampling: TokenDistribution,
                         seed: int) -> list[Samples]:
        """One completion per problem from every engine (each must sample the trainer's distribution)."""
        return ray.get([self._generate(e, problems, 1, max_new_tokens, sampling, seed) for e in self.engines],
                       timeout=self.timeout)

    def sync(self, manifests: Manifest | list[Manifest], mode: str, restart_if_layout_differs: bool = False
             ) -> list[dict]:
        """Load an iteration into every engine: one manifest for all, or one per engine (each engine's
        own local copy after a transfer). See RolloutEngine.sync."""
        if isinstance(manifests, Manifest):
            manifests = [manifests] * len(self.engines)
        return ray.get([e.sync.remote(m, mode, restart_if_layout_differs) for e, m in zip(self.engines, manifests)],
                       timeout=self.timeout)

    def _generate(self, engine, problems: list[Problem], n_samples: int, max_new_tokens: int,
                  sampling: TokenDistribution, seed: int):
        return engine.generate.remote(problems, n_samples, max_new_tokens, sampling.temperature, seed,
                                      sampling.top_p, sampling.top_k, self.stop, self.stop_token_ids)

    def engine_pids(self) -> list[int]:
        return ray.get([e.engine_pid.remote() for e in self.engines], timeout=self.timeout)

    def shutdown(self) -> None:
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=120)
            except Exception:  # already dead: nothing of ours left inside it
                pass
            ray.kill(e)
        self.engines = []

