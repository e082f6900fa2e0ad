"""The rollout engine: one vLLM `LLM` whose V1 EngineCore runs in this process (`engine_process: inline`) or
in a child process (`separate`); "the engine process" is whichever process runs the engine core.

`RolloutEngine` is a plain class; the orchestrator runs it as a Ray actor (`ray.remote(num_cpus=0)`). It
generates samples with the log-probs of the sampled tokens, scores given sequences teacher-forced, swaps
weights (`sync`: restart or in-place reload of a verified published iteration) and, with a separate engine
process, restarts it on the latest verified weights when it dies (an inline engine dies with its actor: the
rollout group replaces the actor). vLLM is imported lazily so that importing this module (e.g. for
`EngineConfig`) stays cheap.
"""
from __future__ import annotations

import atexit
import functools
import gc
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Literal, Sequence, TypeVar

from ckpt_transfer.manifest import Manifest

from ckpt_transfer.verify import (
    CheckpointError,
    engine_checkpoint_dir,
    layout_difference,
    tensor_layout,
    verify_manifest,
)

from . import routing_capture
from .config import EngineConfig
from .engine_model import model_llm_kwargs
from .engine_proc import (DeathWatch, engine_segments, freeze_heap, gc_paused, pin_threads, process_tree,
                          remove_segments, sweep_private_dirs, wait_gone)
from .in_flight import InFlight, Offered, WeightSlot, token_versions
from .samples import Sample, Samples
from .tasks.base import Problem

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_PROJECT_ROOT = Path(__file__).resolve().parents[1]
SyncMode = Literal["restart", "reload"]


class EngineError(RuntimeError):
    """The engine could not serve a call (it kept dying, or failed to start)."""


class SyncError(RuntimeError):
    """A sync was refused or failed; the engine still serves the previous verified weights."""


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Sampling seed of a prompt's request: a pure function of (seed, prompt). vLLM seeds the request's
    sample j with prompt_seed + j, so a sample does not depend on how requests are batched or whether the
    engine was restarted in between."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)  # + j stays a 63-bit seed


def generate_requests(problems: Sequence[Problem], n_samples: int, max_new_tokens: int, temperature: float, seed: int,
                      top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
                      stop_token_ids: Sequence[int] = ()) -> tuple[list, list]:
    """The vLLM prompts and SamplingParams of one generate call: one request per prompt for its `n_samples`
    samples (vLLM fans it out: fewer requests to build, send and schedule; scripts/bench_rollout.py compares
    it with a request per sample), seeded by prompt_seed (or the problem's own seed and token budget, where a
    multi-turn rollout sets them), asking for the sampled tokens' log-probs."""
    from vllm import SamplingParams, TokensPrompt

    params = [
        SamplingParams(
            n=n_samples, max_tokens=p.max_new_tokens or max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=prompt_seed(seed, i) if p.seed is None else p.seed, logprobs=0, stop=list(stop) or None,
            stop_token_ids=list(stop_token_ids) or None, detokenize=bool(stop),  # vLLM matches stop text
        )
        for i, p in enumerate(problems)
    ]
    prompts = [TokensPrompt(prompt_token_ids=list(p.prompt_ids)) if p.prompt_ids else p.prompt for p in problems]
    return prompts, params


