"""One rollout engine's vLLM `LLM`, its processes and the thread it runs on.

`VllmEngine` starts an `LLM` on a Hugging Face directory (in a private temporary directory that its processes
inherit, with the threads bound as configured), knows which processes and shared-memory segments belong to it,
tells whether its engine core is alive, and tears it all down. Every call that touches the model runs on the
engine's own thread (`on_thread`). Which weights to start on, and what to do when the engine dies, is the
rollout engine's business (rollout/engine.py)."""
from __future__ import annotations

import gc
import logging
import os
import signal
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from . import routing_capture
from .config import EngineConfig
from .engine_errors import EngineError
from .engine_model import model_llm_kwargs, routing_capture_setup
from .engine_proc import (DeathWatch, engine_segments, freeze_heap, gc_paused, process_tree, remove_segments,
                          share_gloo_device, sweep_private_dirs, wait_gone)
from .engine_setup import bound_cpus, configure_env, llm_kwargs
from .lora_serving import lora_llm_kwargs

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class VllmEngine:
    """A vLLM `LLM` started and stopped on demand, one at a time: `llm` is None while none runs."""

    def __init__(self, cfg: EngineConfig, dtype: str, seed: int, deterministic: bool) -> None:
        """Sets the environment vLLM reads (engine_setup.configure_env); `start` starts the engine."""
        self.cfg = cfg
        self.inline = cfg.engine_process == "inline"
        self.dtype, self.seed, self.deterministic = dtype, seed, deterministic
        self.llm: Any = None  # the running `LLM`; None while stopped
        self._watch: DeathWatch | None = None
        self._pids: list[int] = []
        self._segments: set[str] = set()
        self._private_tmp: Path | None = None
        self.starts = 0
        self.last_start_s = 0.0
        self._rpc_dir: Path | None = None  # where vLLM's ZMQ sockets of this process's engines are (_start_llm)
        self.routing_shape: tuple[int, int] | None = None  # (layers, top_k) while routing is recorded
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(1, "vllm-engine", initializer=self._claim_thread)
        configure_env(cfg)
        if self.inline:  # vLLM's process groups are made in this process
            share_gloo_device()

    def on_thread(self, fn: Callable[..., _T], *args, **kwargs) -> _T:
        """fn(*args, **kwargs) on the engine's own thread. An inline engine runs the model on the thread that calls
        it, and OpenMP keeps its thread count per calling thread: the count `start` sets holds on this thread only,
        while the actor's calls arrive on any of its threads (elsewhere: Ray's OMP_NUM_THREADS=1)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        try:
            done = self._executor.submit(fn, *args, **kwargs)
        except RuntimeError:  # the interpreter is exiting (atexit's shutdown): no new work on that thread
            return fn(*args, **kwargs)
        return done.result()

    def _claim_thread(self) -> None:
        self._thread = threading.current_thread()

    def start(self, path: Path) -> None:
        """Start an engine on the Hugging Face directory `path`; EngineError when vLLM fails to."""
        self.on_thread(self._start, path)

    def _start(self, path: Path) -> None:
        with gc_paused():
            self._start_llm(path)

    def _start_llm(self, path: Path) -> None:
        from vllm import LLM

        freeze_heap()
        t0 = time.monotonic()
        base_tmp = Path(tempfile.gettempdir())  # also pins this process's own tempdir before TMPDIR changes
        self.starts += 1
        sweep_private_dirs(base_tmp / "tide-rollout")
        private = base_tmp / "tide-rollout" / f"{os.getpid()}-{self.starts}"
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
        ours = set(process_tree(os.getpid())) if self.inline else set()  # to tell the engine's workers apart
        if self.inline and self.cfg.tp == 1:
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
        self.llm, self._private_tmp = llm, private
        if self.inline:  # the engine's own processes: TP workers (none with tp=1)
            self._pids = [p for p in process_tree(os.getpid()) if p not in ours]
        else:
            proc = self._engine_proc()
            self._pids = process_tree(proc.pid)
            client = llm.llm_engine.engine_core
            self._watch = DeathWatch(proc.sentinel, lambda: _wake_client(client))
        self._segments = engine_segments(self._pids)
        self.routing_shape = self._record_routing(llm) if routing_kwargs else None
        # What start-up left on the heap (vLLM, torch, transformers) stays alive for the engine's life; left to
        # the collector, each full collection walks it: 0.4 s, every dozen rollouts of the quickstart.
        freeze_heap()
        self.last_start_s = time.monotonic() - t0
        log.info("vLLM engine pid %d on %s started in %.1f s", self.pid(), path, self.last_start_s)

    def _record_routing(self, llm: Any) -> tuple[int, int] | None:
        """Start recording the experts a mixture-of-experts model routes each token to (`record_routing`; the
        engine loaded through routing_capture_setup's arguments): (hidden layers, top_k)."""
        shape = llm.collective_rpc("tide_record_routing")[0]
        return None if shape is None else tuple(shape)

    def routing_records(self) -> dict:
        """The routing recorded since the last call, by vLLM's request id (routing_capture.from_wire); empty when
        none is recorded."""
        return self.on_thread(self._routing_records)

    def _routing_records(self) -> dict:
        if self.routing_shape is None or self.llm is None:
            return {}
        return routing_capture.from_wire(self.llm.collective_rpc("tide_drain_routing")[0])

    def pid(self) -> int:
        """The process that runs the engine core: this one with an inline engine."""
        return os.getpid() if self.inline else self._engine_proc().pid

    def _engine_proc(self):
        return self.llm.llm_engine.engine_core.resources.engine_manager.processes[0]

    def alive(self) -> bool:
        """Whether the engine runs and its engine core (and, inline, its TP workers) is alive."""
        llm = self.llm
        if llm is not None and self.inline:  # a TP worker process that died fails the executor
            return not getattr(llm.llm_engine.engine_core.engine_core.model_executor, "is_failed", False)
        if llm is None or self._watch is None or self._watch.dead.is_set():
            return False
        return not llm.llm_engine.engine_core.resources.engine_dead and self._engine_proc().is_alive()

    def teardown(self, process_ends: bool = False) -> None:
        """Stop the engine and its processes and remove what they left in shared memory (nothing when stopped).
        `process_ends`: this process ends next."""
        self.on_thread(self._teardown, process_ends)

    def _teardown(self, process_ends: bool = False) -> None:
        llm, self.llm = self.llm, None
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
        ends_with_process = process_ends and self.inline and not tracked
        if not ends_with_process:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as e:  # a dead engine may fail half-way through its own shutdown
                log.warning("engine shutdown raised %s: %s", type(e).__name__, e)
        del llm
        gc.unfreeze()  # the engine's start-up heap, frozen in _start, can go now
        if self.inline and not ends_with_process:
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

    def load_in_place(self, path: Path) -> None:
        """Load the weights of `path` into the running engine (the same tensors as those it serves)."""
        self.on_thread(self._load_in_place, path)

    def _load_in_place(self, path: Path) -> None:
        llm = self.llm
        llm.collective_rpc("reload_weights", timeout=self.cfg.engine_start_timeout_s,
                           kwargs={"weights_path": str(path)})
        # Without this, prompts longer than one KV block reuse KV computed with the old weights.
        if not llm.reset_prefix_cache():
            raise EngineError("reset_prefix_cache refused (requests still running)")

    def _llm_kwargs(self, path: Path) -> dict:
        return {**llm_kwargs(self.cfg, self.dtype, self.seed, self.deterministic), **model_llm_kwargs(self.cfg, path),
                **lora_llm_kwargs(self.cfg.lora, self.cfg.device)}

    def close(self) -> None:
        """No more work on the engine's thread (after the last `teardown`)."""
        self._executor.shutdown(wait=False)


def _wake_client(client: Any) -> None:
    """Fail whatever the client is blocked on, so the caller sees the engine's death instead of hanging."""
    from vllm.v1.engine.exceptions import EngineDeadError

    client.resources.engine_dead = True
    client.outputs_queue.put_nowait(EngineDeadError())
    for fut in list(getattr(client, "utility_results", {}).values()):
        if not fut.done():
            fut.set_exception(EngineDeadError())
