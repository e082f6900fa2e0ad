"""Pluggable rewards (`rewards:` a list of `{fn, weight, name, style, columns}`): tide's built-in verifiers and
users' functions, called the way TRL or veRL calls them (docs/rewards.md is the users' guide).

- TRL style (TRL 1.16, `GRPOTrainer._calculate_rewards`): once per batch, every argument by keyword:
  `fn(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=, **columns)` -> one float
  or None per completion. Chat prompts come as the dataset's message lists and completions as
  `[{"role": "assistant", "content": text}]`; plain prompts and completions as strings. The columns are a dataset
  row's, each under its own name, but the prompt's; other tasks' problems give `answer` and their columns.
- veRL style (veRL 0.8's `NaiveRewardManager`): once per completion, `compute_score(data_source=, solution_str=,
  ground_truth=, extra_info=)` -> a number, or a dict whose "score" is the reward (its other numeric keys are
  logged as metrics, the rest as extra columns). `ground_truth` is the problem's answer (`task.answer_field`,
  e.g. `reward_model.ground_truth`), `data_source` and `extra_info` the row's columns ({} when absent).
- `columns: {keyword: column.path}` passes more (or renamed) columns to one function, dots reaching into nested
  ones, so TRL's functions run unchanged on veRL's layout: `{solution: reward_model.ground_truth}`.

A function is `package.module:function` (imported from the environment, the config file's directory or the
directory tide runs in) or `path/to/file.py:function` (relative to the config file's directory), found as tools are
(rollout/user_functions.py). Whether it can take its call is checked at start-up, against the columns of one
problem when they are known then, and again on every new set of columns.

A sample's reward is the weighted sum of the values that are not None; a sample every function skips gets no
reward and is left out of training (`None`). Functions run batched in a worker process (they cannot touch the
driver's state, and a hung one is stopped after `reward_timeout_s`); coroutine functions are awaited there.
`log_metric(name, value)` values are averaged into `reward/<label>/<name>`; `log_extra(column, values)` columns
come back with the scores (`ScoredBatch.extra_columns`).

Built-ins (`exact`, `numeric`, `math`, `code`, `length`) are tide's own, called with the reference answer as
`answer` (orchestrator/rewards/built_in.py)."""
from __future__ import annotations

import asyncio
import inspect
import multiprocessing
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ckpt_transfer.config import StrictModel
from orchestrator.rewards.built_in import BUILTIN_FNS, BUILTINS, LENGTH, length_values
from orchestrator.rewards.errors import RewardFunctionError, ServedModelError
from orchestrator.rewards.normalize import normalized
from orchestrator.rewards.served_config import Normalize
from orchestrator.rewards.values import metric_values, validated
from rollout.tasks.dataset import MISSING, field_value
from rollout import UserFunctionError, load_function, resolve_in_config

# What TRL 1.16's GRPOTrainer passes every reward function by keyword besides the columns (it also passes
# `environments` with environment factories, which tide has not)
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
VERL_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")  # veRL's compute_score call
Style = Literal["auto", "trl", "verl"]