def configure_env(cfg: EngineConfig) -> None:
    """The environment vLLM reads in this process and passes to the engine's processes."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CACHE_ROOT", cfg.cache_root or str(_PROJECT_ROOT / ".cache" / "vllm"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM waits this long for its workers to exit before killing them (default 5 s, and they never
    # made it in time here): a restart would otherwise spend 5 s on teardown.
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.engine_process == "inline" else "1"
    if cfg.eager:
        # Eager mode still torch.compiles a few helpers on first use (the sampler's token-rank count among
        # them): on CPU that is an inductor C++ build of ~7 s in every new engine process (its cache sits
        # in the engine's private TMPDIR), paid by the first rollout and by every `restart` sync. The
        # helpers give the same results uncompiled.
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    else:
        os.environ.pop("TORCH_COMPILE_DISABLE", None)  # compiled mode is torch.compile
    # Read once when vLLM is first imported in this process.
    os.environ["VLLM_ENGINE_READY_TIMEOUT_S"] = str(int(cfg.engine_start_timeout_s))
    # Explicit for tp=1 too: vLLM's "auto" binding reserves a core for its scheduler and keeps one logical
    # CPU per physical core, which left the model one thread on a 2-vCPU machine (half the tokens/s of
    # binding both; scripts/bench_rollout.py). Ignored on GPUs.
    if "VLLM_CPU_OMP_THREADS_BIND" not in cfg.extra_env:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _threads_bind(cfg.tp)
    # oneDNN (torch's and vLLM's CPU GEMMs) keeps a primitive, JIT code and scratchpad included, per distinct
    # shape, up to 1024 by default: an engine meets new batch shapes as the policy's completion lengths drift, and
    # its memory grew about 1 MB per iteration of the quickstart for hundreds of iterations (1.20 -> 1.49 GB over
    # 300). A few entries hold one step's shapes; measured on varied batches: flat memory, and no cost in speed
    # (scripts/bench_rollout.py --quick, 2026-11-27: 1365 generated tokens/s capped against 1347 with the default,
    # ratio 1.01). Read when oneDNN makes its first primitive, which is after this in the engine's process.
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8")
    os.environ.update(cfg.extra_env)
    chosen = named_cpus(cfg.extra_env.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))
    if cfg.device == "cpu" and chosen:
        # The engine's cores were chosen (placement.mode disaggregated, or by hand): its whole process runs there,
        # scheduler and detokenizer threads and the processes it starts too, not only the OpenMP threads vLLM binds.
        pin_threads(chosen)
    if "torch" in sys.modules:
        # An inline engine runs in this process, whose torch read TORCH_COMPILE_DISABLE when it was imported.
        import torch._dynamo

        torch._dynamo.config.disable = os.environ.get("TORCH_COMPILE_DISABLE") == "1"


def _model_config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def routing_capture_setup(cfg: EngineConfig, model_dir: str | Path) -> tuple[dict, dict]:
    """The `LLM(...)` arguments and environment (set unless set already) of an engine that records its routing
    (rollout/routing_capture.py): a mixture-of-experts model with rollout.record_routing; none otherwise."""
    from ckpt_transfer.convert import is_moe

    if not cfg.record_routing or not is_moe(SimpleNamespace(**_model_config(model_dir))):
        return {}, {}
    kwargs = {"worker_extension_cls": routing_capture.WORKER_EXTENSION, "load_format": routing_capture.LOAD_FORMAT}
    # The recorder reads the V1 model runner's batch layout, which vllm-cpu runs; vLLM 0.32 runs its V2 runner
    # wherever Triton is (GPUs), and V2's own capture needs the prefix cache, which deterministic runs turn off.
    return kwargs, {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def llm_kwargs(cfg: EngineConfig, dtype: str, seed: int, deterministic: bool) -> dict:
    """vLLM `LLM(...)` arguments of a rollout engine."""
    kw: dict[str, Any] = dict(
        tensor_parallel_size=cfg.tp, dtype=dtype, seed=seed, enforce_eager=cfg.eager,
        enable_prefix_caching=not deterministic,
        # log-probs of the distribution sampled from (after temperature and top-k/top-p): what the trainer
        # recomputes; score_sequences' prompt log-probs stay raw whatever this says
        logprobs_mode="processed_logprobs", distributed_executor_backend=executor_backend(cfg),
        disable_log_stats=True,
        # With chunked prefill, a seeded request whose prompt is split across steps has its sampled token
        # discarded and its generator rewound with set_offset, which CPU generators do not support
        # ("CPU Generator does not use offset": the engine core dies). Whole prompts avoid the rewind.
        enable_chunked_prefill=False,
    )
    if cfg.kv_cache_bytes is not None:
        kw["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
    else:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if cfg.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if cfg.max_model_len is not None:
        kw["max_model_len"] = cfg.max_model_len
    if cfg.max_num_seqs is not None:
        kw["max_num_seqs"] = cfg.max_num_seqs
    if cfg.weight_update == "in_flight":  # no batch in flight between two steps, where the weights change
        kw["async_scheduling"] = False
    return kw


def executor_backend(cfg: EngineConfig) -> str:
    """Where vLLM's model workers run: an inline engine with tp=1 runs its model in its own process ("uni":
    no worker process, no shared-memory queue polled between steps); otherwise one worker process per TP rank."""
    return "uni" if cfg.engine_process == "inline" and cfg.tp == 1 else "mp"


def _token_logprob(entry: Any, token: int) -> float:
    return float(entry[token].logprob)


def named_cpus(binding: str) -> list[int] | None:
    """The CPUs a VLLM_CPU_OMP_THREADS_BIND value names, all workers' groups together ('0,1|2-3': [0, 1, 2, 3]);
    None when it names none ('auto', 'nobind', 'all')."""
    cpus: list[int] = []
    for part in binding.replace("|", ",").split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return sorted(set(cpus))


def bound_cpus(binding: str) -> list[int]:
    """The CPUs of the first worker's group in a VLLM_CPU_OMP_THREADS_BIND value ('0,1|2-3': [0, 1]); the
    CPUs this process may use when the value names none ('auto', 'nobind', 'all')."""
    return named_cpus(binding.split("|")[0]) or sorted(os.sched_getaffinity(0))


def _threads_bind(tp: int) -> str:
    """One OpenMP core group per TP worker, e.g. '0|1' for tp=2 on two cores (the default 'auto' binding
    refuses to put two workers on one NUMA node)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"tp={tp} needs at least {tp} CPUs, this process may use {len(cpus)}")
    per = len(cpus) // tp
    groups = [cpus[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)


def _on_engine_thread(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run the method on the engine's own thread. An inline engine runs the model on the thread that calls it,
    and OpenMP keeps its thread count per calling thread: the count _start sets holds on this thread only, while
    the actor's calls arrive on any of its threads (elsewhere: Ray's OMP_NUM_THREADS=1)."""
    @functools.wraps(method)
    def run(self: "RolloutEngine", *args, **kwargs):
        if threading.current_thread() is self._engine_thread:
            return method(self, *args, **kwargs)
        try:
            done = self._engine_executor.submit(method, self, *args, **kwargs)
        except RuntimeError:  # the interpreter is exiting (atexit's shutdown): no new work on that thread
            return method(self, *args, **kwargs)
        return done.result()
    return run


class RolloutEngine:
    def __init__(self, model_dir: str, cfg: EngineConfig | None = None, *, dtype: str = "float32", seed: int = 0,
                 deterministic: bool = False, start_on: Manifest | None = None) -> None:
        """`dtype`: float32 by default (bf16 is slower on CPU and drifts from a float32 trainer);
        `deterministic` turns prefix caching off, so every prompt is recomputed on the same path. `start_on`:
        a published iteration to start on instead of `model_dir`, verified as a sync verifies it (the rollout
        group replacing an engine that died)."""
        self.cfg = cfg or EngineConfig()
        self._inline = self.cfg.engine_process == "inline"
        self.dtype, self.seed, self.deterministic = dtype, seed, deterministic
        self._checkpoint_dir = Path(model_dir)  # latest verified weights: restarts always go back here
        self._iteration: int | None = None
        self._llm: Any = None
        self._watch: DeathWatch | None = None
        self._pids: list[int] = []
        self._segments: set[str] = set()
        self._private_tmp: Path | None = None
        self._starts = 0
        self._deaths = 0
        self.last_start_s = 0.0
        self._closed = False
        self._scratch: Path | None = None  # a merged-TP directory we wrote for the current weights
        self._rpc_dir: Path | None = None  # where vLLM's ZMQ sockets of this process's engines are (_start_llm)
        self._layout: dict = {}  # tensor names/dtypes/shapes of the weights being served
        self._routing_shape: tuple[int, int] | None = None  # (layers, top_k) while routing is recorded
        self._slot: WeightSlot | None = None  # while a generate takes weights in flight (rollout/in_flight.py)
        # generate/score/sync/shutdown take turns (the actor may run with max_concurrency > 1 so that
        # engine_pid/info answer while a generate runs).
        self._lock = threading.RLock()
        self._engine_thread: threading.Thread | None = None
        self._engine_executor = ThreadPoolExecutor(1, "vllm-engine", initializer=self._claim_engine_thread)
        self._configure_env()
        if start_on is not None:
            try:
                path, self._layout, _ = self._verified(start_on)
            except CheckpointError as e:
                raise EngineError(f"cannot start on {start_on.run} iteration {start_on.iteration}: {e}") from None
            self._checkpoint_dir, self._iteration = path, start_on.iteration
            self._scratch = path if path != Path(start_on.directory) else None
        elif not (self._checkpoint_dir / "config.json").is_file():
            raise EngineError(f"{self._checkpoint_dir} is not a Hugging Face model directory (no config.json)")
        else:
            self._layout = tensor_layout(self._checkpoint_dir)
        self._start(self._checkpoint_dir)
        atexit.register(self.shutdown)

    # ------------------------------------------------------------------ public API

    def generate(
        self, problems: list[Problem], n_samples: int, max_new_tokens: int, temperature: float, seed: int,
        top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
        in_flight: InFlight | None = None,
    ) -> Samples:
        """`n_samples` completions per problem, sampled from softmax(logits / temperature) truncated to the
        top_k tokens (0: all) and the top_p nucleus (1.0: all), with every sampled token's log-prob under that
        same distribution (vLLM's processed log-probs; with temperature 1 and no truncation, the raw ones).
        A problem's `prompt_ids` are used as they are (else vLLM tokenises `prompt`). Generation ends at the
        end-of-sequence token, a token of `stop_token_ids` or a string of `stop`; the completion's tokens keep
        what ended it (the policy sampled it), its text stops before a stop string.
        Sample.prompt_index = problem index. `in_flight`: a `sync` to its version made while this call runs is
        loaded between two decode steps (rollout/in_flight.py); each sample then carries its tokens' versions."""
        if n_samples < 1 or max_new_tokens < 1:
            raise ValueError("n_samples and max_new_tokens must be >= 1")
        prompts, params = generate_requests(problems, n_samples, max_new_tokens, temperature, seed, top_p, top_k,
                                            stop, stop_token_ids)
        if not prompts:
            return Samples()
        slot = None
        if in_flight is not None:  # opened by open_in_flight, or here
            slot = self._slot if self._slot is not None and self._slot.switch == in_flight else WeightSlot(in_flight)
            self._slot = slot
        try:
            with self._lock:
                first_version = None
                if slot is None:
                    outputs = self._call("generate", lambda llm: llm.generate(prompts, params, use_tqdm=False))
                else:
                    outputs, first_version = self._call(
                        "generate", lambda llm: self._generate_in_flight(llm, prompts, params, slot))
                routing = routing_capture.request_records(self._routing_records(), n_samples)
        finally:
            if slot is not None:
                slot.close()
                if self._slot is slot:
                    self._slot = None
        # One decode of the whole completion (vLLM's incremental detokenizer holds back a trailing partial
        # UTF-8 sequence); special tokens such as EOS are dropped.
        tokenizer = self._llm.get_tokenizer()
        items = []
        for i, out in enumerate(outputs):
            if len(out.outputs) != n_samples:
                raise EngineError(f"vLLM returned {len(out.outputs)} completions for {n_samples} samples")
            prompt_ids = list(out.prompt_token_ids)
            experts = [routing.get((out.request_id, c.index)) for c in out.outputs]
            if self._routing_shape is not None:
                if any(e is None for e in experts):
                    raise EngineError(f"no routing was recorded for a sample of request {out.request_id}")
                routing_capture.fill_shared_prefix(experts, len(prompt_ids))
            for c, routed in zip(out.outputs, experts):  # in sample order
                ids = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise EngineError(f"vLLM returned {len(c.logprobs or [])} log-probs for {len(ids)} tokens")
                text = tokenizer.decode(ids, skip_special_tokens=True)
                if isinstance(c.stop_reason, str) and c.stop_reason in text:
                    text = text[:text.index(c.stop_reason)]
                items.append(Sample(
                    prompt_index=i, task_id=problems[i].task_id, prompt_ids=list(prompt_ids),
                    completion_ids=ids, logprobs=[_token_logprob(e, t) for e, t in zip(c.logprobs, ids)],
                    text=text, answer=problems[i].answer, finish_reason=str(c.finish_reason or ""),
                    routed_experts=routed, versions=None if in_flight is None else token_versions(
                        c.weight_versions, len(ids), first_version),
                ))
        return Samples(items)

    def score_sequences(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Teacher-forced raw log-prob of each completion token given its prompt and the tokens before it."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        from vllm import SamplingParams, TokensPrompt

        todo = [k for k, c in enumerate(completion_ids) if c]
        result: list[list[float]] = [[] for _ in prompt_ids]
        if not todo:
            return result
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(prompt_ids[k]) + list(completion_ids[k])) for k in todo]
        with self._lock:
            outputs = self._call("score_sequences", lambda llm: llm.generate(prompts, params, use_tqdm=False))
            self._routing_records()  # not wanted here: dropped
        for k, out in zip(todo, outputs):
            start, comp = len(prompt_ids[k]), completion_ids[k]
            entries = out.prompt_logprobs[start:start + len(comp)]
            result[k] = [_token_logprob(e, t) for e, t in zip(entries, comp)]
        return result

    def sync(self, manifest: Manifest, mode: SyncMode = "reload", restart_if_layout_differs: bool = False) -> dict:
        """Load a published iteration: `restart` stops the engine process and starts a new one on it,
        `reload` loads the weights into the running engine. The files are verified first; on any failure the
        engine keeps serving the previous verified weights and SyncError names the problem. A reload of
        tensors other than the served ones (names, dtypes, shapes) is refused, or, with
        `restart_if_layout_differs` (the first load after starting on a base checkpoint stored otherwise),
        done as a restart."""
        if mode not in ("restart", "reload"):
            raise ValueError(f"sync mode must be 'restart' or 'reload', got {mode!r}")
        # A generate that takes these weights in flight is open (open_in_flight) or running: handed to it (the
        # first check); or it opens while this sync waits for the engine (the checks while waiting)
        offered = False
        while True:
            slot = self._slot
            if not offered and slot is not None and mode == "reload" and manifest.iteration == slot.switch.to_version:
                offered = True
                if (taken := self._offer(slot, manifest)) is not None:
                    return taken
            if self._lock.acquire(timeout=0.05):
                break
        try:
            return self._sync_locked(manifest, mode, restart_if_layout_differs)
        finally:
            self._lock.release()

    def _sync_locked(self, manifest: Manifest, mode: SyncMode, restart_if_layout_differs: bool) -> dict:
        if self._closed:
            raise EngineError("engine was shut down")
        t0 = time.monotonic()
        try:
            path, layout, nbytes = self._verified(manifest)
            # In-place loading needs the same tensors; a failed reload_weights also breaks vLLM's later
            # reloads, so catch a mismatch before the engine sees it.
            if mode == "reload" and (why := layout_difference(layout, self._layout)):
                if not restart_if_layout_differs:
                    raise CheckpointError(f"cannot be loaded in place: {why}")
                log.info("%s iteration %d is stored otherwise than the served weights (%s): restarting on it",
                         manifest.run, manifest.iteration, why)
                mode = "restart"
        except CheckpointError as e:
            raise SyncError(f"refused {manifest.run} iteration {manifest.iteration}: {e}; "
                            f"still serving {self._checkpoint_dir}") from None
        t1 = time.monotonic()
        if mode == "reload":
            self._reload(path, manifest.iteration)
        else:
            self._restart_on(path, manifest.iteration)
        t2 = time.monotonic()
        self._serve(manifest, path, layout)
        return {"mode": mode, "iteration": manifest.iteration, "bytes": nbytes,
                "verify_s": t1 - t0, "load_s": t2 - t1, "seconds": t2 - t0}

    def _offer(self, slot: WeightSlot, manifest: Manifest) -> dict | None:
        """A sync to the version a running generate takes in flight: verified here (while the engine generates),
        loaded by the engine thread between two decode steps. None: the call did not take it (it ended first, or
        the weights cannot be loaded in place), and the sync loads it as usual once the call is done."""
        t0 = time.monotonic()
        try:
            path, layout, nbytes = self._verified(manifest)
        except CheckpointError as e:
            slot.release()  # nothing will come: the generate goes on without waiting for it
            raise SyncError(f"refused {manifest.run} iteration {manifest.iteration}: {e}; "
                            f"still serving {self._checkpoint_dir}") from None
        if layout_difference(layout, self._layout):  # a restart, which cannot happen between two steps
            slot.release()
            return None
        t1 = time.monotonic()
        load_s = slot.offer(Offered(manifest.iteration, path, manifest, layout), self.cfg.engine_call_timeout_s)
        if load_s is None:
            return None
        return {"mode": "in_flight", "iteration": manifest.iteration, "bytes": nbytes, "verify_s": t1 - t0,
                "load_s": load_s, "seconds": time.monotonic() - t0}

    def open_in_flight(self, switch: InFlight) -> None:
        """Ready the generate call about to be made with `switch`: a sync to its version made from now on is
        handed to that call (loaded at its step), also if the call has not reached the engine yet."""
        self._slot = WeightSlot(switch)

    def release_in_flight(self) -> None:
        """A generate waiting for in-flight weights goes on without them (the run is stopping)."""
        if (slot := self._slot) is not None:
            slot.release()

    def _serve(self, manifest: Manifest, path: Path, layout: dict) -> None:
        """The engine serves `manifest`'s weights, loaded from `path`: the latest verified ones, to which a
        restart goes back."""
        old_scratch = self._scratch
        self._scratch = path if path != Path(manifest.directory) else None
        self._checkpoint_dir, self._iteration, self._layout = path, manifest.iteration, layout
        if old_scratch is not None and old_scratch != path:
            shutil.rmtree(old_scratch, ignore_errors=True)

    def process(self) -> tuple[str, int]:
        """(Ray node id, pid) of this actor's own process, so that whoever kills the actor can wait for it."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def engine_pid(self) -> int:
        """The process that runs the engine core: this actor's own with an inline engine."""
        if self._llm is None:
            raise EngineError("engine is not running")
        return self._engine_pid()

    def info(self) -> dict:
        """State for callers and tests; answers without waiting for a running call (no lock)."""
        llm = self._llm
        return {
            "checkpoint_dir": str(self._checkpoint_dir),
            "iteration": self._iteration,
            "engine_pid": self._engine_pid() if llm is not None else None,
            "starts": self._starts,
            "engine_deaths": self._deaths,
            "last_start_s": self.last_start_s,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size if llm is not None else None,
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len if llm is not None else None,
            "unfinished_requests": llm.llm_engine.get_num_unfinished_requests() if llm is not None else 0,
        }

    def shutdown(self, process_ends: bool = False) -> None:
        """Stop the engine process and remove what it left in shared memory. Idempotent. `process_ends`: the
        caller ends this process next (RolloutGroup ends the actor), so an inline engine with no process of its
        own skips vLLM's in-process teardown, whose garbage collections over the whole heap took 2-3 s here."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._teardown(process_ends)
            self._engine_executor.shutdown(wait=False)
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)

    # ------------------------------------------------------------------ engine lifecycle

    def _claim_engine_thread(self) -> None:
        self._engine_thread = threading.current_thread()

    def _configure_env(self) -> None:
        configure_env(self.cfg)

    def _llm_kwargs(self, path: Path) -> dict:
        return {**llm_kwargs(self.cfg, self.dtype, self.seed, self.deterministic), **model_llm_kwargs(self.cfg, path)}

    @staticmethod
    def _verified(manifest: Manifest) -> tuple[Path, dict, int]:
        """The HF directory to load for a published iteration once its files check out, its tensor layout and
        its size in bytes; CheckpointError names what is wrong."""
        nbytes = verify_manifest(manifest)
        path = engine_checkpoint_dir(manifest, f"engine-whole-{os.getpid()}")
        return path, tensor_layout(path), nbytes

    @_on_engine_thread
    def _start(self, path: Path) -> None:
        with gc_paused():
            self._start_llm(path)

    def _start_llm(self, path: Path) -> None:
        from vllm import LLM

        freeze_heap()
        t0 = time.monotonic()
        base_tmp = Path(tempfile.gettempdir())  # also pins this process's own tempdir before TMPDIR changes
        self._starts += 1
        sweep_private_dirs(base_tmp / "tide-rollout")
        private = base_tmp / "tide-rollout" / f"{os.getpid()}-{self._starts}"
        private.mkdir(parents=True, exist_ok=True)
        # vLLM's ZMQ sockets between this actor and a separate engine core (uuid-named files that vLLM never
        # removes, 3 per start, also after a clean shutdown) go into a directory of this process: emptied when an
        # engine stops, removed at shutdown or, after a kill, by the next engine's sweep. One path for the
        # process's life, not the start's private directory: vLLM caches its environment once an engine ran here.
        # A user's own VLLM_RPC_BASE_PATH is kept.
        rpc = base_tmp / "tide-rollout" / f"{os.getpid()}-rpc"
        if os.environ.setdefault("VLLM_RPC_BASE_PATH", str(rpc)) == str(rpc):
            rpc.mkdir(exist_ok=True)
            self._rpc_dir = rpc
        old_tmp, old_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
        # Engine processes inherit TMPDIR: their torch file stores land in a directory we can remove whole. This
        # process's own temporary directory is cached by `tempfile` (pinned above): the rendezvous file of an
        # executor created here (vLLM's `vllm_dist_<uuid>`, which nothing removes) goes there unless it moves too.
        os.environ["TMPDIR"] = tempfile.tempdir = str(private)
        ours = set(process_tree(os.getpid())) if self._inline else set()  # to tell the engine's workers apart
        if self._inline and self.cfg.tp == 1:
            # vLLM sets a CPU worker's OpenMP threads through the environment of the worker process it spawns;
            # an inline model runs on this thread, whose OpenMP runtime has long read the actor's environment
            # (Ray's OMP_NUM_THREADS=1). torch._C's setter: vLLM replaces torch.set_num_threads with a no-op.
            import torch

            torch._C.set_num_threads(len(bound_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"))))
        routing_kwargs, routing_env = routing_capture_setup(self.cfg, path)
        for name, value in routing_env.items():
            os.environ.setdefault(name, value)
        try:
            llm = LLM(str(path), **self._llm_kwargs(path), **routing_kwargs)
        except Exception as e:
            remove_segments(set(), private)
            raise EngineError(f"vLLM failed to start on {path}: {type(e).__name__}: {e}") from e
        finally:
            tempfile.tempdir = old_tempdir
            if old_tmp is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = old_tmp
        self._llm, self._private_tmp = llm, private
        if self._inline:  # the engine's own processes: TP workers (none with tp=1)
            self._pids = [p for p in process_tree(os.getpid()) if p not in ours]
        else:
            proc = self._engine_proc()
            self._pids = process_tree(proc.pid)
            client = llm.llm_engine.engine_core
            self._watch = DeathWatch(proc.sentinel, lambda: _wake_client(client))
        self._segments = engine_segments(self._pids)
        self._routing_shape = self._record_routing(llm) if routing_kwargs else None
        # What start-up left on the heap (vLLM, torch, transformers) stays alive for the engine's life; left to
        # the collector, each full collection walks it: 0.4 s, every dozen rollouts of the quickstart.
        freeze_heap()
        self.last_start_s = time.monotonic() - t0
        log.info("vLLM engine pid %d on %s started in %.1f s", self._engine_pid(), path, self.last_start_s)

    def _record_routing(self, llm: Any) -> tuple[int, int] | None:
        """Start recording the experts a mixture-of-experts model routes each token to (`record_routing`; the
        engine loaded through routing_capture_setup's arguments): (hidden layers, top_k)."""
        shape = llm.collective_rpc("tide_record_routing")[0]
        return None if shape is None else tuple(shape)

    @_on_engine_thread
    def _routing_records(self) -> dict:
        if self._routing_shape is None or self._llm is None:
            return {}
        return routing_capture.from_wire(self._llm.collective_rpc("tide_drain_routing")[0])

    def _engine_pid(self) -> int:
        return os.getpid() if self._inline else self._engine_proc().pid

    def _engine_proc(self):
        return self._llm.llm_engine.engine_core.resources.engine_manager.processes[0]

    def _alive(self) -> bool:
        llm = self._llm
        if llm is not None and self._inline:  # a TP worker process that died fails the executor
            return not getattr(llm.llm_engine.engine_core.engine_core.model_executor, "is_failed", False)
        if llm is None or self._watch is None or self._watch.dead.is_set():
            return False
        return not llm.llm_engine.engine_core.resources.engine_dead and self._engine_proc().is_alive()

    @_on_engine_thread
    def _teardown(self, process_ends: bool = False) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._watch is not None:
            self._watch.expected = True
        pids = {q for p in self._pids for q in process_tree(p)}
        self._segments |= engine_segments(list(pids))
        tracked = set(self._pids) | pids
        # An inline engine with no process of its own whose process ends next (shutdown's process_ends): its
        # model, KV cache and single-process distributed groups go with the process; vLLM's teardown of them
        # (collections over the whole heap) is skipped
        ends_with_process = process_ends and self._inline and not tracked
        if not ends_with_process:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # a dead engine may fail half-way through its own shutdown
                log.warning("engine shutdown raised %s: %s", type(e).__name__, e)
        del llm
        gc.unfreeze()  # the engine's start-up heap, frozen in _start, can go now
        if self._inline and not ends_with_process:
            # vLLM's own teardown of an engine in this process (distributed groups, then a collection), so
            # that a restart can set up a new one here
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        # vLLM kills the engine core; its workers follow on their own. Wait for them (bounded), then make sure.
        for pid in wait_gone(list(tracked), timeout_s=10):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        remove_segments(self._segments, self._private_tmp)
        if self._rpc_dir is not None:  # the stopped engine's sockets; the next start makes its own
            remove_segments(set(), self._rpc_dir)
        self._segments, self._pids, self._private_tmp, self._watch = set(), [], None, None

    @_on_engine_thread
    def _call(self, what: str, fn: Callable[[Any], _T]) -> _T:
        """Run fn(llm); if the engine process dies (before or during the call), start a new one on the latest
        verified weights and retry, at most cfg.max_engine_restarts times."""
        if self._closed:
            raise EngineError("engine was shut down")
        restarts, last_error = 0, None
        while True:
            if not self._alive():
                if restarts >= self.cfg.max_engine_restarts:
                    raise EngineError(
                        f"{what}: the vLLM engine process died {restarts + 1} times during one call "
                        f"(max_engine_restarts={self.cfg.max_engine_restarts}); last error: {last_error!r}"
                    )
                restarts += 1
                self._deaths += 1
                log.warning("%s: engine process is dead, restarting on %s (attempt %d)", what,
                            self._checkpoint_dir, restarts)
                self._teardown()
                self._start(self._checkpoint_dir)
            try:
                return fn(self._llm)
            except Exception as e:
                if self._alive():
                    raise
                last_error = e

    def _reload(self, path: Path, iteration: int) -> None:
        if not self._alive():
            self._restart_on(path, iteration)
            return
        self._sync_step(f"reload of iteration {iteration} from {path}", lambda: self._load_in_place(path))

    @_on_engine_thread
    def _load_in_place(self, path: Path) -> None:
        llm = self._llm
        llm.collective_rpc("reload_weights", timeout=self.cfg.engine_start_timeout_s,
                           kwargs={"weights_path": str(path)})
        # Without this, prompts longer than one KV block reuse KV computed with the old weights.
        if not llm.reset_prefix_cache():
            raise EngineError("reset_prefix_cache refused (requests still running)")

    @_on_engine_thread
    def _generate_in_flight(self, llm: Any, prompts: list, params: list, slot: WeightSlot) -> tuple[list, int]:
        """LLM.generate's loop, one engine step at a time, taking `switch.to_version`'s weights between two
        steps when a sync offers them (at `switch.at_step`, waiting for them). The outputs in request order and
        the version that sampled the first tokens; vLLM labels every token with the version set when it was
        sampled (its weight-version spans)."""
        engine = llm.llm_engine
        core = getattr(engine.engine_core, "engine_core", None)  # the in-process EngineCore (engine_process inline)
        if core is None or core.batch_queue is not None:
            raise EngineError("in-flight weight updates need engine_process inline without vLLM's batch queue "
                              "(async scheduling or pipeline parallelism): a step must end before the weights change")
        switch = slot.switch
        first = self._iteration if self._iteration is not None else switch.from_version
        engine.set_weight_version(str(first))
        pending = first < switch.to_version  # an engine started again on the new weights has nothing to take
        if not pending:
            slot.close()
        request_ids = llm.enqueue(prompts, params, use_tqdm=False)
        outputs, step = [], 0
        try:
            while engine.has_unfinished_requests():
                # at_step: at that step exactly (waiting for the weights); else whenever they are offered
                due = pending and (switch.at_step is None or step >= switch.at_step)
                if due:
                    offered = slot.take(wait=switch.at_step is not None)
                    if offered is not None:
                        self._switch_weights(llm, slot, offered)
                    if offered is not None or switch.at_step is not None:  # taken, or released: no more waiting
                        slot.close()
                        pending = False
                outputs += [out for out in engine.step() if out.finished]
                step += 1
        except BaseException:
            if self._llm is llm and self._alive():  # nothing of this call is left for the next one
                engine.abort_request(request_ids, internal=True)  # enqueue's ids are vLLM's internal ones
            raise
        finally:
            slot.close()
        return sorted(outputs, key=lambda out: int(out.request_id)), first

    def _switch_weights(self, llm: Any, slot: WeightSlot, offered: Offered) -> None:
        """Load the offered weights between two steps and recompute the running requests' KV under them (they
        are preempted and prefilled again, their tokens kept); from the next step on, tokens are labelled with
        the new version. A failed load fails the generate as well, after the engine went back to the previous
        weights (a sync's failure: SyncError to the sync's caller)."""
        t0 = time.monotonic()
        try:
            llm.collective_rpc("reload_weights", timeout=self.cfg.engine_start_timeout_s,
                               kwargs={"weights_path": str(offered.path)})
            if not llm.reset_prefix_cache(reset_running_requests=True):
                raise EngineError("reset_prefix_cache refused with the running requests reset")
        except Exception as e:
            error = SyncError(f"in-flight reload of iteration {offered.version} from {offered.path} failed "
                              f"({type(e).__name__}: {e}); still serving {self._checkpoint_dir}")
            slot.loaded(error)
            self._recover()
            raise EngineError(f"generate: {error}") from None
        llm.llm_engine.set_weight_version(str(offered.version))
        self._serve(offered.manifest, offered.path, offered.layout)
        slot.loaded(time.monotonic() - t0)

    def _restart_on(self, path: Path, iteration: int) -> None:
        self._teardown()
        self._sync_step(f"restart on iteration {iteration} from {path}", lambda: self._start(path))

    def _sync_step(self, what: str, step: Callable[[], None]) -> None:
        """Run the loading step of a sync; if it fails, go back to the latest verified weights and raise
        SyncError naming what failed."""
        try:
            step()
        except Exception as e:
            detail = f"{type(e).__name__}: {e}"
            self._recover()
            raise SyncError(f"{what} failed ({detail}); still serving {self._checkpoint_dir}") from None

    def _recover(self) -> None:
        """Back to the latest verified weights after a failed sync (the engine may hold partial weights)."""
        if self._alive():
            try:
                self._load_in_place(self._checkpoint_dir)
                return
            except Exception as e:
                log.warning("reloading the previous weights failed (%s); restarting the engine", e)
        self._teardown()
        self._start(self._checkpoint_dir)


def _wake_client(client: Any) -> None:
    """Fail whatever the client is blocked on, so the caller sees the engine's death instead of hanging."""
    from vllm.v1.engine.exceptions import EngineDeadError

    client.resources.engine_dead = True
    client.outputs_queue.put_nowait(EngineDeadError())
    for fut in list(getattr(client, "utility_results", {}).values()):
        if not fut.done():
            fut.set_exception(EngineDeadError())
