"""Second models served for a run (`models:`): each a set of Ray actors holding the model (a reward model:
rollout/reward_model.py; a judge: a rollout engine of its own, rollout/judge.py), started and health-checked before
the first iteration, a batch split evenly between the replicas, a replica that
dies replaced and its part scored again (up to `max_replacements`), and a replica that does not answer within
`timeout_s` stopping the run with an error naming the model. Never a default score in place of an answer.

A judge's prompts are rendered here (its template through its own chat template, token ids sent to the engine)
and its replies read here; identical prompts are judged once per run (greedy replies: the same prompt gets the same
verdict), and a reply without a readable verdict gets `unreadable_reward` and is counted.

Metrics per model (`served/<name>/...`): conversations scored, replicas replaced, a judge's unreadable verdicts;
each model's seconds are a part of the reward phase in RUN_DIR/timings.jsonl (`served/<name>`)."""
from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from orchestrator.rewards.errors import ServedModelError
from orchestrator.rewards.served_config import ServedModelConfig

__all__ = ["ServedModel", "ServedModelError", "ServedModels"]


class _RewardModelActor:
    """The actor around rollout.reward_model.RewardModel (imported in the actor's process: torch there)."""

    def __init__(self, name: str, cfg: dict) -> None:
        from rollout.reward_model import RewardModel

        self.model = RewardModel(name, cfg["path"], cfg["device"], cfg["dtype"], cfg["batch_size"], cfg["threads"])

    def info(self) -> dict:
        return self.model.info()

    def score(self, prompts: list, completions: list[str]) -> list[float]:
        return self.model.score(prompts, completions)