class RewardSpec(StrictModel):
    """One entry of the YAML `rewards:` list."""

    fn: str | None = Field(None, description="A built-in (exact, numeric, math, code, length), "
                           "`package.module:function` or `path/to/file.py:function`; or give `model`.")
    model: str | None = Field(None, description="A served model of the `models:` section scoring every "
                              "(prompt, completion) instead of a function.")
    normalize: Normalize = Field("none", description="none; group: each value minus its prompt's samples' mean, "
                                 "over their standard deviation; batch: the same over the whole batch.")
    weight: float = Field(1.0, description="Factor of this function's values in a sample's reward.")
    name: str | None = Field(None, description="Its name in metrics (reward/<name>); null: the built-in's or the "
                                               "function's name.")
    style: Style = Field("auto", description="How a user's function is called: trl (per batch, by keyword, as "
                                             "TRL's GRPOTrainer), verl (per completion, as veRL's compute_score), "
                                             "auto (verl when it takes solution_str and ground_truth).")
    columns: dict[str, str] = Field(default_factory=dict,
                                    description="Keyword -> column path (dots reach into nested columns) passed to "
                                                "this function besides the row's columns, e.g. "
                                                "{solution: reward_model.ground_truth}.")

    @property
    def label(self) -> str:
        return self.name or (self.model if self.fn is None else self.fn.rpartition(":")[2])

    @field_validator("fn")
    @classmethod
    def _found_from_config(cls, fn: str | None, info: ValidationInfo) -> str | None:
        """A file relative to the config file's directory, a module there or in the working directory, as tools
        are found (rollout/user_functions.py); the resolved config holds what it found there as absolute paths."""
        return None if fn is None else resolve_in_config(fn, info)

    @model_validator(mode="after")
    def _builtin_options(self) -> "RewardSpec":
        if (self.fn is None) == (self.model is None):
            raise ValueError("give a reward either `fn` (a function) or `model` (a served model of `models:`)")
        if self.model is not None and (self.style != "auto" or self.columns):
            raise ValueError(f"style and columns: are for functions; model {self.model!r} is sent each prompt and "
                             f"completion")
        if self.fn in BUILTINS and self.style != "auto":
            raise ValueError(f"style: {self.fn!r} is a built-in, called tide's way (style is for users' functions)")
        if self.fn == LENGTH and self.columns:
            raise ValueError("columns: the `length` reward reads no columns")
        return self


@dataclass(frozen=True)
class TrainerState:
    """`trainer_state` of a TRL-style call: the progress fields of transformers' TrainerState that TRL passes
    (optimizer steps done before this batch, and the run's total)."""

    global_step: int = 0
    max_steps: int = 0


@dataclass
class RewardBatch:
    """One reward call's completions and what the functions read of their problems, one entry per completion."""

    prompts: list  # as TRL passes them: the dataset's chat messages, or prompt strings
    completions: list[str]  # texts, special tokens left out (as TRL and veRL decode them)
    columns: dict[str, list]  # each column under its own name
    answers: list[Any]  # each problem's reference answer: the built-ins' `answer`, veRL's `ground_truth`
    completion_ids: Sequence[Sequence[int]] = ()  # the engine's tokens; empty: not known ([] each)
    groups: Sequence[int] = ()  # the prompt each completion answers (what `length` needs)
    trainer_state: TrainerState | None = None  # None: zeros

    @property
    def chat(self) -> bool:
        # TRL 1.16 (`is_conversational` of the first prompt): message prompts get message completions
        return bool(self.prompts) and isinstance(self.prompts[0], list)


def _worker_traceback(error: BaseException) -> str | None:
    """The traceback a worker process of a ProcessPoolExecutor sent with `error` (concurrent.futures attaches it
    as the cause, a `_RemoteTraceback`); None for an error raised in this process."""
    remote = error.__cause__
    text = getattr(remote, "tb", None)
    return text.strip().strip('"').strip() if isinstance(text, str) else None  # sent inside """ quotes


def load_reward_function(fn: str) -> Callable:
    """A built-in by name, `package.module:function` or `path/to/file.py:function` (rollout/user_functions.py)."""
    if fn in BUILTIN_FNS:
        return BUILTIN_FNS[fn]
    source, sep, attr = fn.rpartition(":")
    if not sep or not source or not attr:
        raise RewardFunctionError(f"reward {fn!r}: not a built-in ({', '.join(BUILTINS)}) nor "
                                  f"'package.module:function' nor 'path/to/file.py:function'")
    try:
        return load_function(fn, "reward")
    except UserFunctionError as e:
        raise RewardFunctionError(str(e)) from None


