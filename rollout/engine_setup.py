"""How a rollout engine's vLLM is set up: the environment vLLM reads in the engine's process (and passes to the
processes it starts), the `LLM(...)` arguments the rollout config asks for, and the CPUs the engine's threads run
on. Pure functions of the config; vLLM is not imported here."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .config import EngineConfig
from .engine_proc import pin_threads

_PROJECT_ROOT = Path(__file__).resolve().parents[1]


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
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind(cfg.tp)
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
    if cfg.sleep_level:  # LLM.sleep / wake_up between rollouts (vLLM allocates through its cumem allocator then)
        kw["enable_sleep_mode"] = True
    return kw


def executor_backend(cfg: EngineConfig) -> str:
    """Where vLLM's model workers run: an inline engine with tp=1 runs its model in its own process ("uni":
    no worker process, no shared-memory queue polled between steps); otherwise one worker process per TP rank."""
    return "uni" if cfg.engine_process == "inline" and cfg.tp == 1 else "mp"


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


def threads_bind(tp: int) -> str:
    """One OpenMP core group per TP worker, e.g. '0|1' for tp=2 on two cores (the default 'auto' binding
    refuses to put two workers on one NUMA node)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        raise ValueError(f"tp={tp} needs at least {tp} CPUs, this process may use {len(cpus)}")
    per = len(cpus) // tp
    groups = [cpus[i * per:(i + 1) * per] for i in range(tp)]
    return "|".join(",".join(map(str, g)) for g in groups)