class _JudgeActor:
    """The actor around a rollout engine serving a judge (greedy replies to prompts given as token ids)."""

    def __init__(self, name: str, cfg: dict) -> None:
        from rollout.config import EngineConfig
        from rollout.engine import RolloutEngine

        self.name, self.max_new_tokens = name, cfg["max_new_tokens"]
        engine = EngineConfig(device=cfg["device"], kv_cache_gb=cfg["kv_cache_gb"], engine_process="inline")
        self.engine = RolloutEngine(cfg["path"], engine, dtype=cfg["dtype"], seed=0, deterministic=True)

    def info(self) -> dict:
        return {"name": self.name, "pid": os.getpid()}

    def judge(self, prompt_ids: list[list[int]], stop_token_ids: list[int]) -> list[str]:
        from rollout.tasks import Problem

        problems = [Problem("judge", "", "", prompt_ids=tuple(ids)) for ids in prompt_ids]
        # top_k 1: greedy, the same reply to the same prompt; a reply ends at its chat template's end of turn
        samples = self.engine.generate(problems, 1, self.max_new_tokens, 1.0, 0, top_k=1,
                                       stop_token_ids=stop_token_ids)
        texts = [""] * len(problems)
        for sample in samples:
            texts[sample.prompt_index] = sample.text
        return texts


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
    last: dict[str, float] = field(default_factory=dict)  # the last batch's metrics (the same on a resumed run)
    last_seconds: float = 0.0  # the last batch's wall time (RUN_DIR/timings.jsonl: a part of the reward phase)
    last_replies: list[str] | None = None  # a judge's replies to the last batch
    cache_hits: int = 0  # a judge's: the last batch's prompts judged earlier in the run
    _cache: dict[tuple[int, ...], str] = field(default_factory=dict)  # a judge's replies by prompt
    _renderer: Any = None  # a judge's prompts, rendered as the policy's (orchestrator/workers/prompts.py)

    def start(self) -> "ServedModel":
        self.replicas = [self._launch() for _ in range(self.cfg.replicas)]
        return self

    def _launch(self) -> _Replica:
        cfg = self.cfg
        actor_class = ray.remote(num_cpus=cfg.num_cpus, num_gpus=1 if cfg.device == "cuda" else 0,
                                 max_restarts=0, max_concurrency=1)(
            _JudgeActor if cfg.kind == "judge" else _RewardModelActor)
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

    def score(self, prompts: Sequence, completions: Sequence[str], answers: Sequence[Any] = ()) -> list:
        """Each (prompt, completion)'s value: a reward model's score, or a judge's verdict (None where unreadable
        and `unreadable_reward` is null), the batch split between the replicas."""
        t0 = time.perf_counter()
        n = len(completions)
        if self.cfg.kind == "judge":
            values, extra = self._judge(prompts, completions, list(answers) or [None] * n)
        else:
            values, extra = self._on_replicas("score", [list(prompts), list(completions)]), {}
        self.last = {"scored": float(n), "replaced": float(self.replaced), **extra}
        self.last_seconds = time.perf_counter() - t0
        return values

    def _judge(self, prompts: Sequence, completions: Sequence[str], answers: list) -> tuple[list, dict]:
        from rollout.judge import parse_verdict, render

        cfg = self.cfg
        keys = [self._prompt_ids(render(cfg.template, p, c, a, cfg.rubric))
                for p, c, a in zip(prompts, completions, answers)]
        new = list(dict.fromkeys(k for k in keys if k not in self._cache))
        if new:
            replies = self._on_replicas("judge", [[list(k) for k in new]], self._renderer.end_of_turn_ids())
            self._cache.update(zip(new, replies))
        replies = [self._cache[k] for k in keys]
        read = [parse_verdict(r, cfg.verdict, key=cfg.verdict_key, letters=cfg.letters, scale=cfg.scale)
                for r in replies]
        self.last_replies = replies
        values = [cfg.unreadable_reward if v is None else v for v in read]
        self.cache_hits = len(keys) - len(new)
        return values, {"unreadable": float(sum(v is None for v in read))}

    def _prompt_ids(self, text: str) -> tuple[int, ...]:
        """The judge's prompt as a user turn of its chat template (its text alone without one), rendered and
        tokenised as the policy's prompts are."""
        from rollout.judge import judge_problem

        if self._renderer is None:
            from transformers import AutoTokenizer

            from orchestrator.workers.prompts import PromptRenderer

            self._renderer = PromptRenderer(AutoTokenizer.from_pretrained(self.cfg.path))
        rendered, _ = self._renderer.render(judge_problem(text, bool(self._renderer.template)))
        return rendered.prompt_ids

    def _on_replicas(self, method: str, columns: list[list], *shared: Any) -> list:
        """`method` called on each replica with its contiguous part of every column, then `shared` as they are;
        results in order. A replica that dies is replaced and its part sent again; one that does not answer in time
        stops the call."""
        n = len(columns[0])
        parts = _split(n, len(self.replicas))

        def send(i: int):
            lo, hi = parts[i]
            return getattr(self.replicas[i].actor, method).remote(*[c[lo:hi] for c in columns], *shared)

        pending = {i: send(i) for i, (lo, hi) in enumerate(parts) if hi > lo}
        results: dict[int, list] = {}
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
                pending[i] = send(i)
                deadline = time.monotonic() + self.cfg.timeout_s
            except ray.exceptions.RayTaskError as e:
                raise ServedModelError(f"served model {self.name!r}: {_cause(e)}") from None
        out = [x for i in sorted(results) for x in results[i]]
        if len(out) != n:
            raise ServedModelError(f"served model {self.name!r} returned {len(out)} values for {n} conversations")
        return out

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
        """The last batch's, per model: conversations scored, replicas replaced so far, a judge's unreadable
        replies. Wall time is not among them (metrics.jsonl of a resumed run equals the uninterrupted one's)."""
        return {f"served/{name}/{k}": v for name, m in self.models.items() for k, v in m.last.items()}

    def seconds(self) -> dict[str, float]:
        """The last batch's wall seconds per model: parts of the reward phase in RUN_DIR/timings.jsonl."""
        return {f"served/{name}": m.last_seconds for name, m in self.models.items()}

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