def call_style(spec: RewardSpec, func: Callable) -> str:
    """`builtin`, `trl` or `verl`: `auto` is veRL's for a function that takes solution_str and ground_truth."""
    if spec.fn in BUILTIN_FNS:
        return "builtin"
    if spec.style != "auto":
        return spec.style
    names = set(_signature(spec, func).parameters)
    return "verl" if {"solution_str", "ground_truth"} <= names else "trl"


def _signature(spec: RewardSpec, func: Callable) -> inspect.Signature:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}): its signature cannot be read") from None


def call_problem(sig: inspect.Signature, keywords: set[str], columns_known: bool = True) -> str | None:
    """Why calling with exactly `keywords`, all by keyword, would fail; None when it would not. With
    `columns_known` False a parameter not among `keywords` may still be a column, and is not reported missing."""
    params = sig.parameters.values()
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    positional_only = [p.name for p in required if p.kind is p.POSITIONAL_ONLY]
    if positional_only:
        return f"its parameter(s) {', '.join(positional_only)} are positional-only; every argument comes by keyword"
    missing = [p.name for p in required if p.name not in keywords] if columns_known else []
    if missing:
        return f"nothing is passed as its parameter(s) {', '.join(missing)}"
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unexpected = sorted(keywords - named)
        if unexpected:
            return f"it takes no {', '.join(unexpected)} (and no **kwargs)"
    return None


@dataclass
class _Function:
    """A configured function as the driver knows it (the worker imports it again from `spec.fn`)."""

    spec: RewardSpec
    style: str  # builtin | trl | verl
    signature: inspect.Signature | None  # None for built-ins

    @property
    def label(self) -> str:
        return self.spec.label

    def keywords(self, columns: Collection[str]) -> set[str]:
        """What its call passes by keyword, given the batch's column names."""
        mapped = set(self.spec.columns)
        if self.style == "verl":
            return set(VERL_KEYWORDS) | mapped
        return set(TRL_KEYWORDS) | set(columns) | mapped

    def check(self, columns: Collection[str] | None) -> None:
        """Refuses a function that cannot take its call (`columns`: the column names, None: not known yet)."""
        if self.signature is None:
            return
        known = columns is not None or self.style == "verl"  # veRL's call passes no columns
        problem = call_problem(self.signature, self.keywords(columns or ()), columns_known=known)
        if problem is None:
            return
        spec = self.spec
        if self.style == "verl":
            hint = f"veRL style: called per completion with {', '.join(VERL_KEYWORDS)} and `columns:`"
        else:
            shown = f"the columns {', '.join(sorted(columns))}" if columns is not None else "the dataset's columns"
            hint = f"TRL style: called with {', '.join(TRL_KEYWORDS)}, {shown} and `columns:`"
        raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}) cannot take its call: {problem}; its "
                                  f"signature is {self.signature} ({hint}; a parameter none of these fill needs a "
                                  f"default or a `columns: {{name: column.path}}` entry, and a function without "
                                  f"**kwargs must name every keyword)")


def _load(spec: RewardSpec) -> _Function:
    func = load_reward_function(spec.fn)
    style = call_style(spec, func)
    return _Function(spec, style, None if style == "builtin" else _signature(spec, func))


def _column_values(columns: dict[str, list], path: str, n: int) -> list:
    """Each completion's value at a column path (None where it leads nowhere)."""
    rows = [{k: v[i] for k, v in columns.items()} for i in range(n)]
    return [None if v is MISSING else v for v in (field_value(row, path) for row in rows)]


def _call_kwargs(f: _Function, batch: RewardBatch, options: dict[str, Any]) -> dict[str, Any]:
    """Everything a call passes by keyword, one list per argument (veRL's are split per completion in the
    worker); `options`: a built-in's settings (the sandbox's address for `code`)."""
    n = len(batch.completions)
    mapped = {k: _column_values(batch.columns, path, n) for k, path in f.spec.columns.items()}
    if f.style == "builtin":
        return {**batch.columns, "answer": batch.answers, **mapped, "prompts": batch.prompts,
                "completions": batch.completions, **options}
    if f.style == "verl":  # veRL's NaiveRewardManager: ground truth, data source and extra info of the row
        extra_info = batch.columns.get("extra_info", [None] * n)
        return {"data_source": batch.columns.get("data_source", [None] * n), "solution_str": batch.completions,
                "ground_truth": batch.answers, "extra_info": [{} if e is None else e for e in extra_info], **mapped}
    completions: list = ([[{"role": "assistant", "content": t}] for t in batch.completions] if batch.chat
                         else batch.completions)
    return {**batch.columns, **mapped, "prompts": batch.prompts, "completions": completions,
            "completion_ids": [list(ids) for ids in batch.completion_ids] or [[] for _ in range(n)],
            "trainer_state": batch.trainer_state or TrainerState()}


@dataclass
class _Outcome:
    """What one function's call gave, back from the worker."""

    values: Any  # checked on the driver: one number or None per completion
    metrics: dict[str, list]  # log_metric's values (veRL: the result dicts' other numeric keys)
    extra: dict[str, list]  # log_extra's columns (veRL: the result dicts' other keys)


class _Logs:
    """The `log_metric` and `log_extra` callables TRL passes, collecting in the worker."""

    def __init__(self) -> None:
        self.metrics: dict[str, list] = {}
        self.extra: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)  # TRL 1.16 extends a column logged twice


def _call(fn: str, style: str, kwargs: dict[str, Any]) -> _Outcome:
    """In the worker process: load and call one function on the whole batch."""
    func = load_reward_function(fn)
    if style == "verl":
        return _call_verl(func, kwargs)
    logs = _Logs()
    if style == "trl":
        kwargs = {**kwargs, "log_extra": logs.log_extra, "log_metric": logs.log_metric}
    result = _resolved([func(**kwargs)])[0]
    return _Outcome(list(result) if isinstance(result, (list, tuple)) else result, logs.metrics, logs.extra)


def _call_verl(func: Callable, kwargs: dict[str, list]) -> _Outcome:
    n = len(kwargs["solution_str"])
    results = _resolved([func(**{k: v[i] for k, v in kwargs.items()}) for i in range(n)])
    logs, values = _Logs(), []
    for i, result in enumerate(results):
        if not isinstance(result, dict):
            values.append(result)
            continue
        values.append(result.get("score", result))  # a dict without a score is refused on the driver
        for key, value in result.items():
            if key == "score":
                continue
            if isinstance(value, (int, float)):  # veRL's `acc` is often a bool: its mean is the accuracy
                logs.log_metric(key, float(value))
            else:
                logs.extra.setdefault(key, [None] * n)[i] = value
    return _Outcome(values, logs.metrics, logs.extra)


def _resolved(results: list) -> list:
    """The results with every awaitable among them awaited, concurrently."""
    pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
    if pending:
        done = asyncio.run(_gather([results[i] for i in pending]))
        for i, r in zip(pending, done):
            results[i] = r
    return results


async def _gather(awaitables: list) -> list:
    return await asyncio.gather(*awaitables)


def _ready() -> bool:
    return True


@dataclass
class ScoredBatch:
    rewards: list[float | None]  # None: every function skipped the sample (left out of training)
    # reward/<label>: mean over the samples the function scored; reward/<label>/<name>: its logged metrics' means
    per_function: dict[str, float]
    # columns logged with log_extra (and veRL dicts' other keys), one value per sample; a column a function
    # listed earlier logged too is named <label>/<column>
    extra_columns: dict[str, list] = field(default_factory=dict)
    values: dict[str, list[float | None]] = field(default_factory=dict)  # each function's value of each sample
    parts: dict[str, float] = field(default_factory=dict)  # served models' seconds (timings.jsonl, reward phase)


class RewardFunctions:
    """The configured functions with a worker process pool; `close()` stops the workers. `columns`: one
    problem's columns as the functions get them (e.g. a dataset's first row), to check at start-up that every
    function can take its call; without them each new set of columns is checked at its first batch."""

    def __init__(self, specs: Sequence[RewardSpec], timeout_s: float = 60.0, workers: int = 1,
                 sandbox_url: str | None = None, columns: Mapping[str, Any] | None = None) -> None:
        if not specs:
            raise ValueError("no reward functions")
        labels = [s.label for s in specs]
        if len(set(labels)) != len(labels):
            raise RewardFunctionError(f"rewards: two functions would both report as reward/<name> for "
                                      f"{sorted({x for x in labels if labels.count(x) > 1})}: give them `name`s")
        self.length = [s for s in specs if s.fn == LENGTH]
        self.functions = [_load(s) for s in specs if s.fn is not None and s.fn != LENGTH]  # called in the workers
        self.model_specs = [s for s in specs if s.model is not None]  # scored by served models (attach_models)
        self._served = None
        if len(self.length) > 1 or (self.length and not (self.functions or self.model_specs)):
            raise RewardFunctionError("rewards: `length` shapes the other rewards: give it once, beside at least "
                                      "one other function")
        if any(s.fn == "code" for s in specs) and not sandbox_url:
            raise RewardFunctionError("reward 'code' needs a sandbox: none is running or configured (sandbox.url)")
        for f in self.functions:  # import errors and calls a function cannot take stop the run before it starts
            if columns is not None:
                _check_paths(f.spec, columns)
            f.check(None if columns is None else list(columns))
        self._checked: set[frozenset[str]] = set()
        self._options = {"code": {"sandbox_url": sandbox_url}}
        self.timeout_s, self.workers = timeout_s, workers
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        """Started and warmed up (every worker has imported this module) before any timeout applies."""
        # spawn: the driver holds threads (Ray, progress bars); a forked child could inherit a held lock
        pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        for f in [pool.submit(_ready) for _ in range(self.workers)]:
            f.result()
        return pool

    def score(self, prompts: list, completions: list[str], columns: dict[str, list[Any]], *,
              completion_ids: Sequence[Sequence[int]] = (), groups: Sequence[int] = ()) -> ScoredBatch:
        """A batch whose reference answers are the `answer` column (tasks that are not datasets)."""
        answers = columns.get("answer", [None] * len(completions))
        return self.score_batch(RewardBatch(prompts, completions, columns, answers, completion_ids, groups))

    def attach_models(self, served) -> None:
        """The run's served models (orchestrator.workers.served_models.ServedModels), started once Ray is up."""
        self._served = served

    def score_batch(self, batch: RewardBatch) -> ScoredBatch:
        n = len(batch.completions)
        self._check_columns(batch.columns)
        futures = {f.label: self._pool.submit(_call, f.spec.fn, f.style,
                                              _call_kwargs(f, batch, self._options.get(f.spec.fn, {})))
                   for f in self.functions}
        by_model = {s.label: self._model_values(s, batch) for s in self.model_specs}  # meanwhile, in their actors
        outcomes = {f.label: self._outcome(f, futures[f.label], n) for f in self.functions}
        values = {label: o.values for label, o in outcomes.items()} | by_model
        weighed = [f.spec for f in self.functions] + self.model_specs
        raw = {}  # the mean of a normalised reward's values before normalisation: its own scale
        for spec in weighed:
            if spec.normalize != "none":
                kept = [v for v in values[spec.label] if v is not None]
                if kept:
                    raw[f"reward/{spec.label}/raw"] = sum(kept) / len(kept)
                values[spec.label] = normalized(values[spec.label], batch.groups or range(n), spec.normalize)
        rewards: list[float | None] = []
        for i in range(n):
            scored = [(s.weight, values[s.label][i]) for s in weighed if values[s.label][i] is not None]
            rewards.append(sum(w * v for w, v in scored) if scored else None)
        for spec in self.length:
            lengths = [len(ids) for ids in batch.completion_ids]
            values[spec.label] = length_values(rewards, lengths, batch.groups)
            rewards = [r if v is None else r + spec.weight * v for r, v in zip(rewards, values[spec.label])]
        per_function = {}
        for label, vs in values.items():
            scored_values = [v for v in vs if v is not None]
            if scored_values:
                per_function[f"reward/{label}"] = sum(scored_values) / len(scored_values)
        per_function |= raw
        parts = {}
        if self.model_specs:  # scored above, or raised: the served models are attached
            per_function |= self._served.metrics()  # served/<model>/scored, replaced, unreadable
            parts = self._served.seconds()
        extra_columns: dict[str, list] = {}
        for label, outcome in outcomes.items():
            per_function.update({f"reward/{label}/{name}": sum(vs) / len(vs)
                                 for name, vs in outcome.metrics.items() if vs})
            for column, column_values in outcome.extra.items():
                extra_columns[column if column not in extra_columns else f"{label}/{column}"] = column_values
        for spec in self.model_specs:  # a judge's replies, beside each sample in samples.jsonl
            replies = self._served[spec.model].last_replies
            if replies is not None:
                extra_columns[f"{spec.label}/reply"] = list(replies)
        return ScoredBatch(rewards, per_function, extra_columns, values, parts)

    def _model_values(self, spec: RewardSpec, batch: RewardBatch) -> list[float | None]:
        if self._served is None:
            raise RewardFunctionError(f"reward {spec.label!r}: served model {spec.model!r} was not started")
        try:
            return list(self._served[spec.model].score(batch.prompts, batch.completions, batch.answers))
        except ServedModelError as e:
            raise RewardFunctionError(f"reward {spec.label!r}: {e}") from None

    def _check_columns(self, columns: Mapping[str, list]) -> None:
        """Each new set of column names: every function must take the call they make."""
        names = frozenset(columns)
        if names not in self._checked:
            for f in self.functions:
                f.check(names)
            self._checked.add(names)

    def _outcome(self, f: _Function, future: Future, n: int) -> _Outcome:
        try:
            got = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._restart_pool()
            raise RewardFunctionError(f"reward {f.label!r} ({f.spec.fn}) did not return within "
                                      f"reward_timeout_s = {self.timeout_s:g}") from None
        except RewardFunctionError as e:
            e.user_traceback = _worker_traceback(e)
            raise
        except Exception as e:
            error = RewardFunctionError(f"reward {f.label!r} ({f.spec.fn}) raised {type(e).__name__}: {e}")
            error.user_traceback = _worker_traceback(e)
            raise error from None
        who = f"reward {f.label!r} ({f.spec.fn})"
        got.values = validated(who, got.values, n)
        got.metrics = {name: metric_values(who, name, vs) for name, vs in got.metrics.items()}
        for column, column_values in got.extra.items():
            if not isinstance(column_values, list) or len(column_values) != n:
                raise RewardFunctionError(f"reward {f.label!r} ({f.spec.fn}) logged column {column!r} with "
                                          f"{len(column_values)} values for {n} completions")
        return got

    def _restart_pool(self) -> None:
        """A hung function keeps its worker busy: the pool's processes are ended and a fresh pool replaces it."""
        for proc in list(getattr(self._pool, "_processes", {}).values()):
            proc.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._new_pool()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _check_paths(spec: RewardSpec, columns: Mapping[str, Any]) -> None:
    """Every column path a function's `columns:` names must lead somewhere in the example row."""
    for keyword, path in spec.columns.items():
        if field_value(columns, path) is MISSING:
            raise RewardFunctionError(f"reward {spec.label!r} ({spec.fn}): columns: {{{keyword}: {path}}}: no such "
                                      f"column; the columns: {', '.join(sorted(columns))} (dots reach into "
                                      f"nested ones)")
